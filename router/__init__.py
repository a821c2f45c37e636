"""The pdserve PD router (import ``pd.router``; lives in top-level ``router/``, mapped by
pyproject's package-dir).

Build and run one from Python::

    from pd.router import RouterConfig, create_app, serve
    cfg = RouterConfig.from_urls(prefill=[("http://10.0.0.1:30000", 8998)], decode=["http://10.0.0.2:30000"], port=8000)
    serve(cfg)                 # blocking; or uvicorn.run(create_app(cfg), ...)

or from the command line: ``pdserve router --prefill URL [BOOTSTRAP_PORT] --decode URL --port N``.
"""

if __name__ == "router":  # the checkout root is on sys.path: hand the import to the real package (docs/design.md)
    from pd.util.shadowing import defer_to_installed

    defer_to_installed(__name__, __file__)

_EXPORTS = {
    "RouterConfig": "pd.router.config",
    "PrefillWorkerConfig": "pd.router.config",
    "create_app": "pd.router.app",
    "serve": "pd.router.cli",
    "serve_async": "pd.router.cli",
    "make_server": "pd.router.cli",
}


def __getattr__(name):
    # Lazy, so importing pd.router.config does not pull in FastAPI and uvicorn.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pd.router' has no attribute {name!r}")
