import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engines import start_engine, wait_ready  # noqa: E402

# Small PD timeouts so the timeout paths are testable in seconds.
PD_TIMEOUT = "4"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("pdserve-cache"))
    os.environ["PDSERVE_CACHE"] = cache
    from pd.engines.builtin_model import resolve_model_path

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
