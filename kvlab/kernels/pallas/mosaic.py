"""Pallas kernels for TPU (Mosaic): decode attention over one layer's stored tokens.

The same partial as `triton.stored_attention` (its docstring: folded query
parts, `Stored` keys and values, row lengths -> (acc, peak, total), merged with
`merge_partials`), laid out for a TPU's pipeline rather than a GPU's threads.

Grid (batch row, KV head, block of tokens). The row lengths and the block
tables are scalar-prefetched into SMEM, and every stored array's BlockSpec
index map picks from them the block a step reads: block i of the row (dense
rows) or the page the row's table names for block i (a pool: ragged paged
attention, one page per step). Pallas's pipeline copies the next step's
blocks HBM -> VMEM while this step computes (double buffering); a step past
the row's last visible block names that block again, so nothing is copied
for it, and its compute is skipped. Codes are unpacked and scaled in VMEM
(`tiles.dequantized`, the Triton kernel's math); the online softmax state
stays in VMEM scratch across a row's blocks and is written once, at the
row's last step. When the values are one of the key parts (absorbed latent
attention) the tile is loaded and dequantized once.

Blocks. With any tensor paged, a block is one page (every pool must then
have one page size). Dense rows are read in blocks of `block_tokens`
(default: the largest divisor of the capacity S that is a multiple of 8 and
of the channel-axis group sizes, up to `DEFAULT_BLOCK_TOKENS`; S itself when
there is none). An array whose block would not be a multiple of 8 rows
(Mosaic's sublane tiling; channel-axis scales hold block / group_size rows)
stays whole in VMEM for the row and is sliced in the kernel.

What is verified. Interpret mode on CPU equals the reference for every
storage kind (tests/kernels/test_pallas.py runs both kernels), and programs
lower to a `tpu_custom_call` under an abstract TPU device (tests/test_export.py:
jax's Mosaic lowering checks block shapes and that every operation has a
lowering). Not verified: libtpu's Mosaic compiler passes (layouts of narrow
widths, the uint8 unpacking, fp8 on chips without it), VMEM limits at long
contexts for arrays kept whole, and any timing; `scripts/device_check.py` is
the first thing to run on a TPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvlab.attention.core import MASKED
from kvlab.kernels.pallas import tiles
from kvlab.kernels.pallas.plan import (
    CallPlan,
    Partial,
    Stored,
    TensorPlan,
    empty_partial,
    parts,
    plan,
)

# Dense rows are read in blocks of at most this many tokens; not tuned on a TPU.
DEFAULT_BLOCK_TOKENS = 512
SUBLANES = 8  # a block's second-to-last axis is a multiple of this or the whole axis


def _refuse(argument: str, value, problem: str, fix: str):
    raise ValueError(f"mosaic.stored_attention: {argument}={value} {problem}: {fix}")


def _block_tokens(call: CallPlan, block_tokens) -> int:
    """The tokens one grid step reads (module docstring, "Blocks")."""
    tensors = [*call.keys, *([call.values] if call.values else [])]
    pages = {t.page_size for t in tensors if t.page_size}
    if len(pages) > 1:
        _refuse("page sizes", sorted(pages), "differ", "store the layer's tensors in one pool size")
    if pages:
        (page,) = pages
        if block_tokens not in (None, page):
            _refuse("block_tokens", block_tokens, f"is not the page size {page}", "pass None")
        return page
    unit = SUBLANES
    for t in tensors:
        if t.spec is not None and t.spec.axis == "channel":
            unit = math.lcm(unit, t.spec.group_size)
    if block_tokens is None:
        fits = [n for n in range(unit, DEFAULT_BLOCK_TOKENS + 1, unit) if call.tokens % n == 0]
        return fits[-1] if fits else call.tokens
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        _refuse("block_tokens", block_tokens, "is not a positive int", "pass None or e.g. 64")
    if call.tokens % block_tokens or (block_tokens % SUBLANES and block_tokens != call.tokens):
        _refuse(
            "block_tokens",
            block_tokens,
            f"does not divide the {call.tokens} slots in blocks of a multiple of {SUBLANES}",
            "pass None (the kernel's choice)",
        )
    return block_tokens


def _planned(queries, keys, values, lengths, scale, block_tokens, compute_dtype) -> tuple:
    """plan()'s checks and CallPlan, with this kernel's block of tokens."""
    arguments = (queries, keys, values, lengths, scale)
    call, tables = plan(*arguments, None, 1, compute_dtype, triton_tiles=False)
    size = _block_tokens(call, block_tokens)
    if size != call.block_tokens:
        call, tables = plan(*arguments, size, 1, compute_dtype, triton_tiles=False)
    return call, tables


def _arrays(stored: Stored, tensor: TensorPlan) -> list:
    arrays = [stored.data] + ([] if tensor.spec is None else [stored.scale])
    return arrays + ([stored.zero] if tensor.has_zero else [])


def _whole(tensor: TensorPlan, array: Array, call: CallPlan) -> bool:
    """Whether a dense array stays whole in VMEM for its row (its block's rows are
    not a multiple of the sublanes); pools are read a page at a time."""
    if tensor.page_size:
        return False
    block = call.block_tokens * array.shape[2] // call.tokens
    return block % SUBLANES != 0 and block != array.shape[2]


def _spec(tensor: TensorPlan, array: Array, call: CallPlan) -> pl.BlockSpec:
    """The block of one stored array a grid step (b, k, i) reads, from the prefetched
    lengths and tables: the last visible block for steps past it."""
    size = call.block_tokens

    def visible(b, i, lengths):
        return jnp.minimum(i, jnp.maximum((lengths[b] + size - 1) // size - 1, 0))

    if tensor.page_size:
        pages = array.shape[1]

        def page(b, k, i, lengths, *tables):
            table = tables[tensor.table]
            return k, jnp.clip(table[b, visible(b, i, lengths)], 0, pages - 1), 0, 0

        return pl.BlockSpec((None, None, *array.shape[2:]), page)
    if _whole(tensor, array, call):
        return pl.BlockSpec((None, None, *array.shape[2:]), lambda b, k, i, *_: (b, k, 0, 0))
    rows = size * array.shape[2] // call.tokens
    return pl.BlockSpec(
        (None, None, rows, array.shape[3]),
        lambda b, k, i, lengths, *_: (b, k, visible(b, i, lengths), 0),
    )


def _kernel(*refs, call: CallPlan, whole: tuple):
    """One (row, KV head, block): fold the block into the row's online softmax."""
    lengths_ref, *refs = refs
    refs = refs[call.tables :]  # the tables only steer the index maps
    queries, refs = refs[: len(call.keys)], refs[len(call.keys) :]
    *refs, acc_out, peak_out, total_out, acc_ref, peak_ref, total_ref = refs
    size, i = call.block_tokens, pl.program_id(2)
    length = lengths_ref[pl.program_id(0)]

    @pl.when(i == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        peak_ref[...] = jnp.full(peak_ref.shape, MASKED, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)

    def tile(tensor: TensorPlan, own: list, kept: tuple) -> Array:
        loaded = []
        for ref, is_whole in zip(own, kept, strict=True):
            rows = size * ref.shape[0] // call.tokens if is_whole else ref.shape[0]
            loaded.append(ref[pl.ds(i * rows, rows), :] if is_whole else ref[...])
        data, *scales = loaded
        return tiles.narrowed(tiles.dequantized(tensor, data, scales, size), call)

    @pl.when(i * size < length)
    def _block():
        tensors = [*call.keys, *([call.values] if call.values else [])]
        own, rest, kept = [], list(refs), list(whole)
        for tensor in tensors:
            count = 1 if tensor.spec is None else 2 + tensor.has_zero
            own.append((tensor, rest[:count], tuple(kept[:count])))
            rest, kept = rest[count:], kept[count:]
        keys = [tile(*entry) for entry in own[: len(call.keys)]]
        value = keys[call.value_part] if call.values is None else tile(*own[-1])
        visible = (i * size + jnp.arange(size)) < length
        carry = (acc_ref[...], peak_ref[...][:, 0], total_ref[...][:, 0])
        q = [ref[...] for ref in queries]
        acc, peak, total = tiles.softmax_step(carry, q, keys, value, visible, call)
        acc_ref[...] = acc
        peak_ref[...] = peak[:, None]
        total_ref[...] = total[:, None]

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        acc_out[...] = acc_ref[...]
        peak_out[...] = peak_ref[...]
        total_out[...] = total_ref[...]


@functools.partial(jax.jit, static_argnames=("call", "interpret"))
def _run(queries, keys, values, lengths, tables, call: CallPlan, interpret: bool):
    batch, heads, num_queries, _ = queries[0].shape
    padded = [
        jnp.pad(q, ((0, 0), (0, 0), (0, call.queries - num_queries), (0, 0))) for q in queries
    ]
    value_width = (call.values or call.keys[call.value_part]).width
    stored = [*zip(keys, call.keys, strict=True)]
    if call.values is not None:
        stored.append((values, call.values))
    arrays = list(padded)
    specs = [
        pl.BlockSpec((None, None, call.queries, q.shape[3]), lambda b, k, i, *_: (b, k, 0, 0))
        for q in padded
    ]
    whole = []
    for s, tensor in stored:
        for array in _arrays(s, tensor):
            arrays.append(array)
            specs.append(_spec(tensor, array, call))
            whole.append(_whole(tensor, array, call))
    rows = (batch, heads, call.queries)

    def out(width: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, None, call.queries, width), lambda b, k, i, *_: (b, k, 0, 0))

    acc, peak, total = pl.pallas_call(
        functools.partial(_kernel, call=call, whole=tuple(whole)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1 + len(tables),
            grid=(batch, heads, call.tokens // call.block_tokens),
            in_specs=specs,
            out_specs=[out(value_width), out(1), out(1)],
            scratch_shapes=[
                pltpu.VMEM((call.queries, value_width), jnp.float32),
                pltpu.VMEM((call.queries, 1), jnp.float32),
                pltpu.VMEM((call.queries, 1), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((*rows, value_width), jnp.float32),
            jax.ShapeDtypeStruct((*rows, 1), jnp.float32),
            jax.ShapeDtypeStruct((*rows, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="stored_attention",
    )(lengths.astype(jnp.int32), *[t.astype(jnp.int32) for t in tables], *arrays)
    return acc[:, :, :num_queries], peak[:, :, :num_queries], total[:, :, :num_queries]


def takes(q, keys, values, lengths, *, scale: float, interpret: bool) -> bool:
    """Whether stored_attention takes these arguments, compiled or interpreted: every
    pool of one page size (module docstring, "Blocks")."""
    del interpret  # the interpreter runs the same blocks
    queries, keys = parts(q, keys)
    try:
        _planned(queries, keys, values, lengths, scale, None, "float32")
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
    compute_dtype: str = "float32",
    interpret: bool = False,
) -> Partial:
    """Partial softmax attention of folded queries over one layer's stored tokens, on
    a TPU (`triton.stored_attention`'s arguments and result; blocks: module docstring).
    `interpret=True` runs the Pallas interpreter (any backend). Arguments are checked
    before anything is traced (ValueError naming the argument, its value and the fix).
    """
    queries, keys = parts(q, keys)
    call, tables = _planned(queries, keys, values, lengths, scale, block_tokens, compute_dtype)
    if call.tokens == 0:
        return empty_partial(queries, call)
    values = None if call.values is None else values
    return _run(queries, keys, values, lengths, tuple(tables), call, interpret)
