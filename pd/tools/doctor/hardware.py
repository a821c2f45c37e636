"""What this machine has: its GPU generation (:func:`detect_gpu`) and its RDMA devices (:func:`ib_devices`).

GPU detection: ``--assume-gpu`` wins (no device query). Otherwise ``nvidia-smi
--query-gpu=compute_cap`` first -- it counts the node's physical GPUs, which is what the config's
``gpus`` ids index (workers put them in CUDA_VISIBLE_DEVICES), and creates no CUDA context in the
launching process -- then ``torch.cuda``. Neither: architecture checks are skipped. The reference
engine needs no GPU, so for it nothing is queried.

RDMA devices are the entries of :data:`IB_SYSFS` (what ``ibv_devices`` lists).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

IB_SYSFS = "/sys/class/infiniband"


@dataclass
class GpuInfo:
    """The GPU generation the deployment runs on.

    Attributes:
        arch: ``sm_XY`` (e.g. ``sm_120``), or None when unknown (no GPU visible, no flag).
        count: GPUs on this node, or None when not detected.
        source: where it came from (``--assume-gpu``, ``nvidia-smi``, ``torch.cuda``, ...).
    """

    arch: Optional[str] = None
    count: Optional[int] = None
    source: str = "not detected"

    @property
    def major(self) -> Optional[int]:
        """Compute-capability major (``sm_120`` -> 12), None when the arch is unknown."""
        return None if self.arch is None else int(self.arch[3:]) // 10


def parse_arch(text: str) -> str:
    """Normalize a GPU architecture: ``sm_120``, ``sm120``, ``sm_120a``, ``12.0``, ``120`` -> ``sm_120``.

    Raises:
        ValueError: not an architecture.
    """
    t = text.strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", t)
    if m:
        return f"sm_{int(m.group(1))}"
    m = re.fullmatch(r"(\d{1,2})\.(\d)", t)
    if m:
        return f"sm_{int(m.group(1)) * 10 + int(m.group(2))}"
    raise ValueError(f"not a GPU architecture: {text!r} (expected e.g. sm_90, sm_100, sm_120)")


def _from_nvidia_smi() -> Optional[GpuInfo]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not caps:
        return None
    try:
        archs = [parse_arch(c) for c in caps]
    except ValueError:
        return None
    mixed = " (mixed GPUs: " + ", ".join(sorted(set(archs))) + ")" if len(set(archs)) > 1 else ""
    return GpuInfo(arch=archs[0], count=len(caps), source="nvidia-smi" + mixed)


def _from_torch() -> Optional[GpuInfo]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
        return GpuInfo(arch=f"sm_{major * 10 + minor}", count=torch.cuda.device_count(), source="torch.cuda")
    except Exception:
        return None


def detect_gpu(assume: Optional[str] = None) -> GpuInfo:
    """The GPU architecture: ``assume`` (``--assume-gpu``) if given, else nvidia-smi, else
    torch.cuda; ``GpuInfo()`` (unknown) on a machine without GPUs.

    Raises:
        ValueError: ``assume`` is not an architecture.
    """
    if assume:
        return GpuInfo(arch=parse_arch(assume), count=None, source="--assume-gpu")
    return _from_nvidia_smi() or _from_torch() or GpuInfo()


def ib_devices() -> Optional[list[str]]:
    """RDMA devices listed in /sys/class/infiniband, None when the directory does not exist."""
    try:
        return sorted(os.listdir(IB_SYSFS))
    except OSError:
        return None
