"""The dependency locks (locks/README.md) against pyproject.toml, and the installed environment against the CPU lock.

A lock is a uv-compiled requirements file of exact pins whose header records the ``uv pip compile`` command; each
test reads the extras and the packages left out from that command, so an edit of pyproject that the lock no longer
meets (a raised bound, a new dependency) fails here until ``make lock`` runs, and a venv that drifted from the lock
fails until ``make install`` runs. No network: pyproject, the lock files and importlib.metadata only.
"""

from __future__ import annotations

import shlex
import tomllib
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"

# The extras each lock covers (Makefile `lock`): the CPU lock is what `make install` installs; the GPU lock is only
# resolved here (GPU nodes install it).
EXTRAS = {"cpu": {"cpu", "dev", "monitoring", "bench"}, "gpu": {"gpu", "monitoring", "bench"}}
# The target both locks are resolved for, as environment markers see it.
TARGET = dict(default_environment(), python_version="3.11", python_full_version="3.11.0", sys_platform="linux",
              platform_system="Linux", platform_machine="x86_64", os_name="posix",
              implementation_name="cpython", platform_python_implementation="CPython")
# `make install` takes torch from $(TORCH), never from the CPU lock, and so never its CUDA-only wheels.
CUDA_PREFIXES = ("nvidia-", "cuda-")


class Lock:
    """One lock file: its pins (canonical name -> version string), the uv command of its header, and every line that
    is not a plain ``name==version`` pin or repeats a name."""

    def __init__(self, name: str):
        self.path = LOCKS / f"{name}.txt"
        self.pins: dict[str, str] = {}
        self.bad: list[str] = []
        self.duplicates: list[str] = []
        self.command: list[str] = []
        lines = self.path.read_text().splitlines()
        for i, line in enumerate(lines):
            text = line.strip()
            if text.startswith("#") and text[1:].strip().startswith("uv pip compile") and not self.command:
                self.command = shlex.split(text[1:])
            if not text or text.startswith("#"):
                continue
            try:
                req = Requirement(text)
            except InvalidRequirement:
                self.bad.append(f"line {i + 1}: {text}")
                continue
            specs = list(req.specifier)
            if (req.url or req.extras or req.marker or len(specs) != 1 or specs[0].operator != "=="
                    or "*" in specs[0].version):
                self.bad.append(f"line {i + 1}: {text}")
                continue
            key = canonicalize_name(req.name)
            if key in self.pins:
                self.duplicates.append(key)
            self.pins[key] = specs[0].version

    def option(self, flag: str) -> set[str]:
        """Every value of ``flag`` (``--extra``, ``--no-emit-package``) in the header's command."""
        return {self.command[i + 1] for i, a in enumerate(self.command[:-1]) if a == flag}


@lru_cache(maxsize=None)
def lock(name: str) -> Lock:
    return Lock(name)


def pyproject_requirements(extras: set[str]) -> list[tuple[str, Requirement]]:
    """``(where, requirement)`` for pyproject's dependencies and those of ``extras``, pdserve's own extras that an
    extra names (``pdserve[engine,cluster]``) expanded, markers evaluated for the locks' target."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    out = [("dependencies", r) for r in map(Requirement, project["dependencies"])
           if r.marker is None or r.marker.evaluate(dict(TARGET, extra=""))]
    pending, seen = sorted(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        assert extra in optional, f"pyproject.toml has no extra {extra!r}"
        for text in optional[extra]:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(dict(TARGET, extra=extra)):
                continue
            if canonicalize_name(req.name) == own:
                pending.extend(req.extras)
            else:
                out.append((f"extra {extra!r}", req))
    return out


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_lock_is_exact_pins_for_the_target(name):
    """Only ``name==version`` lines, each name once, compiled by uv for CPython 3.11 on Linux x86_64 with the
    extras this test checks."""
    lk = lock(name)
    assert lk.pins, f"{lk.path} pins nothing"
    assert not lk.bad, f"{lk.path}: not an exact pin: {lk.bad}"
    assert not lk.duplicates, f"{lk.path}: pinned more than once: {lk.duplicates}"
    cmd = lk.command
    assert cmd[:4] == ["uv", "pip", "compile", "pyproject.toml"], f"{lk.path}: header names no uv command: {cmd}"
    assert cmd[cmd.index("--python-version") + 1] == "3.11", cmd
    assert cmd[cmd.index("--python-platform") + 1].startswith("x86_64-manylinux_"), cmd
    assert lk.option("--extra") == EXTRAS[name], f"{lk.path} was compiled for other extras: {cmd}"


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_lock_meets_pyproject(name):
    """Every package pyproject names for the lock's extras is pinned at a version pyproject admits (those left out of
    the output on purpose, torch in the CPU lock, are absent)."""
    lk = lock(name)
    left_out = {canonicalize_name(p) for p in lk.option("--no-emit-package")}
    problems = []
    for where, req in pyproject_requirements(EXTRAS[name]):
        key = canonicalize_name(req.name)
        if key in left_out:
            if key in lk.pins:
                problems.append(f"{key} is pinned, but the lock's command leaves it out")
        elif key not in lk.pins:
            problems.append(f"{req} ({where}) is not in the lock")
        elif not req.specifier.contains(Version(lk.pins[key]), prereleases=True):
            problems.append(f"{key}=={lk.pins[key]} does not meet {req} ({where})")
    assert not problems, f"{lk.path} is stale for pyproject.toml (run `make lock`):\n  " + "\n  ".join(problems)


def test_cpu_lock_has_no_torch_or_cuda_wheels():
    """torch comes from the Makefile's $(TORCH); a CPU machine never gets nvidia-* or cuda-* wheels from the lock."""
    found = [k for k in lock("cpu").pins if k == "torch" or k.startswith(CUDA_PREFIXES)]
    assert not found, f"locks/cpu.txt pins {found}"
    assert "torch" in lock("cpu").option("--no-emit-package")
    assert "triton" in lock("cpu").pins  # the dev extra's; the torch builds' own requirement is checked below


def test_gpu_lock_pins_the_pinned_sglang():
    """The GPU lock's sglang is pyproject's gpu-extra pin, as the launcher and `make install` read it."""
    from pd.commands.sglang import pinned_sglang_requirement

    assert f"sglang=={lock('gpu').pins.get('sglang')}" == pinned_sglang_requirement()


def test_installed_environment_is_the_cpu_lock():
    """Every package of the CPU lock is installed at its pinned version, and the installed torch (from $(TORCH))
    accepts the lock's pins of its own dependencies (triton among them)."""
    pins = lock("cpu").pins
    drift = []
    for key, pinned in sorted(pins.items()):
        try:
            installed = metadata.version(key)
        except metadata.PackageNotFoundError:
            drift.append(f"{key}=={pinned} is not installed")
            continue
        if Version(installed) != Version(pinned):
            drift.append(f"{key} is {installed}, the lock pins {pinned}")
    try:
        torch_requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        torch_requires = []
    for text in torch_requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(dict(default_environment(), extra="")):
            continue
        key = canonicalize_name(req.name)
        if key in pins and not req.specifier.contains(Version(pins[key]), prereleases=True):
            drift.append(f"torch {metadata.version('torch')} requires {req}, the lock pins {key}=={pins[key]}")
    assert not drift, "the environment is not locks/cpu.txt (run `make install`):\n  " + "\n  ".join(drift)
