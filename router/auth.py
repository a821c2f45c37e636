"""API keys: ``Authorization: Bearer KEY`` on client routes (``api_key``) and on the admin API
(``admin_api_key``), in SGLang's manner (health and metrics routes stay open for probes and
Prometheus).

Admin API rules: with an admin key only it unlocks the admin API; without one the client
``api_key`` does; with neither, only clients connecting from a loopback address may use it (an
open admin API on a public address would let anyone add workers).
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Optional

from starlette.requests import Request


def _bearer(header: Optional[str]) -> Optional[str]:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(header: Optional[str], key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` (constant-time comparison)."""
    token = _bearer(header)
    return token is not None and secrets.compare_digest(token.encode(), key.encode())


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else None
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Auth:
    """Key checks of one router.

    Args:
        api_key: key of client routes (None = open).
        admin_api_key: key of the admin API (None = ``api_key``, else loopback only).
    """

    def __init__(self, api_key: Optional[str], admin_api_key: Optional[str]):
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def client_ok(self, request: Request) -> bool:
        """May this request use a client route?"""
        return self.api_key is None or key_matches(request.headers.get("authorization"), self.api_key)

    def client_header_ok(self, authorization: Optional[bytes]) -> bool:
        """May a request with this raw ``Authorization`` header value (None: absent) use a client
        route? (The bare-ASGI generation routes' form of ``client_ok``.)"""
        if self.api_key is None:
            return True
        return authorization is not None and key_matches(authorization.decode("latin-1"), self.api_key)

    def admin_ok(self, request: Request) -> bool:
        """May this request use the admin API?"""
        key = self.admin_api_key or self.api_key
        if key is None:
            return _loopback(request)
        return key_matches(request.headers.get("authorization"), key)



def worker_auth_headers(key: Optional[str]) -> dict[str, str]:
    """The headers of every call to a worker given ``key`` (SGLang workers started with ``--api-key`` want
    it): each worker carries its own (pd.router.workers.Worker.headers), so a key goes only to the workers
    it was given for: those the router starts with get ``worker_api_key`` (else ``api_key``), one added
    through the admin API only the key its ``POST /workers`` names."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def valid_key(key: object) -> bool:
    """Whether ``key`` can travel in an ``Authorization`` header: a non-empty string of visible ASCII."""
    return isinstance(key, str) and bool(key) and all("!" <= c <= "~" for c in key)
