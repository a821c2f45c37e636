"""From one log record to the finding it supports (:func:`classify`): its category, a title naming
the specifics (the port, the allocation size, the sm_100 kernel, the bootstrap address), the fix
(:mod:`.fixes`) and a tier that says whether it can be the root cause.

The categories are tried most specific first; the patterns are in :mod:`.patterns`.
"""

from __future__ import annotations

import dataclasses
import re

from pd.util.shadowing import SHADOWING_FOLDERS

from .fixes import (
    FIX_ARCH,
    FIX_CAPTURE,
    FIX_EXCEPTION,
    FIX_KV_BOOTSTRAP,
    FIX_KV_LOST,
    FIX_KV_MEM,
    FIX_KV_OTHER,
    FIX_KV_UNREACHABLE,
    FIX_KV_WAIT,
    FIX_MODEL_PATH,
    FIX_MODULE,
    FIX_MOONCAKE,
    FIX_OOM,
    FIX_PAGE,
    FIX_PD_MISMATCH,
    FIX_PORT,
    FIX_SHADOW,
    FIX_SHADOW_PDSERVE,
    FIX_SIGQUIT,
    FIX_SMEM,
    FIX_WATCHDOG,
    PORT_FLAG,
    nccl_fix,
)
from .logparse import HEAD, TB, Source
from .patterns import (
    CONSEQUENTIAL,
    RX_CAPTURE,
    RX_CHILD_EXIT,
    RX_CUDA_ERR,
    RX_ERRORISH,
    RX_EXC_LINE,
    RX_FRAME_FILE,
    RX_IMPORT_NAME,
    RX_INSTALLED,
    RX_KV,
    RX_KV_ADDR,
    RX_KV_BENIGN,
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
    RX_PORT_VALUE,
    RX_SIGQUIT,
    RX_SM100,
    RX_SM100_QUICK,
    RX_SMEM,
    RX_SMEM_VALUES,
    RX_WATCHDOG,
)

# Tiers: 0 = a root cause; 1 = often the consequence of a failure elsewhere (primary only when
# nothing better is found); 2 = a pure symptom (never primary).
ROOT, SECONDARY, SYMPTOM = 0, 1, 2


@dataclasses.dataclass
class Finding:
    """What one record shows; merged by (category, key) into a :class:`~.diagnosis.Diagnosis`."""

    category: str
    title: str
    fix: str
    tier: int = ROOT
    key: str = ""
    evidence: list[int] = dataclasses.field(default_factory=list)  # indexes into the record's lines
    ranks: list[int] = dataclasses.field(default_factory=list)  # ranks named in the text itself


# The package a bare import of one of pdserve's top-level folders means (each name is a package on PyPI).
REAL_PACKAGES = {"kernels": "Hugging Face's 'kernels' (PyPI kernels; transformers and SGLang import it)"}


def _importer(lines: list[str], i: int) -> str:
    """The installed package whose code ran the import failing at ``lines[i]`` (the traceback's last frame: the
    folder after site-packages), else ``""``."""
    for t in reversed(lines[:i]):
        m = RX_FRAME_FILE.match(t)
        if m:
            path = m.group(1).replace("\\", "/")
            installed = RX_INSTALLED.search(path)
            return path[installed.end():].split("/")[0].removesuffix(".py") if installed else ""
    return ""


def _shadowed_import(lines: list[str]) -> Finding | None:
    """``cannot import name 'N' from 'M' (PATH)`` where PATH is ``.../M/__init__.py`` outside site-packages and
    dist-packages: a folder named like the package, in a checkout or working dir on sys.path, was imported in
    place of the installed package."""
    for i in _idx(lines, RX_IMPORT_NAME):
        name, mod, path = RX_IMPORT_NAME.search(lines[i]).groups()
        parts, names = path.replace("\\", "/").split("/"), mod.split(".")
        if parts[-1] != "__init__.py" or parts[-1 - len(names):-1] != names or RX_INSTALLED.search(path):
            continue
        top = names[0]
        folder = "/".join(parts[:len(parts) - len(names)])
        importer = _importer(lines, i)
        title = (f"Shadowed import: `from {mod} import {name}`{f' in {importer}' if importer else ''} found the folder "
                 f"{folder}/, not the installed package '{top}'")
        if top in SHADOWING_FOLDERS:
            fix = FIX_SHADOW_PDSERVE.format(folder=folder, mod=top,
                                            real=REAL_PACKAGES.get(top, f"the installed package '{top}' (PyPI {top})"))
        else:
            fix = FIX_SHADOW.format(mod=top, importer=importer or "the importing code")
        frames = [k for k in range(i) if RX_FRAME_FILE.match(lines[k])]
        return Finding("shadowed_import", title, fix, key=f"{top}:{folder}", evidence=_uniq([i], frames[-1:]))
    return None


def _model_path(line: str) -> str:
    """The path a model-path error names: after ``--model-path``, the last quoted string of a
    Hub repo-id error, else the word before the message."""
    m = RX_MODEL_PATH.search(line)
    if m.group().startswith("--model-path"):
        return m.group().split()[1].rstrip(":")
    if m.group().startswith("Repo id"):
        quoted = re.findall(r"'([^']*)'", line[m.end():])
        return quoted[-1] if quoted else "?"
    words = line[:m.start()].split()
    return words[-1].strip("'\"") if words else "?"


def _idx(lines: list[str], rx: re.Pattern) -> list[int]:
    """Indexes of the lines matching ``rx``: messages first, then traceback source lines (indented)."""
    hits = [i for i, t in enumerate(lines) if rx.search(t)]
    return [i for i in hits if lines[i][:1] not in " \t"] + [i for i in hits if lines[i][:1] in " \t"]


def _uniq(*lists: list[int]) -> list[int]:
    """The indexes in order of first appearance (the main evidence line first)."""
    return list(dict.fromkeys(i for lst in lists for i in lst))


def short_name(name: str) -> str:
    """A kernel name cut for a title: ``bmm_MxE2m1_MxE2m...TN_schedS_sm100f``."""
    return name if len(name) <= 48 else f"{name[:16]}...{name[-24:]}"


def _message(line: str) -> str:
    """A log line without its record header (timestamp, rank, glog/NCCL prefix)."""
    _, body = Source.split_label(line)
    m = HEAD.match(body)
    if m and not body[m.end():].strip():
        return body.strip()
    if m:
        body = body[m.end():]
        if re.match(r"(?:\d+ +)?\S+:\d+\] ", body):  # glog: "[thread] file.cpp:123] message"
            body = body.split("] ", 1)[1]
    return body.strip()


def _cut(s: str, n: int = 160) -> str:
    s = s.strip()
    return s if len(s) <= n else s[: n - 3] + "..."


def _context(low: str) -> tuple[str, list[str]]:
    """(kind, phrases) of where in the engine's life the record failed."""
    capture = "capture cuda graph failed" in low or ("cuda_graph" in low and "capture" in low)
    phrases = []
    kind = ""
    if capture:
        phrases.append("during CUDA graph capture")
        kind = "capture"
    elif "load_weights" in low or "load_model" in low or "weight_utils" in low:
        phrases.append("while loading the weights")
        kind = "load"
    if re.search(r"eagle|draft_|/speculative/|\bmtp", low):
        phrases.append("in the EAGLE/MTP draft model")
    return kind, phrases


def _with_context(title: str, phrases: list[str]) -> str:
    return title + (" " + ", ".join(phrases) if phrases else "")


def _exception_lines(lines: list[str]) -> list[int]:
    """Indexes of the exception lines that end each traceback in the record."""
    out = []
    in_tb = False
    for i, t in enumerate(lines):
        if TB in t:
            in_tb = True
            continue
        if in_tb:
            if not t.strip() or t[:1] in " \t":
                continue
            if RX_EXC_LINE.match(t):
                out.append(i)
            in_tb = False
    return out


def _nccl_detail(lines: list[str]) -> str:
    for i, t in enumerate(lines):
        if t.strip() == "Last error:" and i + 1 < len(lines):
            return lines[i + 1].strip()
    for t in lines:
        m = re.search(r"NCCL WARN (.+)", t)
        if m:
            return m.group(1).strip()
    for t in lines:
        m = re.search(r"(nccl\w+Error): (.+)", t) or re.search(r"NCCL error[^:]*: (.+)", t)
        if m:
            return m.group(0).strip()
    return ""


def _kv_addr(text: str) -> str:
    for rx in RX_KV_ADDR:
        m = rx.search(text)
        if m:
            return ":".join(m.groups())
    return ""


def _port(text: str) -> tuple[str, str]:
    """(port, kind) named by a port-in-use record."""
    for rx, kind in RX_PORT_VALUE:
        m = rx.search(text)
        if m:
            if kind == "name":
                return m.group(2), m.group(1)
            return m.group(1), kind or ""
    return "", ""


def classify(lines: list[str]) -> Finding | None:
    """The finding one record supports, or None."""
    if "server_args=" in lines[0]:  # the startup dump of every flag: names, not failures
        return None
    joined = "\n".join(lines)
    low = joined.lower()
    exc = _exception_lines(lines)
    kind, phrases = _context(low)

    # Prefill/decode configuration mismatches (the most specific texts first).
    ev = _idx(lines, RX_PAGE)
    if ev:
        m = RX_PAGE_VALUES.search(joined)
        title = "Page size mismatch between prefill and decode"
        if m:
            title += f" (prefill page_size={m.group(1)}, decode page_size={m.group(2)})"
        return Finding("page_size_mismatch", title, FIX_PAGE, evidence=ev[:2])
    ev = _idx(lines, RX_PD_MISMATCH)
    if ev:
        first = lines[ev[-1]]
        m = RX_PD_MISMATCH.search(first)
        sentence = first[m.start():].split(". ")[0] if m else first
        return Finding("pd_config_mismatch", "Prefill/decode mismatch: " + _cut(sentence, 140),
                        FIX_PD_MISMATCH, key=RX_NORM.sub("#", sentence[:60]), evidence=ev[-1:])

    shadow = _shadowed_import(lines) if "cannot import name" in joined else None
    if shadow is not None:
        return shadow

    ev = _idx(lines, RX_PORT)
    if ev:
        port, pkind = _port(joined)
        title = f"Port {port} is already in use" if port else "A port the engine binds is already in use"
        if pkind and pkind not in ("http", "store", "zmq"):
            title += f" ({pkind})"
        elif pkind == "http":
            title += " (HTTP server --port)"
        elif pkind == "store":
            title += " (torch.distributed store)"
        flag = PORT_FLAG.get(pkind, "--port, --nccl-port, --disaggregation-bootstrap-port")
        return Finding("port_in_use", title, FIX_PORT.format(port=port or "N", flag=flag), key=port,
                        evidence=ev[:2])

    ev = _idx(lines, RX_NOIMAGE)
    if ev:
        return _arch_finding(lines, ev, phrases)

    ev = _idx(lines, RX_OOM)
    if ev:
        size = RX_OOM_SIZE.search(joined)
        title = _with_context("CUDA out of memory", phrases)
        if size:
            title += f" (tried to allocate {size.group(1)})"
        cap = _idx(lines, RX_CAPTURE)
        return Finding("cuda_oom", title, FIX_OOM[kind], key=kind, evidence=_uniq(ev[:1], cap[:1]))

    ev = _idx(lines, RX_KV_MEM)
    if ev:
        return Finding("kv_cache_memory", "Not enough GPU memory left for the KV cache", FIX_KV_MEM, evidence=ev[:1])

    ev = _idx(lines, RX_SMEM)
    if ev:
        m = RX_SMEM_VALUES.search(joined)
        title = "Triton kernel needs more shared memory than the GPU has per block"
        if m:
            title += f" (needs {m.group(1)} bytes, limit {m.group(2)})"
        return Finding("shared_memory", _with_context(title, phrases), FIX_SMEM, evidence=ev[:1])

    if exc or RX_ERRORISH.search(lines[0] if lines else ""):
        ev = [i for i in _idx(lines, RX_SM100) if sm100_tokens(lines[i])]
        if ev:
            return _arch_finding(lines, ev, phrases)

    ev = _idx(lines, RX_NCCL)
    if ev:
        detail = _nccl_detail(lines)
        title = _with_context("NCCL failure" + (f": {_cut(detail, 120)}" if detail else ""), phrases)
        return Finding("nccl", title, nccl_fix(detail + " " + low), key="error",
                        evidence=_uniq(ev[:2], exc[:1]))
    ev = _idx(lines, RX_NCCL_TIMEOUT)
    if ev:
        return Finding("nccl", "NCCL collective timed out or was aborted (a peer rank died or hung)",
                        "A collective waited on a rank that failed or hangs: the first error on another rank "
                        "is the cause; " + nccl_fix(low), tier=SECONDARY, key="timeout", evidence=ev[:1])

    ev = _idx(lines, RX_KV)
    if ev:
        return _kv_finding(lines, joined, ev)

    ev = _idx(lines, RX_CUDA_ERR)
    if ev:
        m = RX_CUDA_ERR.search(lines[ev[0]])
        what = _cut(m.group(0), 120)
        if "driver" in what.lower():
            fix = "Update the NVIDIA driver to one that supports this CUDA/torch build (nvidia-smi shows it)."
        elif kind == "capture":
            fix = ("An operation of the captured model is not graph-safe (a host sync or allocation in a "
                   "kernel path): confirm with --cuda-graph-backend-decode disabled (slow; diagnosis only), "
                   "then switch the attention / MoE backend that runs it.")
        else:
            fix = ("A kernel faulted: rerun with CUDA_LAUNCH_BLOCKING=1 to find it, and try another "
                   "attention / MoE backend (--attention-backend triton, --moe-runner-backend triton).")
        return Finding("cuda_error", _with_context(what, phrases), fix, key=RX_NORM.sub("#", what),
                        evidence=ev[:1])

    ev = _idx(lines, RX_WATCHDOG)
    if ev:
        return Finding("watchdog_timeout", "Scheduler watchdog timeout: a forward step hung", FIX_WATCHDOG,
                        tier=SECONDARY, evidence=ev[:1])

    ev = _idx(lines, RX_CHILD_EXIT)
    if ev:
        m = RX_CHILD_EXIT.search(lines[ev[0]])
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

    ev = _idx(lines, RX_MODEL_PATH)
    if ev:
        path = _model_path(lines[ev[0]])
        return Finding("model_path", f"Model path {path!r} is not a checkpoint directory", FIX_MODEL_PATH,
                        key=path, evidence=ev[:1])

    ev = _idx(lines, RX_MODULE)
    if ev:
        m = RX_MODULE.search(lines[ev[0]])
        mod = m.group(1) or "mooncake-transfer-engine"
        return Finding("missing_dependency", f"Missing Python module '{mod}'",
                        FIX_MODULE.format(mod=mod.split(".")[0].replace("_", "-")), key=mod, evidence=ev[:1])

    ev = _idx(lines, RX_SIGQUIT)
    if ev:
        return Finding("sigquit", "The parent process reports a failed child (SIGQUIT)", FIX_SIGQUIT,
                        tier=SYMPTOM, evidence=ev[:1])

    ev = _idx(lines, RX_CAPTURE)
    if ev:
        t = lines[ev[0]]
        wrapped = t[RX_CAPTURE.search(t).end():].lstrip(": ").strip() or (lines[exc[0]] if exc else "")
        title = _with_context("CUDA graph capture failed", [p for p in phrases if "capture" not in p])
        if wrapped:
            title += f": {_cut(wrapped, 120)}"
        return Finding("cuda_graph_capture", title, FIX_CAPTURE, key=RX_NORM.sub("#", wrapped[:80]),
                        evidence=_uniq(ev[:1], exc[:1]))

    if exc:
        root = lines[exc[0]].strip()
        tier = SECONDARY if (CONSEQUENTIAL.match(root) or "exception ignored in" in low) else ROOT
        return Finding("exception", _cut(root, 200), FIX_EXCEPTION, tier=tier,
                        key=RX_NORM.sub("#", root[:200]), evidence=[exc[0]])
    return None


def sm100_tokens(line: str) -> list[str]:
    """The sm_100 kernel names a line mentions (``..._sm100f``), empty when none."""
    if not RX_SM100_QUICK.search(line):
        return []
    return [m.group(1) for m in RX_SM100.finditer(line)]


def _arch_finding(lines: list[str], ev: list[int], phrases: list[str]) -> Finding:
    names = [n for i in range(len(lines)) for n in sm100_tokens(lines[i])]
    title = "Kernel built for another GPU architecture"
    if any(RX_NOIMAGE.search(lines[i]) for i in ev):
        title += ": no kernel image is available for this device"
    if names:
        longest = max(names, key=len)
        title += f" (sm_100 kernel {short_name(longest)})"
        sm_lines = [i for i in range(len(lines)) if sm100_tokens(lines[i])]
        ev = _uniq(ev[:1], sm_lines[:1])
    return Finding("kernel_arch", _with_context(title, phrases), FIX_ARCH, key="", evidence=ev[:2])


def _kv_finding(lines: list[str], joined: str, ev: list[int]) -> Finding | None:
    main = [i for i in ev if not RX_KV_BENIGN.search(lines[i])]
    if not main:
        return Finding("kv_transfer", "", "", tier=-1)  # a client abort: not a failure
    text = "\n".join(lines[i] for i in main)
    addr = _kv_addr(joined) or "the prefill's bootstrap host:port"
    low = text.lower()
    ev = main[:2]
    if "kvpoll.bootstrapping" in low or "when bootstrapping" in low:
        return Finding("kv_transfer", "PD bootstrap timed out (KVPoll.Bootstrapping): the KV destination "
                        "never reached the prefill", FIX_KV_BOOTSTRAP.format(addr=addr), key="bootstrap", evidence=ev)
    if "kvpoll.waitingforinput" in low or "waiting for prefill" in low or "no kv from prefill" in low:
        return Finding("kv_transfer", "Decode timed out waiting for the KV cache from the prefill",
                        FIX_KV_WAIT, key="waiting", evidence=ev)
    if "lost connection with prefill" in low or "now it is down" in low:
        return Finding("kv_transfer", f"Lost connection with the prefill ({addr})",
                        FIX_KV_LOST.format(addr=addr), tier=SECONDARY, key="lost", evidence=ev)
    if ("prefill server info" in low or "parallel info" in low or "unreachable" in low
            or "register to bootstrap" in low):
        return Finding("kv_transfer", f"Cannot reach the prefill's bootstrap server ({addr})",
                        FIX_KV_UNREACHABLE.format(addr=addr), key="unreachable", evidence=ev)
    if "mooncake" in low or "retry counter" in low or "transferengine" in low or "rdma" in low:
        return Finding("kv_transfer", "Mooncake transfer engine failure: " + _cut(_message(lines[ev[0]]), 110),
                        FIX_MOONCAKE, key="mooncake", evidence=ev)
    if "unknown reason from another rank" in low:
        return Finding("kv_transfer", "KV transfer failed on another rank", FIX_KV_OTHER.format(addr=addr),
                        tier=SECONDARY, key="other-rank", evidence=ev)
    m = re.search(r"KVTransferError\([^)]*\): (.+)|with exception (.+)|failed[^:]*: (.+)", text)
    reason = next((g for g in (m.groups() if m else ()) if g), "")
    title = "KV transfer failed" + (f": {_cut(reason, 120)}" if reason else "")
    return Finding("kv_transfer", title, FIX_KV_OTHER.format(addr=addr), key=RX_NORM.sub("#", reason[:60]),
                    evidence=ev)
