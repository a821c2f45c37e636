"""A soak of the router on the embedded default: mixed and hostile traffic, an engine killed, one frozen.

What is measured
----------------
The embedded default (deploy/local.yaml: one prefill and one decode reference engine serving ``builtin:tiny``,
Mooncake over TCP, behind ``pdserve router``) runs as subprocesses of this script, with the command lines and the
router settings the launcher derives from that config (``pd.commands.reference``, ``pd.cluster.launch``), one
generated key for the engines, and the router's active health checks every 2 s (the default is 10 s) so that a
restarted engine is re-admitted quickly. For ``--duration`` seconds (600 by default) a seeded asyncio client sends
Poisson arrivals at ``--rate`` requests/s (4): non-streaming and streaming ``/generate``, ``/v1/completions`` and
``/v1/chat/completions``, batches (2-4 prompts), ``n`` 2-3, clients that disconnect after 1-3 stream events,
clients that give up on a non-streaming request (the router has no client ``/abort_request``: the router owns
request ids, so a client aborts by closing its connection), and a stream of bad inputs (the cases of
``tests/bad_inputs.py`` sent to the generation routes). Faults, on a timeline (``--quick`` compresses it):

* at 120 s the prefill engine's process group gets SIGKILL; 10 s later it is started again on the same ports;
* at 300 s the decode engine's process group gets SIGSTOP; 30 s later SIGCONT.

Each request has a client deadline (``--deadline``, 120 s): one still open past it counts as hung. A request is
"in a fault window" when its lifetime overlaps [fault, the router seeing the worker healthy again + 5 s].
Reported: requests by kind and outcome (ok / 4xx / 429 / 5xx / stream_error: a 200 stream that ended with an error
event or without ``[DONE]`` / server_abort: a 200 whose sequence finished ``abort`` / malformed / transport_error /
client_aborted / hung); p50 and p99 TTFT (first stream event) of good streams and E2E of good non-streaming requests,
in fault windows and outside; the router's RSS (its process group, /proc VmRSS) after warm-up, sampled every second
(peak) and after the drain; when the router re-admitted each faulted worker; after the drain (traffic stopped,
every request ended), polled until 0 with a deadline: every engine's ``pdserve_kv_pages_held`` and
``pdserve_kv_pages_quarantined``, the prefill bootstrap server's ``rooms`` and ``draining``, and the router's
requests in flight and queued; and the router's and engines' own counters.

The run fails (exit 1, naming each requirement missed) unless: no request hung; pages, rooms, in-flight and
queued requests are all 0 after the drain; the router's RSS after the drain is within 50 MB of its RSS after
warm-up; both faults happened and the router re-admitted both workers; outside the fault windows, every good
request succeeded and every bad input got a 4xx.

Reproduce
---------
    .venv/bin/python benchmarks/soak.py            # 10 minutes; writes benchmarks/results/soak.{json,md}
    .venv/bin/python benchmarks/soak.py --quick    # 90 s, faults at 15 s (5 s down) and 35 s (25 s frozen)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
from kv_transfer import git_commit, machine
from router_procs import group_hwm_mb, group_rss_mb

from pd.cluster.procs import LoggedGroup
from pd.commands.reference import reference_command
from pd.config import load_config
from pd.util.ports import free_ports
from pd.util.wait import async_wait_until

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "deploy" / "local.yaml"
RSS_SLACK_MB = 50.0
WARMUP_DEADLINE_S = 300.0  # the first requests of a fresh engine load lazily
RECOVERY_SETTLE_S = 5.0  # a fault window ends this long after the router sees the worker healthy again
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# weights of the traffic kinds; "bad" is a bad input, the rest are well-formed
KINDS = {"generate": 14, "generate_stream": 16, "completion": 6, "chat": 8, "chat_stream": 12, "batch": 8,
         "n": 8, "disconnect": 8, "give_up": 6, "bad": 14}
STREAMING = {"generate_stream", "chat_stream"}
WORDS = "the a router engine page prefill decode token stream soak cache room key queue batch sample".split()


# ---- the cluster -------------------------------------------------------------------------------------------
class Cluster:
    """The embedded default as subprocesses: engines from ``reference_command`` of deploy/local.yaml, a router
    with the launcher's settings for that config. Each is its own process group; faults signal the group."""

    def __init__(self, logs: Path, health_interval: float):
        self.cfg = load_config(CONFIG)
        self.logs = logs
        self.key = secrets.token_hex(32)  # the cluster's engine key, as the launcher makes one
        self.router_port, pport, bport, dport = free_ports(4)
        self.ports = {"prefill": (pport, bport), "decode": (dport, None)}
        self.urls = {role: f"http://127.0.0.1:{p}" for role, (p, _) in self.ports.items()}
        self.bootstrap_url = f"http://127.0.0.1:{bport}"
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.health_interval = health_interval
        self.engines: dict[str, LoggedGroup] = {}
        self.starts: Counter = Counter()
        self.router: Optional[LoggedGroup] = None
        self.commands: dict[str, str] = {}
        self.down: set[str] = set()  # roles killed on purpose and not restarted yet

    def start_engine(self, role: str) -> None:
        port, bport = self.ports[role]
        cmd = reference_command(self.cfg, role, "127.0.0.1", port, bport, api_key=self.key)
        self.starts[role] += 1
        self.down.discard(role)
        self.engines[role] = LoggedGroup(role, cmd.argv, self.logs / f"{role}-{self.starts[role]}.log",
                                         env=dict(os.environ, **cmd.env))
        self.commands[role] = " ".join(cmd.argv[1:])

    def start_router(self) -> None:
        from pd.router.config import ADMIN_KEY_ENV, CONFIG_ENV, WORKER_KEY_ENV, RouterConfig, RouterSettings

        settings = self.cfg.router.model_dump(include=set(RouterSettings.model_fields),
                                              exclude={"api_key", "admin_api_key", "worker_api_key"})
        pport, bport = self.ports["prefill"]
        config = RouterConfig(**settings, prefill=[{"url": self.urls["prefill"], "bootstrap_port": bport}],
                              decode=[self.urls["decode"]])
        env = dict(os.environ, **{CONFIG_ENV: config.model_dump_json(), WORKER_KEY_ENV: self.key,
                                  ADMIN_KEY_ENV: secrets.token_urlsafe(24)})
        argv = [sys.executable, "-m", "pd.cli", "router", "--port", str(self.router_port),
                "--health-check-interval-secs", str(self.health_interval)]
        self.router = LoggedGroup("router", argv, self.logs / "router.log", env=env)
        self.commands["router"] = " ".join(argv[1:]) + " (other settings: deploy/local.yaml's, in $" + CONFIG_ENV + ")"

    def procs(self) -> list[LoggedGroup]:
        return [*self.engines.values(), *([self.router] if self.router else [])]

    def check_alive(self) -> None:
        """RuntimeError with the log tail if a process we did not kill has exited."""
        for p in self.procs():
            if not p.alive() and p.name not in self.down:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")

    async def engine_healthy(self, client: httpx.AsyncClient, role: str) -> bool:
        self.check_alive()
        return (await client.get(self.urls[role] + "/health", timeout=5)).status_code == 200

    async def ready(self, client: httpx.AsyncClient, timeout: float = 300) -> None:
        async def up() -> bool:
            return (await self.engine_healthy(client, "prefill") and await self.engine_healthy(client, "decode")
                    and (await client.get(self.url + "/health", timeout=5)).status_code == 200)

        await async_wait_until(up, timeout, interval=0.5, what="engines and router healthy", retry=(httpx.HTTPError,))

    def signal_engine(self, role: str, sig: signal.Signals) -> None:
        eng = self.engines[role]
        if sig == signal.SIGKILL:
            self.down.add(role)
        os.killpg(eng.pid, sig)
        if sig == signal.SIGKILL:
            eng.stop(grace=10)  # reaps it and closes its log (the group is gone already)

    def stop(self) -> None:
        for p in reversed(self.procs()):
            try:
                os.killpg(p.pid, signal.SIGCONT)  # a frozen engine cannot act on SIGTERM
            except ProcessLookupError:
                pass
            p.stop()


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``/metrics`` of ``url`` as {sample name with its labels: value} (labels sorted, Prometheus style)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families((await client.get(url + "/metrics", timeout=10)).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def total(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def by_label(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    """Samples of ``name`` summed by the value of ``label`` (zeros left out)."""
    out: dict[str, float] = defaultdict(float)
    for k, v in m.items():
        if k.startswith(name + "{") and f'{label}="' in k:
            out[k.split(f'{label}="', 1)[1].split('"', 1)[0]] += v
    return {k: v for k, v in sorted(out.items()) if v}


# ---- traffic -----------------------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    route: str
    start: float  # s since the traffic began
    end: float = 0.0
    outcome: str = ""
    status: Optional[int] = None
    ttft: Optional[float] = None
    detail: str = ""
    in_fault: bool = False
    faults: list = field(default_factory=list)


def bad_cases(rng: random.Random) -> list:
    """The generation routes' bad inputs of tests/bad_inputs.py (not the 32 MiB one: one send of it costs more than
    the whole soak's other traffic), shuffled; each is (route, method, body bytes, content type)."""
    sys.path.insert(0, str(REPO / "tests"))
    from bad_inputs import all_cases

    cases = [(c.route, c.method, c.body, c.content_type) for c in all_cases()
             if c.router and c.route in GENERATION_ROUTES and c.status != 413 and not c.query]
    rng.shuffle(cases)
    return cases


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 24)))


def good_request(kind: str, rng: random.Random) -> tuple[str, dict, int]:
    """(route, body, sequences expected in the answer) of one well-formed request of ``kind``."""
    mx = rng.randrange(8, 33)
    sp = {"max_new_tokens": mx, "temperature": rng.choice([0, 0.7, 1.0])}
    msgs = [{"role": "user", "content": prompt(rng)}]
    if kind in ("generate", "generate_stream"):
        return "/generate", {"text": prompt(rng), "sampling_params": sp, "stream": kind == "generate_stream"}, 1
    if kind == "completion":
        return "/v1/completions", {"prompt": prompt(rng), "max_tokens": mx, "temperature": 0.7}, 1
    if kind in ("chat", "chat_stream"):
        return "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": mx,
                                        "stream": kind == "chat_stream"}, 1
    if kind == "batch":
        k = rng.randrange(2, 5)
        return "/generate", {"text": [prompt(rng) for _ in range(k)], "sampling_params": sp}, k
    if kind == "n":
        n = rng.randrange(2, 4)
        if rng.random() < 0.5:
            return "/generate", {"text": prompt(rng), "sampling_params": dict(sp, n=n, temperature=1.0)}, n
        return "/v1/chat/completions", {"messages": msgs, "n": n, "max_completion_tokens": mx, "temperature": 1.0}, n
    if kind == "disconnect":  # long enough to be cut mid-stream
        return "/generate", {"text": prompt(rng), "stream": True, "sampling_params": dict(sp, max_new_tokens=64,
                                                                                           ignore_eos=True)}, 1
    if kind == "give_up":
        return "/generate", {"text": prompt(rng), "sampling_params": dict(sp, max_new_tokens=64, ignore_eos=True)}, 1
    raise ValueError(kind)


def check_answer(route: str, body, want: int) -> str:
    """"" if ``body`` (a non-streaming answer) is well-formed with ``want`` sequences; else what is wrong."""
    if route == "/generate":
        items = body if isinstance(body, list) else [body]
        if len(items) != want or not all(isinstance(i, dict) and isinstance(i.get("text"), str) for i in items):
            return f"want {want} items with text, got {str(body)[:200]}"
        reasons = [(i.get("meta_info") or {}).get("finish_reason") or {} for i in items]
        return "abort" if any(r.get("type") == "abort" for r in reasons) else ""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != want:
        return f"want {want} choices, got {str(body)[:200]}"
    return "abort" if any(c.get("finish_reason") == "abort" for c in choices) else ""


async def send_good(client: httpx.AsyncClient, url: str, res: Result, body: dict, want: int, rng: random.Random,
                    t0: float) -> None:
    if res.kind == "give_up":
        try:
            r = await asyncio.wait_for(client.post(url + res.route, json=body), rng.uniform(0.05, 1.0))
        except asyncio.TimeoutError:
            res.outcome = "client_aborted"
            return
        return finish_plain(res, r, want)
    if not body.get("stream"):
        return finish_plain(res, await client.post(url + res.route, json=body), want)
    cut = rng.randrange(1, 4) if res.kind == "disconnect" else None
    events, done, error = 0, False, ""
    async with client.stream("POST", url + res.route, json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            res.outcome, res.detail = status_outcome(r.status_code), r.text[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            if res.ttft is None:
                res.ttft = time.perf_counter() - t0 - res.start
            events += 1
            ev = json.loads(data)
            if "error" in ev:
                error = json.dumps(ev["error"])[:200]
            elif (ev.get("meta_info") or {}).get("finish_reason", {}) and \
                    ev["meta_info"]["finish_reason"].get("type") == "abort":
                error = "finish_reason abort"
            if cut is not None and events >= cut:
                res.outcome = "client_aborted"
                return  # leaving the context closes the connection mid-stream
    if error:
        res.outcome, res.detail = ("server_abort" if error.startswith("finish_reason") else "stream_error"), error
    elif not done:
        res.outcome, res.detail = "stream_error", f"ended without [DONE] after {events} events"
    else:
        res.outcome = "ok"


def status_outcome(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if status == 429:
        return "429"
    return "4xx" if 400 <= status < 500 else "5xx"


def finish_plain(res: Result, r: httpx.Response, want: int) -> None:
    res.status = r.status_code
    res.outcome = status_outcome(r.status_code)
    if res.outcome != "ok":
        res.detail = r.text[:200]
        return
    try:
        wrong = check_answer(res.route, r.json(), want)
    except ValueError:
        wrong = f"not JSON: {r.text[:200]}"
    if wrong:
        res.outcome, res.detail = ("server_abort" if wrong == "abort" else "malformed"), wrong


async def send_bad(client: httpx.AsyncClient, url: str, res: Result, case) -> None:
    route, method, body, ctype = case
    headers = {"content-type": ctype} if ctype else {}
    r = await client.request(method, url + route, content=body, headers=headers)
    res.status, res.outcome = r.status_code, status_outcome(r.status_code)
    if res.outcome in ("ok", "5xx"):
        res.detail = f"{method} {route} {body[:120]!r} -> {r.status_code} {r.text[:120]}"


async def one(client, url: str, res: Result, rng: random.Random, bad: list, deadline: float, t0: float) -> None:
    """Send one request of ``res.kind`` and fill ``res``; past ``deadline`` s it is cancelled and counted hung."""
    try:
        if res.kind == "bad":
            case = bad[rng.randrange(len(bad))]
            res.route = case[0]
            coro = send_bad(client, url, res, case)
        else:
            res.route, body, want = good_request(res.kind, rng)
            coro = send_good(client, url, res, body, want, rng, t0)
        await asyncio.wait_for(coro, deadline)
    except asyncio.TimeoutError:
        res.outcome, res.detail = "hung", f"open after the {deadline:g} s deadline"
    except httpx.HTTPError as e:
        res.outcome, res.detail = "transport_error", repr(e)[:200]
    res.end = time.perf_counter() - t0


# ---- the soak ----------------------------------------------------------------------------------------------
def timeline(duration: float, quick: bool) -> list[tuple[float, str, str]]:
    """(time s, action, role): SIGKILL the prefill and restart it, SIGSTOP the decode and SIGCONT it."""
    if quick:
        return [(15, "kill", "prefill"), (20, "restart", "prefill"), (35, "stop", "decode"), (60, "cont", "decode")]
    f = duration / 600
    return [(120 * f, "kill", "prefill"), (130 * f, "restart", "prefill"), (300 * f, "stop", "decode"),
            (330 * f, "cont", "decode")]


async def run_faults(cluster: Cluster, plan, t0: float, events: list[dict]) -> None:
    for at, action, role in plan:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        if action == "kill":
            cluster.signal_engine(role, signal.SIGKILL)
        elif action == "restart":
            cluster.start_engine(role)
        elif action == "stop":
            cluster.signal_engine(role, signal.SIGSTOP)
        else:
            cluster.signal_engine(role, signal.SIGCONT)
        events.append({"t": round(time.perf_counter() - t0, 2), "action": action, "role": role})
        print(f"[{time.perf_counter() - t0:6.1f}s] {action} {role}", flush=True)


async def sample(client, cluster: Cluster, t0: float, stop: asyncio.Event, rss: list, health: list) -> None:
    """Every second: the router's RSS, and each worker's health as the router sees it (transitions kept)."""
    last: dict[str, float] = {}
    while not stop.is_set():
        t = round(time.perf_counter() - t0, 1)
        rss.append((t, round(group_rss_mb(cluster.router.pid), 1)))
        try:
            m = await metrics(client, cluster.url)
            for role in ("prefill", "decode"):
                v = total(m, "pdserve_router_worker_healthy", role=role)
                if last.get(role) != v:
                    health.append({"t": t, "role": role, "healthy": bool(v)})
                    last[role] = v
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def fault_windows(events: list[dict], health: list[dict], end: float) -> list[dict]:
    """Per fault: [its start, the worker back + RECOVERY_SETTLE_S]. Back = the router's last health transition of
    that worker after the fault, when it is to healthy (re-admitted); if the router never took the worker out (a
    freeze shorter than its failed probes take), the resume."""
    out = []
    for i, ev in enumerate(events):
        if ev["action"] not in ("kill", "stop"):
            continue
        resume = next((e["t"] for e in events[i + 1:] if e["role"] == ev["role"]), None)
        seen = [h for h in health if h["role"] == ev["role"] and h["t"] > ev["t"]]
        if seen:
            back = seen[-1]["t"] if seen[-1]["healthy"] else None
        else:
            back = resume
        out.append({"fault": f"{ev['action']} {ev['role']}", "start": ev["t"], "resumed": resume,
                    "taken_out": bool(seen), "back": back, "readmitted": back is not None,
                    "end": (back if back is not None else end) + RECOVERY_SETTLE_S})
    return out


async def drain(client, cluster: Cluster, timeout: float) -> dict:
    """Poll until every engine holds no KV pages, the bootstrap server no rooms, the router nothing in flight or
    queued; the last readings and whether they reached 0 within ``timeout`` s."""
    state: dict = {}

    async def empty() -> bool:
        for role in ("prefill", "decode"):
            m = await metrics(client, cluster.urls[role])
            state[role] = {k: total(m, k) for k in ("pdserve_kv_pages_held", "pdserve_kv_pages_quarantined",
                                                    "sglang:num_running_reqs", "sglang:num_queue_reqs")}
        b = (await client.get(cluster.bootstrap_url + "/health", timeout=5)).json()
        state["bootstrap"] = {"rooms": b.get("rooms"), "draining": b.get("draining")}
        r = await metrics(client, cluster.url)
        state["router"] = {k: total(r, k) for k in ("pdserve_router_requests_in_flight",
                                                    "pdserve_router_requests_queued")}
        return all(v == 0 for part in state.values() for v in part.values())

    t = time.perf_counter()
    try:
        await async_wait_until(empty, timeout, interval=1.0, what="nothing held", retry=(httpx.HTTPError,))
        state["drained"] = True
    except TimeoutError as e:
        state["drained"], state["error"] = False, str(e)
    state["drain_s"] = round(time.perf_counter() - t, 1)
    return state


def pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    if len(xs) == 1:
        return round(1e3 * xs[0], 1)
    return round(1e3 * statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 1)


def latency(results: list[Result], in_fault: bool) -> dict:
    good = [r for r in results if r.in_fault == in_fault and r.kind != "bad" and r.outcome == "ok"]
    ttft = [r.ttft for r in good if r.ttft is not None]
    e2e = [r.end - r.start for r in good if r.kind in ("generate", "completion", "chat", "batch")]
    return {"streams": len(ttft), "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "non_streaming": len(e2e), "e2e_ms_p50": pct(e2e, 50), "e2e_ms_p99": pct(e2e, 99)}



def targets_of(checks: dict[str, bool]) -> dict:
    """The results' ``targets`` object: one entry per requirement, its value whether it held."""
    return {name: {"value": ok, "goal": "holds", "met": ok} for name, ok in checks.items()}


async def soak(args) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    wall0 = time.perf_counter()
    rng = random.Random(args.seed)
    bad = bad_cases(random.Random(args.seed))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    cluster = Cluster(logs, args.health_check_interval)
    plan = timeline(args.duration, args.quick)
    results: list[Result] = []
    events: list[dict] = []
    rss: list = []
    health: list = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=64)
    try:
        cluster.start_engine("prefill")
        cluster.start_engine("decode")
        cluster.start_router()
        async with httpx.AsyncClient(timeout=args.deadline + 30, trust_env=False, limits=limits) as client:
            await cluster.ready(client)
            warm = [Result(k, "", 0.0) for k in ("generate", "generate_stream", "chat", "batch", "n")]
            await asyncio.gather(*(one(client, cluster.url, r, rng, bad, WARMUP_DEADLINE_S, time.perf_counter())
                                   for r in warm))
            if any(r.outcome != "ok" for r in warm):
                raise RuntimeError(f"warm-up failed: {[(r.kind, r.outcome, r.detail) for r in warm]}")
            router0 = await metrics(client, cluster.url)
            rss_before = group_rss_mb(cluster.router.pid)
            print(f"ready; router RSS {rss_before:.1f} MB; logs in {logs}", flush=True)

            t0 = time.perf_counter()
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(client, cluster, t0, stop, rss, health))
            faults = asyncio.create_task(run_faults(cluster, plan, t0, events))
            tasks = set()
            kinds, weights = list(KINDS), list(KINDS.values())
            next_at = 0.0
            while next_at < args.duration:
                await asyncio.sleep(max(0.0, next_at - (time.perf_counter() - t0)))
                if faults.done() and faults.exception():
                    raise faults.exception()
                res = Result(rng.choices(kinds, weights)[0], "", round(time.perf_counter() - t0, 3))
                results.append(res)
                task = asyncio.create_task(one(client, cluster.url, res, random.Random(rng.random()), bad,
                                               args.deadline, t0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if len(results) % 200 == 0:
                    print(f"[{next_at:6.1f}s] {len(results)} sent, {len(tasks)} open, "
                          f"{dict(Counter(r.outcome for r in results if r.outcome))}", flush=True)
                next_at += rng.expovariate(args.rate)
            await faults
            print(f"traffic stopped at {time.perf_counter() - t0:.1f}s; waiting for {len(tasks)} open", flush=True)
            if tasks:
                await asyncio.wait(tasks)  # each one ends by its own deadline
            traffic_end = time.perf_counter() - t0
            cluster.check_alive()
            after = await drain(client, cluster, args.drain_timeout)
            stop.set()
            await sampler
            rss_after = group_rss_mb(cluster.router.pid)
            rss_hwm = group_hwm_mb(cluster.router.pid)
            router1 = await metrics(client, cluster.url)
            engines = {role: await metrics(client, cluster.urls[role]) for role in ("prefill", "decode")}
    finally:
        cluster.stop()

    windows = fault_windows(events, health, traffic_end)
    for r in results:
        r.faults = [w["fault"] for w in windows if r.start <= w["end"] and r.end >= w["start"]]
        r.in_fault = bool(r.faults)
    outcomes = Counter(r.outcome for r in results)
    by_kind = {k: dict(Counter(r.outcome for r in results if r.kind == k)) for k in KINDS}
    calm_good_failed = [r for r in results if not r.in_fault and r.kind != "bad"
                        and r.outcome not in ("ok", "client_aborted")]
    calm_bad_wrong = [r for r in results if not r.in_fault and r.kind == "bad" and r.outcome not in ("4xx",)]
    router_counts = {
        "requests_by_status": {k: v - by_label(router0, "pdserve_router_requests_total", "status").get(k, 0)
                               for k, v in by_label(router1, "pdserve_router_requests_total", "status").items()},
        "errors_by_kind": {k: v - by_label(router0, "pdserve_router_errors_total", "kind").get(k, 0)
                           for k, v in by_label(router1, "pdserve_router_errors_total", "kind").items()},
        "retries": total(router1, "pdserve_router_retries_total") - total(router0, "pdserve_router_retries_total"),
    }
    engine_counts = {role: {"aborted_by_reason": by_label(m, "pdserve_engine_aborted_requests_total", "reason"),
                            "transfer_failed": total(m, "sglang:num_transfer_failed_reqs_total"),
                            "bootstrap_failed": total(m, "sglang:num_bootstrap_failed_reqs_total"),
                            "requests": total(m, "sglang:num_requests_total")}
                     for role, m in engines.items()}
    peak = max([v for _, v in rss] + [rss_before])
    growth = rss_after - rss_before
    checks = {
        "no request hung": outcomes["hung"] == 0,
        "nothing held after the drain (KV pages, quarantined pages, rooms, in flight, queued)": after["drained"],
        f"router RSS after within {RSS_SLACK_MB:g} MB of after warm-up": growth <= RSS_SLACK_MB,
        "both faults happened and the router re-admitted both workers":
            len(events) == len(plan) and len(windows) == 2 and all(w["readmitted"] for w in windows),
        "outside the fault windows every good request succeeded": not calm_good_failed,
        "outside the fault windows every bad input got a 4xx": not calm_bad_wrong,
    }
    failed = [k for k, ok in checks.items() if not ok]
    calm, faulty = latency(results, False), latency(results, True)
    headline = (f"{len(results)} requests in {args.duration:g} s, {outcomes['hung']} hung; after the drain "
                f"{'nothing held' if after['drained'] else 'NOT drained'}; router RSS {rss_before:.1f} -> "
                f"{rss_after:.1f} MB (peak {peak:.1f}); good-stream TTFT p99 {faulty['ttft_ms_p99']} ms in fault "
                f"windows vs {calm['ttft_ms_p99']} ms outside; requirements "
                + ("all met" if not failed else "MISSED: " + "; ".join(failed)))
    return {
        "benchmark": "soak", "started_utc": started, "wall_s": round(time.perf_counter() - wall0, 1),
        "commit": git_commit(), "machine": machine(),
        "command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
        "settings": {"duration_s": args.duration, "rate_per_s": args.rate, "deadline_s": args.deadline,
                     "seed": args.seed, "health_check_interval_s": args.health_check_interval,
                     "kinds_weights": KINDS, "bad_input_cases": len(bad), "fault_plan": plan,
                     "commands": cluster.commands},
        "headline": headline, "requirements": checks, "failed": failed, "targets": targets_of(checks),
        "outcomes": dict(outcomes), "outcomes_by_kind": by_kind,
        "outcomes_in_fault_windows": dict(Counter(r.outcome for r in results if r.in_fault)),
        "outcomes_outside": dict(Counter(r.outcome for r in results if not r.in_fault)),
        "latency_outside_faults": calm, "latency_in_fault_windows": faulty,
        "fault_events": events, "fault_windows": windows, "router_health_transitions": health,
        "router_rss_mb": {"after_warmup": round(rss_before, 1), "peak_sampled": peak, "vm_hwm": round(rss_hwm, 1),
                          "after_drain": round(rss_after, 1), "growth": round(growth, 1)},
        "rss_timeline_mb": rss[::10],
        "after_drain": after, "router_counters": router_counts, "engine_counters": engine_counts,
        "problems": [vars(r) | {"faults": r.faults} for r in sorted(results, key=lambda r: (r.in_fault, r.start))
                     if r.outcome not in (("4xx",) if r.kind == "bad" else ("ok", "client_aborted"))][:60],
        "logs": str(logs),
    }


def markdown(rep: dict) -> str:
    m, s = rep["machine"], rep["settings"]
    kinds = list(s["kinds_weights"])
    outs = ["ok", "4xx", "429", "5xx", "stream_error", "server_abort", "malformed", "transport_error",
            "client_aborted", "hung"]
    lines = ["# Soak: mixed traffic and engine faults through the router (embedded default)", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB, no GPU",
             f"- Date: {rep['started_utc']} ({rep['wall_s']:.0f} s)", f"- Measured at commit {rep['commit']}",
             f"- Command: `{rep['command']}`",
             f"- Traffic: {s['rate_per_s']:g} req/s Poisson for {s['duration_s']:g} s, seed {s['seed']}, client "
             f"deadline {s['deadline_s']:g} s, {s['bad_input_cases']} bad-input cases; router health checks every "
             f"{s['health_check_interval_s']:g} s",
             "- Faults: " + ", ".join(f"{e['action']} {e['role']} at {e['t']:.0f} s" for e in rep["fault_events"]),
             "", f"Headline: {rep['headline']}", "",
             "A request is in a fault window when its lifetime overlaps [the fault, the router having the worker "
             "healthy again + 5 s]. With the only prefill down, the router tries it anyway (panic mode: failing "
             "outright would make a restart an outage) and answers 502 after its retries; a frozen decode's requests "
             "wait and finish after SIGCONT. TTFT is the first stream event, at the client.", "",
             "## Requirements", ""]
    lines += [f"- {'met' if ok else '**MISSED**'}: {k}" for k, ok in rep["requirements"].items()]
    lines += ["", "## Requests by kind and outcome", "", "| kind | " + " | ".join(outs) + " |",
              "|---" * (len(outs) + 1) + "|"]
    for k in kinds:
        row = rep["outcomes_by_kind"].get(k, {})
        lines.append(f"| {k} | " + " | ".join(str(row.get(o, 0)) for o in outs) + " |")
    lines.append("| **all** | " + " | ".join(str(rep["outcomes"].get(o, 0)) for o in outs) + " |")
    lines += ["", f"In fault windows: {rep['outcomes_in_fault_windows']}; outside: {rep['outcomes_outside']}.", "",
              "## Latency of good traffic (ms)", "",
              "| | streams | TTFT p50 | TTFT p99 | non-streaming | E2E p50 | E2E p99 |",
              "|---|---|---|---|---|---|---|"]
    for name, key in (("outside the fault windows", "latency_outside_faults"),
                      ("in fault windows", "latency_in_fault_windows")):
        x = rep[key]
        lines.append(f"| {name} | {x['streams']} | {x['ttft_ms_p50']} | {x['ttft_ms_p99']} | {x['non_streaming']} | "
                     f"{x['e2e_ms_p50']} | {x['e2e_ms_p99']} |")
    lines += ["", "## Faults and re-admission", "",
              "| fault | at s | restarted / resumed at s | router took it out | healthy in the router again at s "
              "| window ends s |", "|---|---|---|---|---|---|"]
    for w in rep["fault_windows"]:
        lines.append(f"| {w['fault']} | {w['start']:.1f} | {w['resumed']} | {'yes' if w['taken_out'] else 'no'} | "
                     f"{w['back']} | {w['end']:.1f} |")
    r, a = rep["router_rss_mb"], rep["after_drain"]
    lines += ["", "## Resources", "",
              f"- Router RSS: {r['after_warmup']} MB after warm-up, peak {r['peak_sampled']} MB (sampled each second; "
              f"VmHWM {r['vm_hwm']}), {r['after_drain']} MB after the drain: {r['growth']:+.1f} MB "
              f"(limit +{RSS_SLACK_MB:g})",
              f"- After the drain ({a['drain_s']} s of polling, drained: {a['drained']}): prefill {a.get('prefill')}, "
              f"decode {a.get('decode')}, bootstrap {a.get('bootstrap')}, router {a.get('router')}",
              f"- Router counters during the soak: {json.dumps(rep['router_counters'])}",
              f"- Engine counters (the prefill's since its restart): {json.dumps(rep['engine_counters'])}", ""]
    if rep["problems"]:
        lines += ["## Requests that failed (first 60; outside the fault windows first)", ""]
        lines += [f"- {p['kind']} {p['route']} at {p['start']:.1f} s: {p['outcome']} {p['status']} "
                  f"{'(fault: ' + ', '.join(p['faults']) + ') ' if p['faults'] else ''}{p['detail'][:160]}"
                  for p in rep["problems"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic (default 600)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, Poisson (default 4)")
    p.add_argument("--deadline", type=float, default=120, help="client deadline per request, s (default 120)")
    p.add_argument("--drain-timeout", type=float, default=90,
                   help="seconds to wait for pages, rooms and in-flight requests to reach 0 (default 90)")
    p.add_argument("--health-check-interval", type=float, default=2.0,
                   help="the router's --health-check-interval-secs (default 2)")
    p.add_argument("--seed", type=int, default=0, help="traffic seed (default 0)")
    p.add_argument("--quick", action="store_true", help="90 s with the compressed fault timeline")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 90
    return args


if __name__ == "__main__":
    a = parse_args()
    report = asyncio.run(soak(a))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    (a.out / "soak.md").write_text(markdown(report))
    print(report["headline"])
    if report["failed"]:
        print("FAILED: " + "; ".join(report["failed"]), file=sys.stderr)
        sys.exit(1)
