"""Evicting layers: cache layers that keep a budget of tokens and drop the rest.

A layer of an evicting cache (`cache.evict.method` other than 'none', or a
model with `model.sliding_window`) stores `budget` slots per KV head instead of
the row's whole length; tokens it evicts are gone, so `cache_bytes` counts
only the slots (docs/caches.md, "Evicting caches"). Keys are stored after
RoPE, so a kept token keeps its position; `Cache.lengths` stays the number of
tokens a row has seen (the next position), and `EvictingLayer.stored()` the
number each head holds. What a layer keeps is its static Policy (policy.py);
paged.py's PagedEvictingLayer keeps the same slots in page pools.

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
pairs of the layer are kept, each head at least `adakv_floor` x budget (its
`recent` tokens counting towards it, so the floor is always honoured). The
pool costs exactly what K heads of `budget` slots cost; every query head
reads the pool masked to its own KV head's slots (the stored arrays come as
`Pooled`, so a backend may read each slot with its own head's queries alone).

Quantized tensors (cache.<prefix>_axis='token', residual 0) are stored per
slot as codes and per-token scales, quantized as they are stored; a step's
tokens are seen quantized, as the quantized cache sees them. With a residual
window or per-channel scales (KIVI, arXiv:2402.02750) a scored layer keeps the
quantized layout (quant.Layout, g tokens per group): the unsettled tokens wait
in a full-precision ring [B, K, W, Wd] (slot = position mod W) and are never
evicted; tokens settle a group at a time when QuantizedLayer would flush them,
are quantized then, and compete as whole groups for S group slots per storage
head, the most for which the groups and the fullest ring never hold more than
the budget (policy.settled_slots; positions: each group's first position).
Reads are QuantizedLayer.read's with the payload masked per head.
A window (window, sinks, model.sliding_window) over such storage stores
positions too: its band masks every block, and the sinks' groups and the newest
ones that cover every query's band stay (window_groups).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import struct
from jaxtyping import Array, Float, Int

from kvlab import backends
from kvlab.cache.evict.buffer import QueryBuffer, empty_buffer
from kvlab.cache.evict.policy import (
    Policy,
    banded,
    due,
    empty_ring_scores,
    empty_since,
    empty_slots,
    empty_weights,
    observed_queries,
    overflows,
    ring_positions,
    steps_since,
    stored_tokens,
)
from kvlab.cache.evict.scorers import Candidates, Channels, running_count
from kvlab.cache.evict.stored import (
    PrunedKeys,
    as_pending,
    as_read,
    as_stored,
    put_tokens,
    reader_of,
    stored_values,
    tensor_heads,
    tensor_width,
)
from kvlab.cache.placement import Placement, stored_end, write_tokens
from kvlab.cache.protocols import Pooled
from kvlab.cache.quant import PayloadReader, QuantizedLayer, dequantize_tokens, write_ring

KEPT = 3.0e38  # priority of a token that must stay (recent); scores stay far below
FLOOR = 1.0e38  # adakv: a head's best `floor` tokens


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
    since        int32[B] cache.evict.when='decoding': decode steps since each row
                 last compressed (Policy.decodes); None otherwise
    buffer       a decoding layer's queries of the decode steps since each row last
                 compressed (buffer.QueryBuffer, Policy.buffers); None otherwise
    weights      float32[B, E, S] each slot's token's weight (Scorer.weigh, weighed
                 as it arrived: CriticalKV's value norm; NaN: unknown, weighed when
                 next scored) where Policy.weighs; None otherwise
    """

    tensors: tuple
    positions: Array | None
    scores: Array | None
    policy: Policy = struct.field(pytree_node=False)
    ring_scores: Array | None = None
    since: Array | None = None
    buffer: QueryBuffer | None = None
    weights: Array | None = None

    @property
    def capacity(self) -> int:
        return self.policy.max_len

    @property
    def slots(self) -> int:
        return self.policy.slots

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        if self.policy.pooled:  # the pool stands for K heads
            return tuple((self.policy.kv_heads, tensor_width(t)) for t in self.tensors)
        return tuple((tensor_heads(t), tensor_width(t)) for t in self.tensors)

    def stored(self, lengths: Int[Array, " B"]) -> Int[Array, "B K"]:
        """Tokens each KV head of each row holds (K = 1 for a latent)."""
        return stored_tokens(self.positions, self.policy, lengths)

    def observe(self, placement: Placement) -> Float[Array, "B T"] | None:
        """Weights of the queries whose attention scores this step's tokens."""
        return observed_queries(self.policy, placement)

    def competes(self, placement: Placement) -> Array | None:
        """bool[]: whether this step's write scores its candidates (some head of
        some row then has more than its slots), so attention computes the mass
        only then; None where every step computes it (policy.overflows)."""
        return overflows(self.positions, self.policy, placement, self.since)

    # -- read

    def read(self, fresh: tuple, placement: Placement):
        """The kept tokens and the step's new ones as the layer holds them, masked."""
        p = self.policy
        if p.settles:
            return self._read_settling(fresh, placement)
        pending = tuple(as_pending(x, t) for x, t in zip(fresh, self.tensors, strict=True))
        fresh = tuple(
            as_read(x, t, placement.lengths) for x, t in zip(pending, self.tensors, strict=True)
        )
        stored = tuple(reader_of(t) for t in self.tensors)
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
        # One pool: query head n reads the slots of KV head n // G. Arrays come as
        # Pooled, masked by their owners only where they are read so; readers
        # under the layer's mask.
        if all(isinstance(x, jax.Array) for x in stored):
            tags = self.positions[:, 0]  # [B, S]
            stored_block = (tuple(Pooled(x, tags, p.kv_heads) for x in stored), None)
        else:
            stored_block = (stored, self._pool_mask(held, 1))
        blocks = [stored_block, self._pooled(fresh, placement.fresh_mask)]
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
        """Per-head arrays [B, K, X, .] as one pooled head [B, 1, K x X, .] (a payload's
        reader: its arrays pooled)."""

        def pool(x):
            if isinstance(x, PayloadReader):
                t = x.tensor
                return PayloadReader(
                    t.replace(payload=pool(t.payload), scale=pool(t.scale), zero=pool(t.zero))
                )
            return None if x is None else rearrange(x, "B K X W -> B 1 (K X) W")

        return tuple(pool(x) for x in xs)

    def _pooled(self, values: tuple, mask: Array):
        """A per-head block (values [B, K, X, W], mask [B, T, X]) as one pooled head
        read by each query head where its KV head's tokens are: mask [B, 1, T, N, K x X]."""
        p = self.policy
        group = jnp.arange(p.query_heads) // (p.query_heads // p.kv_heads)  # [N]
        mine = jnp.arange(p.kv_heads)[None, :] == group[:, None]  # [N, K]
        pooled = mask[:, None, :, None, None, :] & mine[None, None, None, :, :, None]
        return self._pool_tensors(values), pooled.reshape(*pooled.shape[:4], -1)

    # -- write

    def write(self, pending, placement: Placement, mass=None, queries=None) -> EvictingLayer:
        """Stores the step's tokens: in their ring slots, or in the slots of the
        stored tokens they outscore. `mass`: attention's per-block mass
        ([B, K', S] and [B, K', T']) when `observe` asked for it; `queries`:
        the observed queries and their weights (Candidates.queries), or None."""
        if self.policy.settles:
            return self.write_settling(pending, placement, mass, queries=queries)
        slots, positions, scores, weights = self.destinations(pending, placement, mass, queries)
        tensors = self.with_channels(pending, placement, slots, queries)
        tensors = tuple(put_tokens(t, x, slots) for t, x in zip(tensors, pending, strict=True))
        return EvictingLayer(
            tensors,
            positions,
            scores,
            self.policy,
            since=self.counted(placement),
            buffer=self.buffered(placement, queries),
            weights=weights,
        )

    def counted(self, placement: Placement) -> Array | None:
        """A decoding layer's `since` after this step (policy.steps_since); None
        for other policies."""
        if not self.policy.decodes:
            return None
        return steps_since(self.since, self._due(placement), placement)

    def buffered(self, placement: Placement, queries) -> QueryBuffer | None:
        """A decoding layer's buffer after this step: the step's decode queries
        appended, emptied in the rows it compressed; None without one."""
        if self.buffer is None:
            return None
        return self._joined(placement, queries).emptied(self._due(placement))

    def _joined(self, placement: Placement, queries) -> QueryBuffer:
        """The buffer with the step's decode queries (`queries`, Observed) appended."""
        if queries is None:
            raise ValueError(
                f"cache.evict.method={self.policy.method!r} scores a decoding layer's "
                "compressions by its buffered queries, and this attention offered none"
            )
        return self.buffer.appended(queries, placement)

    def _due(self, placement: Placement) -> Array:
        """bool[B]: the rows a decoding layer compresses in this step (policy.due)."""
        return due(self.since, self.positions, self.policy, placement)

    def with_channels(self, pending: tuple, placement: Placement, slots: Array, queries):
        """The stored tensors, pruned keys (policy.key_channels) with the channels
        of the rows in their first write chosen (Scorer.choose_channels) from the
        step's keys those rows keep (`slots` [B, K, T], S: not stored)."""
        keys = self.tensors[0]
        if not isinstance(keys, PrunedKeys):
            return self.tensors
        p = self.policy
        if queries is None:
            raise ValueError(
                f"cache.evict.method={p.method!r} chooses key channels from the step's "
                "queries, and this attention offered none"
            )
        c = Channels(
            keys=pending[0].astype(jnp.float32),
            kept=slots < self.positions.shape[2],
            queries=queries.vectors,
            query_positions=queries.positions,
            end=placement.lengths + placement.num_tokens,
            count=p.key_channels,
            width=keys.width,
            options=dict(p.options),
        )
        starting = (placement.lengths == 0) & (placement.num_tokens > 0)
        chosen = jnp.where(starting[:, None, None], p.scorer.choose_channels(c), keys.channels)
        return (keys.replace(channels=chosen), *self.tensors[1:])

    def destinations(self, pending: tuple, placement: Placement, mass=None, queries=None):
        """Where the step's tokens go: (slots [B, T] for a ring, else per storage
        head [B, E, T'], S where a token is not stored; the new positions, scores
        and weights)."""
        p = self.policy
        if p.ring:
            return self._ring_slots(placement), None, None, None
        tags, candidates = self._candidates(placement)  # [B, E, T'], [B, E, C]
        valid = candidates >= 0
        end = self._end(placement)[:, None, None]
        limit = None
        if p.compresses and placement.compress is not None:
            limit = self._limit(placement.compress, placement, end)
        elif p.decodes:
            limit = self._limit(self._due(placement), placement, end)
        weights = known = None
        if p.weighs:  # every step: the new tokens' weights are carried from now on
            weights, known = self._weights(pending, placement, candidates, valid, queries)
        score = lambda w: self._score(  # noqa: E731
            pending, placement, candidates, valid, mass, queries, limit, w
        )
        return self._decide(tags, candidates, score, end, limit=limit, weights=weights, known=known)

    def _limit(self, compress: Array, placement: Placement, end: Array) -> Array:
        """int32[B, 1, 1]: candidates a head keeps at most this step: the target in
        the rows that `compress` (after_prefill: those given compress, of their whole
        context's length where given, Placement.context; decoding: those `due`; a
        pool: its K heads' targets), -1 in the others (the slots, less the
        interval's spare when they overflow)."""
        p = self.policy
        rows = (compress & (placement.num_tokens > 0))[:, None, None]
        if placement.context is not None:
            end = placement.context[:, None, None]
        target = p.target(end) * (p.kv_heads if p.pooled else 1)
        return jnp.where(rows, target, -1)

    def _decide(
        self,
        tags: Array,
        candidates: Array,
        score,
        end: Array,
        span=1,
        limit=None,
        weights=None,
        known=None,
    ):
        """`_keep`, scoring (`score(weights)`: the scores and the priorities they
        rank by) only in a step where some head of some row has
        more candidates than slots, or is compressed (`limit`, `_limit`): otherwise
        the new ones take free slots and nothing is scored or sorted (a scorer that
        `keeps` a state is still scored, to add to it). The choices are the same;
        the fill, cache.evict.interval's steps between compressions and
        after_prefill's steps after its compression cost no top-k. `known()`:
        the candidates' `weights` as a competition reads them (`_weights`),
        computed only in a step that scores."""
        slots = self.positions.shape[2]
        overflow = jnp.any((candidates >= 0).sum(-1) > slots)
        if limit is not None:
            overflow = overflow | jnp.any(limit >= 0)
        if self.policy.keeps:
            if known is not None:  # scored every step
                weights, known = known(), None
            kept_score = score(weights)
            score = lambda _: kept_score  # noqa: E731
            appended = kept_score[0]
        else:
            appended = jnp.zeros(candidates.shape, jnp.float32)

        def competing():
            read = weights if known is None else known()
            return self._keep(tags, candidates, *score(read), end, span, limit=limit, weights=read)

        return jax.lax.cond(
            overflow,
            competing,
            lambda: self._keep(
                tags, candidates, appended, appended, end, span, compete=False, weights=weights
            ),
        )

    def _keep(
        self,
        tags: Array,
        candidates: Array,
        score: Array,
        priority: Array,
        end: Array,
        span: int = 1,
        compete: bool = True,
        limit=None,
        weights=None,
    ):
        """The competition for the S slots of each head: candidates [B, E, C] (stored
        slots first, then the new `tags` [B, E, C - S]) of `span` positions each.
        A head with more candidates than slots drops the lowest down to S minus
        the policy's `spare` (cache.evict.interval), a row with a `limit` (>= 0)
        down to it, the lowest `priority` first; the kept ones carry their `score`
        (a state the scorer keeps) and their `weights` (Policy.weighs). Returns the
        new candidates' slots [B, E, C - S] (S: not stored), the positions, (h2o)
        the scores and the weights the slots then hold.
        compete=False: every candidate fits (nothing dropped)."""
        slots = self.positions.shape[2]
        valid = candidates >= 0
        if compete:
            keep = valid & ~self._dropped(candidates, priority, end, span, limit)
        else:
            keep = valid
        kept_stored, kept_new = keep[..., :slots], keep[..., slots:]
        b = jnp.arange(candidates.shape[0])[:, None, None]
        e = jnp.arange(candidates.shape[1])[None, :, None]
        # New tokens that stay take the free slots (emptied or lost), lowest first:
        # the r-th kept new token the r-th free slot.
        rank = jnp.cumsum(kept_new, axis=-1)  # [B, E, T'], from 1
        dest = jnp.where(kept_new, _free_slots(kept_stored, rank), slots)
        positions = jnp.where(kept_stored, self.positions, -1)
        positions = positions.at[b, e, dest].set(tags, mode="drop")
        scores = self.scores
        if scores is not None:  # h2o: the attention each kept token has received
            scores = jnp.where(kept_stored, score[..., :slots], 0.0)
            scores = scores.at[b, e, dest].set(score[..., slots:], mode="drop")
        held = None
        if weights is not None:
            held = jnp.where(kept_stored, weights[..., :slots], 0.0)
            held = held.at[b, e, dest].set(weights[..., slots:], mode="drop")
        return dest, positions, scores, held

    def _dropped(self, candidates: Array, score: Array, end: Array, span: int, limit=None) -> Array:
        """bool[B, E, C]: the candidates a head drops, the lowest priority first."""
        p = self.policy
        slots = self.positions.shape[2]
        valid = candidates >= 0
        position = candidates // p.kv_heads if p.pooled else candidates
        priority = jnp.where(valid, score, -jnp.inf)
        if p.recent:
            # a candidate holding any of the `recent` latest positions stays
            recent = position + (span - 1) >= end - p.recent
            priority = jnp.where(valid & recent, KEPT, priority)
        # The best stay: a head over its S slots drops its (count - S + spare)
        # lowest, at most T' + spare of them, so a top-k of that width (not S)
        # finds them; among equals the later candidate goes.
        count = valid.sum(-1, keepdims=True)  # [B, E, 1]
        drop = jnp.where(count > slots, count - slots + p.spare, 0)
        width = min(candidates.shape[2], candidates.shape[2] - slots + p.spare)
        if limit is not None:  # a compressed row may drop any of its candidates
            drop = jnp.where(limit >= 0, jnp.maximum(count - limit, 0), drop)
            width = candidates.shape[2]
        lowest = lambda priority: _lowest(valid, priority, drop, width)  # noqa: E731
        if not p.floor:
            return lowest(priority)
        # adakv: each head's `floor` best stay first (its recent tokens count
        # towards it). A head that keeps at least its floor without that keeps
        # those best already (both choices rank by priority, the earlier first
        # among equals), so the floors' top-k runs only where some head does not.
        floors = None
        if limit is not None:  # a compressed row's floor is its target's share
            share = jnp.floor(p.floor_share * (limit // p.kv_heads)).astype(jnp.int32)
            floors = jnp.where(limit >= 0, share, p.floor)
        plain = lowest(priority)

        def floored():
            floor = self._floor(priority, candidates, valid, floors) & (priority < KEPT)
            return lowest(jnp.where(floor, FLOOR, priority))

        short = self._short_of_floor(plain, priority, candidates, valid, floors)
        return jax.lax.cond(short, floored, lambda: plain)

    def _short_of_floor(self, dropped, priority, candidates, valid, floors=None) -> Array:
        """bool[]: whether some head of some row keeps fewer than its floor
        (`_floor`: at most the candidates it ranks, of a priority above -inf)
        when `dropped` [B, 1, C] go."""
        p = self.policy
        mine = (candidates % p.kv_heads) == jnp.arange(p.kv_heads)[None, :, None]  # [B, K, C]
        ranked = valid & (priority > -jnp.inf)
        kept = (ranked & ~dropped & mine).sum(-1)  # [B, K]
        floor = p.floor if floors is None else floors[:, :, 0]  # [B, 1]
        return jnp.any(kept < jnp.minimum(floor, (ranked & mine).sum(-1)))

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
        (stored slots first); -1 for empty slots, padding and probes."""
        length = placement.positions.shape[1]
        real = jnp.arange(length)[None, :] < placement.num_tokens[:, None]
        real = real & (placement.positions < self._end(placement)[:, None])
        return self._tagged(jnp.where(real, placement.positions, -1))  # [B, T]

    def _end(self, placement: Placement) -> Array:
        """int32[B]: each row's length after the step (a probing row's: its context)."""
        context = placement.context if self.policy.probes else None
        return stored_end(placement.lengths, placement.num_tokens, context)

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

    def _score(
        self, pending, placement, candidates, valid, mass, queries, limit=None, weights=None
    ):
        """(scores, priorities) float32[B, E, C]: the scorer's score of each candidate
        token and what the competition ranks it by (`weights`: the candidates'
        carried weights, Policy.weighs)."""
        p = self.policy
        heads = candidates.shape[1]
        per_head = None
        if mass is not None:  # mean over the query heads of each storage head
            per_head = jnp.concatenate(
                [m.reshape(m.shape[0], heads, -1, m.shape[-1]).mean(2) for m in mass], axis=2
            )[..., None]
        c = self._candidates_of(
            candidates,
            valid,
            1,
            per_head,
            *self._readers(pending, placement),
            placement,
            queries,
            limit,
        )
        c = dataclasses.replace(c, weights=weights)
        if self.buffer is not None:
            c = self._with_buffer(c, placement, queries)
        if not p.remembers:
            return _scored(p.scorer, c)
        # A static scorer's: the slots' carried scores, the new tokens' scored now;
        # a row reset_rows started on prefix pages (NaN: unknown) has its slots scored.
        slots = self.positions.shape[2]
        fresh = self._fresh(c, pending, placement)
        unknown = jnp.isnan(self.scores)
        held = jax.lax.cond(
            jnp.any(unknown),
            lambda: jnp.where(unknown, p.scorer.score(c)[..., :slots], self.scores),
            lambda: self.scores,
        )
        score = jnp.concatenate([held, p.scorer.score(fresh)], axis=-1)
        return score, p.scorer.priority(c, score)

    def _readers(self, pending, placement, held: bool = True):
        """(keys, values): functions giving the candidates' keys and values as stored
        [B, E, C, 1, W] (float32), the stored slots' first unless not `held`."""

        def tokens(i):  # cached tensor i's, stored (held) and new, as stored
            new = as_stored(pending[i], self.tensors[i], placement.lengths).astype(jnp.float32)
            if self.policy.pooled:
                (new,) = self._pool_tensors((new,))
            if held:
                new = jnp.concatenate([stored_values(self.tensors[i]), new], axis=2)
            return new[:, :, :, None]

        return lambda: tokens(0), lambda: tokens(self._values_index)

    def _fresh(self, c: Candidates, pending, placement) -> Candidates:
        """`c` narrowed to the step's new candidates (past the stored slots)."""
        slots = self.positions.shape[2]
        keys, values = self._readers(pending, placement, held=False)
        return dataclasses.replace(
            c,
            **{f: getattr(c, f)[..., slots:] for f in ("tags", "valid", "positions", "heads")},
            held=0,
            state=None,
            weights=None if c.weights is None else c.weights[..., slots:],
            keys=keys,
            values=values,
        )

    def _weights(self, pending, placement, candidates, valid, queries):
        """(weights, known): float32[B, E, C], each candidate's weight (Policy.weighs):
        the slots' carried ones, the step's new tokens' weighed now (NaN where the
        attention offered no queries to weigh them by); `known()` the same with
        every candidate of unknown weight (NaN: such a token, or a slot of a row
        reset_rows started on prefix pages) weighed, for a step that scores (None
        without queries). A step that does not score carries the NaNs on."""
        scorer, slots = self.policy.scorer, self.positions.shape[2]
        if queries is None:
            fresh = jnp.full(candidates[..., slots:].shape, jnp.nan, jnp.float32)
            return jnp.concatenate([self.weights, fresh], axis=-1), None
        c = self._candidates_of(
            candidates, valid, 1, None, *self._readers(pending, placement), placement, queries
        )
        fresh = scorer.weigh(self._fresh(c, pending, placement))
        weights = jnp.concatenate([self.weights, fresh], axis=-1)

        def known():
            unknown = jnp.isnan(weights) & valid
            return jax.lax.cond(
                jnp.any(unknown),
                lambda: jnp.where(unknown, scorer.weigh(c), weights),
                lambda: weights,
            )

        return weights, known

    def _with_buffer(self, c: Candidates, placement: Placement, queries) -> Candidates:
        """`c` with a decoding layer's buffered queries of earlier decode steps beside
        the step's own: in the mass (the attention they paid, buffer.QueryBuffer.mass),
        the queries and the count of observed ones."""
        joined = self._joined(placement, queries)
        keys = c.keys()[..., 0, :]  # [B, E, C, W]: tokens one by one
        earlier = joined.mass(keys, c.positions, c.valid, c.heads, placement)
        observed = joined.observed(queries, placement)
        buffered = joined.before(placement).sum(-1).astype(jnp.float32)[:, None, None]
        return dataclasses.replace(
            c,
            mass=None if c.mass is None else c.mass + earlier[..., None],
            queries=observed.vectors,
            query_weights=observed.weights,
            query_positions=observed.positions,
            raw_queries=observed.raw,
            observed=c.observed + buffered,
        )

    @property
    def _values_index(self) -> int:
        """The cached tensor values are read from: the second (a latent model: the latent)."""
        return 0 if self.policy.latent else 1

    def _candidates_of(
        self, tags, valid, group: int, mass, keys, values, placement, queries, limit=None
    ) -> Candidates:
        """What the scorer reads of candidates `tags` [B, E, C] (module docstring)."""
        p = self.policy
        count, slots = valid.sum(-1, keepdims=True), self.positions.shape[2]
        keep = jnp.where(count > slots, slots - p.spare, count)  # what _keep leaves
        if limit is not None:
            keep = jnp.where(limit >= 0, jnp.minimum(count, limit), keep)
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
            queries=None if queries is None else queries.vectors,
            query_weights=None if queries is None else queries.weights,
            query_positions=None if queries is None else queries.positions,
            query_groups=0 if queries is None else queries.groups,
            raw_queries=None if queries is None else queries.raw,
            rotate=None if queries is None else queries.rotate,
            values=values,
            keep=keep,
            output_norms=None if queries is None else queries.output_norms,
            hidden=None if queries is None else queries.hidden,
            key_transform=placement.transforms[0] if placement.transforms else None,
            max_len=p.max_len,
            end=self._end(placement)[:, None, None],
            observed=_observed_count(p, placement),
            recent=p.recent,
            options=dict(p.options),
        )

    def _floor(self, score, candidates, valid, floors=None) -> Array:
        """adakv: each head's `floor` best candidates by `score` (bool[B, 1, C]):
        exactly `floor` of a head that has them (among equals the earlier), so the
        floors of the K heads never claim more than the pool; `floors` int32[B, 1, 1]:
        a row's own floor, at most the policy's."""
        p = self.policy
        owner = candidates % p.kv_heads  # [B, 1, C]
        kv = jnp.arange(p.kv_heads)[None, :, None]
        per_head = jnp.where(valid & (owner == kv), score, -jnp.inf)  # [B, K, C]
        best, chosen = jax.lax.top_k(per_head, p.floor)  # [B, K, floor]
        taken = best > -jnp.inf
        if floors is not None:
            taken = taken & (jnp.arange(p.floor) < floors)
        b = jnp.arange(chosen.shape[0])[:, None, None]
        marked = jnp.zeros(per_head.shape, bool).at[b, kv, chosen].set(taken)
        return jnp.any(marked, axis=1, keepdims=True)

    # -- settling: tokens wait in the ring and compete as whole settled groups

    def write_settling(
        self, flush, placement: Placement, mass=None, tensors=None, put=None, queries=None
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
        settling, ring_scores = None, None
        if self.ring_scores is not None:  # h2o: added to every step
            settling, ring_scores = self._unsettled_mass(flush, placement, mass)

        def score(_):  # other scorers' settling mass only in a step that scores
            unsettled = settling
            if unsettled is None and mass is not None:
                unsettled = self._unsettled_mass(flush, placement, mass)[0]
            return self._group_score(flush, placement, candidates, valid, mass, unsettled, queries)

        end = (placement.lengths + placement.num_tokens)[:, None, None]
        dest, positions, scores, _ = self._decide(tags, candidates, score, end, span=g)
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
            if tensor.spec.quantized and not tensor.spec.calibrated:
                # channel axis: one scale row per slot
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

    def _group_score(self, flush, placement, candidates, valid, mass, settling_mass, queries):
        """(scores, priorities) float32[B, E, C]: how much each kept and settling
        group deserves to stay."""
        p = self.policy
        if p.windowed:  # the sinks' groups and the newest ones stay
            newest = jnp.where(candidates < p.sinks, KEPT, candidates.astype(jnp.float32))
            return newest, newest
        g = p.granularity
        batch, heads = candidates.shape[:2]
        groups = lambda x: x.reshape(*x.shape[:2], -1, g, *x.shape[3:])  # noqa: E731  [.., X g, ..]
        per_storage = lambda x: x.reshape(batch, heads, -1, *x.shape[3:])  # noqa: E731  head-major
        per_token = None
        if mass is not None:  # the payload's groups, then the settling ones
            m = mass[0]
            stored = groups(m.reshape(batch, heads, -1, m.shape[-1]).mean(2))
            per_token = jnp.concatenate([stored, per_storage(groups(settling_mass))], axis=2)

        def tokens(i):  # cached tensor i's groups, kept and settling, as stored
            tensor = self.tensors[i]
            settled = flush.payloads[i].astype(jnp.float32)
            if tensor.spec.quantized:
                settled = dequantize_tokens(
                    flush.payloads[i], flush.scales[i], flush.zeros[i], tensor.spec
                )
            stored = groups(stored_values(tensor))
            return jnp.concatenate([stored, per_storage(groups(settled))], axis=2)

        keys, values = lambda: tokens(0), lambda: tokens(self._values_index)  # noqa: E731
        c = self._candidates_of(candidates, valid, g, per_token, keys, values, placement, queries)
        return _scored(p.scorer, c)


FEW_NEW = 16  # a step of at most this many candidates finds its free slots by a top-k
FEWEST_NEW = 2  # ... and of at most this many by successive minima (a decode step's one)
FREE_BLOCK = 128  # a pool's few new tokens look for free slots in blocks of this many


def _free_slots(kept: Array, rank: Array) -> Array:
    """int32[B, E, T']: the rank[..]-th (from 1) of the slots not `kept` [B, E, S],
    lowest first. A decode step's one or two new tokens a head take the lowest free
    slots by successive minima over the slots' indices (XLA:CPU's top-k of one
    costs two to four of them), a few more by a top-k: in a large pool (AdaKV's K
    new tokens a step) a top-k of the first blocks of FREE_BLOCK slots that have a
    free one, then of their slots (a top-k over all of `mha.py:tiny`'s pool at 8k
    took about 24 us a layer), or the backend's kernel where it has one
    (Backend.top_k_last); a long step's by their running count (a cumulative
    sum over S costs far more than the top-k of a few)."""
    slots, new = kept.shape[-1], rank.shape[-1]
    if new > FEW_NEW:
        free = running_count(~kept)  # [B, E, S]
        find = jax.vmap(jax.vmap(lambda f, r: jnp.searchsorted(f, r, side="left")))
        return find(free, rank)
    order = jnp.where(kept, -jnp.inf, -jnp.arange(slots, dtype=jnp.float32))  # exact: < 2**24
    few = backends.writer().top_k_last(order, min(new, slots)) if new > FEWEST_NEW else None
    if few is not None:  # the backend's kernel (distinct indices: no ties to break)
        lowest = few
    elif new <= FEWEST_NEW:
        index = jnp.arange(slots, dtype=jnp.int32)
        lowest = []
        for _ in range(new):
            lowest.append(jnp.min(jnp.where(kept, slots, index), axis=-1, keepdims=True))
            kept = kept | (index == lowest[-1])
        lowest = jnp.concatenate(lowest, axis=-1)
    elif slots >= 4 * new * FREE_BLOCK:
        # The lowest `new` free slots lie in the first `new` blocks with a free one.
        blocks = -(-slots // FREE_BLOCK)
        padded = jnp.pad(
            kept, [(0, 0), (0, 0), (0, blocks * FREE_BLOCK - slots)], constant_values=True
        )
        padded = padded.reshape(*kept.shape[:2], blocks, FREE_BLOCK)
        order = jnp.arange(blocks, dtype=jnp.float32)
        _, first = jax.lax.top_k(jnp.where(padded.all(-1), -jnp.inf, -order), new)  # [B, E, new]
        taken = jnp.take_along_axis(padded, first[..., None], axis=2).reshape(*first.shape[:2], -1)
        index = (first[..., None] * FREE_BLOCK + jnp.arange(FREE_BLOCK)).reshape(taken.shape)
        _, lowest = jax.lax.top_k(jnp.where(taken, -jnp.inf, -index.astype(jnp.float32)), new)
        lowest = jnp.take_along_axis(index, lowest, -1)
    else:
        _, lowest = jax.lax.top_k(order, min(new, slots))
    return jnp.take_along_axis(lowest, jnp.clip(rank - 1, 0, lowest.shape[-1] - 1), -1)


def _lowest(valid: Array, priority: Array, drop: Array, width: int) -> Array:
    """bool[B, E, C]: each head's `drop` [B, E, 1] lowest valid candidates by
    `priority`, among equals the later first, found among the `width` lowest
    (by the backend's kernel where it has one: Backend.top_k_last)."""
    lowest = jnp.where(valid, -priority, -jnp.inf)
    worst = backends.writer().top_k_last(lowest, width)
    if worst is None:
        worst = top_k_last(lowest, width)  # [B, E, width], lowest priority first
    b = jnp.arange(worst.shape[0])[:, None, None]
    e = jnp.arange(worst.shape[1])[None, :, None]
    return jnp.zeros(valid.shape, bool).at[b, e, worst].set(jnp.arange(width) < drop)


def top_k_last(x: Array, k: int) -> Array:
    """int32[..., k]: the indices of the k largest of x [..., C] in XLA's total
    order (NaN above +inf, +0 above -0), among equals the later first: a top-k
    of the reversed row (Backend.top_k_last's reference)."""
    _, index = jax.lax.top_k(x[..., ::-1], k)
    return x.shape[-1] - 1 - index


def _observed_count(policy: Policy, placement: Placement) -> Array:
    """float32[B, 1, 1]: the queries of each row whose attention the mass sums."""
    weights = observed_queries(policy, placement)
    if weights is None:
        return jnp.zeros((placement.positions.shape[0], 1, 1), jnp.float32)
    return weights.sum(-1)[:, None, None]


def _scored(scorer, c: Candidates) -> tuple[Array, Array]:
    """The scorer's scores of `c` and the priorities they rank by."""
    score = scorer.score(c)
    return score, scorer.priority(c, score)


def init_layer(policy: Policy, tensors: tuple, batch: int, dtype=jnp.bfloat16) -> EvictingLayer:
    """An empty layer around `tensors` (each with policy.slots rows, zeroed; settling:
    QuantizedTensors of slots x g rows and a ring of policy.layout.ring_len); a
    decoding layer's query buffer in `dtype` (the cache's)."""
    return EvictingLayer(
        tensors,
        *empty_slots(policy, batch),
        policy,
        empty_ring_scores(policy, batch),
        empty_since(policy, batch),
        init_buffer(policy, tensors, batch, dtype),
        empty_weights(policy, batch),
    )


def init_buffer(policy: Policy, tensors: tuple, batch: int, dtype) -> QueryBuffer | None:
    """An empty query buffer of `policy.buffers` tokens (None where it keeps none)."""
    if not policy.buffers:
        return None
    groups = policy.query_heads // policy.kv_heads
    width = tensor_width(tensors[0])
    return empty_buffer(policy.buffers, batch, policy.kv_heads, groups, width, dtype)


def reset_rows(layer, starting: Array, lengths: Array):
    """The layer with rows `starting` (bool[B]) holding their first lengths[b]
    tokens in slot order (a request starting there on matched prefix pages) and
    nothing else: slot j holds position j (settling: group j, first position j x g)
    or nothing (-1), scores 0 (a remembered static score: NaN, scored at the next
    write, Policy.remembers) and weights NaN (weighed when next scored). Other
    layers pass through."""
    if getattr(layer, "positions", None) is None:
        return layer
    first = jnp.arange(layer.positions.shape[2]) * layer.policy.granularity  # slot j: group j
    fresh = jnp.where(first[None, :] < lengths[:, None], first[None, :], -1)[:, None, :]
    positions = jnp.where(starting[:, None, None], fresh, layer.positions)
    scores = layer.scores
    if scores is not None:  # h2o's sum starts afresh; a static score is unknown until scored
        fill = jnp.nan if layer.policy.remembers else 0.0
        scores = jnp.where(starting[:, None, None], fill, scores)
    layer = layer.replace(positions=positions, scores=scores)
    if getattr(layer, "ring_scores", None) is not None:
        ring_scores = jnp.where(starting[:, None, None], 0.0, layer.ring_scores)
        layer = layer.replace(ring_scores=ring_scores)
    if getattr(layer, "since", None) is not None:
        layer = layer.replace(since=jnp.where(starting, 0, layer.since))
    if getattr(layer, "weights", None) is not None:
        layer = layer.replace(weights=jnp.where(starting[:, None, None], jnp.nan, layer.weights))
    if getattr(layer, "buffer", None) is not None:
        layer = layer.replace(buffer=layer.buffer.emptied(starting))
    return layer
