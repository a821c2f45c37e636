"""The reference engine's ``--api-key``: SGLang's check, on the HTTP server and the bootstrap server.

Mirrors sglang/srt/utils/auth.py (``decide_request_auth`` and ``add_api_key_middleware``, the "normal"
endpoint level, which is every route of this engine): with a key set, every request needs
``Authorization: Bearer KEY`` (constant-time comparison) except ``OPTIONS`` and paths starting with
``/health``, ``/ready`` or ``/metrics`` (probes and Prometheus scrape without secrets); anything else
gets HTTP 401 with SGLang's body ``{"error": "Unauthorized"}``. A pure ASGI middleware, as SGLang's,
so a client's disconnect still reaches the route (a stream is cancelled when its client leaves).

The key comes from ``--api-key`` (SGLang's flag) or, so that it stays off ``ps`` output, from
``$PDSERVE_ENGINE_API_KEY`` (what the launcher sets; pd.engines.settings).
"""

from __future__ import annotations

import json
import secrets
from typing import Optional

OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang's always-allowed paths
UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


def bearer_matches(header: Optional[bytes], key: str) -> bool:
    """Whether a raw ``Authorization`` header value is ``Bearer <key>`` (scheme case-insensitive, as SGLang's)."""
    if not header:
        return False
    scheme, sep, token = header.decode("latin-1").partition(" ")
    return bool(sep) and scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def auth_headers(key: Optional[str]) -> dict[str, str]:
    """The headers that carry ``key`` to a peer engine (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class ApiKeyMiddleware:
    """ASGI middleware refusing requests without the key (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        api_key: the key; None or empty = every request passes.
    """

    def __init__(self, app, api_key: Optional[str]):
        self.app = app
        self.api_key = api_key or None

    def allowed(self, scope) -> bool:
        """May this HTTP request through? (OPTIONS and the open prefixes always may.)"""
        if self.api_key is None or scope.get("method") == "OPTIONS":
            return True
        if scope.get("path", "").startswith(OPEN_PREFIXES):
            return True
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        return bearer_matches(header, self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})
