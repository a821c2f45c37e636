"""The planner's input: what one engine replica costs, per TP size (a JSON profile, pydantic models).

A profile is measured from a running engine (``pdserve profile``, pd.planner.measure) or written by hand from
published or benchmark numbers; every cost section names its ``source``, and any point may name its own. Times
are seconds, sizes tokens and bytes. A minimal hand-written profile::

    {
      "schema": "pdserve-profile/1",
      "name": "DeepSeek-V4-Flash, 8x RTX PRO 6000",
      "model": "deepseek-v4-flash", "engine": "sglang",
      "kv_bytes_per_token": 33288, "kv_bytes_per_token_source": "584 B/token/layer x 57 layers",
      "tp": {
        "4": {
          "prefill": {"max_batch_size": 8, "max_batch_tokens": 16384, "source": "...",
                      "points": [{"batch_size": 1, "input_len": 1024, "seconds": 0.080}]},
          "decode": {"max_batch_size": 64, "source": "...",
                     "points": [{"batch_size": 1, "context_len": 2048, "seconds": 0.020}]},
          "transfer": {"bandwidth_gb_s": 25, "latency_s": 0.002, "source": "..."}
        }
      }
    }

Fields (the planner's cost model, pd.planner.simulate):

- ``prefill.points``: wall time of one prefill batch of ``batch_size`` prompts of ``input_len`` tokens each,
  request in to first token out (``max_new_tokens=1``). ``max_batch_size`` prompts at most per batch
  (1 = one prompt at a time, as the reference engine runs), ``max_batch_tokens`` prompt tokens at most per batch
  (SGLang's ``--chunked-prefill-size``; a longer prompt runs alone).
- ``decode.points``: time of one decode iteration (every running sequence advances one step) at
  ``batch_size`` running sequences whose KV holds ``context_len`` tokens on average: the inter-token latency at
  that load. ``max_batch_size``: running sequences at most (``--max-running-requests``); ``max_kv_tokens``: the KV
  pool of one replica in tokens (prompt + output of every running sequence must fit). ``admit_points``: time the
  decode spends taking in one transferred prompt of ``input_len`` tokens (the reference engine loads the KV from
  its pages on the model thread; SGLang's KV lands in place: leave empty). ``tokens_per_step``: tokens each
  iteration emits per sequence (1; the mean accept length with speculative decoding).
- ``transfer``: KV transfer time of one prompt, prefill forward end to the KV in the decode's pages, as
  ``points`` (``bytes``, ``seconds``) or ``latency_s`` + ``bytes`` / ``bandwidth_gb_s`` (GB = 1e9 bytes). Bytes =
  prompt tokens x ``kv_bytes_per_token``.
- ``engine_args``: extra engine flags the replicas of this TP size ran with (e.g. ``--cpu-threads 2`` for the
  reference engine); a config written by ``pdserve plan-split`` gives them to the workers.
- ``host``: set when the replicas share one machine's CPU cores (the embedded default: reference engines on a
  CPU box). ``cores``: cores the engines get; each busy replica needs ``cores_per_replica`` of them (a TP entry's
  ``host_cores`` overrides it: a reference engine with ``--cpu-threads 2`` keeps two busy), and when the busy
  replicas need more than there are, all run proportionally slower (processor sharing). What requests cost the
  host outside the replicas' model work -- the router's ``cpu_per_request_s`` plus ``cpu_per_token_s`` per
  output token, and per TP entry the engines' HTTP, bootstrap and transfer threads
  (``prefill.cpu_overhead_per_request_s``, ``decode.cpu_overhead_per_request_s``,
  ``decode.cpu_overhead_per_token_s``; ``pdserve profile`` reads each process's ``process_cpu_seconds_total``) --
  at a request rate adds ``rate x`` that many cores to the demand the busy replicas share the cores with, as
  ``background_cores`` (other work on the machine) does: a busy replica runs at
  ``min(1, cores / (busy replicas' cores + that demand))``. GPU replicas own their GPUs: leave ``host`` unset.

Fitted models: a cost between measured points is interpolated linearly; below the smallest measured length it
stays at the smallest point's cost (the fixed per-batch overhead does not shrink); above the largest it grows
along the last segment's slope. Across batch sizes the curves of the two nearest measured batch sizes are
interpolated (extrapolated) linearly, and never fall below the largest measured batch's curve; with one measured
batch size, a larger batch costs proportionally more (batch_size / measured), the conservative reading.
"""

from __future__ import annotations

import bisect
import json
from functools import cached_property
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA = "pdserve-profile/1"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field (``tp.2.decode.points[3].seconds``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefillPoint(_Strict):
    """One measured prefill batch: ``batch_size`` prompts of ``input_len`` tokens took ``seconds``."""

    batch_size: int = Field(1, ge=1)
    input_len: int = Field(ge=1)
    seconds: float = Field(gt=0)
    source: Optional[str] = None


class DecodePoint(_Strict):
    """One measured decode iteration: ``batch_size`` sequences of ``context_len`` KV tokens each took ``seconds``."""

    batch_size: int = Field(1, ge=1)
    context_len: int = Field(ge=1)
    seconds: float = Field(gt=0)
    source: Optional[str] = None


class AdmitPoint(_Strict):
    """The decode's cost of taking in one transferred prompt of ``input_len`` tokens (``seconds``)."""

    input_len: int = Field(ge=1)
    seconds: float = Field(ge=0)
    source: Optional[str] = None


class TransferPoint(_Strict):
    """One measured KV transfer: ``bytes`` took ``seconds`` (prefill forward end to KV in the decode's pages)."""

    bytes: int = Field(ge=1)
    seconds: float = Field(gt=0)
    source: Optional[str] = None


class Curve:
    """Piecewise-linear ``y(x)`` through points sorted by x: flat below the first, the last segment's slope (at
    least 0) above the last. Several points at one x are averaged."""

    def __init__(self, xy: list[tuple[float, float]]):
        merged: dict[float, list[float]] = {}
        for x, y in xy:
            merged.setdefault(float(x), []).append(float(y))
        self.xs = sorted(merged)
        self.ys = [sum(merged[x]) / len(merged[x]) for x in self.xs]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1 or x <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, x)
        if i >= len(xs):  # beyond the last point: last segment's slope, never decreasing
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (x - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class Surface:
    """``seconds(batch_size, length)`` from points at a few batch sizes: a Curve over length per measured batch
    size, interpolated linearly across batch sizes (module docstring: the extrapolation rules)."""

    def __init__(self, points: list[tuple[int, float, float]]):
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for b, x, y in points:
            by_batch.setdefault(int(b), []).append((x, y))
        self.batches = sorted(by_batch)
        self.curves = [Curve(by_batch[b]) for b in self.batches]

    def __call__(self, batch_size: float, length: float) -> float:
        bs, cs = self.batches, self.curves
        if len(bs) == 1:
            y = cs[0](length)
            return y * batch_size / bs[0] if batch_size > bs[0] else y
        if batch_size <= bs[0]:
            return cs[0](length)
        i = bisect.bisect_right(bs, batch_size)
        if i >= len(bs):
            i = len(bs) - 1
        b0, b1 = bs[i - 1], bs[i]
        y0, y1 = cs[i - 1](length), cs[i](length)
        y = y0 + (y1 - y0) * (batch_size - b0) / (b1 - b0)
        return max(y, y1) if batch_size > bs[-1] else y


class PrefillCosts(_Strict):
    """Prefill costs of one replica (module docstring: fields)."""

    points: list[PrefillPoint] = Field(min_length=1)
    max_batch_size: int = Field(1, ge=1)
    max_batch_tokens: Optional[int] = Field(None, ge=1)
    cpu_overhead_per_request_s: float = Field(0.0, ge=0)
    source: str = Field(min_length=1)

    @cached_property
    def model(self) -> Surface:
        return Surface([(p.batch_size, p.input_len, p.seconds) for p in self.points])

    def seconds(self, batch_size: int, mean_input_len: float) -> float:
        """Wall seconds of a prefill batch of ``batch_size`` prompts averaging ``mean_input_len`` tokens."""
        return self.model(batch_size, mean_input_len)


class DecodeCosts(_Strict):
    """Decode costs of one replica (module docstring: fields)."""

    points: list[DecodePoint] = Field(min_length=1)
    admit_points: list[AdmitPoint] = Field(default_factory=list)
    max_batch_size: int = Field(256, ge=1)
    max_kv_tokens: Optional[int] = Field(None, ge=1)
    tokens_per_step: float = Field(1.0, ge=1.0)
    tokens_per_step_source: Optional[str] = None
    cpu_overhead_per_request_s: float = Field(0.0, ge=0)
    cpu_overhead_per_token_s: float = Field(0.0, ge=0)
    source: str = Field(min_length=1)

    @cached_property
    def model(self) -> Surface:
        return Surface([(p.batch_size, p.context_len, p.seconds) for p in self.points])

    @cached_property
    def admit_model(self) -> Optional[Curve]:
        return Curve([(p.input_len, p.seconds) for p in self.admit_points]) if self.admit_points else None

    def step_seconds(self, batch_size: int, mean_context_len: float) -> float:
        """Seconds of one decode iteration over ``batch_size`` sequences averaging ``mean_context_len`` KV tokens."""
        return self.model(batch_size, mean_context_len)

    def admit_seconds(self, input_len: int) -> float:
        """Seconds the decode spends taking in one transferred prompt of ``input_len`` tokens (0 if not profiled)."""
        return self.admit_model(input_len) if self.admit_model else 0.0


class TransferCosts(_Strict):
    """KV transfer time of one prompt: measured ``points``, or ``latency_s`` + bytes / ``bandwidth_gb_s``."""

    points: list[TransferPoint] = Field(default_factory=list)
    bandwidth_gb_s: Optional[float] = Field(None, gt=0)
    latency_s: float = Field(0.0, ge=0)
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _one_form(self):
        if bool(self.points) == (self.bandwidth_gb_s is not None):
            raise ValueError("give either points or bandwidth_gb_s (with latency_s), not both or neither")
        return self

    @cached_property
    def model(self) -> Optional[Curve]:
        return Curve([(p.bytes, p.seconds) for p in self.points]) if self.points else None

    def seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes of KV from a prefill to a decode."""
        if self.model is not None:
            return self.model(nbytes)
        return self.latency_s + nbytes / (self.bandwidth_gb_s * 1e9)


class TPEntry(_Strict):
    """Costs of one replica at one TP size."""

    prefill: PrefillCosts
    decode: DecodeCosts
    transfer: Optional[TransferCosts] = None
    engine_args: list[str] = Field(default_factory=list)
    host_cores: Optional[float] = Field(None, gt=0)


class Host(_Strict):
    """Replicas that share one machine's CPU cores (module docstring)."""

    cores: float = Field(gt=0)
    cores_per_replica: float = Field(1.0, gt=0)
    cpu_per_request_s: float = Field(0.0, ge=0)
    cpu_per_token_s: float = Field(0.0, ge=0)
    cpu_overhead_source: Optional[str] = None
    background_cores: float = Field(0.0, ge=0)
    source: str = Field(min_length=1)

    def background_demand(self, request_rate: float, mean_output_len: float, per_request_s: float = 0.0,
                          per_token_s: float = 0.0) -> float:
        """Cores of CPU demand besides the replicas' model work at ``request_rate`` req/s: ``background_cores`` plus
        what the requests cost outside the model threads (the router's, plus the engines' ``per_request_s`` and
        ``per_token_s``). It shares the cores with the busy replicas as the kernel's fair scheduler shares them
        among runnable threads (it takes its share, not all it asks for)."""
        req = self.cpu_per_request_s + per_request_s
        tok = self.cpu_per_token_s + per_token_s
        return self.background_cores + request_rate * (req + mean_output_len * tok)


class Profile(_Strict):
    """A whole profile: per-TP costs of one model on one kind of hardware (module docstring)."""

    schema_: Literal["pdserve-profile/1"] = Field(SCHEMA, alias="schema")
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    engine: Literal["reference", "sglang"]
    hardware: Optional[str] = None
    date: Optional[str] = None
    notes: list[str] = Field(default_factory=list)
    kv_bytes_per_token: float = Field(gt=0)
    kv_bytes_per_token_source: str = Field(min_length=1)
    transfer: Optional[TransferCosts] = None
    host: Optional[Host] = None
    tp: dict[str, TPEntry] = Field(min_length=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check(self):
        for key, entry in self.tp.items():
            if not key.isdigit() or int(key) < 1:
                raise ValueError(f"tp: key {key!r} must be a TP size (a positive integer)")
            if entry.transfer is None and self.transfer is None:
                raise ValueError(f"tp.{key}.transfer: missing, and no top-level transfer to fall back on")
        return self

    def tp_sizes(self) -> list[int]:
        """The TP sizes profiled, ascending."""
        return sorted(int(k) for k in self.tp)

    def entry(self, tp_size: int) -> TPEntry:
        """The costs at ``tp_size``.

        Raises:
            ProfileError: the profile has no entry for it (the message lists those it has).
        """
        try:
            return self.tp[str(tp_size)]
        except KeyError:
            raise ProfileError(f"tp: no entry for TP size {tp_size} (profiled: {self.tp_sizes()})") from None

    def host_demand(self, tp_size: int) -> float:
        """Cores one busy replica at ``tp_size`` keeps busy on a shared host (``host`` set), else 0."""
        if self.host is None:
            return 0.0
        own = self.entry(tp_size).host_cores
        return own if own is not None else self.host.cores_per_replica

    def transfer_for(self, tp_size: int) -> TransferCosts:
        """The KV transfer costs of a prefill at ``tp_size`` (its own, else the top-level ones)."""
        return self.entry(tp_size).transfer or self.transfer

    def dump(self) -> dict:
        """The profile as the JSON mapping it loads from."""
        return self.model_dump(by_alias=True, exclude_none=True)


def _format(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ""
        for part in err["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


def parse_profile(data, source: str = "<profile>") -> Profile:
    """Validate a profile mapping.

    Raises:
        ProfileError: one line per problem, each naming its field (``tp.1.prefill.points[0].seconds``).
    """
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: the top level must be a JSON object")
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_format(e, source)) from None


def load_profile(path: str | Path) -> Profile:
    """Load a JSON profile file.

    Raises:
        ProfileError: unreadable file, bad JSON (with its line and column), or an invalid profile.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read profile: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: invalid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    return parse_profile(data, str(path))
