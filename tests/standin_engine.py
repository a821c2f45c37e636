"""A stand-in SGLang PD engine for router fault-injection tests: no model, exact bookkeeping, and
faults on command.

It speaks what the router uses of SGLang: ``POST /generate``, ``/v1/completions``,
``/v1/chat/completions`` (single, batches, ``n``, streams with ``data: [DONE]``, SGLang's result
shapes and ``finish_reason`` values), ``POST /abort_request`` (SGLang's semantics: the id must be
a live sequence's exact id, then every live sequence with that prefix is aborted; ``rid`` may be a
list of such ids, as the reference engine takes, unless ``abort_lists`` is off: then a list gets
the pinned SGLang's 400), ``GET
/health``, ``/health_generate``, ``/v1/models``, ``/get_model_info``, ``/get_server_info``.

PD between stand-ins, over a small HTTP bootstrap server on the prefill's bootstrap port: the
decode registers each sequence's room there, then waits for the prefill's verdict on it; the
prefill waits (up to ``--bootstrap-timeout``) until the decode registered the room, then
"transfers". A decode whose prefill never comes waits up to ``--waiting-timeout`` (like SGLang's
``--disaggregation-waiting-timeout``), so a router that forgets to abort it is caught. An
aborted prefill room is *not* told to the decode unless ``propagate_aborts`` is on (SGLang's
decode does not learn of it either).

Control (tests only): ``POST /control`` with any of
``{"faults": [...], "clear_faults": true, "health": STATUS, "propagate_aborts": bool,
"token_interval": seconds, "abort_lists": bool}`` appends faults (after clearing the pending ones) /
sets values; ``POST /control/reset`` clears faults and the records;
``GET /control`` returns ``{"requests": [...] (each with the whole ``body`` as received), "aborts": [rid...],
"abort_calls": [[rid...] per /abort_request call, [] for a refused one], "abort_bodies": [body per
/abort_request call], "live": [rid...], "aborted": [rid...], "finished": n}``.
A fault is ``{"kind": K, "count": N (default 1), ...}``,
used by the next N generation requests:

- ``status``: answer ``status`` (default 503) with an OpenAI-style error, touching nothing.
- ``drop``: close the connection without an answer.
- ``stall``: keep the request open without answering until the client leaves or it is aborted.
- ``abort_rooms``: (prefill) sequences whose index is odd end with finish reason ``abort``
  (``every`` changes the modulus) and their rooms are marked aborted.
- ``stream_error_first``: a stream answers 200 whose first event is an error chunk (code
  ``status``, default 500), then ``[DONE]``.
- ``drop_mid_stream``: a stream sends ``after`` token events (default 2), then drops the connection.
- ``delay``: after the PD handoff, wait ``seconds`` before answering (a slow first token).

Run: ``python tests/standin_engine.py --role prefill --port N --bootstrap-port M``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Optional

from aiohttp import ClientSession, ClientTimeout, web

TOKEN_TEXT = " t"


def error_json(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "ServerError" if status >= 500 else "BadRequestError",
                      "param": None, "code": status}}


class Room:
    """One bootstrap room as the prefill's bootstrap server sees it."""

    def __init__(self) -> None:
        self.registered = asyncio.Event()
        self.verdict: asyncio.Future = asyncio.get_running_loop().create_future()  # "done" | "aborted"


class Seq:
    """One generated sequence."""

    def __init__(self, index: int, rid: str, room: Optional[int], host, port, prompt_tokens: int, max_tokens: int):
        self.index, self.rid, self.room, self.host, self.port = index, rid, room, host, port
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.tokens = 0
        self.abort = asyncio.Event()
        self.finish: Optional[dict] = None  # SGLang's finish_reason


def _list(value, count: int) -> list:
    return list(value) if isinstance(value, list) else [value] * count


class StandIn:
    def __init__(self, args: argparse.Namespace):
        self.role = args.role
        self.args = args
        self.faults: list[dict] = []
        self.health = 200
        self.propagate_aborts = False
        self.token_interval = args.token_interval
        self.requests: list[dict] = []
        self.aborts: list[str] = []
        self.abort_calls: list[list[str]] = []
        self.abort_bodies: list = []  # every /abort_request body as received, refused ones too
        self.abort_lists = True
        self.live: dict[str, Seq] = {}
        self.aborted: list[str] = []
        self.finished = 0
        self.rooms: dict[int, Room] = {}  # prefill: its bootstrap table
        self.session: Optional[ClientSession] = None

    # ---- faults ---------------------------------------------------------------------------------
    def take_fault(self) -> Optional[dict]:
        if not self.faults:
            return None
        f = self.faults[0]
        f["count"] = f.get("count", 1) - 1
        if f["count"] <= 0:
            self.faults.pop(0)
        return f

    # ---- request parsing ------------------------------------------------------------------------
    def expand(self, route: str, body: dict) -> tuple[list[Seq], bool]:
        """Sequences of a request (prompt-major, P x n) and whether the answer is a list."""
        if route == "/generate":
            prompts = body.get("text") if body.get("text") is not None else body.get("input_ids")
            is_batch = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
            plist = prompts if is_batch else [prompts]
            sp = body.get("sampling_params") or {}
            sp = sp[0] if isinstance(sp, list) else sp
            n, max_tokens = sp.get("n", 1), sp.get("max_new_tokens", 8)
        else:
            prompt = body.get("prompt") if route == "/v1/completions" else json.dumps(body.get("messages"))
            is_batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
            plist = prompt if is_batch else [prompt]
            n, max_tokens = body.get("n", 1), body.get("max_tokens", 8)
        count = len(plist) * n
        rid = body.get("rid")
        if rid is None:
            rids = [f"auto-{time.monotonic_ns()}-{i}" for i in range(count)]
        elif isinstance(rid, str):
            rids = [rid] if count == 1 and not is_batch else [f"{rid}_{i}" for i in range(count)]
        else:
            rids = list(rid)
        rooms = _list(body.get("bootstrap_room"), count)
        hosts = _list(body.get("bootstrap_host"), count)
        ports = _list(body.get("bootstrap_port"), count)
        seqs = []
        for p, prompt in enumerate(plist):
            for s in range(n):
                i = p * n + s
                ptoks = len(prompt) if isinstance(prompt, list) else len(str(prompt).encode())
                seqs.append(Seq(i, rids[i], rooms[i], hosts[i], ports[i], ptoks,
                                1 if self.role == "prefill" else max_tokens))
        return seqs, bool(is_batch) or n > 1  # SGLang answers a list for a batch or n > 1

    # ---- the PD handoff -------------------------------------------------------------------------
    def room(self, room: int) -> Room:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = Room()
        return r

    async def run_prefill(self, seq: Seq, abort_it: bool) -> None:
        r = self.room(seq.room)
        waiter = asyncio.ensure_future(r.registered.wait())
        aborted = asyncio.ensure_future(seq.abort.wait())
        done, _ = await asyncio.wait({waiter, aborted}, timeout=self.args.bootstrap_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        aborted.cancel()
        if seq.abort.is_set() or abort_it:
            seq.finish = {"type": "abort", "message": "Aborted"}
            if not r.verdict.done():
                r.verdict.set_result("aborted")
            return
        if not done:
            raise web.HTTPInternalServerError(
                text=json.dumps(error_json(500, f"bootstrap timeout for room {seq.room}")),
                content_type="application/json")
        seq.tokens = 1
        seq.finish = {"type": "length", "length": 1}
        if not r.verdict.done():
            r.verdict.set_result("done")

    async def wait_for_kv(self, seq: Seq) -> None:
        """Decode: register the room with the prefill's bootstrap server, wait for its verdict."""
        base = f"http://{seq.host}:{seq.port}"
        try:
            async with self.session.post(f"{base}/register", json={"room": seq.room},
                                         timeout=ClientTimeout(total=5)) as r:
                await r.read()
        except Exception as e:  # the prefill is gone: fail fast, as SGLang's decode does
            raise web.HTTPInternalServerError(
                text=json.dumps(error_json(500, f"prefill bootstrap {base} unreachable: {e!r}")),
                content_type="application/json")
        poll = asyncio.ensure_future(self._poll(base, seq.room))
        aborted = asyncio.ensure_future(seq.abort.wait())
        done, _ = await asyncio.wait({poll, aborted}, timeout=self.args.waiting_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if seq.abort.is_set():
            poll.cancel()
            return
        if not done:
            poll.cancel()
            raise web.HTTPInternalServerError(text=json.dumps(error_json(500, f"waiting timeout for room {seq.room}")),
                                              content_type="application/json")
        if poll.exception() is not None or poll.result() == "aborted":
            seq.finish = {"type": "abort", "message": "aborted by the prefill"}
            seq.abort.set()

    async def _poll(self, base: str, room: int) -> str:
        while True:
            async with self.session.get(f"{base}/verdict/{room}", timeout=ClientTimeout(total=60)) as r:
                data = await r.json()
            if data["verdict"] == "aborted" and not data["propagate"]:
                await asyncio.sleep(3600)  # SGLang's decode is not told: it waits until aborted
            if data["verdict"] is not None:
                return data["verdict"]

    # ---- results --------------------------------------------------------------------------------
    def generate_obj(self, seq: Seq, shown: int, final: bool, body: dict) -> dict:
        fin = seq.finish if final else None
        meta = {"id": seq.rid, "finish_reason": fin, "prompt_tokens": seq.prompt_tokens,
                "completion_tokens": shown, "cached_tokens": 0}
        if body.get("return_logprob"):
            n_in = seq.prompt_tokens if self.role == "prefill" else 0
            meta["input_token_logprobs"] = [[-1.0, 1, None]] * n_in
            meta["output_token_logprobs"] = [[-0.5, 2, None]] * shown
        return {"text": TOKEN_TEXT * shown, "output_ids": [2] * shown, "meta_info": meta}

    def openai_finish(self, seq: Seq) -> Optional[str]:
        if seq.finish is None:
            return None
        return "abort" if seq.finish["type"] == "abort" else seq.finish["type"]

    async def answer(self, request: web.Request, route: str, body: dict, seqs: list[Seq], is_list: bool,
                     fault: Optional[dict]) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        if not stream:
            if route == "/generate":
                objs = [self.generate_obj(s, s.tokens, True, body) for s in seqs]
                return web.json_response(objs if is_list else objs[0])
            kind = "chat.completion" if route.endswith("chat/completions") else "text_completion"
            choices = []
            for s in seqs:
                c = {"index": s.index, "finish_reason": self.openai_finish(s)}
                if kind == "chat.completion":
                    c["message"] = {"role": "assistant", "content": TOKEN_TEXT * s.tokens}
                else:
                    c["text"] = TOKEN_TEXT * s.tokens
                choices.append(c)
            usage = {"prompt_tokens": seqs[0].prompt_tokens, "completion_tokens": sum(s.tokens for s in seqs),
                     "total_tokens": seqs[0].prompt_tokens + sum(s.tokens for s in seqs)}
            return web.json_response({"id": "cmpl-standin", "object": kind, "created": int(time.time()),
                                      "model": "standin", "choices": choices, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if fault and fault["kind"] == "stream_error_first":
            status = fault.get("status", 500)
            await resp.write(b"data: " + json.dumps(error_json(status, "stand-in stream error")).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        drop_after = fault.get("after", 2) if fault and fault["kind"] == "drop_mid_stream" else None
        sent = 0
        shown = {s.index: 0 for s in seqs}
        pending = list(seqs)
        while pending:  # one event per sequence per step, like a decode batch
            for s in list(pending):
                k = shown[s.index] = min(shown[s.index] + 1, s.tokens)
                final = k >= s.tokens
                await resp.write(b"data: " + json.dumps(self.event(route, s, k, final, body, is_list)).encode()
                                 + b"\n\n")
                sent += 1
                if drop_after is not None and sent >= drop_after:
                    request.transport.close()
                    return resp
                if final:
                    pending.remove(s)
            if pending and self.token_interval:
                await asyncio.sleep(self.token_interval)
        so = body.get("stream_options") or {}
        if route != "/generate" and so.get("include_usage"):
            usage = {"prompt_tokens": seqs[0].prompt_tokens, "completion_tokens": sum(s.tokens for s in seqs),
                     "total_tokens": seqs[0].prompt_tokens + sum(s.tokens for s in seqs)}
            await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def event(self, route: str, s: Seq, shown: int, final: bool, body: dict, is_list: bool) -> dict:
        if route == "/generate":
            obj = self.generate_obj(s, shown, final, body)
            if is_list:
                obj["index"] = s.index
            return obj
        fin = self.openai_finish(s) if final else None
        text = TOKEN_TEXT if shown else ""
        if route.endswith("chat/completions"):
            choice = {"index": s.index, "delta": {"content": text}, "finish_reason": fin}
        else:
            choice = {"index": s.index, "text": text, "finish_reason": fin}
        return {"id": "x", "object": "chunk", "choices": [choice], "usage": None}

    # ---- routes ---------------------------------------------------------------------------------
    async def generation(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(error_json(400, "malformed JSON body"), status=400)
        fault = self.take_fault()
        seqs, is_list = self.expand(route, body)
        self.requests.append({"route": route, "rid": body.get("rid"), "rooms": body.get("bootstrap_room"),
                              "hosts": body.get("bootstrap_host"), "ports": body.get("bootstrap_port"),
                              "x_request_id": request.headers.get("X-Request-Id"),
                              "authorization": request.headers.get("Authorization"),
                              "stream": bool(body.get("stream")), "count": len(seqs),
                              "stream_options": body.get("stream_options"), "fault": fault and fault["kind"],
                              "body": body})
        if fault and fault["kind"] == "status":
            status = fault.get("status", 503)
            return web.json_response(error_json(status, fault.get("message", f"stand-in fault {status}")),
                                     status=status)
        if fault and fault["kind"] == "drop":
            request.transport.close()
            return web.Response(status=500)
        for s in seqs:
            self.live[s.rid] = s
        try:
            if fault and fault["kind"] == "stall":
                await asyncio.wait([asyncio.ensure_future(s.abort.wait()) for s in seqs],
                                   return_when=asyncio.FIRST_COMPLETED)
                for s in seqs:
                    s.finish = {"type": "abort", "message": "Aborted"}
                return await self.answer(request, route, body, seqs, is_list, None)
            every = fault.get("every", 2) if fault and fault["kind"] == "abort_rooms" else None
            if self.role == "prefill":
                await asyncio.gather(*(self.run_prefill(s, every is not None and s.index % every == 1) for s in seqs))
            else:
                await asyncio.gather(*(self.wait_for_kv(s) for s in seqs))
                for s in seqs:
                    if s.abort.is_set() and s.finish is None:
                        s.finish = {"type": "abort", "message": "Aborted"}
                    elif s.finish is None:
                        s.tokens = s.max_tokens
                        s.finish = {"type": "length", "length": s.tokens}
            if fault and fault["kind"] == "delay":  # after the handoff: a slow first token (an abort ends it)
                waits = [asyncio.ensure_future(s.abort.wait()) for s in seqs]
                await asyncio.wait(waits, timeout=fault.get("seconds", 1), return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
            return await self.answer(request, route, body, seqs, is_list, fault)
        except asyncio.CancelledError:  # the client went away: SGLang aborts its requests
            for s in seqs:
                if s.rid in self.live:
                    self.aborted.append(s.rid)
            raise
        finally:
            for s in seqs:
                if self.live.pop(s.rid, None) is not None:
                    if s.finish is not None and s.finish["type"] == "abort":
                        self.aborted.append(s.rid)
                    else:
                        self.finished += 1

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.abort_bodies.append(body)
        rid = body.get("rid", "")
        if isinstance(rid, list) and not self.abort_lists:
            self.abort_calls.append([])
            return web.json_response(error_json(400, "rid: Input should be a valid string"), status=400)
        rids = rid if isinstance(rid, list) else [rid]
        self.aborts.extend(rids)
        self.abort_calls.append(rids)
        if body.get("abort_all"):
            hits = list(self.live.values())
        else:  # SGLang's tokenizer manager: exact id first, then prefix in the scheduler
            hits = [s for r, s in self.live.items() if any(x in self.live and r.startswith(x) for x in rids)]
        for s in hits:
            s.finish = {"type": "abort", "message": "Aborted"}
            s.abort.set()
        return web.Response(status=200)

    async def control(self, request: web.Request) -> web.Response:
        if request.method == "GET":
            return web.json_response({"requests": self.requests, "aborts": self.aborts,
                                      "abort_calls": self.abort_calls, "abort_bodies": self.abort_bodies,
                                      "live": list(self.live),
                                      "aborted": self.aborted, "finished": self.finished})
        if request.path.endswith("/reset"):
            self.faults.clear()
            self.requests.clear()
            self.aborts.clear()
            self.abort_calls.clear()
            self.abort_bodies.clear()
            self.abort_lists = True
            self.aborted.clear()
            self.finished = 0
            self.health = 200
            self.propagate_aborts = False
            self.token_interval = self.args.token_interval
            return web.json_response({})
        body = await request.json()
        if body.get("clear_faults"):
            self.faults.clear()
        self.faults.extend(body.get("faults", []))
        self.health = body.get("health", self.health)
        self.propagate_aborts = body.get("propagate_aborts", self.propagate_aborts)
        self.token_interval = body.get("token_interval", self.token_interval)
        self.abort_lists = body.get("abort_lists", self.abort_lists)
        return web.json_response({})

    async def health_route(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health)

    async def info(self, request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})
        return web.json_response({"disaggregation_mode": self.role, "engine": "standin"})

    # ---- bootstrap server (prefill) -------------------------------------------------------------
    async def bs_register(self, request: web.Request) -> web.Response:
        self.room((await request.json())["room"]).registered.set()
        return web.json_response({})

    async def bs_verdict(self, request: web.Request) -> web.Response:
        r = self.room(int(request.match_info["room"]))
        try:
            verdict = await asyncio.wait_for(asyncio.shield(r.verdict), 30)
        except asyncio.TimeoutError:
            verdict = None
        return web.json_response({"verdict": verdict, "propagate": self.propagate_aborts})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, handler_args={"handler_cancellation": True})
        for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(route, self.generation)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_route("*", "/control", self.control)
        app.router.add_post("/control/reset", self.control)
        app.router.add_get("/health", self.health_route)
        app.router.add_get("/health_generate", self.health_route)
        for path in ("/v1/models", "/get_model_info", "/get_server_info", "/model_info", "/server_info"):
            app.router.add_get(path, self.info)
        return app

    def bootstrap_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/register", self.bs_register)
        app.router.add_get("/verdict/{room}", self.bs_verdict)
        return app


async def serve(args: argparse.Namespace) -> None:
    engine = StandIn(args)
    engine.session = ClientSession()
    runners = []
    apps = [(engine.app(), args.port)]
    if args.role == "prefill":
        apps.append((engine.bootstrap_app(), args.bootstrap_port))
    for app, port in apps:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, args.host, port).start()
        runners.append(runner)
    print(f"stand-in {args.role} ready on {args.host}:{args.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for r in runners:
            await r.cleanup()
        await engine.session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int)
    p.add_argument("--token-interval", type=float, default=0.0, help="seconds between stream events")
    p.add_argument("--bootstrap-timeout", type=float, default=30.0, help="prefill: seconds to wait for the decode")
    p.add_argument("--waiting-timeout", type=float, default=30.0, help="decode: seconds to wait for the KV")
    args = p.parse_args()
    if args.role == "prefill" and not args.bootstrap_port:
        p.error("--bootstrap-port is required for a prefill")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
