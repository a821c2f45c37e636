"""What to try, per failure: the fix texts :mod:`.rules` attaches to each finding."""

from __future__ import annotations

FIX_OOM = {
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
# Backends by expert format follow pd.tools.doctor.moe (FP4_EXPERT_METHODS, FP4_TO_TRITON_BACKENDS) and SGLang's
# own sm_120 pick for modelopt_fp4 (sglang/srt/arg_groups/overrides.py).
FIX_ARCH = (
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
FIX_KV_MEM = (
    "The weights and the activation reserve left no room for the KV cache: raise --mem-fraction-static "
    "(e.g. 0.88), spread the model over more GPUs (--tp-size) or use an FP8 KV cache "
    "(--kv-cache-dtype fp8_e4m3); check with nvidia-smi that no other process holds GPU memory."
)
FIX_SMEM = (
    "The kernel's tile configuration was tuned for a GPU with more shared memory per block (sm_90 / "
    "sm_100: 227 KiB; sm_120: 99 KiB = 101376 bytes). Use a backend or config tuned for this GPU "
    "(pd.kernels are sized for sm_120) or fewer pipeline stages / smaller blocks."
)
FIX_CAPTURE = (
    "The wrapped error is the real cause. To confirm the model runs without graphs, start once with "
    "--cuda-graph-backend-decode disabled (slow; diagnosis only), then fix the wrapped error."
)
FIX_PORT = (
    "Another process listens on port {port} (often an engine left over from an earlier run): "
    "`ss -ltnp 'sport = :{port}'` shows which; stop it or pick another port ({flag}). SGLang derives "
    "several internal ports from --port, so leave a gap between engines on one host."
)
PORT_FLAG = {
    "http": "--port",
    "store": "--nccl-port / --dist-init-addr",
    "zmq": "--port; the internal ZMQ ports follow it",
    "nccl_port": "--nccl-port",
    "dist_init_port": "--dist-init-addr",
}
FIX_PAGE = (
    "Prefill and decode must use the same KV page layout: start both roles with the same --page-size "
    "(set it once in the cluster config so both engines get it)."
)
FIX_PD_MISMATCH = (
    "Prefill and decode must agree on the KV cache format: use the same --kv-cache-dtype, --page-size, "
    "--disaggregation-decode-allocation-policy and model spec on both roles."
)
FIX_KV_BOOTSTRAP = (
    "The prefill never got this decode's KV destination. Check that the decode reaches the prefill's "
    "bootstrap server ({addr}: the request's bootstrap_host/bootstrap_port, --disaggregation-bootstrap-port) "
    "and that the two transfer engines reach each other: the RDMA device (--disaggregation-ib-device; "
    "`ibv_devices`) or, to rule RDMA out, MC_FORCE_TCP=1 on both engines. Raise "
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT only if the peer is merely slow."
)
FIX_KV_WAIT = (
    "The decode registered its KV destination but the KV never arrived: check that the prefill is "
    "alive (its own log) and that its transfer engine can write to this decode: RDMA device "
    "(--disaggregation-ib-device; `ibv_devices`), or MC_FORCE_TCP=1 on both engines to test over TCP. "
    "Raise SGLANG_DISAGGREGATION_WAITING_TIMEOUT only if the prefill is merely overloaded."
)
FIX_KV_UNREACHABLE = (
    "The decode cannot reach the prefill's bootstrap server {addr}: check the prefill is up and that "
    "--disaggregation-bootstrap-port is reachable from the decode host (`curl http://{addr}/route`); "
    "across nodes bootstrap_host must be an address the decode can reach, not 127.0.0.1."
)
FIX_KV_LOST = (
    "The prefill {addr} went away (crashed or restarted): its own log holds the root cause "
    "(`pdserve diagnose PREFILL_LOG`); then check the decode can reach it again."
)
FIX_MOONCAKE = (
    "The Mooncake transfer engine failed: check the RDMA device name and state "
    "(--disaggregation-ib-device, `ibv_devices`, `ibv_devinfo`), that both hosts reach each other, "
    "and rule RDMA out with MC_FORCE_TCP=1 (or protocol tcp) on both engines."
)
FIX_KV_OTHER = (
    "Check the bootstrap host/port between the two roles ({addr}), the RDMA device "
    "(--disaggregation-ib-device) or MC_FORCE_TCP=1 to test over TCP, and the peer engine's own log."
)
FIX_WATCHDOG = (
    "A forward step made no progress for --watchdog-timeout seconds: usually a collective waiting on a "
    "dead or stuck rank (look for the first error on the other ranks) or a kernel that hangs; raise "
    "--watchdog-timeout only for legitimately slow first steps (JIT compilation)."
)
FIX_MODEL_PATH = ("Point --model-path (config `model_path`) at the checkpoint directory as it is seen on every "
                   "node that runs an engine (config.json, tokenizer and weights inside); nothing is downloaded "
                   "from the Hugging Face Hub.")
FIX_MODULE = "Install it in the engine's Python environment (the worker's venv), e.g. `pip install {mod}`."
# A folder of a checkout or Ray working dir on sys.path stands in for an installed package of the same name.
FIX_SHADOW_PDSERVE = (
    "{folder}/ is a top-level folder of a pdserve checkout (the source of pd.{mod}), importable as '{mod}' because "
    "the checkout root is on sys.path (Ray's --working-dir upload, `python -m`/`-c` or pytest run from the root, "
    "PYTHONPATH). Run from an up-to-date checkout: its top-level folders hand a bare `import {mod}` to the "
    "installed package (pd/util/shadowing.py); or keep the checkout root off sys.path (submit the job without "
    "--working-dir ., with pdserve installed; drop the root from PYTHONPATH). The real package is {real}; "
    "`pip install {mod}` in the engine's environment if it is missing there."
)
FIX_SHADOW = (
    "A folder named '{mod}' in a directory on sys.path (a checkout or Ray working dir: the current directory of "
    "`python -m`/`-c`, PYTHONPATH, Ray's --working-dir upload) is imported instead of the installed package "
    "'{mod}' that {importer} expects: rename the folder, or keep its parent directory off sys.path (run from "
    "another directory, drop it from PYTHONPATH, submit the job without that working dir)."
)
FIX_EXCEPTION = "No known pattern: read the traceback at the evidence lines; the first rank's error is the cause."
FIX_SIGQUIT = (
    "A child process (a TP rank's scheduler) failed and told the parent to stop; its own error is not "
    "in this log. Diagnose the full engine log or the per-rank logs (earlier lines)."
)


def nccl_fix(detail: str) -> str:
    """The NCCL hints that match the failure text (peer access, /dev/shm, sockets, InfiniBand)."""
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
