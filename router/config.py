"""Configuration of the PD router: which prefill and decode workers, where to listen, timeouts."""

from __future__ import annotations

from typing import Literal, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

# SGLang's default --disaggregation-bootstrap-port: a prefill given without one listens here.
DEFAULT_BOOTSTRAP_PORT = 8998


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} is not an http(s) URL with a host")
    return url


class PrefillWorkerConfig(BaseModel):
    """One prefill worker: its HTTP URL and the port of its bootstrap server (the decode
    registers its KV pages there)."""

    model_config = ConfigDict(frozen=True)

    url: str
    bootstrap_port: int = Field(DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)

    @property
    def bootstrap_host(self) -> str:
        """The prefill's host as the decode must reach it: the host part of its URL."""
        return urlsplit(self.url).hostname


class RouterConfig(BaseModel):
    """Everything the router needs.

    Attributes:
        prefill: prefill workers (at least one).
        decode: decode worker URLs (at least one).
        host / port: where the router listens.
        policy: how a (prefill, decode) pair is picked; ``round_robin`` (per side) only, for now.
        request_timeout: seconds one upstream request may take in total, streams included.
        connect_timeout: seconds to open a connection to a worker.
        health_check_interval: seconds between background GET /health probes of every worker;
            0 disables them.
        max_connections: upper bound of pooled connections to all workers together.
        log_level: Python logging level name.
    """

    model_config = ConfigDict(frozen=True)

    prefill: list[PrefillWorkerConfig] = Field(min_length=1)
    decode: list[str] = Field(min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    policy: Literal["round_robin"] = "round_robin"
    request_timeout: float = Field(1800.0, gt=0)
    connect_timeout: float = Field(10.0, gt=0)
    health_check_interval: float = Field(10.0, ge=0)
    max_connections: int = Field(1024, ge=1)
    log_level: str = "info"

    @field_validator("decode")
    @classmethod
    def _decode_urls(cls, v: list[str]) -> list[str]:
        return [normalize_url(u) for u in v]

    @classmethod
    def from_urls(cls, prefill: list[tuple[str, Optional[int]] | str], decode: list[str], **kw) -> "RouterConfig":
        """Convenience constructor: ``prefill`` items are ``url`` or ``(url, bootstrap_port)``
        (``None`` port = the default 8998)."""
        pre = []
        for item in prefill:
            url, bport = (item, None) if isinstance(item, str) else item
            pre.append(PrefillWorkerConfig(url=url) if bport is None else PrefillWorkerConfig(url=url, bootstrap_port=bport))
        return cls(prefill=pre, decode=list(decode), **kw)
