"""Keep this checkout's top-level folders from standing in for real packages of the same name.

``kernels/``, ``router/``, ``monitoring/`` and ``deploy/`` are the sources of ``pd.kernels``, ``pd.router``,
``pd.monitoring`` and ``pd.deploy`` (pyproject's package-dir). Whenever the checkout's root is on ``sys.path``
-- Ray's ``--working-dir .`` upload, ``python -m`` or ``python -c`` from the root, ``python -m pytest`` -- a
plain ``import kernels`` would find the folder before site-packages. Hugging Face's ``kernels`` package is
imported that way by transformers >= 5 whenever it builds a model, and by SGLang, so the shadow kills engines.

Each of those folders' ``__init__.py`` calls :func:`defer_to_installed` when it is imported under its bare
name: the import is handed to the package the folder hides (searched on ``sys.path`` without the checkout's
root), or fails with the ``ModuleNotFoundError`` Python would have raised without the checkout.
docs/design.md ("Top-level folders never shadow a package") argues the choice.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

#: The checkout's top-level folders that are packages of ``pd`` (pyproject's ``[tool.setuptools.package-dir]``).
SHADOWING_FOLDERS = ("kernels", "router", "monitoring", "deploy")


def _real(path: str) -> str:
    return os.path.realpath(path or os.getcwd())  # "" on sys.path is the current directory


def _inside(path: str | None, folder: str) -> bool:
    return path is not None and (_real(path) + os.sep).startswith(folder + os.sep)


def defer_to_installed(name: str, init_file: str) -> None:
    """Replace the module being imported as ``name`` by the real package of that name, or fail as Python would.

    Called from the top of a shadowing folder's ``__init__.py`` when ``__name__`` is the bare folder name. Looks
    ``name`` up with every finder on ``sys.meta_path`` -- the path finder over ``sys.path`` minus the folder's
    parent (the checkout root) -- skips a spec of the folder itself, executes the real package and puts it in
    ``sys.modules[name]``, which the import system then returns (a module may replace itself there).

    Args:
        name: the bare module name being imported (``__name__`` of the caller), e.g. ``"kernels"``.
        init_file: the caller's ``__file__``: ``<root>/<name>/__init__.py``.

    Raises:
        ModuleNotFoundError: no package ``name`` is installed outside the checkout (``e.name == name``).
        Exception: whatever the real package raises while it is executed (``sys.modules`` is left without it).
    """
    folder = _real(os.path.dirname(os.path.abspath(init_file)))
    root = os.path.dirname(folder)
    search = [p for p in sys.path if isinstance(p, str) and _real(p) != root]
    spec = None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        path_finder = finder is importlib.machinery.PathFinder
        candidate = find(name, search) if path_finder else find(name, None)
        if candidate is None or _inside(candidate.origin, folder):
            continue
        if any(_inside(p, folder) for p in candidate.submodule_search_locations or ()):
            continue
        spec = candidate
        break
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if spec.loader is not None:  # None: a namespace package, nothing to execute
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise

