"""Errors the router itself produces, as OpenAI-style bodies
``{"error": {"message", "type", "param", "code"}}`` (the engines answer in the same shape), and
the errors a failed exchange with a worker raises."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import httpx
from starlette.responses import Response

# What a failed exchange with a worker raises: the httpx client's errors (pd.router.client), timeouts
# and socket errors (pd.router.upstream's UpstreamError is an OSError).
UPSTREAM_ERRORS = (httpx.HTTPError, asyncio.TimeoutError, OSError)
# The ones of them that mean "timed out" (httpx raises its own for a phase's timeout).
TIMEOUT_ERRORS = (asyncio.TimeoutError, httpx.TimeoutException)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 409: "ConflictError", 413: "PayloadTooLargeError",
          429: "RateLimitError",
          499: "ClientClosedRequest", 502: "BadGatewayError", 503: "ServiceUnavailableError",
          504: "GatewayTimeoutError"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """The OpenAI-style error object for HTTP ``status``."""
    kind = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_json(status: int, message: str, param: Optional[str] = None) -> bytes:
    """``error_body`` encoded as JSON bytes."""
    return json.dumps(error_body(status, message, param)).encode()


def error_response(status: int, message: str, param: Optional[str] = None, extra: Optional[dict] = None,
                   headers: Optional[dict] = None) -> Response:
    """A JSON error response; ``extra`` keys are added next to ``error`` (e.g. which workers failed)."""
    body = error_body(status, message, param)
    if extra:
        body.update(extra)
    return Response(json.dumps(body).encode(), status_code=status, media_type="application/json", headers=headers)
