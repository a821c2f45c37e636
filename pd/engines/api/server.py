"""HTTP server of the reference engine (FastAPI + uvicorn), speaking SGLang's HTTP protocol.

Routes: POST /generate, /v1/completions, /v1/chat/completions, /abort_request; GET /v1/models,
/health, /health_generate, /get_server_info (/server_info), /get_model_info (/model_info),
/metrics. With ``--api-key`` every route but /health*, /ready* and /metrics needs the key
(pd.engines.api.auth: 401 ``{"error": "Unauthorized"}`` without it, as SGLang's). Errors are HTTP 4xx/5xx
with ``{"error": {"message", "type", "param", "code"}}``; inside a stream (after HTTP 200 was sent) as
a ``data: {"error": ...}`` chunk before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from typing import AsyncIterator, Callable, Optional, TypeVar

import pydantic
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pd
from pd.engines.api import generate_api, openai_api
from pd.engines.api.auth import ApiKeyMiddleware
from pd.engines.api.limits import RequestLimits
from pd.engines.engine_core import EngineCore
from pd.engines.errors import EngineError, EngineSettingsError, bad_request
from pd.engines.handoff.decode_engine import DecodeEngineCore
from pd.engines.handoff.prefill_engine import PrefillEngineCore
from pd.engines.metrics import EngineMetrics
from pd.engines.models.model_runner import ModelRunner
from pd.engines.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, check_unsupported
from pd.engines.sequence import Sequence
from pd.engines.settings import ResolvedSettings, build_parser, parse_settings, resolve
from pd.engines.spec.decoder import SpecDecoder
from pd.util import jsonbody
from pd.util.connection_guard import ConnectionGuard, ConnectionLimits

log = logging.getLogger("pd.engine")
HEALTH_CHECK_TIMEOUT = 20.0  # seconds, SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
# The engine core of each --disaggregation-mode.
CORES: dict[str, type[EngineCore]] = {"null": EngineCore, "prefill": PrefillEngineCore, "decode": DecodeEngineCore}
M = TypeVar("M", bound=pydantic.BaseModel)


def error_response(e: EngineError) -> JSONResponse:
    """The JSON error response for an EngineError, with its HTTP status."""
    return JSONResponse(e.body(), status_code=e.status)


def sse(obj) -> bytes:
    """One server-sent event ``data: <json>`` frame."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style bodies for the errors FastAPI itself answers: 404 (no route), 405 (wrong method) and
    400 instead of its 422 for query parameters that do not validate (``/flush_cache?timeout=soon``)."""
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(EngineError(exc.status_code, msg))

    async def invalid(_request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        field = str(err["loc"][-1]) if err.get("loc") else None
        return error_response(bad_request(f"{field}: {err['msg']}" if field else err["msg"], field))

    # starlette types a handler as taking any Exception; each is registered for its own exception class
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]


def is_json_type(content_type: Optional[str]) -> bool:
    """Whether a request's ``Content-Type`` may carry a JSON body: none at all, ``application/json`` or a
    ``+json`` type, any parameters (``charset=utf-8``) aside. SGLang's FastAPI routes parse no other
    type as JSON, and sgl-model-gateway answers 415 to one."""
    if content_type is None:
        return True
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


async def read_json(request: Request, limit: int):
    """The request body as JSON (pd.util.jsonbody: no NaN/Infinity, no lone surrogates, any nesting).

    Raises:
        EngineError: 415 for a content type that is not JSON, 413 over ``limit`` bytes, 400 for
            malformed JSON or a value no field can take (naming it).
    """
    content_type = request.headers.get("content-type")
    if not is_json_type(content_type):
        raise EngineError(415, f"Content-Type {content_type!r} is not JSON; send 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise EngineError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise EngineError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return jsonbody.loads(b"".join(chunks) or b"null")
    except jsonbody.BadJSON as e:
        raise bad_request(f"invalid JSON body: {e}", e.path or None) from None
    except ValueError as e:  # UnicodeDecodeError is one
        raise bad_request(f"malformed JSON body: {e}") from None


def parse(model: type[M], body) -> M:
    """Validate ``body`` against ``model``; 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
        raise bad_request(f"{field}: {msg}" if field else msg, field) from None


def load_speculative(runner: ModelRunner, args: ResolvedSettings) -> SpecDecoder:
    """Load the draft next to the target (the built-in model's own draft unless
    ``--speculative-draft-model-path`` names one) and return the decoder that drives it.

    Raises:
        ValueError: the draft does not fit the target (hidden size, vocabulary), naming the flag.
    """
    from pd.engines.spec.draft_model import DraftModel, resolve_draft_path

    cfg = args.speculative_config
    assert cfg is not None
    path = resolve_draft_path(args.model_path, cfg.draft_model_path)
    return SpecDecoder(runner, DraftModel(path, runner, args.dtype), cfg)


class EngineServer:
    """The FastAPI application around one EngineCore."""

    def __init__(self, args: ResolvedSettings):
        self.args = args
        self.served_name = args.served_model_name or args.model_path
        self._runner: Optional[ModelRunner] = None  # both set by the lifespan, before any request is served
        self._core: Optional[EngineCore] = None
        self.metrics = EngineMetrics(self.served_name, args.disaggregation_mode)
        self.started = time.time()
        self.app = FastAPI(title="pdserve reference engine", lifespan=self._lifespan)
        self.app.add_exception_handler(EngineError, lambda _r, e: error_response(e))
        self.app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)  # SGLang's --api-key (pd.engines.api.auth)
        self._routes()

    @property
    def runner(self) -> ModelRunner:
        """The loaded model.

        Raises:
            RuntimeError: the app's lifespan has not loaded it yet.
        """
        if self._runner is None:
            raise RuntimeError("the engine's model is not loaded: the app's lifespan has not started")
        return self._runner

    @property
    def core(self) -> EngineCore:
        """The engine core.

        Raises:
            RuntimeError: the app's lifespan has not made it yet.
        """
        if self._core is None:
            raise RuntimeError("the engine core is not running: the app's lifespan has not started it")
        return self._core

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app):
        loop = asyncio.get_running_loop()
        runner = self._runner = await loop.run_in_executor(None, ModelRunner, self.args.model_path, self.args.dtype)
        spec = None
        if self.args.speculative_config is not None:
            spec = await loop.run_in_executor(None, load_speculative, runner, self.args)
        core = self._core = CORES[self.args.disaggregation_mode](runner, self.args, self.metrics, spec)
        await core.start()
        try:
            yield
        finally:
            await core.stop()

    # ---- request plumbing ---------------------------------------------------------------
    async def _run(self, request: Request, reqs, stream: bool, full: Callable, chunks: Callable) -> Response:
        """Submit sequences and answer: one JSON body, or an SSE stream of ``chunks(seq)``."""
        seqs = self.core.submit(reqs)
        tasks = [s.task for s in seqs if s.task is not None]  # submit started every one
        queue: asyncio.Queue = asyncio.Queue()
        for s in seqs:
            s.listener = queue
        if not stream:
            watcher = asyncio.create_task(self._watch_disconnect(request, seqs))
            try:
                await asyncio.wait(tasks)
            finally:
                watcher.cancel()
            errors = [s.error for s in seqs if s.error is not None]
            if errors:
                return error_response(errors[0])
            return JSONResponse(full(seqs))
        # Pull the first event before answering 200, so an early failure is a plain HTTP error.
        first = await queue.get()
        if first.error is not None:
            for s in seqs:
                self.core.cancel(s, "another sequence of the request failed")
            return error_response(first.error)
        queue.put_nowait(first)
        return StreamingResponse(self._sse(seqs, tasks, queue, chunks), media_type="text/event-stream")

    async def _sse(self, seqs: list[Sequence], tasks: list[asyncio.Task], queue: asyncio.Queue,
                   chunks: Callable) -> AsyncIterator[bytes]:
        try:
            while not all(t.done() for t in tasks) or not queue.empty():
                seq = await queue.get()
                if seq.error is not None:
                    yield sse(seq.error.body())
                    break
                for c in chunks(seq):
                    yield sse(c)
            for c in chunks(None):
                yield sse(c)
            yield SSE_DONE
        finally:
            for s in seqs:  # client went away (or a sequence failed): release everything
                self.core.cancel(s, "client disconnected")

    async def _watch_disconnect(self, request: Request, seqs: list[Sequence]) -> None:
        while True:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                for s in seqs:
                    self.core.cancel(s, "client disconnected")
                return

    # ---- routes -------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app
        install_error_handlers(app)
        limit = self.args.max_body_bytes
        caps = RequestLimits.from_args(self.args)  # before anything is tokenized: 400 over a cap

        @app.post("/generate")
        async def generate(request: Request):
            body = await read_json(request, limit)
            req = parse(GenerateRequest, body)
            check_unsupported("/generate", body)
            caps.check_generate(req)
            reqs, is_single = generate_api.requests_from_generate(req, self.runner)
            renderers = self._generate_renderers(reqs, is_single, req.return_text_in_logprobs)
            return await self._run(request, reqs, req.stream, *renderers)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await read_json(request, limit)
            req = parse(CompletionRequest, body)
            check_unsupported("/v1/completions", body)
            caps.check_completion(req)
            openai_api.check_model(req.model, self._model_names())
            reqs = openai_api.requests_from_completion(req, self.runner)
            return await self._run(request, reqs, req.stream, *self._openai_renderers("completion", req))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            body = await read_json(request, limit)
            req = parse(ChatCompletionRequest, body)
            check_unsupported("/v1/chat/completions", body)
            caps.check_chat(req)
            openai_api.check_model(req.model, self._model_names())
            reqs = openai_api.requests_from_chat(req, self.runner)
            return await self._run(request, reqs, req.stream, *self._openai_renderers("chat", req))

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "pdserve",
                "root": self.args.model_path, "max_model_len": self.runner.context_length,
            }]}

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(timeout: float = 0.0):
            """SGLang's /flush_cache (``?timeout=`` seconds to wait for the engine to go idle): empties the radix
            prefix cache (an ``AllBlocksCleared`` KV event follows); like SGLang, it refuses (400) while requests
            run, so a benchmark's flush after its warm-up means the same thing on both engines."""
            if not 0 <= timeout < math.inf:  # NaN too
                raise bad_request("timeout must be a finite number of seconds >= 0", "timeout")
            deadline = time.monotonic() + min(timeout, 600.0)
            while self.core.sequences and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.core.sequences:
                return Response(f"Flush cache failed: {len(self.core.sequences)} requests are running.\n",
                                status_code=400)
            if self.core.prefix is not None and not self.core.prefix.flush():
                return Response("Flush cache failed: cached pages are still read by a KV transfer.\n",
                                status_code=400)
            self.core.update_pool_metrics()
            return Response("Cache flushed.\n", status_code=200)

        @app.get("/health_generate")
        async def health_generate():
            try:
                await asyncio.wait_for(self.core.health_generate(), HEALTH_CHECK_TIMEOUT)
            except asyncio.TimeoutError:
                return Response(status_code=503)
            return Response(status_code=200)

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info():
            info = {k: v for k, v in vars(self.args).items()
                    if isinstance(v, (str, int, float, bool, type(None))) and k != "api_key"}  # never the key
            pool = self.core.pool
            info.update({
                "version": pd.__version__,
                "engine": "pdserve-reference",
                "served_model_name": self.served_name,
                "context_length": self.runner.context_length,
                "scheduler_info": {
                    "status": "ready",
                    "max_total_num_tokens": pool.num_pages * pool.page_size if pool else self.args.max_total_tokens,
                    "max_req_input_len": self.runner.context_length - 1,
                },
                "kv_events": self.core.kv_events_source(),
                "kv_pages_held": pool.held if pool else 0,
                "kv_pages_total": pool.num_pages if pool else 0,
                "transfer_session_id": self.core.transfer.session_id if self.core.transfer else None,
                "torch_num_threads": torch.get_num_threads(),
                "torch_num_interop_threads": torch.get_num_interop_threads(),
            })
            return info

        @app.get("/get_model_info")
        @app.get("/model_info")
        async def model_info():
            cfg = self.runner.config
            return {
                "model_path": self.args.model_path, "served_model_name": self.served_name,
                # a directory a client's AutoTokenizer loads (builtin:* names resolve to their checkpoint)
                "tokenizer_path": self.runner.local_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "disaggregation_mode": self.args.disaggregation_mode,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
            }

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = await read_json(request, limit)
            if not isinstance(body, dict):
                raise bad_request("the request body must be a JSON object")
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            # one id (SGLang's AbortReq) or a list of them: the router aborts a request's sequences in one call
            if not (isinstance(rid, str) or isinstance(rid, list) and all(isinstance(r, str) for r in rid)):
                raise bad_request("rid must be a string or a list of strings", "rid")
            if not isinstance(abort_all, bool):  # "false" is a string, and truthy: it must not abort everything
                raise bad_request("abort_all must be a JSON boolean", "abort_all")
            self.core.abort(rid, abort_all)
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_names(self) -> set[str]:
        return {self.served_name, self.args.model_path}

    # ---- renderers ----------------------------------------------------------------------
    def _generate_renderers(self, reqs, is_single: bool, with_text: bool):
        runner = self.runner

        def full(seqs):
            results = [generate_api.generate_result(s, runner, with_text) for s in seqs]
            return results[0] if is_single else results

        sent: dict[int, tuple] = {}

        def chunks(seq):
            if seq is None:
                return []
            text = seq.stable_text()
            key = (len(seq.output_ids), text, seq.done)
            if sent.get(seq.req.index) == key or (not seq.output_ids and not seq.done):
                return []
            sent[seq.req.index] = key
            out = generate_api.generate_result(seq, runner, with_text, text=text)
            if not is_single:
                out["index"] = seq.req.index
            return [out]

        return full, chunks

    def _openai_renderers(self, kind: str, req):
        echo = openai_api.echo_texts(req, self.runner) if kind == "completion" else None
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        responder = openai_api.OpenAIResponder(kind, req.model or self.served_name, self.runner, req.n, echo,
                                               include_usage, self.args.enable_cache_report)
        state: dict[int, dict] = {}
        done_seqs: dict[int, Sequence] = {}

        def chunks(seq):
            if seq is None:
                if include_usage:
                    return [responder.chunk([], openai_api.usage(list(done_seqs.values()), req.n,
                                                                      self.args.enable_cache_report))]
                return []
            st = state.setdefault(seq.req.index, {"text": "", "lp": 0, "first": True, "final": False})
            if st["final"]:
                return []
            text = seq.stable_text()
            delta = text[len(st["text"]):] if text.startswith(st["text"]) else ""
            final = seq.done
            if not delta and not final and not st["first"] and len(seq.output_ids) == st["lp"]:
                return []
            choice = responder.delta_choice(seq, delta, st["lp"], st["first"], final)
            st.update(text=st["text"] + delta, lp=len(seq.output_ids), first=False, final=final)
            if final:
                done_seqs[seq.req.index] = seq
            return [responder.chunk([choice])]

        return responder.full, chunks


def set_cpu_threads(n: int) -> None:
    """Give torch ``n`` intra-op and inter-op threads; call before any torch work (the model load)."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # the inter-op pool already started (torch allows setting it once, before use)
        log.warning("torch inter-op threads already started; left at %d", torch.get_num_interop_threads())
    log.info("torch threads: %d intra-op, %d inter-op", torch.get_num_threads(), torch.get_num_interop_threads())


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``pdserve engine``."""
    import uvicorn

    try:
        args = resolve(parse_settings(sys.argv[1:] if argv is None else argv))
    except EngineSettingsError as e:
        build_parser().error(str(e))  # argparse's usage line and exit status 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: health probes and per-request peer calls would flood the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    set_cpu_threads(args.cpu_threads)
    server = EngineServer(args)

    class _Server(uvicorn.Server):
        # SGLang's ready line, logged once the socket listens (a port in use must not look ready in the log)
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                log.info("The server is fired up and ready to roll! (%s mode, model %s, port %d)",
                         args.disaggregation_mode, server.served_name, args.port)

    # The router's limits on client connections (pd.util.connection_guard), at their defaults.
    limits = ConnectionLimits.auto()
    refused = server.metrics.connections_refused
    guard = ConnectionGuard(limits, on_refuse=lambda reason: refused.labels(reason=reason).inc())
    _Server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                           timeout_graceful_shutdown=5, access_log=False, http=guard.protocol(), loop="uvloop",
                           # uvicorn annotates int seconds; its keep-alive timer takes a float as well
                           timeout_keep_alive=limits.keep_alive_timeout)).run()  # type: ignore[arg-type]
