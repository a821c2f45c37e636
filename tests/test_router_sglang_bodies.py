"""What the router sends its engines for ``n > 1`` requests and aborts, read by the pinned SGLang's own code.

The router (``pd.router``) runs over a stand-in prefill/decode pair (tests/standin_engine.py, ``abort_lists``
off: a list ``rid`` to /abort_request gets SGLang's 400) and serves n=4 requests on ``/v1/chat/completions``,
``/v1/completions`` and ``/generate`` (one prompt and a batch of two), streamed and not, and three streams the
client leaves midway (one prompt, a batch of two, a chat), so that the router aborts their samples. Every body
each stand-in received (generation and /abort_request, prefill and decode) then goes through SGLang 0.5.23 in
one subprocess per module (tests/sglang_bodies.py, with the import-only deps of ``.venv/sglang-live``):

- /generate: ``GenerateReqInput(**body)``, ``GenerateReqInput.normalize_batch_and_arguments()``
  (sglang/srt/managers/io_struct.py: ``_determine_batch_size``, ``_handle_parallel_sampling``,
  ``_normalize_bootstrap_params``...), then ``TokenizerManager._handle_batch_request``
  (sglang/srt/managers/tokenizer_manager.py; ``GenerateReqInput.__getitem__``, and for ``n > 1`` the prefix
  warm-up and the sample copies with ``regenerate_rid``) on a manager whose tokenizer and scheduler are stubs
  that record each request it would run;
- /v1/completions: ``protocol.CompletionRequest`` (sglang/srt/entrypoints/openai/protocol.py) and
  ``OpenAIServingCompletion._convert_to_internal_request`` (serving_completions.py), then as /generate;
- /v1/chat/completions: ``protocol.ChatCompletionRequest`` and its ``to_sampling_params``; serving_chat.py does
  not import without xgrammar, so its ``_convert_to_internal_request`` is read with ast for how it passes
  ``bootstrap_host/port/room`` and ``rid`` (unchanged from the request), then as /generate;
- /abort_request: SGLang's own ``abort_request`` route function (sglang/srt/entrypoints/http_server.py, read
  with ast: ``Annotated[AbortReq, Body()]``, its 400 on a validation error) on FastAPI, calling
  ``TokenizerManager.abort_request`` over the rids SGLang's normalisation gave the requests of that side.

The tests assert: every body is one SGLang accepts; every request SGLang would run has
``parallel_sample_num`` 1 (no warm-up request, no rid SGLang made up); every room is an int in [0, 2^63),
unique across all prefill-side requests, and each decode-side room has exactly one prefill-side twin with the
same bootstrap host and port (the prefill stand-in's); every abort reaches a request SGLang knows by that rid,
and a list rid is refused with 400 and then sent as one call per id; the client's answers are well formed.
A router that sent one n=4 body fails: SGLang normalises it to ``parallel_sample_num`` 4 and runs a warm-up
and four samples all on room ``bootstrap_room[0]``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engines import ROOT
from pd.util.wait import wait_until
from pdclient import parse_sse
from routers import RouterProc
from test_router_fanout import BATCH, CHAT, COMPLETION, GENERATE, samples, streamed, with_n
from test_router_faults import running_standins

pytestmark = pytest.mark.slow  # ~10 s: stand-ins, a router and an SGLang import in a subprocess

N = 4
HERE = Path(__file__).parent
LIVE_DEPS = Path(sys.prefix) / "sglang-live"  # `make install` puts SGLang's import-only deps there
ROOM_LIMIT = 2**63  # SGLang's rooms are non-negative signed 64-bit ints (its own router draws them in [0, 2^63))
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")

# (name, route, body, sequences the client gets)
CASES = [(f"{name}-{'stream' if stream else 'whole'}", route, streamed(route, with_n(route, body, N, 1.0), stream),
          prompts * N)
         for stream in (False, True)
         for name, route, body, prompts in [("chat", "/v1/chat/completions", CHAT, 1),
                                            ("completion", "/v1/completions", COMPLETION, 1),
                                            ("generate", "/generate", GENERATE, 1),
                                            ("generate-batch", "/generate", BATCH, 2)]]
# Streams the client leaves after LEAVE_AFTER events: the router aborts every sample. The batch one first, so
# that the router's first abort names a list of rids (SGLang's 400, then one call per id from then on).
LONG = 400
LEFT = [("left-generate-batch", "/generate", dict(with_n("/generate", dict(BATCH, sampling_params={"max_new_tokens":
                                                                                                  LONG}), N, 1.0),
                                                   stream=True)),
        ("left-generate", "/generate", dict(with_n("/generate", dict(GENERATE, sampling_params={"max_new_tokens":
                                                                                               LONG}), N, 1.0),
                                            stream=True)),
        ("left-chat", "/v1/chat/completions", dict(with_n("/v1/chat/completions", dict(CHAT, max_tokens=LONG), N,
                                                          1.0), stream=True))]
LEAVE_AFTER = 2 * N


def _leave_midway(url: str, route: str, body: dict) -> int:
    """Stream ``body``, leave after LEAVE_AFTER events; returns the events seen."""
    seen = 0
    with httpx.Client(timeout=30) as c, c.stream("POST", url + route, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen >= LEAVE_AFTER:
                break
    return seen


def _run_sglang(items: list[dict]) -> dict:
    """tests/sglang_bodies.py over ``items``: id -> record."""
    assert LIVE_DEPS.is_dir(), f"{LIVE_DEPS} is missing; `make install` installs tests/sglang_live_requirements.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "SGLANG_", "TRITON_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIVE_DEPS), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(HERE / "sglang_bodies.py")], input=json.dumps(items), env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    records = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert records and records[-1].get("done"), p.stderr[-4000:]
    return {r["id"]: r for r in records[:-1]}


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """Everything the module checks, from one run: the client's answers, what the stand-ins recorded, and
    SGLang's reading of every body they received."""
    logs = str(tmp_path_factory.mktemp("sglang-bodies-logs"))
    with running_standins(logs, "p0", "d0") as procs:
        pre, dec = procs["p0"], procs["d0"]
        r = RouterProc(["--prefill", pre.url, str(pre.bootstrap_port), "--decode", dec.url,
                        "--health-check-interval", "0"], logs)
        try:
            r.wait_ready()
            for p in procs.values():
                p.control(abort_lists=False)  # as SGLang: a list rid is refused with 400
            answers = {}
            for name, route, body, _ in CASES:
                resp = httpx.post(r.url + route, json=body, timeout=60)
                assert resp.status_code == 200, (name, resp.text)
                answers[name] = parse_sse(resp.content) if body.get("stream") else resp.json()
            dec.control(token_interval=0.05)
            left = {}
            for name, route, body in LEFT:
                before = {q["rid"] if isinstance(q["rid"], str) else tuple(q["rid"])
                          for q in dec.state()["requests"]}
                _leave_midway(r.url, route, body)
                rids = set()
                for q in dec.state()["requests"]:
                    key = q["rid"] if isinstance(q["rid"], str) else tuple(q["rid"])
                    if key not in before:
                        rids.update([q["rid"]] if isinstance(q["rid"], str) else q["rid"])
                left[name] = rids  # the tests check that each was aborted by this very id
                wait_until(lambda: not dec.state()["live"], 15, interval=0.05,
                           what=f"{name}: every sequence on the decode aborted")
            dec.control(token_interval=0)

            def idle() -> bool:
                return all(not p.state()["live"] for p in procs.values())

            wait_until(idle, 15, interval=0.05, what="both stand-ins idle")
            states = {"prefill": pre.state(), "decode": dec.state()}
        finally:
            r.stop()
    items = []
    for side, st in states.items():
        for i, q in enumerate(st["requests"]):
            items.append({"id": f"{side}/req/{i}", "side": side, "route": q["route"], "body": q["body"]})
        for i, body in enumerate(st["abort_bodies"]):
            items.append({"id": f"{side}/abort/{i}", "side": side, "route": "/abort_request", "body": body})
    return {"answers": answers, "left": left, "states": states, "bootstrap_port": pre.bootstrap_port,
            "sglang": _run_sglang(items)}


def _generations(seen, side=None) -> list[dict]:
    return [r for r in seen["sglang"].values() if r["route"] in GENERATION and (side is None or r["side"] == side)]


def _aborts(seen, side=None) -> list[dict]:
    return [r for r in seen["sglang"].values()
            if r["route"] == "/abort_request" and (side is None or r["side"] == side)]


def _ran(seen, side) -> list[dict]:
    """Every request SGLang would run on ``side`` (its scheduler's inputs), with the body record it came from."""
    return [dict(s, source=r["id"]) for r in _generations(seen, side) for s in r.get("sent", [])]


# ---- the tests ------------------------------------------------------------------------------------------------
def test_sglang_accepts_every_generation_body(seen):
    gens = _generations(seen)
    counts = collections.Counter((r["side"], r["route"]) for r in gens)
    assert set(counts) == {(s, r) for s in ("prefill", "decode") for r in GENERATION}, counts
    bad = [(r["id"], r["error"], r["trace"]) for r in gens if not r["valid"]]
    assert not bad, f"SGLang refuses bodies the router sent: {bad[:3]}"


def test_every_request_sglang_runs_is_one_sample(seen):
    many = [(r["id"], r["route"], r["normalized"]) for r in _generations(seen)
            if r["normalized"]["parallel_sample_num"] != 1]
    assert not many, (f"{len(many)} bodies SGLang normalises to parallel_sample_num > 1 (it then runs a warm-up "
                      f"and every sample of a prompt on one room): {many[:3]}")
    openai_n = [(r["id"], r["n"]) for r in _generations(seen) if r["route"] != "/generate" and r["n"] != 1]
    assert not openai_n, openai_n
    warmups = [s for side in ("prefill", "decode") for s in _ran(seen, side) if s["warmup"]]
    assert not warmups, warmups[:3]


def test_prefill_rooms_are_ints_in_range_and_never_shared(seen):
    ran = _ran(seen, "prefill")
    for s in ran:
        room = s["bootstrap_room"]
        assert type(room) is int and 0 <= room < ROOM_LIMIT, s
    rooms = collections.Counter(s["bootstrap_room"] for s in ran)
    shared = {room: f"{c} requests of {sorted({s['source'] for s in ran if s['bootstrap_room'] == room})}"
              for room, c in rooms.items() if c > 1}
    assert not shared, f"{len(shared)} rooms SGLang's prefill would run several requests on: {shared}"
    expected = sum(n for _, _, _, n in CASES) + sum(2 * N if "batch" in name else N for name, _, _ in LEFT)
    assert len(ran) == expected, (len(ran), expected)  # one request per sequence the clients asked for


def test_each_decode_room_has_one_prefill_twin_with_the_same_bootstrap_address(seen):
    prefill = collections.defaultdict(list)
    for s in _ran(seen, "prefill"):
        prefill[s["bootstrap_room"]].append(s)
    decode = _ran(seen, "decode")
    rooms = collections.Counter(s["bootstrap_room"] for s in decode)
    shared = {room: c for room, c in rooms.items() if c > 1}
    assert not shared, f"{len(shared)} rooms SGLang's decode would run several requests on: {shared}"
    for s in decode:
        twins = prefill.get(s["bootstrap_room"], [])
        assert len(twins) == 1, (s, twins)
        (t,) = twins
        assert (s["bootstrap_host"], s["bootstrap_port"]) == (t["bootstrap_host"], t["bootstrap_port"]), (s, t)
        assert s["bootstrap_port"] == seen["bootstrap_port"] and isinstance(s["bootstrap_host"], str), s
    assert len(decode) == len(_ran(seen, "prefill"))


def test_every_abort_reaches_a_request_sglang_knows_by_that_rid(seen):
    aborts = _aborts(seen)
    assert aborts, "no /abort_request reached the stand-ins"
    scalar = [a for a in aborts if isinstance(a["body"].get("rid"), str)]
    unknown = [(a["id"], a["body"]) for a in scalar if a["status"] != 200 or not a["known"]]
    assert not unknown, f"aborts SGLang takes but finds no request for (it drops them): {unknown[:5]}"
    for side in ("prefill", "decode"):
        mine = [a for a in scalar if a["side"] == side]
        dispatched = [rid for a in mine for rid in a["dispatched"]]
        assert sorted(dispatched) == sorted({a["body"]["rid"] for a in mine}), side  # each reached once
    aborted = {a["body"]["rid"] for a in scalar if a["side"] == "decode"}
    for name, rids in seen["left"].items():
        assert len(rids) == (2 * N if "batch" in name else N), (name, rids)
        assert rids <= aborted, (name, rids - aborted)


def test_a_list_rid_is_refused_as_sglang_does_and_each_id_is_then_aborted_alone(seen):
    aborts = _aborts(seen)
    lists = [a for a in aborts if not isinstance(a["body"].get("rid"), str)]
    assert lists, "the batch that was left never got an abort naming a list of rids"
    for a in lists:
        assert a["status"] == 400 and a["dispatched"] == [], a
        alone = {b["body"]["rid"] for b in aborts if b["side"] == a["side"] and isinstance(b["body"].get("rid"), str)
                 and b["status"] == 200}
        assert set(a["body"]["rid"]) <= alone, (a["body"], alone)
    assert all(a["signature"] == "obj: Annotated[AbortReq, Body()], request: Request" for a in aborts)


@pytest.mark.parametrize("name,route,body,sequences", CASES, ids=[c[0] for c in CASES])
def test_the_client_gets_one_answer_with_every_sample(seen, name, route, body, sequences):
    answer = seen["answers"][name]
    texts, _ = samples(route, answer, body.get("stream", False))  # indexes 0.. in order, one [DONE]
    assert len(texts) == sequences
    if route == "/generate" and not body.get("stream"):
        assert isinstance(answer, list) and len(answer) == sequences
    if route != "/generate" and not body.get("stream"):
        assert [c["index"] for c in answer["choices"]] == list(range(sequences))
