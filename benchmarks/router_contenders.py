"""The router benchmark's contenders (benchmarks/router.py): the stub engines, pdserve's router, SGLang's Rust
gateway and mini_lb (sglang-router 0.3.2), the Shepherd Model Gateway (``smg``, the Rust gateway's successor), or no
router at all (``direct``), each started the same way and checked with one streaming and
one non-streaming request before it is measured."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

from router_procs import REPO, Proc, group_cpu_seconds, http, wait_ready

from pd.util.ports import free_port, free_ports
from pd.util.wait import wait_until

VENV_BIN = Path(sys.executable).parent
SGLANG_ROUTER_DIR = REPO / ".bench" / "sglang-router"
SGLANG_ROUTER_PIN = "sglang-router==0.3.2"
INSTALL_HINT = (f"install it for the benchmark only (not a project dependency): `make bench-router`, or\n"
                f"  .venv/bin/pip install --no-deps --target .bench/sglang-router {SGLANG_ROUTER_PIN} setproctitle")
# The Shepherd Model Gateway (PyPI smg; formerly sgl-model-gateway): the same Rust gateway lineage and the same
# launch_router CLI, shipped as the module smg.launch_router with the Rust core in smg/smg_rs.abi3.so.
SMG_DIR = REPO / ".bench" / "smg"
SMG_PIN = "smg==1.13.0"
SMG_INSTALL_HINT = (f"install it for the benchmark only (not a project dependency): `make bench-router`, or\n"
                    f"  .venv/bin/pip install --no-deps --target .bench/smg {SMG_PIN} setproctitle")
CONTENDERS = ("direct", "pdserve", "gateway", "smg", "mini_lb")
# The Rust gateways pdserve is held to (req/s >= 1.0x in every cell), each with the package it comes from.
GATEWAYS = {"gateway": f"SGLang's Rust gateway ({SGLANG_ROUTER_PIN})", "smg": f"Shepherd Model Gateway ({SMG_PIN})"}
REFERENCES = (*GATEWAYS, "mini_lb")  # the routers every other contender's req/s, p99 and CPU/req are compared to
TOKENS = 64


def request_body(stream: bool, tokens: int = TOKENS) -> dict:
    return {"text": "The capital of France is", "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
            "stream": stream}


def smoke(name: str, url: str) -> None:
    """One non-streaming and one streaming /generate through ``url``: the answers must be whole."""
    status, data = http("POST", url + "/generate", request_body(False), timeout=30)
    if status != 200 or json.loads(data).get("meta_info", {}).get("completion_tokens") != TOKENS:
        raise RuntimeError(f"{name}: /generate answered {status} {data[:300]!r}")
    status, data = http("POST", url + "/generate", request_body(True), timeout=30)
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data:")]
    if status != 200 or len(events) != TOKENS + 1 or events[-1] != b"data: [DONE]":
        raise RuntimeError(f"{name}: streaming /generate answered {status} with {len(events)} events "
                           f"(want {TOKENS} + [DONE]): {data[-300:]!r}")


class Stubs:
    """The prefill and decode stub engines."""

    def __init__(self, tag: str, cpus: set[int], logdir: Path, token_interval: float = 0.0):
        # three distinct ports; nobody listens on the bootstrap port: the stubs only count the field
        self.bootstrap_port, prefill_port, decode_port = free_ports(3)
        self.prefill_url = f"http://127.0.0.1:{prefill_port}"
        self.decode_url = f"http://127.0.0.1:{decode_port}"
        stub = str(REPO / "benchmarks" / "stub_engine.py")
        self.prefill = Proc(f"{tag}stub_prefill", [sys.executable, stub, "--role", "prefill", "--port",
                                                   self.prefill_url.rsplit(":", 1)[1]], cpus, logdir)
        self.decode = Proc(f"{tag}stub_decode", [sys.executable, stub, "--role", "decode", "--port",
                                                 self.decode_url.rsplit(":", 1)[1], "--token-interval",
                                                 str(token_interval)], cpus, logdir)
        wait_ready(self.prefill, self.prefill_url, 30)
        wait_ready(self.decode, self.decode_url, 30)

    def stats(self) -> dict:
        return {"prefill": json.loads(http("GET", self.prefill_url + "/stub_stats")[1]),
                "decode": json.loads(http("GET", self.decode_url + "/stub_stats")[1])}

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.prefill.pid) + group_cpu_seconds(self.decode.pid)

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def pdserve_snapshot(rev: str, workdir: Path) -> Path:
    """``pd/`` and ``router/`` of commit ``rev`` extracted into ``workdir``/pdserve_REV, laid out as
    the installed package maps them (``pd.router`` = ``router/``), so that commit's router can be
    measured while the working tree changes. RuntimeError if git cannot resolve ``rev``."""
    r = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"--pdserve-commit {rev!r}: {r.stderr.strip()}")
    sha = r.stdout.strip()
    dest = workdir / f"pdserve_{sha[:10]}"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", sha, "pd", "router"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "pd" / "router").symlink_to("../router")
    return dest


def contender_argv(name: str, stubs: Stubs, port: int, sglang_router_dir: Path,
                   pdserve_tree: Optional[Path] = None, custom: Optional[dict[str, str]] = None,
                   ) -> tuple[list[str], Optional[dict]]:
    """Command line and environment that start contender ``name`` on ``port``."""
    if custom and name in custom:
        return shlex.split(custom[name].format(python=sys.executable, prefill_url=stubs.prefill_url,
                                               bootstrap_port=stubs.bootstrap_port, decode_url=stubs.decode_url,
                                               port=port)), None
    if name == "pdserve":
        flags = ["router", "--prefill", stubs.prefill_url, str(stubs.bootstrap_port), "--decode", stubs.decode_url,
                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if pdserve_tree is None:
            return [str(VENV_BIN / "pdserve"), *flags], None
        # -P: the snapshot on PYTHONPATH, not the working tree (cwd), is what gets imported.
        return ([sys.executable, "-P", "-c", "from pd.cli import main; main()", *flags],
                dict(os.environ, PYTHONPATH=str(pdserve_tree)))
    pd_flags = ["--pd-disaggregation", "--prefill", stubs.prefill_url, str(stubs.bootstrap_port), "--decode",
                stubs.decode_url, "--host", "127.0.0.1", "--port", str(port)]
    if name == "smg":
        # Same flags as the gateway (smg keeps launch_router's CLI): round_robin, its own metrics port, warn.
        metrics_port = free_port(exclude=(port,))
        return ([sys.executable, "-m", "smg.launch_router", *pd_flags, "--policy", "round_robin",
                 "--prometheus-port", str(metrics_port), "--log-level", "warn"],
                dict(os.environ, PYTHONPATH=str(SMG_DIR)))
    env = dict(os.environ, PYTHONPATH=str(sglang_router_dir))
    common = [sys.executable, "-m", "sglang_router.launch_router", *pd_flags]
    if name == "gateway":
        metrics_port = free_port(exclude=(port,))  # not the router's own port, picked just before
        return common + ["--policy", "round_robin", "--prometheus-port", str(metrics_port), "--log-level", "warn"], env
    if name == "mini_lb":
        return common + ["--mini-lb"], env
    raise ValueError(f"unknown contender {name!r}")


class Contender:
    """One contender: a router process in front of the stubs, or ``direct`` (the decode stub)."""

    def __init__(self, name: str, stubs: Stubs, cpus: set[int], logdir: Path, sglang_router_dir: Path, tag: str = "",
                 pdserve_tree: Optional[Path] = None, custom: Optional[dict[str, str]] = None):
        self.name = name
        self.proc: Optional[Proc] = None
        self.argv: Optional[list[str]] = None
        if name == "direct":
            self.url = stubs.decode_url
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv, env = contender_argv(name, stubs, port, sglang_router_dir, pdserve_tree, custom)
        self.proc = Proc(tag + name, self.argv, cpus, logdir, env)

    def ready(self, timeout: float = 120) -> None:
        if self.proc is not None:
            wait_ready(self.proc, self.url, timeout)
        # The gateway answers /health before its workers are registered: retry the first requests.
        failed: list[Exception] = []

        def smoke_passes() -> bool:
            try:
                smoke(self.name, self.url)
                return True
            except (RuntimeError, OSError) as e:
                failed[:] = [e]
                if self.proc is not None and not self.proc.alive():
                    raise RuntimeError(f"{e}\n{self.proc.tail()}") from None
                return False

        try:
            wait_until(smoke_passes, timeout, interval=0.5, what=f"{self.name} answering whole requests", retry=())
        except TimeoutError:
            raise RuntimeError(f"{failed[-1]}\n{self.proc.tail() if self.proc else ''}") from None

    def cpu_seconds(self) -> float:
        return 0.0 if self.proc is None else group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
