"""SGLang's KV block hashes: the chained page hashes its radix cache publishes in KV events, so that a router
can hash a prompt's pages exactly as the engine that caches them does (the engines' radix cache and the router's
kv_aware policy both call ``page_hashes``)."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Optional

DIGEST_BYTES = 32  # SHA-256


@functools.lru_cache(maxsize=64)
def _packer(page_size: int):
    """One page of uint32 ids as little-endian bytes (compiled once per page size: a router hashes per request)."""
    return struct.Struct(f"<{page_size}I").pack


def page_hashes(
    token_ids: Sequence[int], page_size: int, prior_digest: Optional[bytes] = None
) -> list[tuple[bytes, int]]:
    """Chained block hashes of each whole page of ``token_ids``, as SGLang computes them.

    Page ``i``'s digest is ``SHA-256(digest[i-1] || tokens as little-endian uint32)``, where
    ``digest[-1]`` is ``prior_digest`` (nothing at all when None). Its event hash is the digest's
    first 8 bytes read as a big-endian signed int64. This reproduces SGLang's
    ``sglang/srt/mem_cache/utils.py`` ``compute_node_hash_values`` -> ``get_hash_str``
    (``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp``, the uint32 page encoding) and
    ``hash_str_to_int64`` (first 16 hex digits as uint64, minus 2**64 when >= 2**63), so hashes
    equal the ``block_hashes`` an SGLang worker publishes for the same tokens.

    Args:
        token_ids: token ids; a trailing partial page is ignored.
        page_size: tokens per page (SGLang's ``--page-size``).
        prior_digest: the 32-byte digest of the page before ``token_ids[0]``; None at the start.

    Returns:
        One ``(digest, int64 hash)`` per whole page, in order.

    Raises:
        ValueError: ``page_size`` is not positive, ``prior_digest`` is not 32 bytes, or a token id
            of a whole page does not fit in uint32 (SGLang hashes such ids differently).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if prior_digest is not None and len(prior_digest) != DIGEST_BYTES:
        raise ValueError(f"prior_digest must be {DIGEST_BYTES} bytes, got {len(prior_digest)}")
    pack = _packer(page_size)
    out = []
    prior = prior_digest
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        try:
            data = pack(*page)
        except struct.error:
            raise ValueError(f"token ids must fit in uint32: page at {start} is {list(page)}") from None
        digest = hashlib.sha256(prior + data if prior is not None else data).digest()
        out.append((digest, int.from_bytes(digest[:8], "big", signed=True)))
        prior = digest
    return out
