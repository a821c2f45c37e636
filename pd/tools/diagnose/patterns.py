"""The log texts each failure category is recognised by, and the trigger words that find them.

Only lines holding a trigger word are looked at (:data:`TRIGGERS`), so every pattern here must match a
line that contains one of them.
"""

from __future__ import annotations

import re

# Lower-case words whose presence makes a line worth a look. Anything a category matches must
# contain one of them.
TRIGGERS = (
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
    "watchdog timeout", "no module named", "cannot import name",
    "repo id must be", "is not a local folder", "does not appear to have a file named config.json", "--model-path",
    "cuda error", "illegal memory access", "device-side assert", "driver version is insufficient",
    "driver on your system is too old",
)

RX_PAGE = re.compile(r"Page size mismatch")
RX_PAGE_VALUES = re.compile(r"prefill\D{0,30}page_size=(\d+).{0,80}?decode\D{0,30}page_size=(\d+)")
RX_PD_MISMATCH = re.compile(
    r"KV cache dtype mismatch|allocation policy mismatch|PD KV layout mismatch|"
    r"requires matching attention TP sizes"
)
RX_PORT = re.compile(
    r"address already in use|EADDRINUSE|\[Errno 98\]|is not available in \d+ seconds|Port is already in use",
    re.I,
)
RX_PORT_VALUE = (
    (re.compile(r"(\w+_port) at (\d+) is not available"), "name"),
    (re.compile(r"bind on address \([^,)]*, (\d+)\)"), "http"),
    (re.compile(r"port: (\d+), useIpv6"), "store"),
    (re.compile(r"addr='tcp://[^']*:(\d+)'"), "zmq"),
    (re.compile(r"\bport\b[ =:]+(\d{2,5})\b", re.I), None),
    (re.compile(r"\w:(\d{4,5})\b"), None),
)
RX_NOIMAGE = re.compile(r"no kernel image is available", re.I)
RX_SM100 = re.compile(r"\b(?!is_|has_|supports?_)(\w*?[Ss][Mm]_?100(?!\d)[af]?\w*)")
RX_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation|"
    r"CUBLAS_STATUS_ALLOC_FAILED|failure 'out of memory'",
    re.I,
)
RX_OOM_SIZE = re.compile(r"Tried to allocate ([\d.]+ [KMGT]i?B)")
RX_KV_MEM = re.compile(r"Not enough memory\b.{0,60}--mem-fraction-static")
RX_SMEM = re.compile(r"out of resource: shared memory|OutOfResources")
RX_SMEM_VALUES = re.compile(r"Required: (\d+), Hardware limit: (\d+)")
RX_CAPTURE = re.compile(r"Capture cuda graph failed", re.I)
RX_NCCL = re.compile(
    r"NCCL error|NCCL WARN|nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidUsage|InvalidArgument|"
    r"RemoteError)|DistBackendError"
)
RX_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|NCCL communicator was aborted")
RX_KV = re.compile(
    r"KVTransferError|KVPoll\.(?:Bootstrapping|WaitingForInput)|Lost connection with prefill instance|"
    r"timed out when bootstrapping|Timed out waiting for prefill|prefill server info from bootstrap|"
    r"Could not fetch prefill parallel info|failed to register to bootstrap server|"
    r"Failed to get prefill server info|is healthy before, but now it is down|"
    r"retry counter exceeded|Mooncake\b.{0,100}(?:fail|error)|TransferEngine\.initialize\(.{0,200}returned -?\d+|"
    r"(?:Decode|Prefill) (?:transfer|handshake|bootstrap) failed|prefill bootstrap server \S+ unreachable|"
    r"no KV from prefill|RDMA\b.{0,80}(?:fail|error|no such|not found)|(?:fail|error)\w*\b.{0,80}\bRDMA",
    re.I,
)
RX_KV_BENIGN = re.compile(r"Aborted by AbortReq|Duplicate or cancelled bootstrap room|Duplicate decode bootstrap room")
RX_KV_ADDR = (
    re.compile(r"bootstrap_addr:? ([\w.\-\[\]:]+:\d+)"),
    re.compile(r"host='([^']+)', port=(\d+)"),
    re.compile(r"http://([\w.\-\[\]:]+:\d+)/route"),
    re.compile(r"(?:bootstrap server|from prefill) ([\w.\-\[\]]+:\d+)"),
)
RX_CUDA_ERR = re.compile(
    r"CUDA error: (?!out of memory)[^\n]+|illegal memory access|device-side assert|"
    r"CUDA driver version is insufficient|NVIDIA driver on your system is too old"
)
RX_WATCHDOG = re.compile(r"watchdog timeout")
RX_CHILD_EXIT = re.compile(
    r"Rank (\d+) scheduler died during initialization \(exit code: (-?\d+)\)|"
    r"Subprocess (\S+) \(pid=\d+\) crashed with exit code (-?\d+)"
)
# Literal first (a leading path group would make the search quadratic on long garbage lines); the
# path is then read around the match (evidence.model_path).
RX_MODEL_PATH = re.compile(r"--model-path \S+: no (?:such directory|config\.json)|Repo id must be in the form"
                            r"| is not a local folder and is not a valid model identifier"
                            r"| does not appear to have a file named config\.json")
# "cannot import name 'N' from 'M' (PATH)": Python names the file M was loaded from. Not its "from partially
# initialized module" form (a circular import) nor "(unknown location)" (a namespace package).
RX_IMPORT_NAME = re.compile(r"cannot import name '([^']+)' from '([\w.]+)' \(([^()\n]+)\)")
RX_FRAME_FILE = re.compile(r'^\s*File "([^"]+)", line \d+')
RX_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
RX_MODULE = re.compile(r"No module named '([^']+)'|(the Mooncake transfer engine is not installed)")
RX_SIGQUIT = re.compile(
    r"Received sigquit from a child process|SIGQUIT received|Initialization failed\. Please see the error"
)
RX_ERRORISH = re.compile(r"error|fail|exception|unsupported|not supported|traceback", re.I)
RX_NORM = re.compile(r"0x[0-9a-fA-F]+|\d+")
CONSEQUENTIAL = re.compile(
    r"^(?:\w+\.)*(?:KeyboardInterrupt|SystemExit|BrokenPipeError|EOFError|ConnectionResetError|"
    r"CancelledError)\b"
)
RX_ARCH_120 = ("sm_120", "sm120", "rtx pro 6000", "capability 12.", "capability: 12.", "capability=(12,",
                "capability (12,")
RX_EXC_LINE = re.compile(r"[A-Za-z_][\w.]*(?::\s|:?\s*$)")
RX_SM100_QUICK = re.compile(r"[Ss][Mm]_?100")
