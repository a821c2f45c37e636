import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engines import start_engine, wait_ready  # noqa: E402

# The session PD engines' bootstrap and waiting timeouts (s): short, so the tests of the timeout paths run in
# seconds; long enough that a KV wait queued behind a few dozen prefills on a loaded 2-core machine ends in time.
PD_TIMEOUT = "10"
# s: a failure answered within this did not wait out a PD timeout (the tests of "fails at once, not at the timeout").
AT_ONCE = float(PD_TIMEOUT) - 2


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("pdserve-cache"))
    os.environ["PDSERVE_CACHE"] = cache
    from pd.engines.models.builtin_model import resolve_model_path

    resolve_model_path("builtin:tiny")
    return cache


@pytest.fixture(scope="session")
def engines(model_cache, tmp_path_factory):
    """One null, one prefill and one decode reference engine (builtin:tiny), shared by the session."""
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    timeouts = ("--disaggregation-bootstrap-timeout", PD_TIMEOUT, "--disaggregation-waiting-timeout", PD_TIMEOUT)
    started = {
        "null": start_engine("null", logs),
        "prefill": start_engine("prefill", logs, *timeouts),
        "decode": start_engine("decode", logs, *timeouts),
    }
    try:
        wait_ready(list(started.values()))
        yield started
    finally:
        for e in started.values():
            e.stop()


# The speculative flags every speculative test engine runs with (3 draft tokens, a chain).
SPEC_FLAGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4")


@pytest.fixture(scope="session")
def spec_engines(model_cache, tmp_path_factory):
    """A speculative null engine and a speculative prefill + decode pair (builtin:tiny with its built-in draft),
    shared by the session."""
    from pd.engines.spec.draft_model import resolve_draft_path

    resolve_draft_path("builtin:tiny", None)  # written once here, not by three engines at once
    logs = str(tmp_path_factory.mktemp("spec-engine-logs"))
    timeouts = ("--disaggregation-bootstrap-timeout", PD_TIMEOUT, "--disaggregation-waiting-timeout", PD_TIMEOUT)
    started = {
        "null": start_engine("null", logs, *SPEC_FLAGS),
        "prefill": start_engine("prefill", logs, *SPEC_FLAGS, *timeouts),
        "decode": start_engine("decode", logs, *SPEC_FLAGS, *timeouts),
    }
    try:
        wait_ready(list(started.values()))
        yield started
    finally:
        for e in started.values():
            e.stop()



# Test tiers (pyproject's markers): `make test` runs everything on two xdist workers, `make test-fast` leaves out
# `cluster` and `slow`. The kernel modules' interpreter runs and ahead-of-time compiles are slow by rule; other slow
# tests carry the mark themselves.
KERNEL_MODULES = {"test_mxfp4_moe", "test_indexer", "test_sparse_mla_decode"}


def _compiles_or_interprets(item) -> bool:
    if item.module.__name__ not in KERNEL_MODULES:
        return False
    if "interp_results" in getattr(item, "fixturenames", ()) or "aot" in item.name:
        return True
    from triton_aot import AOT_REASON

    return any(m.kwargs.get("reason") == AOT_REASON for m in item.iter_markers("skipif"))


def _start_rank(item) -> int:
    """Longest groups first, so that no worker is left alone with a long one at the end: the cluster group
    (~7 min on an idle 2-core machine), then the kernel modules (2-4 min each), then the rest."""
    if item.get_closest_marker("cluster"):
        return 0
    return 1 if item.module.__name__ in KERNEL_MODULES else 2


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: each module keeps its order
    for item in items:
        if _compiles_or_interprets(item):
            item.add_marker(pytest.mark.slow)
        # xdist --dist loadgroup: a module's tests stay on one worker (its module and session fixtures start once
        # there); every `cluster` module shares one group, so Ray heads and namespaces never start side by side.
        group = "cluster" if item.get_closest_marker("cluster") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def no_leaked_threads():
    """The test leaves no thread behind: the count returns to what it was before (within 10 s)."""
    import threading

    from pd.util.wait import wait_until

    before = threading.active_count()
    yield
    wait_until(lambda: threading.active_count() == before, timeout=10, interval=0.02,
               what=f"thread count back to {before}")
