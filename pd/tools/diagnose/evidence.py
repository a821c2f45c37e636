"""What the diagnosis rules (:mod:`.rules`) read a log record with: the :class:`Finding` a rule returns, the
:class:`Record` it reads, and helpers that pull the specifics (port, addresses, messages, context) out of it."""

from __future__ import annotations

import dataclasses
import re

from pd.util.shadowing import SHADOWING_FOLDERS

from .fixes import (
    FIX_ARCH,
    FIX_KV_BOOTSTRAP,
    FIX_KV_LOST,
    FIX_KV_OTHER,
    FIX_KV_UNREACHABLE,
    FIX_KV_WAIT,
    FIX_MOONCAKE,
    FIX_SHADOW,
    FIX_SHADOW_PDSERVE,
)
from .logparse import HEAD, TB, Source
from .patterns import (
    RX_EXC_LINE,
    RX_FRAME_FILE,
    RX_IMPORT_NAME,
    RX_INSTALLED,
    RX_KV_ADDR,
    RX_KV_BENIGN,
    RX_MODEL_PATH,
    RX_NOIMAGE,
    RX_NORM,
    RX_PORT_VALUE,
    RX_SM100,
    RX_SM100_QUICK,
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


@dataclasses.dataclass(frozen=True)
class Record:
    """One log record as the rules read it: its lines, their text joined (and lower-cased), the indexes of
    the exception lines ending its tracebacks, and where in the engine's life it failed (``_context``)."""

    lines: list[str]
    joined: str
    low: str
    exc: list[int]
    kind: str
    phrases: list[str]

    @classmethod
    def of(cls, lines: list[str]) -> "Record":
        joined = "\n".join(lines)
        low = joined.lower()
        kind, phrases = _context(low)
        return cls(lines, joined, low, _exception_lines(lines), kind, phrases)


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


def shadowed_import(lines: list[str]) -> Finding | None:
    """``cannot import name 'N' from 'M' (PATH)`` where PATH is ``.../M/__init__.py`` outside site-packages and
    dist-packages: a folder named like the package, in a checkout or working dir on sys.path, was imported in
    place of the installed package."""
    for i in idx(lines, RX_IMPORT_NAME):
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
        return Finding("shadowed_import", title, fix, key=f"{top}:{folder}", evidence=uniq([i], frames[-1:]))
    return None


def model_path(line: str) -> str:
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


def idx(lines: list[str], rx: re.Pattern) -> list[int]:
    """Indexes of the lines matching ``rx``: messages first, then traceback source lines (indented)."""
    hits = [i for i, t in enumerate(lines) if rx.search(t)]
    return [i for i in hits if lines[i][:1] not in " \t"] + [i for i in hits if lines[i][:1] in " \t"]


def uniq(*lists: list[int]) -> list[int]:
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


def cut(s: str, n: int = 160) -> str:
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


def with_context(title: str, phrases: list[str]) -> str:
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


def nccl_detail(lines: list[str]) -> str:
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


def port_named(text: str) -> tuple[str, str]:
    """(port, kind) named by a port-in-use record."""
    for rx, kind in RX_PORT_VALUE:
        m = rx.search(text)
        if m:
            if kind == "name":
                return m.group(2), m.group(1)
            return m.group(1), kind or ""
    return "", ""


def sm100_tokens(line: str) -> list[str]:
    """The sm_100 kernel names a line mentions (``..._sm100f``), empty when none."""
    if not RX_SM100_QUICK.search(line):
        return []
    return [m.group(1) for m in RX_SM100.finditer(line)]


def arch_finding(lines: list[str], ev: list[int], phrases: list[str]) -> Finding:
    names = [n for i in range(len(lines)) for n in sm100_tokens(lines[i])]
    title = "Kernel built for another GPU architecture"
    if any(RX_NOIMAGE.search(lines[i]) for i in ev):
        title += ": no kernel image is available for this device"
    if names:
        longest = max(names, key=len)
        title += f" (sm_100 kernel {short_name(longest)})"
        sm_lines = [i for i in range(len(lines)) if sm100_tokens(lines[i])]
        ev = uniq(ev[:1], sm_lines[:1])
    return Finding("kernel_arch", with_context(title, phrases), FIX_ARCH, key="", evidence=ev[:2])


def kv_finding(lines: list[str], joined: str, ev: list[int]) -> Finding | None:
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
        return Finding("kv_transfer", "Mooncake transfer engine failure: " + cut(_message(lines[ev[0]]), 110),
                        FIX_MOONCAKE, key="mooncake", evidence=ev)
    if "unknown reason from another rank" in low:
        return Finding("kv_transfer", "KV transfer failed on another rank", FIX_KV_OTHER.format(addr=addr),
                        tier=SECONDARY, key="other-rank", evidence=ev)
    m = re.search(r"KVTransferError\([^)]*\): (.+)|with exception (.+)|failed[^:]*: (.+)", text)
    reason = next((g for g in (m.groups() if m else ()) if g), "")
    title = "KV transfer failed" + (f": {cut(reason, 120)}" if reason else "")
    return Finding("kv_transfer", title, FIX_KV_OTHER.format(addr=addr), key=RX_NORM.sub("#", reason[:60]),
                    evidence=ev)
