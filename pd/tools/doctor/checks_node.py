"""Checks of what this node must provide: the GPUs the config names, a free router port, pdserve's
SGLang plugin in this Python, and the RDMA device KV moves over."""

from __future__ import annotations

import errno
import socket
import sys

import httpx

from . import hardware
from .context import Context
from .findings import Finding


def check_gpu_arch(ctx: Context) -> list[Finding]:
    """Report the GPU architecture the other checks assume (or that they are skipped)."""
    g = ctx.gpu
    if g.arch is None:
        if not ctx.sglang:
            return [Finding("ok", "gpu-arch", "the reference engine needs no GPU architecture")]
        return [Finding("ok", "gpu-arch", "skipped: no GPU detected (no nvidia-smi, no torch.cuda); architecture "
                        "checks are skipped — pass --assume-gpu sm_120 (or sm_90, sm_100) to check for that GPU")]
    count = f", {g.count} GPUs" if g.count is not None else ""
    return [Finding("ok", "gpu-arch", f"GPU {g.arch}{count} (from {g.source})")]


def check_gpus(ctx: Context) -> list[Finding]:
    """Explicit GPU ids must exist on the node; warn when the cluster claims more GPUs than one
    node has."""
    cfg, out = ctx.cfg, []
    n = ctx.gpu.count
    for role, g in cfg.groups().items():
        for i, ids in enumerate(g.gpus or []):
            beyond_node = [x for x in ids if x >= cfg.cluster.gpus_per_node]
            if beyond_node:
                out.append(Finding("error", "gpus", f"{role}.gpus[{i}]: GPU ids {beyond_node} are not below "
                                   f"cluster.gpus_per_node={cfg.cluster.gpus_per_node}; the ids index the GPUs of the "
                                   "worker's node (CUDA_VISIBLE_DEVICES)",
                                   f"use ids 0..{cfg.cluster.gpus_per_node - 1} (placement picks the node)"))
            elif n is not None and any(x >= n for x in ids):
                out.append(Finding("error", "gpus", f"{role}.gpus[{i}]: GPU ids {[x for x in ids if x >= n]} do not "
                                   f"exist: this node has {n} GPUs ({ctx.gpu.source})",
                                   f"use ids 0..{n - 1}, or let Ray place the workers ({role}.gpus: null)"))
    per_node = min(cfg.cluster.num_gpus, cfg.cluster.gpus_per_node)
    if n is not None and per_node > n:
        out.append(Finding("warning", "gpus", f"cluster.num_gpus={cfg.cluster.num_gpus} "
                           f"(gpus_per_node={cfg.cluster.gpus_per_node}) but this node has {n} GPUs "
                           f"({ctx.gpu.source})",
                           f"set cluster.gpus_per_node: {n} (and cluster.num_gpus to the cluster's total)"))
    if not out:
        out.append(Finding("ok", "gpus", "GPU ids exist and do not overlap" if n is not None
                           else "GPU ids do not overlap (GPU count not detected)"))
    return out


def check_router_port(ctx: Context) -> list[Finding]:
    """The router's host:port must be bindable on this machine (the launcher runs the router here)."""
    if not ctx.check_ports:
        return []
    r = ctx.cfg.router
    try:
        infos = socket.getaddrinfo(r.host, r.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return [Finding("error", "router-port", f"router.host {r.host!r} does not resolve: {e}",
                        "set router.host to an address of this machine")]
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server does
        s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            if _pdserve_router_at(r.host, r.port):
                return [Finding("warning", "router-port", f"router.port {r.port} on {r.host} is in use by a running "
                                "pdserve router (this config's cluster, if it is already up)",
                                "a second cluster needs another router.port (pdserve up --port N); this one stops "
                                "with `ray job stop JOB_ID` (or Ctrl-C in its pdserve up)")]
            return [Finding("error", "router-port", f"router.port {r.port} on {r.host} is already in use",
                            f"stop what listens there (ss -ltnp 'sport = :{r.port}') or set router.port to a free "
                            "port")]
        if e.errno == errno.EADDRNOTAVAIL:
            return [Finding("error", "router-port", f"router.host {r.host} is not an address of this machine",
                            "set router.host to 0.0.0.0, 127.0.0.1 or this machine's address")]
        return [Finding("error", "router-port", f"cannot bind router {r.host}:{r.port}: {e.strerror}",
                        "set router.port to a free port above 1023")]
    finally:
        s.close()
    return [Finding("ok", "router-port", f"router {r.host}:{r.port} is free")]


def _pdserve_router_at(host: str, port: int) -> bool:
    """Whether what listens on host:port answers /metrics as a pdserve router does (2 s at most)."""
    probe = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    try:
        r = httpx.get(f"http://{probe}:{port}/metrics", timeout=2, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and "pdserve_router_requests_total" in r.text


def check_pdserve_plugin(ctx: Context) -> list[Finding]:
    """With ``sglang.pdserve_kernels`` on, this Python must expose pdserve's SGLang plugin: SGLang finds
    plugins only through installed package metadata, and without it the workers start, silently, without
    our kernels."""
    if not ctx.sglang or not ctx.cfg.sglang.pdserve_kernels.enabled:
        return []
    from importlib.metadata import entry_points

    from pd.kernels.sglang_plugin import ENTRY_POINT_GROUP, PLUGIN_NAME

    want = "pd.kernels.sglang_plugin:register"
    if any(e.name == PLUGIN_NAME and e.value == want for e in entry_points(group=ENTRY_POINT_GROUP)):
        return [Finding("ok", "pdserve-plugin", f"SGLang workers load pdserve's plugin ({want})")]
    level = "warning" if ctx.cfg.sglang.launch_command else "error"  # a wrapper may run another Python
    return [Finding(level, "pdserve-plugin",
                    f"sglang.pdserve_kernels is on, but {sys.executable} has no '{PLUGIN_NAME}' entry point in "
                    f"{ENTRY_POINT_GROUP}: SGLang workers would run without pdserve's kernels",
                    "pip install -e . (this checkout) in the Python that runs the workers; a stale "
                    "pdserve.egg-info in the working directory also hides the installed metadata: delete it")]


def check_kv_transfer(ctx: Context) -> list[Finding]:
    """KV over TCP is a warning (SGLang engine); an ib_device this machine does not have is an error."""
    t = ctx.cfg.transfer
    have = hardware.ib_devices()
    if t.protocol == "rdma":
        want = [x.strip() for x in (t.ib_device or "").split(",") if x.strip()]
        missing = [x for x in want if not have or x not in have]
        if missing:
            listed = f"it lists {', '.join(have)}" if have else f"{hardware.IB_SYSFS} lists none"
            return [Finding("error", "kv-transfer", f"transfer.ib_device {', '.join(missing)} is not an RDMA "
                            f"device of this machine ({listed})",
                            "set transfer.ib_device to one of " + ", ".join(have) if have
                            else "set transfer.protocol: tcp (or install the RDMA driver)")]
        return [Finding("ok", "kv-transfer", f"KV over RDMA ({t.ib_device})")]
    if not ctx.sglang:
        return [Finding("ok", "kv-transfer", "KV over TCP (reference engine)")]
    ignored = f"; transfer.ib_device {t.ib_device} is ignored (MC_FORCE_TCP=1)" if t.ib_device else ""
    fix = (f"set transfer.protocol: rdma and transfer.ib_device: {have[0]} (this machine has {', '.join(have)})" if have
           else "with an RDMA NIC: set transfer.protocol: rdma and transfer.ib_device (e.g. mlx5_0)")
    return [Finding("warning", "kv-transfer", "transfer.protocol is tcp: KV caches move over TCP (Mooncake, "
                    f"MC_FORCE_TCP=1), slower than RDMA; long prompts pay for it in time to first token{ignored}",
                    fix)]
