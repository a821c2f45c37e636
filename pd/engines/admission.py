"""Whether the engine can run a generated sequence, decided before anything is held for it."""

from __future__ import annotations

from typing import Optional

from pd.engines.errors import EngineError, bad_request
from pd.engines.handoff.bootstrap import BootstrapServer
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.models.model_runner import ModelRunner
from pd.engines.protocol import SeqRequest


def validate_request(req: SeqRequest, runner: ModelRunner, mode: str, pool: Optional[KVPagePool],
                     bootstrap: Optional[BootstrapServer], decode_rooms: set[int]) -> None:
    """Refuse a sequence before anything is held for it.

    Args:
        mode: the engine's ``--disaggregation-mode`` (``null``, ``prefill``, ``decode``).
        pool: the KV page pool (None on a ``null`` engine); ``bootstrap``: the prefill's bootstrap server.
        decode_rooms: bootstrap rooms active on this decode.

    Raises:
        EngineError: 400 for an empty/too-long prompt, a token outside the vocabulary, bad sampling values, a PD
            request without bootstrap fields, or one whose KV can never fit the pool; 409 for a room already
            active here; 500 for a room the decode already aborted.
    """
    n = len(req.prompt_ids)
    if n == 0:
        raise bad_request("the prompt is empty", "prompt")
    bad = [t for t in req.prompt_ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise bad_request(f"input_ids: token {bad[0]} is outside the vocabulary [0, {runner.vocab_size})",
                          "input_ids")
    req.params.validate_for(runner.vocab_size)
    max_new = req.params.max_new_tokens or 0
    ctx = runner.context_length
    if n + max_new >= ctx:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {n + max_new} tokens: {n} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.",
            "max_tokens",
        )
    if req.top_logprobs_num < 0:
        raise bad_request("top_logprobs_num must be >= 0", "top_logprobs_num")
    if pool is not None and pool.pages_for(n) > pool.num_pages:  # a null engine has a pool for its prefix cache
        raise bad_request(f"{n} prompt tokens need {pool.pages_for(n)} KV pages; the pool has {pool.num_pages}",
                          "prompt")
    if mode == "null":
        return
    b = req.bootstrap
    if b is None:
        raise bad_request(
            f"Disaggregated request received without bootstrap room id (this engine runs with "
            f"--disaggregation-mode {mode}); send bootstrap_host, bootstrap_port and bootstrap_room",
            "bootstrap_room",
        )
    assert pool is not None, "a prefill or decode engine has its KV pool once started"
    if mode == "decode":
        if not b.host or b.port is None:
            raise bad_request("bootstrap_host and bootstrap_port are required on a decode engine", "bootstrap_host")
        if b.room in decode_rooms:
            raise EngineError(409, f"bootstrap room {b.room} is already active on this decode", "bootstrap_room")
        return
    assert bootstrap is not None
    if b.room in bootstrap.rooms and bootstrap.rooms[b.room].prefill_attached:
        raise EngineError(409, f"bootstrap room {b.room} is already active on this prefill", "bootstrap_room")
    aborted = bootstrap.tombstone_reason(b.room)
    if aborted is not None:
        raise EngineError(500, f"Prefill bootstrap failed for request rid={req.rid!r} "
                               f"bootstrap_room={b.room}: the room was aborted by the decode: {aborted}")
