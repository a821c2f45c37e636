"""pdserve's Triton kernels, their torch references and the SGLang plugin (import ``pd.kernels``; lives in
top-level ``kernels/``, mapped by pyproject's package-dir)."""

if __name__ == "kernels":  # the checkout root is on sys.path: hand the import to the real package (docs/design.md)
    from pd.util.shadowing import defer_to_installed

    defer_to_installed(__name__, __file__)
