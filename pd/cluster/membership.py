"""Keeping a router's workers in step with the launcher's worker actors, through the admin API.

The launcher polls its actors' ``info()`` (name, role, state, url, bootstrap_port) and calls
``sync``: a worker that comes back on other ports is swapped (old URL removed, new one added), a
worker that is gone for good (``failed`` after its restart limit, ``stopped``) is removed, and a
worker that is ``ready`` again after a restart is put back at once (drain undone, circuit closed)
instead of waiting for the router's health checks. While a worker restarts on the same ports the
router keeps it and its health checks and circuit breaker decide. On stop, ``drain_all`` lets the
requests in flight finish before the engines go away.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import httpx

from pd.router.admin_client import AdminClient, AdminError

GONE_STATES = ("failed", "stopped", "lost")  # lost: its node died (pd.cluster.actor_slots)


def _entry(info: dict) -> Optional[tuple]:
    if not info.get("url"):
        return None
    return info["url"], info["role"], info.get("bootstrap_port") if info["role"] == "prefill" else None


class Membership:
    """What the router was told, per worker name.

    Args:
        admin: the router's admin API.
        say: where to report changes (one line each).
        worker_key: the cluster's key, which the engines want and the router sends to the workers it
            re-adds here (a worker the admin API adds gets only the key its call names).
    """

    def __init__(self, admin: AdminClient, say: Callable[[str], None] = print, worker_key: Optional[str] = None):
        self.admin = admin
        self.say = say
        self.worker_key = worker_key
        self.registered: dict[str, tuple] = {}  # name -> (url, role, bootstrap_port) in the router now
        self.states: dict[str, str] = {}

    def seed(self, infos: list[dict]) -> None:
        """The router was (re)started with these workers on its command line."""
        self.registered = {i["name"]: e for i in infos if (e := _entry(i)) is not None}
        self.states = {i["name"]: i.get("state", "") for i in infos}

    def sync(self, infos: list[dict]) -> None:
        """Bring the router in line with ``infos``; a call that fails (router restarting) is
        retried by the next sync."""
        for info in infos:
            name, state = info["name"], info.get("state", "")
            want = None if state in GONE_STATES else _entry(info)
            have = self.registered.get(name)
            try:
                if have is not None and have != want:
                    self._remove(have[0])
                    del self.registered[name]
                    self.say(f"router: removed {name} ({have[0]}; {state})")
                    have = None
                if want is not None and have is None and state == "ready":
                    try:
                        self.admin.add(*want, api_key=self.worker_key)
                    except AdminError as e:
                        if e.status != 409:
                            raise
                    self.registered[name] = want
                    self.say(f"router: added {name} ({want[0]})")
                elif want is not None and state == "ready" and self.states.get(name) not in (None, "ready"):
                    self.admin.activate(want[0])  # back from a restart: no need to wait for health checks
                    self.say(f"router: {name} is back in routing")
            except (AdminError, httpx.HTTPError) as e:
                self.say(f"router: could not update {name}: {e}")
                continue
            self.states[name] = state

    def _remove(self, url: str) -> None:
        try:
            self.admin.remove(url)
        except AdminError as e:
            if e.status != 404:
                raise

    def drain_all(self, timeout: float) -> bool:
        """Stop new requests to every worker, then wait up to ``timeout`` seconds in all for the
        requests in flight; True when they all finished."""
        urls = [e[0] for e in self.registered.values()]
        try:
            for url in urls:  # first nobody gets new requests, then wait
                self.admin.drain(url, 0)
            deadline = time.monotonic() + timeout
            return all([self.admin.drain(url, max(0.0, deadline - time.monotonic())) for url in urls])
        except (AdminError, httpx.HTTPError) as e:
            self.say(f"router: could not drain the workers: {e}")
            return False
