"""Prefix caching for the reference engine: a radix tree over KV pages with SGLang's semantics."""

from pd.engines.prefix.radix_cache import Cleared, RadixCache, RadixNode, Removed, Stored, page_hashes

__all__ = ["Cleared", "RadixCache", "RadixNode", "Removed", "Stored", "page_hashes"]
