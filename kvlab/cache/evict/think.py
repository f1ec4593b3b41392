"""ThinK (arXiv:2407.21018): the key channels that matter least pruned, the bytes saved.

    cfg.cache.evict.method = "think:snapkv"  # over any scorer (kvlab.registry.WRAPPERS)
    cfg.cache.evict.options = {"key_channel_compression_ratio": 0.5, "channel_window": 32}

A wrapper that leaves the scorer's choice of tokens alone and stores each kept
key with fewer channels: floor(W x key_channel_compression_ratio) of a KV
head's W channels are dropped, chosen per row and KV head in the row's first
write (its prefill, the compressing step after_prefill) by kvpress's
ThinKPress rule: channel c scores mean(q_c^2) over the last `channel_window`
queries of the row's context and its KV head's query heads (after RoPE and
the cache's transform) x mean(k_c^2) over the keys the layer keeps, and the
lowest go (kvpress's ComposedPress([scorer, ThinKPress]) prunes after the
scorer in the same order). The slots then hold Wk = W - floor(W x ratio)
channels and an int32 index of them per row, layer and KV head
(stored.PrunedKeys), and attention reads the queries' kept channels against
them (stored.ChannelReader): a pruned channel counts as zero, as kvpress's
zeroed keys do, and its bytes are gone.

Where kvlab differs from kvpress, on purpose: every key stored after the first
write (the question, generated tokens, later chunks) is stored with the same
channels, since its slot has no room for more; kvpress prunes only the context
it compresses and keeps later keys whole (and saves no bytes). The first
write's own queries see its keys whole, as kvpress's prefill does.

Grouped-query attention with 16-bit keys, dense or paged, the scorer's own
slots per head: pooled scorers (adakv), scorers of probes (kvzip), quantized
keys, settling layouts, latent caches and shared prefix pages are refused,
naming the combination.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Channels, Wrapper
from kvlab.registry import WRAPPERS


class ThinK(Wrapper):
    """Key channels pruned by ThinK's query x key energy (module docstring)."""

    name, observes = "think", "last"  # the step's queries, where the scorer observes none
    prefix_unsafe = (
        "each row's key channels are chosen in its first write, so another row's "
        "pages hold keys pruned to other channels"
    )
    attention_kinds = ("gqa",)
    defaults = types.MappingProxyType({"key_channel_compression_ratio": 0.5, "channel_window": 32})

    def check(self, options, field: str) -> None:
        ratio = options["key_channel_compression_ratio"]
        if not 0 <= ratio < 1:
            raise ValueError(
                f"{field}.key_channel_compression_ratio={ratio} is not a share in [0, 1): "
                "set the share of each key's channels to prune (0.5 prunes half)"
            )
        if options["channel_window"] < 1:
            raise ValueError(
                f"{field}.channel_window={options['channel_window']} is below 1: set the "
                "latest queries of the context whose energy scores the channels (kvpress: 32)"
            )

    def key_channels(self, width: int, options) -> int:
        return width - int(width * options["key_channel_compression_ratio"])

    def choose_channels(self, c: Channels) -> Array:
        window = c.options["channel_window"]
        # The last `window` queries of each row's context, all its KV head's query heads.
        seen = (c.query_positions < c.end[:, None]) & (
            c.query_positions >= c.end[:, None] - window
        )  # [B, Q]
        weight = seen[:, None, :, None].astype(jnp.float32)
        queries = (c.queries**2 * weight).sum(2) / jnp.maximum(weight.sum(2), 1.0)  # [B, K, W]
        kept = c.kept[..., None].astype(jnp.float32)
        keys = (c.keys**2 * kept).sum(2) / jnp.maximum(kept.sum(2), 1.0)  # [B, K, W]
        _, best = jax.lax.top_k(queries * keys, c.count)
        return jnp.sort(best, axis=-1).astype(jnp.int32)


WRAPPERS.register(ThinK())
