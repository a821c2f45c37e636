"""The split controller's decisions (pd.planner.controller) and the live metrics it reads (pd.planner.live_metrics),
without a cluster: snapshots and Prometheus text made by hand, the clock a number."""

import math
import random
from dataclasses import replace

import pytest

from pd.planner.controller import ACTIONS, REASONS, Policy, Snapshot, SplitController
from pd.planner.live_metrics import ROUTER, MetricsWindow, attainment, reduce_text

POLICY = Policy(slo_attainment=0.9, min_requests=10, cooldown_secs=60, cooldown_restarts=3, hold_secs=20,
                hold_restarts=2, min_gain=0.1)
AT_ONCE = replace(POLICY, hold_secs=0, hold_restarts=0)  # no hysteresis: each decision's proposal shows


def snap(now, p=2, d=1, ttft=1.0, tpot=1.0, **kw):
    base = dict(requests=100, request_rate=5.0, mean_input_len=500, mean_output_len=50)
    return Snapshot(now=now, prefill=p, decode=d, ttft_attainment=ttft, tpot_attainment=tpot, **{**base, **kw})


def run(ctl, snaps):
    """Decide every snapshot in turn; the (time, action, reason) of each."""
    out = []
    for s in snaps:
        d = ctl.decide(s)
        assert d.action in ACTIONS and d.reason in REASONS
        out.append((s.now, d.action, d.reason))
    return out


def test_meeting_both_objectives_holds():
    ctl = SplitController(POLICY)
    assert {r for _, a, r in run(ctl, [snap(t) for t in range(0, 300, 10)])} == {"slo_met"}


def test_a_sustained_ttft_miss_moves_a_decode_only_after_the_hold_time():
    ctl = SplitController(POLICY)
    out = run(ctl, [snap(t, p=1, d=2, ttft=0.5) for t in range(0, 40, 10)])
    assert [a for _, a, _ in out] == ["hold", "hold", "move_to_prefill", "move_to_prefill"]
    assert [r for _, _, r in out[:2]] == ["hysteresis", "hysteresis"] and out[2][2] == "ttft_slo"
    assert ctl.decide(snap(40, p=1, d=2, ttft=0.5)).target == (2, 1)


def test_the_hold_and_cooldown_times_follow_the_measured_restart_time():
    ctl = SplitController(POLICY)
    out = run(ctl, [snap(t, p=1, d=2, ttft=0.5, restart_s=30) for t in range(0, 70, 10)])
    # hold = max(20 s, 2 x 30 s) = 60 s
    assert [a for _, a, _ in out] == ["hold"] * 6 + ["move_to_prefill"]
    ctl.moved(60)
    # cooldown = max(60 s, 3 x 30 s) = 90 s after the move; the miss persists throughout
    out = run(ctl, [snap(t, p=1, d=2, ttft=0.5, restart_s=30) for t in range(70, 170, 10)])
    firsts = [t for t, a, _ in out if a != "hold"]
    assert firsts and firsts[0] == 150, out
    assert {r for t, a, r in out if t < 150} <= {"hysteresis", "cooldown"}


def test_a_noisy_metric_never_moves_and_a_shift_moves_once_per_cooldown():
    """A TTFT attainment that dips far below the target every other interval, or two intervals of three, or jitters
    inside the dead band at random, never moves a worker; a real shift moves one after the hold time, and while the
    miss persists the next move waits out the cooldown."""
    ctl = SplitController(POLICY)
    every_other = [snap(t, p=3, d=2, ttft=0.5 if (t // 10) % 2 else 0.95) for t in range(0, 1000, 10)]
    two_of_three = [snap(t, p=3, d=2, tpot=0.5 if (t // 10) % 3 else 0.95) for t in range(1000, 2000, 10)]
    rng = random.Random(7)
    jitter = [snap(t, p=3, d=2, ttft=rng.uniform(0.86, 0.94), tpot=rng.uniform(0.86, 0.99))
              for t in range(2000, 4000, 10)]
    out = run(ctl, every_other + two_of_three + jitter)
    assert all(a == "hold" for _, a, _ in out)
    assert {r for _, _, r in out} == {"hysteresis", "slo_met"}
    shift = run(ctl, [snap(t, p=3, d=2, tpot=0.5) for t in range(4000, 4060, 10)])
    assert [(t, a) for t, a, _ in shift if a != "hold"][0] == (4020, "move_to_decode")  # the hold time: 20 s
    ctl.moved(4030)
    after = run(ctl, [snap(t, p=2, d=3, tpot=0.5) for t in range(4040, 4200, 10)])
    assert [t for t, a, _ in after if a != "hold"][0] == 4090  # cooldown: 60 s after the move ended
    assert {r for t, _, r in after if t < 4090} == {"hysteresis", "cooldown"}  # proposed again, then cooling
    # the floor: one prefill left
    out = run(ctl, [snap(t, p=1, d=4, tpot=0.5) for t in range(4300, 4400, 10)])
    assert {(a, r) for _, a, r in out} == {("hold", "min_split")}


def test_a_stage_under_its_own_target_keeps_its_workers():
    ctl = SplitController(POLICY)
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, tpot=0.88)).reason == "no_spare"
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, tpot=0.9)).reason == "hysteresis"


def test_never_below_one_of_each_and_a_free_gpu_is_used_first():
    ctl = SplitController(POLICY)
    out = run(ctl, [snap(t, p=1, d=1, tpot=0.4) for t in range(0, 60, 10)])
    assert {(a, r) for _, a, r in out} == {("hold", "min_split")}
    ctl = SplitController(POLICY)
    out = run(ctl, [snap(t, p=1, d=1, tpot=0.4, free_slots=1) for t in range(0, 60, 10)])
    assert out[-1][1:] == ("add_decode", "tpot_slo")
    assert ctl.decide(snap(60, p=1, d=1, tpot=0.4, free_slots=1)).target == (1, 2)


def test_where_the_wait_is_decides_which_stage_is_short():
    ctl = SplitController(AT_ONCE)
    # TTFT misses while requests wait at the decodes for KV pages: the decode stage is short
    d = ctl.decide(snap(0, p=2, d=2, ttft=0.5, prefill_queue=0, decode_queue=6))
    assert (d.reason, d.target) == ("decode_queue", (1, 3))
    # a full KV pool with requests waiting, TPOT fine
    assert ctl.decide(snap(0, p=2, d=2, kv_usage=0.97, decode_queue=2)).reason == "kv_full"
    assert ctl.decide(snap(0, p=2, d=2, kv_usage=0.97, decode_queue=0)).reason == "slo_met"
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, prefill_queue=4, decode_queue=1)).reason == "ttft_slo"
    # both short: toward the longer queue per replica; none: hold
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, tpot=0.5, prefill_queue=1, decode_queue=0)).target == (3, 1)
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, tpot=0.5)).reason == "overloaded"
    # queues even: toward the stage far further below its objective
    d = ctl.decide(snap(0, p=2, d=2, ttft=0.79, tpot=0.0))
    assert (d.action, d.reason, d.target) == ("move_to_decode", "shortfall", (1, 3))
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.1, tpot=0.7)).target == (3, 1)
    # TPOT missed and TTFT missed for the decodes' queue: the prefills can still give one up
    d = ctl.decide(snap(0, p=2, d=2, ttft=0.5, tpot=0.5, prefill_queue=0, decode_queue=6))
    assert (d.action, d.reason) == ("move_to_decode", "tpot_slo")
    assert ctl.decide(snap(0, p=2, d=2, ttft=0.5, requests=3)).reason == "idle"


def test_an_override_is_followed_at_once_one_worker_at_a_time():
    ctl = SplitController(AT_ONCE)
    ctl.moved(0)  # a cooldown would hold anything else
    d = ctl.decide(snap(1, p=3, d=1, override=(1, 3), requests=0))
    assert (d.action, d.reason, d.target) == ("move_to_decode", "override", (1, 3))
    assert ctl.decide(snap(2, p=3, d=1, override=(1, 3), moving=True)).reason == "moving"
    assert ctl.decide(snap(3, p=1, d=3, override=(1, 3), tpot=0.1)).action == "hold"
    assert ctl.decide(snap(3, p=1, d=3, override=(2, 3))).reason == "override_unreachable"
    d = ctl.decide(snap(3, p=1, d=3, override=(2, 3), free_slots=1))
    assert (d.action, d.target) == ("add_prefill", (2, 3))
    assert ctl.decide(snap(3, p=2, d=2, override=(1, 2))).reason == "override_unreachable"  # never removes one


def model(best):
    """A scorer that likes splits near ``best``."""
    return lambda s, split: 10.0 - abs(split[0] - best[0]) - abs(split[1] - best[1])


def test_the_model_picks_when_both_stages_are_short_and_vetoes_a_losing_move():
    ctl = SplitController(AT_ONCE, scorer=model((1, 3)))
    d = ctl.decide(snap(0, p=3, d=1, ttft=0.5, tpot=0.5, prefill_queue=9))
    assert (d.reason, d.target) == ("model", (1, 3)) and "1P3D 10" in d.detail
    ctl = SplitController(AT_ONCE, scorer=model((1, 3)))
    d = ctl.decide(snap(0, p=2, d=2, ttft=0.5, prefill_queue=3))  # measured: prefill short; model: 3P1D loses
    assert (d.action, d.reason) == ("hold", "model_disagrees")
    ctl = SplitController(AT_ONCE, scorer=model((3, 1)))
    d = ctl.decide(snap(0, p=2, d=2, ttft=0.5, prefill_queue=3))
    assert (d.action, d.reason) == ("move_to_prefill", "ttft_slo")


# ---- live metrics --------------------------------------------------------------------------------------------

def router_text(requests, ttft_counts, prompt=0, completion=0):
    """Router /metrics with ``requests`` answered and a TTFT histogram of cumulative ``ttft_counts`` {le: count}."""
    lines = [f'pdserve_router_requests_total{{endpoint="/generate",status="200"}} {requests}',
             f'pdserve_router_prompt_tokens_total{{endpoint="/generate"}} {prompt}',
             f'pdserve_router_completion_tokens_total{{endpoint="/generate"}} {completion}']
    for le, c in ttft_counts.items():
        lines.append(f'pdserve_router_ttft_seconds_bucket{{endpoint="/generate",le="{le}"}} {c}')
    return "# TYPE pdserve_router_requests_total counter\n# TYPE pdserve_router_prompt_tokens_total counter\n" \
           "# TYPE pdserve_router_completion_tokens_total counter\n# TYPE pdserve_router_ttft_seconds histogram\n" \
           + "\n".join(lines) + "\n"


def decode_text(tpot_counts, usage=0.0, prealloc=0):
    lines = ["# TYPE sglang:request_time_per_output_token_seconds histogram",
             *(f'sglang:request_time_per_output_token_seconds_bucket{{engine_type="decode",le="{le}"}} {c}'
               for le, c in tpot_counts.items()),
             "# TYPE sglang:token_usage gauge", f'sglang:token_usage{{engine_type="decode"}} {usage}',
             "# TYPE sglang:num_decode_prealloc_queue_reqs gauge",
             f'sglang:num_decode_prealloc_queue_reqs{{engine_type="decode"}} {prealloc}']
    return "\n".join(lines) + "\n"


def test_attainment_interpolates_inside_the_bucket_of_the_objective():
    inc = {("h", 0.1): 10.0, ("h", 0.4): 30.0, ("h", math.inf): 40.0}
    assert attainment(inc, "h", 0.25) == pytest.approx((10 + 0.5 * 20) / 40)
    assert attainment(inc, "h", 0.4) == pytest.approx(30 / 40)
    assert attainment(inc, "h", 5.0) == pytest.approx(30 / 40)  # past the last bound: unknown counts as a miss
    assert attainment({("h", math.inf): 0.0}, "h", 1) is None


def test_the_window_counts_increases_across_a_restart_and_builds_the_snapshot():
    w = MetricsWindow(window_s=60, slo_ttft_s=0.25, slo_tpot_s=0.05)
    w.add(0, ROUTER, reduce_text(router_text(100, {"0.1": 50, "0.4": 90, "+Inf": 100}, 1000, 100)))
    w.add(30, ROUTER, reduce_text(router_text(200, {"0.1": 100, "0.4": 180, "+Inf": 200}, 51000, 5100)))
    dec = "http://d:1"
    w.add(0, dec, reduce_text(decode_text({"0.02": 10, "0.06": 20, "+Inf": 20})))
    w.add(30, dec, reduce_text(decode_text({"0.02": 14, "0.06": 24, "+Inf": 30})))
    w.add(45, dec, reduce_text(decode_text({"0.02": 2, "0.06": 5, "+Inf": 10}, usage=0.5, prealloc=3)))  # restarted
    s = w.snapshot(45, {"http://p:1": "prefill", dec: "decode"}, free_slots=0)
    assert (s.prefill, s.decode, s.requests) == (1, 1, 100)
    assert s.request_rate == pytest.approx(100 / 30)
    assert (s.mean_input_len, s.mean_output_len) == (500, 50)
    assert s.ttft_attainment == pytest.approx((50 + 0.5 * 40) / 100)  # increases 50 under 0.1 s, 90 under 0.4
    # TPOT increases: 4 + 2 under 20 ms, 4 + 5 under 60 ms, 10 + 10 in all
    assert s.tpot_attainment == pytest.approx((6 + (9 - 6) * 0.75) / 20)
    assert (s.decode_queue, s.kv_usage) == (3, 0.5)
    w.add(200, ROUTER, reduce_text(router_text(200, {"0.1": 100, "0.4": 180, "+Inf": 200})))
    assert w.snapshot(200, {}).requests == 0  # the window moved past the traffic


# ---- the config's planner block --------------------------------------------------------------------------------

def test_the_planner_block_is_off_by_default_and_names_what_cannot_move():
    from pd.config import ConfigError, load_config, parse_config

    assert load_config().planner.mode == "off"
    ok = parse_config({"planner": {"mode": "act", "slo_ttft_ms": 250}})
    assert ok.planner.mode == "act" and ok.planner.slo_ttft_ms == 250
    bad = [({"planner": {"mode": "act"}, "prefill": {"tp_size": 2}}, "prefill.tp_size 2 and decode.tp_size 1 differ"),
           ({"planner": {"mode": "advise"}, "decode": {"placement": {"resources": {"decode_node": 1}}}},
            "prefill.placement and decode.placement differ"),
           ({"planner": {"mode": "sometimes"}}, "planner.mode: Input should be 'off', 'advise' or 'act'"),
           ({"planner": {"interval": 5}}, "planner.interval: unknown key"),
           ({"planner": {"slo_attainment": 1.5}}, "planner.slo_attainment: Input should be less than or equal to 1")]
    for data, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            parse_config(data)
    # off: any layout, as before
    assert parse_config({"planner": {"mode": "off"}, "prefill": {"tp_size": 2}}).prefill.tp_size == 2


def test_the_model_scores_splits_for_the_live_mix():
    """The planner's model (the embedded default's measured profile) for the window's workload: long prompts and
    short outputs favour 2P1D, short prompts and long outputs 1P2D; a steady workload is simulated once."""
    from pathlib import Path

    from pd.planner.live_model import ModelScorer
    from pd.planner.profile import load_profile
    from pd.planner.simulate import SLO

    profile = load_profile(Path(__file__).parent.parent / "benchmarks" / "results" / "plan_split_profile.json")
    scorer = ModelScorer(profile, 1, SLO(0.25, 0.035), 0.9)
    prefill_heavy = snap(0, p=2, d=1, request_rate=10, mean_input_len=1100, mean_output_len=6)
    decode_heavy = snap(0, p=2, d=1, request_rate=3, mean_input_len=96, mean_output_len=140)
    assert scorer(prefill_heavy, (2, 1)) > scorer(prefill_heavy, (1, 2)) * 1.1
    assert scorer(decode_heavy, (1, 2)) > scorer(decode_heavy, (2, 1)) * 1.1
    assert scorer(snap(0, request_rate=0), (1, 1)) == 0.0
    n = len(scorer._cache)
    scorer(replace(decode_heavy, request_rate=3.01, mean_output_len=141), (1, 2))  # rounds to the same workload
    assert len(scorer._cache) == n
    ctl = SplitController(AT_ONCE, scorer=scorer)
    d = ctl.decide(replace(decode_heavy, ttft_attainment=0.5, tpot_attainment=0.5))
    assert (d.action, d.reason, d.target) == ("move_to_decode", "model", (1, 2))
