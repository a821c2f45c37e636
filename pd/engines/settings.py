"""Every setting of the reference engine (``pdserve engine``), one pydantic model named as SGLang's flags.

The engine's flags, their ``--help`` and their checks come from ``EngineSettings`` (pd.util.settings_flags turns
each field into a flag: ``--`` and the key with ``-`` for ``_``; the ``speculative`` section's keys get
``--speculative-``); the reference engine's command builder writes a settings object's flags (``engine_argv``);
the cluster config's ``speculative:`` block is the model's ``speculative`` section; the doctor resolves what the
engine will run with ``resolve``. Adding a setting is adding a field here.

Flags shared with SGLang keep SGLang's names and defaults (sglang/srt/server_args.py). The PD timeouts default to
SGLang's environment variables ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s), and the decode's wait for a failed room's in-flight KV write to
drain to ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s; sglang/srt/environ.py).
``--disaggregation-transfer-timeout`` is the reference engine's own: SGLang has no flag for it and relies on
Mooncake's sync-write deadline, ``MC_TRANSFER_TIMEOUT`` (30 s), which is its default. ``--cpu-threads`` is the
reference engine's own too. No torch here: the command builders and the doctor run in the base install.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
from typing import ClassVar, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pd.engines.errors import EngineSettingsError
from pd.engines.handoff.transfer import default_transfer_timeout
from pd.engines.models.builtin_model import BUILTIN_MODELS, BUILTIN_PREFIX
from pd.engines.prefix.kv_events import KVEventsConfig
from pd.engines.spec.config import SpecConfig, SpeculativeSettings, check_draft_shape, resolve_speculative
from pd.util import request_caps as caps
from pd.util.settings_flags import SettingsFlags, flag, set_path

API_KEY_ENV = "PDSERVE_ENGINE_API_KEY"  # what the launcher sets: the key stays off the command line


class EngineSettings(BaseModel):
    """The reference engine's settings (``pdserve engine --help`` lists them as flags)."""

    # The docstring under a field is its description: its flag's --help.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    FLAG: ClassVar[str] = "--{}"  # the flag of a key (pd.util.settings_flags)

    model_path: str = "builtin:tiny"
    """Local Hugging Face causal-LM checkpoint directory, or builtin:tiny (a seeded small Llama with a byte-level
    tokenizer, written once to $PDSERVE_CACHE or ~/.cache/pdserve)."""
    served_model_name: Optional[str] = None
    """Model name in /v1/models and the OpenAI responses. Unset: the model path."""
    host: str = "127.0.0.1"
    """HTTP (and bootstrap) listen address."""
    port: int = Field(default=30000, ge=1, le=65535)
    """HTTP port."""
    disaggregation_mode: Literal["null", "prefill", "decode"] = "null"
    """null: a whole engine; prefill: computes prompts and pushes their KV to decodes; decode: receives KV from
    prefills and generates."""
    disaggregation_bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    """Port of the prefill's bootstrap server, where decodes register their KV pages. One per prefill."""
    disaggregation_transfer_backend: Literal["mooncake"] = "mooncake"
    """KV transfer backend: the Mooncake transfer engine."""
    disaggregation_transfer_protocol: Optional[Literal["tcp", "rdma"]] = None
    """Mooncake transport. Unset: rdma when --disaggregation-ib-device is given and MC_FORCE_TCP is unset, else
    tcp."""
    disaggregation_ib_device: Optional[str] = None
    """RDMA device(s) for Mooncake, e.g. mlx5_0 or mlx5_0,mlx5_1."""
    disaggregation_transfer_host: Optional[str] = None
    """Address peers use to reach this engine's transfer engine. Unset: --host, or this machine's address when
    --host is a wildcard."""
    disaggregation_bootstrap_timeout: float = Field(
        default=300.0, gt=0, json_schema_extra=flag(env="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"))
    """Seconds a prefill waits for its decode to register a room."""
    disaggregation_waiting_timeout: float = Field(
        default=300.0, gt=0, json_schema_extra=flag(env="SGLANG_DISAGGREGATION_WAITING_TIMEOUT"))
    """Seconds a decode waits for a room's KV."""
    disaggregation_transfer_timeout: Optional[float] = Field(default=None, gt=0)
    """Seconds a prefill's KV write into its decode may take (plus 1 ns per byte, Mooncake's allowance); then the
    request fails, the decode is told and the pages are freed once the transfer engine lets go of them. Unset:
    $MC_TRANSFER_TIMEOUT, Mooncake's own sync-write deadline, or 30."""
    decode_kv_release_timeout: float = Field(
        default=30.0, gt=0,
        json_schema_extra=flag(env="SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", takes_value=False))
    """Seconds a failed decode request's pages stay held while its prefill may still write into them."""
    page_size: int = Field(default=16, ge=1)
    """Tokens per KV page; must match on prefill and decode."""
    max_total_tokens: int = Field(default=65536, ge=1)
    """KV pool capacity in tokens (prefill and decode)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Model and KV dtype (float32 is exact on CPU)."""
    cpu_threads: Optional[int] = Field(default=None, ge=1)
    """Torch intra-op (and inter-op) threads for the model, set before it loads. Unset: the cores this process may
    run on (its CPU affinity) minus one for the HTTP server thread, at least 1."""
    max_body_bytes: int = Field(default=caps.MAX_BODY_BYTES, ge=1)
    """Largest request body accepted, in bytes (larger gets HTTP 413)."""
    # Caps on one generation request (400 above them, before anything is tokenized); SGLang has none, so the
    # names are the router's (sglang-router style), with the router's defaults (pd.util.request_caps).
    max_n: int = Field(default=caps.MAX_N, ge=1)
    """Largest n (samples per prompt; sampling_params.n on /generate)."""
    max_batch_size: int = Field(default=caps.MAX_BATCH_SIZE, ge=1)
    """Most prompts in one batch request."""
    max_sequences_per_request: int = Field(default=caps.MAX_SEQUENCES_PER_REQUEST, ge=1)
    """Most sequences (prompts x n) one request generates."""
    api_key: Optional[str] = Field(default=None, repr=False, json_schema_extra=flag(env=API_KEY_ENV))
    """Key every request must carry as 'Authorization: Bearer KEY' (SGLang's flag; /health*, /ready* and /metrics
    stay open), on the HTTP and the bootstrap server; a decode sends it to its prefills."""
    log_level: str = "info"
    """Log level."""
    disable_radix_cache: bool = False
    """Turn the radix prefix cache off: every prompt is computed whole and no KV is kept between requests."""
    disaggregation_decode_enable_radix_cache: bool = False
    """A decode keeps the prompt KV pages it received in a radix cache: a prompt that starts with cached whole pages
    registers only the rest with its prefill, which sends only those. With speculative decoding the draft's pages
    are cached alongside. Only in --disaggregation-mode decode (ignored in the others, as SGLang does)."""
    enable_cache_report: bool = False
    """Report cached prompt tokens in the OpenAI usage (usage.prompt_tokens_details.cached_tokens)."""
    kv_events_config: Optional[str] = None
    """SGLang's KV events as JSON, e.g. {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
    "tcp://*:5558"}: the radix cache's BlockStored / BlockRemoved / AllBlocksCleared over ZMQ, for a KV-aware
    router. Unset: none published."""

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events_json(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            KVEventsConfig.from_cli(v)  # ValueError naming the bad key
        return v
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    """speculative decoding (EAGLE/MTP)"""

    @field_validator("model_path")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v.startswith(BUILTIN_PREFIX) and v not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model (known: {', '.join(BUILTIN_MODELS)})")
        return v


class ResolvedSettings(EngineSettings):
    """``EngineSettings`` with every derived value filled (``resolve``): the transport, the Mooncake deadline and
    the torch threads are set.

    Attributes:
        transfer_host: the address peers reach this engine's transfer engine at.
        speculative_config: the resolved speculative settings, None when speculation is off.
    """

    transfer_host: str
    speculative_config: Optional[SpecConfig] = None
    # Set by ``resolve`` (the parent's Optional fields, narrowed; same constraints).
    disaggregation_transfer_protocol: Literal["tcp", "rdma"]
    disaggregation_transfer_timeout: float = Field(gt=0)
    cpu_threads: int = Field(ge=1)


@functools.cache
def engine_flags() -> SettingsFlags:
    """The flags of every ``EngineSettings`` field (pd.util.settings_flags)."""
    return SettingsFlags(EngineSettings)


def build_parser() -> argparse.ArgumentParser:
    """``pdserve engine``'s parser: one flag per setting, named as SGLang's."""
    p = argparse.ArgumentParser(
        prog="pdserve engine", allow_abbrev=False,
        description="The pdserve reference engine: an exact CPU engine that speaks SGLang's HTTP and "
                    "prefill-decode (PD) protocol, moving KV through the Mooncake transfer engine.")
    engine_flags().add_to(p, "engine")
    return p


def parse_settings(argv: list[str], environ: Mapping[str, str] = os.environ,
                   parser: Optional[argparse.ArgumentParser] = None) -> EngineSettings:
    """The settings ``argv`` (``pdserve engine``'s arguments) and the settings' environment variables give.

    Raises:
        SystemExit: argparse's exit 2 for a flag it cannot parse (``parser.error``).
        EngineSettingsError: a value out of range, naming its flag.
    """
    parser = parser or build_parser()
    given = engine_flags().given(parser.parse_args(argv), environ)
    data: dict = {}
    for dotted, value in given.items():
        set_path(data, dotted, value)
    try:
        return EngineSettings.model_validate(data)
    except ValidationError as e:
        raise settings_error(e) from None


def engine_argv(settings: EngineSettings) -> list[str]:
    """The flags that give ``settings``: every field set explicitly, none left at its default, never the API key
    (it goes in ``$PDSERVE_ENGINE_API_KEY``: ps shows a command line to everyone)."""
    return engine_flags().argv(settings, exclude=("api_key",))


def settings_error(e: ValidationError) -> EngineSettingsError:
    """The first problem of a pydantic ``ValidationError`` on ``EngineSettings`` as a typed error naming its flag
    (its environment variable, for a setting without a flag)."""
    err = e.errors()[0]
    dotted = ".".join(str(x) for x in err["loc"])
    name = engine_flags().flag_of(dotted) or engine_flags().env_of(dotted) or dotted
    value = err.get("input")
    shown = "" if isinstance(value, dict) or dotted == "api_key" else f" {value}"
    return EngineSettingsError(name, f"{name}{shown}: {err['msg'].removeprefix('Value error, ')}")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_cpu_threads(cores: int) -> int:
    """Torch threads for an engine given ``cores`` cores: one core is left to the HTTP server thread, at least 1.

    With every core given to torch, its intra-op threads fight the server thread (the event loop that
    parses requests and streams tokens) and throughput collapses under load.
    """
    return max(1, cores - 1)


def resolve(s: EngineSettings, environ: Mapping[str, str] = os.environ) -> ResolvedSettings:
    """Fill the derived values (transport, transfer host, Mooncake deadline, torch threads, speculative settings)
    and check what one field alone cannot: the model path, the flags that go together.

    Raises:
        EngineSettingsError: naming the flag.
    """
    protocol = s.disaggregation_transfer_protocol
    if protocol is None:
        force_tcp = environ.get("MC_FORCE_TCP", "").lower() in ("1", "true", "yes")
        protocol = "rdma" if s.disaggregation_ib_device and not force_tcp else "tcp"
    if protocol == "rdma" and not s.disaggregation_ib_device:
        raise EngineSettingsError("--disaggregation-transfer-protocol", "--disaggregation-transfer-protocol rdma "
                                  "needs --disaggregation-ib-device")
    if not s.model_path.startswith(BUILTIN_PREFIX):  # nothing is downloaded: a hub id would fail deep in transformers
        if not os.path.isdir(s.model_path):
            raise EngineSettingsError("--model-path", f"--model-path {s.model_path}: no such directory (give a "
                                      "local Hugging Face checkpoint directory, or builtin:tiny)")
        if not os.path.isfile(os.path.join(s.model_path, "config.json")):
            raise EngineSettingsError("--model-path", f"--model-path {s.model_path}: no config.json in it (not a "
                                      "Hugging Face checkpoint)")
    if s.disaggregation_mode == "prefill" and s.disaggregation_bootstrap_port == s.port:
        raise EngineSettingsError("--disaggregation-bootstrap-port", "--disaggregation-bootstrap-port must differ "
                                  "from --port")
    host = s.disaggregation_transfer_host or s.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    spec = resolve_speculative(s.speculative, s.model_path)
    if spec is not None and spec.draft_model_path is not None:
        check_draft_shape(s.model_path, spec.draft_model_path)
    derived = {"disaggregation_transfer_protocol": protocol,
               "cpu_threads": s.cpu_threads or default_cpu_threads(available_cores()),
               "disaggregation_transfer_timeout": s.disaggregation_transfer_timeout or default_transfer_timeout()}
    return ResolvedSettings(**{**dict(s), **derived}, transfer_host=host, speculative_config=spec)
