"""The one attention function every variant calls.

Grouped-query attention (arXiv:2305.13245) over key/value blocks: the cache's
contents (dense, dequantized, gathered pages, a latent) and the tokens of the
current step. Query heads are grouped under their KV head instead of
repeating K/V in memory: query head n = k * G + g reads KV head k, so MHA
(G = 1), GQA and MQA (K = 1) are one computation.

    attend(q [B, T, N, H], blocks) -> [B, T, N, Hv]
    blocks: sequence of (k [B, K, S_i, H], v [B, K, S_i, Hv], mask bool[B, T or 1, S_i])

Queries and keys may also come in parts: q a tuple of [B, T, N, H_j] and each
block's k a tuple of [B, K_j, S_i, H_j]; the score is the sum of the parts' dot
products. Latent attention scores a latent part and a RoPE part this way
without concatenating them in the cache. A part may have its own head count
K_j (a divisor of N): query head n reads that part's head n // (N / K_j), and
the values' K decides the groups of the output (absorbed latent attention with
one latent and a RoPE key per KV head of the source, kvlab/checkpoints/convert.py).

A key or value may also be a `kvlab.cache.protocols.Reader` of stored data
instead of an array (a quantized payload, kvlab/cache/quant/), computing the
same products without dequantizing first.

One softmax runs over all blocks together (each block's scores are
exponentiated against the running maximum and the sums combined), so a step
reads the cache as it was and the new tokens beside it, without concatenating
them: on XLA:CPU, writing the new tokens into the cache before reading it
makes the compiler copy the whole cache every step. A prompt's chunk (several
queries) takes the cache's blocks and its own tokens under two softmaxes merged
as in flash-decoding, so that a cache that holds nothing yet is skipped.

Keys and values are head-major ([B, K, S, H], the layout caches store) and may
have different head widths (latent attention does). The T queries and the G
query heads of a group are folded into one axis M = T * G, so each KV head is
one [M, H] x [H, S] product: XLA on CPU runs a decode step (T = 1) over this
layout at memory bandwidth, but 4-14x slower with the cache stored [B, S, K, H]
or with a separate size-1 T axis in the einsum. Queries and probabilities are
cast to each block's dtype (they are small; the block may be large), and
scores, the softmax and the sums are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float

from kvlab import backends
from kvlab.cache.protocols import Pooled, Reader

# A finite "minus infinity": a fully masked row gives a uniform softmax, not NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
SUMMED_ROWS = 16  # the most query rows a mass is summed over by adds (_summed_rows)


def ordered_after(tree, dependency: Array):
    """`tree` unchanged, but computed after `dependency` (adds 0 * sum(dependency)).

    A cache is read by attention and then written in place with the new
    tokens. XLA may only write in place once every read is done; the write
    does not depend on the reads' results, so XLA:CPU copies the whole cache
    instead (both buffers of every layer, every step: 4x slower decode).
    Making the written values depend on the attention output orders the write
    after the reads. For a finite `dependency` the values are unchanged
    (x + 0.0 == x); a non-finite one (a broken step) poisons them with NaN.
    (`jax.lax.optimization_barrier` does not give XLA:CPU this ordering.)
    """
    zero = 0.0 * jnp.sum(dependency, dtype=jnp.float32)
    return jax.tree_util.tree_map(lambda x: x + zero.astype(x.dtype), tree)


class Queries(NamedTuple):
    """One attention's queries as an eviction scorer reads them (through_layer's
    `queries()`): `meet` [B, K, T, G, W], each KV head's G query heads as they meet
    the layer's first cached tensor (after RoPE and the cache's transform); `raw`
    the same before RoPE and the transform, and `rotate(x [B, K, Q, W], positions
    [B, Q])` what RoPE at `positions` and the transform make of raw vectors (None
    where positions do not enter that tensor's products: a latent);
    `output_norms(v [B, K, X, Wv] as stored)` float32[B, K, G, X], the L1 norm of
    each query head's output projection of each value (None: not offered);
    `hidden` [B, T, D] the attention's input (the step's tokens' hidden states
    after the layer's norm, what its projections read; None: not offered)."""

    meet: Array
    raw: Array | None = None
    rotate: Callable | None = None
    output_norms: Callable | None = None
    hidden: Array | None = None


class Observed(NamedTuple):
    """The queries the attentions over one read asked with, Q = T x G per attending
    layer (Candidates.queries and its companions, kvlab/cache/evict/scorers.py):
    vectors float32[B, K, Q, W] (`Queries.meet`), weights float32[B, Q] (1 where the
    layer observes), positions int32[B, Q], groups G; raw float32[B, K, Q, W] and
    rotate as `Queries`' (None unless every attention offered them); output_norms
    and hidden the first attention's (a cross-layer run's producer)."""

    vectors: Array
    weights: Array
    positions: Array
    groups: int
    raw: Array | None = None
    rotate: Callable | None = None
    output_norms: Callable | None = None
    hidden: Array | None = None


Keys = Float[Array, "B K S H"] | tuple[Float[Array, "B K S _"], ...]
Block = tuple[Keys, Float[Array, "B K S Hv"], Bool[Array, "B T S"] | Bool[Array, "B K T G S"]]


@dataclasses.dataclass(frozen=True)
class Read:
    """A cache layer as one step reads it: what attention attends over
    (`regions`: pairs of tensors and mask), the step's tokens as the layer
    will write them (`pending`), the query weights the layer observes
    (`observe`, eviction by attention) and the mean mass its tokens received
    from the `observers` that attended so far. A cross-layer topology
    (kvlab/cache/topology) hands one read to the attention of several layers
    and commits it once. Without a cache (`layer` None) the regions are the
    step's own tokens and nothing is written."""

    layer: object
    placement: object
    regions: tuple
    pending: tuple = ()
    observe: Array | None = None
    mass: list | None = None
    observers: int = 0
    queries: tuple | None = ()

    @property
    def cached(self) -> bool:
        return self.layer is not None

    def observed(self, mass: list, queries: Queries | None = None) -> Read:
        """This read with one more attention's `mass` averaged in, and its
        `queries` (`through_layer`) beside the others'."""
        if self.mass is not None:
            n = self.observers
            mass = [(m * n + new) / (n + 1) for m, new in zip(self.mass, mass, strict=True)]
        # Queries only while every attention so far offered them.
        joined = None if queries is None or self.queries is None else (*self.queries, queries)
        return dataclasses.replace(self, mass=mass, observers=self.observers + 1, queries=joined)

    def observed_queries(self) -> Observed | None:
        """The queries the observers asked with (`Observed`); None when an
        attention offered none."""
        if not self.queries:
            return None
        flat = lambda q: q.reshape(*q.shape[:2], -1, q.shape[-1]).astype(jnp.float32)  # noqa: E731
        groups = self.queries[0].meet.shape[3]
        repeat = lambda x: jnp.concatenate([jnp.repeat(x, groups, axis=1)] * len(self.queries), 1)  # noqa: E731
        raw, rotate = None, self.queries[0].rotate
        if all(q.raw is not None for q in self.queries):
            raw = jnp.concatenate([flat(q.raw) for q in self.queries], axis=2)
        return Observed(
            vectors=jnp.concatenate([flat(q.meet) for q in self.queries], axis=2),
            weights=repeat(self.observe),
            positions=repeat(self.placement.positions),
            groups=groups,
            raw=raw,
            rotate=rotate if raw is not None else None,
            output_norms=self.queries[0].output_norms,
            hidden=self.queries[0].hidden,
        )

    def commit(self, after: Array):
        """The layer with the step's tokens written, after `after` is computed
        (`ordered_after`: every attention over the read is done, so the layer
        is written in place); None without a cache."""
        if self.layer is None:
            return None
        pending = ordered_after(self.pending, after)
        if self.observe is None:
            return self.layer.write(pending, self.placement)
        return self.layer.write(pending, self.placement, self.mass, self.observed_queries())


def read_layer(layer, fresh: tuple, placement) -> Read:
    """What attention over `layer` (None: no cache) reads this step, `fresh`
    being the step's tensors."""
    if layer is None:
        return Read(None, placement, ((fresh, placement.fresh_mask),))
    regions, pending = layer.read(fresh, placement)
    return Read(layer, placement, regions, pending, layer.observe(placement))


@dataclasses.dataclass(frozen=True)
class Joint:
    """A joint cache layer (kvlab/cache/topology) between the layers of its run: the
    tokens each layer before computed, which the run's last layer writes."""

    layer: object
    pending: tuple


def _through_joint(state, fresh: tuple, placement, attention, commits: bool):
    """`through_layer` over a cache layer its run's layers read each as their own."""
    layer, earlier = (state.layer, state.pending) if isinstance(state, Joint) else (state, ())
    regions, pending = layer.read(fresh, placement, len(earlier))
    out = attention(regions, None, True)
    pending = (*earlier, pending)
    if not commits:
        return out, Joint(layer, pending)
    return out, layer.write(ordered_after(pending, out), placement)


def through_layer(
    state, fresh: tuple | None, placement, attention, commits: bool = True, queries=None
):
    """Reads a cache layer, attends, writes: (attention output, new layer).

    `state` is a cache layer (None: no cache) or a `Read` another layer's
    attention made (cross-layer topologies; `fresh` is then unused); a joint
    cache layer (a topology's own, `joint`) or the `Joint` of its run so far is
    read as the next member's and written by the run's last layer. Without
    `commits` the read comes back instead of the written layer, for later
    layers to attend over. `attention(regions, observe, cached)` attends over
    the regions (pairs of tensors and mask) and returns the output, or
    (output, mass) when `observe` (float32[B, T]: query weights) is given.
    Layers that evict by attention (kvlab/cache/evict/) say which queries
    they observe (`layer.observe`) and receive the mass each of their tokens
    got from them, and the queries with it: `queries()` gives `Queries` (or
    its `meet` array [B, K, T, G, W] alone: each KV head's G query heads as
    they meet the layer's first cached tensor; called only for such layers);
    `queries` None if the attention kind offers none.
    """
    if isinstance(state, Joint) or getattr(state, "joint", False):
        return _through_joint(state, fresh, placement, attention, commits)
    read = state if isinstance(state, Read) else read_layer(state, fresh, placement)
    if read.observe is None:
        out = attention(read.regions, None, read.cached)
    else:
        out, mass = _observing(attention, read)
        asked = None if queries is None else queries()
        if asked is not None and not isinstance(asked, Queries):
            asked = Queries(asked)
        read = read.observed(mass, asked)
    # Write only after the old cache has been read, so it is written in place.
    return out, (read.commit(out) if commits else read)


def _observing(attention, read: Read):
    """(output, mass) of attention over an observing read. The mass is computed
    only in a step whose write scores (`layer.competes`, a traced bool; None:
    every step; False: none, the layer reads the queries alone): other steps
    attend as a layer without eviction does (streamed, or a backend's kernel)
    and hand zeros, which their write does not read."""
    observe = Peak(read.observe) if read.layer.policy.peaks else read.observe
    attend = lambda: attention(read.regions, observe, read.cached)  # noqa: E731
    competes = read.layer.competes(read.placement)
    if competes is None:
        return attend()
    _, masses = jax.eval_shape(attend)

    def unobserved():
        out = attention(read.regions, None, read.cached)
        return out, [jnp.zeros(m.shape, m.dtype) for m in masses]

    if competes is False:
        return unobserved()
    return jax.lax.cond(competes, attend, unobserved)


def _parts(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def scores_of(q, k) -> Array:
    """[B, K, M, H] queries against [B, K, S, H] keys (or a reader): float32 [B, K, M, S]."""
    if isinstance(k, Reader):
        return k.scores(q)
    return jnp.einsum("BKMH,BKSH->BKMS", q.astype(k.dtype), k, preferred_element_type=jnp.float32)


def weighted_sum_of(weights, v) -> Array:
    """[B, K, M, S] weights over [B, K, S, Hv] values (or a reader): float32 [B, K, M, Hv]."""
    if isinstance(v, Reader):
        return v.weighted_sum(weights)
    return jnp.einsum(
        "BKMS,BKSH->BKMH", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )


# Tokens per step when a long stored block is read in steps (`Attention.stream`).
STREAM_TOKENS = 512


def narrow(x) -> bool:
    """A float array narrower than float32 (bfloat16, float16)."""
    return not isinstance(x, Reader) and jnp.dtype(x.dtype).itemsize < 4


def _chunk(x, start, size: int):
    """Tokens start..start+size-1 of a block's keys or values (an array or a Reader)."""
    if isinstance(x, Reader):
        x = x.chunk(start, size)
    else:
        x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
    return x.astype(jnp.float32) if narrow(x) else x  # widened in cache


def merge(a, b):
    """Two softmax partials (peak [B, K, T, G, 1], total, out [B, K, M, Hv]) as one."""
    peak = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - peak), jnp.exp(b[0] - peak)
    rows = *b[2].shape[:2], -1, 1  # [B, K, M, 1], M = T * G
    out = a[2] * scale_a.reshape(rows) + b[2] * scale_b.reshape(rows)
    return peak, a[1] * scale_a + b[1] * scale_b, out


def unpooled(block, query_heads: int):
    """The block with a pool's `Pooled` keys and values as the arrays they wrap,
    masked by their owners (which of `query_heads` reads which slot)."""
    if not pooled(block):
        return block
    plain = lambda x: x.array if isinstance(x, Pooled) else x  # noqa: E731
    k, v, _ = block
    keys = tuple(map(plain, k)) if isinstance(k, tuple) else plain(k)
    return keys, plain(v), v.mask(query_heads)


def pooled(block) -> bool:
    """Whether the block is a pool's stored slots (`Pooled` keys and values)."""
    return isinstance(block[1], Pooled)


def tensors(block) -> tuple:
    """A block's key parts and values (arrays or Readers)."""
    return (*_parts(block[0]), block[1])


def stored(block) -> bool:
    """Whether a block holds stored data beside float32 arrays: a Reader
    (quantized payloads, page pools) or a 16-bit array."""
    return any(isinstance(x, Reader) or narrow(x) for x in tensors(block))


def _long(block) -> bool:
    """Whether a block spans at least two slices of STREAM_TOKENS (or of its readers' step)."""
    steps = [x.step for x in tensors(block) if isinstance(x, Reader)]
    return block[1].shape[2] >= 2 * max([STREAM_TOKENS, *steps])


def streamed_alone(block) -> bool:
    """Whether the reference streams the block when one query reads it (a
    decode step): stored data (`stored`) at least two slices long."""
    return stored(block) and _long(block)


@dataclasses.dataclass(frozen=True)
class Attention:
    """The queries of one `attend` call and how they read a block: what a
    backend (kvlab.backends) is given to compute a block's partial.

    folded: per query part, [B, K_j, M_j, H_j] (M_j = T x N / K_j: the T
    queries and the query heads of each KV head of that part); part_heads:
    each part's K_j; shape: (B, K, T, G) by the values' K heads; scale: the
    softmax scale. A partial is (peak [B, K, T, G, 1], total [B, K, T, G, 1],
    out [B, K, M, Hv]): the largest score, the sum of exp(score - peak) and
    the weighted sum of the values, so out / total is attention's output.
    """

    folded: tuple
    part_heads: tuple
    shape: tuple
    scale: float

    @property
    def query_heads(self) -> int:
        """N: the query heads (K x G)."""
        return self.shape[1] * self.shape[3]

    @property
    def rows(self) -> int:
        """The most queries any KV head of any part reads a block with."""
        batch, kv_heads, length, groups = self.shape
        return length * groups * kv_heads // min(kv_heads, *self.part_heads)

    def _grouped(self, s, heads):
        """[B, K_j, M_j, S] scores as [B, K, T, G, S] (K, G: the values' heads and groups)."""
        batch, kv_heads, length, groups = self.shape
        if heads == kv_heads:
            return s.reshape(batch, kv_heads, length, groups, -1)
        s = rearrange(s, "B K (T G) S -> B T (K G) S", K=heads, T=length)
        return rearrange(s, "B T (K G) S -> B K T G S", K=kv_heads)

    def scores(self, k, mask) -> Array:
        """[B, K, T, G, S] scaled scores of the queries over one block's keys, masked."""
        s = sum(
            self._grouped(scores_of(q_part, k_part), heads)
            for q_part, k_part, heads in zip(self.folded, _parts(k), self.part_heads, strict=True)
        )
        mask = mask[:, None, :, None, :] if mask.ndim == 3 else mask
        return jnp.where(mask, s * self.scale, MASKED)

    def weighted(self, weights, v) -> Array:
        """[B, K, T, G, S] weights over a block's values: float32 [B, K, M, Hv]."""
        batch, kv_heads, length, groups = self.shape
        return weighted_sum_of(weights.reshape(batch, kv_heads, length * groups, -1), v)

    def empty(self, width: int):
        """The partial of no keys (values `width` wide): merged with another, that one."""
        batch, kv_heads, length, groups = self.shape
        peak = jnp.full((*self.shape, 1), MASKED, jnp.float32)
        out = jnp.zeros((batch, kv_heads, length * groups, width), jnp.float32)
        return peak, jnp.zeros_like(peak), out

    def whole(self, block):
        """The partial of one block read at once."""
        s = self.scores(block[0], block[2])
        peak = s.max(axis=-1, keepdims=True, initial=MASKED)
        weights = jnp.exp(s - peak)
        return peak, weights.sum(axis=-1, keepdims=True), self.weighted(weights, block[1])

    def streams(self, block) -> bool:
        """Whether the block is read in steps of STREAM_TOKENS (`stream`): stored
        data (a Reader: quantized payloads, page pools) or a 16-bit array, of at
        least two steps; a float32 array too when several queries read it (a
        prompt's chunk), so that the loop stops at the last slot any of them sees
        instead of scoring a long buffer's unwritten slots. For one query a
        float32 array is read whole: one [M, H] x [H, S] product per head reads
        it at memory bandwidth, faster than a loop over its slices. A 16-bit
        slice is widened to float32 (whose products are then float32 ones: the
        queries and weights are not rounded to 16 bits as a short 16-bit
        block's are)."""
        return _long(block) and (self.shape[2] > 1 or stored(block))

    def stream(self, block):
        """The partial of one long stored block, read STREAM_TOKENS at a time.

        Flash-decoding over the sequence: each step takes one slice of the stored
        data (dequantizing a quantized slice, gathering a paged one), scores it
        and folds it into a running maximum, sum and weighted sum, so no widened
        copy of the whole block is ever made and the working set stays in cache.
        The loop stops after the last slot any query sees (the mask's extent).
        """
        k, v, mask = block
        readers = [x for x in tensors(block) if isinstance(x, Reader)]
        size = math.lcm(STREAM_TOKENS, *(r.step for r in readers))  # whole groups and pages
        slots = v.shape[2]
        seen = jnp.max(jnp.where(mask, jnp.arange(1, slots + 1), 0))  # one past the last seen
        offsets = jnp.arange(size)

        def step(i, carry):
            # The last step may start early (slots % size); slots it read before are masked.
            begin = i * size
            start = jnp.minimum(begin, slots - size)
            keys = tuple(_chunk(part, start, size) for part in _parts(k))
            visible = jax.lax.dynamic_slice_in_dim(mask, start, size, axis=-1)
            visible = visible & (start + offsets >= begin)
            s = self.scores(keys if isinstance(k, tuple) else keys[0], visible)
            peak = jnp.maximum(carry[0], s.max(axis=-1, keepdims=True))
            weights = jnp.exp(s - peak)
            values = self.weighted(weights, _chunk(v, start, size))
            return merge(carry, (peak, weights.sum(axis=-1, keepdims=True), values))

        return jax.lax.fori_loop(0, -(-seen // size), step, self.empty(v.shape[3]))

    def partial(self, block):
        """The reference partial of a block attended on its own: streamed or whole."""
        return self.stream(block) if self.streams(block) else self.whole(block)

    def together(self, blocks, observe):
        """(peak, total, out, weights) of blocks under one softmax; the weights
        (exp(score - peak), per block) only with `observe`."""
        scores = [self.scores(k, mask) for k, _, mask in blocks]
        peak, total, out = self.empty(blocks[0][1].shape[3])
        for s in scores:
            peak = jnp.maximum(peak, s.max(axis=-1, keepdims=True, initial=MASKED))
        kept = []
        for s, (_, v, _) in zip(scores, blocks, strict=True):
            weights = jnp.exp(s - peak)
            total = total + weights.sum(axis=-1, keepdims=True)
            out = out + self.weighted(weights, v)  # [B, K, M, Hv]
            kept += [] if observe is None else [weights]
        return peak, total, out, kept

    def nothing(self, blocks, observe):
        """In `together`'s form, blocks no query sees: an empty partial, no mass."""
        kept = [jnp.zeros((*self.shape, v.shape[2]), jnp.float32) for _, v, _ in blocks]
        return *self.empty(blocks[0][1].shape[3]), kept if observe is not None else []


class Peak(NamedTuple):
    """Observed queries whose mass is, per key, the largest probability any of them
    (and any query head of the key's group) gave it, not their weighted sum
    (KVzip's reconstruction, Scorer.peaks): attend's `observe` as weights > 0."""

    weights: Array


def _masses(weights, factor, total, observe, groups: int) -> list:
    """Per block, the mass its keys got (weights x factor / total) from the
    queries weighted by `observe` (none without it: nothing was kept); a `Peak`:
    the largest probability from an observed query."""
    if observe is None:
        return []
    if isinstance(observe, Peak):
        seen = (observe.weights > 0)[:, None, :, None, None]  # [B, 1, T, 1, 1]
        return [jnp.where(seen, w * factor / total, 0.0).max((2, 3)) for w in weights]
    query = (observe.astype(jnp.float32) / groups)[:, None, :, None, None]  # [B, 1, T, 1, 1]
    # A product and a sum over T and G, not an einsum: XLA:CPU made that a dot over
    # T with G summed apart, which cost more than the rest of a decode step.
    return [_summed_rows(w * factor / total * query) for w in weights]


def _summed_rows(x: Array) -> Array:
    """x [B, K, T, G, S] summed over T and G: as a chain of adds where there are
    few rows (XLA:CPU hands the reduction to YNNPACK: adakv's compressions of
    configs/mha.py:tiny at 8k took 4.0 ms, 3.6 as adds), else a sum."""
    b, k, t, g, s = x.shape
    if t * g > SUMMED_ROWS:
        return x.sum((2, 3))
    rows = x.reshape(b, k, t * g, s)
    return functools.reduce(jnp.add, [rows[:, :, i] for i in range(t * g)])


def attend(
    q: Float[Array, "B T N H"] | tuple[Float[Array, "B T N _"], ...],
    blocks: Sequence[Block],
    scale: float | None = None,
    observe: Float[Array, "B T"] | None = None,
    impl: str = "xla",
):
    """Softmax attention of every query head over its KV head's keys in all blocks.

    `scale` defaults to 1 / sqrt(total query width). A block's mask is
    [B, T or 1, S] (every head alike) or [B, K or 1, T or 1, G or 1, S] (per KV
    head and query head of its group). With `observe` (weights of the T
    queries) it returns (out, mass): per block float32[B, K, S], the
    probability each key received, summed over the queries by their weights
    and averaged over each KV head's G query heads (a `Peak`: the largest from
    any observed query and query head). `impl` names the backend
    (kvlab.backends; model.attention_impl) whose kernels compute the blocks
    it claims; "xla" is this function alone. A pool's block (`Pooled` keys and
    values, AdaKV) is read as the arrays it wraps under its mask, unless the
    backend reads it with each slot's own query heads (`Backend.pooled`). With
    `observe` every block goes under one softmax whose weights give the mass;
    a backend may compute its products (`Backend.readers`).
    """
    queries = _parts(q)
    batch, length, num_heads, _ = queries[0].shape
    # [B, K, S, H] keys and values (arrays or readers)
    first = unpooled(blocks[0], num_heads)
    num_kv_heads = first[1].shape[1]
    part_heads = tuple(part.shape[1] for part in _parts(first[0]))
    for heads in (num_kv_heads, *part_heads):
        if num_heads % heads:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({heads})")
    groups = num_heads // num_kv_heads
    if scale is None:
        scale = sum(part.shape[-1] for part in queries) ** -0.5
    # [B, K_j, M_j, H_j] with M_j = T * N / K_j
    folded = tuple(
        rearrange(part, "B T (K G) H -> B K (T G) H", K=heads)
        for part, heads in zip(queries, part_heads, strict=True)
    )
    attention = Attention(folded, part_heads, (batch, num_kv_heads, length, groups), scale)
    kernels = backends.get(impl)
    # A pool's slots that the backend reads with each slot's own query heads alone
    # (Backend.pooled): their partials, merged with the others' after.
    partials, plain = [], []
    for block in blocks:
        partial = kernels.pooled(block, attention) if pooled(block) and observe is None else None
        if partial is None:
            plain.append(unpooled(block, num_heads))
        else:
            partials.append(partial)
    blocks = plain
    if observe is not None:  # every block's weights are seen: the backend's products
        blocks = [kernels.readers(block, attention) or block for block in blocks]

    def apart(block) -> bool:
        """Blocks attended on their own and merged after: long stored blocks
        (streamed) and those the backend claims (so a short 16-bit block beside
        them rounds its weights as on the reference path)."""
        if observe is not None:
            return False
        return kernels.claims(block, attention) or attention.streams(block)

    separate = [block for block in blocks if apart(block)]
    blocks = [block for block in blocks if not apart(block)]
    if not blocks:
        peak = jnp.full((*attention.shape, 1), MASKED, jnp.float32)
        total, out, mass = jnp.zeros_like(peak), 0.0, []
    elif length > 1 and len(blocks) > 1:
        # A prompt's chunk: the cache's blocks under one softmax, merged with the
        # last (the new tokens) as in flash-decoding. Over a cache that holds
        # nothing yet for any row, the cache's products are skipped: an empty
        # partial merges to the new tokens' own exactly, as does a row's wholly
        # masked one (weight exp(MASKED - peak) = 0), so no row's output depends
        # on whether another row's cache holds tokens.
        cached, fresh = blocks[:-1], blocks[-1:]
        held = jnp.any(jnp.stack([jnp.any(mask) for _, _, mask in cached]))
        old = jax.lax.cond(
            held,
            lambda: attention.together(cached, observe),
            lambda: attention.nothing(cached, observe),
        )
        new = attention.together(fresh, observe)
        peak, total, out = merge(old[:3], new[:3])
        mass = [
            *_masses(old[3], jnp.exp(old[0] - peak), total, observe, groups),
            *_masses(new[3], jnp.exp(new[0] - peak), total, observe, groups),
        ]
    else:
        peak, total, out, weights = attention.together(blocks, observe)
        mass = _masses(weights, 1.0, total, observe, groups)
    for block in separate:  # merged into the others' softmax as in flash-decoding
        partial = kernels.partial(block, attention) if kernels.claims(block, attention) else None
        peak, total, out = merge((peak, total, out), partial or attention.partial(block))
    for partial in partials:
        peak, total, out = merge((peak, total, out), partial)
    out = out / total.reshape(batch, num_kv_heads, length * groups, 1)
    out = rearrange(out, "B K (T G) H -> B T (K G) H", T=length).astype(queries[0].dtype)
    return out if observe is None else (out, mass)


def on_platforms(run: Callable, fallback: Callable, **platforms: bool):
    """`run(platform)` where the program is lowered for a platform named True in
    `platforms` (e.g. cpu=True, cuda=True), else `fallback()`: the choice is made
    when the program is lowered (jax.lax.platform_dependent), so a program
    exported for another platform holds the fallback alone."""
    branches = {p: (lambda p=p: run(p)) for p, wanted in platforms.items() if wanted}
    if not branches:
        return fallback()
    return jax.lax.platform_dependent(**branches, default=fallback)
