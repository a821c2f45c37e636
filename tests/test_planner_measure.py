"""``pdserve profile`` against real reference engines (the session's null engine, and its prefill + decode pair
behind a router): the profile it writes loads, its numbers are the engines' own, and plan-split accepts it."""

from __future__ import annotations

import json

import pytest

from pd.planner.measure import main as profile_main
from pd.planner.profile import load_profile
from routers import pd_router


def builtin_kv_bytes_per_token() -> int:
    """K and V of every layer of builtin:tiny, float32 (the reference engine's default dtype)."""
    from pd.engines.models.builtin_model import TINY as c

    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def test_profile_measures_reference_engines(engines, tmp_path, capsys):
    router = pd_router(engines["prefill"].url, engines["prefill"].bootstrap_port, engines["decode"].url,
                       str(tmp_path))
    try:
        router.wait_ready()
        out = tmp_path / "profile.json"
        rc = profile_main(["--url", engines["null"].url, "--pd-url", router.url, "--prefill-url",
                           engines["prefill"].url, "--decode-url", engines["decode"].url, "--output", str(out),
                           "--prompt-lens", "16,256", "--prefill-batch-sizes", "1,2", "--decode-batch-sizes", "1,2",
                           "--decode-contexts", "16", "--decode-steps", "24", "--repeats", "1", "--host-cores", "2"])
    finally:
        router.stop()
    assert rc == 0, capsys.readouterr().err
    prof = load_profile(out)
    assert prof.engine == "reference" and prof.host.cores == 2
    # the engines' and router's process CPU beyond the profiled model work, per request and per output token
    assert prof.host.cpu_per_request_s > 0 and prof.host.cpu_per_token_s >= 0  # the router's
    assert "process_cpu_seconds_total" in prof.host.cpu_overhead_source
    e1 = prof.entry(1)
    assert e1.prefill.cpu_overhead_per_request_s >= 0 and e1.decode.cpu_overhead_per_token_s >= 0
    e = prof.entry(1)
    assert {(p.batch_size, p.input_len) for p in e.prefill.points} == {(1, 16), (1, 256), (2, 16), (2, 256)}
    assert e.prefill.max_batch_size == 1  # the reference engine runs one prompt at a time
    assert {(p.batch_size, p.context_len) for p in e.decode.points} == {(1, 28), (2, 28)}
    assert all(0 < p.seconds < 5 for p in e.prefill.points + e.decode.points)
    assert e.engine_args[0] == "--cpu-threads"
    # the bytes are the engine's KV layout, exactly: the transfer points moved prompt x bytes-per-token
    assert prof.kv_bytes_per_token == builtin_kv_bytes_per_token()
    kvb = builtin_kv_bytes_per_token()
    assert [p.bytes for p in e.transfer.points] == [16 * kvb, 256 * kvb]
    assert [p.input_len for p in e.decode.admit_points] == [16, 256]
    assert e.decode.max_kv_tokens > 0
    # a second run at another TP size joins the same file; the first entry stays
    rc = profile_main(["--url", engines["null"].url, "--tp-size", "2", "--output", str(out), "--prompt-lens", "16",
                       "--prefill-batch-sizes", "1", "--decode-batch-sizes", "1", "--decode-contexts", "16",
                       "--decode-steps", "4", "--repeats", "1", "--kv-bytes-per-token", "512",
                       "--transfer-bandwidth-gb-s", "2"])
    assert rc == 0, capsys.readouterr().err
    both = load_profile(out)
    assert both.tp_sizes() == [1, 2]
    assert both.entry(1).model_dump() == e.model_dump()
    assert json.loads(out.read_text())["tp"]["2"]["transfer"]["bandwidth_gb_s"] == 2


def test_profile_without_pd_needs_the_transfer_numbers(engines, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = profile_main(["--url", engines["null"].url, "--output", str(out), "--prompt-lens", "16",
                       "--prefill-batch-sizes", "1", "--decode-batch-sizes", "1", "--decode-contexts", "16",
                       "--decode-steps", "4", "--repeats", "1"])
    assert rc == 2 and "--kv-bytes-per-token and --transfer-bandwidth-gb-s" in capsys.readouterr().err
    assert not out.exists()


def test_a_decode_batch_whose_streams_never_overlap_is_sent_again():
    """A busy host can start one stream after another has finished; the window is then empty and the batch is
    sent again, not the point dropped at the first miss."""
    import asyncio

    from pd.planner.measure import Prober

    # per call: two streams of (time, tokens); the first call's streams do not overlap, the second's do
    calls = [[[(0.0, 1), (0.1, 2), (0.2, 3)], [(0.3, 1), (0.4, 2), (0.5, 3)]],
             [[(0.0, 1), (0.1, 2), (0.2, 3), (0.3, 4)], [(0.05, 1), (0.15, 2), (0.25, 3), (0.35, 4)]]]
    sent = []

    class Scripted(Prober):
        async def stream(self, url, input_len, steps):
            sent.append(input_len)
            batch = calls[(len(sent) - 1) // 2]
            return batch[(len(sent) - 1) % 2]

    prober = Scripted(None, (1, 10))
    assert asyncio.run(prober.decode_iteration("http://x", 2, 16, 4)) == pytest.approx(0.1)
    assert len(sent) == 4  # the batch went out twice
    sent.clear()
    calls[:] = [calls[0]] * 3  # three tries, none overlapping: the point is given up
    assert asyncio.run(prober.decode_iteration("http://x", 2, 16, 4, attempts=3)) is None
    assert len(sent) == 6
