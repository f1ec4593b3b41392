"""KVzip's head-level eviction (arXiv:2505.23416, section 3): DuoAttention's
retrieval and streaming heads, the heads scored by context reconstruction.

    heads = kvlab.eval.calibrate.kvzip_heads(model_cfg, params, tokens, encode)  # offline
    kvlab.eval.calibrate.save_patterns(path, heads)
    cfg.cache.evict.method = "kvzip_head"  # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.options = {"patterns": path, "head_ratio": 0.5}

KVzip scores each token of a context by the largest attention a request to repeat
the context gives it; its head-level variant scores a head by the largest of
those over calibration contexts and, as DuoAttention, keeps every token in the
highest-scoring heads and only the first `sink_size` and last `recent_size`
positions in the others (kvlab/cache/evict/duo_attention.py: the pool, the
budgets per layer, the options). Nothing is scored while a context is read: the
heads are fixed offline, so no probes are fed and any cache.evict.when applies
(KVzip's per-token scores cost a second pass over the context and its copy).
"""

from __future__ import annotations

from kvlab.cache.evict.duo_attention import DuoAttention
from kvlab.registry import SCORERS


class KVzipHead(DuoAttention):
    """DuoAttention over heads scored by KVzip (calibrate.kvzip_heads)."""

    name = "kvzip_head"


SCORERS.register(KVzipHead())
