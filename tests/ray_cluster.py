"""A throwaway local Ray cluster for tests: `ray start --head --block` on 127.0.0.1 with free
ports, stopped by process group. Jobs are driven through the `ray job` CLI, as users do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import httpx

from engines import ROOT, free_port
from pd.util.wait import wait_until

BIN = os.path.dirname(sys.executable)


class RayHead:
    def __init__(self, num_gpus: int = 8, node_ip: str = "127.0.0.1"):
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.tmp = tempfile.mkdtemp(prefix="pdt-", dir="/tmp")  # short: Ray puts sockets under it
        self.env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
        if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
            self.env["RAY_AUTH_MODE"] = "token"
        argv = [os.path.join(BIN, "ray"), "start", "--head", "--block", "--node-ip-address", node_ip,
                "--port", str(free_port()), "--dashboard-port", str(self.dashboard_port),
                "--dashboard-host", "127.0.0.1", "--num-cpus", "4", "--num-gpus", str(num_gpus),
                "--temp-dir", self.tmp, "--disable-usage-stats"]
        self.log = open(os.path.join(self.tmp, "head.log"), "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=ROOT)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Ray head exited with {self.proc.returncode}")
            # 401: up, with token authentication (on once ~/.ray/auth_token exists)
            return httpx.get(self.address + "/api/version", timeout=2).status_code in (200, 401)

        try:
            wait_until(up, 120, interval=0.5, what=f"the Ray dashboard at {self.address}", retry=(httpx.HTTPError,))
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"Ray head did not start ({e}): " + open(self.log.name).read()[-3000:]) from e

    def ray(self, *args: str, timeout: float = 120) -> str:
        if os.path.exists(os.path.expanduser("~/.ray/auth_token")):  # the head may have just created it
            self.env["RAY_AUTH_MODE"] = "token"
        out = subprocess.run([os.path.join(BIN, "ray"), *args], capture_output=True, text=True, env=self.env,
                             cwd=ROOT, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed: {out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out.stdout + out.stderr

    def submit(self, *entrypoint: str, options: tuple[str, ...] = ()) -> str:
        """`ray job submit --working-dir . [options] --no-wait -- entrypoint`; returns the job id."""
        class AgentBusy(RuntimeError):
            pass

        def submit() -> str:
            try:
                return self.ray("job", "submit", "--address", self.address, "--working-dir", ".", *options,
                                "--no-wait", "--", *entrypoint)
            except RuntimeError as e:
                if "No available agent" not in str(e):
                    raise
                raise AgentBusy(str(e)) from None

        # a new head serves its dashboard before its job agent registers (busy CI: > 10 s)
        out = wait_until(submit, 180, interval=1, what="a job agent on the Ray head", retry=(AgentBusy,))
        return re.search(r"raysubmit_\w+", out).group(0)

    def logs(self, job: str) -> str:
        return self.ray("job", "logs", "--address", self.address, job)

    def status(self, job: str) -> str:
        return self.ray("job", "status", "--address", self.address, job)

    def wait_log(self, job: str, pattern: str, timeout: float = 240) -> re.Match:
        """Poll the job's log (every 1 s) until ``pattern`` matches; fails at once on a failed job.

        Raises:
            AssertionError: the job failed (config refused, traceback) or no match within ``timeout`` s.
        """
        def found():
            logs = self.logs(job)
            m = re.search(pattern, logs)
            if m:
                return m
            if re.search(r"pdserve: (invalid config|cannot deploy|the preflight checks failed)|Traceback", logs):
                raise AssertionError(f"job {job} failed:\n{logs[-4000:]}")
            return None

        try:
            return wait_until(found, timeout, interval=1, what=f"{pattern!r} in job {job}'s log", retry=())
        except TimeoutError:
            raise AssertionError(f"{pattern!r} not in job {job} logs after {timeout}s:\n{self.logs(job)[-4000:]}") \
                from None

    def workers(self, job: str) -> list[dict]:
        line = self.wait_log(job, r"pdserve: workers (\[.*\])").group(1)
        return json.loads(line)

    def stop_job(self, job: str, timeout: float = 60) -> None:
        self.ray("job", "stop", "--address", self.address, job)
        try:
            wait_until(lambda: re.search(r"stopped|succeeded|failed", self.status(job), re.IGNORECASE), timeout,
                       interval=0.5, what=f"job {job} stopped", retry=())
        except TimeoutError:
            raise AssertionError(f"job {job} did not stop: {self.status(job)}") from None

    def stop(self) -> None:
        from pd.cluster.procs import stop_group

        stop_group(self.proc.pid, grace=5)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)  # Ray's session: sockets, logs, the uploaded working dir


def wait_pids_gone(pids, timeout: float = 30) -> list[int]:
    """Poll until none of ``pids`` is alive, at most ``timeout`` s; returns those still alive."""
    try:
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout, interval=0.5, what="processes gone")
    except TimeoutError:
        pass
    return [p for p in pids if pid_alive(p)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    return True
