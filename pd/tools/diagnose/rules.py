"""From one log record to the finding it supports (:func:`classify`): its category, a title naming
the specifics (the port, the allocation size, the sm_100 kernel, the bootstrap address), the fix
(:mod:`.fixes`) and a tier that says whether it can be the root cause.

The rules are one table, :data:`RULES`, tried in order, most specific first: each rule names the pattern
(:mod:`.patterns`) whose lines are its evidence and builds its finding from them, or declines (None) and
the next rule is tried. A rule without a pattern reads the record itself.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from .evidence import (
    ROOT,
    SECONDARY,
    SYMPTOM,
    Finding,
    Record,
    arch_finding,
    cut,
    idx,
    kv_finding,
    model_path,
    nccl_detail,
    port_named,
    shadowed_import,
    short_name,
    sm100_tokens,
    uniq,
    with_context,
)
from .fixes import (
    FIX_CAPTURE,
    FIX_EXCEPTION,
    FIX_KV_MEM,
    FIX_MODEL_PATH,
    FIX_MODULE,
    FIX_OOM,
    FIX_PAGE,
    FIX_PD_MISMATCH,
    FIX_PORT,
    FIX_SIGQUIT,
    FIX_SMEM,
    FIX_WATCHDOG,
    PORT_FLAG,
    nccl_fix,
)
from .patterns import (
    CONSEQUENTIAL,
    RX_CAPTURE,
    RX_CHILD_EXIT,
    RX_CUDA_ERR,
    RX_ERRORISH,
    RX_KV,
    RX_KV_MEM,
    RX_MODEL_PATH,
    RX_MODULE,
    RX_NCCL,
    RX_NCCL_TIMEOUT,
    RX_NOIMAGE,
    RX_NORM,
    RX_OOM,
    RX_OOM_SIZE,
    RX_PAGE,
    RX_PAGE_VALUES,
    RX_PD_MISMATCH,
    RX_PORT,
    RX_SIGQUIT,
    RX_SM100,
    RX_SMEM,
    RX_SMEM_VALUES,
    RX_WATCHDOG,
)

__all__ = ["RULES", "Rule", "classify", "Finding", "ROOT", "SECONDARY", "SYMPTOM", "short_name", "sm100_tokens"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One category of failure: ``pattern`` picks its evidence lines (the rule runs only when one matches;
    None: it always runs and reads the record), ``find`` builds the finding or declines with None."""

    name: str
    pattern: Optional[re.Pattern]
    find: Callable[[Record, list[int]], Optional[Finding]]


def _page_size(r: Record, ev: list[int]) -> Finding:
    m = RX_PAGE_VALUES.search(r.joined)
    title = "Page size mismatch between prefill and decode"
    if m:
        title += f" (prefill page_size={m.group(1)}, decode page_size={m.group(2)})"
    return Finding("page_size_mismatch", title, FIX_PAGE, evidence=ev[:2])


def _pd_mismatch(r: Record, ev: list[int]) -> Finding:
    first = r.lines[ev[-1]]
    m = RX_PD_MISMATCH.search(first)
    sentence = first[m.start():].split(". ")[0] if m else first
    return Finding("pd_config_mismatch", "Prefill/decode mismatch: " + cut(sentence, 140),
                   FIX_PD_MISMATCH, key=RX_NORM.sub("#", sentence[:60]), evidence=ev[-1:])


def _shadowed(r: Record, ev: list[int]) -> Optional[Finding]:
    return shadowed_import(r.lines) if "cannot import name" in r.joined else None


def _port_in_use(r: Record, ev: list[int]) -> Finding:
    port, pkind = port_named(r.joined)
    title = f"Port {port} is already in use" if port else "A port the engine binds is already in use"
    if pkind and pkind not in ("http", "store", "zmq"):
        title += f" ({pkind})"
    elif pkind == "http":
        title += " (HTTP server --port)"
    elif pkind == "store":
        title += " (torch.distributed store)"
    flag = PORT_FLAG.get(pkind, "--port, --nccl-port, --disaggregation-bootstrap-port")
    return Finding("port_in_use", title, FIX_PORT.format(port=port or "N", flag=flag), key=port, evidence=ev[:2])


def _no_image(r: Record, ev: list[int]) -> Finding:
    return arch_finding(r.lines, ev, r.phrases)


def _oom(r: Record, ev: list[int]) -> Finding:
    size = RX_OOM_SIZE.search(r.joined)
    title = with_context("CUDA out of memory", r.phrases)
    if size:
        title += f" (tried to allocate {size.group(1)})"
    cap = idx(r.lines, RX_CAPTURE)
    return Finding("cuda_oom", title, FIX_OOM[r.kind], key=r.kind, evidence=uniq(ev[:1], cap[:1]))


def _kv_memory(r: Record, ev: list[int]) -> Finding:
    return Finding("kv_cache_memory", "Not enough GPU memory left for the KV cache", FIX_KV_MEM, evidence=ev[:1])


def _shared_memory(r: Record, ev: list[int]) -> Finding:
    m = RX_SMEM_VALUES.search(r.joined)
    title = "Triton kernel needs more shared memory than the GPU has per block"
    if m:
        title += f" (needs {m.group(1)} bytes, limit {m.group(2)})"
    return Finding("shared_memory", with_context(title, r.phrases), FIX_SMEM, evidence=ev[:1])


def _sm100_kernel(r: Record, ev: list[int]) -> Optional[Finding]:
    """An sm_100 kernel named in an error record (a mere mention in a healthy log is no failure)."""
    if not (r.exc or RX_ERRORISH.search(r.lines[0] if r.lines else "")):
        return None
    ev = [i for i in idx(r.lines, RX_SM100) if sm100_tokens(r.lines[i])]
    return arch_finding(r.lines, ev, r.phrases) if ev else None


def _nccl(r: Record, ev: list[int]) -> Finding:
    detail = nccl_detail(r.lines)
    title = with_context("NCCL failure" + (f": {cut(detail, 120)}" if detail else ""), r.phrases)
    return Finding("nccl", title, nccl_fix(detail + " " + r.low), key="error", evidence=uniq(ev[:2], r.exc[:1]))


def _nccl_timeout(r: Record, ev: list[int]) -> Finding:
    return Finding("nccl", "NCCL collective timed out or was aborted (a peer rank died or hung)",
                   "A collective waited on a rank that failed or hangs: the first error on another rank "
                   "is the cause; " + nccl_fix(r.low), tier=SECONDARY, key="timeout", evidence=ev[:1])


def _kv_transfer(r: Record, ev: list[int]) -> Optional[Finding]:
    return kv_finding(r.lines, r.joined, ev)


def _cuda_error(r: Record, ev: list[int]) -> Finding:
    m = RX_CUDA_ERR.search(r.lines[ev[0]])
    what = cut(m.group(0), 120)
    if "driver" in what.lower():
        fix = "Update the NVIDIA driver to one that supports this CUDA/torch build (nvidia-smi shows it)."
    elif r.kind == "capture":
        fix = ("An operation of the captured model is not graph-safe (a host sync or allocation in a "
               "kernel path): confirm with --cuda-graph-backend-decode disabled (slow; diagnosis only), "
               "then switch the attention / MoE backend that runs it.")
    else:
        fix = ("A kernel faulted: rerun with CUDA_LAUNCH_BLOCKING=1 to find it, and try another "
               "attention / MoE backend (--attention-backend triton, --moe-runner-backend triton).")
    return Finding("cuda_error", with_context(what, r.phrases), fix, key=RX_NORM.sub("#", what), evidence=ev[:1])


def _watchdog(r: Record, ev: list[int]) -> Finding:
    return Finding("watchdog_timeout", "Scheduler watchdog timeout: a forward step hung", FIX_WATCHDOG,
                   tier=SECONDARY, evidence=ev[:1])


def _child_exit(r: Record, ev: list[int]) -> Finding:
    m = RX_CHILD_EXIT.search(r.lines[ev[0]])
    who, code = (f"TP{m.group(1)} scheduler", m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    ranks = [int(m.group(1))] if m.group(1) else []
    if code == "-9":
        fix = ("SIGKILL with no traceback is usually the host's OOM killer (`dmesg -T | grep -i oom`): "
               "the engine needs more host RAM (fewer engines loading at once, more memory or swap).")
    elif code in ("-11", "-6", "-7"):
        fix = ("A native crash (segfault/abort) in a CUDA extension: check that the driver, CUDA and "
               "kernel packages match this GPU, and try other attention / MoE backends.")
    else:
        fix = "Its own traceback (earlier in the log) is the cause."
    tier = SECONDARY if code not in ("1", "0") else SYMPTOM
    return Finding("child_exit", f"{who} exited with code {code} without a traceback", fix, tier=tier,
                   key=who + code, evidence=ev[:1], ranks=ranks)


def _model_path_missing(r: Record, ev: list[int]) -> Finding:
    path = model_path(r.lines[ev[0]])
    return Finding("model_path", f"Model path {path!r} is not a checkpoint directory", FIX_MODEL_PATH,
                   key=path, evidence=ev[:1])


def _missing_module(r: Record, ev: list[int]) -> Finding:
    m = RX_MODULE.search(r.lines[ev[0]])
    mod = m.group(1) or "mooncake-transfer-engine"
    return Finding("missing_dependency", f"Missing Python module '{mod}'",
                   FIX_MODULE.format(mod=mod.split(".")[0].replace("_", "-")), key=mod, evidence=ev[:1])


def _sigquit(r: Record, ev: list[int]) -> Finding:
    return Finding("sigquit", "The parent process reports a failed child (SIGQUIT)", FIX_SIGQUIT, tier=SYMPTOM,
                   evidence=ev[:1])


def _graph_capture(r: Record, ev: list[int]) -> Finding:
    t = r.lines[ev[0]]
    wrapped = t[RX_CAPTURE.search(t).end():].lstrip(": ").strip() or (r.lines[r.exc[0]] if r.exc else "")
    title = with_context("CUDA graph capture failed", [p for p in r.phrases if "capture" not in p])
    if wrapped:
        title += f": {cut(wrapped, 120)}"
    return Finding("cuda_graph_capture", title, FIX_CAPTURE, key=RX_NORM.sub("#", wrapped[:80]),
                   evidence=uniq(ev[:1], r.exc[:1]))


def _exception(r: Record, ev: list[int]) -> Optional[Finding]:
    """Any other traceback: its exception line, a root cause unless it is one that follows from another."""
    if not r.exc:
        return None
    root = r.lines[r.exc[0]].strip()
    tier = SECONDARY if (CONSEQUENTIAL.match(root) or "exception ignored in" in r.low) else ROOT
    return Finding("exception", cut(root, 200), FIX_EXCEPTION, tier=tier, key=RX_NORM.sub("#", root[:200]),
                   evidence=[r.exc[0]])


RULES: tuple[Rule, ...] = (
    # prefill/decode configuration mismatches (the most specific texts first)
    Rule("page_size_mismatch", RX_PAGE, _page_size),
    Rule("pd_config_mismatch", RX_PD_MISMATCH, _pd_mismatch),
    Rule("shadowed_import", None, _shadowed),
    Rule("port_in_use", RX_PORT, _port_in_use),
    Rule("kernel_arch", RX_NOIMAGE, _no_image),
    Rule("cuda_oom", RX_OOM, _oom),
    Rule("kv_cache_memory", RX_KV_MEM, _kv_memory),
    Rule("shared_memory", RX_SMEM, _shared_memory),
    Rule("kernel_arch_sm100", None, _sm100_kernel),
    Rule("nccl", RX_NCCL, _nccl),
    Rule("nccl_timeout", RX_NCCL_TIMEOUT, _nccl_timeout),
    Rule("kv_transfer", RX_KV, _kv_transfer),
    Rule("cuda_error", RX_CUDA_ERR, _cuda_error),
    Rule("watchdog_timeout", RX_WATCHDOG, _watchdog),
    Rule("child_exit", RX_CHILD_EXIT, _child_exit),
    Rule("model_path", RX_MODEL_PATH, _model_path_missing),
    Rule("missing_dependency", RX_MODULE, _missing_module),
    Rule("sigquit", RX_SIGQUIT, _sigquit),
    Rule("cuda_graph_capture", RX_CAPTURE, _graph_capture),
    Rule("exception", None, _exception),
)


def classify(lines: list[str]) -> Finding | None:
    """The finding of the first rule of :data:`RULES` that takes the record ``lines``, or None."""
    if "server_args=" in lines[0]:  # the startup dump of every flag: names, not failures
        return None
    r = Record.of(lines)
    for rule in RULES:
        ev = idx(lines, rule.pattern) if rule.pattern is not None else []
        if rule.pattern is not None and not ev:
            continue
        found = rule.find(r, ev)
        if found is not None:
            return found
    return None
