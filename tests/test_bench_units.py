"""pd.bench without a server: goodput on a hand-built trace (and against SGLang's own), the config and its
flags (named as the pinned SGLang's), lengths, arrivals, the stage split from exposition text, the PNG."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from pd.bench import BenchConfig, goodput, max_rate_meeting_attainment
from pd.bench.config import parse_rates, sglang_flags
from pd.bench.load import arrival_offsets

# (success, ttft_ms, e2e_ms, output_len): TPOT = (e2e - ttft) / (output_len - 1)
TRACE = [
    (True, 100, 1000, 10),   # TPOT 100        -> meets TTFT 200, misses TPOT 50
    (True, 150, 600, 10),    # TPOT 50         -> meets both (<= is a hit)
    (True, 300, 400, 5),     # TPOT 25         -> misses TTFT
    (True, 50, 50, 1),       # one token       -> no TPOT: meets both
    (False, 10, 20, 3),      # failed          -> never good, still in the denominator
    (True, 199, 289, 10),    # TPOT 10         -> meets both
]


def _records():
    return [{"success": ok, "ttft_ms": t, "tpot_ms": None if n == 1 else (e - t) / (n - 1)} for ok, t, e, n in TRACE]


def test_goodput_counts_a_request_iff_both_slos_hold():
    g = goodput(_records(), slo_ttft_ms=200, slo_tpot_ms=50, duration_s=2.0)
    assert g["num_requests"] == 6 and g["num_good"] == 3
    assert g["slo_attainment"] == pytest.approx(3 / 6)
    assert g["request_goodput"] == pytest.approx(3 / 2.0)
    assert g["slo_attainment_by_metric"] == {"ttft": pytest.approx(4 / 6), "tpot": pytest.approx(4 / 6)}
    assert g["goodput_slos_ms"] == {"ttft": 200, "tpot": 50}
    # one SLO only: TTFT alone admits the TPOT-100 request too
    assert goodput(_records(), 200, None)["num_good"] == 4
    assert goodput(_records(), 200, None)["request_goodput"] is None
    assert goodput([], 200, 50)["slo_attainment"] == 0.0


def test_goodput_agrees_with_sglangs_on_request_outputs():
    from pd.bench.sglang_serving import serving

    mod = serving()
    from sglang.benchmark.goodput import calculate_goodput

    outs = []
    for ok, t, e, n in TRACE:
        o = mod.RequestFuncOutput(success=ok, ttft=t / 1000, latency=e / 1000, output_len=n)
        outs.append(o)
    ours = goodput(outs, 200, 50, 2.0)
    theirs = calculate_goodput(outputs=outs, goodput_slos={"ttft": 200, "tpot": 50}, dur_s=2.0)
    assert ours["num_good"] == 3
    assert ours["request_goodput"] == pytest.approx(theirs.request_goodput)
    assert ours["slo_attainment"] == pytest.approx(theirs.slo_attainment)
    assert ours["slo_attainment_by_metric"] == pytest.approx(theirs.slo_attainment_by_metric)


def test_goodput_rejects_bad_slos_and_records():
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        goodput(_records(), 0, 50)
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        goodput(_records(), 100, math.nan)
    with pytest.raises(TypeError, match="ttft_ms"):
        goodput([object()], 100, 50)


def test_sweep_goodput_is_the_highest_rate_meeting_the_target():
    assert max_rate_meeting_attainment([1, 2, 4, 8], [1.0, 0.95, 0.89, 0.5]) == 2
    assert max_rate_meeting_attainment([1, 2, 4], [0.9, 0.5, 0.91], target=0.9) == 4
    assert max_rate_meeting_attainment([1, 2], [0.5, 0.4]) is None
    with pytest.raises(ValueError):
        max_rate_meeting_attainment([1], [0.5, 0.6])


def test_request_rates_parse_lists_and_inf():
    assert parse_rates("1,2,4") == (1.0, 2.0, 4.0)
    assert parse_rates("inf") == (math.inf,)
    assert parse_rates(3) == (3.0,)
    for bad in ("0", "-1", "x", "1,,2", "nan"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)


def test_config_errors_name_the_flag():
    for kwargs, flag in [({"num_prompts": 0}, "--num-prompts"), ({"random_range_ratio": 2}, "--random-range-ratio"),
                         ({"random_input_dist": "zipf"}, "--random-input-dist"), ({"backend": "x"}, "--backend"),
                         ({"slo_ttft_ms": -1}, "--slo-ttft-ms"), ({"extra_request_body": "[1]"},
                                                                 "--extra-request-body"),
                         ({"random_shared_prefix_ratio": 1.0}, "--random-shared-prefix-ratio")]:
        with pytest.raises(ValueError, match=flag):
            BenchConfig(**kwargs)
    cfg = BenchConfig(request_rate="1,2", base_url="http://h:1/")
    assert cfg.request_rate == (1.0, 2.0) and cfg.url == "http://h:1"
    assert cfg.to_dict()["request_rate"] == [1.0, 2.0]


def test_flags_named_as_sglangs_exist_in_the_pinned_sglang_parser():
    from pd.bench.sglang_serving import sglang_parser

    theirs = {o for a in sglang_parser()._actions for o in a.option_strings}
    ours = sglang_flags()
    assert len(ours) >= 25
    assert not [f for f in ours if f not in theirs]


@pytest.mark.parametrize("argv, needle", [
    (["--request-rate", "0"], "--request-rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--dataset-name", "mmmu"], "--dataset-name"),
    (["--max-concurrency", "two"], "--max-concurrency"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv, needle):
    p = subprocess.run([sys.executable, "-m", "pd.cli", "bench", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "usage: pdserve bench" in p.stderr


def test_lengths_follow_their_distribution():
    from pd.bench.datasets import lengths

    rng = np.random.default_rng(0)
    assert lengths("fixed", 7, 3, 0.0, 1.0, rng) == [7, 7, 7]
    np.random.seed(0)
    uni = lengths("uniform", 100, 2000, 0.5, 1.0, rng)
    assert min(uni) >= 50 and max(uni) <= 100 and abs(np.mean(uni) - 75) < 2
    logn = lengths("lognormal", 200, 20000, 0.0, 1.0, rng)
    assert min(logn) >= 1 and max(logn) <= 3200
    assert abs(np.mean(logn) - 200) < 10              # the mean is the flag's length
    assert np.median(logn) == pytest.approx(200 * math.exp(-0.5), rel=0.05)  # median exp(mu) = len e^(-s^2/2)


def test_random_prompts_have_their_lengths_and_shared_prefix():
    from pd.bench.datasets import random_requests
    from pd.bench.run import load_tokenizer

    tok = load_tokenizer("builtin:tiny")
    cfg = BenchConfig(dataset_name="random", num_prompts=6, random_input_len=40, random_output_len=5,
                      random_input_dist="fixed", random_output_dist="fixed", random_shared_prefix_ratio=0.5,
                      random_shared_prefix_groups=2)
    rows = random_requests(cfg, tok)
    specials = tok.num_special_tokens_to_add()
    for r in rows:  # text prompts: the server's tokenizer sees the intended length
        assert r.output_len == 5
        assert len(tok.encode(r.prompt)) == 40 == r.prompt_len + specials
    assert rows[0].prompt[:20] == rows[2].prompt[:20] != rows[1].prompt[:20]
    assert rows[0].prompt[20:] != rows[2].prompt[20:]
    ids = random_requests(BenchConfig(dataset_name="random", num_prompts=2, random_input_len=9,
                                      random_input_dist="fixed", tokenize_prompt=True), tok)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 9 for r in ids)


def test_arrivals_poisson_and_constant():
    rng = np.random.default_rng(1)
    assert arrival_offsets(4, 2.0, "constant", rng) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, math.inf, "poisson", rng) == [0.0, 0.0, 0.0]
    pois = arrival_offsets(5001, 10.0, "poisson", rng)
    gaps = np.diff(pois)
    assert pois[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.1) < 0.005 and abs(gaps.std() - 0.1) < 0.01  # exponential: std = mean
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, "bursty", rng)


ROUTER_TEXT = """# TYPE pdserve_router_queue_seconds histogram
pdserve_router_queue_seconds_bucket{endpoint="/generate",le="+Inf"} %(n)d
pdserve_router_queue_seconds_sum{endpoint="/generate"} %(q)f
pdserve_router_queue_seconds_count{endpoint="/generate"} %(n)d
pdserve_router_queue_seconds_bucket{endpoint="/v1/completions",le="+Inf"} 1
pdserve_router_queue_seconds_sum{endpoint="/v1/completions"} 1.0
pdserve_router_queue_seconds_count{endpoint="/v1/completions"} 1
# TYPE pdserve_router_e2e_seconds histogram
pdserve_router_e2e_seconds_bucket{endpoint="/generate",le="+Inf"} %(n)d
pdserve_router_e2e_seconds_sum{endpoint="/generate"} %(e)f
pdserve_router_e2e_seconds_count{endpoint="/generate"} %(n)d
"""
ENGINE_TEXT = """# TYPE sglang:per_stage_req_latency_seconds histogram
sglang:per_stage_req_latency_seconds_bucket{engine_type="prefill",stage="prefill_forward",le="+Inf"} %(n)d
sglang:per_stage_req_latency_seconds_sum{engine_type="prefill",stage="prefill_forward"} %(p)f
sglang:per_stage_req_latency_seconds_count{engine_type="prefill",stage="prefill_forward"} %(n)d
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{is_streaming="true",le="+Inf"} %(n)d
sglang:e2e_request_latency_seconds_sum{is_streaming="true"} %(e)f
sglang:e2e_request_latency_seconds_count{is_streaming="true"} %(n)d
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="+Inf"} %(n)d
sglang:time_to_first_token_seconds_sum{is_streaming="true"} %(t)f
sglang:time_to_first_token_seconds_count{is_streaming="true"} %(n)d
"""


def test_stage_breakdown_is_the_mean_of_the_histogram_deltas():
    from pd.bench.stages import Snapshot, Targets, breakdown, histogram_totals

    def snap(n, q, e, p, de, dt):
        eng = histogram_totals(ENGINE_TEXT % {"n": n, "p": p, "e": de, "t": dt})
        return Snapshot(router=histogram_totals(ROUTER_TEXT % {"n": n, "q": q, "e": e}),
                        engines={"prefill": eng, "decode": eng}, missing=[])

    targets = Targets(router="http://r", workers={"prefill": ["http://p"], "decode": ["http://d"]})
    # 10 requests between the snapshots: queue 0.02 s, e2e 3 s, prefill 0.5 s, decode e2e 4 s - ttft 1 s in total
    out = breakdown(snap(5, 0.01, 2.0, 0.3, 3.0, 1.0), snap(15, 0.03, 5.0, 0.8, 7.0, 2.0), targets)
    ms = out["mean_ms"]
    assert out["requests"] == 10 and out["counts"]["router_queue"] == 10
    assert ms["router_queue"] == pytest.approx(2.0)   # the /v1/completions series is unchanged: no effect
    assert ms["router_e2e"] == pytest.approx(300.0)
    assert ms["prefill"] == pytest.approx(50.0)
    assert ms["decode"] == pytest.approx(300.0)        # ((7 - 3) - (2 - 1)) / 10 s
    assert ms["kv_transfer"] is None and out["counts"]["kv_transfer"] == 0
    assert out["note"] is None


def test_stage_metric_names_are_exported_by_the_router_and_the_engines():
    """The names pd.bench.stages reads are the ones the router and the reference engine export."""
    from pathlib import Path

    from pd.bench import stages

    root = Path(__file__).resolve().parent.parent
    router_src = (root / "router" / "metrics.py").read_text()
    engine_src = (root / "pd" / "engines" / "metrics.py").read_text()
    for name in stages.ROUTER_HISTOGRAMS.values():
        assert name.removeprefix("pdserve_router_").removesuffix("_seconds") in router_src, name
    for name in (stages.STAGE_HISTOGRAM, stages.E2E_HISTOGRAM, stages.TTFT_HISTOGRAM):
        assert f'"{name}"' in engine_src, name
    from pd.engines.metrics import STAGES

    assert {label for _, label in stages.ENGINE_STAGES.values()} <= set(STAGES)


def test_png_has_cdfs_and_goodput_panels(tmp_path):
    from pd.bench.plots import write_png

    runs, cols = [], []
    for rate, scale in ((1.0, 1.0), (4.0, 2.0)):
        runs.append({"request_rate": rate, "request_throughput": rate * 0.9, "request_goodput": rate * 0.8,
                     "slo_attainment": 0.95 / scale, "max_concurrency": None})
        cols.append({"successes": [True] * 3 + [False], "ttfts": [0.1 * scale, 0.2, 0.3, 0],
                     "e2e_latencies": [1.0, 2.0, 3.0, 0], "output_lens": [10, 10, 1, 0],
                     "itls": [[0.1] * 9, [0.2] * 9, [], []]})
    path = tmp_path / "b.png"
    write_png(str(path), runs, cols, slo_ttft_ms=150, slo_tpot_ms=120)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


def test_a_server_that_is_not_there_is_a_clear_error():
    from pd.util.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    p = subprocess.run([sys.executable, "-m", "pd.cli", "bench", "--base-url", url, "--ready-check-timeout-sec", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert f"{url}/v1/models did not answer 200" in p.stderr and "Traceback" not in p.stderr
