"""What a stored_attention call reads, checked before anything is traced.

`Stored` is one cached tensor of a layer as the cache keeps it (dense rows or a
page pool through block tables; 16-bit numbers or packed codes with their
scales); `plan` checks every argument of a call (shapes, dtypes, bit-widths,
scale groups, token capacities, block sizes) and returns the static
`CallPlan` the kernels are specialised on, with the block tables. Nothing here
depends on the platform a kernel is compiled for, except the compiled
kernels' tile rules (powers of two, `DOT_MIN`), asked with `triton_tiles=True`.
Partials over disjoint token sets combine with `merge_partials`
(kvlab/kernels/pallas/triton.py's docstring: what a partial is).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

from kvlab.attention.core import MASKED
from kvlab.cache.quant import QuantizedTensor, Storage

# Blocks of this many tokens unless the caller or `block_tokens` says otherwise
# (rounded up to the page size and channel group size).
DEFAULT_BLOCK_TOKENS = 64
# tl.dot's smallest M, N and K; queries are padded to it, narrower widths contract by hand.
DOT_MIN = 16
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


def parts(q, keys) -> tuple[tuple, tuple]:
    """The query parts and key parts of a call (one array or Stored is one part)."""
    queries = tuple(q) if isinstance(q, (tuple, list)) else (q,)
    return queries, ((keys,) if isinstance(keys, Stored) else tuple(keys))


def empty_partial(queries: tuple, call: CallPlan) -> Partial:
    """(0, MASKED, 0): the partial over no stored token (merges as nothing)."""
    batch, heads, num_queries, _ = queries[0].shape
    rows = (batch, heads, num_queries, 1)
    width = (call.values or call.keys[call.value_part]).width
    return (
        jnp.zeros((*rows[:3], width), jnp.float32),
        jnp.full(rows, MASKED, jnp.float32),
        jnp.zeros(rows, jnp.float32),
    )


# ---------------------------------------------------------------------------
# Static description of a call (checked before tracing)


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How the kernel reads one Stored (static)."""

    spec: Storage | None  # None: 16-bit
    width: int  # numbers per token and head
    packed: int  # X: entries per token and head as stored
    scale_width: int  # last axis of scale/zero (0 at 16 bits)
    page_size: int  # L, 0 when dense
    table: int  # which block table (paged), -1 when dense
    has_zero: bool


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """Everything static about one stored_attention call."""

    keys: tuple[TensorPlan, ...]
    values: TensorPlan | None  # None: the values are keys[value_part]
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
    stored, name: str, batch: int, heads: int, tables: list, triton_tiles: bool
) -> tuple[TensorPlan, int]:
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
    if triton_tiles:
        sizes = {"width": width, "packed width": packed}
        if scale_width:
            sizes["scale width"] = scale_width
        if page_size:
            sizes["page size"] = page_size
        _check_tiles(name, data.shape, sizes)
    tensor = TensorPlan(spec, width, packed, scale_width, page_size, table, has_zero)
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


def _describe_all(queries: tuple, keys: tuple, values, tables: list, triton_tiles: bool) -> tuple:
    """(the keys' TensorPlans, the values' TensorPlan or None when they are a key part, that
    part or -1, the tensors' common token capacity)."""
    batch, heads = queries[0].shape[:2]
    described = [
        _describe(k, f"keys[{j}]", batch, heads, tables, triton_tiles) for j, k in enumerate(keys)
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
        value_tensor, value_tokens = _describe(values, "values", batch, heads, tables, triton_tiles)
        capacities = [tokens for _, tokens in described] + [value_tokens]
    if len(set(capacities)) != 1:
        _fail(
            "keys/values",
            f"token capacities {capacities}",
            "differ (dense S or n * page_size)",
            "pass tensors of one layer, cut to the same length",
        )
    return tuple(t for t, _ in described), value_tensor, value_part, capacities[0]


def _block_size(tensors: list, tokens: int, block_tokens, triton_tiles: bool, target: int) -> int:
    """`block_tokens`, or `target` (cut to `tokens`); a block holds whole pages and whole
    channel-axis scale groups (and, for Triton, is a power of two >= DOT_MIN)."""
    unit = 1
    for t in tensors:
        unit = math.lcm(unit, t.page_size or 1)
        if t.spec is not None and t.spec.axis == "channel":
            unit = math.lcm(unit, t.spec.group_size)
    if block_tokens is None:
        target = max(DOT_MIN, min(target, 1 << max(0, tokens - 1).bit_length()))
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
    if triton_tiles and (not _power_of_two(block_tokens) or block_tokens < DOT_MIN):
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


def plan(
    queries,
    keys,
    values,
    lengths,
    scale,
    block_tokens,
    num_splits,
    compute_dtype,
    triton_tiles,
    target_block=DEFAULT_BLOCK_TOKENS,
) -> tuple:
    """Checks every argument (shapes, dtypes, divisibility); returns the static CallPlan
    and the block tables (blocks of `block_tokens`, or of about `target_block`).
    Runs before anything is traced."""
    _check_arguments(queries, keys, lengths, scale)
    num_queries = queries[0].shape[2]
    tables: list = []
    key_tensors, value_tensor, value_part, tokens = _describe_all(
        queries, keys, values, tables, triton_tiles
    )
    tensors = list(key_tensors) + ([value_tensor] if value_tensor else [])
    block_tokens = _block_size(tensors, tokens, block_tokens, triton_tiles, target_block)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        _fail("num_splits", num_splits, "is not a positive int", "pass 1, or more to split S")
    compute = _compute_name(compute_dtype)
    blocks = max(1, -(-tokens // block_tokens))
    split_tokens = -(-blocks // num_splits) * block_tokens
    splits = -(-blocks * block_tokens // split_tokens)  # none past the capacity (they'd be empty)
    call = CallPlan(
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
