"""``pdserve up [CONFIG]``: the whole system on this machine with one command.

Makes sure a Ray cluster is reachable (else starts a local head with the logical GPUs the config
needs, on 127.0.0.1), submits ``python -m pd.launch`` as a Ray job, follows its log, prints the
router URL and a curl example once the router is ready, and on Ctrl-C (or SIGTERM) stops the job
and the Ray head it started. Nothing it did not start is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx
import yaml

from pd.cluster.launch import CONFIG_ENV
from pd.cluster.procs import popen_group, stop_group
from pd.config import DEFAULT_CONFIG, ConfigError, PDConfig, load_config, parse_config
from pd.util.ports import free_ports, port_holder
from pd.util.wait import wait_until

# A source checkout pd is imported from (its root holds pyproject.toml), or None for an installed pdserve.
_ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = _ROOT if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "deploy" / "local.yaml").is_file() else None
READY = re.compile(r"pdserve: router ready at (\S+)")


def say(msg: str) -> None:
    """Print a ``pdserve up:`` message, flushed at once."""
    print(f"pdserve up: {msg}", flush=True)


def dashboard_up(address: str) -> bool:
    """A Ray dashboard answers at ``address`` (401/403: it is there, with token authentication on;
    the job client then authenticates with RAY_AUTH_MODE=token and ~/.ray/auth_token)."""
    try:
        return httpx.get(address.rstrip("/") + "/api/version", timeout=2).status_code in (200, 401, 403)
    except httpx.HTTPError:
        return False


def ray_env() -> dict[str, str]:
    """Environment for Ray processes: this interpreter's bin dir first on PATH (so a job's
    ``python`` is the one pdserve is installed in) and token auth when the head uses it."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if (Path.home() / ".ray" / "auth_token").exists():
        env.setdefault("RAY_AUTH_MODE", "token")
    return env


def start_local_head(cfg: PDConfig, dashboard_port: int, log_path: Path) -> subprocess.Popen:
    """``ray start --head --block`` on 127.0.0.1 with ``cluster.num_gpus`` logical GPUs, as a child
    process group (stopping it stops the whole local cluster).

    Raises:
        RuntimeError: the dashboard did not come up within 120 s.
    """
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    gcs, agent, agent_grpc, runtime_env_agent, metrics = free_ports(5, exclude=[dashboard_port])
    argv = [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
            "--num-cpus", str(max(4, os.cpu_count() or 1)), "--num-gpus", str(cfg.cluster.num_gpus),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--disable-usage-stats",
            # Ray's fixed defaults (agent 52365, ...) collide with another Ray cluster on this host; a
            # head whose agent cannot bind serves the dashboard but refuses every job submission.
            "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
            "--runtime-env-agent-port", str(runtime_env_agent), "--metrics-export-port", str(metrics)]
    log = open(log_path, "wb")
    head = popen_group(argv, stdout=log, stderr=subprocess.STDOUT, env=ray_env())
    address = f"http://127.0.0.1:{dashboard_port}"

    def ready() -> bool:
        if head.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {head.returncode}")
        return dashboard_up(address)

    try:
        wait_until(ready, 120, interval=0.5, what=f"the local Ray dashboard at {address}", retry=())
    except (RuntimeError, TimeoutError) as e:
        stop_group(head.pid)
        raise RuntimeError(f"the local Ray head did not start; see {log_path}") from e
    return head


class _AgentBusy(RuntimeError):
    """The head refused a job submission because its job agent has not registered yet."""


def submit_when_agent_ready(client, timeout_s: float = 180, **job) -> str:
    """``client.submit_job(**job)``, retried while the head answers "No available agent to submit job".

    A freshly started head serves its dashboard before its job agent has registered; on a busy machine that
    takes longer than the 10 s the head waits per submission (ray/dashboard/consts.py
    WAIT_AVAILABLE_AGENT_TIMEOUT), and the head then refuses the job with that 500.

    Raises:
        RuntimeError: any other submission error, or no agent within ``timeout_s`` seconds.
    """
    def submit() -> str:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            say("the Ray head's job agent is not up yet; retrying the submission")
            raise _AgentBusy(str(e)) from None

    try:
        return wait_until(submit, timeout_s, interval=1, what="a job agent on the Ray head", retry=(_AgentBusy,))
    except TimeoutError as e:
        raise e.__cause__ from None  # the head's last refusal, "No available agent ..."


async def follow(client, job_id: str, router_seen: list, model: str) -> None:
    """Print the job's log as it arrives; on the router's ready line, print its URL and a curl example once."""
    async for chunk in client.tail_job_logs(job_id):
        for line in chunk.splitlines():
            print(line, flush=True)
            m = READY.search(line)
            if m and not router_seen:
                router_seen.append(m.group(1))
                url = m.group(1)
                say(f"ready. Router: {url}")
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}],
                                   "max_tokens": 16})
                say(f"try: curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
                say("Ctrl-C stops the job and everything `pdserve up` started")


def main(argv: Optional[list[str]] = None) -> int:
    """``pdserve up [CONFIG]``: start (or reuse) a Ray head, submit the cluster job and follow its log; Ctrl-C
    or SIGTERM stops the job and the head it started. When it starts the head, it first runs the job's preflight
    checks here (pd.tools.doctor.preflight) and starts nothing if they fail. Returns 0 when the job succeeded or was
    stopped (the head's log is then removed), 1 when it failed, 2 for an invalid config or a failed preflight."""
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="cluster config YAML (default: the embedded deploy/local.yaml)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard (job submission) address; a local head is started if nothing answers there "
                        "(default: $RAY_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--port", type=int, help="the router's port (default: the config's router.port)")
    args = p.parse_args(argv)
    # Python's Ctrl-C handler also where SIGINT starts out ignored (a script's background job): `kill -INT` stops
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cfg = load_config(args.config)
        config_text = Path(args.config).read_text() if args.config else DEFAULT_CONFIG.read_text()
        if args.port is not None:  # the job gets the config as text: it carries the override too
            data = yaml.safe_load(config_text) or {}
            data.setdefault("router", {})["port"] = args.port
            config_text = yaml.safe_dump(data, sort_keys=False)
            cfg = parse_config(data, f"{args.config or DEFAULT_CONFIG} with --port {args.port}")
    except ConfigError as e:
        print(f"pdserve up: invalid config:\n{e}", file=sys.stderr)
        return 2

    head = None
    address = args.address if "://" in args.address else f"http://{args.address}"
    if dashboard_up(address):
        say(f"found a Ray cluster at {address}: the job goes there (pdserve up did not start that cluster, so "
            "Ctrl-C stops the job only, never the cluster)")
    else:
        port = int(address.rsplit(":", 1)[1]) if re.search(r":\d+$", address) else 8265
        holder = port_holder(port)
        if holder is not None:  # a head there would wait 2 minutes for a dashboard it cannot bind
            say(f"port {port}, where the local Ray head's dashboard would listen, is in use by {holder} (not a "
                f"Ray dashboard); pick another with --address http://127.0.0.1:PORT or RAY_ADDRESS; nothing started")
            return 2
        # The job would run the same checks on this machine after the head started and the job was submitted.
        from pd.tools.doctor import preflight

        if not preflight(cfg):
            say("the preflight checks failed (see above; `pdserve doctor CONFIG` runs them alone); nothing started")
            return 2
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-ray-head-{os.getpid()}.log"
        say(f"no Ray cluster at {address}; starting a local head with {cfg.cluster.num_gpus} logical GPUs "
            f"(log: {log_path})")
        head = start_local_head(cfg, port, log_path)
        address = f"http://127.0.0.1:{port}"
    os.environ.update({k: v for k, v in ray_env().items() if k == "RAY_AUTH_MODE"})
    if head is not None:  # other shells need the same ray binary and auth mode to use this head
        auth = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
        say(f"local Ray head at {address}; from another shell: {auth}{os.path.dirname(sys.executable)}/ray "
            f"job submit --address {address} --working-dir . -- python -m pd.launch CONFIG")

    from ray.job_submission import JobStatus, JobSubmissionClient

    def stop_requested(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop_requested)
    job_id = None
    client = None
    code = 0
    try:
        client = JobSubmissionClient(address)
        runtime_env = {"env_vars": {CONFIG_ENV: config_text}}
        if CHECKOUT is not None:  # the job runs this tree's code, whatever pdserve the head's Python has
            runtime_env["working_dir"] = str(CHECKOUT)
        job_id = submit_when_agent_ready(client, entrypoint=f"{sys.executable} -m pd.launch", runtime_env=runtime_env)
        say(f"submitted Ray job {job_id} to {address}")
        seen: list = []
        asyncio.run(follow(client, job_id, seen, cfg.served_model_name or cfg.model_path))
        status = client.get_job_status(job_id)
        say(f"job {job_id} ended: {status}")
        code = 0 if status == JobStatus.SUCCEEDED else 1
    except KeyboardInterrupt:
        say("stopping")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if client is not None and job_id is not None:
            try:
                client.stop_job(job_id)
                wait_until(lambda: client.get_job_status(job_id).is_terminal(), 60, interval=0.5,
                           what=f"job {job_id} stopped", retry=())
            except Exception as e:
                say(f"could not stop job {job_id}: {e!r}")
        if head is not None:
            say("stopping the local Ray head")
            stop_group(head.pid, grace=5)  # the job is already stopped; Ray would drain for 30 s
            if code == 0:
                log_path.unlink(missing_ok=True)
            else:
                say(f"the local Ray head's log stays at {log_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
