"""Expected Attention (kvpress's ExpectedAttentionPress): the attention future queries
are expected to pay each key, from the statistics of the queries seen so far.

    cfg.cache.evict.method = "expected_attention"  # kvlab.registry.SCORERS ships it
    cfg.cache.evict.options = {"future_positions": 512}  # kvpress's defaults otherwise

Per query head, the step's queries before RoPE (those at positions from
`sink_tokens` on) give a mean mu and, with `covariance`, a covariance S. A
query at the next `future_positions` positions is taken as that distribution
turned by RoPE at those positions, averaged: R = mean of the rotations at
positions end .. end + future_positions - 1, so the expected query is mu R and
its covariance R^T S R. Under a Gaussian query the expected exponentiated score
of a key k is exp(k . mu R / sqrt(d) + k^T R^T S R k / (2 d)), soft-maxed over
the KV head's keys past the sinks and averaged over its query heads; with
`value_norm` each is multiplied by the L2 norm of its value (plus `epsilon`).
The first `sink_tokens` positions stay. Every quantity is kvpress's: its
kept tokens are kvlab's on the same weights (tests/test_kvpress_live.py). It
needs the queries before RoPE, which grouped-query attention offers
(Candidates.raw_queries); a latent model is refused. A decode step
competing every step scores by its own query (a mean and no spread); a
decoding layer (cache.evict.when='decoding') by the queries it buffered since
its last compression (kvlab/cache/evict/buffer.py). A settled group of a
quantized layout scores the mean of its tokens'.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer
from kvlab.registry import SCORERS


class ExpectedAttention(Scorer):
    """The expected attention of future queries, times the value's norm."""

    name, observes = "expected_attention", "all"
    attention_kinds = ("gqa",)
    defaults = types.MappingProxyType(
        {
            "future_positions": 512,
            "sink_tokens": 4,
            "covariance": True,
            "value_norm": True,
            "epsilon": 0.0,
        }
    )

    def check(self, options, field: str) -> None:
        for name, minimum in (("future_positions", 1), ("sink_tokens", 0)):
            if options[name] < minimum:
                raise ValueError(
                    f"{field}.{name}={options[name]} is below {minimum}: set an integer "
                    f">= {minimum}"
                )
        if not options["epsilon"] >= 0:
            raise ValueError(f"{field}.epsilon={options['epsilon']} is negative: set >= 0")

    def score(self, c: Candidates) -> Array:
        o = c.options
        sinks, groups = o["sink_tokens"], c.query_groups
        raw = c.raw_queries  # [B, K, Q, W]
        batch, heads, _, width = raw.shape
        weight = c.query_weights * (c.query_positions >= sinks)  # [B, Q]
        per_head = lambda x: x.reshape(*x.shape[:2], -1, groups, *x.shape[3:])  # noqa: E731
        q = per_head(raw)  # [B, K, Q / G, G, W]
        w = weight.reshape(batch, 1, -1, groups, 1)
        count = jnp.maximum(w.sum(2), 1.0)  # [B, 1, G, 1]
        mean = (q * w).sum(2) / count  # [B, K, G, W]
        turn = _average_rotation(c.rotate, c.end[:, 0, 0], heads, width, o["future_positions"])
        expected = jnp.einsum("bkgw,bkwv->bkgv", mean, turn)
        keys = c.keys()  # [B, K, C, g, W]
        scores = jnp.einsum("bkcjw,bkgw->bkgcj", keys, expected) / jnp.sqrt(width)
        if o["covariance"]:
            centred = (q - mean[:, :, None]) * jnp.sqrt(w)  # [B, K, Q / G, G, W]
            scores += _spread(keys, centred, turn) / (count[..., None] * 2 * width)
        tokens = c.positions[..., None] + jnp.arange(c.group)  # [B, K, C, g]
        scored = c.valid[..., None] & (tokens >= sinks)
        scores = jnp.where(scored[:, :, None], scores, -jnp.inf)
        flat = scores.reshape(*scores.shape[:3], -1)
        attention = jax.nn.softmax(flat, axis=-1).reshape(scores.shape).mean(2)  # [B, K, C, g]
        attention = jnp.where(scored, attention, 0.0)
        if o["value_norm"]:
            attention = (attention + o["epsilon"]) * jnp.linalg.norm(c.values(), axis=-1)
        best = jnp.max(jnp.where(scored, attention, -jnp.inf), axis=(2, 3), keepdims=True)
        attention = jnp.where(tokens < sinks, jnp.maximum(best, 0.0) + 1.0, attention)
        return attention.mean(-1)


def _spread(keys: Array, centred: Array, turn: Array) -> Array:
    """float32[B, K, G, C, g]: k^T R^T S R k for each key k ([B, K, C, g, W]) and query
    head, S = the sum of c^T c over its centred queries c ([B, K, Q, G, W]), R = turn:
    as the sum of the keys' squared products with the turned queries where there
    are fewer queries than channels (a decode step's, a buffer's), else through S."""
    if centred.shape[2] < centred.shape[-1]:
        turned = jnp.einsum("bkqgw,bkwu->bkqgu", centred, turn)
        return jnp.square(jnp.einsum("bkcju,bkqgu->bkgcjq", keys, turned)).sum(-1)
    spread = jnp.einsum("bkqgw,bkqgv->bkgwv", centred, centred)
    spread = jnp.einsum("bkwu,bkgwv,bkvz->bkguz", turn, spread, turn)
    return jnp.einsum("bkcjw,bkgwv,bkcjv->bkgcj", keys, spread, keys)


def _average_rotation(rotate, end: Array, heads: int, width: int, future: int) -> Array:
    """float32[B, K, W, W]: the mean over positions end .. end + future - 1 of the
    map rotate(., position), as a matrix acting on row vectors (x @ R): the basis
    turned by the mean rotation (rotate's span), W rows a head at one position."""
    basis = jnp.broadcast_to(jnp.eye(width, dtype=jnp.float32), (end.shape[0], heads, width, width))
    return rotate(basis, end[:, None], span=future).astype(jnp.float32)


SCORERS.register(ExpectedAttention())
