"""KeyDiff (arXiv:2504.15364): the keys least like the average key stay.

    cfg.cache.evict.method = "keydiff"  # kvlab.registry.SCORERS ships it by this name

A candidate's score is minus the cosine similarity of its key with the anchor,
the mean of the L2-normalised keys of every candidate of its KV head (the kept
ones and the step's new ones): keys that point where most keys point are the
redundant ones and go first. Each step that overflows the budget compresses
the cache and the step's block together, which is the paper's block-wise
eviction (kvpress's KeyDiffPress is one such block; wrapped in its BlockPress,
the paper's loop). It reads the keys as stored (quantized: dequantized; a
latent model: the latent) and no attention, so it runs with any attention
kernel. A settled group of a quantized layout scores the mean of its tokens'.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer
from kvlab.registry import SCORERS


class KeyDiff(Scorer):
    """-cos(key, mean of the normalised keys), per KV head."""

    name = "keydiff"

    def score(self, c: Candidates) -> Array:
        keys = c.keys()  # [B, E, C, g, W]
        unit = keys / jnp.maximum(jnp.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
        weight = c.valid[..., None, None].astype(unit.dtype)  # [B, E, C, 1, 1]
        count = jnp.maximum(weight.sum((2, 3)) * unit.shape[3], 1.0)  # [B, E, 1]
        anchor = (unit * weight).sum((2, 3)) / count  # [B, E, W]
        anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
        cosine = jnp.einsum("becgw,bew->becg", unit, anchor)
        return -cosine.mean(-1)


SCORERS.register(KeyDiff())
