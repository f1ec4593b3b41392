"""Token eviction: cache layers that keep a budget of tokens and drop the rest.

A layer of an evicting cache (`cache.evict.method` other than 'none', or a
model with `model.sliding_window`) stores `budget` slots per KV head instead of
the row's whole length; tokens it evicts are gone, so `cache_bytes` counts
only the slots (docs/caches.md, "Evicting caches"). Keys are stored after
RoPE, so a kept token keeps its position; `Cache.lengths` stays the number of
tokens a row has seen (the next position), and `EvictingLayer.stored()` the
number each head holds.

Layouts (AdaKV's pool and the quantized groups below are scored ones):

- ring ('window', 'sinks', and `model.sliding_window` over tokens stored one
  by one): slot of position p is
  p for the first `sinks` tokens and sinks + (p - sinks) mod R after them
  (R = slots - sinks), as Mistral's rolling buffer; which position a slot holds
  follows from the row's length, so nothing else is stored. A query at p sees
  the sinks and the positions in (p - R, p], also among a step's own tokens:
  the cache equals a plain forward with that banded mask, whatever the chunks.
- scored (h2o, snapkv, pyramidkv, adakv, knorm, random): each slot's position
  is stored (`positions` int32[B, E, S], -1 = empty) and, for h2o, the
  attention it accumulated (`scores` float32[B, E, S]). A step's tokens
  attend over the kept tokens and each other (causally); then the stored and
  the new tokens together compete for the S slots of each head: the `recent`
  latest positions are always kept, the others by the method's score, and the
  new tokens that win take the slots of the stored ones that lose. With a
  budget of at least the sequence length nothing is evicted and the logits
  are the full cache's. E is the number of KV heads (GQA; each head evicts on
  its own, scored by the mean over its group's query heads) or 1 (MLA: one
  latent per token, scored over all heads).

AdaKV (arXiv:2407.11550) gives a layer's heads unequal budgets: its K heads
share one pool of K x budget slots (E = 1), each slot tagged with its head
(`positions` holds position * K + head), the top K x budget (head, token)
pairs of the layer are kept, each head at least `adakv_floor` x budget. The
pool costs exactly what K heads of `budget` slots cost; every query head
reads the pool masked to its own KV head's slots.

Scores: h2o (arXiv:2306.14048) accumulates each token's attention from every
later query; snapkv (arXiv:2404.14469) scores by the attention of the step's
last `obs_window` queries, max-pooled over `kernel` neighbouring positions;
pyramidkv (arXiv:2406.02069) is snapkv with budgets shrinking linearly from the
first layer to the last (the last keeps the mean / pyramid_beta, the mean is
the budget); knorm (arXiv:2406.11430) keeps the keys of smallest L2 norm;
random keeps a pseudo-random set (a hash of seed, layer, head and position).

Quantized tensors (cache.<prefix>_axis='token', residual 0) are stored per
slot as codes and per-token scales, quantized as they are stored; a step's
tokens are seen quantized, as the quantized cache sees them. With a residual
window or per-channel scales (KIVI, arXiv:2402.02750) a scored layer keeps the
quantized layout (quant.Layout, g tokens per group): the unsettled tokens wait
in a full-precision ring [B, K, W, Wd] (slot = position mod W) and are never
evicted; tokens settle a group at a time when QuantizedLayer would flush them,
are quantized then, and compete as whole groups for S = max(1, (budget -
residual) // g) group slots per storage head (positions: each group's first
position). Reads are QuantizedLayer.read's with the payload masked per head.
A window (window, sinks, model.sliding_window) over such storage stores
positions too: its band masks every block, and the sinks' groups and the newest
ones that cover every query's band stay (window_groups).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import struct
from jaxtyping import Array, Float, Int

from kvlab.cache import topology
from kvlab.cache.evict.scorers import Candidates, Scorer
from kvlab.cache.paged import gather_pages, write_pages
from kvlab.cache.placement import Placement, write_tokens
from kvlab.cache.quant import (
    Layout,
    QuantizedLayer,
    QuantizedTensor,
    dequantize_tokens,
    quantize_tokens,
    quantized_layout,
    write_ring,
)
from kvlab.config import dtype_of
from kvlab.registry import SCORERS

RING_METHODS = ("window", "sinks")
MAX_SCORED_LEN = 2**24 - 2**16  # positions (and a step's tokens) stay below 2**24: sort keys
KEPT = 3.0e38  # priority of a token that must stay (recent); scores stay far below
FLOOR = 1.0e38  # adakv: a head's best `floor` tokens


@dataclasses.dataclass(frozen=True)
class Policy:
    """What one evicting layer keeps (static: part of the compiled program)."""

    method: str
    slots: int  # S per storage head (a pooled layer: K x budget); settling: groups of g tokens
    max_len: int  # positions a row may reach: the cache's capacity
    kv_heads: int  # K of the attention (the head tag of a pooled layer)
    query_heads: int  # N
    pooled: bool = False  # adakv over K > 1 heads: one pool per layer
    sinks: int = 0  # ring: first positions kept
    recent: int = 0  # scored: latest positions kept
    obs_window: int = 1
    kernel: int = 1
    floor: int = 0  # adakv: slots each head keeps at least
    seed: int = 0
    layer: int = 0
    residual: int = 0  # quantized: latest tokens kept unsettled, in full precision
    granularity: int = 1  # g: tokens that settle, and are kept or evicted, together
    span: int = 0  # window methods: R, the latest positions a query sees after the sinks

    @property
    def windowed(self) -> bool:
        """A query sees the sinks and its last `span` positions (window, sinks)."""
        return self.method in RING_METHODS

    @property
    def scorer(self) -> Scorer | None:
        """The method's scorer (kvlab/cache/evict/scorers.py); None for a window."""
        return scorer_of(self.method)

    @property
    def keeps(self) -> bool:
        """Whether each slot carries a float32 of the scorer's (`Scorer.keeps`)."""
        return self.scorer is not None and self.scorer.keeps

    @property
    def ring(self) -> bool:
        """Slots in a ring whose positions follow from the length (a window over
        tokens stored one by one; over settling groups the newest groups stay)."""
        return self.windowed and not self.settles

    @property
    def settles(self) -> bool:
        """Tokens wait in a full-precision ring and settle in groups (quant.Layout)."""
        return self.residual > 0 or self.granularity > 1

    @property
    def rows(self) -> int:
        """Token rows a row stores per storage head: its slots (settling: g each)."""
        return self.slots * self.granularity

    @property
    def layout(self) -> Layout:
        """The quantized layout whose settled(n) rule says when tokens leave the ring."""
        return Layout(self.max_len, self.residual, self.granularity)


def scorer_of(method: str) -> Scorer | None:
    """The scorer of cache.evict.method, None for the layouts that score nothing."""
    return None if method in ("none", *RING_METHODS) else SCORERS.get(method)


def resolve_budget(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> int:
    """Tokens kept per KV head and layer (before pyramidkv's per-layer schedule)."""
    if model_cfg["sliding_window"]:
        return model_cfg["sliding_window"]
    evict = cache_cfg["evict"]
    return evict["budget"] or math.ceil(evict["ratio"] * max_len)


def layer_budgets(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> tuple[int, ...]:
    """Tokens kept per KV head in each layer; raises ValueError for budgets that
    cannot hold what the method always keeps."""
    evict = cache_cfg["evict"]
    method = "window" if model_cfg["sliding_window"] else evict["method"]
    budget = resolve_budget(model_cfg, cache_cfg, max_len)
    layers = topology.num_cache_layers(model_cfg)
    source = (
        "cache.evict.budget" if evict["budget"] else f"ceil(cache.evict.ratio x max_len={max_len})"
    )
    if method == "sinks" and evict["sinks"] >= budget:
        raise ValueError(
            f"cache.evict.sinks={evict['sinks']} leaves no recent window in a budget of "
            f"{budget} ({source}): set cache.evict.sinks below the budget or a larger budget"
        )
    scorer = scorer_of(method)
    if scorer is None:
        return (budget,) * layers
    if evict["recent"] >= budget:
        raise ValueError(
            f"cache.evict.recent={evict['recent']} keeps every token of a budget of {budget} "
            f"({source}), so nothing is scored: set cache.evict.recent below the budget, or "
            "use cache.evict.method='window'"
        )
    return scorer.budgets(budget, layers, evict)


def policies(model_cfg: Mapping, cache_cfg: Mapping, max_len: int) -> tuple[Policy, ...] | None:
    """One Policy per layer, or None for a cache that keeps every token."""
    evict = cache_cfg["evict"]
    method = "window" if model_cfg["sliding_window"] else evict["method"]
    if method == "none":
        return None
    scorer = scorer_of(method)
    if scorer is not None and max_len > MAX_SCORED_LEN:
        raise ValueError(
            f"max_len={max_len} is too long for cache.evict.method={method!r}: scored slots "
            f"key positions below 2**24 with their head; use max_len <= {MAX_SCORED_LEN}"
        )
    grouped = model_cfg["attention"] != "mla"
    kv_heads = model_cfg["num_kv_heads"] if grouped else 1
    pooled = scorer is not None and scorer.pooled and kv_heads > 1
    # Quantized with a residual window or per-channel scales (KIVI): tokens settle in
    # groups of g and only settled groups compete, for (budget - residual) // g slots.
    layout = quantized_layout(model_cfg, cache_cfg, max_len)
    residual, g = (0, 1) if layout is None else (layout.residual, layout.granularity)
    settles = residual > 0 or g > 1
    sinks = evict["sinks"] if method == "sinks" else 0
    out = []
    for i, budget in enumerate(layer_budgets(model_cfg, cache_cfg, max_len)):
        if not settles:
            units = budget
        elif method in RING_METHODS:
            units = window_groups(layout, sinks, budget - sinks)
        else:
            units = max(1, (budget - residual) // g)
        out.append(
            Policy(
                method=method,
                slots=units * kv_heads if pooled else units,
                max_len=max_len,
                kv_heads=kv_heads,
                query_heads=model_cfg["num_heads"],
                pooled=pooled,
                sinks=sinks,
                recent=evict["recent"] if scorer is not None else 0,
                obs_window=evict["obs_window"],
                kernel=evict["kernel"],
                floor=math.floor(evict["adakv_floor"] * units) if pooled else 0,
                seed=evict["seed"],
                layer=i,
                residual=residual if settles else 0,
                granularity=g if settles else 1,
                span=budget - sinks if method in RING_METHODS else 0,
            )
        )
    return tuple(out)


def window_groups(layout: Layout, sinks: int, span: int) -> int:
    """Group slots a window over settling groups needs: the groups holding the
    first `sinks` positions, and enough of the newest settled ones that every
    query sees its last `span` positions (the rest of them are unsettled)."""
    g = layout.granularity
    sink_groups = -(-sinks // g)
    needed = 1
    # Queries at position n (the first of a step at length n) reach back to
    # n - span + 1; which groups are settled repeats with period g past the start.
    for n in range(min(layout.capacity, sinks + span + layout.residual + 3 * g) + 1):
        reach = max(0, n - span + 1) // g
        needed = max(needed, layout.settled(n) // g - max(reach, sink_groups))
    return sink_groups + needed


def storage_heads(policy: Policy) -> int:
    """E: heads that evict on their own (1 for a pooled or latent layer)."""
    return 1 if policy.pooled else policy.kv_heads


# ---------------------------------------------------------------------------
# Stored tensors: arrays in the cache dtype, or quantized per token


def _block(tensor):
    """What attention reads a stored tensor through."""
    return tensor.reader() if isinstance(tensor, QuantizedTensor) else tensor


def _pending(x: Array, tensor) -> Array:
    """New tokens as `write` takes them: in the cache dtype."""
    if not isinstance(tensor, QuantizedTensor):
        return x.astype(tensor.dtype)
    return x.astype(dtype_of(tensor.spec.dtype))


def _as_stored(x: Array, tensor) -> Array:
    """New tokens (from `_pending`) as attention will see them stored:
    quantized ones as their dequantized codes."""
    if not isinstance(tensor, QuantizedTensor) or not tensor.spec.quantized:
        return x
    return dequantize_tokens(*quantize_tokens(x, tensor.spec), tensor.spec)


def _stored_values(tensor) -> Array:
    """The stored tokens as an array [B, KH, S, W] (knorm's key norms)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize()
    return tensor.astype(jnp.float32)


def _put(tensor, new: Array, slots: Array):
    """`new` [B, KH, T, W] written at `slots` [B, T] or per head [B, E, T]."""
    if not isinstance(tensor, QuantizedTensor):
        return write_tokens(tensor, new, slots, axis=2)
    if not tensor.spec.quantized:
        return tensor.replace(payload=write_tokens(tensor.payload, new, slots, axis=2))
    payload, scale, zero = quantize_tokens(new, tensor.spec)
    return tensor.replace(
        payload=write_tokens(tensor.payload, payload, slots, axis=2),
        scale=write_tokens(tensor.scale, scale, slots, axis=2),
        zero=None if zero is None else write_tokens(tensor.zero, zero, slots, axis=2),
    )


def _heads(tensor) -> int:
    array = tensor.payload if isinstance(tensor, QuantizedTensor) else tensor
    return array.shape[1]


def _width(tensor) -> int:
    return tensor.width if isinstance(tensor, QuantizedTensor) else tensor.shape[3]


# ---------------------------------------------------------------------------
# The ring


def ring_positions(lengths: Int[Array, " B"], policy: Policy) -> Int[Array, "B S"]:
    """The position each ring slot holds for rows of `lengths` tokens; -1 = empty."""
    slot = jnp.arange(policy.slots)
    sinks, span = policy.sinks, policy.span
    last = lengths[:, None] - 1
    offset = slot - sinks  # place in the ring after the sinks
    latest = sinks + offset + span * jnp.floor_divide(last - sinks - offset, span)
    in_ring = last - sinks - offset >= 0
    position = jnp.where(slot < sinks, slot, latest)
    held = jnp.where(slot < sinks, slot < lengths[:, None], in_ring)
    return jnp.where(held, position, -1)


def banded(q_positions: Array, k_positions: Array, sinks: int, span: int) -> Array:
    """Keys a query may see under a window of `span` positions after `sinks` kept ones."""
    return (
        (k_positions >= 0)
        & (k_positions <= q_positions)
        & ((k_positions < sinks) | (k_positions > q_positions - span))
    )


# ---------------------------------------------------------------------------
# The layer


def stored_tokens(positions: Array | None, policy: Policy, lengths: Array) -> Array:
    """int32[B, K]: tokens each KV head of each row holds (K = 1 for a latent)."""
    if policy.ring:
        return jnp.minimum(lengths, policy.slots)[:, None]
    held = positions >= 0  # [B, E, S]
    if policy.pooled:  # [B, 1, S] -> per KV head [B, K]
        heads = jnp.arange(policy.kv_heads)[None, :, None]
        held = held & (positions % policy.kv_heads == heads)
    count = held.sum(-1)
    if policy.settles:  # kept groups of g tokens, and the ring's unsettled tokens
        count = count * policy.granularity + (lengths - policy.layout.settled(lengths))[:, None]
    return count.astype(jnp.int32)


def observed_queries(policy: Policy, placement: Placement) -> Array | None:
    """float32[B, T]: the queries whose attention the scorer reads (`observes`:
    "all" real ones, the last obs_window of a "window", the "last" one), or None."""
    observes = None if policy.scorer is None else policy.scorer.observes
    if observes is None:
        return None
    steps = jnp.arange(placement.positions.shape[1])[None, :]
    real = steps < placement.num_tokens[:, None]
    if observes != "all":
        window = policy.obs_window if observes == "window" else 1
        real = real & (steps >= placement.num_tokens[:, None] - window)
    return real.astype(jnp.float32)


@struct.dataclass
class EvictingLayer:
    """One layer's kept tokens (module docstring).

    tensors      per cached tensor: [B, KH, S, W] in cache.dtype, or a QuantizedTensor
                 whose payload, scales and zeros have S rows (token axis); a pooled
                 layer stores [B, 1, K x budget, W]. A settling policy (residual or
                 per-channel scales): QuantizedTensors of S x g payload rows (slot j:
                 rows j*g .. j*g + g-1, and scale row j on the channel axis) and a
                 full-precision ring [B, K, W, Wd] (slot = position mod W)
    positions    int32[B, E, S] position of each slot's token (pooled: position * K
                 + head; settling: the first position of the slot's group), -1 =
                 empty; None for a ring
    scores       float32[B, E, S] h2o's accumulated attention; None otherwise
    policy       static Policy
    ring_scores  float32[B, K, W] settling h2o: the attention each ring slot's token
                 has accumulated while unsettled; None otherwise
    """

    tensors: tuple
    positions: Array | None
    scores: Array | None
    policy: Policy = struct.field(pytree_node=False)
    ring_scores: Array | None = None

    @property
    def capacity(self) -> int:
        return self.policy.max_len

    @property
    def slots(self) -> int:
        return self.policy.slots

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        if self.policy.pooled:  # the pool stands for K heads
            return tuple((self.policy.kv_heads, _width(t)) for t in self.tensors)
        return tuple((_heads(t), _width(t)) for t in self.tensors)

    def stored(self, lengths: Int[Array, " B"]) -> Int[Array, "B K"]:
        """Tokens each KV head of each row holds (K = 1 for a latent)."""
        return stored_tokens(self.positions, self.policy, lengths)

    def observe(self, placement: Placement) -> Float[Array, "B T"] | None:
        """Weights of the queries whose attention scores this step's tokens."""
        return observed_queries(self.policy, placement)

    # -- read

    def read(self, fresh: tuple, placement: Placement):
        """The kept tokens and the step's new ones as the layer holds them, masked."""
        p = self.policy
        if p.settles:
            return self._read_settling(fresh, placement)
        pending = tuple(_pending(x, t) for x, t in zip(fresh, self.tensors, strict=True))
        fresh = tuple(_as_stored(x, t) for x, t in zip(pending, self.tensors, strict=True))
        stored = tuple(_block(t) for t in self.tensors)
        q_positions = placement.positions[:, :, None]  # [B, T, 1]
        if p.ring:
            held = ring_positions(placement.lengths, p)[:, None, :]  # [B, 1, S]
            stored_mask = banded(q_positions, held, p.sinks, p.span)  # [B, T, S]
            fresh_mask = placement.fresh_mask & banded(
                q_positions, placement.positions[:, None, :], p.sinks, p.span
            )
            return [(stored, stored_mask), (fresh, fresh_mask)], pending
        held = self.positions >= 0  # [B, E, S]
        if not p.pooled:
            return [(stored, held[:, :, None, None, :]), (fresh, placement.fresh_mask)], pending
        # One pool: query head n reads the slots of KV head n // G.
        blocks = [(stored, self._pool_mask(held, 1)), self._pooled(fresh, placement.fresh_mask)]
        return blocks, self._pool_tensors(pending)

    def _read_settling(self, fresh: tuple, placement: Placement):
        """QuantizedLayer.read's blocks (payload, ring, fresh, settling groups, each
        masked by the settled(p + 1) rule) with the payload holding each head's kept
        groups; `pending` is the step's quant.Flush."""
        p = self.policy
        band = None
        if p.windowed:
            band = lambda q, k: banded(q, k, p.sinks, p.span)  # noqa: E731
        blocks, flush = QuantizedLayer(self.tensors, p.layout).read(fresh, placement, band)
        readers = blocks[0][0]
        held = self.positions >= 0  # [B, E, S]
        if not p.pooled:
            rows = jnp.repeat(held, p.granularity, axis=-1)[:, :, None, None, :]  # [B, E, 1, 1, Sg]
            if band is not None:  # row i of a slot holds its group's first position + i
                first = jnp.repeat(self.positions, p.granularity, axis=-1)
                offset = jnp.tile(jnp.arange(p.granularity), p.slots)
                q = placement.positions[:, None, :, None, None]  # [B, 1, T, 1, 1]
                rows = rows & band(q, (first + offset)[:, :, None, None, :])
            return [(readers, rows), *blocks[1:]], flush
        pooled = [self._pooled(values, mask) for values, mask in blocks[1:]]
        return [(readers, self._pool_mask(held, p.granularity)), *pooled], flush

    def _pool_mask(self, held: Array, rows: int) -> Array:
        """A pool's mask [B, 1, 1, N, S x rows]: query head n reads KV head n // G's slots."""
        p = self.policy
        group = jnp.arange(p.query_heads) // (p.query_heads // p.kv_heads)  # [N]
        owner = jnp.repeat(self.positions % p.kv_heads, rows, axis=-1)
        held = jnp.repeat(held, rows, axis=-1)
        return held[:, :, None, None, :] & (owner[:, :, None, None, :] == group[:, None])

    def _pool_tensors(self, xs: tuple) -> tuple:
        """Per-head arrays [B, K, X, .] as one pooled head [B, 1, K x X, .]."""
        return tuple(None if x is None else rearrange(x, "B K X W -> B 1 (K X) W") for x in xs)

    def _pooled(self, values: tuple, mask: Array):
        """A per-head block (values [B, K, X, W], mask [B, T, X]) as one pooled head
        read by each query head where its KV head's tokens are: mask [B, 1, T, N, K x X]."""
        p = self.policy
        group = jnp.arange(p.query_heads) // (p.query_heads // p.kv_heads)  # [N]
        mine = jnp.arange(p.kv_heads)[None, :] == group[:, None]  # [N, K]
        pooled = mask[:, None, :, None, None, :] & mine[None, None, None, :, :, None]
        return self._pool_tensors(values), pooled.reshape(*pooled.shape[:4], -1)

    # -- write

    def write(self, pending, placement: Placement, mass=None) -> EvictingLayer:
        """Stores the step's tokens: in their ring slots, or in the slots of the
        stored tokens they outscore. `mass`: attention's per-block mass
        ([B, K', S] and [B, K', T']) when `observe` asked for it."""
        if self.policy.settles:
            return self._write_settling(pending, placement, mass)
        slots, positions, scores = self.destinations(pending, placement, mass)
        tensors = tuple(_put(t, x, slots) for t, x in zip(self.tensors, pending, strict=True))
        return EvictingLayer(tensors, positions, scores, self.policy)

    def destinations(self, pending: tuple, placement: Placement, mass=None):
        """Where the step's tokens go: (slots [B, T] for a ring, else per storage
        head [B, E, T'], S where a token is not stored; the new positions and scores)."""
        p = self.policy
        if p.ring:
            return self._ring_slots(placement), None, None
        tags, candidates = self._candidates(placement)  # [B, E, T'], [B, E, C]
        valid = candidates >= 0
        score = self._score(pending, placement, candidates, valid, mass)
        end = (placement.lengths + placement.num_tokens)[:, None, None]
        return self._keep(tags, candidates, score, end)

    def _keep(self, tags: Array, candidates: Array, score: Array, end: Array, span: int = 1):
        """The competition for the S slots of each head: candidates [B, E, C] (stored
        slots first, then the new `tags` [B, E, C - S]) of `span` positions each.
        Returns the new candidates' slots [B, E, C - S] (S: not stored), the
        positions and (h2o) the scores the slots then hold."""
        p = self.policy
        slots = self.positions.shape[2]
        valid = candidates >= 0
        position = candidates // p.kv_heads if p.pooled else candidates
        priority = jnp.where(valid, score, -jnp.inf)
        if p.floor:
            priority = jnp.where(self._floor(score, candidates, valid), FLOOR, priority)
        if p.recent:
            # a candidate holding any of the `recent` latest positions stays
            recent = position + (span - 1) >= end - p.recent
            priority = jnp.where(valid & recent, KEPT, priority)
        # The S best stay: the (count - S) lowest go, at most one per new candidate,
        # so a top-k of T' (not S) finds them; among equals the later candidate goes.
        width = candidates.shape[2] - slots  # T'
        drop = jnp.maximum(valid.sum(-1, keepdims=True) - slots, 0)  # [B, E, 1]
        lowest = jnp.where(valid, -priority, -jnp.inf)[..., ::-1]
        _, worst = jax.lax.top_k(lowest, width)
        worst = candidates.shape[2] - 1 - worst  # [B, E, T'], lowest priority first
        b = jnp.arange(worst.shape[0])[:, None, None]
        e = jnp.arange(worst.shape[1])[None, :, None]
        dropped = jnp.zeros(candidates.shape, bool).at[b, e, worst].set(jnp.arange(width) < drop)
        keep = valid & ~dropped
        kept_stored, kept_new = keep[..., :slots], keep[..., slots:]
        # New tokens that stay take the free slots (emptied or lost), lowest first:
        # the r-th kept new token, the slot where the free count reaches r.
        free = jnp.cumsum(~kept_stored, axis=-1)  # [B, E, S]
        rank = jnp.cumsum(kept_new, axis=-1)  # [B, E, T'], from 1
        find = jax.vmap(jax.vmap(lambda f, r: jnp.searchsorted(f, r, side="left")))
        dest = jnp.where(kept_new, find(free, rank), slots)
        positions = jnp.where(kept_stored, self.positions, -1)
        positions = positions.at[b, e, dest].set(tags, mode="drop")
        scores = self.scores
        if scores is not None:  # h2o: the attention each kept token has received
            scores = jnp.where(kept_stored, score[..., :slots], 0.0)
            scores = scores.at[b, e, dest].set(score[..., slots:], mode="drop")
        return dest, positions, scores

    def _ring_slots(self, placement: Placement) -> Array:
        p = self.policy
        positions = placement.positions
        end = (placement.lengths + placement.num_tokens)[:, None]
        real = jnp.arange(positions.shape[1])[None, :] < placement.num_tokens[:, None]
        # A new token another new token of the step overwrites is not written.
        lives = real & ((positions < p.sinks) | (positions >= end - p.span))
        slot = jnp.where(positions < p.sinks, positions, p.sinks + (positions - p.sinks) % p.span)
        return jnp.where(lives, slot, p.slots)

    def _candidates(self, placement: Placement):
        """Tags of the step's tokens [B, E, T'] and of every candidate [B, E, S + T']
        (stored slots first); -1 for empty slots and padding."""
        length = placement.positions.shape[1]
        real = jnp.arange(length)[None, :] < placement.num_tokens[:, None]
        return self._tagged(jnp.where(real, placement.positions, -1))  # [B, T]

    def _tagged(self, new: Array):
        """New positions [B, T] (-1: none) as tags per storage head [B, E, T'] and
        every candidate's [B, E, S + T'] (pooled: position * K + head, head-major)."""
        p = self.policy
        if p.pooled:
            kv = jnp.arange(p.kv_heads)[None, :, None]
            tags = jnp.where(new[:, None, :] >= 0, new[:, None, :] * p.kv_heads + kv, -1)
            tags = tags.reshape(new.shape[0], 1, -1)  # [B, 1, K x T], head-major
        else:
            tags = jnp.broadcast_to(
                new[:, None, :], (new.shape[0], self.positions.shape[1], new.shape[1])
            )
        return tags, jnp.concatenate([self.positions, tags], axis=2)

    def _score(self, pending, placement, candidates, valid, mass) -> Array:
        """float32[B, E, C]: the scorer's score of each candidate token."""
        p = self.policy
        heads = candidates.shape[1]
        per_head = None
        if mass is not None:  # mean over the query heads of each storage head
            per_head = jnp.concatenate(
                [m.reshape(m.shape[0], heads, -1, m.shape[-1]).mean(2) for m in mass], axis=2
            )[..., None]

        def keys():  # the first cached tensor's, stored and new, as stored
            stored = _stored_values(self.tensors[0])
            new = _as_stored(pending[0], self.tensors[0]).astype(jnp.float32)
            if p.pooled:
                (new,) = self._pool_tensors((new,))
            return jnp.concatenate([stored, new], axis=2)[:, :, :, None]

        return p.scorer.score(self._candidates_of(candidates, valid, 1, per_head, keys))

    def _candidates_of(self, tags, valid, group: int, mass, keys) -> Candidates:
        """What the scorer reads of candidates `tags` [B, E, C] (module docstring)."""
        p = self.policy
        if p.pooled:
            positions, heads = tags // p.kv_heads, tags % p.kv_heads
        else:
            positions = tags
            heads = jnp.broadcast_to(jnp.arange(tags.shape[1])[None, :, None], tags.shape)
        return Candidates(
            tags=tags,
            valid=valid,
            positions=jnp.where(valid, positions, -1),
            heads=heads,
            held=self.positions.shape[2],
            group=group,
            mass=mass,
            state=self.scores,
            keys=keys,
            kernel=p.kernel,
            seed=p.seed,
            layer=p.layer,
            kv_heads=p.kv_heads,
        )

    def _floor(self, score, candidates, valid) -> Array:
        """adakv: each head's `floor` best candidates (bool[B, 1, C])."""
        p = self.policy
        owner = candidates % p.kv_heads  # [B, 1, C]
        kv = jnp.arange(p.kv_heads)[None, :, None]
        per_head = jnp.where(valid & (owner == kv), score, -jnp.inf)  # [B, K, C]
        threshold = jax.lax.top_k(per_head, p.floor)[0][..., -1:]  # [B, K, 1]
        chosen = (per_head >= threshold) & (per_head > -jnp.inf)
        return jnp.any(chosen, axis=1, keepdims=True)

    # -- settling: tokens wait in the ring and compete as whole settled groups

    def _write_settling(
        self, flush, placement: Placement, mass=None, tensors=None, put=None
    ) -> EvictingLayer:
        """The step's settling groups compete with the kept ones for the S group
        slots of each head (quantized as QuantizedLayer stores them); the tokens
        still unsettled go to the ring. The groups are written into `tensors`
        (default the layer's own) by `put(array, new, slots)` (default
        write_tokens; page pools: write_pages)."""
        p = self.policy
        tensors = self.tensors if tensors is None else tensors
        put = put or (lambda array, new, slots: write_tokens(array, new, slots, axis=2))
        g, layout = p.granularity, p.layout
        first = flush.positions[:, ::g]  # [B, F] each settling group's first position, -1 none
        tags, candidates = self._tagged(first)  # [B, E, F'], [B, E, S + F']
        valid = candidates >= 0
        settling_mass, ring_scores = None, None
        if mass is not None:
            settling_mass, ring_scores = self._unsettled_mass(flush, placement, mass)
        score = self._group_score(flush, candidates, valid, mass, settling_mass)
        end = (placement.lengths + placement.num_tokens)[:, None, None]
        dest, positions, scores = self._keep(tags, candidates, score, end, span=g)
        # Slot j of a head holds rows j*g .. j*g + g-1 (S x g: dropped).
        rows = (dest[..., None] * g + jnp.arange(g)).reshape(*dest.shape[:2], -1)
        pool = self._pool_tensors if p.pooled else (lambda xs: xs)
        written = []
        for tensor, new, payload, scale, zero in zip(
            tensors, flush.fresh, flush.payloads, flush.scales, flush.zeros, strict=True
        ):
            payload, scale, zero = pool((payload, scale, zero))
            stored = tensor.replace(
                payload=put(tensor.payload, payload, rows),
                ring=write_ring(tensor.ring, new, layout, placement),
            )
            if tensor.spec.quantized:  # channel axis: one scale row per slot
                scale_slots = rows if tensor.spec.axis == "token" else dest
                stored = stored.replace(
                    scale=put(tensor.scale, scale, scale_slots),
                    zero=None if zero is None else put(tensor.zero, zero, scale_slots),
                )
            written.append(stored)
        return EvictingLayer(tuple(written), positions, scores, p, ring_scores)

    def _per_kv_head(self, m: Array) -> Array:
        """A per-head block's mass [B, K', X] (pooled: [B, 1, K x X]) as [B, K, X]."""
        p = self.policy
        if p.pooled:
            return m.reshape(m.shape[0], p.kv_heads, -1)
        return m.reshape(m.shape[0], p.kv_heads, -1, m.shape[-1]).mean(2)

    def _unsettled_mass(self, flush, placement: Placement, mass):
        """(float32[B, K, F x g] the attention each settling token received, h2o:
        over its whole stay in the ring; h2o's ring scores after the step or None).

        A token's mass this step comes from up to three blocks (the ring, the
        fresh tokens, the settling groups: which one a query reads it through
        depends on the query's position); they are added by position, over the
        window [settled(length), settled(length) + W + T) of unsettled tokens."""
        p = self.policy
        layout = p.layout
        width = layout.ring_len
        lengths = placement.lengths
        before = layout.settled(lengths)[:, None]  # [B, 1]
        end = (lengths + placement.num_tokens)[:, None]
        window = width + placement.positions.shape[1]
        ring_mass, fresh_mass, settling_mass = (self._per_kv_head(m) for m in mass[1:])
        slots = jnp.arange(width)
        held = lengths[:, None] - 1 - (lengths[:, None] - 1 - slots) % width  # [B, W]
        if self.ring_scores is not None:
            ring_mass = ring_mass + self.ring_scores
        real = jnp.arange(placement.positions.shape[1])[None, :] < placement.num_tokens[:, None]
        offset = lambda position, ok: jnp.where(ok, position - before, window)  # noqa: E731
        settling = offset(flush.positions, flush.positions >= 0)  # [B, F x g]
        total = jnp.zeros((*ring_mass.shape[:2], window), jnp.float32)  # [B, K, W + T]
        for where, value in (
            (offset(held, held >= before), ring_mass),
            (offset(placement.positions, real), fresh_mass),
            (settling, settling_mass),
        ):
            total = jax.vmap(lambda t, i, v: t.at[:, i].add(v, mode="drop"))(total, where, value)
        read = lambda i: jnp.take_along_axis(total, jnp.minimum(i, window - 1)[:, None], axis=-1)  # noqa: E731
        tokens = jnp.where(settling[:, None] < window, read(settling), 0.0)
        ring_scores = None
        if self.ring_scores is not None:
            now = end - 1 - (end - 1 - slots) % width  # the position each slot holds after
            stays = now >= layout.settled(end)
            ring_scores = jnp.where(stays[:, None], read(offset(now, stays)), 0.0)
        return tokens, ring_scores

    def _group_score(self, flush, candidates, valid, mass, settling_mass) -> Array:
        """float32[B, E, C]: how much each kept and settling group deserves to stay."""
        p = self.policy
        if p.windowed:  # the sinks' groups and the newest ones stay
            return jnp.where(candidates < p.sinks, KEPT, candidates.astype(jnp.float32))
        g = p.granularity
        batch, heads = candidates.shape[:2]
        groups = lambda x: x.reshape(*x.shape[:2], -1, g, *x.shape[3:])  # noqa: E731  [.., X g, ..]
        per_storage = lambda x: x.reshape(batch, heads, -1, *x.shape[3:])  # noqa: E731  head-major
        per_token = None
        if mass is not None:  # the payload's groups, then the settling ones
            m = mass[0]
            stored = groups(m.reshape(batch, heads, -1, m.shape[-1]).mean(2))
            per_token = jnp.concatenate([stored, per_storage(groups(settling_mass))], axis=2)

        def keys():  # the first cached tensor's groups, kept and settling, as stored
            key = self.tensors[0]
            settled = flush.payloads[0].astype(jnp.float32)
            if key.spec.quantized:
                settled = dequantize_tokens(
                    flush.payloads[0], flush.scales[0], flush.zeros[0], key.spec
                )
            stored = groups(_stored_values(key))
            return jnp.concatenate([stored, per_storage(groups(settled))], axis=2)

        return p.scorer.score(self._candidates_of(candidates, valid, g, per_token, keys))


_POOLED = ("payload", "scale", "zero")  # the QuantizedTensor arrays that page


def _entries(array: Array, rows: int, page: int) -> int:
    """Entries of a row's `rows` token rows in a pool array holding array.shape[2]
    per page of `page` rows (per-channel scales: one per group of tokens)."""
    return rows * array.shape[2] // page


def _gather(pool, pages: Array, rows: int, page: int):
    """A pool's dense view [B, KH, rows, X] (a quantized tensor's arrays alike; its
    ring stays per row)."""
    if not isinstance(pool, QuantizedTensor):
        return gather_pages(pool, pages, rows)
    views = {
        name: None
        if getattr(pool, name) is None
        else gather_pages(getattr(pool, name), pages, _entries(getattr(pool, name), rows, page))
        for name in _POOLED
    }
    return pool.replace(**views)


def _put_pages(pool, new: Array, slots: Array, pages: Array, size: int):
    """`new` [B, KH, T, W] written at the rows' slots, in their pages."""
    if not isinstance(pool, QuantizedTensor):
        return write_pages(pool, new, slots, pages, size)
    if not pool.spec.quantized:
        return pool.replace(payload=write_pages(pool.payload, new, slots, pages, size))
    payload, scale, zero = quantize_tokens(new, pool.spec)
    return pool.replace(
        payload=write_pages(pool.payload, payload, slots, pages, size),
        scale=write_pages(pool.scale, scale, slots, pages, size),
        zero=None if zero is None else write_pages(pool.zero, zero, slots, pages, size),
    )


@struct.dataclass
class PagedEvictingLayer:
    """An evicting layer whose slots live in page pools (row r of a row's slots:
    entry r mod L of page block_tables[b, r div L]); positions and scores stay
    per row.

    pools        per cached tensor: [KH, P, L, W] in cache.dtype, or a QuantizedTensor
                 whose payload, scale and zero are such pools (per-channel scales:
                 L / g entries per page); a settling policy's ring stays per row
    positions, scores, policy, ring_scores: as EvictingLayer's
    """

    pools: tuple
    positions: Array | None
    scores: Array | None
    policy: Policy = struct.field(pytree_node=False)
    ring_scores: Array | None = None

    @property
    def capacity(self) -> int:
        return self.policy.max_len

    @property
    def _page(self) -> int:
        return jax.tree.leaves(self.pools)[0].shape[2]  # payloads come first

    def view(self, pages: Array) -> EvictingLayer:
        """The rows' slots gathered from their pages, as a dense evicting layer."""
        p = self.policy
        tensors = tuple(_gather(pool, pages, p.rows, self._page) for pool in self.pools)
        return EvictingLayer(tensors, self.positions, self.scores, p, self.ring_scores)

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        pool_heads = lambda t: (t.payload if isinstance(t, QuantizedTensor) else t).shape[0]  # noqa: E731
        heads = lambda t: self.policy.kv_heads if self.policy.pooled else pool_heads(t)  # noqa: E731
        return tuple((heads(t), _width(t)) for t in self.pools)

    def stored(self, lengths: Int[Array, " B"]) -> Int[Array, "B K"]:
        return stored_tokens(self.positions, self.policy, lengths)

    def observe(self, placement: Placement) -> Float[Array, "B T"] | None:
        return observed_queries(self.policy, placement)

    def read(self, fresh: tuple, placement: Placement):
        return self.view(placement.pages).read(fresh, placement)

    def write(self, pending: tuple, placement: Placement, mass=None) -> PagedEvictingLayer:
        p, pages = self.policy, placement.pages
        view = self.view(pages)  # knorm reads the stored keys
        if p.settles:

            def put(array, new, slots):
                size = _entries(array, p.rows, self._page)
                return write_pages(array, new, slots, pages, size)

            layer = view._write_settling(pending, placement, mass, self.pools, put)
            return PagedEvictingLayer(
                layer.tensors, layer.positions, layer.scores, p, layer.ring_scores
            )
        slots, positions, scores = view.destinations(pending, placement, mass)
        pools = tuple(
            _put_pages(pool, x, slots, pages, p.slots)
            for pool, x in zip(self.pools, pending, strict=True)
        )
        return PagedEvictingLayer(pools, positions, scores, p)


def _metadata(policy: Policy, batch: int):
    if policy.ring:
        return None, None
    shape = (batch, storage_heads(policy), policy.slots)
    scores = jnp.zeros(shape, jnp.float32) if policy.keeps else None
    return jnp.full(shape, -1, jnp.int32), scores


def _ring_scores(policy: Policy, batch: int) -> Array | None:
    if not (policy.settles and policy.keeps):
        return None
    return jnp.zeros((batch, policy.kv_heads, policy.layout.ring_len), jnp.float32)


def init_layer(policy: Policy, tensors: tuple, batch: int) -> EvictingLayer:
    """An empty layer around `tensors` (each with policy.slots rows, zeroed; settling:
    QuantizedTensors of slots x g rows and a ring of policy.layout.ring_len)."""
    return EvictingLayer(tensors, *_metadata(policy, batch), policy, _ring_scores(policy, batch))


def init_paged_layer(policy: Policy, pools: tuple, batch: int) -> PagedEvictingLayer:
    """An empty paged layer around zeroed `pools`."""
    return PagedEvictingLayer(pools, *_metadata(policy, batch), policy, _ring_scores(policy, batch))


def reset_rows(layer, starting: Array, lengths: Array):
    """The layer with rows `starting` (bool[B]) holding their first lengths[b]
    tokens in slot order (a request starting there on matched prefix pages) and
    nothing else: slot j holds position j (settling: group j, first position j x g)
    or nothing (-1), scores 0. Other layers pass through."""
    if getattr(layer, "positions", None) is None:
        return layer
    first = jnp.arange(layer.positions.shape[2]) * layer.policy.granularity  # slot j: group j
    fresh = jnp.where(first[None, :] < lengths[:, None], first[None, :], -1)[:, None, :]
    positions = jnp.where(starting[:, None, None], fresh, layer.positions)
    scores = layer.scores
    if scores is not None:
        scores = jnp.where(starting[:, None, None], 0.0, scores)
    layer = layer.replace(positions=positions, scores=scores)
    if getattr(layer, "ring_scores", None) is not None:
        ring_scores = jnp.where(starting[:, None, None], 0.0, layer.ring_scores)
        layer = layer.replace(ring_scores=ring_scores)
    return layer


def copy_pages(layer, sources: Array, targets: Array):
    """A paged evicting layer with pages `sources` copied into `targets`
    (int32[C]; -1 targets copy nothing). Other layers pass through."""
    if not isinstance(layer, PagedEvictingLayer):
        return layer
    num_pages = jax.tree.leaves(layer.pools)[0].shape[1]
    targets = jnp.where(targets < 0, num_pages, targets)  # dropped
    sources = jnp.clip(sources, 0, num_pages - 1)
    copy = lambda pool: pool.at[:, targets].set(pool[:, sources], mode="drop")  # noqa: E731

    def copied(pool):
        if not isinstance(pool, QuantizedTensor):
            return copy(pool)
        arrays = {name: getattr(pool, name) for name in _POOLED}  # not the per-row ring
        return pool.replace(**{k: None if a is None else copy(a) for k, a in arrays.items()})

    return layer.replace(pools=tuple(copied(pool) for pool in layer.pools))
