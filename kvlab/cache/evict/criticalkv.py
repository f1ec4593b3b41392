"""CriticalKV (arXiv:2502.03805): a scorer's priorities corrected by what each value adds.

    cfg.cache.evict.method = "criticalkv:snapkv"  # over any scorer (kvlab.registry.WRAPPERS)
    cfg.cache.evict.options = {"epsilon": 1e-4, "first_stage_ratio": 0.5}  # kvpress's

Two stages, as kvpress's CriticalKVPress runs them: the scorer's best
floor(kept x first_stage_ratio) candidates of each head (at least one) stay first (the
tokens always kept, cache.evict.recent, among them); the rest rank by
(priority + epsilon) x the L1 norm of the value's output projection, W_o^h v
per query head averaged over the KV head's query heads, the part of a token's
attention output that reaches the residual stream. `kept` is what the head
keeps after the step (Candidates.keep). The output projection comes from the
attention module (Candidates.output_norms), which grouped-query attention
offers for scorers that observe: the wrapper observes the step's last query
where its scorer observes none. A settled group of a quantized layout weighs
the mean of its tokens' norms. The norm is a function of the value alone
(`weighs`): a layer storing tokens one by one weighs each token once, as it
arrives, and carries its weight per slot (Candidates.weights), so a compression
does not project every held value again.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Wrapper, always_kept, best
from kvlab.registry import WRAPPERS

FIRST = 1.0e36  # the first stage's candidates: above every weighed priority


class CriticalKV(Wrapper):
    """First the scorer's best share, then the rest by priority x |W_o v|_1."""

    name, observes, weighs = "criticalkv", "last", True
    attention_kinds = ("gqa",)
    defaults = types.MappingProxyType({"epsilon": 1e-4, "first_stage_ratio": 0.5})

    def check(self, options, field: str) -> None:
        if options["epsilon"] < 0:
            raise ValueError(f"{field}.epsilon={options['epsilon']} is negative: set >= 0")
        if not 0 <= options["first_stage_ratio"] <= 1:
            raise ValueError(
                f"{field}.first_stage_ratio={options['first_stage_ratio']} is not a share in [0, 1]"
            )

    def priority(self, c: Candidates, priority: Array) -> Array:
        first = jnp.where(c.valid, priority, -jnp.inf)
        first = jnp.where(always_kept(c), jnp.inf, first)
        share = c.options["first_stage_ratio"]
        count = jnp.floor(c.keep * share).astype(jnp.int32)
        if share > 0:  # at least one, as kvpress
            count = jnp.maximum(count, 1)
        weight = self.weigh(c) if c.weights is None else c.weights
        weighed = (priority + c.options["epsilon"]) * weight
        return jnp.where(c.valid & best(first, count), FIRST, weighed)

    def weigh(self, c: Candidates) -> Array:
        """float32[B, E, C]: |W_o^h v|_1 averaged over the KV head's query heads
        (a settled group: over its tokens too)."""
        values = c.values()  # [B, E, C, g, W]
        batch, heads, candidates, group = values.shape[:4]
        flat = values.reshape(batch, heads, candidates * group, -1)
        if heads != c.kv_heads:  # one pool (AdaKV): every KV head's projection, then its own
            flat = jnp.broadcast_to(flat, (batch, c.kv_heads, *flat.shape[2:]))
        norms = c.output_norms(flat).mean(2).reshape(batch, -1, candidates, group).mean(-1)
        return jnp.take_along_axis(norms, c.heads, axis=1) if heads != c.kv_heads else norms


WRAPPERS.register(CriticalKV())
