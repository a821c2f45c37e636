"""Root cause of a failed engine start or crash, read from its logs (``pdserve diagnose``).

An SGLang server writes every tensor-parallel rank into one stream: ``[2025-11-02 10:12:03 TP2] ...``
from the scheduler of rank 2, ``[2025-11-02 10:12:03] ...`` from the parent process, and tracebacks
as unprefixed continuation lines of the record that logged them. When one rank fails, its scheduler
logs the traceback and sends SIGQUIT to the parent, which kills the whole process tree; every other
rank either fails the same way or is killed silently. Operators then see a SIGQUIT message last and a
wall of near-identical tracebacks above it.

This module reads such logs (one combined log, per-rank files, several engines' logs, or the tail a
worker actor kept) and names the root cause:

- the earliest root-cause error across ranks, shown once with the ranks that hit it;
- a known category (out of memory, kernel built for another GPU, Mooncake/bootstrap failure, port in
  use, NCCL, prefill/decode mismatch, ...) with the fix to try;
- never the SIGQUIT itself: the parent's message is evidence that a child died, attached to the
  child's error.

Public API: :func:`diagnose_logs`, :func:`diagnose_text`, :func:`render`, :class:`Diagnosis`.

How it stays fast on big logs (100k lines in well under a second): the text is searched once per
trigger word with ``str.find`` (C speed); only records around a hit are parsed (walking back to the
log record's header line and forward to the next one), and repeated one-line records are classified
once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from typing import Iterable, NamedTuple

__all__ = ["CATEGORIES", "Diagnosis", "Evidence", "diagnose_logs", "diagnose_text", "render", "main"]


# --------------------------------------------------------------------------------------------------
# Public data
# --------------------------------------------------------------------------------------------------

CATEGORIES: dict[str, str] = {
    "kernel_arch": "a GPU kernel built for another architecture (no kernel image / sm_100-only kernel)",
    "cuda_oom": "CUDA out of memory (weights, CUDA graph capture, or at run time)",
    "kv_cache_memory": "no GPU memory left for the KV cache after loading",
    "shared_memory": "a Triton kernel needs more shared memory per block than the GPU has",
    "cuda_graph_capture": "CUDA graph capture failed for a reason not recognised below it",
    "cuda_error": "another CUDA error (illegal memory access, device-side assert, driver too old)",
    "nccl": "NCCL / torch.distributed communication failure",
    "kv_transfer": "Mooncake KV transfer or PD bootstrap failure",
    "page_size_mismatch": "prefill and decode run with different --page-size",
    "pd_config_mismatch": "prefill and decode disagree on another setting (KV dtype, layout, policy)",
    "port_in_use": "a port the engine binds is already taken",
    "missing_dependency": "a Python module the engine needs is not installed",
    "model_path": "--model-path is not a local checkpoint directory (typo, not mounted on this node)",
    "watchdog_timeout": "a forward step hung past SGLang's watchdog timeout",
    "child_exit": "an engine subprocess died (killed, crashed) without a Python traceback",
    "sigquit": "the parent got SIGQUIT from a failed child (a symptom; never the root cause)",
    "exception": "a Python traceback that matches no known pattern (shown as found)",
}

#: Categories that are not a recognised cause (the CLI exits 1 when only these are found).
UNRECOGNISED = frozenset({"exception", "sigquit"})

# Tiers: 0 = a root cause; 1 = often the consequence of a failure elsewhere (primary only when
# nothing better is found); 2 = a pure symptom (never primary).
_ROOT, _SECONDARY, _SYMPTOM = 0, 1, 2


class Evidence(NamedTuple):
    """One log line that proves a diagnosis: ``(file, line, text)``, line numbers from 1."""

    file: str
    line: int
    text: str


@dataclasses.dataclass
class Diagnosis:
    """One distinct cause found in the logs.

    Attributes:
        cause: short title, e.g. ``"CUDA out of memory during CUDA graph capture"``.
        category: category id, a key of :data:`CATEGORIES`.
        evidence: the few lines that prove it, as :class:`Evidence` ``(file, line, text)``.
        ranks: tensor-parallel ranks that hit it (``[0, 1, 2, 3]``); empty when the log has no ranks.
        fix: what to try.
        primary: True for the one root cause to act on first (at most one per result).
        occurrences: how many log records showed it (all ranks, all repeats).
    """

    cause: str
    category: str
    evidence: list[Evidence]
    ranks: list[int]
    fix: str
    primary: bool = False
    occurrences: int = 1

    @property
    def recognised(self) -> bool:
        """True when the category is a known failure pattern (not a bare traceback or a SIGQUIT)."""
        return self.category not in UNRECOGNISED

    def ranks_text(self) -> str:
        """The ranks as ``"TP0, TP1, TP2, TP3"`` (empty string when none are known)."""
        return ", ".join(f"TP{r}" for r in self.ranks)

    def to_dict(self) -> dict:
        """A JSON-friendly dict (evidence as ``{"file", "line", "text"}`` objects)."""
        d = dataclasses.asdict(self)
        d["evidence"] = [e._asdict() for e in self.evidence]
        return d


# --------------------------------------------------------------------------------------------------
# Line shapes
# --------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Stream labels: a pdserve job log forwards engine lines as "[prefill-0] <line>", Ray prefixes actor
# output with "(Actor pid=123) ". Each labelled stream holds its own records.
_LABEL = re.compile(r"\[([A-Za-z][\w.]*-\d+)\] |\(((?:[\w.]+ )?pid=\d+(?:, ip=[\w.:]+)?)\) ")
# The first line of a log record (anything else continues the record above it, same stream).
_HEAD = re.compile(
    r"(?:"
    r"\[(?P<ts>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)(?P<tags>[^\]\n]{0,80})\]"  # SGLang
    r"|(?P<ts2>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)[ |]+(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b"
    r"|\[rank(?P<trank>\d+)\]:"  # torch c10 logging
    r"|\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ "  # glog (Mooncake, torch C++)
    r"|[\w.-]+:\d+:\d+ \[\d+\] "  # NCCL "host:pid:tid [dev] ..."
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):  "  # uvicorn
    r"|Process [\w-]+:\s*$"  # multiprocessing's header above a dead child's traceback
    r")"
)
_TP = re.compile(r"\bTP(\d+)\b")
_TB = "Traceback (most recent call last)"
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_RANK_IN_NAME = re.compile(r"(?:^|[^a-z])(?:tp|rank)[_-]?(\d+)(?![0-9])", re.I)

# Lower-case words whose presence makes a line worth a look. Anything a category matches must
# contain one of them.
_TRIGGERS = (
    "traceback (most recent",
    "out of memory", "outofmemoryerror", "alloc_failed", "memoryallocation", "not enough memory",
    "capture cuda graph failed", "no kernel image", "sm100", "sm_100", "out of resource",
    "already in use", "is not available in",
    "nccl error", "nccl warn", "ncclunhandled", "ncclsystem", "distbackenderror", "watchdog caught",
    "communicator was aborted",
    "kvtransfererror", "lost connection with prefill", "when bootstrapping", "waiting for prefill",
    "prefill server info", "prefill parallel info", "bootstrap server", "no kv from prefill", "bootstrap failed",
    "transfer failed", "handshake failed", "mooncake", "rdma", "retry counter exceeded",
    "mismatch", "sigquit", "initialization failed", "died during initialization", "crashed with exit code",
    "watchdog timeout", "no module named",
    "repo id must be", "is not a local folder", "does not appear to have a file named config.json", "--model-path",
    "cuda error", "illegal memory access", "device-side assert", "driver version is insufficient",
    "driver on your system is too old",
)

_MAX_BACK = 400  # lines walked back to find a record's header
_MAX_FWD = 400  # lines walked forward to find its end
_MAX_EVIDENCE = 10
_MAX_TEXT = 400  # evidence text is cut here


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Record:
    src: str
    src_idx: int
    lines: list[tuple[int, str]]  # (line number, text) of this record's stream
    bodies: list[str]  # the same lines without their stream label
    ts: str | None
    rank: int | None
    label: str | None


class _Source:
    """One log text, searched lazily around trigger hits."""

    def __init__(self, text: str, name: str, idx: int, default_rank: int | None):
        if "\x1b" in text:
            text = _ANSI.sub("", text)
        self.text = text
        self.name = name
        self.idx = idx
        self.default_rank = default_rank

    # -- lines ------------------------------------------------------------------------------------
    def line_at(self, start: int) -> str:
        end = self.text.find("\n", start)
        return self.text[start:] if end < 0 else self.text[start:end]

    def prev_start(self, start: int) -> int | None:
        if start <= 0:
            return None
        return self.text.rfind("\n", 0, start - 1) + 1

    def next_start(self, start: int) -> int | None:
        end = self.text.find("\n", start)
        return None if end < 0 or end + 1 > len(self.text) else end + 1

    @staticmethod
    def split_label(line: str) -> tuple[str | None, str]:
        """(stream label or None, the line without it)."""
        label = None
        while line[:1] in ("[", "("):
            m = _LABEL.match(line)
            if not m:
                break
            part = m.group(1) or m.group(2)
            label = part if label is None else f"{label} {part}"
            line = line[m.end():]
        return label, line

    # -- hits ---------------------------------------------------------------------------------------
    def hit_lines(self) -> list[tuple[int, int]]:
        """(line number, line start) of every line holding a trigger word, in order."""
        text = self.text
        scan = text if text.isascii() else text.encode("ascii", "replace").decode("ascii")
        scan = scan.lower()  # same length as text: ASCII only
        starts: set[int] = set()
        for word in _TRIGGERS:
            pos = scan.find(word)
            while pos >= 0:
                ls = scan.rfind("\n", 0, pos) + 1
                starts.add(ls)
                nl = scan.find("\n", pos)
                if nl < 0:
                    break
                pos = scan.find(word, nl + 1)
        out = []
        line_no, prev = 1, 0
        for s in sorted(starts):
            line_no += text.count("\n", prev, s)
            prev = s
            out.append((line_no, s))
        return out

    # -- records ------------------------------------------------------------------------------------
    def record_around(self, line_no: int, start: int) -> tuple[_Record, int]:
        """The log record holding the line at ``start``; also the position where it ends."""
        label, _ = self.split_label(self.line_at(start))
        # Walk back to the header of the record (same stream).
        first_no, first_s = line_no, start
        cur_no, cur_s = line_no, start
        steps = 0
        while True:
            lab, body = self.split_label(self.line_at(cur_s))
            if lab == label:
                first_no, first_s = cur_no, cur_s
                if _HEAD.match(body):
                    break
                if body.startswith(_TB) and not self._chained_before(cur_s, label):
                    break
            steps += 1
            p = self.prev_start(cur_s)
            if p is None or steps > _MAX_BACK:
                break
            cur_no, cur_s = cur_no - 1, p
        # Walk forward to the next record of the stream.
        lines: list[tuple[int, str]] = []
        bodies: list[str] = []
        cur_no, cur_s = first_no, first_s
        last_sep = False
        end_s = len(self.text)
        steps = 0
        while cur_s is not None:
            raw = self.line_at(cur_s)
            lab, body = self.split_label(raw)
            if lab == label:
                if lines and (_HEAD.match(body) or (body.startswith(_TB) and not last_sep)):
                    end_s = cur_s
                    break
                lines.append((cur_no, raw.rstrip("\r")))
                bodies.append(body.rstrip("\r"))
                if body.strip():
                    last_sep = body.startswith(_CHAIN)
            steps += 1
            if steps > _MAX_FWD + (line_no - first_no):
                end_s = cur_s
                break
            cur_s = self.next_start(cur_s)
            cur_no += 1
        ts, rank = self._head_meta(first_s, label)
        if rank is None:
            rank = self.default_rank
        return _Record(self.name, self.idx, lines, bodies, ts, rank, label), end_s

    def _chained_before(self, start: int, label: str | None) -> bool:
        """Whether the stream's previous non-blank line is a chained-exception separator."""
        p = self.prev_start(start)
        for _ in range(50):
            if p is None:
                return False
            lab, body = self.split_label(self.line_at(p))
            if lab == label and body.strip():
                return body.startswith(_CHAIN)
            p = self.prev_start(p)
        return False

    def _head_meta(self, start: int, label: str | None) -> tuple[str | None, int | None]:
        """Timestamp and TP rank of the record starting at ``start`` (timestamp inherited from the
        stream's last timestamped line when the header has none)."""
        _, body = self.split_label(self.line_at(start))
        m = _HEAD.match(body)
        rank = None
        if m:
            if m.group("tags"):
                t = _TP.search(m.group("tags"))
                rank = int(t.group(1)) if t else None
            elif m.group("trank"):
                rank = int(m.group("trank"))
            ts = m.group("ts") or m.group("ts2")
            if ts:
                return ts.replace(",", ".").replace("T", " "), rank
        p = self.prev_start(start)
        for _ in range(200):
            if p is None:
                break
            lab, body = self.split_label(self.line_at(p))
            if lab == label:
                m = _HEAD.match(body)
                if m and (m.group("ts") or m.group("ts2")):
                    return (m.group("ts") or m.group("ts2")).replace(",", ".").replace("T", " "), rank
            p = self.prev_start(p)
        return None, rank

    def records(self) -> list[_Record]:
        """Every record that holds a trigger word, in file order."""
        out: list[_Record] = []
        covered: dict[str | None, int] = {}  # stream label -> end of the last record built
        for line_no, start in self.hit_lines():
            label, _ = self.split_label(self.line_at(start))
            if start < covered.get(label, -1):
                continue
            rec, end = self.record_around(line_no, start)
            covered[label] = end
            out.append(rec)
        return out


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Finding:
    category: str
    title: str
    fix: str
    tier: int = _ROOT
    key: str = ""
    evidence: list[int] = dataclasses.field(default_factory=list)  # indexes into the record's lines
    ranks: list[int] = dataclasses.field(default_factory=list)  # ranks named in the text itself


def _model_path(line: str) -> str:
    """The path a model-path error names: after ``--model-path``, the last quoted string of a
    Hub repo-id error, else the word before the message."""
    m = _RX_MODEL_PATH.search(line)
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


def _short_name(name: str) -> str:
    """A kernel name cut for a title: ``bmm_MxE2m1_MxE2m...TN_schedS_sm100f``."""
    return name if len(name) <= 48 else f"{name[:16]}...{name[-24:]}"


def _message(line: str) -> str:
    """A log line without its record header (timestamp, rank, glog/NCCL prefix)."""
    _, body = _Source.split_label(line)
    m = _HEAD.match(body)
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


_RX_PAGE = re.compile(r"Page size mismatch")
_RX_PAGE_VALUES = re.compile(r"prefill\D{0,30}page_size=(\d+).{0,80}?decode\D{0,30}page_size=(\d+)")
_RX_PD_MISMATCH = re.compile(
    r"KV cache dtype mismatch|allocation policy mismatch|PD KV layout mismatch|"
    r"requires matching attention TP sizes"
)
_RX_PORT = re.compile(
    r"address already in use|EADDRINUSE|\[Errno 98\]|is not available in \d+ seconds|Port is already in use",
    re.I,
)
_RX_PORT_VALUE = (
    (re.compile(r"(\w+_port) at (\d+) is not available"), "name"),
    (re.compile(r"bind on address \([^,)]*, (\d+)\)"), "http"),
    (re.compile(r"port: (\d+), useIpv6"), "store"),
    (re.compile(r"addr='tcp://[^']*:(\d+)'"), "zmq"),
    (re.compile(r"\bport\b[ =:]+(\d{2,5})\b", re.I), None),
    (re.compile(r"\w:(\d{4,5})\b"), None),
)
_RX_NOIMAGE = re.compile(r"no kernel image is available", re.I)
_RX_SM100 = re.compile(r"\b(?!is_|has_|supports?_)(\w*?[Ss][Mm]_?100(?!\d)[af]?\w*)")
_RX_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation|"
    r"CUBLAS_STATUS_ALLOC_FAILED|failure 'out of memory'",
    re.I,
)
_RX_OOM_SIZE = re.compile(r"Tried to allocate ([\d.]+ [KMGT]i?B)")
_RX_KV_MEM = re.compile(r"Not enough memory\b.{0,60}--mem-fraction-static")
_RX_SMEM = re.compile(r"out of resource: shared memory|OutOfResources")
_RX_SMEM_VALUES = re.compile(r"Required: (\d+), Hardware limit: (\d+)")
_RX_CAPTURE = re.compile(r"Capture cuda graph failed", re.I)
_RX_NCCL = re.compile(
    r"NCCL error|NCCL WARN|nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidUsage|InvalidArgument|"
    r"RemoteError)|DistBackendError"
)
_RX_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|NCCL communicator was aborted")
_RX_KV = re.compile(
    r"KVTransferError|KVPoll\.(?:Bootstrapping|WaitingForInput)|Lost connection with prefill instance|"
    r"timed out when bootstrapping|Timed out waiting for prefill|prefill server info from bootstrap|"
    r"Could not fetch prefill parallel info|failed to register to bootstrap server|"
    r"Failed to get prefill server info|is healthy before, but now it is down|"
    r"retry counter exceeded|Mooncake\b.{0,100}(?:fail|error)|TransferEngine\.initialize\(.{0,200}returned -?\d+|"
    r"(?:Decode|Prefill) (?:transfer|handshake|bootstrap) failed|prefill bootstrap server \S+ unreachable|"
    r"no KV from prefill|RDMA\b.{0,80}(?:fail|error|no such|not found)|(?:fail|error)\w*\b.{0,80}\bRDMA",
    re.I,
)
_RX_KV_BENIGN = re.compile(r"Aborted by AbortReq|Duplicate or cancelled bootstrap room|Duplicate decode bootstrap room")
_RX_KV_ADDR = (
    re.compile(r"bootstrap_addr:? ([\w.\-\[\]:]+:\d+)"),
    re.compile(r"host='([^']+)', port=(\d+)"),
    re.compile(r"http://([\w.\-\[\]:]+:\d+)/route"),
    re.compile(r"(?:bootstrap server|from prefill) ([\w.\-\[\]]+:\d+)"),
)
_RX_CUDA_ERR = re.compile(
    r"CUDA error: (?!out of memory)[^\n]+|illegal memory access|device-side assert|"
    r"CUDA driver version is insufficient|NVIDIA driver on your system is too old"
)
_RX_WATCHDOG = re.compile(r"watchdog timeout")
_RX_CHILD_EXIT = re.compile(
    r"Rank (\d+) scheduler died during initialization \(exit code: (-?\d+)\)|"
    r"Subprocess (\S+) \(pid=\d+\) crashed with exit code (-?\d+)"
)
# Literal first (a leading path group would make the search quadratic on long garbage lines); the
# path is then read around the match by _model_path().
_RX_MODEL_PATH = re.compile(r"--model-path \S+: no (?:such directory|config\.json)|Repo id must be in the form"
                            r"| is not a local folder and is not a valid model identifier"
                            r"| does not appear to have a file named config\.json")
_RX_MODULE = re.compile(r"No module named '([^']+)'|(the Mooncake transfer engine is not installed)")
_RX_SIGQUIT = re.compile(
    r"Received sigquit from a child process|SIGQUIT received|Initialization failed\. Please see the error"
)
_RX_ERRORISH = re.compile(r"error|fail|exception|unsupported|not supported|traceback", re.I)
_RX_NORM = re.compile(r"0x[0-9a-fA-F]+|\d+")
_CONSEQUENTIAL = re.compile(
    r"^(?:\w+\.)*(?:KeyboardInterrupt|SystemExit|BrokenPipeError|EOFError|ConnectionResetError|"
    r"CancelledError)\b"
)
_RX_ARCH_120 = ("sm_120", "sm120", "rtx pro 6000", "capability 12.", "capability: 12.", "capability=(12,",
                "capability (12,")


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


_RX_EXC_LINE = re.compile(r"[A-Za-z_][\w.]*(?::\s|:?\s*$)")


def _exception_lines(lines: list[str]) -> list[int]:
    """Indexes of the exception lines that end each traceback in the record."""
    out = []
    in_tb = False
    for i, t in enumerate(lines):
        if _TB in t:
            in_tb = True
            continue
        if in_tb:
            if not t.strip() or t[:1] in " \t":
                continue
            if _RX_EXC_LINE.match(t):
                out.append(i)
            in_tb = False
    return out


_FIX_OOM = {
    "capture": (
        "CUDA graphs are captured after the KV cache took its share (--mem-fraction-static), so the "
        "graphs ran out of room: lower --mem-fraction-static (e.g. 0.85 -> 0.80) or capture smaller "
        "graphs with --cuda-graph-max-bs-decode / --cuda-graph-max-bs-prefill (e.g. 32); with "
        "EAGLE/MTP the draft model's graphs need room too."
    ),
    "load": (
        "The weights do not fit on these GPUs: spread the model over more ranks (--tp-size), use a "
        "quantized checkpoint, and check with nvidia-smi that no other process holds GPU memory."
    ),
    "": (
        "Leave more memory outside the KV cache: lower --mem-fraction-static, or lower the peak "
        "activation size (--chunked-prefill-size, --max-running-requests, --cuda-graph-max-bs-decode); "
        "check with nvidia-smi that no other process shares the GPU."
    ),
}
# Backends by expert format follow pd.tools.doctor (FP4_EXPERT_METHODS, FP4_TO_TRITON_BACKENDS) and SGLang's own
# sm_120 pick for modelopt_fp4 (sglang/srt/arg_groups/overrides.py).
_FIX_ARCH = (
    "The backend picked a kernel compiled for another GPU (sm_100 = B200/GB200 kernels such as "
    "trtllm-gen / flashinfer_trtllm do not run on sm_120 RTX PRO 6000 Blackwell). Pick a MoE backend with "
    "sm_120 kernels for the experts' format, for the target (--moe-runner-backend) and the EAGLE/MTP draft "
    "(--speculative-moe-runner-backend): MXFP4 experts (DeepSeek-V4, its MTP layer included) flashinfer_mxfp4 "
    "(triton reads them as FP8 and fails with \"Hidden size mismatch\"), NVFP4 (modelopt_fp4) "
    "flashinfer_cutlass, FP8/BF16 experts triton. Set --quantization explicitly (the checkpoint's "
    "config.json quantization_config.quant_method, fp8 for DeepSeek-V4-Flash) so auto-detection cannot "
    "skip the backend guard; pdserve's SGLang plugin (config sglang.pdserve_kernels) runs the draft's MXFP4 "
    "MoE on its own kernel on sm_120. `pdserve doctor CONFIG --assume-gpu sm_120` names the backend for a "
    "config before launch."
)
_FIX_KV_MEM = (
    "The weights and the activation reserve left no room for the KV cache: raise --mem-fraction-static "
    "(e.g. 0.88), spread the model over more GPUs (--tp-size) or use an FP8 KV cache "
    "(--kv-cache-dtype fp8_e4m3); check with nvidia-smi that no other process holds GPU memory."
)
_FIX_SMEM = (
    "The kernel's tile configuration was tuned for a GPU with more shared memory per block (sm_90 / "
    "sm_100: 227 KiB; sm_120: 99 KiB = 101376 bytes). Use a backend or config tuned for this GPU "
    "(pd.kernels are sized for sm_120) or fewer pipeline stages / smaller blocks."
)
_FIX_CAPTURE = (
    "The wrapped error is the real cause. To confirm the model runs without graphs, start once with "
    "--cuda-graph-backend-decode disabled (slow; diagnosis only), then fix the wrapped error."
)
_FIX_PORT = (
    "Another process listens on port {port} (often an engine left over from an earlier run): "
    "`ss -ltnp 'sport = :{port}'` shows which; stop it or pick another port ({flag}). SGLang derives "
    "several internal ports from --port, so leave a gap between engines on one host."
)
_PORT_FLAG = {
    "http": "--port",
    "store": "--nccl-port / --dist-init-addr",
    "zmq": "--port; the internal ZMQ ports follow it",
    "nccl_port": "--nccl-port",
    "dist_init_port": "--dist-init-addr",
}
_FIX_PAGE = (
    "Prefill and decode must use the same KV page layout: start both roles with the same --page-size "
    "(set it once in the cluster config so both engines get it)."
)
_FIX_PD_MISMATCH = (
    "Prefill and decode must agree on the KV cache format: use the same --kv-cache-dtype, --page-size, "
    "--disaggregation-decode-allocation-policy and model spec on both roles."
)
_FIX_KV_BOOTSTRAP = (
    "The prefill never got this decode's KV destination. Check that the decode reaches the prefill's "
    "bootstrap server ({addr}: the request's bootstrap_host/bootstrap_port, --disaggregation-bootstrap-port) "
    "and that the two transfer engines reach each other: the RDMA device (--disaggregation-ib-device; "
    "`ibv_devices`) or, to rule RDMA out, MC_FORCE_TCP=1 on both engines. Raise "
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT only if the peer is merely slow."
)
_FIX_KV_WAIT = (
    "The decode registered its KV destination but the KV never arrived: check that the prefill is "
    "alive (its own log) and that its transfer engine can write to this decode: RDMA device "
    "(--disaggregation-ib-device; `ibv_devices`), or MC_FORCE_TCP=1 on both engines to test over TCP. "
    "Raise SGLANG_DISAGGREGATION_WAITING_TIMEOUT only if the prefill is merely overloaded."
)
_FIX_KV_UNREACHABLE = (
    "The decode cannot reach the prefill's bootstrap server {addr}: check the prefill is up and that "
    "--disaggregation-bootstrap-port is reachable from the decode host (`curl http://{addr}/route`); "
    "across nodes bootstrap_host must be an address the decode can reach, not 127.0.0.1."
)
_FIX_KV_LOST = (
    "The prefill {addr} went away (crashed or restarted): its own log holds the root cause "
    "(`pdserve diagnose PREFILL_LOG`); then check the decode can reach it again."
)
_FIX_MOONCAKE = (
    "The Mooncake transfer engine failed: check the RDMA device name and state "
    "(--disaggregation-ib-device, `ibv_devices`, `ibv_devinfo`), that both hosts reach each other, "
    "and rule RDMA out with MC_FORCE_TCP=1 (or protocol tcp) on both engines."
)
_FIX_KV_OTHER = (
    "Check the bootstrap host/port between the two roles ({addr}), the RDMA device "
    "(--disaggregation-ib-device) or MC_FORCE_TCP=1 to test over TCP, and the peer engine's own log."
)
_FIX_WATCHDOG = (
    "A forward step made no progress for --watchdog-timeout seconds: usually a collective waiting on a "
    "dead or stuck rank (look for the first error on the other ranks) or a kernel that hangs; raise "
    "--watchdog-timeout only for legitimately slow first steps (JIT compilation)."
)
_FIX_MODEL_PATH = ("Point --model-path (config `model_path`) at the checkpoint directory as it is seen on every "
                   "node that runs an engine (config.json, tokenizer and weights inside); nothing is downloaded "
                   "from the Hugging Face Hub.")
_FIX_MODULE = "Install it in the engine's Python environment (the worker's venv), e.g. `pip install {mod}`."
_FIX_EXCEPTION = "No known pattern: read the traceback at the evidence lines; the first rank's error is the cause."
_FIX_SIGQUIT = (
    "A child process (a TP rank's scheduler) failed and told the parent to stop; its own error is not "
    "in this log. Diagnose the full engine log or the per-rank logs (earlier lines)."
)


def _nccl_fix(detail: str) -> str:
    d = detail.lower()
    hints = []
    if "peer access" in d or "p2p" in d:
        hints.append("these GPUs cannot use peer-to-peer access: set NCCL_P2P_DISABLE=1 "
                     "(and --disable-custom-all-reduce)")
    if "shm" in d or "shared memory" in d or "/dev/shm" in d:
        hints.append("/dev/shm is too small: give the container more (--shm-size=16g or --ipc=host) or "
                     "set NCCL_SHM_DISABLE=1")
    if "socket" in d or "connect" in d or "bootstrap" in d or "address" in d:
        hints.append("ranks cannot reach each other over the network: set NCCL_SOCKET_IFNAME to the "
                     "right interface and check --dist-init-addr is reachable")
    if "ibv" in d or "net/ib" in d or " ib " in d or "infiniband" in d:
        hints.append("InfiniBand setup: NCCL_IB_HCA to pick the device, or NCCL_IB_DISABLE=1")
    if "unhandled cuda error" in d and not hints:
        hints.append("a CUDA call inside NCCL failed: check the driver/CUDA versions and try "
                     "NCCL_P2P_DISABLE=1 (and --disable-custom-all-reduce)")
    hints.append("rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,P2P,NET) to see which transport fails")
    return "; ".join(h[0].upper() + h[1:] if i == 0 else h for i, h in enumerate(hints)) + "."


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
    for rx in _RX_KV_ADDR:
        m = rx.search(text)
        if m:
            return ":".join(m.groups())
    return ""


def _port(text: str) -> tuple[str, str]:
    """(port, kind) named by a port-in-use record."""
    for rx, kind in _RX_PORT_VALUE:
        m = rx.search(text)
        if m:
            if kind == "name":
                return m.group(2), m.group(1)
            return m.group(1), kind or ""
    return "", ""


def _classify(lines: list[str]) -> _Finding | None:
    """The finding one record supports, or None."""
    if "server_args=" in lines[0]:  # the startup dump of every flag: names, not failures
        return None
    joined = "\n".join(lines)
    low = joined.lower()
    exc = _exception_lines(lines)
    kind, phrases = _context(low)

    # Prefill/decode configuration mismatches (the most specific texts first).
    ev = _idx(lines, _RX_PAGE)
    if ev:
        m = _RX_PAGE_VALUES.search(joined)
        title = "Page size mismatch between prefill and decode"
        if m:
            title += f" (prefill page_size={m.group(1)}, decode page_size={m.group(2)})"
        return _Finding("page_size_mismatch", title, _FIX_PAGE, evidence=ev[:2])
    ev = _idx(lines, _RX_PD_MISMATCH)
    if ev:
        first = lines[ev[-1]]
        m = _RX_PD_MISMATCH.search(first)
        sentence = first[m.start():].split(". ")[0] if m else first
        return _Finding("pd_config_mismatch", "Prefill/decode mismatch: " + _cut(sentence, 140),
                        _FIX_PD_MISMATCH, key=_RX_NORM.sub("#", sentence[:60]), evidence=ev[-1:])

    ev = _idx(lines, _RX_PORT)
    if ev:
        port, pkind = _port(joined)
        title = f"Port {port} is already in use" if port else "A port the engine binds is already in use"
        if pkind and pkind not in ("http", "store", "zmq"):
            title += f" ({pkind})"
        elif pkind == "http":
            title += " (HTTP server --port)"
        elif pkind == "store":
            title += " (torch.distributed store)"
        flag = _PORT_FLAG.get(pkind, "--port, --nccl-port, --disaggregation-bootstrap-port")
        return _Finding("port_in_use", title, _FIX_PORT.format(port=port or "N", flag=flag), key=port,
                        evidence=ev[:2])

    ev = _idx(lines, _RX_NOIMAGE)
    if ev:
        return _arch_finding(lines, ev, phrases)

    ev = _idx(lines, _RX_OOM)
    if ev:
        size = _RX_OOM_SIZE.search(joined)
        title = _with_context("CUDA out of memory", phrases)
        if size:
            title += f" (tried to allocate {size.group(1)})"
        cap = _idx(lines, _RX_CAPTURE)
        return _Finding("cuda_oom", title, _FIX_OOM[kind], key=kind, evidence=_uniq(ev[:1], cap[:1]))

    ev = _idx(lines, _RX_KV_MEM)
    if ev:
        return _Finding("kv_cache_memory", "Not enough GPU memory left for the KV cache", _FIX_KV_MEM, evidence=ev[:1])

    ev = _idx(lines, _RX_SMEM)
    if ev:
        m = _RX_SMEM_VALUES.search(joined)
        title = "Triton kernel needs more shared memory than the GPU has per block"
        if m:
            title += f" (needs {m.group(1)} bytes, limit {m.group(2)})"
        return _Finding("shared_memory", _with_context(title, phrases), _FIX_SMEM, evidence=ev[:1])

    if exc or _RX_ERRORISH.search(lines[0] if lines else ""):
        ev = [i for i in _idx(lines, _RX_SM100) if _sm100_tokens(lines[i])]
        if ev:
            return _arch_finding(lines, ev, phrases)

    ev = _idx(lines, _RX_NCCL)
    if ev:
        detail = _nccl_detail(lines)
        title = _with_context("NCCL failure" + (f": {_cut(detail, 120)}" if detail else ""), phrases)
        return _Finding("nccl", title, _nccl_fix(detail + " " + low), key="error",
                        evidence=_uniq(ev[:2], exc[:1]))
    ev = _idx(lines, _RX_NCCL_TIMEOUT)
    if ev:
        return _Finding("nccl", "NCCL collective timed out or was aborted (a peer rank died or hung)",
                        "A collective waited on a rank that failed or hangs: the first error on another rank "
                        "is the cause; " + _nccl_fix(low), tier=_SECONDARY, key="timeout", evidence=ev[:1])

    ev = _idx(lines, _RX_KV)
    if ev:
        return _kv_finding(lines, joined, ev)

    ev = _idx(lines, _RX_CUDA_ERR)
    if ev:
        m = _RX_CUDA_ERR.search(lines[ev[0]])
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
        return _Finding("cuda_error", _with_context(what, phrases), fix, key=_RX_NORM.sub("#", what),
                        evidence=ev[:1])

    ev = _idx(lines, _RX_WATCHDOG)
    if ev:
        return _Finding("watchdog_timeout", "Scheduler watchdog timeout: a forward step hung", _FIX_WATCHDOG,
                        tier=_SECONDARY, evidence=ev[:1])

    ev = _idx(lines, _RX_CHILD_EXIT)
    if ev:
        m = _RX_CHILD_EXIT.search(lines[ev[0]])
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
        tier = _SECONDARY if code not in ("1", "0") else _SYMPTOM
        return _Finding("child_exit", f"{who} exited with code {code} without a traceback", fix, tier=tier,
                        key=who + code, evidence=ev[:1], ranks=ranks)

    ev = _idx(lines, _RX_MODEL_PATH)
    if ev:
        path = _model_path(lines[ev[0]])
        return _Finding("model_path", f"Model path {path!r} is not a checkpoint directory", _FIX_MODEL_PATH,
                        key=path, evidence=ev[:1])

    ev = _idx(lines, _RX_MODULE)
    if ev:
        m = _RX_MODULE.search(lines[ev[0]])
        mod = m.group(1) or "mooncake-transfer-engine"
        return _Finding("missing_dependency", f"Missing Python module '{mod}'",
                        _FIX_MODULE.format(mod=mod.split(".")[0].replace("_", "-")), key=mod, evidence=ev[:1])

    ev = _idx(lines, _RX_SIGQUIT)
    if ev:
        return _Finding("sigquit", "The parent process reports a failed child (SIGQUIT)", _FIX_SIGQUIT,
                        tier=_SYMPTOM, evidence=ev[:1])

    ev = _idx(lines, _RX_CAPTURE)
    if ev:
        t = lines[ev[0]]
        wrapped = t[_RX_CAPTURE.search(t).end():].lstrip(": ").strip() or (lines[exc[0]] if exc else "")
        title = _with_context("CUDA graph capture failed", [p for p in phrases if "capture" not in p])
        if wrapped:
            title += f": {_cut(wrapped, 120)}"
        return _Finding("cuda_graph_capture", title, _FIX_CAPTURE, key=_RX_NORM.sub("#", wrapped[:80]),
                        evidence=_uniq(ev[:1], exc[:1]))

    if exc:
        root = lines[exc[0]].strip()
        tier = _SECONDARY if (_CONSEQUENTIAL.match(root) or "exception ignored in" in low) else _ROOT
        return _Finding("exception", _cut(root, 200), _FIX_EXCEPTION, tier=tier,
                        key=_RX_NORM.sub("#", root[:200]), evidence=[exc[0]])
    return None


_RX_SM100_QUICK = re.compile(r"[Ss][Mm]_?100")


def _sm100_tokens(line: str) -> list[str]:
    if not _RX_SM100_QUICK.search(line):
        return []
    return [m.group(1) for m in _RX_SM100.finditer(line)]


def _arch_finding(lines: list[str], ev: list[int], phrases: list[str]) -> _Finding:
    names = [n for i in range(len(lines)) for n in _sm100_tokens(lines[i])]
    title = "Kernel built for another GPU architecture"
    if any(_RX_NOIMAGE.search(lines[i]) for i in ev):
        title += ": no kernel image is available for this device"
    if names:
        longest = max(names, key=len)
        title += f" (sm_100 kernel {_short_name(longest)})"
        sm_lines = [i for i in range(len(lines)) if _sm100_tokens(lines[i])]
        ev = _uniq(ev[:1], sm_lines[:1])
    return _Finding("kernel_arch", _with_context(title, phrases), _FIX_ARCH, key="", evidence=ev[:2])


def _kv_finding(lines: list[str], joined: str, ev: list[int]) -> _Finding | None:
    main = [i for i in ev if not _RX_KV_BENIGN.search(lines[i])]
    if not main:
        return _Finding("kv_transfer", "", "", tier=-1)  # a client abort: not a failure
    text = "\n".join(lines[i] for i in main)
    addr = _kv_addr(joined) or "the prefill's bootstrap host:port"
    low = text.lower()
    ev = main[:2]
    if "kvpoll.bootstrapping" in low or "when bootstrapping" in low:
        return _Finding("kv_transfer", "PD bootstrap timed out (KVPoll.Bootstrapping): the KV destination "
                        "never reached the prefill", _FIX_KV_BOOTSTRAP.format(addr=addr), key="bootstrap", evidence=ev)
    if "kvpoll.waitingforinput" in low or "waiting for prefill" in low or "no kv from prefill" in low:
        return _Finding("kv_transfer", "Decode timed out waiting for the KV cache from the prefill",
                        _FIX_KV_WAIT, key="waiting", evidence=ev)
    if "lost connection with prefill" in low or "now it is down" in low:
        return _Finding("kv_transfer", f"Lost connection with the prefill ({addr})",
                        _FIX_KV_LOST.format(addr=addr), tier=_SECONDARY, key="lost", evidence=ev)
    if ("prefill server info" in low or "parallel info" in low or "unreachable" in low
            or "register to bootstrap" in low):
        return _Finding("kv_transfer", f"Cannot reach the prefill's bootstrap server ({addr})",
                        _FIX_KV_UNREACHABLE.format(addr=addr), key="unreachable", evidence=ev)
    if "mooncake" in low or "retry counter" in low or "transferengine" in low or "rdma" in low:
        return _Finding("kv_transfer", "Mooncake transfer engine failure: " + _cut(_message(lines[ev[0]]), 110),
                        _FIX_MOONCAKE, key="mooncake", evidence=ev)
    if "unknown reason from another rank" in low:
        return _Finding("kv_transfer", "KV transfer failed on another rank", _FIX_KV_OTHER.format(addr=addr),
                        tier=_SECONDARY, key="other-rank", evidence=ev)
    m = re.search(r"KVTransferError\([^)]*\): (.+)|with exception (.+)|failed[^:]*: (.+)", text)
    reason = next((g for g in (m.groups() if m else ()) if g), "")
    title = "KV transfer failed" + (f": {_cut(reason, 120)}" if reason else "")
    return _Finding("kv_transfer", title, _FIX_KV_OTHER.format(addr=addr), key=_RX_NORM.sub("#", reason[:60]),
                    evidence=ev)


# --------------------------------------------------------------------------------------------------
# Merging findings into diagnoses
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Group:
    finding: _Finding
    order: tuple
    diag: Diagnosis
    ranks_seen: set


def _evidence(rec: _Record, idx: int) -> Evidence:
    no, text = rec.lines[idx]
    return Evidence(rec.src, no, text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "...")


def _diagnose_sources(sources: list[_Source]) -> list[Diagnosis]:
    groups: dict[tuple, _Group] = {}
    sm100_lines: list[tuple[_Source, _Record, int]] = []
    cache: dict[str, _Finding | None] = {}
    arch_120 = False
    all_ts = True
    for src in sources:
        low_head = src.text[:2_000_000].lower()
        arch_120 = arch_120 or any(w in low_head for w in _RX_ARCH_120)
        for rec in src.records():
            texts = rec.bodies
            if not texts:
                continue
            if len(texts) == 1:  # repeated one-line records: classify once
                m = _HEAD.match(texts[0])
                norm = _RX_NORM.sub("#", texts[0][m.end():] if m else texts[0])
                if norm in cache:
                    finding = cache[norm]
                else:
                    finding = cache[norm] = _classify(texts)
            else:
                finding = _classify(texts)
            for i, t in enumerate(texts):
                if _sm100_tokens(t):
                    sm100_lines.append((src, rec, i))
            if finding is None or finding.tier < 0:
                continue
            key = (finding.category, finding.key)
            ranks = set(finding.ranks)
            if rec.rank is not None:
                ranks.add(rec.rank)
            g = groups.get(key)
            if g is None:
                ev = [_evidence(rec, i) for i in sorted(finding.evidence)]
                if (finding.evidence and 0 not in finding.evidence and rec.ts and rec.rank is not None
                        and _HEAD.match(rec.bodies[0])):
                    ev.insert(0, _evidence(rec, 0))  # the header line shows the rank and the time
                diag = Diagnosis(cause=finding.title, category=finding.category, evidence=ev, ranks=[],
                                 fix=finding.fix, occurrences=0)
                first_line = rec.lines[finding.evidence[0] if finding.evidence else 0][0]
                g = _Group(finding, (rec.ts, src.idx, first_line), diag, set())
                groups[key] = g
                g.ranks_seen |= ranks
            else:
                new = ranks - g.ranks_seen
                if new and len(g.diag.evidence) < _MAX_EVIDENCE and finding.evidence:
                    g.diag.evidence.append(_evidence(rec, finding.evidence[0]))
                g.ranks_seen |= ranks
            g.diag.occurrences += 1
    for g in groups.values():
        g.diag.ranks = sorted(g.ranks_seen)
        if g.order[0] is None:
            all_ts = False

    # kernel_arch found through "no kernel image": name the sm_100 kernel seen just before on that rank.
    arch = groups.get(("kernel_arch", ""))
    if arch is not None:
        if arch_120 and "sm_120" not in arch.diag.cause:
            arch.diag.cause += " on this sm_120 GPU"
        noimage = [e for e in arch.diag.evidence if _RX_NOIMAGE.search(e.text)]
        if "sm_100 kernel" not in arch.diag.cause and sm100_lines and noimage:
            first = noimage[0]
            before = [(s, r, i) for s, r, i in sm100_lines
                      if s.name == first.file and first.line - 300 <= r.lines[i][0] <= first.line]
            if before:
                s, r, i = before[-1]
                name = max(_sm100_tokens(r.lines[i][1]), key=len)
                arch.diag.cause = arch.diag.cause.replace(
                    "for this device", f"for this device (sm_100 kernel {_short_name(name)})", 1)
                arch.diag.evidence.append(_evidence(r, i))
                arch.diag.evidence.sort(key=lambda e: (e.file != first.file, e.line))

    def order(g: _Group) -> tuple:
        ts, idx, line = g.order
        return (g.finding.tier, ts if all_ts else "", idx, line)

    ranked = sorted(groups.values(), key=order)
    symptoms = [g for g in ranked if g.finding.tier == _SYMPTOM]
    causes = [g for g in ranked if g.finding.tier != _SYMPTOM]
    if causes:
        primary = causes[0].diag
        primary.primary = True
        # The parent's SIGQUIT message (and exit-code-1 notices) point at the child's error: evidence.
        for g in symptoms:
            if len(primary.evidence) < _MAX_EVIDENCE + 2:
                primary.evidence.append(g.diag.evidence[-1])
        return [g.diag for g in causes]
    return [g.diag for g in symptoms]


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------


def _default_rank(name: str) -> int | None:
    m = _RANK_IN_NAME.search(os.path.basename(name))
    return int(m.group(1)) if m else None


def diagnose_text(text: str, source: str = "<log>") -> list[Diagnosis]:
    """Diagnose one log's text (a whole engine log or just its tail).

    Args:
        text: the log; any content (binary garbage, partial lines) is accepted.
        source: the name evidence lines refer to. A name like ``tp2.log`` or ``rank2`` gives lines
            without a rank prefix that rank.

    Returns:
        Distinct causes, root causes first in the order they happened; the first one has
        ``primary=True`` unless only a symptom (a SIGQUIT with no child error) was found.
        Empty when nothing known was found.
    """
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8", "replace")
    return _diagnose_sources([_Source(text, source, 0, _default_rank(source))])


def diagnose_logs(paths: Iterable[str | os.PathLike]) -> list[Diagnosis]:
    """Diagnose one or more log files together (a combined server log, per-rank files, or the logs of
    several engines, e.g. a prefill's and a decode's): one cause seen in several files is reported once.

    Args:
        paths: log files; a file name like ``tp2.log`` gives lines without a rank prefix that rank.

    Returns:
        As :func:`diagnose_text`; evidence names each file as given.

    Raises:
        OSError: a file cannot be read (the exception's ``filename`` names it).
    """
    sources = []
    for i, p in enumerate(paths):
        name = os.fspath(p)
        with open(name, "rb") as f:
            data = f.read()
        sources.append(_Source(data.decode("utf-8", "replace"), name, i, _default_rank(name)))
    return _diagnose_sources(sources)


def render(diagnoses: list[Diagnosis]) -> str:
    """Human-readable text for :func:`diagnose_logs` / :func:`diagnose_text` results."""
    if not diagnoses:
        return "No known failure pattern found."
    out = []
    for n, d in enumerate(diagnoses, 1):
        if d.primary:
            tag = "ROOT CAUSE" if d.recognised else "ROOT CAUSE (no known pattern; first error shown)"
        elif d.category == "sigquit":
            tag = "SYMPTOM ONLY"
        else:
            tag = "also found"
        out.append(f"[{n}] {tag}: {d.cause}  [{d.category}]")
        if d.ranks:
            out.append(f"    ranks:    {d.ranks_text()}")
        if d.occurrences > 1:
            out.append(f"    seen:     {d.occurrences} times")
        for k, e in enumerate(d.evidence):
            out.append(f"    {'evidence:' if k == 0 else '         '} {e.file}:{e.line}: {e.text}")
        out.append(textwrap.fill(d.fix, width=110, initial_indent="    fix:      ",
                                 subsequent_indent="              ", break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


def _last_error_lines(paths: list[str], n: int = 12) -> list[str]:
    """The last traceback / error-looking lines of the logs (shown when nothing known was found)."""
    out = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - 1_000_000))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        tail = _ANSI.sub("", tail)
        lines = tail.splitlines()[-5000:]
        for i, t in enumerate(lines):
            if _RX_ERRORISH.search(t) or (t.startswith("  File ") and i + 1 < len(lines)):
                out.append(f"{p}: {t[:_MAX_TEXT]}")
    return out[-n:]


USAGE = """usage: pdserve diagnose [--json] LOG [LOG...]

Finds the root cause of a failed engine start or crash in SGLang (or reference engine) logs: one
combined server log, per-rank logs, or the logs of several engines. A directory means its *.log files.
Exit status: 0 a known cause was found, 1 nothing known (the last error lines are shown), 2 a file
cannot be read (or a directory holds no *.log file, or an unknown option).
"""


def main(argv: list[str] | None = None) -> int:
    """``pdserve diagnose``: print the diagnosis of the given logs; returns the exit status."""
    import json
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0 if argv else 2
    as_json = "--json" in argv
    paths = []
    for a in argv:
        if a == "--json":
            continue
        if a.startswith("-") and not os.path.exists(a):
            print(f"pdserve diagnose: unknown option {a} (options: --json, --help)", file=sys.stderr)
            return 2
        if os.path.isdir(a):
            logs = sorted(os.path.join(a, f) for f in os.listdir(a) if f.endswith(".log"))
            if not logs:
                print(f"pdserve diagnose: {a} has no *.log files", file=sys.stderr)
                return 2
            paths.extend(logs)
        else:
            paths.append(a)
    if not paths:
        print("pdserve diagnose: no log files given", file=sys.stderr)
        return 2
    try:
        found = diagnose_logs(paths)
    except OSError as e:
        print(f"pdserve diagnose: cannot read {e.filename or '?'}: {e.strerror or e}", file=sys.stderr)
        return 2
    known = any(d.primary and d.recognised for d in found)
    if as_json:
        print(json.dumps([d.to_dict() for d in found], indent=2))
        return 0 if known else 1
    print(render(found))
    if not known:
        tail = _last_error_lines(paths)
        if tail and not found:
            print("Last error lines seen:")
            print("\n".join("  " + t for t in tail))
        elif not found:
            print("No error or traceback lines seen.")
    return 0 if known else 1


if __name__ == "__main__":
    raise SystemExit(main())
