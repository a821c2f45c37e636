"""SGLang workers: the exact ``python -m sglang.launch_server`` argv and env for each role, and
parsing them with the pinned SGLang's own argument parser.

The targeted SGLang release is pinned in one place, the ``gpu`` extra of pyproject.toml
(``sglang==X``); :func:`pinned_sglang_requirement` reads it from the installed distribution.

What the pinned source (0.5.23) requires of a PD pair, and how we meet it:

- ``--page-size`` equal on both sides (KV pages are copied page by page): from ``page_size``.
- One ``--disaggregation-bootstrap-port`` per prefill (the decode finds its prefill's bootstrap
  server there): chosen per worker by the launcher.
- Speculative decoding in PD: the prefill also runs the draft (``prefill.py``: for EAGLE the
  draft's hidden states and top-k tokens travel with the KV in ``MetadataBuffers``, sized by
  ``--speculative-eagle-topk`` and the hidden size), so the whole ``--speculative-*`` set is
  emitted identically for both roles from one config section.
- DeepSeek-V4 with speculative decoding in PD needs the Mooncake (or NIXL) transfer backend
  (``arg_groups/deepseek_v4_hook.py``): always ``--disaggregation-transfer-backend mooncake``.
- ``--quantization`` is emitted whenever the config sets it; ``pdserve doctor`` refuses a config
  that leaves it to auto-detection.
- TP may differ between prefill and decode.

The cluster's key: SGLang reads ``--api-key`` only from its command line, where ``ps`` shows it to every
user of the node, or from the YAML file of ``--config`` (sglang/srt/server_args.py ``prepare_server_args``
and srt/utils/server_args_config_parser.py: the file's keys become flags before parsing). So the key goes
into an owner-only ``sglang_api_key.yaml`` the worker writes (``EngineCommand.files``) and argv carries
``--config PATH``; a group's ``extra_args`` may then not bring its own ``--config`` (SGLang takes one).

Env: ``SGLANG_HOST_IP`` = the worker's ``--host`` (the address the launcher gives it: ``engine_host``, else its
node's Ray address) when that is an IP literal and not a wildcard: SGLang's KV manager and Mooncake take their
address from ``get_local_ip_auto()`` (srt/utils/network.py: ``SGLANG_HOST_IP``, else ``HOST_IP``, else the NIC
named by ``SGLANG_LOCAL_IP_NIC``, else the default route's interface, else the hostname), which on a multi-homed
node may be another NIC than the one peers reach; a group's ``env`` naming any of those three keeps its choice.
``MC_FORCE_TCP=1`` when no RDMA device is configured; ``NCCL_DEBUG=WARN`` so NCCL failures
reach the log that ``pdserve diagnose`` reads; with ``sglang.pdserve_kernels`` on, the switches of our SGLang
plugin (``pd.kernels.sglang_plugin.worker_env``: ``PDSERVE_KERNELS=1`` and one ``PDSERVE_*`` per kernel). A
group's ``env`` still overrides single switches. ``SGLANG_PLUGINS`` is left unset (SGLang then loads every
installed plugin); an allow-list the group's ``env`` (or, at spawn, the node's environment) sets is extended
with ``pdserve`` rather than replaced.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import os
import sys
from functools import lru_cache
from typing import Optional

from pd.commands.command import EngineCommand
from pd.config import PDConfig
from pd.kernels.sglang_plugin import PLUGIN_ALLOW_LIST
from pd.kernels.sglang_plugin import worker_env as plugin_env

# What sglang/srt/utils/network.py get_local_ip_auto() reads, in order, before guessing from the routes.
HOST_IP_ENV = ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC")


def kv_host_env(host: str, group_env: dict[str, str]) -> dict[str, str]:
    """``{"SGLANG_HOST_IP": host}``: the address SGLang's KV manager and Mooncake register
    (``get_local_ip_auto()`` in sglang/srt/utils/network.py) pinned to the worker's ``--host``.

    Empty when ``host`` is not an IP literal (a hostname: SGLang would put it where an IP goes) or is a wildcard
    (``0.0.0.0`` / ``::``: not an address peers can reach), and when ``group_env`` names any of
    :data:`HOST_IP_ENV` (the group's own choice stands).
    """
    if any(k in group_env for k in HOST_IP_ENV):
        return {}
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return {}
    return {} if ip.is_unspecified else {"SGLANG_HOST_IP": str(ip)}


class SGLangArgError(ValueError):
    """A flag the pinned SGLang does not accept; the message names it and the candidates."""


def pinned_sglang_requirement() -> str:
    """The ``sglang==X`` requirement of the ``gpu`` extra (pyproject.toml), e.g. ``sglang==0.5.23``.

    Raises:
        RuntimeError: pdserve is not installed as a distribution, or the extra has no pin.
    """
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("pdserve") or []
    except PackageNotFoundError as e:
        raise RuntimeError("pdserve is not installed (pip install -e .)") from e
    for r in reqs:
        spec = r.split(";")[0].strip().replace(" ", "")
        if spec.startswith("sglang==") and "gpu" in r:
            return spec
    raise RuntimeError("pyproject.toml's gpu extra does not pin sglang==X")


def pinned_sglang_version() -> str:
    """The SGLang version pinned in pyproject.toml, e.g. ``0.5.23``."""
    return pinned_sglang_requirement().split("==", 1)[1]


def sglang_command(cfg: PDConfig, role: str, host: str, port: int, bootstrap_port: Optional[int],
                   api_key: Optional[str] = None, key_dir: Optional[str] = None) -> EngineCommand:
    """argv + env (+ the key file) of one SGLang worker.

    Args:
        role: ``prefill`` or ``decode``; ``bootstrap_port`` is required for a prefill.
        api_key: SGLang's ``--api-key``, written to ``key_dir/sglang_api_key.yaml`` and read through
            ``--config`` (never on the command line).

    Raises:
        ValueError: a prefill without a bootstrap port; an ``api_key`` without ``key_dir``, or with a
            ``--config`` in the group's ``extra_args``.
    """
    s, g = cfg.sglang, cfg.groups()[role]
    if role == "prefill" and bootstrap_port is None:
        raise ValueError("a prefill worker needs its --disaggregation-bootstrap-port")
    prefix = list(s.launch_command or [sys.executable, "-m", "sglang.launch_server"])
    argv = prefix + [
        "--model-path", cfg.model_path,
        "--tp-size", str(g.tp_size),
        "--host", host, "--port", str(port),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", cfg.transfer.backend,
        "--page-size", str(cfg.page_size),
        "--kv-cache-dtype", s.kv_cache_dtype,
    ]
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if cfg.transfer.ib_device:
        argv += ["--disaggregation-ib-device", cfg.transfer.ib_device]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if s.quantization:
        argv += ["--quantization", s.quantization]
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if s.context_length is not None:
        argv += ["--context-length", str(s.context_length)]
    if g.cuda_graph_max_bs is not None:
        argv += [f"--cuda-graph-max-bs-{role}", str(g.cuda_graph_max_bs)]
    if s.moe_runner_backend:
        argv += ["--moe-runner-backend", s.moe_runner_backend]
    if s.enable_metrics:
        argv.append("--enable-metrics")
    if s.trust_remote_code:
        argv.append("--trust-remote-code")
    sp, _ = cfg.speculative_settings()
    if sp is not None:
        argv += sp.argv()  # keys left unset are SGLang's to choose
    files = {}
    if api_key:
        if key_dir is None:
            raise ValueError("an SGLang worker's api_key needs a directory for its key file")
        if any(a == "--config" or a.startswith("--config=") for a in g.extra_args):
            raise ValueError(f"{role}.extra_args has --config, but the cluster's key reaches SGLang through its "
                             "own --config file (SGLang takes one): move those settings into extra_args flags")
        path = os.path.join(key_dir, "sglang_api_key.yaml")
        files[path] = json.dumps({"api-key": api_key}) + "\n"  # JSON is YAML, and quotes any key safely
        argv += ["--config", path]
    argv += g.extra_args
    env = {"NCCL_DEBUG": "WARN", **kv_host_env(host, g.env)}
    if cfg.transfer.protocol == "tcp":
        env["MC_FORCE_TCP"] = "1"
    kernels = s.pdserve_kernels
    if kernels.enabled:
        env.update(plugin_env(kernels.kernels(), force=kernels.force, allow_list=g.env.get(PLUGIN_ALLOW_LIST)))
    env.update({k: v for k, v in g.env.items() if not (kernels.enabled and k == PLUGIN_ALLOW_LIST)})
    return EngineCommand(argv=argv, env=env, ready_path="/health_generate", args_start=len(prefix), files=files)


# ---- the pinned parser ------------------------------------------------------------------------
@lru_cache(maxsize=1)
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own ``launch_server`` parser (``ServerArgs.add_cli_args``), abbreviations off.

    Raises:
        RuntimeError: the pinned sglang is not importable, with the command that installs it.
    """
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as e:
        req = pinned_sglang_requirement()
        raise RuntimeError(
            f"checking SGLang flags needs the pinned {req} importable ({e}); on a CPU machine: "
            f"pip install --no-deps {req} psutil pybase64 pillow msgspec pyzmq tqdm ipython orjson triton"
        ) from None
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def known_flags() -> list[str]:
    """Every ``--flag`` the pinned SGLang's server argument parser accepts, sorted."""
    return sorted(o for a in sglang_parser()._actions for o in a.option_strings if o.startswith("--"))


def parse_sglang_args(args: list[str]) -> argparse.Namespace:
    """Parse launch_server arguments (no ``python -m sglang.launch_server`` prefix) with the pinned
    parser.

    Raises:
        SGLangArgError: an unknown flag (with the closest known flags), an abbreviation, or a bad value.
    """
    parser = sglang_parser()
    flags = known_flags()
    for tok in args:
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            if name not in flags:
                prefixed = [f for f in flags if f.startswith(name)]
                close = prefixed[:6] or difflib.get_close_matches(name, flags, n=5, cutoff=0.6)
                kind = "ambiguous" if len(prefixed) > 1 else "abbreviated" if prefixed else "unknown"
                raise SGLangArgError(f"{kind} SGLang flag {name} (sglang {pinned_sglang_version()}); "
                                     f"candidates: {', '.join(close) if close else 'none'}")
    try:
        ns, rest = parser.parse_known_args(args)
    except argparse.ArgumentError as e:
        raise SGLangArgError(f"SGLang rejects {e.argument_name}: {e.message}") from None
    if rest:
        raise SGLangArgError(f"SGLang does not accept the arguments {rest}")
    return ns


def server_args_of(command: EngineCommand) -> argparse.Namespace:
    """Parse a generated command's flags (``argv[args_start:]``) with the pinned parser."""
    return parse_sglang_args(command.argv[command.args_start:])
