"""Where a worker's KV events and tokenizer come from, for the ``kv_aware`` policy (pd.router.kv_aware): its
``/server_info`` ``kv_events`` block, and text prompts' token ids from the tokenizer its ``/model_info`` names."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional
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


def load_tokenizer(path: str) -> Callable[[str], list[int]]:
    """A text -> token ids function as the engines tokenize prompts (BOS prepended when the tokenizer has
    one, no other special tokens).

    Raises:
        ImportError: transformers is not installed. OSError / ValueError: no tokenizer at ``path``.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.bos_token_id
    head = [bos] if bos is not None else []

    def encode(text: str) -> list[int]:
        return head + tok.encode(text, add_special_tokens=False)

    return encode


class TokenCache:
    """Token ids of text prompts, the ``size`` most recently used kept (system prompts repeat)."""

    def __init__(self, size: int):
        self.size = size
        self.encode: Optional[Callable[[str], list[int]]] = None
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def ids(self, text: str) -> Optional[list[int]]:
        """The token ids of ``text``; None without a tokenizer."""
        ids = self._ids.get(text)
        if ids is not None:
            self._ids.move_to_end(text)
            return ids
        if self.encode is None:
            return None
        ids = self.encode(str(text))
        if self.size:
            self._ids[text] = ids
            if len(self._ids) > self.size:
                self._ids.popitem(last=False)
        return ids
