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
heads (attend also allows a part with fewer). TPU (Mosaic) is not targeted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from kvlab.attention.core import MASKED
from kvlab.cache.quant import QuantizedTensor, Storage, dequantize, unpack

# Blocks of this many tokens unless `block_tokens` says otherwise (rounded up to
# the page size and channel group size); not tuned on a GPU.
DEFAULT_BLOCK_TOKENS = 64
# tl.dot's smallest M, N and K; queries are padded to it, narrower widths contract by hand.
DOT_MIN = 16
TRITON_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)  # untuned
# The products' operands: float32 (the XLA path's numbers) or bfloat16 (tensor cores).
COMPUTE_DTYPES = ("float32", "bfloat16")


@struct.dataclass
class Stored:
    """One cached tensor of a layer as it is stored (docs/caches.md, "The cache pytree").

    data   dense [B, K, S, X] or a page pool [K, P, L, X]; X = width at 16 bits
           (the cache dtype), width * bits / 8 packed codes (uint8) below
    scale  quantized: [B, K, S, width / group_size] (token axis) or
           [B, K, S / group_size, width] (channel axis); pools [K, P, L, .] and
           [K, P, L / group_size, width]; None at 16 bits
    zero   as scale; None when symmetric, fp8 or 16-bit
    spec   kvlab.cache.quant.Storage (static); None (or bits=16): a 16-bit tensor
    pages  int32[B, n] block tables when data is a pool (-1: no page), else None
    """

    data: Array
    scale: Array | None = None
    zero: Array | None = None
    spec: Storage | None = struct.field(pytree_node=False, default=None)
    pages: Array | None = None

    @classmethod
    def of(cls, tensor: QuantizedTensor, pages: Array | None = None) -> Stored:
        """The settled part of a QuantizedTensor (dense, or pools with `pages`)."""
        spec = tensor.spec if tensor.spec.quantized else None
        return cls(tensor.payload, tensor.scale, tensor.zero, spec, pages)


Partial = tuple[Float[Array, "B K M Hv"], Float[Array, "B K M 1"], Float[Array, "B K M 1"]]


def merge_partials(*partials: Partial) -> Partial:
    """(acc, peak, total) of the union of disjoint token sets, from each set's partial."""
    peak = functools.reduce(jnp.maximum, [p for _, p, _ in partials])
    acc, total = 0.0, 0.0
    for a, p, t in partials:
        correction = jnp.exp(p - peak)
        acc = acc + a * correction
        total = total + t * correction
    return acc, peak, total


# ---------------------------------------------------------------------------
# Static description of a call (checked before tracing)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How the kernel reads one Stored (static)."""

    spec: Storage | None  # None: 16-bit
    width: int  # numbers per token and head
    packed: int  # X: entries per token and head as stored
    scale_width: int  # last axis of scale/zero (0 at 16 bits)
    page_size: int  # L, 0 when dense
    table: int  # which block table (paged), -1 when dense
    has_zero: bool


@dataclasses.dataclass(frozen=True)
class _Call:
    """Everything static about one stored_attention call."""

    keys: tuple[_Tensor, ...]
    values: _Tensor | None  # None: the values are keys[value_part]
    value_part: int  # -1 unless the values are a key part
    tables: int  # distinct block tables passed
    tokens: int  # S: slots each row may hold
    queries: int  # M padded (>= DOT_MIN, a power of two)
    block_tokens: int
    split_tokens: int  # tokens per sequence split, a multiple of block_tokens
    splits: int
    scale: float
    compute: str  # dtype of the products' operands: "float32" | "bfloat16"


def _fail(argument: str, value, problem: str, fix: str):
    raise ValueError(f"stored_attention: {argument}={value} {problem}: {fix}")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _shape(x) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _layout(
    stored: Stored, name: str, batch: int, heads: int, tables: list
) -> tuple[int, int, int]:
    """(table, page size, token capacity) of a Stored's dense rows or page pool; a
    pool's block table joins `tables` unless the same array is already there."""
    data, pages = stored.data, stored.pages
    if pages is None:
        if data.shape[:2] != (batch, heads):
            _fail(
                f"{name}.data.shape",
                data.shape,
                f"does not start with (B, K) = {(batch, heads)} of the queries",
                "pass the layer's [B, K, S, X] rows, or a pool with its block tables as pages",
            )
        return -1, 0, data.shape[2]
    if len(_shape(pages)) != 2 or pages.shape[0] != batch:
        _fail(
            f"{name}.pages.shape",
            _shape(pages),
            f"is not [B, n] with B={batch}",
            "pass the cache's block_tables, one row per batch row",
        )
    if not jnp.issubdtype(pages.dtype, jnp.integer):
        _fail(f"{name}.pages.dtype", pages.dtype, "is not an integer type", "pass int32 pages")
    if data.shape[0] != heads:
        _fail(
            f"{name}.data.shape",
            data.shape,
            f"is not a pool [K, P, L, X] with K={heads} heads",
            "pass the layer's page pool for this tensor",
        )
    table = next((i for i, t in enumerate(tables) if t is pages), len(tables))
    if table == len(tables):
        tables.append(pages)
    page_size = data.shape[2]
    return table, page_size, pages.shape[1] * page_size


def _unquantized(stored: Stored, name: str) -> tuple[int, int, bool]:
    """(width, scale width, has zero) of a 16-bit tensor: float numbers, no scales."""
    data = stored.data
    if not jnp.issubdtype(data.dtype, jnp.floating):
        _fail(
            f"{name}.data.dtype",
            data.dtype,
            "is not a float type, but spec is None (a 16-bit tensor)",
            "pass the QuantizedTensor's spec with its codes (Stored.of(tensor))",
        )
    for field in ("scale", "zero"):
        if getattr(stored, field) is not None:
            _fail(
                f"{name}.{field}",
                "an array",
                "is given for a 16-bit tensor",
                "pass spec for quantized codes, or scale=None and zero=None",
            )
    return data.shape[3], 0, False


def _quantized(
    stored: Stored, name: str, spec: Storage, batch: int, heads: int
) -> tuple[int, int, bool]:
    """(width, scale width, has zero) of packed codes: their dtype and bit-width, and
    the scales' (and zeros') shapes for the spec's axis and group size."""
    data, pages = stored.data, stored.pages
    if spec.bits not in (8, 4, 2) or (spec.format == "fp8" and spec.bits != 8):
        _fail(
            f"{name}.spec.bits",
            spec.bits,
            f"is not a stored bit-width of format {spec.format!r}",
            "use 8, 4 or 2 bits for int codes and 8 for fp8",
        )
    if data.dtype != jnp.uint8:
        _fail(
            f"{name}.data.dtype",
            data.dtype,
            f"is not uint8 but spec says {spec.bits}-bit codes",
            "pass the packed payload (or spec=None for a 16-bit tensor)",
        )
    width = data.shape[3] * 8 // spec.bits
    gs = spec.group_size
    head = (heads, data.shape[1]) if pages is not None else (batch, heads)
    if spec.axis == "token":
        if width % gs:
            _fail(
                f"{name}.spec.group_size",
                gs,
                f"does not divide the width {width}",
                "pass the spec the codes were quantized with",
            )
        rows, scale_width = data.shape[2], width // gs
    else:
        if data.shape[2] % gs:
            what = "page_size" if pages is not None else "rows S"
            _fail(
                f"{name}.data.shape",
                data.shape,
                f"has {what}={data.shape[2]}, not a multiple of group_size={gs} "
                "(channel-axis scales cover group_size tokens)",
                "pass the payload the scales were computed over",
            )
        rows, scale_width = data.shape[2] // gs, width
    _check_scales(stored, name, spec, (*head, rows, scale_width))
    return width, scale_width, spec.has_zero


def _check_scales(stored: Stored, name: str, spec: Storage, expected: tuple) -> None:
    """The scale (and, where the spec has a zero point, the zero) of shape `expected`;
    no zero where it has none."""
    gs = spec.group_size
    for field, needed in (("scale", True), ("zero", spec.has_zero)):
        array = getattr(stored, field)
        if not needed:
            if array is not None:
                _fail(
                    f"{name}.zero",
                    "an array",
                    f"is given but spec (format {spec.format!r}, symmetric="
                    f"{spec.symmetric}) has no zero point",
                    "pass zero=None",
                )
            continue
        if array is None or _shape(array) != expected:
            _fail(
                f"{name}.{field}.shape",
                None if array is None else _shape(array),
                f"is not {expected} for {spec.axis}-axis scales with group_size={gs}",
                f"pass the QuantizedTensor's {field} (or its pool) with the codes",
            )


def _check_tiles(name: str, shape: tuple, sizes: dict) -> None:
    """The Triton backend's tiles: every size (widths, page size) a power of two."""
    for what, size in sizes.items():
        if not _power_of_two(size):
            _fail(
                f"{name}.data.shape",
                shape,
                f"gives a {what} of {size}, not a power of two, which the Triton "
                "backend's tiles need",
                "use power-of-two widths and page sizes, or interpret=True",
            )


def _describe(
    stored, name: str, batch: int, heads: int, tables: list, interpret: bool
) -> tuple[_Tensor, int]:
    """The static reading of one Stored and its token capacity; refuses what does not fit."""
    if not isinstance(stored, Stored):
        _fail(name, type(stored).__name__, "is not a Stored", "wrap arrays as Stored(data, ...)")
    data, spec = stored.data, stored.spec
    if spec is not None and not spec.quantized:
        spec = None
    if len(_shape(data)) != 4:
        _fail(
            f"{name}.data.shape",
            _shape(data),
            "is not 4-D",
            "pass dense [B, K, S, X] rows or a [K, P, L, X] page pool",
        )
    table, page_size, tokens = _layout(stored, name, batch, heads, tables)
    packed = data.shape[3]
    if spec is None:
        width, scale_width, has_zero = _unquantized(stored, name)
    else:
        width, scale_width, has_zero = _quantized(stored, name, spec, batch, heads)
    if not interpret:
        sizes = {"width": width, "packed width": packed}
        if scale_width:
            sizes["scale width"] = scale_width
        if page_size:
            sizes["page size"] = page_size
        _check_tiles(name, data.shape, sizes)
    tensor = _Tensor(spec, width, packed, scale_width, page_size, table, has_zero)
    return tensor, tokens


def _check_arguments(queries: tuple, keys: tuple, lengths, scale) -> None:
    """The query parts (float [B, K, M, H], one [B, K, M]), one key part per query
    part, int lengths [B] and a real scale."""
    if not queries:
        _fail("q", "()", "is empty", "pass one [B, K, M, H] array per key part")
    for j, part in enumerate(queries):
        if len(_shape(part)) != 4 or not jnp.issubdtype(part.dtype, jnp.floating):
            _fail(
                f"q[{j}]",
                f"{getattr(part, 'dtype', type(part).__name__)}{_shape(part)}",
                "is not a float [B, K, M, H] array",
                "fold the queries as core.attend does: 'B T (K G) H -> B K (T G) H'",
            )
        if part.shape[:3] != queries[0].shape[:3]:
            _fail(
                f"q[{j}].shape",
                part.shape,
                f"does not share [B, K, M] = {queries[0].shape[:3]} with q[0]",
                "fold every part with the same batch, KV heads and queries",
            )
    batch = queries[0].shape[0]
    if len(keys) != len(queries):
        _fail(
            "keys",
            f"{len(keys)} parts",
            f"do not match the {len(queries)} query parts",
            "pass one Stored per query part",
        )
    if _shape(lengths) != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        _fail(
            "lengths",
            f"{getattr(lengths, 'dtype', type(lengths).__name__)}{_shape(lengths)}",
            f"is not an int array of shape [B] = ({batch},)",
            "pass each row's visible token count as int32[B]",
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail("scale", scale, "is not a real number", "pass the softmax scale as a Python float")


def _describe_all(queries: tuple, keys: tuple, values, tables: list, interpret: bool) -> tuple:
    """(the keys' _Tensors, the values' _Tensor or None when they are a key part, that
    part or -1, the tensors' common token capacity)."""
    batch, heads = queries[0].shape[:2]
    described = [
        _describe(k, f"keys[{j}]", batch, heads, tables, interpret) for j, k in enumerate(keys)
    ]
    for j, ((tensor, _), part) in enumerate(zip(described, queries, strict=True)):
        if tensor.width != part.shape[3]:
            _fail(
                f"q[{j}].shape",
                part.shape,
                f"has width {part.shape[3]} but keys[{j}] holds width {tensor.width}",
                "pair each query part with the keys of its width",
            )
    value_part = next((j for j, k in enumerate(keys) if k is values), -1)
    if value_part >= 0:
        value_tensor = None
        capacities = [tokens for _, tokens in described]
    else:
        value_tensor, value_tokens = _describe(values, "values", batch, heads, tables, interpret)
        capacities = [tokens for _, tokens in described] + [value_tokens]
    if len(set(capacities)) != 1:
        _fail(
            "keys/values",
            f"token capacities {capacities}",
            "differ (dense S or n * page_size)",
            "pass tensors of one layer, cut to the same length",
        )
    return tuple(t for t, _ in described), value_tensor, value_part, capacities[0]


def _block_size(tensors: list, tokens: int, block_tokens, interpret: bool) -> int:
    """`block_tokens`, or the default for `tokens`; a block holds whole pages and whole
    channel-axis scale groups (and, for Triton, is a power of two >= DOT_MIN)."""
    unit = 1
    for t in tensors:
        unit = math.lcm(unit, t.page_size or 1)
        if t.spec is not None and t.spec.axis == "channel":
            unit = math.lcm(unit, t.spec.group_size)
    if block_tokens is None:
        target = max(DOT_MIN, min(DEFAULT_BLOCK_TOKENS, 1 << max(0, tokens - 1).bit_length()))
        block_tokens = unit * -(-target // unit)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        _fail("block_tokens", block_tokens, "is not a positive int", "pass e.g. 64, or None")
    if block_tokens % unit:
        _fail(
            "block_tokens",
            block_tokens,
            f"is not a multiple of {unit} (page sizes and channel-axis group sizes: a "
            "block holds whole pages and whole scale groups)",
            f"pass a multiple of {unit}",
        )
    if not interpret and (not _power_of_two(block_tokens) or block_tokens < DOT_MIN):
        _fail(
            "block_tokens",
            block_tokens,
            f"is not a power of two >= {DOT_MIN}, which the Triton backend's tiles need",
            f"pass {max(DOT_MIN, unit)} or another power of two, or interpret=True",
        )
    return block_tokens


def _compute_name(compute_dtype) -> str:
    """The products' dtype by name, one of COMPUTE_DTYPES."""
    try:
        compute = jnp.dtype(compute_dtype).name
    except TypeError:
        compute = None
    if compute not in COMPUTE_DTYPES:
        _fail(
            "compute_dtype",
            compute_dtype,
            "is not a dtype the products run in",
            f"pass one of {list(COMPUTE_DTYPES)}",
        )
    return compute


def _plan(
    queries, keys, values, lengths, scale, block_tokens, num_splits, compute_dtype, interpret
) -> tuple:
    """Checks every argument (shapes, dtypes, divisibility); returns the static _Call
    and the block tables. Runs before anything is traced."""
    _check_arguments(queries, keys, lengths, scale)
    num_queries = queries[0].shape[2]
    tables: list = []
    key_tensors, value_tensor, value_part, tokens = _describe_all(
        queries, keys, values, tables, interpret
    )
    tensors = list(key_tensors) + ([value_tensor] if value_tensor else [])
    block_tokens = _block_size(tensors, tokens, block_tokens, interpret)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        _fail("num_splits", num_splits, "is not a positive int", "pass 1, or more to split S")
    compute = _compute_name(compute_dtype)
    blocks = max(1, -(-tokens // block_tokens))
    split_tokens = -(-blocks // num_splits) * block_tokens
    splits = -(-blocks * block_tokens // split_tokens)  # none past the capacity (they'd be empty)
    call = _Call(
        keys=key_tensors,
        values=value_tensor,
        value_part=value_part,
        tables=len(tables),
        tokens=tokens,
        queries=max(DOT_MIN, 1 << max(0, num_queries - 1).bit_length()),
        block_tokens=block_tokens,
        split_tokens=split_tokens,
        splits=splits,
        scale=float(scale),
        compute=compute,
    )
    return call, tables


# ---------------------------------------------------------------------------
# The kernel


def _contract(a: Array, b: Array, dims: tuple[int, int]) -> Array:
    """float32 a . b over a's axis dims[0] and b's axis dims[1] (2-D operands of one
    dtype): tl.dot where every side is at least DOT_MIN, else multiply and sum."""
    out_a, out_b = a.shape[1 - dims[0]], b.shape[1 - dims[1]]
    if min(out_a, out_b, a.shape[dims[0]]) >= DOT_MIN:
        return jax.lax.dot_general(
            a, b, (((dims[0],), (dims[1],)), ((), ())), preferred_element_type=jnp.float32
        )
    a = a.astype(jnp.float32) if dims[0] == 1 else a.astype(jnp.float32).T  # [out_a, n]
    b = b.astype(jnp.float32) if dims[1] == 1 else b.astype(jnp.float32).T  # [out_b, n]
    return jnp.sum(a[:, None, :] * b[None, :, :], axis=-1)


def _rows(ref, first, size: int) -> Array:
    """Rows first..first+size-1 of a [N, X] ref; rows past N read 0 (a ragged last block)."""
    inside = (first + jnp.arange(size)) < ref.shape[0]
    return plgpu.load(ref.at[pl.ds(first, size), :], mask=inside[:, None], other=0)


def _page_ids(table_ref, first, call: _Call, page_size: int, num_pages: int) -> Array:
    """The pages holding tokens first..first+block_tokens-1 of this row (-1 reads page 0)."""
    count = call.block_tokens // page_size
    start = first // page_size
    inside = (start + jnp.arange(count)) < table_ref.shape[0]
    ids = plgpu.load(table_ref.at[pl.ds(start, count)], mask=inside, other=0)
    return jnp.clip(ids, 0, num_pages - 1)


def _tile(tensor: _Tensor, refs, tables, first, call: _Call) -> Array:
    """One block of tokens [block_tokens, width]: the 16-bit numbers in their dtype, or
    the codes unpacked and scaled in float32 (PayloadReader's math)."""
    size = call.block_tokens
    spec = tensor.spec
    data_ref, *scale_refs = refs
    channel = spec is not None and spec.axis == "channel"
    scale_rows = size // spec.group_size if channel else size
    if tensor.page_size:
        ids = _page_ids(
            tables[tensor.table], first, call, tensor.page_size, num_pages=data_ref.shape[0]
        )
        data = data_ref[ids].reshape(size, tensor.packed)  # [pages, L, X] -> [block, X]
        scales = [r[ids].reshape(scale_rows, tensor.scale_width) for r in scale_refs]
    else:
        data = _rows(data_ref, first, size)
        scale_first = first // spec.group_size if channel else first
        scales = [_rows(r, scale_first, scale_rows) for r in scale_refs]
    if spec is None:
        return data
    codes = unpack(data, spec.bits)  # [block, width]
    if channel:  # one scale per channel and group of tokens
        grouped, axis = codes.reshape(scale_rows, spec.group_size, tensor.width), 1
    else:  # one scale per token and group of channels
        grouped, axis = codes.reshape(size, tensor.scale_width, spec.group_size), 2
    scale, zero = scales[0], (scales[1] if tensor.has_zero else None)
    return dequantize(grouped, scale, zero, spec, axis).reshape(size, tensor.width)


def _narrowed(tile: Array, call: _Call) -> Array:
    """A tile [block, W] in the products' dtype when that is narrower than its own."""
    dtype = jnp.dtype(call.compute)
    return tile.astype(dtype) if dtype.itemsize < tile.dtype.itemsize else tile


def _kernel(*refs, call: _Call):
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
        acc, peak, total = carry  # [M, Hv], [M], [M]
        first = start + i * call.block_tokens
        visible = (first + jnp.arange(call.block_tokens)) < end  # [block]
        scores = 0.0
        tiles = []
        for tensor, part, tensor_refs in zip(call.keys, q, inputs[: len(q)], strict=True):
            tile = _narrowed(_tile(tensor, tensor_refs, tables, first, call), call)
            tiles.append(tile)
            scores = scores + _contract(part.astype(tile.dtype), tile, (1, 1))  # [M, block]
        scores = jnp.where(visible[None, :], scores * call.scale, MASKED)
        new_peak = jnp.maximum(peak, scores.max(axis=-1))
        correction = jnp.exp(peak - new_peak)
        weights = jnp.where(visible[None, :], jnp.exp(scores - new_peak[:, None]), 0.0)
        if call.values is None:
            value = tiles[call.value_part]
        else:
            value = _narrowed(_tile(call.values, inputs[-1], tables, first, call), call)
        # Slots past the length may hold anything (a reused page, NaN codes): zero them.
        value = jnp.where(visible[:, None], value, jnp.zeros((), value.dtype))
        acc = acc * correction[:, None] + _contract(weights.astype(value.dtype), value, (1, 0))
        total = total * correction + weights.sum(axis=-1)
        return acc, new_peak, total

    init = (
        jnp.zeros(acc_ref.shape, jnp.float32),
        jnp.full(peak_ref.shape, MASKED, jnp.float32),
        jnp.zeros(total_ref.shape, jnp.float32),
    )
    acc, peak, total = jax.lax.fori_loop(0, num_blocks, block, init)
    acc_ref[...] = acc
    peak_ref[...] = peak
    total_ref[...] = total


def _stored_specs(stored: Stored, tensor: _Tensor) -> tuple[list, list]:
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
def _run(queries, keys, values, lengths, tables, call: _Call, interpret: bool):
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
        compiler_params=TRITON_PARAMS,
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


def compiles(q, keys, values, lengths, *, scale: float) -> bool:
    """Whether the Triton kernel (interpret=False) takes these stored_attention
    arguments: its tiles must be powers of two (module docstring, "Limits"),
    which the interpreter does not ask."""
    queries = tuple(q) if isinstance(q, (tuple, list)) else (q,)
    keys = (keys,) if isinstance(keys, Stored) else tuple(keys)
    try:
        _plan(queries, keys, values, lengths, scale, None, 1, "float32", False)
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
    64 rounded up to the page and channel group sizes) must hold whole pages
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
    queries = tuple(q) if isinstance(q, (tuple, list)) else (q,)
    keys = (keys,) if isinstance(keys, Stored) else tuple(keys)
    call, tables = _plan(
        queries, keys, values, lengths, scale, block_tokens, num_splits, compute_dtype, interpret
    )
    if call.tokens == 0:  # nothing stored: the empty partial
        batch, heads, num_queries, _ = queries[0].shape
        rows = (batch, heads, num_queries, 1)
        width = (call.values or call.keys[call.value_part]).width
        return (
            jnp.zeros((*rows[:3], width), jnp.float32),
            jnp.full(rows, MASKED, jnp.float32),
            jnp.zeros(rows, jnp.float32),
        )
    values = None if call.values is None else values
    return _run(queries, keys, values, lengths, tuple(tables), call, interpret)
