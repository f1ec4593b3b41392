"""KV-cache storage and byte accounting (docs/caches.md, "The cache pytree")."""

from kvlab.cache.accounting import bits_label, cache_bytes, cache_label, tree_bytes
from kvlab.cache.allocator import OutOfPages, PageAllocator
from kvlab.cache.dense import Cache, CacheError, DenseLayer
from kvlab.cache.evict import EvictingLayer
from kvlab.cache.factory import init_cache
from kvlab.cache.paged import PagedCache, PagedLayer, PagedQuantizedLayer
from kvlab.cache.placement import write_tokens
from kvlab.cache.prefix import PrefixCache
from kvlab.cache.protocols import CacheLayer, Pooled, Reader
from kvlab.cache.quant import QuantizedLayer, QuantizedTensor
from kvlab.cache.serialization import PYTREES  # registers them with jax.export

__all__ = [
    "Cache",
    "CacheError",
    "CacheLayer",
    "DenseLayer",
    "EvictingLayer",
    "OutOfPages",
    "PYTREES",
    "PageAllocator",
    "PagedCache",
    "PagedLayer",
    "PagedQuantizedLayer",
    "Pooled",
    "PrefixCache",
    "QuantizedLayer",
    "QuantizedTensor",
    "Reader",
    "bits_label",
    "cache_bytes",
    "cache_label",
    "init_cache",
    "tree_bytes",
    "write_tokens",
]
