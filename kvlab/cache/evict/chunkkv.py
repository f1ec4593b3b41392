"""ChunkKV (arXiv:2502.00299): tokens kept and evicted in chunks of consecutive positions.

    cfg.cache.evict.method = "chunkkv:snapkv"  # ChunkKV over any scorer (kvlab.registry.WRAPPERS)
    cfg.cache.evict.options = {"chunk_length": 20}  # its default (kvpress's)

A wrapper: the scorer under it scores every candidate, then each candidate
ranks by the mean priority of its chunk (positions chunk_length x j onward),
taken over every KV head of the row, so all heads keep the same chunks
(kvpress's ChunkKVPress sums the scores over the heads before the mean). The
best chunks stay whole; where the budget ends inside a chunk, part of it stays
(its tokens tie: the layer drops the later candidates first, in one prefill the
later positions), so a head holds exactly its budget (kvpress keeps
int(chunks x (1 - compression_ratio)) whole chunks, a little less). Candidates
that always stay (cache.evict.recent) are left out of their chunk's mean. A
settled group of a quantized layout belongs to the chunk of its first position.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Wrapper, always_kept
from kvlab.registry import WRAPPERS


class ChunkKV(Wrapper):
    """Each candidate ranked by its chunk's mean priority over the row's heads."""

    name = "chunkkv"
    defaults = types.MappingProxyType({"chunk_length": 20})

    def check(self, options, field: str) -> None:
        if options["chunk_length"] < 1:
            raise ValueError(
                f"{field}.chunk_length={options['chunk_length']} is below 1: set the tokens "
                "of a chunk, an integer >= 1"
            )

    def priority(self, c: Candidates, priority: Array) -> Array:
        counted = c.valid & ~always_kept(c)
        batch, length = priority.shape[0], c.options["chunk_length"]
        chunk = jnp.where(counted, c.positions // length, -1).reshape(batch, -1)
        rows = jnp.arange(batch)[:, None]
        if c.max_len:  # chunk numbers stay below max_len / chunk_length: sums by number
            places = -(-c.max_len // length) + 1  # the last: candidates not counted
            ids = jnp.where(chunk >= 0, chunk, places - 1)
        else:  # chunks as ids 0.. in sorted order, so their sums scatter into C x E places
            order = jnp.argsort(chunk, axis=-1)
            ordered = jnp.take_along_axis(chunk, order, axis=-1)
            starts = jnp.concatenate(
                [jnp.ones((batch, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=-1
            )
            ids = jnp.zeros_like(order).at[rows, order].set(jnp.cumsum(starts, axis=-1) - 1)
            places = chunk.shape[-1]
        weight = counted.reshape(batch, -1).astype(jnp.float32)
        scored = jnp.where(counted, priority, 0.0).reshape(batch, -1)
        total = jnp.zeros((batch, places)).at[rows, ids].add(scored)
        tokens = jnp.zeros((batch, places)).at[rows, ids].add(weight)
        mean = jnp.take_along_axis(total / jnp.maximum(tokens, 1.0), ids, axis=-1)
        return jnp.where(counted, mean.reshape(priority.shape), priority)


WRAPPERS.register(ChunkKV())
