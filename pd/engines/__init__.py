"""Engines a pdserve worker can run: the reference engine (CPU, exact) and, later, SGLang."""
