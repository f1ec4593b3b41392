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
one latent and a RoPE key per KV head of the source, kvlab/convert.py).

A key or value may also be a `kvlab.cache.protocols.Reader` of stored data
instead of an array (a quantized payload, kvlab/cache/quant.py), computing the
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
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float

from kvlab import native
from kvlab.cache.protocols import Reader, ReadWhole

# A finite "minus infinity": a fully masked row gives a uniform softmax, not NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


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


Keys = Float[Array, "B K S H"] | tuple[Float[Array, "B K S _"], ...]
Block = tuple[Keys, Float[Array, "B K S Hv"], Bool[Array, "B T S"] | Bool[Array, "B K T G S"]]


def through_layer(layer, fresh: tuple, placement, attention):
    """Reads a cache layer, attends, writes: (attention output, new layer).

    `attention(regions, observe)` attends over the layer's regions (pairs of
    tensors and mask) and returns the output, or (output, mass) when `observe`
    (float32[B, T]: query weights) is given. Layers that evict by attention
    (kvlab/cache/evict.py) say which queries they observe (`layer.observe`)
    and receive the mass each of their tokens got from them.
    """
    regions, pending = layer.read(fresh, placement)
    observe = layer.observe(placement)
    out = attention(regions, observe)
    if observe is None:
        # Write only after the old cache has been read, so it is written in place.
        return out, layer.write(ordered_after(pending, out), placement)
    out, mass = out
    return out, layer.write(ordered_after(pending, out), placement, mass)


def _parts(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _scores(q, k, impl: str) -> Array:
    """[B, K, M, H] queries against [B, K, S, H] keys (or a reader): float32 [B, K, M, S]."""
    if isinstance(k, Reader):
        return k.scores(q)
    if impl == "native" and k.dtype == jnp.float32:
        return native.scores(q.astype(jnp.float32), k)
    return jnp.einsum("BKMH,BKSH->BKMS", q.astype(k.dtype), k, preferred_element_type=jnp.float32)


def _weighted_sum(weights, v, impl: str) -> Array:
    """[B, K, M, S] weights over [B, K, S, Hv] values (or a reader): float32 [B, K, M, Hv]."""
    if isinstance(v, Reader):
        return v.weighted_sum(weights)
    if impl == "native" and v.dtype == jnp.float32:
        return native.weighted_sum(weights.astype(jnp.float32), v)
    return jnp.einsum(
        "BKMS,BKSH->BKMH", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )


# Tokens per step when a long stored block is read in steps (`_stream`).
STREAM_TOKENS = 512


def _narrow(x) -> bool:
    """A float array narrower than float32 (bfloat16, float16)."""
    return not isinstance(x, Reader) and jnp.dtype(x.dtype).itemsize < 4


def _streams(block, size: int, queries: int = 1) -> bool:
    """Whether attention reads this block in steps of `size` tokens: stored data
    (a Reader: quantized payloads, page pools) or a 16-bit array, of at least
    two steps; a float32 array too when several queries read it (a prompt's
    chunk), so that the loop stops at the last slot any of them sees instead
    of scoring a long buffer's unwritten slots. For one query a float32 array
    is read whole: XLA:CPU reads one [M, H] x [H, S] product per head at memory
    bandwidth, faster than a loop over its slices. 16-bit products are several
    times slower than widening a slice to float32 (whose products are then
    float32 ones: the queries and weights are not rounded to 16 bits as a short
    16-bit block's are)."""
    k, v, _ = block
    tensors = (*_parts(k), v)
    readers = [x for x in tensors if isinstance(x, Reader)]
    if not readers and not any(_narrow(x) for x in tensors) and queries == 1:
        return False
    return v.shape[2] >= 2 * max([size, *(r.step for r in readers)])


def _chunk(x, start, size: int):
    """Tokens start..start+size-1 of a block's keys or values (an array or a Reader)."""
    if isinstance(x, Reader):
        x = x.chunk(start, size)
    else:
        x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
    return x.astype(jnp.float32) if _narrow(x) else x  # widened in cache


def _stream(k, v, mask, block_scores, weighted, size: int, shape: tuple):
    """(peak, total, out) of one long stored block, read `size` tokens at a time.

    Flash-decoding over the sequence: each step takes one slice of the stored
    data (dequantizing a quantized slice, gathering a paged one), scores it
    and folds it into a running maximum, sum and weighted sum, so no widened
    copy of the whole block is ever made and the working set stays in cache.
    The loop stops after the last slot any query sees (the mask's extent).
    """
    readers = [x for x in (*_parts(k), v) if isinstance(x, Reader)]
    size = math.lcm(size, *(r.step for r in readers))  # slices start on whole groups and pages
    slots = v.shape[2]
    seen = jnp.max(jnp.where(mask, jnp.arange(1, slots + 1), 0))  # one past the last seen slot
    offsets = jnp.arange(size)

    def step(i, carry):
        # The last step may start early (slots % size); slots it read before are masked.
        begin = i * size
        start = jnp.minimum(begin, slots - size)
        keys = tuple(_chunk(part, start, size) for part in _parts(k))
        visible = jax.lax.dynamic_slice_in_dim(mask, start, size, axis=-1)
        visible = visible & (start + offsets >= begin)
        s = block_scores(keys if isinstance(k, tuple) else keys[0], visible)
        peak = jnp.maximum(carry[0], s.max(axis=-1, keepdims=True))
        weights = jnp.exp(s - peak)
        values = weighted(weights, _chunk(v, start, size))
        return _merge(carry, (peak, weights.sum(axis=-1, keepdims=True), values))

    batch, kv_heads, length, groups = shape
    peak = jnp.full((batch, kv_heads, length, groups, 1), MASKED, jnp.float32)
    out = jnp.zeros((batch, kv_heads, length * groups, v.shape[3]), jnp.float32)
    return jax.lax.fori_loop(0, -(-seen // size), step, (peak, jnp.zeros_like(peak), out))


def _merge(a, b):
    """Two softmax partials (peak [B, K, T, G, 1], total, out [B, K, M, Hv]) as one."""
    peak = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - peak), jnp.exp(b[0] - peak)
    rows = *b[2].shape[:2], -1, 1  # [B, K, M, 1], M = T * G
    out = a[2] * scale_a.reshape(rows) + b[2] * scale_b.reshape(rows)
    return peak, a[1] * scale_a + b[1] * scale_b, out


def _stored(x):
    """A stored block's keys or values as the Pallas kernels take them, or None."""
    from kvlab.attention import pallas  # noqa: PLC0415 (Triton's modules load on first use)
    from kvlab.cache import paged, quant  # noqa: PLC0415 (the cache package imports this one)

    if isinstance(x, quant.PayloadReader):
        return pallas.Stored.of(x.tensor)
    if isinstance(x, paged.PagedPayloadReader):
        return pallas.Stored.of(x.tensor, x.pages)
    if isinstance(x, paged.PagedReader):
        return pallas.Stored(x.pool, pages=x.pages)
    return None


def _kernel(block, folded, part_heads, scale: float, shape: tuple, fallback):
    """(peak, total, out) of a stored block by the Pallas kernel
    (kvlab/attention/pallas.py), or None when the kernel cannot read it.

    The kernel reads rows' first `lengths` tokens: blocks whose mask is one
    prefix per row for every query ([B, 1, S], a quantized payload's settled
    tokens or a page pool's written ones) and whose key parts have the values'
    heads. A mask that is no prefix (an evicting window's band) takes
    `fallback()`, the XLA path, at run time.
    """
    from kvlab.attention import pallas  # noqa: PLC0415

    k, v, mask = block
    batch, kv_heads, length, groups = shape
    if mask.ndim != 3 or mask.shape[1] != 1 or any(h != kv_heads for h in part_heads):
        return None
    stored = {id(x): _stored(x) for x in (*_parts(k), v)}
    if any(x is None for x in stored.values()):
        return None
    lengths = mask[:, 0].sum(axis=-1, dtype=jnp.int32)
    prefix = jnp.all(mask[:, 0] == (jnp.arange(mask.shape[-1]) < lengths[:, None]))

    def kernel():
        out, peak, total = pallas.stored_attention(
            tuple(folded),
            tuple(stored[id(x)] for x in _parts(k)),
            stored[id(v)],
            lengths,
            scale=scale,
            interpret=jax.default_backend() == "cpu",
        )
        rows = (batch, kv_heads, length, groups, 1)
        return peak.reshape(rows), total.reshape(rows), out

    return jax.lax.cond(prefix, kernel, fallback)


def _native_block(block, rows: int):
    """The block with its quantized payloads and float page pools (through
    their block tables) and long 16-bit arrays read by kvlab.native's kernels
    (model.attention_impl='native'), or None where they cannot read them all.

    The kernels read a payload's packed codes in place, pools a page at a
    time, and 16-bit numbers widened in registers, up to the last slot any
    query sees, so the block is read whole instead of streamed. 16-bit arrays
    and pools are theirs only in a block XLA's path streams, whose products
    are float32 ones too (a short 16-bit block's queries and weights are
    rounded to 16 bits there, and stay so). Its other tensors must be float32
    arrays (which `_scores` and `_weighted_sum` give the kernels as they are).
    """
    from kvlab.cache import paged, quant  # noqa: PLC0415 (the cache package imports this one)

    k, v, mask = block
    tensors = (*_parts(k), v)
    readable = (quant.PayloadReader, paged.PagedPayloadReader, paged.PagedReader)
    arrays = [x for x in tensors if not isinstance(x, Reader)]
    if (
        not native.runs(rows)
        or any(isinstance(x, Reader) and not isinstance(x, readable) for x in tensors)
        or any(x.dtype not in (jnp.float32, *native.HALF) for x in arrays)
    ):
        return None
    widen = _streams(block, STREAM_TOKENS)  # never true of float32 arrays alone
    if len(arrays) == len(tensors) and not widen:
        return None
    limit = jnp.max(jnp.where(mask, jnp.arange(1, mask.shape[-1] + 1), 0))  # one past the last seen

    def swap(x):
        if isinstance(x, paged.PagedReader) and x.dtype != jnp.float32 and not widen:
            return x  # a short 16-bit pool: XLA's products, as for a short 16-bit array
        if isinstance(x, Reader):
            return x.native(limit, rows)
        return NativeRows(x, limit) if widen and _narrow(x) else x

    swapped = {id(x): swap(x) for x in tensors}  # a latent is keys and values
    if any(x is None for x in swapped.values()):
        return None
    keys = tuple(swapped[id(x)] for x in _parts(k))
    return (keys if isinstance(k, tuple) else keys[0], swapped[id(v)], mask)


@dataclasses.dataclass(frozen=True)
class NativeRows(ReadWhole):
    """A 16-bit array of keys or values read by kvlab.native's kernels, widened
    to float32 in registers as they read it (no float32 copy), whole (`step` is
    its length) and only up to `limit` tokens."""

    array: Array
    limit: Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.array.shape

    def scores(self, q: Array) -> Array:
        return native.scores(q.astype(jnp.float32), self.array, self.limit)

    def weighted_sum(self, w: Array) -> Array:
        return native.weighted_sum(w.astype(jnp.float32), self.array, self.limit)

    def dequantize(self) -> Array:
        return self.array.astype(jnp.float32)


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
    and averaged over each KV head's G query heads. `impl` "pallas" reads
    blocks of stored data (quantized payloads, page pools) with the Pallas
    kernels where they can (`_kernel`; model.attention_impl); "native" takes
    kvlab.native's CPU kernels for float32 products and quantized payloads
    (`_native_block`).
    """
    queries = _parts(q)
    batch, length, num_heads, _ = queries[0].shape
    # [B, K, S, H] keys and values (arrays or readers)
    num_kv_heads = blocks[0][1].shape[1]
    part_heads = [part.shape[1] for part in _parts(blocks[0][0])]
    for heads in (num_kv_heads, *part_heads):
        if num_heads % heads:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({heads})")
    groups = num_heads // num_kv_heads
    if impl == "native":  # queries per head: the most any part of a block has
        rows = length * num_heads // min(num_kv_heads, *part_heads)
        blocks = [_native_block(block, rows) or block for block in blocks]
    if scale is None:
        scale = sum(part.shape[-1] for part in queries) ** -0.5
    # [B, K_j, M_j, H_j] with M_j = T * N / K_j
    folded = [
        rearrange(part, "B T (K G) H -> B K (T G) H", K=heads)
        for part, heads in zip(queries, part_heads, strict=True)
    ]

    def grouped(s, heads):
        """[B, K_j, M_j, S] scores as [B, K, T, G, S] (K, G: the values' heads and groups)."""
        if heads == num_kv_heads:
            return s.reshape(batch, num_kv_heads, length, groups, -1)
        s = rearrange(s, "B K (T G) S -> B T (K G) S", K=heads, T=length)
        return rearrange(s, "B T (K G) S -> B K T G S", K=num_kv_heads)

    def block_scores(k, mask):
        """[B, K, T, G, S] scaled scores of the queries over one block's keys, masked."""
        s = sum(
            grouped(_scores(q_part, k_part, impl), heads)
            for q_part, k_part, heads in zip(folded, _parts(k), part_heads, strict=True)
        )
        mask = mask[:, None, :, None, :] if mask.ndim == 3 else mask
        return jnp.where(mask, s * scale, MASKED)

    def weighted(weights, v):
        """[B, K, T, G, S] weights over a block's values: float32 [B, K, M, Hv]."""
        return _weighted_sum(weights.reshape(batch, num_kv_heads, length * groups, -1), v, impl)

    shape = (batch, num_kv_heads, length, groups)

    def whole(block):
        """(peak, total, out) of one block read at once."""
        s = block_scores(block[0], block[2])
        peak = s.max(axis=-1, keepdims=True, initial=MASKED)
        weights = jnp.exp(s - peak)
        return peak, weights.sum(axis=-1, keepdims=True), weighted(weights, block[1])

    def partial(block):
        """(peak, total, out) of one stored block: by a kernel, streamed or whole."""
        if _streams(block, STREAM_TOKENS, length):
            fallback = lambda: _stream(*block, block_scores, weighted, STREAM_TOKENS, shape)  # noqa: E731
        else:
            fallback = lambda: whole(block)  # noqa: E731
        if impl == "pallas":
            done = _kernel(block, folded, part_heads, scale, shape, fallback)
            if done is not None:
                return done
        return fallback()

    def apart(block) -> bool:
        """Blocks attended on their own and merged after: long stored blocks
        (streamed) and, with the kernels, every block of stored data (so a
        short 16-bit block beside it rounds its weights as on XLA's path)."""
        if observe is not None:
            return False
        stored = impl in ("pallas", "native") and any(
            isinstance(x, Reader) for x in (*_parts(block[0]), block[1])
        )
        return stored or _streams(block, STREAM_TOKENS, length)

    def empty(blocks):
        """(peak, total, out) of no keys: merged with another partial, that one."""
        peak = jnp.full((*shape, 1), MASKED, jnp.float32)  # [B, K, T, G, 1]
        out = jnp.zeros((batch, num_kv_heads, length * groups, blocks[0][1].shape[3]), jnp.float32)
        return peak, jnp.zeros_like(peak), out

    def together(blocks):
        """(peak, total, out, weights) of blocks under one softmax; the weights
        (exp(score - peak), per block) only with `observe`."""
        scores = [block_scores(k, mask) for k, _, mask in blocks]
        peak, total, out = empty(blocks)
        for s in scores:
            peak = jnp.maximum(peak, s.max(axis=-1, keepdims=True, initial=MASKED))
        kept = []
        for s, (_, v, _) in zip(scores, blocks, strict=True):
            weights = jnp.exp(s - peak)
            total = total + weights.sum(axis=-1, keepdims=True)
            out = out + weighted(weights, v)  # [B, K, M, Hv]
            kept += [] if observe is None else [weights]
        return peak, total, out, kept

    def masses(weights, factor, total):
        """Per block, the mass its keys got (weights x factor / total) from `observe`
        (none without it: `together` keeps no weights then)."""
        if observe is None:
            return []
        query = observe.astype(jnp.float32) / groups
        return [jnp.einsum("BKTGS,BT->BKS", w * factor / total, query) for w in weights]

    def nothing(blocks):
        """In `together`'s form, blocks no query sees: an empty partial, and no mass."""
        kept = [jnp.zeros((*shape, v.shape[2]), jnp.float32) for _, v, _ in blocks]
        return *empty(blocks), kept if observe is not None else []

    separate = [block for block in blocks if apart(block)]
    blocks = [block for block in blocks if not apart(block)]
    if not blocks:
        peak = jnp.full((*shape, 1), MASKED, jnp.float32)
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
        old = jax.lax.cond(held, lambda: together(cached), lambda: nothing(cached))
        new = together(fresh)
        peak, total, out = _merge(old[:3], new[:3])
        mass = [
            *masses(old[3], jnp.exp(old[0] - peak), total),
            *masses(new[3], jnp.exp(new[0] - peak), total),
        ]
    else:
        peak, total, out, weights = together(blocks)
        mass = masses(weights, 1.0, total)
    for block in separate:  # merged into the others' softmax as in flash-decoding
        peak, total, out = _merge((peak, total, out), partial(block))
    out = out / total.reshape(batch, num_kv_heads, length * groups, 1)
    out = rearrange(out, "B K (T G) H -> B T (K G) H", T=length).astype(queries[0].dtype)
    return out if observe is None else (out, mass)
