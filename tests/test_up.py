"""`pdserve up`: one command brings the cluster up on this machine; Ctrl-C takes all of it down."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import yaml

from engines import ROOT, free_port
from pd.util.wait import wait_until
from ray_cluster import wait_pids_gone
from tcp_states import server_side_time_wait


@pytest.mark.cluster  # starts Ray (conftest.py: test tiers)
def test_pdserve_up_serves_and_ctrl_c_stops_everything(model_cache):
    """The embedded default, with the router moved by --port (the job gets the config text with the override)."""
    router_port, dashboard_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.cli", "up", "--port", str(router_port),
         "--address", f"http://127.0.0.1:{dashboard_port}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        # As a script's background job starts it (`pdserve up &`): with SIGINT ignored, which Python would keep;
        # pdserve up must still stop on the SIGINT below.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line.decode(errors="replace")) for line in proc.stdout],
                     daemon=True).start()

    def ready() -> bool:
        assert proc.poll() is None, "".join(lines)[-4000:]
        return any("pdserve up: try: curl" in line for line in lines)

    try:
        try:
            wait_until(ready, 240, interval=0.5, what="`pdserve up` printing the curl example", retry=())
        except TimeoutError as e:
            raise AssertionError("".join(lines)[-4000:]) from e
        out = "".join(lines)
        assert f"Router: http://127.0.0.1:{router_port}" in out
        assert "starting a local head with 8 logical GPUs" in out
        r = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", timeout=60, json={
            "model": "builtin:tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        pids = [int(p) for p in re.findall(r"started engine pid (\d+)", out)]
        assert len(pids) == 2
        # the printed submit line works from a plain shell (ray binary path, token auth mode)
        m = re.search(r"from another shell: (RAY_AUTH_MODE=token )?(\S+/ray) job submit --address (\S+) ", out)
        assert m, out[-3000:]
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        if m.group(1):
            env["RAY_AUTH_MODE"] = "token"
        job = subprocess.run([m.group(2), "job", "submit", "--address", m.group(3), "--", "python", "-c",
                              "print('submitted-from-another-shell')"], env=env, capture_output=True, text=True,
                             timeout=120)
        assert job.returncode == 0 and "submitted-from-another-shell" in job.stdout, job.stdout + job.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):  # already exited: keep the assertion that said why
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("`pdserve up` did not stop within 120 s of SIGINT:\n" + "".join(lines)[-4000:]) \
                from None
    out = "".join(lines)
    assert "pdserve up: stopping the local Ray head" in out
    head_log = re.search(r"logical GPUs \(log: (\S+)\)", out).group(1)
    assert not os.path.exists(head_log), "the head's log outlived a clean stop"
    assert not wait_pids_gone(pids, 30), "engine processes left behind"
    for port in (router_port, dashboard_port):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
            raise AssertionError(f"port {port} still answers after Ctrl-C")
        except httpx.HTTPError:
            pass


def test_pdserve_up_runs_the_preflight_before_starting_a_head(tmp_path):
    """A config the job's preflight would refuse (its router port is taken) fails at once, with nothing started."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cfg = yaml.safe_load(open(os.path.join(ROOT, "deploy", "local.yaml")))
    cfg["router"].update(host="127.0.0.1", port=taken.getsockname()[1])
    config = tmp_path / "taken.yaml"
    config.write_text(yaml.safe_dump(cfg))
    try:
        r = subprocess.run([sys.executable, "-m", "pd.cli", "up", str(config), "--address",
                            f"http://127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert str(cfg["router"]["port"]) in out and "nothing started" in out, out
    assert "starting a local head" not in out


def test_pdserve_up_names_a_taken_dashboard_port_at_once():
    """A program that is not Ray holds the dashboard port: `up` says so and how to pick another, before starting
    anything (a head there would wait two minutes for a dashboard it cannot bind)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "pd.cli", "up", "--address", f"http://127.0.0.1:{port}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"port {port}" in out and f"pid {os.getpid()}" in out and "--address" in out, out
    assert "nothing started" in out and "starting a local head" not in out, out


def test_pdserve_up_restarted_after_ctrl_c_starts_a_head_despite_time_wait(monkeypatch, capsys):
    """Restarted within a minute of Ctrl-C, the stopped head's dashboard port holds only TIME-WAIT sockets, which
    do not stop a new dashboard from binding it: `up` goes on to start the head (stood in for here)."""
    from pd.cluster import up
    from pd.tools import doctor

    class HeadStarting(Exception):
        pass

    def start_local_head(cfg, dashboard_port, log_path):
        raise HeadStarting(dashboard_port)

    monkeypatch.setattr(up, "start_local_head", start_local_head)
    monkeypatch.setattr(doctor, "preflight", lambda cfg: True)
    port = server_side_time_wait()
    with pytest.raises(HeadStarting) as started:
        up.main(["--address", f"http://127.0.0.1:{port}"])
    assert started.value.args == (port,)
    out = capsys.readouterr().out
    assert "is in use" not in out and "starting a local head" in out, out


def test_submission_waits_for_the_heads_job_agent(monkeypatch):
    """A new head refuses jobs with "No available agent" until its agent registers: `up` retries only that."""
    from pd.cluster import up
    from pd.util import wait

    monkeypatch.setattr(wait.time, "sleep", lambda s: None)

    class Client:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def submit_job(self, **job):
            self.calls += 1
            if self.errors:
                raise RuntimeError(self.errors.pop(0))
            return f"raysubmit_{job['entrypoint']}"

    busy = "Request failed with status code 500: No available agent to submit job, please try again later.."
    client = Client([busy, busy])
    assert up.submit_when_agent_ready(client, entrypoint="x") == "raysubmit_x" and client.calls == 3
    client = Client(["Request failed with status code 400: bad runtime_env"])
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        up.submit_when_agent_ready(client, entrypoint="x")
    assert client.calls == 1
    client = Client([busy] * 3)
    with pytest.raises(RuntimeError, match="No available agent"):
        up.submit_when_agent_ready(client, timeout_s=-1, entrypoint="x")
    assert client.calls == 1
