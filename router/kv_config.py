"""Settings of the ``kv_aware`` policy (pd.router.kv_aware): a section of RouterSettings, flags ``--kv-*``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field


class KvAwareConfig(BaseModel):
    """The ``kv_aware`` policy: prefill workers ranked by the cost of the prompt pages they would still
    compute, from their own KV cache events (pd.router.kv_aware)."""

    # the same rules as pd.router.config's sections (kept here so that file stays small)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    FLAG: ClassVar[str] = "--kv-{}"

    overlap_weight: float = Field(default=1.0, ge=0)
    """weight of the prompt pages a worker must still compute against the prompt pages already in flight
    to it (NVIDIA Dynamo's ``kv-overlap-score-weight``): above 1 favours cache hits (lower TTFT), below 1
    spreads load."""
    stale_secs: float = Field(default=30.0, gt=0)
    """a worker that sent no KV event for this many seconds after the router sent it a prompt with pages it
    did not hold is treated as not publishing: its overlap is estimated as ``cache_aware`` does."""
    info_timeout_secs: float = Field(default=5.0, gt=0)
    """seconds to read a joining prefill's ``/server_info`` (where its KV events are published) and
    ``/model_info`` (its tokenizer)."""
    attach_retry_secs: float = Field(default=5.0, gt=0)
    """seconds between tries to read the event source of a prefill that did not answer (not started yet)."""
    tokenizer_cache_size: int = Field(default=1024, ge=0)
    """tokenized chunks of repeated prompt prefixes (and whole repeated prompts) kept, least recently used out:
    system prompts repeat."""
