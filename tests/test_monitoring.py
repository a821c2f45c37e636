"""Monitoring as code against the real thing: the committed dashboards and rules are current,
promtool accepts the config and rules and its unit tests cover every alert, and a real Prometheus
(Debian's package) scraping two clusters (each a router + reference prefill/decode pair + the launcher's
exporter, through the committed prometheus.yml and a targets file per cluster written by the launcher's code)
answers every panel query and every recording rule after traffic. One pair runs speculative decoding
(builtin:tiny with its built-in MTP draft), so the speculative panels are checked for data like the rest; the
other's router runs the kv_aware prefill policy on its prefill's KV events, and prompts that share a prefix give
the prefix cache panels (hit rate, the router's index accuracy) values to check."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engines import ROOT, ManagedProcess, free_port, spawn, start_engine, wait_ready, wait_until_ready
from pd.cluster.prom_targets import TargetsFile, build_targets
from pd.cluster.worker_metrics import WorkerStateExporter
from pd.monitoring import grafana as g
from pd.monitoring.prom_api import Prometheus, finite_values
from pd.monitoring.promql import metric_names
from pd.util.wait import wait_until

MON = Path(ROOT) / "monitoring"
DASHBOARDS = sorted((MON / "grafana" / "dashboards").glob("*.json"))
RULES = yaml.safe_load((MON / "rules.yml").read_text())
SGLANG_SRT = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
              / "sglang" / "srt")

# Panels whose only metrics exist in SGLang and not in the reference engine: their names are checked
# against the pinned SGLang source instead of for data. None today: the speculative engines here export
# every engine name a panel uses.
SGLANG_ONLY_PANELS: set[str] = set()
SPEC_STEPS = 3
SPEC_PANELS = {"pdserve: PD overview": ("Speculative accept length", "Speculative accept rate"),
               "pdserve: Workers": ("Verify steps per second", "Speculative depth (steps / draft tokens)",
                                    "Speculative step time (draft / verify / extend)", "Draft KV pages held")}
SYNTHETIC = {"up"}  # made by Prometheus itself for every target
OFFSET = re.compile(r"\s+offset\s+\d+[smhdwy]\b")
TEST_RATE_INTERVAL = "1m"  # $__rate_interval for the checks (Grafana gives 40s at a 10s scrape interval)


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:  # a clear failure, never a silent skip: CI installs it (`make install` as root)
        pytest.fail(f"`{name}` not found: install Debian's `prometheus` package (apt-get install prometheus; "
                    f"`make install` does it when run as root)")
    return path


def run(*argv: str, cwd: Path = MON) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def all_rules(kind: str) -> list[dict]:
    return [r for grp in RULES["groups"] for r in grp["rules"] if kind in r]


def dashboard_targets():
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel, t in g.iter_targets(dash):
            yield dash, panel, t


# ---- generated files, promtool --------------------------------------------------------------------
def test_generated_files_are_current():
    r = run(sys.executable, "-m", "pd.monitoring.generate", "--check", cwd=Path(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr


def test_generate_check_fails_on_a_stale_file(tmp_path):
    out = tmp_path / "m"
    assert run(sys.executable, "-m", "pd.monitoring.generate", "--out", str(out), cwd=Path(ROOT)).returncode == 0
    assert run(sys.executable, "-m", "pd.monitoring.generate", "--check", "--out", str(out),
               cwd=Path(ROOT)).returncode == 0
    rules = out / "rules.yml"
    rules.write_text(rules.read_text().replace("> 2", "> 3"))
    r = run(sys.executable, "-m", "pd.monitoring.generate", "--check", "--out", str(out), cwd=Path(ROOT))
    assert r.returncode == 1 and "rules.yml" in r.stderr
    # custom SLOs land in the alert expressions
    run(sys.executable, "-m", "pd.monitoring.generate", "--out", str(out), "--ttft-p99-slo", "1.5", cwd=Path(ROOT))
    assert "pdserve:router_ttft_seconds:p99_5m > 1.5" in rules.read_text()
    bad = run(sys.executable, "-m", "pd.monitoring.generate", "--out", str(out), "--itl-p99-slo", "0", cwd=Path(ROOT))
    assert bad.returncode == 2 and "itl_p99 must be > 0" in bad.stderr


def test_promtool_check_config_and_rules():
    promtool = tool("promtool")
    r = run(promtool, "check", "config", "prometheus.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = run(promtool, "check", "rules", "rules.yml")
    found = f"SUCCESS: {len(all_rules('record')) + len(all_rules('alert'))} rules found"
    assert r.returncode == 0 and found in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_cover_every_alert():
    r = run(tool("promtool"), "test", "rules", "rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    tests = yaml.safe_load((MON / "rules_test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    quiet = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if not a.get("exp_alerts")}
    alerts = {a["alert"] for a in all_rules("alert")}
    assert alerts - fired == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a not-yet/not-firing test"


# ---- dashboard structure ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path):
    dash = json.loads(path.read_text())
    assert dash["uid"].startswith("pdserve-") and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in variables
    ids, cells = set(), set()
    used = set()
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        gp = p["gridPos"]
        assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24, p["title"]
        for x in range(gp["x"], gp["x"] + gp["w"]):
            for y in range(gp["y"], gp["y"] + gp["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and p["targets"], p["title"]
        for t in p["targets"]:
            g.expand(t["expr"], {v: "x" for v in variables})  # every $variable is defined (KeyError otherwise)
            used |= {v for v in variables if f"${v}" in t["expr"] or f"${{{v}}}" in t["expr"]}
    assert variables - used - {"datasource"} == set(), "variables no panel uses"


# ---- the live stack -----------------------------------------------------------------------------------
KV_PAGE = 16  # the kv_aware pair's --page-size
# Prompts of the kv_aware pair: a 40-token prefix shared by all, then 12 tokens of their own; 52 tokens, so the
# first two pages are the shared prefix and the third is each prompt's own.
KV_PREFIX = [3 + (7 * i) % 250 for i in range(40)]
KV_PROMPTS = 5


def kv_prompt(i: int) -> list[int]:
    return KV_PREFIX + [3 + (11 * i + j) % 250 for j in range(12)]


class Cluster:
    """One PD cluster as the launcher would expose it to Prometheus: a router over prefill and decode engines, the
    launcher's exporter fed the workers' infos, and its own targets file (one per cluster, keyed by router port)."""

    def __init__(self, prefills: list, decode, workdir: Path, *router_flags: str):
        self.prefills, self.decode = prefills, decode
        self.prefill = prefills[0]
        self.router = ManagedProcess()
        self.router.port = free_port()
        self.router.log_path = str(workdir / f"router-{self.router.port}.log")
        workers = [a for p in prefills for a in ("--prefill", p.url, str(p.bootstrap_port))]
        self.router.proc = spawn([sys.executable, "-m", "pd.cli", "router", *workers, "--decode", decode.url,
                                  "--port", str(self.router.port), *router_flags], self.router.log_path)
        self.exporter = WorkerStateExporter()
        try:
            infos = [{"name": f"prefill-{i}", "role": "prefill", "url": p.url} for i, p in enumerate(prefills)]
            infos.append({"name": "decode-0", "role": "decode", "url": decode.url})
            self.exporter.update([dict(w, state="ready", restarts=0) for w in infos])
            self.exporter.start("127.0.0.1", 0)
            TargetsFile(workdir / f"pdserve_prometheus_targets_{self.router.port}.json").write(
                build_targets(f"127.0.0.1:{self.router.port}", infos, f"127.0.0.1:{self.exporter.port}"))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            self.router.stop()
        finally:
            self.exporter.stop()


class Stack:
    """Two clusters scraped by one Prometheus, all started here: the speculative pair behind a round-robin router
    (the speculative panels), and a pair whose prefill publishes KV events behind a ``kv_aware`` router (the prefix
    cache panels; the prefix cache is off with speculative decoding)."""

    def __init__(self, spec_engines, kv_engines, workdir: Path):
        self.workdir = workdir
        self.clusters: list[Cluster] = []
        self.started: list[ManagedProcess] = []
        self.prom: Prometheus | None = None
        try:
            self.spec = Cluster([spec_engines["prefill"]], spec_engines["decode"], workdir)
            self.clusters.append(self.spec)
            wait_ready(list(kv_engines.values()))  # the kv_aware router reads their event sources at start
            self.kv = Cluster([kv_engines["prefill-0"], kv_engines["prefill-1"]], kv_engines["decode"], workdir,
                              "--prefill-policy", "kv_aware")
            self.clusters.append(self.kv)
            self.router = self.spec.router
            self.engines = {"prefill": self.spec.prefill, "decode": self.spec.decode,
                            **{f"kv-{name}": e for name, e in kv_engines.items()}}
            (workdir / "ray_sd.json").write_text("[]")
            self.prom_port = free_port()
            self.prometheus = ManagedProcess()
            self.prometheus.port = self.prom_port
            self.prometheus.log_path = str(workdir / "prometheus.log")
            self.prometheus.proc = spawn([tool("prometheus"), f"--config.file={self.write_config()}",
                                          f"--storage.tsdb.path={workdir / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn"],
                                         self.prometheus.log_path)
            self.started.append(self.prometheus)
            self.prom = Prometheus(self.prometheus.url)
            for c in self.clusters:
                self.wait(c.router, "/health")
            self.wait(self.prometheus, "/-/ready")
            self.wait_kv_router_follows()
        except BaseException:  # the fixture never gets a Stack to stop: stop what started here
            self.stop()
            raise

    def write_config(self) -> Path:
        """The committed prometheus.yml with this test's files and a 1 s scrape/evaluation interval."""
        cfg = yaml.safe_load((MON / "prometheus.yml").read_text())
        cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        cfg["rule_files"] = [str(MON / f) for f in cfg["rule_files"]]
        files = {"pdserve": self.workdir / "pdserve_prometheus_targets_*.json", "ray": self.workdir / "ray_sd.json"}
        assert {j["job_name"] for j in cfg["scrape_configs"]} == set(files)
        for job in cfg["scrape_configs"]:
            job["file_sd_configs"][0]["files"] = [str(files[job["job_name"]])]
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def wait_kv_router_follows(self, timeout: float = 60) -> None:
        """Until the kv_aware router follows its prefills' KV events (it reports their lag only then)."""
        urls = {p.url for p in self.kv.prefills}

        def following() -> bool:
            text = httpx.get(self.kv.router.url + "/metrics", timeout=5).text
            return urls <= {s.labels.get("worker") for fam in text_string_to_metric_families(text)
                            for s in fam.samples if s.name == "pdserve_router_kv_events_lag_seconds"}

        wait_until(following, timeout, interval=0.3, what="the kv_aware router following its prefills' KV events",
                   retry=(httpx.HTTPError,))

    @staticmethod
    def wait(proc: ManagedProcess, path: str, timeout: float = 60) -> None:
        wait_until_ready(proc, path, timeout)

    def scrape(self, url: str) -> set[str]:
        """Sample names on a /metrics page (``x_bucket``, ``x_total``, ...)."""
        text = httpx.get(url + "/metrics", timeout=10).text
        return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}

    def exported(self) -> set[str]:
        names: set[str] = set()
        for c in self.clusters:
            names |= self.scrape(c.router.url) | self.scrape(f"http://127.0.0.1:{c.exporter.port}")
        for e in self.engines.values():
            names |= self.scrape(e.url)
        return names

    def value(self, expr: str) -> float:
        vals = finite_values(self.prom.query(expr))
        return sum(vals) if vals else float("nan")

    def stop(self) -> None:
        """Stop the processes first: a Prometheus left running after its directory is removed writes
        errors to its (deleted) log without end."""
        try:
            for p in reversed(self.started):
                p.stop()
            for c in reversed(self.clusters):
                c.stop()
        finally:
            if self.prom is not None:
                self.prom.close()


@pytest.fixture(scope="module")
def kv_engines(model_cache, tmp_path_factory):
    """Two prefills publishing KV events as the launcher configures them for kv_aware (bound to their own address)
    and a decode, without speculation (the prefix cache is off with it). Started, not waited for: they come up
    while the speculative pair does (the stack asks for this fixture first, and waits)."""
    logs = str(tmp_path_factory.mktemp("kv-engine-logs"))
    page = ("--page-size", str(KV_PAGE))
    started = {}
    try:
        for name in ("prefill-0", "prefill-1"):
            pub, replay = free_port(), free_port()
            events = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}", "bind": True,
                                 "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
            started[name] = start_engine("prefill", logs, *page, "--kv-events-config", events)
        started["decode"] = start_engine("decode", logs, *page)
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module")
def stack(kv_engines, spec_engines):
    with tempfile.TemporaryDirectory(prefix="pdmon-") as d:
        s = Stack(spec_engines, kv_engines, Path(d))
        try:
            yield s
        finally:
            s.stop()


GEN = {"max_new_tokens": 8, "temperature": 0}


async def _traffic(router_url: str) -> dict:
    """Non-streaming and streaming requests on every generation route, logprobs, one bad request.
    Returns the completion tokens of the generation requests (from their usage / meta_info)."""
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as c:
        async def gen(i, stream, logprob=False):
            body = {"text": f"monitoring {i}", "sampling_params": GEN, "stream": stream}
            if logprob:
                body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
            r = await c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            if stream:
                last = [line for line in r.text.splitlines() if line.startswith("data: {")][-1]
                return json.loads(last[6:])["meta_info"]["completion_tokens"]
            return r.json()["meta_info"]["completion_tokens"]

        async def completion(stream):
            r = await c.post("/v1/completions", json={"model": "builtin:tiny", "prompt": "monitoring", "max_tokens": 8,
                                                      "temperature": 0, "stream": stream,
                                                      "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                return chunks[-1]["usage"]["completion_tokens"]
            return r.json()["usage"]["completion_tokens"]

        async def chat():
            r = await c.post("/v1/chat/completions", json={"model": "builtin:tiny", "max_tokens": 8, "temperature": 0,
                                                           "messages": [{"role": "user", "content": "hi"}],
                                                           "logprobs": True})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        tokens = []
        for batch in ([gen(i, i % 2 == 1) for i in range(6)] + [gen(6, False, True), gen(7, True, True)],
                      [completion(False), completion(True), chat()]):
            tokens += await asyncio.gather(*batch)
        bad = await c.post("/generate", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400
    return {"requests": len(tokens), "completion_tokens": sum(tokens)}


async def _kv_traffic(router_url: str) -> dict:
    """The kv_aware cluster's prompts (token ids sharing a prefix), streaming and not, one after the other: each
    finds what the ones before left cached, and the router's choice does not hang on which answer comes first.
    Returns what ``_traffic`` returns."""
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as c:
        async def gen(i: int, stream: bool) -> int:
            r = await c.post("/generate", json={"input_ids": kv_prompt(i), "sampling_params": GEN, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                last = [line for line in r.text.splitlines() if line.startswith("data: {")][-1]
                return json.loads(last[6:])["meta_info"]["completion_tokens"]
            return r.json()["meta_info"]["completion_tokens"]

        tokens = [await gen(i, i % 2 == 1) for i in range(KV_PROMPTS)]
    return {"requests": len(tokens), "completion_tokens": sum(tokens)}


def _both_traffic(stack) -> dict:
    """One round of ``_traffic`` (speculative cluster) and ``_kv_traffic`` (kv_aware cluster) at once; the sums."""
    async def both():
        return await asyncio.gather(_traffic(stack.spec.router.url), _kv_traffic(stack.kv.router.url))

    spec, kv = asyncio.run(both())
    return {k: spec[k] + kv[k] for k in ("requests", "completion_tokens")}


def _sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the ``name`` samples on a /metrics page whose labels include ``labels``."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


# Engine counters whose totals on /metrics and in Prometheus must agree before the checks read them.
ENGINE_COUNTERS = ("sglang:generation_tokens_total", "sglang:num_requests_total",
                   "sglang:e2e_request_latency_seconds_count")


def _rule_groups_evaluated_after(stack, t: float) -> bool:
    """Every rule group's last evaluation is later than ``t`` (epoch seconds)."""
    import datetime as dt
    import re

    groups = stack.prom._get("/api/v1/rules", {})["groups"]
    # RFC 3339 with nanoseconds; fromisoformat takes at most microseconds
    stamps = [re.sub(r"(\.\d{6})\d+", r"\1", g["lastEvaluation"]).replace("Z", "+00:00") for g in groups]
    return bool(groups) and all(dt.datetime.fromisoformat(x).timestamp() > t for x in stamps)


def _sync_router_counts(stack) -> None:
    """Wait until Prometheus's last scrape of the routers has every answered request, its last
    scrape of the engines has their current counters, and every rule group has been evaluated
    after that (so the recording rules include the traffic)."""
    answered = sum(_sample_sum(httpx.get(c.router.url + "/metrics", timeout=5).text, "pdserve_router_requests_total")
                   for c in stack.clusters)
    wait_until(lambda: stack.value("sum(pdserve_router_requests_total)") == answered, 30, interval=0.3,
               what="Prometheus scraping the routers' final counts")
    pages = [httpx.get(e.url + "/metrics", timeout=5).text for e in stack.engines.values()]
    for name in ENGINE_COUNTERS:
        exported = sum(_sample_sum(text, name) for text in pages)
        wait_until(lambda: stack.value(f'sum({name}{{component="engine"}})') == exported, 30, interval=0.3,
                   what=f"Prometheus scraping the engines' final {name} ({exported:g})")
    synced = time.time()
    wait_until(lambda: _rule_groups_evaluated_after(stack, synced), 30, interval=0.3,
               what="a rule evaluation after the last scrape")


@pytest.fixture(scope="module")
def traffic(stack):
    """Send traffic once Prometheus scrapes every target; wait until its last scrape saw all of it
    and the recording rules have run on it. A first round creates every labelled series, so the
    measured round's increments are all inside rate windows (Prometheus cannot see the increments
    that happened before a series' first scrape)."""
    def all_up():
        targets = stack.prom._get("/api/v1/targets", {"state": "active"})["activeTargets"]
        pd_targets = [t for t in targets if t["labels"]["job"] == "pdserve"]
        return len(pd_targets) == 9 and all(t["health"] == "up" for t in pd_targets)

    try:
        wait_until(all_up, 30, interval=0.3, what="Prometheus scraping all 9 pdserve targets (2 clusters)")
    except TimeoutError as e:
        targets = stack.prom._get("/api/v1/targets", {"state": "active"})["activeTargets"]
        raise AssertionError(json.dumps(targets, indent=1)[-3000:]) from e
    _both_traffic(stack)
    _sync_router_counts(stack)
    decode_out = 'sum(sglang:generation_tokens_total{engine_type=~"decode|unified"})'
    all_out = "sum(sglang:generation_tokens_total)"
    before = (stack.value(decode_out), stack.value(all_out))
    sent = _both_traffic(stack)
    _sync_router_counts(stack)
    wait_until(lambda: all(finite_values(stack.prom.query(f"{r} > 0")) for r in
                           ("pdserve:router_e2e_seconds_bucket:rate1m",
                            "pdserve:engine_kv_transfer_latency_ms_bucket:rate1m")),
               30, interval=0.3, what="the recording rules picking up the traffic")
    return dict(sent, before=before)


def _has_data(stack, values, exported, dash, panel, t) -> bool:
    """Whether the query returns a finite value; fails unless the only reason it cannot is an
    SGLang-only metric (SGLANG_ONLY_PANELS)."""
    expr = g.expand(t["expr"], values, rate_interval=TEST_RATE_INTERVAL)
    result = stack.prom.query(expr)  # raises on a query Prometheus rejects
    if finite_values(result):
        return True
    missing = {n for n in metric_names(expr) if n not in exported}
    if panel["title"] in SGLANG_ONLY_PANELS and missing and all(n.startswith("sglang:") for n in missing):
        return False
    pytest.fail(f"{dash['title']} / {panel['title']} / {t['refId']}: no data for\n  {expr}\n  result: {result}")


@pytest.mark.slow
def test_every_panel_query_and_recording_rule_returns_data(stack, traffic):
    exported = stack.exported()
    empty, checked = set(), 0
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        values = g.resolve_variables(dash, stack.prom.label_values)
        for panel, t in g.iter_targets(dash):
            if _has_data(stack, values, exported, dash, panel, t):
                checked += 1
            else:
                empty.add(panel["title"])
    assert empty == SGLANG_ONLY_PANELS and checked >= 60
    for rule in all_rules("record"):
        # A rule that looks back past this stack's life (an hour's baseline ``offset 15m``) has nothing recorded
        # yet; its expression without the offset must find the series it reads.
        expr = OFFSET.sub("", rule["expr"]) if OFFSET.search(rule["expr"]) else rule["record"]
        assert finite_values(stack.prom.query(expr)), f"recording rule {rule['record']} has no data: {expr}"
    # No rule fails to evaluate (a many-to-many match or a bad aggregate would show here).
    groups = stack.prom._get("/api/v1/rules", {})["groups"]
    bad = [(r["name"], r.get("lastError")) for grp in groups for r in grp["rules"] if r["health"] != "ok"]
    assert not bad, bad


def test_speculative_panels_show_each_decode_worker(stack, traffic):
    """The speculative panels' queries return series after traffic: accept length and rate one per decode worker
    (the prefill drafts no verify steps), within what 3 draft tokens allow; step time for all three phases."""
    dec = f"127.0.0.1:{stack.engines['decode'].port}"
    dashes = {d["title"]: d for d in (json.loads(p.read_text()) for p in DASHBOARDS)}
    seen = {}
    for title, panels in SPEC_PANELS.items():
        dash = dashes[title]
        values = g.resolve_variables(dash, stack.prom.label_values)
        for panel, t in g.iter_targets(dash):
            if panel["title"] in panels:
                series = stack.prom.query(g.expand(t["expr"], values, rate_interval=TEST_RATE_INTERVAL))
                assert finite_values(series), f"{title} / {panel['title']} / {t['refId']}: no data"
                seen.setdefault(panel["title"], []).append(series)
    assert set(seen) == {p for ps in SPEC_PANELS.values() for p in ps}
    ((length,),) = seen["Speculative accept length"]
    ((rate,),) = seen["Speculative accept rate"]
    assert length["metric"] == {"instance": dec} and rate["metric"] == {"instance": dec}
    assert 1 <= float(length["value"][1]) <= SPEC_STEPS + 1 and 0 <= float(rate["value"][1]) <= 1
    mean, p99 = seen["Speculative step time (draft / verify / extend)"]
    assert {(s["metric"]["instance"], s["metric"]["phase"]) for s in mean} >= {(dec, ph) for ph in
                                                                               ("draft", "verify", "extend")}
    assert all(0 < v < 60 for v in finite_values(mean) + finite_values(p99))
    # no request runs now: every draft page is back in the pool on both sides
    (held,) = seen["Draft KV pages held"]
    assert {s["metric"]["instance"] for s in held} == {f"127.0.0.1:{e.port}" for e in (stack.spec.prefill,
                                                                                         stack.spec.decode)}
    assert finite_values(held) == [0.0] * len(held)


PREFIX_PANELS = ("Cache hit rate per worker", "Index accuracy (predicted / reported cached tokens)",
                 "Cached prompt tokens per second (kv_aware)", "KV events lag (kv_aware)",
                 "Router index size (kv_aware)", "kv_aware fallbacks")


def test_prefix_cache_panels_follow_the_kv_aware_router(stack, traffic):
    """The kv_aware router sent every prompt of the shared prefix to the prefill that holds it, and predicted
    every cached prompt token that prefill then reported, from the prefill's own KV events: its index holds the
    pages each engine keeps, the accuracy panel reads 100%, the hit rate panel shows the last prefill's hit, no
    decision fell back to estimates. The speculative prefill caches nothing."""
    workers = json.loads((MON / "grafana" / "dashboards" / "workers.json").read_text())
    values = g.resolve_variables(workers, stack.prom.label_values)
    seen: dict[str, list] = {}
    for panel, t in g.iter_targets(workers):
        if panel["title"] in PREFIX_PANELS:
            series = stack.prom.query(g.expand(t["expr"], values, rate_interval=TEST_RATE_INTERVAL))
            assert finite_values(series), f"{panel['title']} / {t['refId']}: no data"
            seen.setdefault(panel["title"], []).append(series)
    assert set(seen) == set(PREFIX_PANELS)

    def by(series, label):
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in series}

    # Each prompt is 52 tokens: 3 whole pages, which a hit can cover (it stops short of the whole prompt). In the
    # warm-up round the first prompt misses and the 4 others find the 2 shared pages; in the measured round all 5
    # find their own 3 pages. The holder keeps the 2 shared pages and each prompt's third.
    hit = len(kv_prompt(0)) // KV_PAGE * KV_PAGE
    (index,) = seen["Router index size (kv_aware)"]
    pages = by(index, "worker")
    holders = [p for p in stack.kv.prefills if pages[p.url]]
    assert len(holders) == 1, f"prompts of one prefix went to {len(holders)} prefills: {pages}"
    (holder,) = holders
    (other,) = [p for p in stack.kv.prefills if p is not holder]
    assert pages == {holder.url: 2 + KV_PROMPTS, other.url: 0}
    for p in stack.kv.prefills:  # the index holds what each engine keeps
        assert stack.value(f'sum(pdserve_kv_pages_cached{{instance="127.0.0.1:{p.port}"}})') == pages[p.url]
    decisions = httpx.get(stack.kv.router.url + "/metrics", timeout=5).text
    assert {p.url: _sample_sum(decisions, "pdserve_router_policy_decisions_total", worker=p.url)
            for p in stack.kv.prefills} == {holder.url: 2 * KV_PROMPTS, other.url: 0}
    (rate,) = seen["Cache hit rate per worker"]
    rates = by(rate, "instance")
    assert rates.pop(f"127.0.0.1:{other.port}", 0.0) == 0.0  # it served no prompt
    assert rates == {f"127.0.0.1:{holder.port}": hit / len(kv_prompt(0)), f"127.0.0.1:{stack.spec.prefill.port}": 0.0}
    (accuracy,) = seen["Index accuracy (predicted / reported cached tokens)"]
    assert finite_values(accuracy) == [pytest.approx(1.0)] and by(accuracy, "worker").keys() == pages.keys()
    predicted, reported = (by(s, "worker") for s in seen["Cached prompt tokens per second (kv_aware)"])
    assert predicted[holder.url] > 0 and reported[holder.url] > 0
    router = decisions
    expected = (KV_PROMPTS - 1) * 2 * KV_PAGE + KV_PROMPTS * hit
    assert _sample_sum(router, "pdserve_router_kv_predicted_cached_tokens_total") == expected
    assert _sample_sum(router, "pdserve_router_kv_reported_cached_tokens_total") == expected
    assert _sample_sum(router, "pdserve_router_kv_fallbacks_total") == 0
    assert set(by(seen["kv_aware fallbacks"][0], "reason").values()) == {0.0}
    (lag,) = seen["KV events lag (kv_aware)"]
    assert 0 <= by(lag, "worker")[holder.url] < 120, lag  # -1 until a first event batch arrives


def test_variables_resolve_from_scraped_labels(stack, traffic):
    overview = json.loads((MON / "grafana" / "dashboards" / "pd-overview.json").read_text())
    values = g.resolve_variables(overview, stack.prom.label_values)
    assert values["model"] == "(builtin:tiny)"
    assert values["role"] == "(decode|prefill)"
    engines = stack.engines.values()
    assert values["instance"] == "(" + "|".join(sorted(g.regex_escape(f"127.0.0.1:{e.port}") for e in engines)) + ")"
    assert set(values["endpoint"].strip("()").split("|")) == {"/generate", "/v1/completions", "/v1/chat/completions"}


def test_targets_carry_the_launchers_labels(stack, traffic):
    active = stack.prom._get("/api/v1/targets", {"state": "active"})["activeTargets"]
    labels = sorted((t["labels"]["component"], t["labels"].get("role", ""), t["labels"].get("worker_name", ""))
                    for t in active if t["labels"]["job"] == "pdserve")
    # two clusters, each from its own targets file
    assert labels == sorted(2 * [("engine", "decode", "decode-0"), ("engine", "prefill", "prefill-0"),
                                 ("launcher", "", ""), ("router", "", "")] + [("engine", "prefill", "prefill-1")])
    # The router's own worker/role labels survive next to the target labels (no exported_ renames).
    series = stack.prom.query('pdserve_router_worker_healthy{component="router"}')
    assert sorted(s["metric"]["role"] for s in series) == ["decode", "decode", "prefill", "prefill", "prefill"]
    assert not stack.prom.query('{__name__=~".+", exported_role!=""}')


def test_every_metric_name_is_exported_somewhere(stack, traffic):
    """Dashboards and rules use only names that the router, the reference engine or the launcher
    export, that the pinned SGLang defines, or that a recording rule records."""
    exported = stack.exported()
    sglang = sglang_metric_names()
    recorded = {r["record"] for r in all_rules("record")}
    used: dict[str, str] = {}
    for dash, panel, t in dashboard_targets():
        for n in metric_names(t["expr"]):
            used.setdefault(n, f"{dash['title']} / {panel['title']}")
    for dash in (json.loads(p.read_text()) for p in DASHBOARDS):
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                metric = v["definition"].split("(", 1)[1].split(",")[0].split("{")[0].strip()
                used.setdefault(metric, f"variable {v['name']}")
    for r in all_rules("record") + all_rules("alert"):
        for n in metric_names(r["expr"]):
            used.setdefault(n, f"rule {r.get('record') or r.get('alert')}")
    assert len(used) >= 40
    unknown = {n: where for n, where in used.items()
               if n not in exported | sglang | recorded | SYNTHETIC}
    assert not unknown, unknown
    # Engine names the reference engine exports are SGLang's own (same dashboards on both engines).
    ours = {n for n in used if n.startswith("sglang:")}
    assert ours <= sglang, ours - sglang


def test_panels_against_sglang_workers_have_data_or_say_they_cannot():
    """Every panel that reads an engine metric the reference engine alone exports sits under a row titled
    "Reference engine only": against SGLang workers, the rest of the dashboards are never empty for want of
    a name (the names SGLang defines are checked above)."""
    from pd.engines.metrics import EngineMetrics
    from pd.monitoring.dashboards import REFERENCE_ONLY_ROW

    families = {m.name for m in EngineMetrics("m", "decode").registry.collect()}
    reference_only = {n for n in families if not n.startswith("sglang:")}
    assert {"pdserve_spec_step_seconds", "pdserve_draft_kv_pages_held"} <= reference_only

    def family(sample: str) -> str:
        return re.sub(r"_(bucket|sum|count|total)$", "", sample) if sample not in families else sample

    flagged, wrong = [], []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        row = ""
        for panel in dash["panels"]:
            if panel["type"] == "row":
                row = panel["title"]
                continue
            names = {family(n) for t in panel.get("targets", []) for n in metric_names(t["expr"])}
            if names & reference_only:
                (flagged if row.startswith(REFERENCE_ONLY_ROW) else wrong).append((panel["title"], row))
    assert not wrong, f"panels empty against SGLang workers outside a '{REFERENCE_ONLY_ROW}' row: {wrong}"
    assert len(flagged) == 2, flagged


def sglang_metric_names() -> set[str]:
    """Sample names of every metric the pinned SGLang defines (``name="sglang:..."`` in its
    source), expanded by type: histograms -> _bucket/_sum/_count, counters -> _total."""
    assert SGLANG_SRT.is_dir(), f"the pinned SGLang source is missing at {SGLANG_SRT} (make install)"
    out = set()
    for f in SGLANG_SRT.rglob("*.py"):
        try:
            text = f.read_text()
            if "sglang:" not in text:  # parse only files that can define one
                continue
            with warnings.catch_warnings():  # invalid escapes in some SGLang files
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            for kw in node.keywords:
                if (kw.arg == "name" and isinstance(kw.value, ast.Constant)
                        and str(kw.value.value).startswith("sglang:")):
                    name = kw.value.value
                    if "Histogram" in fn:
                        out |= {name + "_bucket", name + "_sum", name + "_count"}
                    elif fn == "Summary":
                        out |= {name + "_sum", name + "_count", name}
                    elif fn == "Counter":
                        out.add(name if name.endswith("_total") else name + "_total")
                    else:
                        out.add(name)
    assert len(out) > 150, "too few SGLang metric names found; did its source layout change?"
    return out


def test_engine_aggregates_count_each_request_once(stack, traffic):
    """The PD prefill counts every request too (as SGLang's does): summing over both roles would
    double count; the dashboards' decode/unified selection counts each generated token once."""
    decode_before, all_before = traffic["before"]
    decode_out = stack.value('sum(sglang:generation_tokens_total{engine_type=~"decode|unified"})') - decode_before
    all_out = stack.value("sum(sglang:generation_tokens_total)") - all_before
    assert decode_out == traffic["completion_tokens"]
    # the prefill adds its one token per request: summing both roles would be wrong
    assert all_out == traffic["completion_tokens"] + traffic["requests"]
    # and aggregating across the two label sets of the two roles works: one series per role
    by_role = stack.prom.query("sum by (engine_type) (rate(sglang:num_requests_total[1m]))")
    assert sorted(s["metric"]["engine_type"] for s in by_role) == ["decode", "prefill"]


def test_render_dashboard_png(stack, traffic, tmp_path):
    out = tmp_path / "overview.png"
    r = subprocess.run([sys.executable, "-m", "pd.cli", "render-dashboard", "--prometheus", stack.prometheus.url,
                        "--out", str(out), "--range", "2m", "--scrape-interval", "1s"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    counts = dict(part.rsplit(" (", 1) for part in r.stdout.strip().split(": ", 1)[1].split(", "))
    # every stage shows a line in the p50/p99 panels, every stage a bar
    stages = 12
    assert counts == {"Per-stage latency p50": f"{stages} series)", "Per-stage latency p99": f"{stages} series)",
                      "Mean time per stage": f"{stages} series)", "Requests by status": counts["Requests by status"]}
    assert int(counts["Requests by status"].split()[0]) >= 3  # 200s on three endpoints and the 400


def test_render_dashboard_without_data_fails_clearly(stack, tmp_path):
    """A Prometheus that scrapes nothing of a cluster: exit 1 and say why."""
    empty = Path(tempfile.mkdtemp(prefix="pdmon-empty-"))
    port = free_port()
    cfg = empty / "p.yml"
    cfg.write_text("global: {scrape_interval: 1s}\n")
    proc = ManagedProcess()
    proc.port, proc.log_path = port, str(empty / "log")
    proc.proc = spawn([tool("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={empty / 'data'}",
                       f"--web.listen-address=127.0.0.1:{port}"], proc.log_path)
    try:
        Stack.wait(proc, "/-/ready")
        r = subprocess.run([sys.executable, "-m", "pd.cli", "render-dashboard", "--prometheus", proc.url,
                            "--out", str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "found no values" in r.stderr, r.stderr
    finally:
        proc.stop()
        shutil.rmtree(empty, ignore_errors=True)


def test_launcher_exporter_reports_state_and_restarts():
    exp = WorkerStateExporter()
    exp.update([{"name": "prefill-0", "role": "prefill", "url": "http://h:1", "state": "restarting", "restarts": 3}])
    port = exp.start("127.0.0.1", 0)
    try:
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text)}
    finally:
        exp.stop()
    (restarts,) = fams["pdserve_worker_restarts"].samples
    assert restarts.name == "pdserve_worker_restarts_total" and restarts.value == 3
    assert restarts.labels == {"worker": "http://h:1", "worker_name": "prefill-0", "role": "prefill"}
    states = {s.labels["state"]: s.value for s in fams["pdserve_worker_state"].samples}
    assert states == {"created": 0, "starting": 0, "ready": 0, "restarting": 1, "failed": 0, "stopped": 0, "lost": 0,
                      "moving": 0}
    assert [s.value for s in fams["pdserve_worker_ready"].samples] == [0]


def test_targets_file_is_atomic_and_written_on_change(tmp_path):
    f = TargetsFile(tmp_path / "sub" / "t.json")
    workers = [{"name": "decode-0", "role": "decode", "url": "http://10.0.0.2:30001"},
               {"name": "prefill-0", "role": "prefill", "url": "http://10.0.0.3:30000"},
               {"name": "prefill-1", "role": "prefill", "url": None}]  # not placed yet: left out
    doc = build_targets("10.0.0.1:8000", workers, "10.0.0.1:9100")
    assert f.write(doc) and not f.write(doc)
    assert json.loads(f.path.read_text()) == [
        {"targets": ["10.0.0.1:8000"], "labels": {"component": "router"}},
        {"targets": ["10.0.0.2:30001"],
         "labels": {"component": "engine", "role": "decode", "worker_name": "decode-0"}},
        {"targets": ["10.0.0.3:30000"],
         "labels": {"component": "engine", "role": "prefill", "worker_name": "prefill-0"}},
        {"targets": ["10.0.0.1:9100"], "labels": {"component": "launcher"}},
    ]
    assert os.listdir(f.path.parent) == ["t.json"]  # no temp file left behind
    assert f.write([]) and json.loads(f.path.read_text()) == []


def test_scrape_address():
    from pd.cluster.prom_targets import scrape_address

    assert scrape_address("0.0.0.0", 8000, node_ip="10.1.2.3") == "10.1.2.3:8000"
    assert scrape_address("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert scrape_address("fe80::1", 8000) == "[fe80::1]:8000"
    with pytest.raises(ValueError, match="port"):
        scrape_address("127.0.0.1", 0)


def test_render_argument_parsing():
    from pd.monitoring.render import parse_duration, parse_time, rate_interval

    assert parse_duration("15m") == 900 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    with pytest.raises(ValueError, match="--range"):
        parse_duration("0m", "--range")
    with pytest.raises(ValueError, match="--range"):
        parse_duration("soon", "--range")
    assert parse_time("2026-11-30T01:13:00Z") == parse_time("2026-11-30T01:13:00") == 1796001180.0
    assert parse_time("1796001180") == 1796001180.0
    with pytest.raises(ValueError, match="--end"):
        parse_time("yesterday")
    assert rate_interval(15, 10) == 40 and rate_interval(60, 10) == 70  # Grafana's $__rate_interval


def test_render_time_axis_is_the_requested_range_in_utc(tmp_path, monkeypatch):
    """The time panels span --range ending at --end (as Grafana does, not just the span that has data),
    in UTC as the title says, whatever the local time zone."""
    import datetime as dt

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from pd.monitoring import render as R

    end, range_s = 1796001180.0, 900.0  # 2026-11-30 01:13:00 UTC, 15 minutes

    class DataForTheLastMinute:
        url = "http://stub:9090"

        def label_values(self, selector, label, start, stop):
            return ["x"]

        def query_range(self, expr, start, stop, step):
            return [{"metric": {"endpoint": "/generate", "status": "200", "stage": "s", "le": "1"},
                     "values": [[end - 60 + 10 * i, "0.01"] for i in range(7)]}]

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        drawn = R.render(DataForTheLastMinute(), tmp_path / "o.png", range_s, end, 10, 10)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert (tmp_path / "o.png").stat().st_size > 10_000 and all(drawn.values())
    (fig,) = figures
    time_axes = [ax for ax in fig.axes if isinstance(ax.xaxis.get_major_formatter(), mdates.ConciseDateFormatter)]
    assert len(time_axes) == 3
    for ax in time_axes:
        lo, hi = (mdates.num2date(x, tz=dt.timezone.utc) for x in ax.get_xlim())
        assert (lo.isoformat(), hi.isoformat()) == ("2026-11-30T00:58:00+00:00", "2026-11-30T01:13:00+00:00")
        last_x = mdates.num2date(ax.lines[0].get_xdata(orig=False)[-1], tz=dt.timezone.utc)
        assert last_x.isoformat() == "2026-11-30T01:13:00+00:00"  # data plotted at its UTC time


def test_metric_names_tokenizer():
    expr = 'histogram_quantile(0.99, sum by (le, endpoint) (rate(a_bucket{x=~"$v", s="5.."}[5m]))) * 0.001'
    assert metric_names(expr) == {"a_bucket"}
    assert metric_names("(sum(rate(a[1m])) or vector(0)) / on(x) group_left sum(b:c:d) > bool 2e-3") == {"a", "b:c:d"}
