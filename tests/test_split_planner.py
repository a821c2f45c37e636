"""The split controller's loop (pd.cluster.split_planner) with its metrics source, clock, router state and
actuator injected: what it decides from /metrics text, what it logs and exports, and that ``advise`` never acts.
Also the worker actor's role change without Ray (pd.cluster.worker.EngineWorker: its command in the new role)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd.cluster.split_mover import MoveResult
from pd.cluster.split_planner import SplitPlanner
from pd.cluster.worker_metrics import WorkerStateExporter
from pd.config import Planner
from pd.planner.controller import Policy, SplitController

WORKERS = [{"name": "prefill-0", "role": "prefill", "url": "http://p0:1", "state": "ready", "start_seconds": 4.0},
           {"name": "decode-0", "role": "decode", "url": "http://d0:1", "state": "ready", "start_seconds": 5.0},
           {"name": "decode-1", "role": "decode", "url": "http://d1:1", "state": "ready", "start_seconds": 5.0}]


class Source:
    """/metrics pages of a cluster whose prefill is too slow: every request's TTFT 0.8 s (the SLO: 0.25 s), TPOT
    5 ms (50 ms), 10 requests a second; decode-0 has 3 requests in flight, decode-1 none."""

    def __init__(self):
        self.t = 0.0

    def fetch(self, url: str) -> str:
        n = int(10 * self.t)
        if url == "http://router:1/metrics":
            return "\n".join([
                "# TYPE pdserve_router_requests_total counter",
                f'pdserve_router_requests_total{{endpoint="/generate",status="200"}} {n}',
                "# TYPE pdserve_router_prompt_tokens_total counter",
                f'pdserve_router_prompt_tokens_total{{endpoint="/generate"}} {1000 * n}',
                "# TYPE pdserve_router_completion_tokens_total counter",
                f'pdserve_router_completion_tokens_total{{endpoint="/generate"}} {20 * n}',
                "# TYPE pdserve_router_ttft_seconds histogram",
                *(f'pdserve_router_ttft_seconds_bucket{{endpoint="/generate",le="{le}"}} {0 if le < 0.8 else n}'
                  for le in (0.1, 0.2, 0.4, 0.6, 0.8, 1.0)),
                f'pdserve_router_ttft_seconds_bucket{{endpoint="/generate",le="+Inf"}} {n}',
                "# TYPE pdserve_router_worker_inflight gauge",
                'pdserve_router_worker_inflight{worker="http://d0:1",role="decode"} 3',
                'pdserve_router_worker_inflight{worker="http://d1:1",role="decode"} 0',
            ]) + "\n"
        if url.startswith("http://d"):
            return ("# TYPE sglang:request_time_per_output_token_seconds histogram\n"
                    f'sglang:request_time_per_output_token_seconds_bucket{{le="0.01"}} {n // 2}\n'
                    f'sglang:request_time_per_output_token_seconds_bucket{{le="+Inf"}} {n // 2}\n')
        return "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 4\n"


class Actuator:
    def __init__(self, clock=lambda: 0.0):
        self.clock, self.moves, self.adds, self.results = clock, [], [], []

    def busy(self) -> bool:
        return False

    def done(self) -> list:
        out, self.results = self.results, []
        return out

    def free_slots(self) -> int:
        return 0

    def move(self, worker: dict, to_role: str) -> None:
        self.moves.append((worker["name"], to_role, self.clock()))

    def add(self, role: str) -> None:
        self.adds.append(role)


class State:
    def __init__(self):
        self.pin, self.reports = None, []

    def override(self):
        return self.pin

    def report(self, state: dict) -> None:
        self.reports.append(state)


def planner(mode: str):
    cfg = Planner(mode=mode, interval_secs=10, window_secs=60, slo_ttft_ms=250, slo_tpot_ms=50, min_requests=10,
                  hold_secs=20, hold_restarts=2, cooldown_secs=60, cooldown_restarts=3)
    src, state, said, exp = Source(), State(), [], WorkerStateExporter()
    act = Actuator(lambda: src.t)
    policy = Policy(slo_attainment=cfg.slo_attainment, min_requests=cfg.min_requests, hold_secs=cfg.hold_secs,
                    cooldown_secs=cfg.cooldown_secs)
    p = SplitPlanner(cfg, SplitController(policy), act, state, "http://router:1", exp, said.append,
                     clock=lambda: src.t, fetch=src.fetch)
    return p, src, act, state, said, exp


def run(p, src, until: float):
    out = []
    while src.t <= until:
        if p.due():
            out.append(p.tick(WORKERS))
        src.t += 1
    return out


def decisions(exp) -> dict:
    text = generate_latest(exp.registry).decode()
    return {(s.labels["action"], s.labels["reason"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pdserve_planner_decisions_total"}


def test_advise_decides_logs_and_exports_but_never_acts():
    p, src, act, state, said, exp = planner("advise")
    out = run(p, src, 120)
    # one reading (no rate yet), then the hold time
    assert [d.reason for d in out[:3]] == ["idle", "hysteresis", "hysteresis"]
    assert {d.action for d in out[3:]} == {"move_to_prefill"} and out[-1].target == (2, 1)
    assert act.moves == [] and act.adds == []
    counted = decisions(exp)
    assert counted[("move_to_prefill", "ttft_slo")] == len(out) - 3 and counted[("hold", "hysteresis")] == 2
    lines = [m for m in said if "would move_to_prefill (ttft_slo)" in m]
    assert len(lines) == len(out) - 3 and "1P2D -> 2P1D" in lines[0] and "TTFT attainment 0%" in lines[0]
    assert state.reports[-1]["mode"] == "advise" and state.reports[-1]["target"] == {"prefill": 2, "decode": 1}
    assert state.reports[-1]["decision"]["reason"] == "ttft_slo"


def test_act_moves_the_least_busy_decode_then_cools_down():
    p, src, act, state, said, exp = planner("act")
    out = run(p, src, 30)
    # hold time max(20 s, 2 x 5 s restart): the third decision with data acts
    assert [d.action for d in out] == ["hold", "hold", "hold", "move_to_prefill"]
    assert act.moves == [("decode-1", "prefill", 30)]
    act.results.append(MoveResult("moved", "decode-1", "decode", "prefill", {}, 12.0, 5.0, "decode-1 -> prefill-1"))
    out = run(p, src, 120)
    assert any("planner: moved: decode-1 -> prefill-1" in m for m in said)
    # the same metrics (the test's cluster did not change): after the move, the cooldown (60 s) holds
    reasons = [d.reason for d in out]
    assert reasons[:3] == ["hysteresis", "hysteresis", "cooldown"] and out[-1].action == "move_to_prefill"
    assert act.moves[1] == ("decode-1", "prefill", 100)  # collected at 40, + 60 s
    assert decisions(exp)[("hold", "cooldown")] >= 1


def test_an_override_is_followed_in_act_mode_at_once():
    p, src, act, state, said, exp = planner("act")
    state.pin = (1, 2)
    assert run(p, src, 40)[-1].reason == "override" and act.moves == []  # already 1P2D
    state.pin = (2, 1)
    p.next_at = None
    d = p.tick(WORKERS)
    assert (d.action, d.reason) == ("move_to_prefill", "override") and act.moves == [("decode-1", "prefill", 41)]


def bare_worker(role: str, speculative: bool):
    """An EngineWorker as the actor builds it, without Ray (only what its ports and command read)."""
    from pd.cluster.worker import EngineWorker
    from pd.config import load_config

    cfg = load_config()
    if speculative:
        cfg = cfg.model_copy(update={"speculative": cfg.speculative_settings()[0] or _spec()})
    w = EngineWorker.__new__(EngineWorker)
    w.name, w.role, w.cfg, w.host, w.api_key, w.key_dir = f"{role}-0", role, cfg, "127.0.0.1", None, None
    w.port = w.bootstrap_port = w.kv_events_ports = w.proc = w.last_exit = w.diagnosis = None
    w.state, w.restarts, w._ready_line_seen, w.cuda_visible_devices, w.node_id = "created", 0, False, "", "n"
    w.start_seconds, w._supervisor, w._stopping = None, None, False
    return w


def _spec():
    from pd.config import Speculative

    return Speculative(algorithm="EAGLE", num_steps=3, eagle_topk=1, num_draft_tokens=4)


@pytest.mark.parametrize("speculative", [False, True])
async def test_a_worker_takes_its_new_roles_ports_and_flags(speculative):
    w = bare_worker("decode", speculative)
    info = await w.reserve_ports([], "prefill", "prefill-1")
    argv = w._command().argv
    assert info["name"] == "prefill-1" and info["role"] == "prefill" and info["bootstrap_port"]
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == str(info["bootstrap_port"])
    assert ("--speculative-algorithm" in argv) is speculative
    info = await w.reserve_ports([info["port"]], "decode", "decode-0")
    argv = w._command().argv
    assert info["bootstrap_port"] is None and "--disaggregation-bootstrap-port" not in argv
    assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
    assert ("--speculative-algorithm" in argv) is speculative
    with pytest.raises(ValueError, match="role must be prefill or decode"):
        await w.start_as("null", "x-0", [])


def holdings(metrics: str, health, role: str = "prefill") -> dict:
    import httpx

    from pd.cluster.split_mover import bootstrap_url, engine_holdings

    def answer(request):
        if request.url.port == 2:
            return httpx.Response(200, json=health) if isinstance(health, dict) else httpx.Response(200, text=health)
        return httpx.Response(200, text=metrics)

    info = {"role": role, "host": "e", "bootstrap_port": 2 if role == "prefill" else None}
    with httpx.Client(transport=httpx.MockTransport(answer)) as c:
        return engine_holdings("http://e:1", bootstrap_url(info), c)


def test_a_worker_is_settled_only_when_its_engine_holds_nothing():
    ref = ("# TYPE pdserve_kv_pages_held gauge\npdserve_kv_pages_held{tp_rank=\"0\"} 3\n"
           "# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens 48\n"
           "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n")
    assert holdings(ref, {"status": "ok", "rooms": 1, "draining": 0}) == {"pdserve_kv_pages_held": 3,
                                                                          "bootstrap_rooms": 1}
    assert holdings(ref.replace("} 3", "} 0").replace("48", "0"), {"rooms": 0, "draining": 0}) == {}
    # the decode side: an abandoned KV write's pages are held until the transfer engine settles it
    assert holdings(ref, None, role="decode") == {"pdserve_kv_pages_held": 3}
    # SGLang: no held-pages gauge (its used tokens count), a bootstrap /health that answers "OK", transfers in flight
    sgl = ("# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens 0\n"
           "# TYPE sglang:num_prefill_inflight_queue_reqs gauge\nsglang:num_prefill_inflight_queue_reqs 2\n")
    assert holdings(sgl, "OK") == {"sglang:num_prefill_inflight_queue_reqs": 2}
    assert holdings(sgl.replace("reqs 2", "reqs 0").replace("tokens 0", "tokens 64"), "OK") == \
        {"sglang:num_used_tokens": 64}
