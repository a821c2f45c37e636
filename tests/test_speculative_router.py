"""The router needs no speculation-specific code: router tests whose assertions hold for any engine that produces
the target's greedy tokens run here with a router over a speculative prefill + decode pair (the reference is still
the null engine without speculation)."""

import pytest

from routers import pd_router
from test_router import (  # noqa: F401  (collected here, against the fixtures below)
    test_client_disconnect_mid_stream_aborts_decode,
    test_concurrent_requests_round_trip,
    test_concurrent_streams_abort_no_room,
    test_every_generation_route_runs_pd,
    test_generate_batch_of_33_in_input_order,
    test_long_streams_arrive_whole,
    test_short_and_stopped_generations_equal_null,
)


@pytest.fixture(scope="module")
def engines(engines, spec_engines):
    """The session's null engine (no speculation) as the reference, the speculative pair behind the router."""
    return {"null": engines["null"], "prefill": spec_engines["prefill"], "decode": spec_engines["decode"]}


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    r = pd_router(engines["prefill"].url, engines["prefill"].bootstrap_port, engines["decode"].url,
                  str(tmp_path_factory.mktemp("spec-router-logs")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()
