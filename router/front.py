"""The router's outermost ASGI app: the generation routes on bare ASGI, everything else on FastAPI.

POST /generate, /v1/completions and /v1/chat/completions are the hot path: they go straight to
the PD dispatcher (pd.router.dispatch), which reads the body and sends its answer with plain ASGI
messages. FastAPI/Starlette's middleware, routing and Request/Response objects cost about 260 us
of router CPU per request in a py-spy profile of the all-FastAPI router, several times the PD work
itself (the steps since, measured side by side: benchmarks/results/router.md, "What each change
bought"). Other methods on those paths get 405; every other path (admin, health, metrics, info
proxies, 404s) and the lifespan go to the FastAPI app as before.

Also here: the few ASGI helpers the dispatcher needs (request headers, body with a size limit and
deadlines, a whole response).
"""

from __future__ import annotations

import asyncio
import re
from typing import Awaitable, Callable, Iterable, Optional

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from pd.router.errors import error_json
from pd.router.rooms import client_request_id, new_rid

# A path separator spelled percent-encoded (%2F, %5C): uvicorn decodes it into the path, which would make
# /v1%2fcompletions the route /v1/completions (and such a path reach whatever a proxy in front did not filter).
_ENCODED_SEPARATOR = re.compile(rb"%(2f|5c)", re.IGNORECASE)

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


def request_headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (ASGI gives them lower-cased); the first of
    repeated headers wins, as in Starlette's ``Headers.get``."""
    return dict(reversed(scope["headers"]))


class BodyTimeout(Exception):
    """The request body did not arrive in time.

    Attributes:
        received: body bytes that had arrived.
        elapsed: seconds since reading began.
        slow: True when the minimum rate cut it off before the whole-body timeout.
        message: the client's error text, naming the flag that applied.
    """

    def __init__(self, received: int, elapsed: float, slow: bool, timeout: float, min_rate: float):
        self.received, self.elapsed, self.slow = received, elapsed, slow
        if slow:
            self.message = (f"the request body arrived too slowly: {received} bytes in {elapsed:.1f} s, below the "
                            f"minimum of {min_rate:g} bytes/s (--body-read-min-rate)")
        else:
            self.message = f"the request body did not arrive within {timeout:g} s (--body-read-timeout-secs)"
        super().__init__(self.message)


async def read_body(receive: Receive, limit: int, timeout: float, min_rate: float = 0.0,
                    grace: float = 0.0) -> Optional[bytes]:
    """The whole request body, or None once it exceeds ``limit`` bytes (the rest is not read).

    Two deadlines bound it: the whole body within ``timeout`` seconds, and, with ``min_rate`` > 0, a
    minimum rate as Apache's mod_reqtimeout applies it (``body=grace,MinRate=rate``): the body must be
    done by ``grace`` seconds plus 1/``min_rate`` s per byte received so far, so a client trickling a few
    bytes a second is cut off soon after ``grace`` rather than holding its connection for ``timeout``.

    Raises:
        ClientGone: the client went away before the body ended.
        BodyTimeout: a deadline passed first.
    """
    first = None
    cycle = getattr(receive, "__self__", None)
    if type(cycle) is RequestResponseCycle and cycle.message_event.is_set() and not cycle.more_body:
        # uvicorn holds the whole body already (or knows the client left): receive() returns without waiting, so
        # no deadline could pass; the common case skips setting one up (a timer and a task lookup per request).
        first = await receive()
        if first["type"] != "http.request":
            raise ClientGone()
        if not first.get("more_body", False):
            body = first.get("body", b"")
            return body if len(body) <= limit else None
    loop = asyncio.get_running_loop()
    start = loop.time()
    hard = start + timeout
    rated = min_rate > 0 and grace < timeout
    size = 0
    # One timeout whose deadline moves as bytes arrive: the one-message body of nearly every request
    # costs what the plain timeout cost before.
    scope = asyncio.timeout_at(start + grace if rated else hard)
    try:
        async with scope:
            msg = first if first is not None else await receive()
            if msg["type"] != "http.request":
                raise ClientGone()
            body = msg.get("body", b"")
            if not msg.get("more_body", False):  # the common case: one message
                return body if len(body) <= limit else None
            chunks, size = [body], len(body)
            while True:
                if rated:
                    scope.reschedule(min(hard, start + grace + size / min_rate))
                msg = await receive()
                if msg["type"] != "http.request":
                    raise ClientGone()
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return None
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        when = scope.when()  # None only for a scope without a deadline, which this one never is
        raise BodyTimeout(size, loop.time() - start, rated and when is not None and when < hard, timeout,
                          min_rate) from None


def json_content_type(value: Optional[bytes]) -> bool:
    """Whether a request's ``Content-Type`` header may carry a JSON body: none at all, ``application/json``
    or an ``application/*+json`` type, parameters (``charset=utf-8``) aside. Anything else is a 415, as
    sgl-model-gateway answers (its JSON extractor's rule); SGLang's routes parse no other type as JSON."""
    if value is None:
        return True
    mime = value.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def response_headers(content_type: str, extra: Iterable[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    """ASGI header list with ``content-type`` (``; charset=utf-8`` added to a bare ``text/*``, as
    Starlette does) and ``extra``."""
    if content_type.startswith("text/") and "charset" not in content_type:
        content_type += "; charset=utf-8"
    return [(b"content-type", content_type.encode("latin-1")), *extra]


async def send_whole(send: Send, status: int, body: bytes, content_type: str = "application/json",
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send a complete response with ``Content-Length``."""
    headers = response_headers(content_type, extra)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GenerationFront:
    """ASGI app: generation routes to ``handle(scope, receive, send, route)``, the rest to ``app``.

    Args:
        app: the FastAPI app (lifespan, admin, health, metrics, info, errors).
        handle: the dispatcher's entry point of one generation request.
        routes: the paths served on bare ASGI (POST only; other methods get 405).
    """

    def __init__(self, app, handle: Callable[[Scope, Receive, Send, str], Awaitable[None]], routes: Iterable[str]):
        self.app = app
        self.handle = handle
        self.routes = frozenset(routes)
        self.state = app.state  # app.state.router, as on the FastAPI app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            raw = scope.get("raw_path") or b""
            if b"%" in raw and _ENCODED_SEPARATOR.search(raw):  # uvicorn decoded it: /v1%2fcompletions is no route
                return await send_whole(send, 404, error_json(404, f"no route {scope['method']} "
                                                                   f"{raw.decode('latin-1')}"))
            if path in self.routes:
                if scope["method"] == "POST":
                    return await self.handle(scope, receive, send, path)
                # the client's X-Request-Id back, or a fresh one, as on every answer of these routes
                rid = client_request_id(request_headers(scope).get(b"x-request-id")) or new_rid()
                return await send_whole(send, 405, error_json(405, f"no route {scope['method']} {path}"),
                                        extra=[(b"allow", b"POST"), (b"x-request-id", rid.encode())])
        await self.app(scope, receive, send)
