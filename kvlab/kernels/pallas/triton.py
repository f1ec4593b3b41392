"""Pallas kernels for decode attention over one layer's stored tokens: dense, paged, quantized.

Flash-decoding (FlashAttention-2, arXiv:2307.08691; split-K decoding) over the
cache layouts of docs/caches.md ("The cache pytree"): dense rows [B, K, S, X],
page pools [K, P, L, X] read through block tables (PagedAttention,
arXiv:2309.06180), and packed 8/4/2-bit or fp8 codes with their scales
(KIVI, arXiv:2402.02750). The kernel reads the codes and scales as stored and
dequantizes one block of tokens at a time in registers, so no dequantized copy
of the cache is ever written to memory.

    stored_attention(q, keys, values, lengths, scale=...) -> (acc, peak, total)
    q       tuple of float [B, K, M, H_j]   queries folded as core.attend folds them (M = T x G)
    keys    tuple of Stored, one per part    K heads, width H_j each
    values  Stored                           K heads, width Hv (may be keys[j] itself: a latent)
    lengths int[B]                           row b sees its tokens 0..lengths[b]-1
    acc     float32[B, K, M, Hv]             sum over visible tokens of exp(s - peak) v
    peak    float32[B, K, M, 1]              max visible score s (core.MASKED if none)
    total   float32[B, K, M, 1]              sum over visible tokens of exp(s - peak)

so out = acc / total, and partials over disjoint token sets combine by the
online-softmax rule (`merge_partials`): the cache's partial with the ring's and
the step's own tokens. A row that sees nothing gives (0, MASKED, 0), which
merges as nothing; core.attend, given only that block, would instead spread a
uniform softmax over every slot (a decode query always sees at least itself,
so the merged result never hits this).

The score of a query against token i is scale x sum_j q_j . k_j[i], float32,
as `kvlab.attention.core.attend` computes it for one block with mask
`arange(S) < lengths[:, None]`: against 16-bit tensors the query is cast to
the tensor's dtype and the probabilities to the values' dtype (attend's
casts); against quantized tensors everything is float32 with
`kvlab.cache.quant`'s own `unpack` and `dequantize` (PayloadReader's math:
int codes times scale plus zero, symmetric codes offset by 2^(b-1), fp8 e4m3
codes; token-axis groups of group_size channels, channel-axis groups of
group_size tokens).

Kernel. Grid (batch row, KV head, sequence split). Each program takes the
row's length and walks its split's tokens in blocks of `block_tokens`,
stopping at the row's length (blocks past it are never read): per block it
looks up the block's pages in the row's block table (pools) or slices the rows
(dense, with a masked load at the ragged end), loads the packed codes and
their scales, unpacks them with shifts and masks, multiplies every query part
with its key tile, keeps the online softmax (running max, sum, weighted sum of
the value tile) and writes one partial. The splits' partials merge in XLA
(`num_splits` > 1 is flash-decoding's split-K, for grids too small to fill a
GPU: batch 1, one latent head). When `values` is one of the key parts (absorbed
latent attention) the tile is loaded and unpacked once. The queries of one KV
head (padded to a power of two >= 16) are processed together, so the kernel
is meant for decode and short chunks (M = T x G small).

What is verified. The kernels are written for the Pallas Triton backend
(`jax.experimental.pallas.triton`): whole-pool block specs with gathered page
loads `pool_ref[page_ids]`, masked loads at ragged ends, `lax.dot_general`
with float32 accumulation (IEEE precision for float32 operands). They are
tested only in Pallas interpret mode on CPU (tests/attention/test_pallas.py:
equal to a pure jnp reference and to core.attend for every cache kind and
bit-width) and lowered, on CPU, to Triton IR for a CUDA target (`jax.export`
with platforms=['cuda'], compute capability 9.0 assumed), which checks that
every operation has a Triton lowering, every loaded tile is a power of two
and the module verifies. They have NOT been compiled by Triton to PTX or run
on a GPU, and no block size, split count or num_warps/num_stages has been
timed.

Reading a layer. A 16-bit cache (DenseLayer rows or PagedLayer pools with the
block tables) takes `lengths` = the rows' lengths before the step; a
QuantizedLayer's payload (`Stored.of(tensor)`, pools with their block tables)
takes the settled lengths `layout.settled(lengths)`; the ring, the step's own
tokens and the settling group stay with the XLA path, merged by
`merge_partials`. Per-head masks (evicting layers) are not taken.

Limits. Triton tiles must be powers of two: with `interpret=False` widths,
packed widths, scale widths, page sizes and `block_tokens` that are not (or
block_tokens < 16, tl.dot's smallest side) are refused before tracing;
interpret mode takes any shape. A width under 16 is contracted by multiply
and sum instead of tl.dot. With float32 products (the default, the XLA
path's numbers) tl.dot runs without tensor cores on queries padded to 16
rows, so on a GPU the products may cost more than reading the codes;
`compute_dtype="bfloat16"` (tensor cores, float32 sums) is the expected
choice there, unmeasured. Every key part and the values have the same K
heads (attend also allows a part with fewer). TPU: mosaic.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from kvlab.attention.core import MASKED
from kvlab.kernels.pallas import tiles
from kvlab.kernels.pallas.plan import (
    DEFAULT_BLOCK_TOKENS,
    CallPlan,
    Partial,
    Stored,
    TensorPlan,
    empty_partial,
    merge_partials,
    parts,
    plan,
)

# Block tokens, num_warps and num_stages by the widest head a call reads and the
# products' dtype (a wider head keeps fewer tokens in registers; bfloat16 tiles
# are half the bytes). Starting points, none timed on a GPU: scripts/
# device_check.py is where to tune them.
TUNING = {
    # (widest head <=, compute dtype): (block_tokens, num_warps, num_stages)
    (64, "float32"): (64, 4, 2),
    (64, "bfloat16"): (64, 4, 3),
    (128, "float32"): (32, 4, 2),
    (128, "bfloat16"): (64, 4, 3),
    (256, "float32"): (16, 8, 2),
    (256, "bfloat16"): (32, 8, 2),
}
WIDER = (16, 8, 1)  # heads wider than the table's (a latent of 512)


def tuning(width: int, compute: str) -> tuple[int, int, int]:
    """(block_tokens, num_warps, num_stages) for heads up to `width` wide (TUNING)."""
    fits = [key for key in TUNING if key[1] == compute and width <= key[0]]
    return TUNING[min(fits)] if fits else WIDER


def _widest(call: CallPlan) -> int:
    return max(t.width for t in (*call.keys, *([call.values] if call.values else [])))


def _rows(ref, first, size: int) -> Array:
    """Rows first..first+size-1 of a [N, X] ref; rows past N read 0 (a ragged last block)."""
    inside = (first + jnp.arange(size)) < ref.shape[0]
    return plgpu.load(ref.at[pl.ds(first, size), :], mask=inside[:, None], other=0)


def _page_ids(table_ref, first, call: CallPlan, page_size: int, num_pages: int) -> Array:
    """The pages holding tokens first..first+block_tokens-1 of this row (-1 reads page 0)."""
    count = call.block_tokens // page_size
    start = first // page_size
    inside = (start + jnp.arange(count)) < table_ref.shape[0]
    ids = plgpu.load(table_ref.at[pl.ds(start, count)], mask=inside, other=0)
    return jnp.clip(ids, 0, num_pages - 1)


def _tile(tensor: TensorPlan, refs, tables, first, call: CallPlan) -> Array:
    """One block of tokens [block_tokens, width] in the products' dtype: pages gathered
    through the block table, or rows sliced (masked at the ragged end), then dequantized."""
    size = call.block_tokens
    data_ref, *scale_refs = refs
    rows = tiles.scale_rows(tensor, size)
    if tensor.page_size:
        ids = _page_ids(
            tables[tensor.table], first, call, tensor.page_size, num_pages=data_ref.shape[0]
        )
        data = data_ref[ids].reshape(size, tensor.packed)  # [pages, L, X] -> [block, X]
        scales = [r[ids].reshape(rows, tensor.scale_width) for r in scale_refs]
    else:
        data = _rows(data_ref, first, size)
        scales = [_rows(r, first // (size // rows), rows) for r in scale_refs]
    return tiles.narrowed(tiles.dequantized(tensor, data, scales, size), call)


def _kernel(*refs, call: CallPlan):
    """One (row, KV head, split): online softmax over the split's visible blocks."""
    lengths_ref, *refs = refs
    tables, refs = refs[: call.tables], refs[call.tables :]
    queries, refs = refs[: len(call.keys)], refs[len(call.keys) :]
    *refs, acc_ref, peak_ref, total_ref = refs
    inputs = []  # per tensor (keys, then values unless shared): its refs
    for tensor in (*call.keys, *([call.values] if call.values else [])):
        count = 1 if tensor.spec is None else 2 + tensor.has_zero
        inputs.append(refs[:count])
        refs = refs[count:]

    start = pl.program_id(2) * call.split_tokens
    end = jnp.minimum(lengths_ref[0], jnp.minimum(start + call.split_tokens, call.tokens))
    num_blocks = jnp.maximum(end - start, 0)
    num_blocks = (num_blocks + call.block_tokens - 1) // call.block_tokens
    q = [ref[...] for ref in queries]  # [M, H_j]

    def block(i, carry):
        first = start + i * call.block_tokens
        visible = (first + jnp.arange(call.block_tokens)) < end  # [block]
        keys = [
            _tile(tensor, own, tables, first, call)
            for tensor, own in zip(call.keys, inputs[: len(q)], strict=True)
        ]
        if call.values is None:
            value = keys[call.value_part]
        else:
            value = _tile(call.values, inputs[-1], tables, first, call)
        return tiles.softmax_step(carry, q, keys, value, visible, call)

    init = (
        jnp.zeros(acc_ref.shape, jnp.float32),
        jnp.full(peak_ref.shape, MASKED, jnp.float32),
        jnp.zeros(total_ref.shape, jnp.float32),
    )
    acc, peak, total = jax.lax.fori_loop(0, num_blocks, block, init)
    acc_ref[...] = acc
    peak_ref[...] = peak
    total_ref[...] = total


def _stored_specs(stored: Stored, tensor: TensorPlan) -> tuple[list, list]:
    """The arrays a Stored passes to the kernel and their block specs (grid b, k, s)."""
    arrays = [stored.data] + ([] if tensor.spec is None else [stored.scale])
    if tensor.has_zero:
        arrays.append(stored.zero)
    if tensor.page_size:  # the head's whole pool; pages are gathered inside
        specs = [pl.BlockSpec((None, *a.shape[1:]), lambda b, k, s: (k, 0, 0, 0)) for a in arrays]
    else:  # the row's and head's whole [S, X]; blocks are sliced inside
        specs = [
            pl.BlockSpec((None, None, *a.shape[2:]), lambda b, k, s: (b, k, 0, 0)) for a in arrays
        ]
    return arrays, specs


@functools.partial(jax.jit, static_argnames=("call", "interpret"))
def _run(queries, keys, values, lengths, tables, call: CallPlan, interpret: bool):
    batch, heads, num_queries, _ = queries[0].shape
    padded = [
        jnp.pad(q, ((0, 0), (0, 0), (0, call.queries - num_queries), (0, 0))) for q in queries
    ]
    value_width = (call.values or call.keys[call.value_part]).width
    arrays = [lengths.astype(jnp.int32)] + [t.astype(jnp.int32) for t in tables] + padded
    specs = [pl.BlockSpec((1,), lambda b, k, s: (b,))]
    specs += [pl.BlockSpec((None, t.shape[1]), lambda b, k, s: (b, 0)) for t in tables]
    specs += [
        pl.BlockSpec((None, None, call.queries, q.shape[3]), lambda b, k, s: (b, k, 0, 0))
        for q in padded
    ]
    stored = [*zip(keys, call.keys, strict=True)]
    if call.values is not None:
        stored.append((values, call.values))
    for s, tensor in stored:
        more_arrays, more_specs = _stored_specs(s, tensor)
        arrays += more_arrays
        specs += more_specs
    rows = (batch, heads, call.splits, call.queries)
    _, num_warps, num_stages = tuning(_widest(call), call.compute)
    acc, peak, total = pl.pallas_call(
        functools.partial(_kernel, call=call),
        grid=(batch, heads, call.splits),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec(
                (None, None, None, call.queries, value_width), lambda b, k, s: (b, k, s, 0, 0)
            ),
            pl.BlockSpec((None, None, None, call.queries), lambda b, k, s: (b, k, s, 0)),
            pl.BlockSpec((None, None, None, call.queries), lambda b, k, s: (b, k, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*rows, value_width), jnp.float32),
            jax.ShapeDtypeStruct(rows, jnp.float32),
            jax.ShapeDtypeStruct(rows, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="stored_attention",
    )(*arrays)
    # The splits' partials: [B, K, splits, M(, Hv)] -> one [B, K, M, .] partial.
    splits = [
        (
            acc[:, :, i, :num_queries],
            peak[:, :, i, :num_queries, None],
            total[:, :, i, :num_queries, None],
        )
        for i in range(call.splits)
    ]
    return merge_partials(*splits)


def takes(q, keys, values, lengths, *, scale: float, interpret: bool) -> bool:
    """Whether stored_attention takes these arguments: compiled, its tiles must be
    powers of two (module docstring, "Limits"), which the interpreter does not ask."""
    if interpret:
        return True
    queries, keys = parts(q, keys)
    try:
        plan(queries, keys, values, lengths, scale, None, 1, "float32", triton_tiles=True)
    except ValueError:
        return False
    return True


def stored_attention(
    q: Float[Array, "B K M H"] | Sequence[Float[Array, "B K M _"]],
    keys: Stored | Sequence[Stored],
    values: Stored,
    lengths: Int[Array, " B"],
    *,
    scale: float,
    block_tokens: int | None = None,
    num_splits: int = 1,
    compute_dtype: str = "float32",
    interpret: bool = False,
) -> Partial:
    """Partial softmax attention of folded queries over one layer's stored tokens.

    q: query parts [B, K, M, H_j] (an array is one part); keys: one Stored per
    part, K heads and width H_j; values: a Stored of width Hv, or one of the
    `keys` objects itself (latent attention: read once). Row b sees its tokens
    0..lengths[b]-1. Returns (acc [B, K, M, Hv], peak [B, K, M, 1],
    total [B, K, M, 1]), float32 (module docstring). `block_tokens` (default:
    TUNING's for the widest head and the products' dtype, rounded up to the page
    and channel group sizes; num_warps and num_stages too) must hold whole pages
    and channel-axis scale groups; `num_splits` cuts each row's tokens into
    that many programs whose partials merge at the end. `compute_dtype`
    "bfloat16" rounds every tile (dequantized codes or float32 numbers), the
    queries and the probabilities to bfloat16 before each product, sums staying
    float32 (tensor cores on a GPU; the error of a bfloat16 cache); "float32"
    (default) keeps the XLA path's numbers. `interpret=True` runs
    the Pallas interpreter (any backend); otherwise the Triton GPU backend.
    Arguments are checked before anything is traced (ValueError naming the
    argument, its value and the fix).
    """
    queries, keys = parts(q, keys)
    arguments = (queries, keys, values, lengths, scale, block_tokens, num_splits, compute_dtype)
    call, tables = plan(*arguments, triton_tiles=not interpret)
    target = tuning(_widest(call), call.compute)[0]
    if block_tokens is None and target != DEFAULT_BLOCK_TOKENS:
        call, tables = plan(*arguments, triton_tiles=not interpret, target_block=target)
    if call.tokens == 0:
        return empty_partial(queries, call)
    values = None if call.values is None else values
    return _run(queries, keys, values, lengths, tuple(tables), call, interpret)
