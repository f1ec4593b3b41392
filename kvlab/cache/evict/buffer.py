"""The queries a decoding layer keeps for its next compression (kvpress's DecodingPress).

Under cache.evict.when='decoding' a layer compresses every `interval` decode
steps. A scorer that reads queries (`Scorer.observes` "window": SnapKV and its
kin; "all": Expected Attention) scores there by the queries of the decode steps
since the last compression, as DecodingPress scores by the hidden states it
buffers: the last obs_window of them. The layer keeps those queries per row
(`QueryBuffer`: as they meet the keys and before RoPE, in the cache's dtype,
counted in its bytes), appends each decode step's and empties a row's when it
compresses. Nothing is evicted between two compressions, so each buffered query
saw exactly the candidates at or before its position: the compressing write
recomputes the attention they paid (`QueryBuffer.mass`) and adds it to the mass
attention gave for the step's own queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from kvlab.cache.placement import Placement


@struct.dataclass
class QueryBuffer:
    """The last `w` decode tokens' queries of each row.

    vectors   [B, K, w, G, W] each KV head's G query heads as they meet the keys
    raw       [B, K, w, G, W] the same before RoPE and the cache's transform
    positions int32[B, w] each token's position, -1 = empty
    """

    vectors: Array
    raw: Array
    positions: Array

    @property
    def size(self) -> int:
        return self.positions.shape[1]

    def appended(self, queries, placement: Placement) -> QueryBuffer:
        """The buffer with the queries (`queries`: attention.core.Observed) of the
        step's decode tokens (of rows that already hold tokens: a prefill is not
        buffered, as DecodingPress skips it), the latest `size` kept."""
        batch, heads, _, groups, width = self.vectors.shape
        length = placement.positions.shape[1]
        if queries.vectors.shape[2] != length * groups:
            raise ValueError(
                "cache.evict.when='decoding' buffers one attention's queries per cache "
                f"layer; this one was read by {queries.vectors.shape[2] // (length * groups)}"
            )
        per_token = lambda x: x.reshape(batch, heads, length, groups, width)  # noqa: E731
        real = jnp.arange(length)[None, :] < placement.num_tokens[:, None]
        decoding = real & (placement.lengths > 0)[:, None]
        positions = jnp.concatenate(
            [self.positions, jnp.where(decoding, placement.positions, -1)], axis=1
        )
        _, latest = jax.lax.top_k(positions, self.size)  # [B, w]: -1s last
        take = lambda old, new: jnp.take_along_axis(  # noqa: E731
            jnp.concatenate([old, per_token(new).astype(old.dtype)], axis=2),
            latest[:, None, :, None, None],
            axis=2,
        )
        return QueryBuffer(
            vectors=take(self.vectors, queries.vectors),
            raw=take(self.raw, queries.raw),
            positions=jnp.take_along_axis(positions, latest, axis=1),
        )

    def emptied(self, rows: Array) -> QueryBuffer:
        """The buffer with rows `rows` (bool[B]) holding nothing."""
        return self.replace(positions=jnp.where(rows[:, None], -1, self.positions))

    def before(self, placement: Placement) -> Array:
        """bool[B, w]: the entries of decode steps before this one's."""
        return (self.positions >= 0) & (self.positions < placement.lengths[:, None])

    def observed(self, step, placement: Placement):
        """The step's observed queries (`step`: attention.core.Observed) with this
        (appended) buffer's entries of earlier steps before them: Q = (w + T) x G,
        weights 1 on those."""
        batch, heads, size, groups, width = self.vectors.shape
        flat = lambda x: x.reshape(batch, heads, size * groups, width).astype(jnp.float32)  # noqa: E731
        by_query = lambda x: jnp.repeat(x, groups, axis=1)  # noqa: E731
        weights = by_query(self.before(placement).astype(jnp.float32))
        return step._replace(
            vectors=jnp.concatenate([flat(self.vectors), step.vectors], axis=2),
            weights=jnp.concatenate([weights, step.weights], axis=1),
            positions=jnp.concatenate([by_query(self.positions), step.positions], axis=1),
            raw=jnp.concatenate([flat(self.raw), step.raw], axis=2),
        )

    def mass(self, keys: Array, positions: Array, valid: Array, heads: Array, placement):
        """float32[B, E, C]: the attention the buffered queries of earlier decode
        steps paid each candidate (keys [B, E, C, W] as stored, at `positions`;
        `heads` their KV head: E = 1 in a pooled layer), summed over the queries
        and averaged over the query heads of each storage head, as attention's mass.
        Each query's softmax is over the candidates at or before its position."""
        batch, kv_heads, size, groups, width = self.vectors.shape
        storage = keys.shape[1]
        queries = self.vectors.astype(jnp.float32)
        if storage == kv_heads:  # [B, K, w, G, C]
            scores = jnp.einsum("bkqgw,bkcw->bkqgc", queries, keys)
            mine = valid[:, :, None, None, :]
        else:  # a pool: each KV head's queries over its own candidates
            scores = jnp.einsum("bkqgw,bcw->bkqgc", queries, keys[:, 0])
            mine = valid & (heads == jnp.arange(kv_heads)[None, :, None])  # [B, K, C]
            mine = mine[:, :, None, None, :]
        seen = positions[:, :, None, None, :] <= self.positions[:, None, :, None, None]
        seen = seen & mine & self.before(placement)[:, None, :, None, None]
        scores = jnp.where(seen, scores * width**-0.5, -jnp.inf)
        peak = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
        weights = jnp.where(seen, jnp.exp(scores - jnp.maximum(peak, -1e30)), 0.0)
        probs = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
        total = probs.sum((2, 3)) / groups  # [B, K, C]
        if storage == kv_heads:
            return total
        return total.sum(1, keepdims=True) / kv_heads  # the pool: over its N query heads


def empty_buffer(size: int, batch: int, kv_heads: int, groups: int, width: int, dtype):
    """A buffer of `size` tokens per row holding nothing."""
    shape = (batch, kv_heads, size, groups, width)
    empty = jnp.full((batch, size), -1, jnp.int32)
    return QueryBuffer(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), empty)  # apart: donated
