"""KV-cache storage and byte accounting."""

from kvlab.cache.accounting import cache_bytes, tree_bytes
from kvlab.cache.dense import Cache, KVLayer, LatentLayer, init_cache, write_tokens

__all__ = [
    "Cache",
    "KVLayer",
    "LatentLayer",
    "cache_bytes",
    "init_cache",
    "tree_bytes",
    "write_tokens",
]
