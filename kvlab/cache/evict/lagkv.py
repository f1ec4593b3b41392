"""LagKV (arXiv:2504.04704): tokens scored against the partition that follows them.

    cfg.cache.evict.method = "lagkv"  # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.options = {"lag_size": 128, "sink_tokens": 4}  # its defaults (kvpress's)

A KV head's candidates, in position order, are `sink_tokens` sinks, then
partitions of `lag_size` tokens. A token of partition j is scored by the
partition after it, its lag reference: per channel, the token's key is min-max
normalised by partition j + 1's minimum and maximum, and the spread (standard
deviation over the channels) of that normalised key, soft-maxed over partition
j, is its key score; its value gets a value score alike, and the token's score
is their mean. Without `cross_scoring` (the default) a token's score is then its
rank within its partition over lag_size, so every partition keeps the same share.
The sinks and the tokens no partition follows (the last whole partition and
what comes after it) score 1 and stay first; a head of fewer than
sink_tokens + 2 x lag_size candidates has no reference to score by and ranks
its tokens by position (the newest stay), as kvpress's LagKVPress does. It
reads keys and values alone (quantized: dequantized; a latent model: the
latent for both), so it runs with any attention kernel; a settled group of a
quantized layout scores the mean of its tokens'. A channel constant over a
reference partition normalises to 0 (kvpress divides by zero there).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer, position_order, position_rank, ranks
from kvlab.registry import SCORERS


class LagKV(Scorer):
    """Lag-relative spread of keys and values, ranked within each partition."""

    name = "lagkv"
    defaults = types.MappingProxyType({"lag_size": 128, "sink_tokens": 4, "cross_scoring": False})

    def check(self, options, field: str) -> None:
        for name, minimum in (("lag_size", 2), ("sink_tokens", 0)):
            if options[name] < minimum:
                raise ValueError(
                    f"{field}.{name}={options[name]} is below {minimum}: set an integer "
                    f">= {minimum}"
                )

    def score(self, c: Candidates) -> Array:
        lag, sinks = c.options["lag_size"], c.options["sink_tokens"]
        batch, heads, count, g = c.valid.shape + (c.group,)
        tokens = count * g  # candidates' tokens, in position order below
        # Each candidate's g tokens in a row, the candidates by position (valid first).
        order = position_order(position_rank(c))[..., None] * g + jnp.arange(g)
        order = order.reshape(batch, heads, tokens)  # [B, E, n]
        n = c.valid.sum(-1, keepdims=True) * g  # real tokens per head [B, E, 1]
        rank = jnp.arange(tokens)
        # Too few candidates for a partition and its reference: the newest stay.
        fallback = jnp.where(rank < sinks, 1.0, (rank - sinks) / jnp.maximum(n - sinks, 1))
        partitions = (tokens - sinks) // lag
        if partitions >= 2:
            keys, values = (
                jnp.take_along_axis(x.reshape(batch, heads, tokens, -1), order[..., None], 2)
                for x in (c.keys(), c.values())
            )
            spread = lambda x: _spread(x, sinks, lag, partitions)  # noqa: E731
            lagged = (spread(keys) + spread(values)) / 2
            if not c.options["cross_scoring"]:  # [B, E, P - 1, lag]: rank in its partition
                lagged = ranks(lagged) / lag
            scored = jnp.ones((batch, heads, tokens), jnp.float32)
            scored = scored.at[..., sinks : sinks + (partitions - 1) * lag].set(
                lagged.reshape(batch, heads, -1)
            )
            # Partitions the last whole one follows are scored; it and the rest score 1.
            last = sinks + ((n - sinks) // lag - 1) * lag  # [B, E, 1]
            scored = jnp.where(rank < last, scored, 1.0)
            fallback = jnp.where(n >= sinks + 2 * lag, scored, fallback)
        b = jnp.arange(batch)[:, None, None]
        e = jnp.arange(heads)[None, :, None]
        per_token = jnp.zeros((batch, heads, tokens), jnp.float32).at[b, e, order].set(fallback)
        return per_token.reshape(batch, heads, count, g).mean(-1)


def _spread(x: Array, sinks: int, lag: int, partitions: int) -> Array:
    """float32[B, E, P - 1, lag]: the softmax over each partition of its tokens'
    spread (std over channels) after min-max normalising by the next partition;
    x [B, E, n, W] in position order, partition j = tokens sinks + j lag onward."""
    blocks = x[:, :, sinks : sinks + partitions * lag].reshape(*x.shape[:2], partitions, lag, -1)
    low, high = blocks[:, :, 1:].min(-2, keepdims=True), blocks[:, :, 1:].max(-2, keepdims=True)
    span = jnp.where(high > low, high - low, 1.0)
    normalised = (blocks[:, :, :-1] - low) / span  # [B, E, P - 1, lag, W]
    return jax.nn.softmax(jnp.std(normalised, axis=-1, ddof=1), axis=-1)


SCORERS.register(LagKV())
