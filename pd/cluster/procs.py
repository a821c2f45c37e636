"""Child processes that die with their parent, and stopping a process group we started."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess

from pd.util.wait import wait_until

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies (prctl PR_SET_PDEATHSIG),
    so an engine or router never outlives a killed actor or launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the explicit stop paths still apply
        pass


def stop_group(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group led by ``pid`` (one we started with start_new_session=True),
    then SIGKILL whatever is left after ``grace`` seconds. Never raises for a gone group."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        wait_until(lambda: _group_gone(pid), grace, interval=0.1, what=f"process group {pid} gone", retry=())
        return
    except TimeoutError:
        pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_gone(pid: int) -> bool:
    """No process of group ``pid`` is left (the leader is reaped if it is our child)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


def popen_group(argv: list[str], **kw) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group that dies with this process."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent, **kw)


class LoggedGroup:
    """``argv`` started as the leader of its own process group (dies with this process unless ``preexec_fn``
    says otherwise), stdout and stderr to ``log_path``; ``stop`` ends the whole group by its PID."""

    def __init__(self, name: str, argv: list[str], log_path, env: dict | None = None, preexec_fn=die_with_parent):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=preexec_fn)

    @property
    def pid(self) -> int:
        """PID of the group leader (also the process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the leader process has not exited."""
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its log ("" if unreadable)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace`` s (stop_group), reap the leader, close the log."""
        stop_group(self.proc.pid, grace=grace)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
