"""Operator tools that read a config or logs and change nothing: plan, doctor (preflight), diagnose."""
