"""Import a module of pd.kernels from a benchmark script, installed or not.

`pip install -e .` maps pd.kernels to kernels/ (pyproject's package-dir). The device machine runs a bare copy
of the checkout with nothing installed, so there the kernels/ folder is loaded as the package ``pd_kernels``
(its relative imports then resolve inside it)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

_KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels")


def kernel_module(name: str) -> ModuleType:
    """``pd.kernels.<name>`` if pdserve is installed, else ``pd_kernels.<name>`` from this checkout's kernels/.

    Raises:
        ImportError: the module is in neither place, or importing it failed (its own error is chained).
    """
    try:
        return importlib.import_module(f"pd.kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("pd", "pd.kernels", f"pd.kernels.{name}"):
            raise  # the kernel module exists but one of its own imports is missing
    if "pd_kernels" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pd_kernels", os.path.join(_KERNELS_DIR, "__init__.py"),
                                                      submodule_search_locations=[_KERNELS_DIR])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["pd_kernels"] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"pd_kernels.{name}")
