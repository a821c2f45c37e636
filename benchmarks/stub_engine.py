"""A minimal, fast stand-in for an SGLang prefill or decode server, for router benchmarks.

It speaks just enough of SGLang's HTTP API for a PD router to be measured without any model work:

* ``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``: the body must be a JSON
  object (else 400). The bootstrap fields a PD router adds (``bootstrap_host``, ``bootstrap_port``,
  ``bootstrap_room``) are accepted and counted, not used. The answer has SGLang's shape:
  non-streaming, one JSON object ``{"text", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", ...}}``; with ``"stream": true``, Server-Sent Events over chunked transfer
  encoding, one ``data: {...}`` event per generated token, then ``data: [DONE]``. The number of
  tokens is ``sampling_params.max_new_tokens`` (/generate) or ``max_tokens`` (OpenAI routes),
  default ``--default-tokens``; a prefill always generates one token, as SGLang's prefill does.
  Streams advance like a real engine's decode batch: one step writes the next token event of every
  open stream (one socket write each, so events reach the router one by one, interleaved across
  streams), then the step loop sleeps ``--token-interval`` seconds (0 = only yields to the event
  loop, so new requests are taken between steps; a positive interval gives slow streams for
  memory tests).
* ``GET /health``, ``/health_generate``: 200. ``GET /get_server_info``, ``/get_model_info``,
  ``/model_info``, ``/v1/models``: small JSON. ``POST /abort_request``, ``/flush_cache``: 200.
* ``GET /stub_stats``: counters since start, ``{"requests", "with_bootstrap", "streams",
  "active_streams", "max_active_streams", "bad_requests"}``; a benchmark diffs them to check that a
  router really sent every request to both sides with the bootstrap fields.
* Anything else: 404.

One process, one thread: asyncio (uvloop when installed) with httptools' HTTP/1.1 parser and
keep-alive. Requests on one connection are answered in order; pipelined requests are not
supported (no client used by the benchmarks pipelines).

Run: ``python benchmarks/stub_engine.py --role decode --port 31001 [--token-interval 0.25]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys

import httptools
import orjson

GENERATION_ROUTES = (b"/generate", b"/v1/completions", b"/v1/chat/completions")
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_TOKENS = 4096  # upper bound of tokens per answer, so one request cannot make the stub build a huge body
TOKEN_TEXT = " tok"  # every generated token decodes to this text (4 bytes, like a short real token)
RID_MARK = "@@RID@@"  # placeholder for the request id inside cached event templates (JSON-safe as is)


def _response(status: bytes, body: bytes, content_type: bytes = b"application/json", keep_alive: bool = True) -> bytes:
    return b"".join((b"HTTP/1.1 ", status, b"\r\nContent-Type: ", content_type,
                     b"\r\nContent-Length: ", str(len(body)).encode(),
                     b"" if keep_alive else b"\r\nConnection: close", b"\r\n\r\n", body))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n")
SSE_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class Stats:
    """Counters the benchmark reads from ``GET /stub_stats``."""

    def __init__(self):
        self.requests = 0
        self.with_bootstrap = 0
        self.streams = 0
        self.active_streams = 0
        self.max_active_streams = 0
        self.bad_requests = 0

    def as_json(self) -> bytes:
        return orjson.dumps(self.__dict__)


class Stub:
    """Answers for one role.

    Args:
        role: ``prefill`` (always one token) or ``decode``.
        default_tokens: tokens per answer when the request does not say.
        token_interval: seconds between decode steps, i.e. between two tokens of one stream
            (0 = only yield to the event loop).
    """

    def __init__(self, role: str, default_tokens: int, token_interval: float):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if default_tokens < 1:
            raise ValueError(f"default_tokens must be >= 1, got {default_tokens}")
        if token_interval < 0:
            raise ValueError(f"token_interval must be >= 0 seconds, got {token_interval}")
        self.role = role
        self.default_tokens = default_tokens
        self.token_interval = token_interval
        self.stats = Stats()
        self._ids = itertools.count()
        self._templates: dict[int, list[list[bytes]]] = {}
        self.info = orjson.dumps({"role": role, "model_path": "stub", "disaggregation_mode": role,
                                  "internal_states": [{"last_gen_throughput": 0.0}]})
        self.models = orjson.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]})
        self.open_streams: dict["HttpConnection", "OpenStream"] = {}
        self._wake = asyncio.Event()

    def start_stream(self, conn: "HttpConnection", rid: str, n: int, keep_alive: bool) -> None:
        conn.transport.write(SSE_HEAD + (b"\r\n" if keep_alive else b"Connection: close\r\n\r\n"))
        self.open_streams[conn] = OpenStream(self.events(rid, n), keep_alive)
        st = self.stats
        st.streams += 1
        st.active_streams = len(self.open_streams)
        st.max_active_streams = max(st.max_active_streams, st.active_streams)
        self._wake.set()

    def drop_stream(self, conn: "HttpConnection") -> None:
        if self.open_streams.pop(conn, None) is not None:
            self.stats.active_streams = len(self.open_streams)

    async def step_loop(self) -> None:
        """Forever: one token to every open stream, then sleep ``token_interval`` (an engine's
        decode step); idle while no stream is open."""
        while True:
            if not self.open_streams:
                self._wake.clear()
                await self._wake.wait()
            for conn, st in list(self.open_streams.items()):
                t = conn.transport
                if t is None or t.is_closing():
                    self.drop_stream(conn)
                    continue
                t.write(st.frames[st.next])
                st.next += 1
                if st.next == len(st.frames):
                    t.write(SSE_DONE)
                    self.drop_stream(conn)
                    if not st.keep_alive:
                        t.close()
            await asyncio.sleep(self.token_interval)

    def tokens(self, route: bytes, req: dict) -> int:
        if self.role == "prefill":
            return 1
        if route == b"/generate":
            sp = req.get("sampling_params")
            n = sp.get("max_new_tokens") if isinstance(sp, dict) else None
        else:
            n = req.get("max_tokens")
        if not isinstance(n, int) or n < 1:
            n = self.default_tokens
        return min(n, MAX_TOKENS)

    def rid(self, req: dict) -> str:
        rid = req.get("rid")
        return rid if isinstance(rid, str) else f"stub-{next(self._ids)}"

    @staticmethod
    def meta(rid: str, prompt_tokens: int, completion: int, finished: bool) -> dict:
        return {"id": rid, "finish_reason": {"type": "length", "length": completion} if finished else None,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion, "cached_tokens": 0}

    def full_answer(self, rid: str, n: int) -> bytes:
        return orjson.dumps({"text": TOKEN_TEXT * n, "output_ids": list(range(n)),
                             "meta_info": self.meta(rid, 8, n, True)})

    def events(self, rid: str, n: int) -> list[bytes]:
        """The chunked-encoding frames of the ``n`` SSE events (without the final [DONE]).

        The JSON of each event is built once per ``n`` around a placeholder id and only the rid
        is spliced in per request: the stub must stay much cheaper than the router it feeds."""
        templates = self._templates.get(n)
        if templates is None:
            templates = self._templates[n] = [
                (b"data: " + orjson.dumps({"text": TOKEN_TEXT * (i + 1), "output_ids": [i],
                                           "meta_info": self.meta(RID_MARK, 8, i + 1, i + 1 == n)}) + b"\n\n"
                 ).split(RID_MARK.encode())
                for i in range(n)]
        rid_b = orjson.dumps(rid)[1:-1]
        return [_chunk(rid_b.join(parts)) for parts in templates]


class OpenStream:
    """A stream in progress: its event frames and the index of the next one to send."""

    __slots__ = ("frames", "next", "keep_alive")

    def __init__(self, frames: list[bytes], keep_alive: bool):
        self.frames = frames
        self.next = 0
        self.keep_alive = keep_alive


class HttpConnection(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer from the ``Stub``."""

    def __init__(self, stub: Stub):
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.stub.drop_stream(self)
        self.transport = None

    def data_received(self, data: bytes):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.stub.stats.bad_requests += 1
            self.transport.write(_response(b"400 Bad Request", orjson.dumps({"error": f"bad HTTP: {e}"}),
                                           keep_alive=False))
            self.transport.close()

    # ---- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self):
        self.url = b""
        self.body = []

    def on_url(self, url: bytes):
        self.url += url

    def on_body(self, body: bytes):
        self.body.append(body)

    def on_message_complete(self):
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        out = self.answer(method, path, b"".join(self.body), keep_alive)
        if out is not None:
            self.transport.write(out)
            if not keep_alive:
                self.transport.close()

    # ---- routes -------------------------------------------------------------------------
    def answer(self, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> bytes | None:
        """The whole response, or None when the step loop writes it (a stream)."""
        stub = self.stub
        if method == b"POST" and path in GENERATION_ROUTES:
            try:
                req = orjson.loads(body)
                if not isinstance(req, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as e:
                stub.stats.bad_requests += 1
                return _response(b"400 Bad Request", orjson.dumps({"error": f"malformed JSON body: {e}"}),
                                 keep_alive=keep_alive)
            stub.stats.requests += 1
            if all(f in req for f in BOOTSTRAP_FIELDS):
                stub.stats.with_bootstrap += 1
            n, rid = stub.tokens(path, req), stub.rid(req)
            if req.get("stream") is True:
                stub.start_stream(self, rid, n, keep_alive)
                return None
            return _response(b"200 OK", stub.full_answer(rid, n), keep_alive=keep_alive)
        if method == b"GET":
            if path in (b"/health", b"/health_generate"):
                return OK_EMPTY
            if path in (b"/get_server_info", b"/server_info", b"/get_model_info", b"/model_info"):
                return _response(b"200 OK", stub.info, keep_alive=keep_alive)
            if path == b"/v1/models":
                return _response(b"200 OK", stub.models, keep_alive=keep_alive)
            if path == b"/stub_stats":
                return _response(b"200 OK", stub.stats.as_json(), keep_alive=keep_alive)
        if method == b"POST" and path in (b"/abort_request", b"/flush_cache"):
            return OK_EMPTY
        return _response(b"404 Not Found", orjson.dumps({"error": f"no route {method.decode()} {path.decode()}"}),
                         keep_alive=keep_alive)


async def serve(args: argparse.Namespace) -> None:
    stub = Stub(args.role, args.default_tokens, args.token_interval)
    loop = asyncio.get_running_loop()
    steps = loop.create_task(stub.step_loop())
    server = await loop.create_server(lambda: HttpConnection(stub), args.host, args.port, backlog=4096,
                                      reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = server.sockets[0].getsockname()[1]
    print(f"stub {args.role} ready on http://{args.host}:{port} (pid {os.getpid()})", flush=True)
    await stop.wait()
    steps.cancel()
    server.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="stub_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--default-tokens", type=int, default=64, help="tokens per answer when the request does not say")
    p.add_argument("--token-interval", type=float, default=0.0, help="seconds between streamed tokens (decode)")
    args = p.parse_args(argv)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(args))
    except ValueError as e:
        sys.exit(f"stub_engine: {e}")


if __name__ == "__main__":
    main()
