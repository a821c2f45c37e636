"""Where a worker's KV events come from, for the ``kv_aware`` policy (pd.router.kv_aware): its ``/server_info``
``kv_events`` block (the tokenizer its ``/model_info`` names is pd.router.kv_tokenizer's)."""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

_WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")


def event_source(worker_url: str, info: object) -> tuple[str, Optional[str], str, int]:
    """Where a worker publishes its KV events, from its ``/server_info`` ``kv_events`` block.

    Returns:
        (PUB endpoint, replay endpoint or None, topic, block size in tokens).

    Raises:
        ValueError: not a zmq publisher block of one data-parallel rank with a port and a block size.
    """
    if not isinstance(info, dict) or info.get("publisher") != "zmq":
        raise ValueError(f"kv_events is not a zmq publisher: {info!r}")
    if info.get("dp_size", 1) != 1:
        raise ValueError(f"kv_events of {info.get('dp_size')} data-parallel ranks are not supported")
    port, block = info.get("endpoint_port_base"), info.get("block_size")
    if type(port) is not int or type(block) is not int or block < 1:
        raise ValueError(f"kv_events has no endpoint_port_base or block_size: {info!r}")
    host = str(info.get("endpoint_host") or "")
    if host in _WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    replay = info.get("replay_endpoint_port_base")
    return (f"tcp://{host}:{port}", f"tcp://{host}:{replay}" if type(replay) is int else None,
            str(info.get("topic") or ""), block)
