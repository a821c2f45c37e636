"""Cluster configs (YAML), shipped as package data: ``pd.deploy``/local.yaml is the embedded default."""
