"""Import the pinned SGLang's serving benchmark (``sglang.benchmark.serving``, what ``python -m
sglang.bench_serving`` runs) on a machine without SGLang's GPU stack.

``pdserve bench`` uses its request functions (one per backend: TTFT, ITL, E2E and output length of each
request, streamed), its datasets (ShareGPT-format files, random ids), its metrics (``calculate_metrics``:
the field names of its JSON) and its goodput. Three of its module-level imports pull in SGLang's whole
runtime for nothing the benchmark needs, and fail on a CPU machine (torchvision, Hugging Face ``datasets``,
``dill``, model configs); they get stand-ins here, only when the real module is not loaded already:

- ``sglang.srt.disaggregation.utils``: imported for one constant, ``FAKE_BOOTSTRAP_HOST`` ("2.2.2.2", the
  bootstrap host of its ``--pd-separated`` mode, which pdserve does not use: the router stamps rooms);
- ``sglang.srt.utils.network``: the real file, loaded alone (its package ``__init__`` imports the runtime);
- ``sglang.benchmark.datasets.mmmu``: the MMMU dataset needs Hugging Face ``datasets``; the stand-in's
  ``MMMUDataset`` raises if used.

Its request functions read their sampling settings from a module global ``args`` (its parsed command
line); :func:`sglang_args` builds that namespace from SGLang's own parser, so every setting it reads has
SGLang's default unless pdserve's flags set it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import types

_FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang/srt/disaggregation/utils.py, the pinned release's value


def _stand_in(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _load_file_alone(name: str) -> None:
    """Load the module ``name`` from its file without importing its package's ``__init__``."""
    if name in sys.modules:
        return
    parent = importlib.util.find_spec("sglang.srt")
    path = f"{parent.submodule_search_locations[0]}/{name.split('.', 2)[2].replace('.', '/')}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise


class _MMMUDataset:
    """Stand-in for SGLang's MMMU dataset (needs Hugging Face ``datasets`` and a hub download)."""

    @classmethod
    def from_args(cls, args):
        raise ValueError("the mmmu dataset needs Hugging Face 'datasets' and a hub download; pdserve bench "
                         "supports --dataset-name random, random-ids and sharegpt (a local --dataset-path)")


@functools.cache
def serving() -> types.ModuleType:
    """The pinned ``sglang.benchmark.serving`` module, imported once.

    Raises:
        ImportError: SGLang (or one of its light dependencies: aiohttp, msgspec, orjson, requests, tqdm,
            transformers, pybase64, pillow, psutil, pyzmq) is not installed; the message says what to install.
    """
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("pdserve bench needs the pinned SGLang's benchmark code: pip install 'pdserve[bench]' "
                          "then pip install --no-deps sglang==0.5.23 (make install does both)")
    _stand_in("sglang.srt.disaggregation.utils", FAKE_BOOTSTRAP_HOST=_FAKE_BOOTSTRAP_HOST)
    _load_file_alone("sglang.srt.utils.network")
    _stand_in("sglang.benchmark.datasets.mmmu", MMMUDataset=_MMMUDataset)
    import sglang.benchmark.serving as mod

    return mod


class _Parsed(Exception):
    """Raised by the capturing parser in place of parsing: carries the parser SGLang built."""


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own ``bench_serving`` argument parser (built by its ``cli_main``, caught before it parses)."""
    mod = serving()

    class Capturing(argparse.ArgumentParser):
        def parse_args(self, args=None, namespace=None):
            raise _Parsed(self)

    real = mod.ArgumentParser
    mod.ArgumentParser = Capturing
    try:
        mod.cli_main()
    except _Parsed as caught:
        return caught.args[0]
    finally:
        mod.ArgumentParser = real
    raise RuntimeError("sglang.benchmark.serving.cli_main did not build its parser")


def sglang_args(**values) -> argparse.Namespace:
    """SGLang's parsed defaults with ``values`` (attribute names as SGLang's, e.g. ``disable_stream``) on top."""
    ns = argparse.ArgumentParser.parse_args(sglang_parser(), [])
    for key, value in values.items():
        if not hasattr(ns, key):
            raise AttributeError(f"sglang.benchmark.serving has no setting {key!r}")
        setattr(ns, key, value)
    return ns


if __name__ == "__main__":
    # `python -m pd.bench.sglang_serving ARGS`: SGLang's own `python -m sglang.bench_serving ARGS`, runnable here.
    serving().cli_main()
