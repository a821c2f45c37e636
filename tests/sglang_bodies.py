"""The bodies the router sent to its engines, read by the pinned SGLang's own code; run by
tests/test_router_sglang_bodies.py as ``python tests/sglang_bodies.py < bodies.json``.

Input (stdin): a JSON list of ``{"id": ..., "side": "prefill"|"decode", "route": ROUTE, "body": {...}}``,
ROUTE one of ``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/abort_request``.
Output (stdout): one JSON line per input item, ``{"id", "side", "route", ...}``, then a last line
``{"done": true}``. Which SGLang code reads each kind of body:

- ``/generate``: ``GenerateReqInput(**body)`` then ``GenerateReqInput.normalize_batch_and_arguments()``
  (sglang/srt/managers/io_struct.py), then what ``TokenizerManager.generate_request`` does with it
  (sglang/srt/managers/tokenizer_manager.py): a single request is sent as is, a batch runs SGLang's own
  ``TokenizerManager._handle_batch_request`` (on a manager whose tokenizer and scheduler IPC are stubs that
  record each request sent: ``obj[i]`` / ``GenerateReqInput.__getitem__``, and for ``parallel_sample_num > 1``
  the prefix warm-up and the sample copies with regenerated rids). Record: ``normalized`` (is_single,
  batch_size, parallel_sample_num) and ``sent``: per request SGLang would run, rid, bootstrap_room/host/port,
  ``warmup`` (max_new_tokens 0).
- ``/v1/completions``: ``CompletionRequest.model_validate(body)`` (sglang/srt/entrypoints/openai/protocol.py),
  then ``OpenAIServingCompletion._convert_to_internal_request`` (serving_completions.py) on a serving object
  without a tokenizer (none of it is used there), then as ``/generate``.
- ``/v1/chat/completions``: ``ChatCompletionRequest.model_validate(body)``; serving_chat.py does not import
  here (it needs xgrammar) and its ``_convert_to_internal_request`` needs the chat template, so the
  GenerateReqInput is built as it builds it: ``sampling_params=request.to_sampling_params(...)`` (SGLang's own
  method) and ``bootstrap_host/port/room``, ``rid`` passed through from the request unchanged, which is read
  from serving_chat.py's source with ast (record ``passthrough``); then as ``/generate``.
- ``/abort_request``: SGLang's own route function ``abort_request`` (sglang/srt/entrypoints/http_server.py,
  taken from the source with ast: http_server does not import here) mounted on a FastAPI app with its
  signature ``Annotated[AbortReq, Body()]`` and SGLang's status for a validation error (400, its
  ``validation_exception_handler``), called through Starlette's TestClient; the route calls SGLang's own
  ``TokenizerManager.abort_request`` on a manager whose ``rid_to_state`` holds every rid the ``sent``
  records of that side carried. Record: HTTP status and whether the abort was dispatched to the scheduler.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import os
import sys
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_live_cases import declare_torchvision_ops  # noqa: E402

declare_torchvision_ops()

from sglang.srt.entrypoints.openai import protocol  # noqa: E402
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion  # noqa: E402
from sglang.srt.managers import tokenizer_manager as tm_module  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput  # noqa: E402

SRT = os.path.dirname(os.path.dirname(tm_module.__file__))


class _State:
    """What ``TokenizerManager._init_req_state`` keeps per rid, as far as the paths run here read it."""

    def __init__(self):
        self.abort_sent = False
        self.lora_released = False
        self.prompt_token_ids = None
        self.time_stats = types.SimpleNamespace(set_finished_time=lambda: None)


def stub_manager(sent: list) -> tm_module.TokenizerManager:
    """A TokenizerManager without a tokenizer, model or scheduler: tokenizing copies the request's fields,
    sending records it, every request answers at once."""
    tm = tm_module.TokenizerManager.__new__(tm_module.TokenizerManager)
    tm.rid_to_state = {}
    tm.enable_metrics = False
    tm.dispatched = []

    def init_req_state(obj, request=None):
        if getattr(obj, "is_single", True) is False:  # one state per rid, as _init_req_state
            for rid in obj.rid:
                tm.rid_to_state[rid] = _State()
        else:
            tm.rid_to_state[obj.rid] = _State()

    async def tokenize_one(obj):
        sp = dict(obj.sampling_params or {})
        return types.SimpleNamespace(rid=obj.rid, bootstrap_room=obj.bootstrap_room,
                                     bootstrap_host=obj.bootstrap_host, bootstrap_port=obj.bootstrap_port,
                                     sampling_params=types.SimpleNamespace(max_new_tokens=sp.get("max_new_tokens"),
                                                                           n=sp.get("n", 1)),
                                     stream=obj.stream, mm_inputs=None, time_stats=None)

    async def send_one(tok):
        sent.append({"rid": tok.rid, "bootstrap_room": tok.bootstrap_room, "bootstrap_host": tok.bootstrap_host,
                     "bootstrap_port": tok.bootstrap_port, "n": tok.sampling_params.n,
                     "warmup": tok.sampling_params.max_new_tokens == 0})

    async def wait_one(obj, request=None):
        yield {"text": "", "meta_info": {"id": obj.rid}}

    tm._init_req_state = init_req_state
    tm._tokenize_one_request = tokenize_one
    tm._send_one_request = send_one
    tm._wait_one_response = wait_one
    tm._should_use_batch_tokenization = lambda batch_size, obj: False
    tm._dispatch_to_scheduler = lambda req: tm.dispatched.append(req)
    return tm


def run_generate(obj: GenerateReqInput) -> dict:
    """``obj`` through SGLang's normalisation and the tokenizer manager's expansion into the requests
    it sends its scheduler."""
    obj.normalize_batch_and_arguments()
    out = {"normalized": {"is_single": obj.is_single, "batch_size": obj.batch_size,
                          "parallel_sample_num": obj.parallel_sample_num}}
    sent: list = []
    tm = stub_manager(sent)
    if obj.is_single:  # generate_request: tokenize the one request and send it
        tm._init_req_state(obj)
        asyncio.run(send_one_single(tm, obj))
    else:
        tm._init_req_state(obj)
        states = {rid: tm.rid_to_state[rid] for rid in obj.rid}

        async def drain():
            async for _ in tm._handle_batch_request(obj, None, states):
                pass

        asyncio.run(drain())
    out["sent"] = sent
    return out


async def send_one_single(tm, obj):
    await tm._send_one_request(await tm._tokenize_one_request(obj))


def _chat_passthrough() -> dict:
    """The keyword arguments serving_chat.py's ``_convert_to_internal_request`` gives GenerateReqInput for
    the fields the router sets, as source text."""
    src = open(os.path.join(SRT, "entrypoints", "openai", "serving_chat.py")).read()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "_convert_to_internal_request")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == "GenerateReqInput")
    kw = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
    return {k: kw.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid", "sampling_params",
                                   "stream")}


CHAT_PASSTHROUGH = None


def check_chat(body: dict) -> dict:
    global CHAT_PASSTHROUGH
    if CHAT_PASSTHROUGH is None:
        CHAT_PASSTHROUGH = _chat_passthrough()
    req = protocol.ChatCompletionRequest.model_validate(body)
    out = {"valid": True, "n": req.n, "rid": req.rid, "bootstrap_room": req.bootstrap_room,
           "bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
           "passthrough": CHAT_PASSTHROUGH, "conversion": "mirrored (serving_chat.py does not import here)"}
    want = {"bootstrap_host": "request.bootstrap_host", "bootstrap_port": "request.bootstrap_port",
            "bootstrap_room": "request.bootstrap_room", "rid": "request.rid", "stream": "request.stream"}
    if any(CHAT_PASSTHROUGH[k] != v for k, v in want.items()):
        raise AssertionError(f"serving_chat.py no longer passes the fields through as read: {CHAT_PASSTHROUGH}")
    sp = req.to_sampling_params(stop=[], model_generation_config={})
    obj = GenerateReqInput(text="<chat template applied>", sampling_params=sp, stream=req.stream,
                           bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
                           bootstrap_room=req.bootstrap_room, rid=req.rid)
    out.update(run_generate(obj))
    return out


def check_completion(body: dict) -> dict:
    req = protocol.CompletionRequest.model_validate(body)
    out = {"valid": True, "n": req.n, "rid": req.rid, "bootstrap_room": req.bootstrap_room,
           "bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
           "conversion": "OpenAIServingCompletion._convert_to_internal_request"}
    serving = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    serving.template_manager = types.SimpleNamespace(completion_template_name=None)
    serving.tokenizer_manager = types.SimpleNamespace(served_model_name=req.model)
    serving.allowed_custom_labels = None
    obj, _ = serving._convert_to_internal_request(req, None)
    out.update(run_generate(obj))
    return out


def check_generate(body: dict) -> dict:
    obj = GenerateReqInput(**body)
    out = {"valid": True, "rid": body.get("rid"), "bootstrap_room": body.get("bootstrap_room")}
    out.update(run_generate(obj))
    return out


# ---- /abort_request through SGLang's own route function ---------------------------------------------------
def abort_app(tm):
    """A FastAPI app with SGLang's ``abort_request`` route function (its source, decorators replaced by a
    plain ``app.post``) over ``tm``, and SGLang's 400 for a body that fails validation."""
    from typing import Annotated

    from fastapi import Body, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    src = open(os.path.join(SRT, "entrypoints", "http_server.py")).read()
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "abort_request")
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    assert decorators[0] == "app.post('/abort_request')", decorators
    signature = ast.unparse(fn.args)
    fn.decorator_list = []
    app = FastAPI()
    scope = {"Annotated": Annotated, "AbortReq": AbortReq, "Body": Body, "Request": Request, "Response": Response,
             "_global_state": types.SimpleNamespace(tokenizer_manager=tm),
             "_create_error_response": lambda e: JSONResponse({"error": repr(e)}, status_code=500)}
    exec(compile(ast.Module([fn], []), "http_server.py", "exec"), scope)
    app.post("/abort_request")(scope["abort_request"])

    @app.exception_handler(RequestValidationError)
    async def validation_exception_handler(request, exc):  # http_server.py: 400 on this path
        return JSONResponse({"object": "error", "message": str(exc), "code": 400}, status_code=400)

    return app, signature


def check_aborts(items: list, sent_rids: dict) -> list:
    from starlette.testclient import TestClient

    # SGLang's default single tokenizer worker (``--tokenizer-worker-num 1``): TokenizerManager.abort_request
    # drops an abort whose rid it does not know (no server args are published in this process to read it from)
    tm_module.get_serving = lambda: types.SimpleNamespace(tokenizer_worker_num=1)

    out = []
    managers = {}
    for it in items:
        side = it["side"]
        if side not in managers:
            tm = stub_manager([])
            for rid in sent_rids.get(side, ()):
                tm.rid_to_state[rid] = _State()
            app, signature = abort_app(tm)
            managers[side] = (tm, TestClient(app), signature)
        tm, client, signature = managers[side]
        before = len(tm.dispatched)
        try:
            r = client.post("/abort_request", json=it["body"])
            rec = {"status": r.status_code, "answer": r.text[:300],
                   "dispatched": [d.rid for d in tm.dispatched[before:]], "signature": signature,
                   "known": it["body"].get("rid") in tm.rid_to_state if isinstance(it["body"].get("rid"), str)
                   else False}
        except Exception as e:  # noqa: BLE001
            rec = {"status": None, "error": repr(e), "trace": traceback.format_exc()[-2000:]}
        out.append({**{k: it[k] for k in ("id", "side", "route")}, "body": it["body"], **rec})
    return out


CHECKS = {"/generate": check_generate, "/v1/completions": check_completion,
          "/v1/chat/completions": check_chat}


def main() -> None:
    items = json.load(sys.stdin)
    sent_rids: dict = {}
    for it in items:
        if it["route"] == "/abort_request":
            continue
        rec = {k: it[k] for k in ("id", "side", "route")}
        try:
            rec.update(CHECKS[it["route"]](copy.deepcopy(it["body"])))
            # the warm-up request of a n > 1 batch is the only one with an id SGLang made up; the rest are abortable
            sent_rids.setdefault(it["side"], set()).update(s["rid"] for s in rec["sent"] if not s["warmup"])
        except Exception as e:  # noqa: BLE001  (recorded: the test names the body SGLang refused)
            rec.update(valid=False, error=repr(e), trace=traceback.format_exc()[-2000:])
        print(json.dumps(rec), flush=True)
    for rec in check_aborts([it for it in items if it["route"] == "/abort_request"], sent_rids):
        print(json.dumps(rec), flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
