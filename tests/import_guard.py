"""The shadowing guard: run in a process, it checks that this checkout's top-level folders stand in for no real
package, and that transformers builds a model (which imports Hugging Face's ``kernels`` in transformers >= 5).

Used in-process by pytest and as ``python tests/import_guard.py`` in the other kinds of process pdserve starts
(an engine's, a Ray job's); prints one JSON line and exits 1 on a failed check.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("kernels", "router", "monitoring", "deploy")


def _distribution_of(top_level: str) -> str | None:
    """The installed distribution that provides import package ``top_level``, if any."""
    return next(iter(importlib.metadata.packages_distributions().get(top_level, [])), None)


def check() -> dict:
    """Import each top-level folder's bare name and build a tiny transformers model.

    Returns:
        {"sys_path_has_root": bool, "modules": {name: origin or None}, "kernels_dist": str | None,
        "model": class name, "errors": [str]}; ``errors`` is empty when every check passed.
    """
    errors: list[str] = []
    root = os.path.realpath(ROOT)
    here = os.path.realpath(os.getcwd())
    on_path = [os.path.realpath(p or here) for p in sys.path if isinstance(p, str)]
    report: dict = {"sys_path_has_root": root in on_path, "modules": {}}
    for name in FOLDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            report["modules"][name] = None
            if e.name != name:
                errors.append(f"import {name} failed on a missing {e.name!r}")
            continue
        origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
        report["modules"][name] = origin
        parent = os.path.dirname(os.path.realpath(origin or ""))
        if origin is None or os.path.dirname(parent) == root:
            errors.append(f"import {name} resolved to this repository's folder {parent}")
    dist = _distribution_of("kernels")
    report["kernels_dist"] = dist
    if dist is not None:  # Hugging Face's package is installed: the bare import must be it
        kernels = sys.modules.get("kernels")
        if kernels is None or not hasattr(kernels, "get_kernel"):
            errors.append(f"'kernels' is installed ({dist}) but `import kernels` did not give it")
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig

        model = AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100))
        report["model"] = type(model).__name__
    except Exception as e:  # the failure under test: report it, don't crash the guard
        errors.append(f"building a transformers model failed: {type(e).__name__}: {e}")
    report["errors"] = errors
    return report


def assert_guard_passed(report: dict) -> None:
    """Assert a :func:`check` report shows a meaningful (checkout on sys.path) and passed check."""
    assert report["sys_path_has_root"], "the checkout root is not on sys.path: the check would prove nothing"
    assert report["errors"] == [], report
    assert report["model"] == "LlamaForCausalLM"
    if report["kernels_dist"] is not None:
        assert "site-packages" in report["modules"]["kernels"], report


def guard_report(log: str) -> dict:
    """The JSON report the guard printed in ``log``."""
    line = next((x for x in log.splitlines() if x.startswith("IMPORT_GUARD ")), None)
    assert line is not None, log[-3000:]
    return json.loads(line.removeprefix("IMPORT_GUARD "))


if __name__ == "__main__":
    result = check()
    print("IMPORT_GUARD " + json.dumps(result), flush=True)
    sys.exit(1 if result["errors"] else 0)
