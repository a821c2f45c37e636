"""Nothing of ours shadows a real package: in pytest itself and in a process started as the launcher starts an
engine, ``import kernels`` is Hugging Face's (when installed), our other top-level folders resolve to nothing of
this checkout, and transformers builds a model. The Ray-job kind of process is checked in test_cluster.py."""

import os
import subprocess
import sys

import pytest

import import_guard
from engines import ROOT
from import_guard import assert_guard_passed, guard_report
from pd.commands.reference import reference_command
from pd.config import load_config


def test_pytest_process(monkeypatch):
    # python -m pytest from the root puts the root on sys.path; make sure of it however pytest was started
    monkeypatch.setattr(sys, "path", [ROOT, *sys.path])
    for name in import_guard.FOLDERS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert_guard_passed(import_guard.check())


def test_engine_process(tmp_path):
    """The guard under the reference engine's interpreter, environment and working directory (the launcher starts
    engines with ``python -m`` from the Ray working dir, which puts the checkout first on sys.path)."""
    cmd = reference_command(load_config(None), "prefill", "127.0.0.1", 30000, 8998)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **cmd.env)
    guard = os.path.join("tests", "import_guard.py")
    out = subprocess.run([cmd.argv[0], "-c", f"import runpy; runpy.run_path({guard!r}, run_name='__main__')"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_guard_passed(guard_report(out.stdout))


@pytest.mark.parametrize("name", import_guard.FOLDERS)
def test_a_missing_package_fails_as_python_would(name, monkeypatch, tmp_path):
    """With nothing of that name installed, the bare import raises ModuleNotFoundError naming it, not our folder."""
    monkeypatch.setattr(sys, "path", [ROOT, str(tmp_path)])  # only the checkout and an empty dir to search
    monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ModuleNotFoundError) as e:
        __import__(name)
    assert e.value.name == name
    assert name not in sys.modules


def test_the_real_package_is_found_beside_the_checkout(monkeypatch, tmp_path):
    """A package named like a folder of ours, later on sys.path, is what the bare import gives."""
    real = tmp_path / "router"
    real.mkdir()
    (real / "__init__.py").write_text("WHO = 'the real router'\n")
    monkeypatch.setattr(sys, "path", [ROOT, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "router", raising=False)
    import router

    assert router.WHO == "the real router"
    assert sys.modules["router"] is router
    from pd.router import RouterConfig  # ours is untouched under its own name

    assert RouterConfig.__module__ == "pd.router.config"
