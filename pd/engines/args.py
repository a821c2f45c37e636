"""Command-line arguments of the reference engine (``pdserve engine``), named as SGLang's.

Flags shared with SGLang keep SGLang's names and defaults (sglang/srt/server_args.py):
``--model-path``, ``--host``, ``--port``, ``--disaggregation-mode``,
``--disaggregation-bootstrap-port`` (8998), ``--disaggregation-transfer-backend``,
``--disaggregation-ib-device``, ``--page-size``, ``--max-total-tokens``, ``--served-model-name``,
``--dtype``, ``--api-key``. ``--cpu-threads`` is the reference engine's own (SGLang has no such flag for a CPU engine).
The PD timeouts default to SGLang's environment variables
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s), and
the decode's wait for a failed room's in-flight KV write to drain to
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s; sglang/srt/environ.py).
``--disaggregation-transfer-timeout`` is the reference engine's own: SGLang has no flag for it and relies on
Mooncake's sync-write deadline, ``MC_TRANSFER_TIMEOUT`` (30 s), which is its default.
"""

from __future__ import annotations

import argparse
import os
import socket

from pd.engines.api.auth import API_KEY_ENV
from pd.engines.handoff.transfer import default_transfer_timeout
from pd.engines.models.builtin_model import BUILTIN_MODELS, BUILTIN_PREFIX
from pd.engines.spec.config import check_draft_shape, resolve_spec_config
from pd.util import request_caps as caps


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise SystemExit(f"environment variable {name} must be a number of seconds, got {os.environ[name]!r}")


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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add every reference-engine flag to ``p``."""
    p.add_argument("--model-path", default="builtin:tiny",
                   help="Local Hugging Face causal-LM checkpoint directory, or builtin:tiny (a seeded small Llama "
                        "with a byte-level tokenizer, written once to $PDSERVE_CACHE or ~/.cache/pdserve). "
                        "Default: builtin:tiny.")
    p.add_argument("--served-model-name", default=None,
                   help="Model name in /v1/models and the OpenAI responses. Default: the model path.")
    p.add_argument("--host", default="127.0.0.1", help="HTTP (and bootstrap) listen address. Default: 127.0.0.1.")
    p.add_argument("--port", type=int, default=30000, help="HTTP port. Default: 30000.")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="null: a whole engine; prefill: computes prompts and pushes their KV to decodes; decode: "
                        "receives KV from prefills and generates. Default: null.")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="Port of the prefill's bootstrap server, where decodes register their KV pages. One per "
                        "prefill. Default: 8998.")
    p.add_argument("--disaggregation-transfer-backend", choices=["mooncake"], default="mooncake",
                   help="KV transfer backend. Only mooncake (the Mooncake transfer engine). Default: mooncake.")
    p.add_argument("--disaggregation-transfer-protocol", choices=["tcp", "rdma"], default=None,
                   help="Mooncake transport: tcp or rdma. Default: rdma when --disaggregation-ib-device is given "
                        "and MC_FORCE_TCP is unset, else tcp.")
    p.add_argument("--disaggregation-ib-device", default=None,
                   help="RDMA device(s) for Mooncake, e.g. mlx5_0 or mlx5_0,mlx5_1. Default: none.")
    p.add_argument("--disaggregation-transfer-host", default=None,
                   help="Address peers use to reach this engine's transfer engine. Default: --host, or this "
                        "machine's address when --host is a wildcard.")
    p.add_argument("--disaggregation-bootstrap-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
                   help="Seconds a prefill waits for its decode to register a room "
                        "(default: $SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT or 300).")
    p.add_argument("--disaggregation-waiting-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
                   help="Seconds a decode waits for a room's KV "
                        "(default: $SGLANG_DISAGGREGATION_WAITING_TIMEOUT or 300).")
    p.add_argument("--disaggregation-transfer-timeout", type=float, default=None,
                   help="Seconds a prefill's KV write into its decode may take (plus 1 ns per byte, Mooncake's "
                        "allowance); then the request fails, the decode is told and the pages are freed once the "
                        "transfer engine lets go of them (default: $MC_TRANSFER_TIMEOUT, Mooncake's own "
                        "sync-write deadline, or 30).")
    p.add_argument("--page-size", type=int, default=16,
                   help="Tokens per KV page; must match on prefill and decode. Default: 16.")
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV pool capacity in tokens (prefill and decode). Default: 65536.")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="Model and KV dtype. Default: float32 (exact on CPU).")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="Torch intra-op (and inter-op) threads for the model, set before it loads. Default: the "
                        "cores this process may run on (its CPU affinity) minus one for the HTTP server thread, "
                        "at least 1.")
    p.add_argument("--max-body-bytes", type=int, default=caps.MAX_BODY_BYTES,
                   help="Largest request body accepted, in bytes (larger gets HTTP 413). Default: 32 MiB.")
    # Caps on one generation request (400 above them, before anything is tokenized); SGLang has none, so the
    # names are the router's (sglang-router style), with the router's defaults (pd.router.config).
    p.add_argument("--max-n", type=int, default=caps.MAX_N,
                   help="Largest n (samples per prompt; sampling_params.n on /generate). Default: 16.")
    p.add_argument("--max-batch-size", type=int, default=caps.MAX_BATCH_SIZE,
                   help="Most prompts in one batch request. Default: 256.")
    p.add_argument("--max-sequences-per-request", type=int, default=caps.MAX_SEQUENCES_PER_REQUEST,
                   help="Most sequences (prompts x n) one request generates. Default: 512.")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="Key every request must carry as 'Authorization: Bearer KEY' (SGLang's flag; /health*, "
                        "/ready* and /metrics stay open), on the HTTP and the bootstrap server; a decode sends it "
                        f"to its prefills. Default: ${API_KEY_ENV} (keeps it off the command line), else none.")
    p.add_argument("--log-level", default="info", help="Log level. Default: info.")
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """SGLang's ``--speculative-*`` flags (sglang/srt/server_args.py), checked in pd.engines.spec.decoder."""
    p.add_argument("--speculative-algorithm", default=None, type=str.upper,
                   help="EAGLE (or NEXTN, SGLang's alias of it): MTP/EAGLE speculative decoding with a draft model. "
                        "Default: off.")
    p.add_argument("--speculative-draft-model-path", default=None,
                   help="The draft checkpoint. Default for builtin:tiny: its built-in MTP draft; other models need "
                        "one.")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="Draft tokens proposed per verify step. Default: 3 (with topk 1 and 4 draft tokens, "
                        "SGLang's choice for DeepSeek MTP).")
    p.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="Tokens kept per draft step; only 1 (chain drafting). Default: 1.")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="Tokens per verify window; with topk 1 always --speculative-num-steps + 1 (SGLang adjusts "
                        "it so, with a warning).")


def finalize(args: argparse.Namespace) -> argparse.Namespace:
    """Fill derived values (transport, transfer host, timeouts) and check the model path and combinations.

    Raises:
        SystemExit: with a message naming the bad flag.
    """
    if args.disaggregation_transfer_protocol is None:
        force_tcp = os.environ.get("MC_FORCE_TCP", "").lower() in ("1", "true", "yes")
        args.disaggregation_transfer_protocol = "rdma" if args.disaggregation_ib_device and not force_tcp else "tcp"
    if args.disaggregation_transfer_protocol == "rdma" and not args.disaggregation_ib_device:
        raise SystemExit("--disaggregation-transfer-protocol rdma needs --disaggregation-ib-device")
    for flag in ("port", "disaggregation_bootstrap_port"):
        if not 1 <= getattr(args, flag) <= 65535:
            raise SystemExit(f"--{flag.replace('_', '-')} must be in 1..65535, got {getattr(args, flag)}")
    if args.model_path.startswith(BUILTIN_PREFIX) and args.model_path not in BUILTIN_MODELS:
        raise SystemExit(f"--model-path {args.model_path}: unknown built-in model (known: {', '.join(BUILTIN_MODELS)})")
    if not args.model_path.startswith("builtin:"):  # nothing is downloaded: a hub id would fail deep in transformers
        if not os.path.isdir(args.model_path):
            raise SystemExit(f"--model-path {args.model_path}: no such directory (give a local Hugging Face "
                             "checkpoint directory, or builtin:tiny)")
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            raise SystemExit(f"--model-path {args.model_path}: no config.json in it (not a Hugging Face checkpoint)")
    for flag in ("page_size", "max_total_tokens", "max_body_bytes", "max_n", "max_batch_size",
                 "max_sequences_per_request"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    if args.cpu_threads is None:
        args.cpu_threads = default_cpu_threads(available_cores())
    elif args.cpu_threads <= 0:
        raise SystemExit(f"--cpu-threads must be a positive integer, got {args.cpu_threads}")
    if args.disaggregation_transfer_timeout is None:
        args.disaggregation_transfer_timeout = default_transfer_timeout()
    for flag in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                 "disaggregation_transfer_timeout"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    if args.disaggregation_mode == "prefill" and args.disaggregation_bootstrap_port == args.port:
        raise SystemExit("--disaggregation-bootstrap-port must differ from --port")
    host = args.disaggregation_transfer_host or args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    args.transfer_host = host
    args.bootstrap_timeout = args.disaggregation_bootstrap_timeout
    args.speculative = resolve_spec_config(args)
    if args.speculative is not None and args.speculative.draft_model_path is not None:
        check_draft_shape(args.model_path, args.speculative.draft_model_path)
    args.waiting_timeout = args.disaggregation_waiting_timeout
    args.transfer_timeout = args.disaggregation_transfer_timeout
    args.kv_release_timeout = _env_float("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", 30)
    if args.kv_release_timeout <= 0:
        raise SystemExit("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT must be positive")
    return args
