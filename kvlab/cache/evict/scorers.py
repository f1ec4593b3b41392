"""Eviction scorers: how much each token deserves to stay (cache.evict.method).

    class Tova(Scorer):                 # a method is one class (kvlab/cache/evict/tova.py)
        name, observes = "tova", "last"
        def score(self, c: Candidates):  # float32[B, E, C]
            return attention(c).mean(1, keepdims=True) * jnp.ones_like(c.valid)
    SCORERS.register(Tova())            # or one line in kvlab.registry.SCORERS.shipped

An evicting layer (kvlab/cache/evict/layers.py) stores a budget of slots per
KV head. Each step the stored tokens and the step's new ones compete for them:
the `recent` latest positions always stay, the rest by the scorer's score
(highest stay). The layer gathers what a scorer may read into `Candidates`
(the same for tokens stored one by one and for the settled groups of g tokens
of a quantized layout with a residual window or per-channel scales: one score
serves both), the scorer returns one number per candidate, and the layer does
the rest: the competition, the writes, the byte count. What a scorer declares
drives everything else (kvlab.config's validation, kvlab.cache.accounting's
bytes, the cache's label, the eviction sweep's grid):

    name          cache.evict.method
    observes      None, or whose attention and queries the layer hands it
                  (`Candidates.mass`, `.queries`):
                  "all" (every real query of a step, h2o), "window" (the last
                  cache.evict.obs_window, snapkv) or "last" (the last one)
    keeps         a float32 per slot carried to the next step (the score of a kept
                  token: h2o's accumulated attention), counted in the cache's bytes
    pooled        a layer's K heads share one pool of K x budget slots, each head at
                  least cache.evict.adakv_floor x budget (adakv)
    prefix_unsafe why shared prompt pages cannot stand for its state (None: they can)
    options       the cache.evict fields it reads, besides budget and ratio
    budgets()     the per-layer budgets (pyramidkv), uniform by default

Built in here: h2o, snapkv, pyramidkv, adakv, knorm, random; beside: tova.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.registry import SCORERS


@dataclasses.dataclass(frozen=True)
class Candidates:
    """What a scorer reads: per storage head E (a KV head; one for a latent or a
    pooled layer), the C candidates for its slots, the `held` stored ones first,
    then the step's new ones; each a token or a settled group of `group` tokens.

    tags       int32[B, E, C]   each candidate's id: its (first) position, or
                                position x K + KV head in a pooled layer; -1 none
    valid      bool[B, E, C]    a real candidate
    positions  int32[B, E, C]   its (first) position, -1 none
    heads      int32[B, E, C]   the KV head it belongs to
    mass       float32[B, E, C, group] | None   the attention each of its tokens
               received from the queries the scorer observes (summed over them,
               averaged over each KV head's query heads); None when it observes none
    state      float32[B, E, held] | None   what the scorer kept per slot (`keeps`)
    keys       () -> float32[B, E, C, group, W]   its keys as stored (quantized:
               dequantized), the first cached tensor (a latent model's latent)
    kernel, seed, layer, kv_heads   the layer's policy fields scorers read
    queries    float32[B, K, Q, W] | None   the step's queries of each KV head
               (a latent model: one, the latent) as they meet `keys`: after RoPE
               and the cache's transform (a latent model's: W_UK folded in, the
               RoPE part left out), Q = T steps x G query heads (x the layers of
               a cross-layer run); per KV head also in a pooled layer (E = 1:
               `heads` picks); None when the scorer observes none
    query_weights  float32[B, Q] | None   1 for the queries the scorer observes
               (its `observes`), 0 for the others and padding
    """

    tags: Array
    valid: Array
    positions: Array
    heads: Array
    held: int
    group: int
    mass: Array | None
    state: Array | None
    keys: Callable[[], Array]
    kernel: int
    seed: int
    layer: int
    kv_heads: int
    queries: Array | None = None
    query_weights: Array | None = None


class Scorer:
    """One eviction method (module docstring). `score` returns float32[B, E, C]."""

    name: str = ""
    observes: str | None = None
    keeps: bool = False
    pooled: bool = False
    prefix_unsafe: str | None = None
    options: tuple[str, ...] = ("recent",)

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        """Tokens kept per KV head in each of `layers` layers, `budget` on average."""
        return (budget,) * layers

    def score(self, c: Candidates) -> Array:
        raise NotImplementedError


def attention(c: Candidates) -> Array:
    """float32[B, E, C]: the attention each candidate (its tokens together) received."""
    return c.mass.sum(-1)


def pooled_max(score: Array, c: Candidates) -> Array:
    """Max of each candidate's score over the `kernel` nearest positions of its
    KV head (SnapKV's pooling): score [B, E, C]."""
    if c.kernel == 1:
        return score
    key = c.heads * (1 << 24) + c.positions  # head-major; positions stay below 2**24
    order = jnp.argsort(jnp.where(c.valid, key, jnp.iinfo(jnp.int32).max), axis=-1)
    take = lambda x: jnp.take_along_axis(x, order, axis=-1)  # noqa: E731
    s, v, h = take(score), take(c.valid), take(c.heads)
    best = s
    for shift in range(1, c.kernel // 2 + 1):
        for d in (shift, -shift):
            moved = jnp.roll(s, d, axis=-1)
            ok = jnp.roll(v, d, axis=-1) & (jnp.roll(h, d, axis=-1) == h)
            edge = jnp.arange(s.shape[-1])
            ok = ok & ((edge >= d) if d > 0 else (edge < s.shape[-1] + d))
            best = jnp.where(ok & v, jnp.maximum(best, moved), best)
    # Back to candidate order: a scatter through the permutation (no second sort).
    b = jnp.arange(order.shape[0])[:, None, None]
    e = jnp.arange(order.shape[1])[None, :, None]
    return jnp.zeros_like(best).at[b, e, order].set(best)


def hash01(x: Array) -> Array:
    """A pseudo-random float in [0, 1) per uint32 (a murmur3 finaliser)."""
    x = x.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) / float(1 << 24)


class H2O(Scorer):
    """Heavy hitters (arXiv:2306.14048): the attention a token has received from
    every later query, accumulated over its stay."""

    name, observes, keeps = "h2o", "all", True
    prefix_unsafe = "the attention a cached prefix's tokens accumulated is not in its pages"

    def score(self, c: Candidates) -> Array:
        score = attention(c)
        return score.at[..., : c.held].add(c.state)


class SnapKV(Scorer):
    """SnapKV (arXiv:2404.14469): the attention of the step's last obs_window
    queries, max-pooled over `kernel` neighbouring positions."""

    name, observes = "snapkv", "window"
    options = ("recent", "obs_window", "kernel")

    def score(self, c: Candidates) -> Array:
        return pooled_max(attention(c), c)


class PyramidKV(SnapKV):
    """PyramidKV (arXiv:2406.02069): SnapKV with budgets shrinking linearly from
    the first layer to the last, whose scored part is the mean's 1 / pyramid_beta."""

    name = "pyramidkv"
    options = (*SnapKV.options, "pyramid_beta")

    def budgets(self, budget: int, layers: int, evict: Mapping) -> tuple[int, ...]:
        if layers == 1:
            return (budget,)
        # The scored part (budget - recent) falls linearly from 2m - m/beta in the
        # first layer to m/beta in the last (mean m).
        mean = budget - evict["recent"]
        low = mean / evict["pyramid_beta"]
        high = 2 * mean - low
        step = (high - low) / (layers - 1)
        return tuple(evict["recent"] + max(1, round(high - i * step)) for i in range(layers))


class AdaKV(SnapKV):
    """AdaKV (arXiv:2407.11550): SnapKV's scores, a layer's heads sharing one pool
    (unequal budgets per head, each at least adakv_floor x budget)."""

    name, pooled = "adakv", True
    prefix_unsafe = "its heads share one pool, so a prefix's tokens are not in slot order"
    options = (*SnapKV.options, "adakv_floor")


class KNorm(Scorer):
    """K-norm (arXiv:2406.11430): the keys of smallest L2 norm stay (a group: the
    mean of its keys' norms)."""

    name = "knorm"

    def score(self, c: Candidates) -> Array:
        return -jnp.linalg.norm(c.keys(), axis=-1).mean(-1)


class Random(Scorer):
    """A pseudo-random set: a hash of seed, layer, storage head and (first) position."""

    name = "random"
    options = ("recent", "seed")

    def score(self, c: Candidates) -> Array:
        heads = c.tags.shape[1]
        e = jnp.arange(heads)[None, :, None]
        salt = (c.seed * 0x9E3779B1 + c.layer * 0x85EBCA77) & 0xFFFFFFFF
        return hash01((c.tags * heads + e).astype(jnp.uint32) ^ jnp.uint32(salt))


for _scorer in (H2O(), SnapKV(), PyramidKV(), AdaKV(), KNorm(), Random()):
    SCORERS.register(_scorer)
