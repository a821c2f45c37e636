"""Cluster configs (YAML), shipped as package data: ``pd.deploy``/local.yaml is the embedded default."""

if __name__ == "deploy":  # the checkout root is on sys.path: hand the import to the real package (docs/design.md)
    from pd.util.shadowing import defer_to_installed

    defer_to_installed(__name__, __file__)
