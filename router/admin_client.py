"""A small synchronous client of the router's admin API (pd.router.admin), for the launcher and
for operators' scripts.

    admin = AdminClient("http://127.0.0.1:8000", admin_key)
    admin.add("http://10.0.0.5:31000", "prefill", bootstrap_port=31001)
    admin.drain("http://10.0.0.5:31000", timeout_secs=30, remove=True)
"""

from __future__ import annotations

from typing import Any, Optional

import httpx


class AdminError(RuntimeError):
    """The admin API refused a call; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"router admin API answered {status}: {message}")
        self.status = status


class AdminClient:
    """Calls to one router's admin API.

    Args:
        url: the router's base URL (``http://host:port``).
        key: the admin key (None when the router has none and this is a loopback client).
        timeout: seconds per call, on top of a drain's own ``timeout_secs``.
    """

    def __init__(self, url: str, key: Optional[str], timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout

    def _call(self, method: str, path: str, extra_timeout: float = 0.0, **kw) -> dict:
        r = httpx.request(method, self.url + path, headers=self.headers, timeout=self.timeout + extra_timeout, **kw)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            raise AdminError(r.status_code, msg)
        return r.json()

    def workers(self) -> list[dict]:
        """Every worker as ``GET /workers`` describes it."""
        return self._call("GET", "/workers")["workers"]

    def add(self, url: str, role: str, bootstrap_port: Optional[int] = None, api_key: Optional[str] = None) -> dict:
        """Add a worker; ``api_key``: the key the router sends it (none without one). Raises AdminError (409 when
        it is already there, 400 for bad fields, 403 for a host outside the cluster)."""
        body: dict[str, Any] = {"url": url, "worker_type": role}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        if api_key is not None:
            body["api_key"] = api_key
        return self._call("POST", "/workers", json=body)["worker"]

    def remove(self, url: str) -> dict:
        """Remove a worker now. Raises AdminError (404 when it is not a worker)."""
        return self._call("DELETE", "/workers", params={"url": url})["removed"]

    def drain(self, url: str, timeout_secs: float, remove: bool = False) -> bool:
        """Stop new requests to a worker, wait up to ``timeout_secs`` for the ones in flight;
        True when none is left. ``remove`` takes it out afterwards."""
        body = {"url": url, "timeout_secs": timeout_secs, "remove": remove}
        return self._call("POST", "/workers/drain", extra_timeout=timeout_secs, json=body)["drained"]

    def activate(self, url: str) -> dict:
        """Undo a drain and close the worker's circuit breaker."""
        return self._call("POST", "/workers/activate", json={"url": url})["worker"]

    def planner(self) -> dict:
        """The split controller's state (``GET /planner``): mode, current, target, decision, override."""
        return self._call("GET", "/planner")

    def report_planner(self, state: dict) -> None:
        """Report the split controller's state (the launcher's call)."""
        self._call("POST", "/planner", json=state)

    def pin_split(self, prefill: int, decode: int) -> dict:
        """Pin the split at ``prefill`` + ``decode`` replicas. Raises AdminError (400 for a count < 1)."""
        return self._call("PUT", "/planner/override", json={"prefill": prefill, "decode": decode})["override"]

    def unpin_split(self) -> None:
        """Let the controller decide the split again."""
        self._call("DELETE", "/planner/override")
