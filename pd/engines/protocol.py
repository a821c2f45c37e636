"""Request bodies the reference engine accepts, and their expansion into generated sequences.

Shapes follow SGLang 0.5.23: ``GenerateReqInput`` (sglang/srt/managers/io_struct.py) for
/generate and the OpenAI ``CompletionRequest`` / ``ChatCompletionRequest``
(sglang/srt/entrypoints/openai/protocol.py), including the PD fields ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` (scalar or list).

Expansion of a batch of P prompts with ``n`` samples (``expand``) is prompt-major (item
``i = p * n + s``, the order SGLang's TokenizerManager sends and returns them in); a list of
bootstrap rooms has ``P * n`` distinct entries indexed by ``i``; a scalar room ``r`` gives item
``i`` the room ``r + i``.

Fields the reference engine does not implement (``check_unsupported``): the models below read only what
the engine honours and ignore other keys (``extra="ignore"``, as SGLang's own OpenAI models do: pydantic's
default), so every other field of SGLang 0.5.23's request models is listed in ``UNSUPPORTED`` and refused
with a 400 naming it whenever it is set to anything but its default (null, false, 0, an empty list or
object: SDKs send defaults), rather than accepted and silently ignored:

- output constraints: ``response_format`` other than ``{"type": "text"}`` (json_schema, json_object,
  structural tags), ``json_schema``, ``regex``, ``ebnf``, ``stop_regex``; tools: ``tools`` (non-empty),
  ``tool_choice`` other than ``auto`` / ``none`` (nothing to call without tools);
- sampling the engine does not do: ``best_of`` > 1, ``suffix`` (insertion), ``custom_logit_processor``,
  ``custom_params``, ``watermark``, ``lora_path``; sessions (``session_id``, ``session_params``); chat
  template options (``chat_template_kwargs``, ``reasoning_effort``, ``reasoning``, ``thinking``, ``task``,
  ``continue_final_message``) and pre-tokenized chat ``input_ids``; multimodal inputs and processor knobs;
- extra outputs it never returns: ``return_hidden_states``, ``return_routed_experts`` (and a non-zero
  ``routed_experts_start_len``), ``return_token_ids``, ``return_prompt_token_ids``, ``return_meta_info``,
  the sglext / flat-logprob / sampling-mask switches, ``return_cached_tokens_details``,
  ``return_spec_tokens_details``, ``token_ids_logprob``, ``stream_options.continuous_usage_stats``;
- placement it cannot honour: ``extra_key`` / ``cache_salt`` (prefix-cache isolation), a data-parallel
  rank other than 0 (it has one), ``decode_tp_size`` other than 1, ``bootstrap_pair_key``, ``kv_hints``,
  ``max_thinking_tokens``, ``require_reasoning``;
- /v1/completions ``top_logprobs``: not a field of SGLang's CompletionRequest (OpenAI's completions API
  counts top logprobs with an integer ``logprobs``), which would drop it; refused, naming ``logprobs: N``.

Fields that pass although the engine does nothing with them, because for a single-model server they
change no output: ``user``, ``priority`` (a scheduling hint), ``custom_labels`` (metric labels),
``routing_key`` (a router's), ``parallel_tool_calls`` and ``return_flat_raw_top_logprobs_b64`` (no effect
without tools / the flat logprobs, both refused), ``separate_reasoning`` / ``stream_reasoning`` (no
effect without a reasoning parser, as in SGLang without ``--reasoning-parser``). Keys in none of
SGLang's models (OpenAI's ``metadata``, ``store``, ...) are ignored, as SGLang's models ignore them.
``sampling_params`` keys of /generate are pd.engines.sampling's (an unknown one is refused there, as
SGLang's /generate contract does).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, field_validator

from pd.engines.errors import bad_request
from pd.engines.sampling import SamplingParams

ScalarOrList = Union[Any, list]


class GenerateRequest(BaseModel):
    """SGLang's native /generate body (the fields the reference engine honours)."""

    # strict: JSON types as SGLang's /generate contract checks them ("stream": "yes" is not a boolean)
    model_config = ConfigDict(extra="ignore", strict=True)

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    stream: bool = False
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    return_text_in_logprobs: bool = False
    rid: Optional[Union[str, list[str]]] = None
    bootstrap_host: Optional[Union[str, list[Optional[str]]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[Optional[int]]]] = None


# ---- fields the reference engine does not implement (see the module docstring) ----------------------
_BOOL = TypeAdapter(bool)
_INT = TypeAdapter(int)


def _off(v: Any) -> bool:
    """Null or false as a lax pydantic bool reads it (``false``, ``0``, ``"no"``), or a list of those."""
    if isinstance(v, list):
        return all(_off(x) for x in v)
    if v is None:
        return True
    try:
        return _BOOL.validate_python(v) is False
    except ValidationError:
        return False


def _empty(v: Any) -> bool:
    """Null, ``""``, ``{}``, ``[]`` or a list of those (``lora_path: [null, null]``)."""
    if isinstance(v, list):
        return all(_empty(x) for x in v)
    return v is None or (isinstance(v, (str, dict)) and not v)


def _int_is(*allowed: int):
    def check(v: Any) -> bool:
        if isinstance(v, list):
            return all(check(x) for x in v)
        if v is None:
            return True
        try:
            return _INT.validate_python(v) in allowed
        except ValidationError:
            return False
    return check


def _text_format(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and v.get("type") == "text")


def _no_tool_call(v: Any) -> bool:
    return v is None or v in ("auto", "none")


_OUTPUTS = {name: _off for name in ("return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
                                    "return_spec_tokens_details", "return_token_ids")}
_OPENAI_COMMON = {
    **_OUTPUTS, "routed_experts_start_len": _int_is(0),
    "response_format": _text_format, "regex": _empty, "ebnf": _empty, "stop_regex": _empty,
    "lora_path": _empty, "session_id": _empty, "session_params": _empty, "custom_params": _empty,
    "custom_logit_processor": _empty, "watermark": _empty, "images_config": _empty,
    "mm_processor_kwargs": _empty, "extra_key": _empty, "cache_salt": _empty,
    "routed_dp_rank": _int_is(0), "data_parallel_rank": _int_is(0), "disagg_prefill_dp_rank": _int_is(0),
}

# route -> field -> whether the value is one the engine serves as asked (its default, or a no-op value)
UNSUPPORTED: dict[str, dict[str, Any]] = {
    "/v1/completions": {
        **_OPENAI_COMMON, "best_of": _int_is(1), "suffix": _empty, "json_schema": _empty,
        "top_logprobs": lambda v: v is None,
    },
    "/v1/chat/completions": {
        **_OPENAI_COMMON, "tools": _empty, "tool_choice": _no_tool_call,
        **{name: _off for name in ("return_prompt_token_ids", "return_meta_info", "return_input_ids_in_sglext",
                                   "return_output_ids_in_sglext", "return_sampling_mask",
                                   "return_flat_raw_output_top_logprobs", "continue_final_message",
                                   "use_audio_in_video")},
        "sampling_logprobs_mode": _empty, "reasoning_effort": _empty, "reasoning": _empty, "thinking": _empty,
        "task": _empty, "chat_template_kwargs": _empty, "max_dynamic_patch": _empty, "min_dynamic_patch": _empty,
        "video_config": _empty, "input_ids": _empty,
    },
    "/generate": {
        **{name: _off for name in ("return_hidden_states", "require_reasoning", "return_prompt_token_ids",
                                   "return_sampling_mask")},
        **{name: _empty for name in ("token_ids_logprob", "image_data", "video_data", "audio_data", "mm_hashes",
                                     "modalities", "images_config", "lora_path", "session_params", "session_id",
                                     "custom_logit_processor", "kv_hints", "max_thinking_tokens", "extra_key",
                                     "cache_salt", "bootstrap_pair_key")},
        "routed_experts_start_len": _int_is(0), "routed_dp_rank": _int_is(0), "disagg_prefill_dp_rank": _int_is(0),
        "decode_tp_size": _int_is(1),
    },
}

_HINTS = {
    "top_logprobs": " on /v1/completions (SGLang's CompletionRequest has no such field): ask for N top logprobs "
                    "per token with an integer logprobs: N",
    "best_of": " (best_of > 1)",
    "response_format": " (only {\"type\": \"text\"})",
    "tool_choice": " (only \"auto\" or \"none\": tools are not supported)",
}


def check_unsupported(route: str, body: dict) -> None:
    """Refuse a field of SGLang's request model for ``route`` that the reference engine does not implement,
    when it is set to anything but its default (``UNSUPPORTED``; the module docstring lists them and why).

    Raises:
        EngineError: 400 ``"<field> is not supported by the reference engine"`` naming the field.
    """
    for name, served in UNSUPPORTED[route].items():
        if name in body and not served(body[name]):
            raise bad_request(f"{name} is not supported by the reference engine{_HINTS.get(name, '')}", name)
    options = body.get("stream_options") if route != "/generate" else None
    if isinstance(options, dict) and not _off(options.get("continuous_usage_stats")):
        raise bad_request("stream_options.continuous_usage_stats is not supported by the reference engine",
                          "stream_options.continuous_usage_stats")


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a final usage chunk."""
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _OpenAIBase(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, plus SGLang's
    extra sampling fields and the PD bootstrap fields)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: Optional[Union[str, list[str]]] = None
    bootstrap_host: Optional[Union[str, list[Optional[str]]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[Optional[int]]]] = None

    def sampling(self, max_tokens_default: Optional[int]) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens if self.max_tokens is not None else max_tokens_default,
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            sampling_seed=self.seed,
        )


class CompletionRequest(_OpenAIBase):
    """OpenAI /v1/completions body."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False


# SGLang 0.5.23's chat message roles (sglang/srt/entrypoints/openai/protocol.py: "user" and the generic
# message roles), matched case-insensitively as SGLang does.
CHAT_ROLES = ("user", "system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


class ChatMessage(BaseModel):
    """One chat message: role and content (text, or a list of content parts); other fields are kept."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict]]] = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v.lower() not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)} (case-insensitive), got {v!r}")
        return v.lower()


class ChatCompletionRequest(_OpenAIBase):
    """OpenAI /v1/chat/completions body."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


@dataclass
class Bootstrap:
    """Where a decode finds its prefill for one sequence: the PD ``bootstrap room`` and the
    prefill's bootstrap server."""

    host: Optional[str]
    port: Optional[int]
    room: int


@dataclass
class SeqRequest:
    """One generated sequence, the unit the engine core runs.

    Attributes:
        index: position in the expanded batch (prompt-major, see ``expand``).
        prompt_index / sample_index: which prompt and which of its ``n`` samples.
        prompt_ids: token ids of the prompt.
        seed: sampling seed (request ``seed`` / ``sampling_seed``, else random; sample ``s`` of a
            seeded request uses ``seed + s`` wrapped into int64, as a router that fans ``n`` out stamps
            it, so parallel samples differ).
        logprob_start_len: first prompt position whose logprob is returned; -1 = none of the prompt.
    """

    index: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    rid: str
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    bootstrap: Optional[Bootstrap] = None
    extra: dict = field(default_factory=dict)


def per_item(value: Any, count: int, name: str, repeat: int = 1) -> list:
    """Broadcast a scalar to ``count`` items, or check a list's length (SGLang's rule: a list of
    ``count / repeat`` values is repeated ``repeat`` times).

    Raises:
        EngineError: 400 when a list has the wrong length.
    """
    if not isinstance(value, list):
        return [value] * count
    if len(value) == count:
        return list(value)
    if repeat > 1 and len(value) * repeat == count:
        return list(value) * repeat
    raise bad_request(f"{name} has {len(value)} entries; expected {count}", name)


# The request bodies that carry the PD bootstrap fields (bootstrap_host, bootstrap_port, bootstrap_room).
WithBootstrap = Union[GenerateRequest, _OpenAIBase]


def bootstraps(body: WithBootstrap, count: int, repeat: int) -> list[Optional[Bootstrap]]:
    """Per-item bootstrap info; None for items that carry no room.

    Raises:
        EngineError: 400 for a malformed room (negative, >= 2^64).
    """
    rooms_field = body.bootstrap_room
    if rooms_field is None:
        rooms: list = [None] * count
    elif isinstance(rooms_field, list):
        rooms = per_item(rooms_field, count, "bootstrap_room", repeat)
    else:
        rooms = [rooms_field + i for i in range(count)]
    hosts = per_item(body.bootstrap_host, count, "bootstrap_host", repeat)
    ports = per_item(body.bootstrap_port, count, "bootstrap_port", repeat)
    out: list[Optional[Bootstrap]] = []
    for host, port, room in zip(hosts, ports, rooms):
        if room is None:
            out.append(None)
            continue
        if not 0 <= int(room) < 2**64:
            raise bad_request(f"bootstrap_room {room} is outside [0, 2^64)", "bootstrap_room")
        out.append(Bootstrap(host=host, port=port, room=int(room)))
    return out


def new_rid() -> str:
    """A fresh request id (32 hex digits)."""
    return uuid.uuid4().hex


def expand(
    prompts: list[list[int]],
    n: int,
    params: list[SamplingParams],
    body: WithBootstrap,
    rid: Optional[Union[str, list[str]]],
    return_logprob: list[bool],
    logprob_start_len: list[int],
    top_logprobs_num: list[int],
    stream: bool,
) -> list[SeqRequest]:
    """Expand P prompts x ``n`` samples into sequences, prompt-major (item ``i = p * n + s``; the
    order SGLang's TokenizerManager sends, returns and indexes them in).

    Bootstrap rooms: one per generated sequence. A list must have ``P * n`` entries indexed by
    ``i`` (SGLang itself would hand all samples of a prompt the same room, which a decode must
    refuse); a scalar room ``r`` gives item ``i`` the room ``r + i``. ``rid``: a string becomes
    ``f"{rid}_{i}"`` for batches (SGLang's naming; /abort_request names each item by its own id).

    Raises:
        EngineError: 400 for list lengths that do not match, or n < 1.
    """
    if n < 1:
        raise bad_request("n must be >= 1", "n")
    count = len(prompts) * n
    boots = bootstraps(body, count, repeat=1)
    single = count == 1
    if rid is None:
        rids = [new_rid() for _ in range(count)]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(count)]
    else:
        rids = per_item(rid, count, "rid")
    if len(set(rids)) != len(rids):
        raise bad_request("rid: duplicate request ids in one batch", "rid")
    reqs = []
    for p, prompt in enumerate(prompts):
        for s in range(n):
            i = p * n + s
            sp = params[p]
            seed = sp.sampling_seed if sp.sampling_seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
            reqs.append(SeqRequest(
                index=i, prompt_index=p, sample_index=s, prompt_ids=list(prompt), params=sp, rid=rids[i],
                seed=(seed + s + 2**63) % 2**64 - 2**63, return_logprob=return_logprob[p],
                logprob_start_len=logprob_start_len[p],
                top_logprobs_num=top_logprobs_num[p], bootstrap=boots[i], extra={"stream": stream},
            ))
    return reqs


def check_logprobs(reqs: list[SeqRequest], vocab_size: int, top_param: str = "top_logprobs_num") -> None:
    """Refuse logprob requests that cannot be honoured rather than clamp them: more top logprobs per token
    than the vocabulary has (``top_param`` names the client's field: ``logprobs`` / ``top_logprobs`` on the
    OpenAI routes), or a ``logprob_start_len`` past the prompt (SGLang's scheduler refuses that too:
    "logprob_start_len ... is higher than the number of input tokens").

    Raises:
        EngineError: 400 naming the field.
    """
    for s in reqs:
        if not 0 <= s.top_logprobs_num <= vocab_size:
            raise bad_request(f"{top_param} must be in [0, {vocab_size}] (the vocabulary's size), "
                              f"got {s.top_logprobs_num}", top_param)
        if s.return_logprob and s.logprob_start_len > len(s.prompt_ids):
            raise bad_request(f"logprob_start_len = {s.logprob_start_len} is higher than the number of input tokens "
                              f"({len(s.prompt_ids)}); use a smaller logprob_start_len", "logprob_start_len")
