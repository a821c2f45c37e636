"""The P:D planner without engines: profile loading and validation, the cost models, the PD simulator on cases
with a known answer, and ``pdserve plan-split``'s table and written config."""

from __future__ import annotations

import json
import math

import pytest

from pd.config import load_config
from pd.planner.cli import main as plan_split
from pd.planner.profile import Curve, ProfileError, Surface, load_profile, parse_profile
from pd.planner.search import candidate_splits, rank_splits
from pd.planner.simulate import SLO, Split, max_goodput_rate, simulate
from pd.planner.workload import Request, Workload


def profile_dict(prefill_s=0.010, step_s=0.001, admit_s=0.0, transfer_gb_s=1e6, latency_s=0.0, host=None,
                 prefill_batch=1, tokens_per_step=1.0, extra_tp=None) -> dict:
    """A profile with constant costs: prefill ``prefill_s`` per prompt (serial batches), a decode iteration of
    ``step_s`` x batch size, KV at ``transfer_gb_s`` after ``latency_s``."""
    entry = {
        "prefill": {"points": [{"batch_size": 1, "input_len": 10, "seconds": prefill_s},
                               {"batch_size": 2, "input_len": 10, "seconds": 2 * prefill_s}],
                    "max_batch_size": prefill_batch, "source": "test"},
        "decode": {"points": [{"batch_size": 1, "context_len": 10, "seconds": step_s},
                              {"batch_size": 64, "context_len": 10, "seconds": 64 * step_s}],
                   "admit_points": [{"input_len": 10, "seconds": admit_s}] if admit_s else [],
                   "tokens_per_step": tokens_per_step, "source": "test"},
        "transfer": {"bandwidth_gb_s": transfer_gb_s, "latency_s": latency_s, "source": "test"},
    }
    d = {"schema": "pdserve-profile/1", "name": "test", "model": "builtin:tiny", "engine": "reference",
         "kv_bytes_per_token": 1000, "kv_bytes_per_token_source": "test", "tp": {"1": entry, **(extra_tp or {})}}
    if host:
        d["host"] = host
    return d


def fixed(rate, n, input_len=10, output_len=1, arrival="poisson", seed=0) -> Workload:
    return Workload(rate, n, input_len, output_len, random_range_ratio=1.0, arrival_process=arrival, seed=seed)


# ---- cost models ------------------------------------------------------------------------------------------------

def test_curve_interpolates_holds_below_and_extrapolates_above():
    c = Curve([(10, 1.0), (20, 3.0), (10, 1.0)])
    assert c(5) == 1.0 and c(10) == 1.0 and c(15) == 2.0 and c(30) == 5.0
    assert Curve([(10, 4.0), (20, 2.0)])(40) == 2.0  # a falling last segment never extrapolates downwards


def test_surface_across_batch_sizes():
    s = Surface([(1, 10, 1.0), (1, 20, 2.0), (4, 10, 4.0), (4, 20, 8.0)])
    assert s(1, 15) == 1.5 and s(4, 15) == 6.0
    assert s(2, 10) == pytest.approx(2.0)  # linear between the measured batch sizes
    assert s(8, 10) == pytest.approx(8.0)  # past the largest: the last two curves' line
    assert Surface([(2, 10, 1.0)])(6, 10) == pytest.approx(3.0)  # one batch size: proportional


# ---- profile loading --------------------------------------------------------------------------------------------

def test_profile_round_trips(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(profile_dict()))
    prof = load_profile(p)
    assert prof.tp_sizes() == [1]
    assert prof.entry(1).prefill.seconds(1, 10) == 0.010
    assert parse_profile(prof.dump()).dump() == prof.dump()


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["tp"]["1"]["prefill"]["points"][1].update(seconds=-1), "tp.1.prefill.points[1].seconds"),
    (lambda d: d["tp"]["1"]["decode"].update(points=[]), "tp.1.decode.points"),
    (lambda d: d["tp"]["1"]["decode"].update(max_batch=4), "tp.1.decode.max_batch: unknown key"),
    (lambda d: d["tp"]["1"]["prefill"].pop("source"), "tp.1.prefill.source"),
    (lambda d: d.pop("kv_bytes_per_token"), "kv_bytes_per_token"),
    (lambda d: d["tp"]["1"]["transfer"].update(points=[{"bytes": 10, "seconds": 1}]), "tp.1.transfer"),
    (lambda d: d["tp"].update({"two": d["tp"]["1"]}), "tp: key 'two' must be a TP size"),
    (lambda d: d["tp"]["1"].pop("transfer"), "tp.1.transfer: missing"),
    (lambda d: d.update(engine="vllm"), "engine"),
])
def test_profile_errors_name_the_field(tmp_path, edit, field):
    d = profile_dict()
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert f"{p}: {field}" in str(e.value)


def test_profile_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",\n "tp": }')
    with pytest.raises(ProfileError, match=r"invalid JSON: line 2, column 8"):
        load_profile(bad)
    with pytest.raises(ProfileError, match=r"no entry for TP size 4 \(profiled: \[1\]\)"):
        parse_profile(profile_dict()).entry(4)


# ---- simulator: hand-checkable cases ---------------------------------------------------------------------------

@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_prefill_queue_wait(rho):
    """Poisson arrivals into one prefill of constant service S: the M/D/1 mean wait rho S / (2 (1 - rho))."""
    S = 0.010
    res = simulate(parse_profile(profile_dict(prefill_s=S)), Split(1, 1, 1, 1), fixed(rho / S, 40000))
    wait = sum(r.prefill_start_s - r.request.arrival_s for r in res.requests) / len(res.requests)
    assert wait == pytest.approx(rho * S / (2 * (1 - rho)), rel=0.06)
    # the first token follows at once (no transfer cost, an idle decode): TTFT = wait + S
    assert sum(r.ttft_s for r in res.requests) / len(res.requests) == pytest.approx(wait + S, rel=1e-9)


def test_deterministic_arrivals_no_queueing():
    """Constant arrivals slower than every stage: each request alone, its latencies the sum of its costs."""
    S, step, admit, lat = 0.010, 0.002, 0.003, 0.004
    prof = parse_profile(profile_dict(prefill_s=S, step_s=step, admit_s=admit, transfer_gb_s=1.0, latency_s=lat))
    res = simulate(prof, Split(1, 1, 1, 1), fixed(2.0, 20, input_len=10, output_len=11, arrival="constant"))
    transfer = lat + 10 * 1000 / 1e9
    for r in res.requests:
        assert r.prefill_start_s == r.request.arrival_s
        assert r.ttft_s == pytest.approx(S + transfer + admit, abs=1e-12)
        assert r.tpot_s == pytest.approx(step, abs=1e-12)  # 10 iterations of one sequence
        assert r.e2e_s == pytest.approx(S + transfer + admit + 10 * step, abs=1e-12)
    s = res.summary(SLO(ttft_s=S + transfer + admit + 1e-9, tpot_s=step + 1e-9))
    assert s["slo_attainment"] == 1.0 and s["num_good"] == 20
    assert s["duration"] == pytest.approx(19 / 2.0 + S + transfer + admit + 10 * step)
    assert res.summary(SLO(ttft_s=S, tpot_s=1))["slo_attainment"] == 0.0  # TTFT just above S: no request meets it


def test_saturated_prefill_serves_at_capacity():
    """Twice the prefill's capacity: throughput is 1/S and the queue (so the TTFT) grows linearly."""
    S, n = 0.010, 400
    res = simulate(parse_profile(profile_dict(prefill_s=S)), Split(1, 1, 1, 1),
                   fixed(2 / S, n, arrival="constant"))
    assert res.summary(SLO(1, 1))["request_throughput"] == pytest.approx(1 / S, rel=0.01)
    last = res.requests[-1]
    assert last.ttft_s == pytest.approx(n * S - (n - 1) * S / 2, rel=1e-9)  # waits for every earlier prefill
    # two prefills double it
    two = simulate(parse_profile(profile_dict(prefill_s=S)), Split(2, 1, 1, 1), fixed(2 / S, n, arrival="constant"))
    assert two.requests[-1].ttft_s == pytest.approx(S, abs=1e-9)


def test_max_goodput_rate_of_a_deterministic_queue():
    """Constant arrivals at rate x into service S with TTFT SLO 2S: request i waits i (S - 1/x), so 90% of n meet
    it while x <= 1 / (S (1 - 1/(0.9 n))); the search lands within its 2% tolerance below that."""
    S, n = 0.010, 100
    prof = parse_profile(profile_dict(prefill_s=S))
    rate = max_goodput_rate(prof, Split(1, 1, 1, 1), fixed(10, n, arrival="constant"), SLO(2 * S + 1e-9, 1.0))
    exact = 1 / (S * (1 - 1 / (0.9 * n)))
    assert exact * 0.97 <= rate <= exact * 1.001


def test_prefill_batches_the_queue_and_decode_batches_running_sequences():
    """A prefill busy with one prompt queues two more and takes them as one batch (2 x 1 ms); both then decode
    together on a decode whose iteration costs batch x step: 2 x step per token each."""
    step = 0.001
    prof = parse_profile(profile_dict(prefill_s=0.001, step_s=step, prefill_batch=2))
    reqs = [Request(0.0, 10, 1), Request(0.0005, 10, 101), Request(0.0005, 10, 101)]
    res = simulate(prof, Split(1, 1, 1, 1), fixed(1, 3), requests=reqs)
    assert res.requests[0].ttft_s == pytest.approx(0.001)
    for r in res.requests[1:]:
        assert r.prefill_start_s == pytest.approx(0.001) and r.prefill_end_s == pytest.approx(0.003)
        assert r.ttft_s == pytest.approx(0.0025)
        assert r.tpot_s == pytest.approx(2 * step)
    # with speculation emitting 2 tokens per iteration, half the iterations
    spec = parse_profile(profile_dict(prefill_s=0.001, step_s=step, prefill_batch=2, tokens_per_step=2.0))
    res2 = simulate(spec, Split(1, 1, 1, 1), fixed(1, 3), requests=reqs)
    assert res2.requests[1].tpot_s == pytest.approx(step)


def test_decode_kv_capacity_queues_admission():
    d = profile_dict(step_s=0.001)
    d["tp"]["1"]["decode"]["max_kv_tokens"] = 150  # one 10 + 101-token sequence at a time
    reqs = [Request(0.0, 10, 101), Request(0.0, 10, 101)]
    res = simulate(parse_profile(d), Split(2, 1, 1, 1), fixed(1, 2), requests=reqs)
    first, second = sorted(res.requests, key=lambda r: r.first_token_s)
    assert second.first_token_s >= first.end_s  # admitted only once the first freed its KV


def test_shared_host_cores_slow_busy_replicas():
    """Two prefills busy on a host with one core run at half speed: two simultaneous 10 ms prefills end at 20 ms;
    with two cores they end at 10 ms."""
    reqs = [Request(0.0, 10, 1), Request(0.0, 10, 1)]
    one = parse_profile(profile_dict(host={"cores": 1, "source": "test"}))
    two = parse_profile(profile_dict(host={"cores": 2, "source": "test"}))
    assert [r.prefill_end_s for r in simulate(one, Split(2, 1, 1, 1), fixed(1, 2), requests=reqs).requests] == \
        pytest.approx([0.020, 0.020])
    assert [r.prefill_end_s for r in simulate(two, Split(2, 1, 1, 1), fixed(1, 2), requests=reqs).requests] == \
        pytest.approx([0.010, 0.010])
    # a TP entry's host_cores: a TP-2 prefill keeps two cores busy, so with a TP-1 one on two cores both run at 2/3
    d = profile_dict(host={"cores": 2, "source": "test"})
    d["tp"]["2"] = {**json.loads(json.dumps(d["tp"]["1"])), "host_cores": 2}
    mixed = parse_profile(d)
    assert mixed.host_demand(2) == 2 and mixed.host_demand(1) == 1
    # the first prefill runs alone (full speed); the second while the decode streams the first's 1000 tokens
    res = simulate(mixed, Split(1, 2, 1, 1), fixed(1, 2), requests=[Request(0.0, 10, 1001), Request(0.1, 10, 1)])
    assert res.requests[0].prefill_end_s == pytest.approx(0.010)
    assert res.requests[1].prefill_end_s == pytest.approx(0.1 + 0.010 * 3 / 2)


def test_round_robin_and_least_load_spread_requests():
    prof = parse_profile(profile_dict())
    res = simulate(prof, Split(2, 1, 3, 1), fixed(10, 12))
    assert [r.prefill_replica for r in res.requests[:4]] == [0, 1, 0, 1]
    assert [r.decode_replica for r in res.requests[:4]] == [0, 1, 2, 0]
    ll = simulate(prof, Split(2, 1, 1, 1), fixed(1, 2), policy="least_load",
                  requests=[Request(0.0, 10, 1), Request(0.0, 10, 1)])
    assert {r.prefill_replica for r in ll.requests} == {0, 1}


def test_workload_lengths_follow_bench_definitions():
    w = Workload(1, 2000, 100, 50, random_range_ratio=0.5, seed=3)
    reqs = w.requests()
    assert min(r.input_len for r in reqs) == 50 and max(r.input_len for r in reqs) == 100
    assert min(r.output_len for r in reqs) == 25 and max(r.output_len for r in reqs) == 50
    ln = Workload(1, 4000, 100, 50, random_input_dist="lognormal", random_lognormal_sigma=0.5).requests()
    assert sum(r.input_len for r in ln) / len(ln) == pytest.approx(100, rel=0.05)
    fast = w.at_rate(2).requests()
    assert [r.arrival_s * 2 for r in fast[:5]] == pytest.approx([r.arrival_s for r in reqs[:5]])  # same draws
    with pytest.raises(ValueError, match="random_range_ratio"):
        Workload(1, 10, 10, 10, random_range_ratio=2)


# ---- search and plan-split ---------------------------------------------------------------------------------------

def two_tp_profile(**kw) -> dict:
    d = profile_dict(**kw)
    tp2 = json.loads(json.dumps(d["tp"]["1"]))
    for p in tp2["prefill"]["points"] + tp2["decode"]["points"]:
        p["seconds"] *= 0.6  # TP2 is faster per replica, slower per GPU
    tp2["engine_args"] = ["--cpu-threads", "2"]
    d["tp"]["2"] = tp2
    return d


def test_candidate_splits_enumerate_the_budget():
    prof = parse_profile(two_tp_profile())
    labels = {s.label for s in candidate_splits(4, [1, 2], prof)}
    assert labels == {"1P1D", "1P2D", "1P3D", "2P1D", "2P2D", "3P1D", "1P(TP2)1D", "1P(TP2)2D", "1P1D(TP2)",
                      "2P1D(TP2)", "1P(TP2)1D(TP2)"}
    with pytest.raises(ProfileError, match="TP size 4"):
        candidate_splits(8, [1, 4], prof)


def test_ranking_follows_the_bottleneck():
    """Long outputs make decode the bottleneck (more decode replicas win); long prompts make prefill it."""
    prof = parse_profile(profile_dict(prefill_s=0.010, step_s=0.001))
    decode_heavy = Workload(20, 200, 10, 200, random_range_ratio=1.0)
    assert rank_splits(prof, 3, [1], decode_heavy, SLO(0.5, 0.01))[0].split.label == "1P2D"
    prefill_heavy = Workload(150, 200, 10, 2, random_range_ratio=1.0)
    assert rank_splits(prof, 3, [1], prefill_heavy, SLO(0.05, 0.01))[0].split.label == "2P1D"


def test_plan_split_prints_the_table_and_writes_a_loadable_config(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(two_tp_profile(prefill_s=0.010, step_s=0.001)))
    out, plan = tmp_path / "split.yaml", tmp_path / "plan.json"
    rc = plan_split(["--profile", str(prof), "--num-gpus", "4", "--tp-sizes", "1,2", "--request-rate", "20",
                     "--num-prompts", "100", "--random-input-len", "10", "--random-output-len", "200",
                     "--random-range-ratio", "1", "--slo-ttft-ms", "500", "--slo-tpot-ms", "10",
                     "--output-config", str(out), "--output-file", str(plan)])
    text = capsys.readouterr().out
    assert rc == 0
    result = json.loads(plan.read_text())
    rows = result["candidates"]
    assert len(rows) == 11 and "pick: " + rows[0]["split"] in text
    assert [r["max_goodput_rate_per_gpu"] for r in rows if r["meets_request_rate"]] == \
        sorted((r["max_goodput_rate_per_gpu"] for r in rows if r["meets_request_rate"]), reverse=True)
    for r in rows:
        assert r["split"] in text
    cfg = load_config(out)
    pick = result["pick"]
    assert (cfg.prefill.replicas, cfg.prefill.tp_size) == (pick["prefill"]["replicas"], pick["prefill"]["tp_size"])
    assert (cfg.decode.replicas, cfg.decode.tp_size) == (pick["decode"]["replicas"], pick["decode"]["tp_size"])
    assert cfg.cluster.num_gpus == 4 and cfg.model_path == "builtin:tiny" and cfg.engine == "reference"
    for g in (cfg.prefill, cfg.decode):  # the profiled engine flags of the group's TP size
        assert g.extra_args == (["--cpu-threads", "2"] if g.tp_size == 2 else [])
    assert out.read_text().startswith("# Written by pdserve plan-split")


def test_plan_split_keeps_a_base_config_and_renumbers_pinned_gpus(tmp_path, capsys):
    prof = tmp_path / "p.json"
    d = two_tp_profile()
    d["engine"] = "sglang"
    prof.write_text(json.dumps(d))
    out = tmp_path / "split.yaml"
    rc = plan_split(["--profile", str(prof), "--num-gpus", "8", "--tp-sizes", "2", "--request-rate", "5",
                     "--num-prompts", "50", "--random-range-ratio", "1", "--random-input-len", "10",
                     "--random-output-len", "20", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                     "--base-config", "deploy/dsv4-flash-rtxpro6000x8.yaml", "--output-config", str(out)])
    assert rc == 0, capsys.readouterr().err
    cfg = load_config(out)
    assert cfg.engine == "sglang" and cfg.sglang.quantization == "fp8" and cfg.page_size == 256  # kept from the base
    ids = [g for grp in (cfg.prefill, cfg.decode) for ids in grp.gpus for g in ids]
    assert ids == list(range(len(ids))) and cfg.prefill.tp_size == cfg.decode.tp_size == 2


@pytest.mark.parametrize("args,message", [
    (["--tp-sizes", "1,4"], "tp: no entry for TP size 4"),
    (["--tp-sizes", "x"], "--tp-sizes 'x'"),
    (["--num-gpus", "1"], "--num-gpus must be >= 2"),
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be > 0"),
    (["--request-rate", "0"], "request_rate must be > 0"),
])
def test_plan_split_bad_input_names_the_flag(tmp_path, capsys, args, message):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile_dict()))
    base = {"--profile": str(prof), "--num-gpus": "3", "--request-rate": "5", "--slo-ttft-ms": "100",
            "--slo-tpot-ms": "10", "--num-prompts": "20"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = [x for kv in base.items() for x in kv]
    assert plan_split(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_split_bad_profile_names_the_field(tmp_path, capsys):
    d = profile_dict()
    d["tp"]["1"]["decode"]["points"][0]["context_len"] = 0
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(d))
    assert plan_split(["--profile", str(prof), "--num-gpus", "2", "--request-rate", "1", "--slo-ttft-ms", "1",
                       "--slo-tpot-ms", "1"]) == 2
    assert "tp.1.decode.points[0].context_len" in capsys.readouterr().err


def test_split_label_and_gpus():
    assert Split(2, 1, 1, 1).label == "2P1D" and Split(1, 2, 2, 4).label == "1P(TP2)2D(TP4)"
    assert Split(1, 2, 2, 4).num_gpus == 10
    with pytest.raises(ValueError, match="decode_replicas"):
        Split(1, 1, 0, 1)
    assert math.isclose(SLO(1, 1).ttft_s, 1)


def test_background_demand_shares_the_host_cores():
    """Other work and the CPU requests cost outside the model threads share the cores with the busy replicas,
    as runnable threads share them: 4 busy prefills plus 0.5 + 10 req/s x (0.01 + 1 token x 0.001) = 0.61 cores of
    background on 2 cores run at 2 / 4.61 of their speed."""
    d = profile_dict(host={"cores": 2, "source": "test", "background_cores": 0.5, "cpu_per_request_s": 0.01,
                           "cpu_per_token_s": 0.001})
    host = parse_profile(d).host
    assert host.background_demand(10, 50) == pytest.approx(0.5 + 10 * (0.01 + 50 * 0.001))
    reqs = [Request(0.0, 10, 1) for _ in range(4)]
    res = simulate(parse_profile(d), Split(4, 1, 1, 1), fixed(10, 4), requests=reqs)
    assert res.requests[0].prefill_end_s == pytest.approx(0.010 * (4 + 0.5 + 10 * 0.011) / 2)
    # the engines' own overheads (per TP entry) add to the router's
    d["tp"]["1"]["prefill"]["cpu_overhead_per_request_s"] = 0.02
    d["tp"]["1"]["decode"].update(cpu_overhead_per_request_s=0.01, cpu_overhead_per_token_s=0.002)
    res = simulate(parse_profile(d), Split(4, 1, 1, 1), fixed(10, 4), requests=reqs)
    assert res.requests[0].prefill_end_s == pytest.approx(0.010 * (4 + 0.5 + 10 * (0.011 + 0.03 + 0.002)) / 2)
    # one busy prefill and a small background fit the two cores: full speed
    one = simulate(parse_profile(d), Split(1, 1, 1, 1), fixed(10, 1), requests=reqs[:1])
    assert one.requests[0].prefill_end_s == pytest.approx(0.010)
