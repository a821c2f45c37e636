"""The settings of one ``pdserve bench`` run: one frozen dataclass, from which the command line is generated
(pd.bench.cli), so a setting is described once: name, default, parser and help here.

Flag names are ``sglang.benchmark.serving``'s where it has the setting (``"sglang": True`` in a field's
metadata; tests/test_bench_units.py checks each against the pinned SGLang's own parser); the rest are ours:
the distributions of random lengths, the shared prefix, constant arrivals, a list of rates, the SLOs,
the plot and the stage breakdown.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

# Backends whose request function SGLang's benchmark has and pdserve bench drives (generation, text out).
BACKENDS = ("sglang", "sglang-native", "sglang-oai", "sglang-oai-chat", "vllm", "vllm-chat", "lmdeploy",
            "lmdeploy-chat")
DATASETS = ("sharegpt", "random", "random-ids")
LENGTH_DISTS = ("uniform", "fixed", "lognormal")
ARRIVALS = ("poisson", "constant")


def parse_rates(text) -> tuple[float, ...]:
    """``"1,2,4"`` / ``"inf"`` / a number / a sequence of numbers -> request rates in req/s (each > 0; inf:
    every request at time 0).

    Raises:
        ValueError: an empty list, or an item that is not a number > 0.
    """
    items = text.split(",") if isinstance(text, str) else (list(text) if isinstance(text, (list, tuple)) else [text])
    rates = []
    for item in items:
        try:
            rate = float(item.strip()) if isinstance(item, str) else float(item)
        except (TypeError, ValueError):
            raise ValueError(f"--request-rate: {item!r} is not a number (give req/s like 1,2,4 or inf)") from None
        if not rate > 0:  # NaN too
            raise ValueError(f"--request-rate: {item!r} must be > 0 req/s (inf sends every request at once)")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate: give at least one rate")
    return tuple(rates)


def _opt_int(text: str) -> int:
    return int(text)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _opt(default, help: str, *, sglang: bool = False, parse=None, choices=None):
    """A field with its command-line description."""
    return field(default=default, metadata={"help": help, "sglang": sglang, "parse": parse, "choices": choices})


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run's settings (units in the names: ``_ms``, ``_secs``; rates in req/s).

    Build it directly, from an ``argparse.Namespace`` (:meth:`from_namespace`, missing attributes take the
    defaults), or with ``pdserve bench`` flags (each field is ``--field-name``).

    Raises:
        ValueError: a setting out of range; the message names the flag.
    """

    # target
    backend: str = _opt("sglang", "API to drive: SGLang's native /generate (sglang, sglang-native) or an OpenAI "
                        "route (sglang-oai: /v1/completions, sglang-oai-chat: /v1/chat/completions; vllm*, lmdeploy* "
                        "the same routes)", sglang=True, choices=BACKENDS)
    base_url: Optional[str] = _opt(None, "server or router URL (default http://HOST:PORT)", sglang=True)
    host: str = _opt("127.0.0.1", "server host when --base-url is not given", sglang=True)
    port: int = _opt(30000, "server port when --base-url is not given (SGLang's default 30000)", sglang=True,
                     parse=int)
    model: Optional[str] = _opt(None, "model name sent to OpenAI routes (default: the first of GET /v1/models), and "
                                "the tokenizer when --tokenizer is not given", sglang=True)
    tokenizer: Optional[str] = _opt(None, "tokenizer: a local directory or builtin:NAME (default: --model, else the "
                                    "server's /model_info tokenizer_path or model_path); never downloaded",
                                    sglang=True)
    # workload
    dataset_name: str = _opt("sharegpt", "sharegpt: conversations from a ShareGPT-format JSON file (--dataset-path; "
                             "default the synthetic one pdserve ships); random / random-ids: random token ids of "
                             "the --random-* lengths", sglang=True, choices=DATASETS)
    dataset_path: str = _opt("", "ShareGPT-format JSON file (a list of {conversations: [{from, value}, ...]})",
                             sglang=True)
    num_prompts: int = _opt(1000, "requests per request rate", sglang=True, parse=int)
    sharegpt_output_len: Optional[int] = _opt(None, "output length of every ShareGPT request (default: the "
                                              "conversation's answer length)", sglang=True, parse=_opt_int)
    sharegpt_context_len: Optional[int] = _opt(None, "drop ShareGPT requests whose prompt + output exceed this",
                                               sglang=True, parse=_opt_int)
    random_input_len: int = _opt(1024, "random dataset: input length in tokens (the maximum for uniform, the mean "
                                 "for lognormal)", sglang=True, parse=int)
    random_output_len: int = _opt(1024, "random dataset: output length in tokens (as --random-input-len)",
                                  sglang=True, parse=int)
    random_range_ratio: float = _opt(0.0, "uniform lengths are drawn from [len x ratio, len] (SGLang's "
                                     "definition; 1 = fixed)", sglang=True, parse=float)
    random_input_dist: str = _opt("uniform", "distribution of random input lengths", choices=LENGTH_DISTS)
    random_output_dist: str = _opt("uniform", "distribution of random output lengths", choices=LENGTH_DISTS)
    random_lognormal_sigma: float = _opt(1.0, "lognormal lengths: sigma of the underlying normal (the mean stays "
                                         "--random-*-len; lengths clipped to [1, 16 x len])", parse=float)
    random_shared_prefix_ratio: float = _opt(0.0, "random dataset: this fraction of each prompt is a prefix shared "
                                             "with the other prompts of its group (exercises cache-aware routing)",
                                             parse=float)
    random_shared_prefix_groups: int = _opt(1, "random dataset: number of distinct shared prefixes (requests are "
                                            "spread round-robin)", parse=int)
    tokenize_prompt: bool = _opt(False, "send token ids instead of text (exact prompt lengths)", sglang=True)
    # load
    request_rate: tuple = _opt((math.inf,), "request rate(s) in req/s, a comma list for a sweep (1,2,4), inf: "
                               "every request at once", sglang=True, parse=parse_rates)
    arrival_process: str = _opt("poisson", "inter-arrival times: poisson (exponential gaps, SGLang's) or constant "
                                "(1/rate apart)", choices=ARRIVALS)
    max_concurrency: Optional[int] = _opt(None, "at most this many requests in flight (the rest wait their turn)",
                                          sglang=True, parse=_opt_int)
    warmup_requests: int = _opt(1, "requests sent (and not measured) before the first rate", sglang=True, parse=int)
    seed: int = _opt(42, "seed of the dataset sampling and the arrival times", sglang=True, parse=int)
    request_timeout_secs: float = _opt(3600.0, "a request still running after this many seconds counts as failed",
                                       parse=float)
    ready_check_timeout_sec: float = _opt(60.0, "wait this long for the server to answer before starting "
                                          "(0: do not wait)", sglang=True, parse=float)
    # sampling
    temperature: float = _opt(0.0, "sampling temperature", sglang=True, parse=float)
    top_p: float = _opt(1.0, "top-p", sglang=True, parse=float)
    disable_stream: bool = _opt(False, "non-streaming requests (then TTFT is the whole request)", sglang=True)
    disable_ignore_eos: bool = _opt(False, "let requests stop at EOS (by default they generate every output token)",
                                    sglang=True)
    extra_request_body: Optional[str] = _opt(None, "JSON object merged into every request body", sglang=True)
    # results
    slo_ttft_ms: Optional[float] = _opt(None, "TTFT SLO in ms for goodput (DistServe: a request counts iff TTFT and "
                                        "TPOT meet their SLOs)", parse=float)
    slo_tpot_ms: Optional[float] = _opt(None, "TPOT SLO in ms for goodput", parse=float)
    slo_attainment_target: float = _opt(0.9, "the sweep's goodput is the highest rate whose SLO attainment is at "
                                        "least this fraction (DistServe's 90%%)", parse=float)
    output_file: Optional[str] = _opt(None, "write the results here: JSON (a .jsonl file gets one SGLang-style "
                                      "line per rate appended)", sglang=True)
    output_details: bool = _opt(False, "add per-request columns (input_lens, output_lens, ttfts, itls, errors, ...)",
                                sglang=True)
    plot_file: Optional[str] = _opt(None, "PNG of latency CDFs and goodput vs request rate (default: next to "
                                    "--output-file as .png); needs matplotlib (pip install 'pdserve[monitoring]'), "
                                    "skipped with a note without it")
    disable_tqdm: bool = _opt(False, "no progress bar", sglang=True)
    tag: Optional[str] = _opt(None, "a label stored in the results", sglang=True)
    # PD stage breakdown
    admin_api_key: Optional[str] = _opt(None, "the router's admin key, to list its workers for the stage breakdown. "
                                        "Default: the key in the file a pdserve launcher (pdserve up, make serve) "
                                        "wrote (never printed): $PDSERVE_ADMIN_API_KEY_FILE when set, else, for a "
                                        "router on this machine, RAY_TMP/ray/session_latest/pdserve_admin_key_PORT "
                                        "(PORT: the --base-url's; RAY_TMP: $RAY_TMPDIR, else $TMPDIR, else /tmp); a "
                                        "router without keys needs none from its own host")
    disable_stage_breakdown: bool = _opt(False, "do not read the router's and engines' /metrics")

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "request_rate", parse_rates(self.request_rate))
        checks = [
            ("num_prompts", self.num_prompts >= 1, ">= 1"),
            ("random_input_len", self.random_input_len >= 1, ">= 1"),
            ("random_output_len", self.random_output_len >= 1, ">= 1"),
            ("random_range_ratio", 0 <= self.random_range_ratio <= 1, "in [0, 1]"),
            ("random_lognormal_sigma", 0 < self.random_lognormal_sigma <= 4, "in (0, 4]"),
            ("random_shared_prefix_ratio", 0 <= self.random_shared_prefix_ratio < 1, "in [0, 1)"),
            ("random_shared_prefix_groups", self.random_shared_prefix_groups >= 1, ">= 1"),
            ("max_concurrency", self.max_concurrency is None or self.max_concurrency >= 1, ">= 1"),
            ("warmup_requests", self.warmup_requests >= 0, ">= 0"),
            ("request_timeout_secs", 0 < self.request_timeout_secs < math.inf, "a finite number > 0"),
            ("ready_check_timeout_sec", 0 <= self.ready_check_timeout_sec < math.inf, "a finite number >= 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("slo_ttft_ms", self.slo_ttft_ms is None or 0 < self.slo_ttft_ms < math.inf, "a finite number > 0"),
            ("slo_tpot_ms", self.slo_tpot_ms is None or 0 < self.slo_tpot_ms < math.inf, "a finite number > 0"),
            ("slo_attainment_target", 0 < self.slo_attainment_target <= 1, "in (0, 1]"),
            ("sharegpt_output_len", self.sharegpt_output_len is None or self.sharegpt_output_len >= 4,
             ">= 4 (SGLang's ShareGPT sampler refuses less)"),
            ("sharegpt_context_len", self.sharegpt_context_len is None or self.sharegpt_context_len >= 2, ">= 2"),
            ("port", 0 < self.port < 65536, "a TCP port"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{_flag(name)} must be {what}, got {getattr(self, name)!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{_flag(f.name)} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        if self.extra_request_body is not None:
            try:
                extra = json.loads(self.extra_request_body)
            except ValueError as e:
                raise ValueError(f"--extra-request-body is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("--extra-request-body must be a JSON object")
        if self.tokenize_prompt and self.dataset_name == "sharegpt":
            raise ValueError("--tokenize-prompt works with --dataset-name random / random-ids only (as in SGLang)")

    @property
    def url(self) -> str:
        """The server's base URL without a trailing slash."""
        return (self.base_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def extra_body(self) -> dict:
        """``--extra-request-body`` as a dict (empty when not given)."""
        return json.loads(self.extra_request_body) if self.extra_request_body else {}

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "BenchConfig":
        """The config of an ``argparse.Namespace`` (its attributes named as the fields; others ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    def to_dict(self) -> dict:
        """The settings as JSON-ready values (rates as numbers, inf as the string "inf")."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "admin_api_key"}
        out["request_rate"] = [_json_rate(r) for r in self.request_rate]
        return out


def _json_rate(rate: float):
    return "inf" if math.isinf(rate) else rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`BenchConfig` field to ``parser`` (defaults, parsers, choices and help from the
    fields), so the command line cannot drift from the config."""
    for f in fields(BenchConfig):
        meta = f.metadata
        default = f.default if f.default is not MISSING else None
        kwargs = {"dest": f.name, "default": default, "help": meta["help"]}
        if isinstance(default, bool):
            kwargs["action"] = "store_true"
        else:
            parse = meta.get("parse")
            if f.name == "request_rate":
                kwargs["default"] = "inf"
                kwargs["type"] = str  # parsed (and errors named) by BenchConfig
            elif parse is not None:
                kwargs["type"] = parse
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            else:
                kwargs["metavar"] = f.name.split("_")[-1].upper()
        parser.add_argument(_flag(f.name), **kwargs)


def sglang_flags() -> list[str]:
    """The flags of :class:`BenchConfig` that are ``sglang.benchmark.serving``'s own."""
    return [_flag(f.name) for f in fields(BenchConfig) if f.metadata.get("sglang")]
