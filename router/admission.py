"""Admission caps: a generation request asking for more than the router's limits allow is refused
with 400 before any worker sees it, so one small request cannot hold the cluster (every sequence is
a bootstrap room, a KV allocation on both sides and, when it fails, an abort per side per attempt).

The request's shape (prompts, ``n``) is pd.router.rooms's, the same that stamps its rooms; the
limits are ``max_n``, ``max_batch_size`` and ``max_sequences_per_request`` of pd.router.config.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from pd.router.config import RouterSettings
from pd.router.flags import SettingsFlags
from pd.router.rooms import Shape

_FLAGS = SettingsFlags(RouterSettings)
FLAG = {key: _FLAGS.flag_of(key) for key in ("max_n", "max_batch_size", "max_sequences_per_request")}


class OverLimit(NamedTuple):
    """Why a request is refused: the client's message (naming the cap and its flag) and the request
    field it is about (None for the sequence count, which two fields make)."""

    message: str
    param: Optional[str]


def check(route: str, shape: Shape, settings: RouterSettings) -> Optional[OverLimit]:
    """None when ``shape`` is within every cap of ``settings``, else the first cap it is over
    (``n``, then the batch size, then prompts x n)."""
    if shape.n > settings.max_n:
        param = "sampling_params.n" if route == "/generate" else "n"
        return OverLimit(f"{param} = {shape.n} is over the router's limit of {settings.max_n} ({FLAG['max_n']})",
                         param)
    if shape.prompts > settings.max_batch_size:
        return OverLimit(f"a batch of {shape.prompts} prompts is over the router's limit of "
                         f"{settings.max_batch_size} ({FLAG['max_batch_size']})", None)
    if shape.sequences > settings.max_sequences_per_request:
        return OverLimit(f"{shape.prompts} prompts x n = {shape.n} make {shape.sequences} sequences, over the "
                         f"router's limit of {settings.max_sequences_per_request} "
                         f"({FLAG['max_sequences_per_request']})", None)
    return None
