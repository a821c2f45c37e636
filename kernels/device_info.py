"""Cached per-device facts the kernels' launchers pick configs by (SM count, compute capability).

``torch.cuda.get_device_properties`` costs microseconds per call; launchers run on every decode step, so the
answers are cached per device index. Off CUDA (CPU tensors under TRITON_INTERPRET=1) an H200-like default is
returned so grid heuristics stay deterministic in tests.
"""

from __future__ import annotations

import functools
import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEFAULT_NUM_SMS = 132  # H200; used off CUDA only


@functools.lru_cache(maxsize=None)
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (DEFAULT_NUM_SMS off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _props(_index(device)).multi_processor_count


def is_sm90(device: torch.device) -> bool:
    """True on Hopper (compute capability 9.x) CUDA devices; False off CUDA and under the interpreter."""
    if device.type != "cuda" or _INTERPRET:
        return False
    return _props(_index(device)).major == 9


def check_runnable(name: str, t: torch.Tensor, reference: str) -> None:
    """Refuse, before any launch, a tensor the Triton kernels cannot run on: a CPU tensor outside the
    interpreter (Triton would fail with "0 active drivers").

    Args:
        name: the argument's name, for the message. t: the tensor whose device decides. reference: the module
            whose torch reference computes the same on any device, named in the message.
    Raises:
        ValueError: ``t`` is not on a CUDA device and TRITON_INTERPRET=1 is not set.
    """
    if t.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"{name} is on {t.device}: the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 "
                         f"for tiny CPU runs); {reference} computes the same in plain torch")
