"""Cluster configuration: one YAML file describes a PD deployment (pydantic models).

Example (deploy/local.yaml is the embedded default)::

    model_path: builtin:tiny
    engine: reference            # reference | sglang
    cluster: {num_gpus: 8, gpus_per_node: 8}
    prefill: {replicas: 1, tp_size: 1}
    decode:  {replicas: 1, tp_size: 1}
    transfer: {backend: mooncake, protocol: tcp}
    router: {host: 127.0.0.1, port: 8000, policy: round_robin}

Unknown keys and impossible layouts are errors that name the field (``ConfigError``).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pd.engines.errors import EngineSettingsError
from pd.engines.spec.config import SpeculativeSettings, resolve_speculative
from pd.router.config import RouterSettings, TimeoutConfig

# deploy/ is package data (``pd.deploy``), so the embedded default is found in a checkout and in an installed wheel.
DEFAULT_CONFIG = Path(str(files("pd.deploy").joinpath("local.yaml")))


class ConfigError(ValueError):
    """A config that cannot be deployed; the message names the field (e.g. ``prefill.tp_size``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Placement(_Strict):
    """Where a group's workers may run (multi-node clusters).

    Attributes:
        resources: Ray custom resources each worker's bundle requires, e.g. ``{"prefill_node": 0.01}``
            (start those nodes with ``ray start --resources '{"prefill_node": 1}'``).
        node_labels: Ray node labels the bundle must match, e.g. ``{"pd-role": "prefill"}``
            (``ray start --labels pd-role=prefill``).
    """

    resources: dict[str, float] = Field(default_factory=dict)
    node_labels: dict[str, str] = Field(default_factory=dict)


class Speculative(SpeculativeSettings):
    """EAGLE/MTP speculative decoding: the engines' ``--speculative-*`` settings (one key per flag, the key with
    ``--speculative-`` in front; pd.engines.spec.config.SpeculativeSettings documents each), applied identically to
    prefill and decode: in PD the prefill runs the draft too and ships its hidden states and top-k draft tokens
    with the KV (sglang/srt/disaggregation/prefill.py, utils.MetadataBuffers, sized by ``eagle_topk`` and the hidden
    size), so both sides must agree. A key left unset is left to the engine, which chooses as SGLang does.

    Where it goes: top-level ``speculative:`` for either engine, or ``sglang.speculative:`` (the older spelling,
    kept for SGLang profiles); both at once is an error. It drives SGLang workers (``pd/commands/sglang.py``) and the
    reference engine (``pd/commands/reference.py``) alike. The block's presence turns speculation on: ``algorithm``
    defaults to ``EAGLE`` here. SGLang 0.5.23 refuses ``NEXTN`` and ``EAGLE3`` for DeepSeek-V4 (its DeepSeek-V4 hook
    checks the algorithm before resolving the alias: write ``EAGLE``) and every one of them for DeepSeek-V4.1;
    ``pdserve doctor`` refuses those before launch (pd/tools/doctor/checks_model.py).

    Attributes:
        moe_runner_backend: the draft MoE's backend (``--speculative-moe-runner-backend``; SGLang workers only);
            unset, the draft inherits the target's resolved backend, and an explicit ``auto`` lands on Triton,
            which cannot serve MXFP4 experts. ``pdserve doctor`` says which backends fit the experts and GPU
            (``flashinfer_mxfp4`` for DSv4's MXFP4 experts on sm_90/sm_120).
        moe_a2a_backend: the draft MoE's all-to-all backend (``--speculative-moe-a2a-backend``; SGLang workers
            only).
    """

    algorithm: Optional[str] = "EAGLE"
    moe_runner_backend: Optional[str] = None
    moe_a2a_backend: Optional[str] = None

    def engine_settings(self) -> SpeculativeSettings:
        """The block without its SGLang-only keys: the reference engine's ``--speculative-*`` settings (a key at
        the engine's own default is left to it, so its command line carries no ``--no-speculative-adaptive``)."""
        fields = SpeculativeSettings.model_fields
        return SpeculativeSettings(**{k: v for k, v in self.model_dump(include=set(fields)).items()
                                      if v != fields[k].default})

    def argv(self) -> list[str]:
        """The ``--speculative-*`` flags of every key set (SGLang's names; the reference engine's are the same); a
        switch (``adaptive``) is its flag alone when on, nothing when off (SGLang's is ``store_true``)."""
        out: list[str] = []
        for key, value in self.model_dump().items():
            flag = self.FLAG.format(key.replace("_", "-"))
            if isinstance(value, bool):
                out += [flag] if value else []
            elif value is not None:
                out += [flag, str(value)]
        return out


class KernelSwitches(_Strict):
    """pdserve's Triton kernels in SGLang workers, through the ``pdserve`` SGLang plugin
    (kernels/sglang_plugin.py; the worker env it gets is listed by ``pdserve plan``).

    ``pdserve_kernels: true`` switches all three on; a mapping picks, e.g. ``{indexer: false}`` (a mapping
    without ``enabled`` means enabled).

    Attributes:
        enabled: master switch (``PDSERVE_KERNELS``).
        sparse_mla: sparse-MLA decode (``PDSERVE_SPARSE_MLA``).
        indexer: DSA lightning indexer scores + top-k (``PDSERVE_INDEXER``).
        mxfp4_moe: the MTP draft's MXFP4 MoE (``PDSERVE_MXFP4_MOE``).
        force: also on GPUs outside the sm_120 family (``PDSERVE_KERNELS_FORCE``; for trying them on
            H100/H200).
    """

    enabled: bool = False
    sparse_mla: bool = True
    indexer: bool = True
    mxfp4_moe: bool = True
    force: bool = False

    def kernels(self) -> dict[str, bool]:
        """Kernel name -> on, as ``pd.kernels.sglang_plugin.worker_env`` takes it."""
        return {"sparse_mla": self.sparse_mla, "indexer": self.indexer, "mxfp4_moe": self.mxfp4_moe}


class SGLangSettings(_Strict):
    """Engine settings shared by every SGLang worker (flags named as SGLang's).

    Attributes:
        quantization: always set it explicitly; auto-detection once left it unset, which disarmed
            the guard routing the draft MoE to a safe backend.
        pdserve_kernels: our Triton kernels in the workers (``true``, or per kernel: KernelSwitches).
        launch_command: what starts a server, before its flags; default
            ``[<python>, -m, sglang.launch_server]``. A wrapper (numactl, a container entry, the
            tests' stand-in server) goes here.
    """

    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"
    context_length: Optional[int] = Field(default=None, ge=1)
    mem_fraction_static: Optional[float] = Field(default=None, gt=0, lt=1)
    moe_runner_backend: Optional[str] = None
    trust_remote_code: bool = False
    enable_metrics: bool = True
    speculative: Optional[Speculative] = None
    pdserve_kernels: KernelSwitches = Field(default_factory=KernelSwitches)
    launch_command: Optional[list[str]] = None

    @field_validator("pdserve_kernels", mode="before")
    @classmethod
    def _kernels_shorthand(cls, v):
        # `true` / `false`, or a mapping that implies enabled unless it says otherwise
        if isinstance(v, bool):
            return {"enabled": v}
        if isinstance(v, dict) and "enabled" not in v:
            return {**v, "enabled": True}
        return v


class Group(_Strict):
    """One role's workers (prefill or decode).

    Attributes:
        replicas: number of engine instances.
        tp_size: GPUs per instance (tensor parallel size); all on one node.
        gpus: explicit GPU ids per replica (``[[0, 1], [2, 3]]``), or None to let Ray pack them.
        cuda_graph_max_bs: largest CUDA-graph batch (``--cuda-graph-max-bs-prefill`` on prefill
            workers, ``--cuda-graph-max-bs-decode`` on decode workers; sglang engine only).
        extra_args: extra engine flags, appended verbatim (SGLang flags for the sglang engine).
        env: extra environment variables for the engine process.
        placement: node constraints.
    """

    replicas: int = Field(default=1, ge=0)
    tp_size: int = Field(default=1, ge=1)
    gpus: Optional[list[list[int]]] = None
    cuda_graph_max_bs: Optional[int] = Field(default=None, ge=1)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    placement: Placement = Field(default_factory=Placement)


class Transfer(_Strict):
    """KV transfer settings (Mooncake)."""

    backend: Literal["mooncake"] = "mooncake"
    protocol: Literal["tcp", "rdma"] = "tcp"
    ib_device: Optional[str] = None

    @model_validator(mode="after")
    def _rdma_needs_device(self):
        if self.protocol == "rdma" and not self.ib_device:
            raise ValueError("protocol rdma needs ib_device (e.g. mlx5_0)")
        return self


class Router(RouterSettings):
    """The router (``pdserve router``). Keys as pd.router.config.RouterSettings documents them,
    named after sglang-router's flags: ``policy`` / ``prefill_policy`` / ``decode_policy``
    (round_robin, random, least_load, power_of_two, cache_aware), ``cache_aware``
    ({cache_threshold, balance_abs_threshold, ...}), ``retry`` ({max_retries, initial_backoff_ms,
    ...}), ``circuit_breaker``, ``health_check``, ``timeouts`` ({connect, prefill, first_token,
    stream_idle, request} seconds), ``max_payload_size``, ``max_n``, ``max_batch_size``,
    ``max_sequences_per_request``, ``max_connections``, ``api_key``,
    ``admin_api_key``, ``worker_api_key``, ``allowed_worker_hosts``, ``request_id_headers``, ``log_level``.

    Attributes:
        drain_timeout_secs: on stop, the launcher drains every worker through the router's admin
            API and waits up to this long for requests in flight to finish; 0 = stop at once.
    """

    port: int = Field(default=8000, ge=1, le=65535)
    timeouts: TimeoutConfig = Field(default_factory=lambda: TimeoutConfig(request=600.0))
    drain_timeout_secs: float = Field(default=30.0, ge=0)


class Restart(_Strict):
    """Engine restart policy of a worker actor: exponential backoff from ``backoff_initial`` to
    ``backoff_max`` seconds, at most ``max_restarts`` restarts (then the worker is failed)."""

    max_restarts: int = Field(default=5, ge=0)
    backoff_initial: float = Field(default=1.0, gt=0)
    backoff_max: float = Field(default=30.0, gt=0)


class Monitoring(_Strict):
    """Prometheus integration of the launcher (monitoring/prometheus.yml reads what it writes).

    Attributes:
        targets_file: where the launcher keeps the file_sd targets JSON (router, engines, its own
            exporter); default ``<Ray session dir>/pdserve_prometheus_targets_<router.port>.json``,
            i.e. ``/tmp/ray/session_latest/pdserve_prometheus_targets_8000.json`` on the head node (one
            file per cluster, so clusters sharing a Ray head keep their own targets).
        metrics_port: port of the launcher's exporter of worker state and engine restarts
            (on ``router.host``); 0 = a free port, published in the targets file.
    """

    targets_file: Optional[str] = None
    metrics_port: int = Field(default=0, ge=0, le=65535)


class Planner(_Strict):
    """The P:D split controller (pd.planner.controller, run by the launcher: pd.cluster.split_planner): every
    ``interval_secs`` it reads the router's and engines' /metrics, decides the split for the live traffic and,
    in ``act`` mode, moves one worker between prefill and decode (drained, settled, restarted in the other role in
    its placement group, admitted; rolled back when the new role does not start). docs/cluster.md, "Moving
    workers between prefill and decode", shows a config.

    Attributes:
        mode: ``off`` (no controller), ``advise`` (log and export each decision, never act) or ``act``.
        interval_secs: seconds between decisions.
        window_secs: the rates, length mix and SLO attainment are measured over this many seconds of metrics.
        profile: a planner profile JSON (``pdserve profile``; pd/planner/profile.py): the planner's model of the
            live workload then picks the split; unset, the measured SLO attainment per stage alone decides.
        slo_ttft_ms, slo_tpot_ms: the objectives (TTFT at the router, TPOT at the decodes).
        slo_attainment: the fraction of requests that must meet each objective (DistServe's 90%).
        attainment_band: a stage is short only when its attainment is below ``slo_attainment`` less this (a dead
            band against a metric jittering around the target), and gives a worker up only at or above the target.
        min_requests: requests the window must hold before a decision other than hold.
        cooldown_secs: no move for this long after one ends, and at least ``cooldown_restarts`` x the measured
            time a worker takes to restart.
        hold_secs: a new target must be proposed in every decision for this long, and at least ``hold_restarts`` x
            the measured restart time, before a move starts (hysteresis: a shift shorter than what a move costs is
            not chased).
        min_gain: with a profile, the predicted goodput of a new split must beat the current one's by this fraction.
        settle_timeout_secs: deadline for a drained worker's requests, KV pages and bootstrap rooms to reach 0;
            past it the move is given up and the worker admitted again as it was.
        add_replicas: when the cluster has GPUs free (``cluster.num_gpus`` less those in use, and Ray has them), add
            a replica to the role that needs one instead of moving a worker (not with explicit ``gpus`` lists).
    """

    mode: Literal["off", "advise", "act"] = "off"
    interval_secs: float = Field(default=10.0, gt=0)
    window_secs: float = Field(default=60.0, gt=0)
    profile: Optional[str] = None
    slo_ttft_ms: float = Field(default=1000.0, gt=0)
    slo_tpot_ms: float = Field(default=100.0, gt=0)
    slo_attainment: float = Field(default=0.9, gt=0, le=1)
    attainment_band: float = Field(default=0.05, ge=0, lt=1)
    min_requests: int = Field(default=20, ge=1)
    cooldown_secs: float = Field(default=60.0, ge=0)
    cooldown_restarts: float = Field(default=3.0, ge=0)
    hold_secs: float = Field(default=20.0, ge=0)
    hold_restarts: float = Field(default=2.0, ge=0)
    min_gain: float = Field(default=0.1, ge=0)
    settle_timeout_secs: float = Field(default=120.0, gt=0)
    add_replicas: bool = True


class Cluster(_Strict):
    """What the Ray cluster offers; ``pdserve up`` starts a local head with ``num_gpus`` logical
    GPUs when none is running."""

    num_gpus: int = Field(default=8, ge=0)
    gpus_per_node: int = Field(default=8, ge=1)


class PDConfig(_Strict):
    """A whole PD deployment."""

    model_path: str = "builtin:tiny"
    served_model_name: Optional[str] = None
    engine: Literal["reference", "sglang"] = "reference"
    cluster: Cluster = Field(default_factory=Cluster)
    prefill: Group = Field(default_factory=Group)
    decode: Group = Field(default_factory=Group)
    transfer: Transfer = Field(default_factory=Transfer)
    router: Router = Field(default_factory=Router)
    restart: Restart = Field(default_factory=Restart)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    speculative: Optional[Speculative] = None
    planner: Planner = Field(default_factory=Planner)
    engine_startup_timeout: float = Field(default=600.0, gt=0, description="seconds an engine may take to become ready")
    engine_host: Optional[str] = Field(default=None, description=(
        "address every engine listens on (HTTP, the prefill's bootstrap server) and peers reach it at; "
        "default: its node's address in Ray (`ray start --node-ip-address`, which picks the interface of a "
        "multi-node cluster); a loopback address keeps a single-node cluster off the network (deploy/local.yaml "
        "sets 127.0.0.1), and the launcher refuses it for a worker on another node"))
    page_size: int = Field(default=16, ge=1, description="KV page size, equal on prefill and decode")

    @field_validator("model_path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _check_layout(self):
        check_layout(self)
        check_speculative(self)
        check_planner(self)
        return self

    def speculative_settings(self) -> tuple[Optional[Speculative], str]:
        """The speculative block both engines run and the key it was given under: (block, ``speculative``
        or ``sglang.speculative``); (None, ``speculative``) when speculation is off."""
        if self.speculative is not None:
            return self.speculative, "speculative"
        if self.sglang.speculative is not None:
            return self.sglang.speculative, "sglang.speculative"
        return None, "speculative"

    def groups(self) -> dict[str, Group]:
        """The two worker groups by role: ``{"prefill": ..., "decode": ...}``."""
        return {"prefill": self.prefill, "decode": self.decode}

    def total_gpus(self) -> int:
        """GPUs the deployment needs: sum over both groups of replicas x tp_size."""
        return sum(g.replicas * g.tp_size for g in self.groups().values())


def check_layout(cfg: PDConfig) -> None:
    """Raise ValueError naming the field for layouts that cannot be placed."""
    if cfg.prefill.replicas < 1 or cfg.decode.replicas < 1:
        raise ValueError("prefill.replicas and decode.replicas must both be >= 1")
    used: dict[int, str] = {}
    for role, g in cfg.groups().items():
        if g.tp_size > cfg.cluster.gpus_per_node:
            raise ValueError(f"{role}.tp_size {g.tp_size} does not fit a node of "
                             f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} GPUs")
        if g.gpus is None:
            continue
        if len(g.gpus) != g.replicas:
            raise ValueError(f"{role}.gpus lists {len(g.gpus)} replicas; {role}.replicas is {g.replicas}")
        for i, ids in enumerate(g.gpus):
            if len(ids) != g.tp_size:
                raise ValueError(f"{role}.gpus[{i}] has {len(ids)} GPUs; {role}.tp_size is {g.tp_size}")
            for gid in ids:
                if not 0 <= gid < cfg.cluster.num_gpus:
                    raise ValueError(f"{role}.gpus[{i}]: GPU {gid} does not exist "
                                     f"(cluster.num_gpus={cfg.cluster.num_gpus})")
                where = f"{role}.gpus[{i}]"
                if gid in used:
                    raise ValueError(f"{where}: GPU {gid} is also used by {used[gid]}")
                used[gid] = where
    need = cfg.total_gpus()
    if need > cfg.cluster.num_gpus:
        raise ValueError(
            f"prefill needs {cfg.prefill.replicas}x{cfg.prefill.tp_size} "
            f"and decode {cfg.decode.replicas}x{cfg.decode.tp_size} "
            f"= {need} GPUs; cluster.num_gpus is {cfg.cluster.num_gpus}"
        )


def check_planner(cfg: PDConfig) -> None:
    """Raise ValueError naming the field for a controller that could not move a worker: a worker keeps its placement
    group (its GPUs and node) when it changes role, so both roles need the same ``tp_size``, ``placement`` and
    ``gpus`` style (the profile is read at launch, where it is used)."""
    if cfg.planner.mode == "off":
        return
    p, d = cfg.prefill, cfg.decode
    if p.tp_size != d.tp_size:
        raise ValueError(f"planner.mode {cfg.planner.mode}: prefill.tp_size {p.tp_size} and decode.tp_size "
                         f"{d.tp_size} differ; a worker that changes role keeps its placement group's GPUs")
    if p.placement != d.placement:
        raise ValueError(f"planner.mode {cfg.planner.mode}: prefill.placement and decode.placement differ; a worker "
                         "that changes role keeps its placement group (its node)")
    if (p.gpus is None) != (d.gpus is None):
        raise ValueError(f"planner.mode {cfg.planner.mode}: set gpus for both prefill and decode, or for neither")


SGLANG_ONLY_SPEC_KEYS = ("moe_runner_backend", "moe_a2a_backend")


def check_speculative(cfg: PDConfig) -> None:
    """Raise ValueError naming the key for a speculative block that cannot run: given twice, or (reference engine)
    one the engine refuses at start (pd.engines.spec.config.resolve_speculative: EAGLE3, ``eagle_topk`` > 1, ...)
    or a key only SGLang workers have."""
    if cfg.speculative is not None and cfg.sglang.speculative is not None:
        raise ValueError("speculative and sglang.speculative are both set: keep one (speculative drives both "
                         "engines; sglang.speculative is the older spelling)")
    sp, key = cfg.speculative_settings()
    if sp is None or cfg.engine != "reference":
        return
    for name in SGLANG_ONLY_SPEC_KEYS:
        if getattr(sp, name) is not None:
            raise ValueError(f"{key}.{name}: SGLang workers only (engine: sglang); the reference engine's draft "
                             "MoE has one path (the MXFP4 MoE torch reference on CPU, the Triton kernel on a GPU)")
    try:
        resolve_speculative(sp.engine_settings(), cfg.model_path)
    except EngineSettingsError as e:  # the engine's message, with the flag turned into the config's key
        name, text = f"{key}.{e.flag.removeprefix('--speculative-').replace('-', '_')}", str(e)
        raise ValueError(name + text.removeprefix(e.flag) if text.startswith(e.flag + " ") else f"{name}: {text}") \
            from None


def _format(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "<config>") -> PDConfig:
    """Validate a config mapping.

    Raises:
        ConfigError: with one line per problem, each naming its field.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return PDConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line with its position (PyYAML's own text spans several lines and quotes
    the source as "<unicode string>")."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return " ".join(str(e).split())
    text = f"{at(mark)}: {problem}" if mark else problem
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        text += f" ({context}" + (f" at {at(context_mark)}" if context_mark else "") + ")"
    return text


def load_config(path: Optional[str | Path] = None) -> PDConfig:
    """Load a YAML config (``None`` = the embedded default, deploy/local.yaml).

    Raises:
        ConfigError: unreadable file, bad YAML, or an invalid config.
    """
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_problem(e)}") from None
    return parse_config(data, str(path))
