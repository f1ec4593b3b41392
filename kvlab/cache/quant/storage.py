"""How each cached tensor of a quantized layer is stored (Storage, chosen per
tensor by the cache config), where a layer's tokens live (Layout), and the
codes: groups quantized through the tensor's storage format
(kvlab/cache/formats) and packed 8 / bits to a byte (kvlab/cache/quant/__init__.py
describes the layout)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvlab.cache import topology
from kvlab.cache.formats import Format
from kvlab.config import cached_tensors, dtype_of
from kvlab.files import read_arrays
from kvlab.registry import FORMATS
from kvlab.rope import rope_frequencies, rotate


@dataclasses.dataclass(frozen=True)
class Storage:
    """How one cached tensor is stored (static, hashable)."""

    bits: int  # 16: cache dtype, unquantized
    format: str  # a kvlab.registry.FORMATS name: "int", "fp8", "nf", ...
    axis: str  # "token" | "channel" | "calibrated" (no groups: `ranges`)
    group_size: int
    symmetric: bool  # int only: no zero point
    scale_dtype: str
    dtype: str  # the cache dtype (16-bit payload and the ring)
    table: tuple = ()  # a format fitted per layer: this layer's levels (Format.table),
    #                    or a tuple of them per run of adjacent channels (`channel_tables`)
    ranges: tuple = ()  # axis 'calibrated': this layer's ranges [KH][Wd] (cache.scales)
    outliers: int = 0  # numbers per token and head kept in `dtype` beside the codes
    rope: tuple = ()  # keys coded before RoPE: (inverse frequencies, cos/sin factor)
    sketch: int = 0  # keys: bits of the residual's sign sketch per token and head
    sketch_seed: int = 0  # of the sketch's Gaussian projection (`sketch_matrix`)
    rank: int = 0  # numbers coded per token and head in a basis (0: the channels)
    basis: tuple = ()  # rank > 0: this layer's orthonormal bases [KH][Wd][rank] (cache.bases)
    full_first: int = 0  # a row's first positions also kept in `dtype`, read exactly

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def channel_tables(self) -> int:
        """G where `table` holds levels per channel group (G runs of adjacent
        coded channels), else 0."""
        return len(self.table) if self.table and isinstance(self.table[0], tuple) else 0

    @property
    def read_dequantized(self) -> bool:
        """Whether attention reads the tensor dequantized (outliers put back, keys
        turned by RoPE at their positions, a basis's coordinates mapped back), not
        folding its scales into products."""
        return bool(self.outliers or self.rope or self.sketch or self.rank)

    @property
    def folds_basis(self) -> bool:
        """Whether attention reads a basis's coordinates without mapping them back: the
        basis folded into the query, (q B) . c, and into the output, (w c) B^T, over
        the r coordinates (`coordinates`); not for keys coded before RoPE, which
        is turned between the basis and the query."""
        return bool(self.rank) and not self.rope

    def coordinates(self) -> Storage:
        """How a tensor coded in a basis stores its coordinates: the same storage of
        `rank` numbers per token and head, without the basis."""
        return dataclasses.replace(self, rank=0, basis=())

    @property
    def grouped_codes(self) -> bool:
        """Codes alone in the payload with a scale per group: what a kernel that
        dequantizes the format reads (no static scales, outliers, sketch, RoPE)."""
        return not (self.calibrated or self.read_dequantized)

    def first_rows(self, rows: int) -> int:
        """Positions per row kept in `dtype` beside a payload of `rows` rows: the first
        `full_first` (cache.<prefix>_full_first), at most `rows` (later positions never
        settle, so they are read from the ring, never from these)."""
        return min(self.full_first, rows) if self.quantized else 0

    def coded_width(self, width: int) -> int:
        """Numbers coded per token and head of a tensor `width` wide: its rank or width."""
        return self.rank or width

    def row_bytes(self, width: int) -> int:
        """Payload bytes per token and head of a tensor `width` wide: the packed codes
        of its `coded_width` numbers, then
        per outlier its channel (one byte) and its number (`dtype`'s bytes), then the
        residual's sketch (`sketch` sign bits and its norm in `scale_dtype`)."""
        total = self.coded_bytes(width)
        if self.sketch:
            total += self.sketch // 8 + dtype_of(self.scale_dtype).itemsize
        return total

    def coded_bytes(self, width: int) -> int:
        """The bytes of a payload row before the sketch: codes and outliers."""
        coded = self.coded_width(width) * self.bits // 8
        return coded + self.outliers * (1 + dtype_of(self.dtype).itemsize)

    def stored_bytes(self, rows: int, width: int) -> int:
        """Bytes of `rows` stored tokens of one head of a tensor `width` wide: `dtype`
        numbers unquantized; else payload rows (`row_bytes`) and the numbers its format
        keeps per group, scales and zero points (none calibrated: the program's
        constants), one group per `group_size` coded numbers or tokens."""
        if not self.quantized:
            return rows * width * dtype_of(self.dtype).itemsize
        total = rows * self.row_bytes(width)
        if self.calibrated:
            return total
        groups = rows * self.coded_width(width) // self.group_size
        scale = dtype_of(self.scale_dtype).itemsize
        return total + groups * scale * self.codes.scale_numbers(self)

    def codes_of(self, row: int) -> int:
        """Numbers coded per token and head in a payload row of `row` bytes."""
        extra = self.outliers * (1 + dtype_of(self.dtype).itemsize)
        if self.sketch:
            extra += self.sketch // 8 + dtype_of(self.scale_dtype).itemsize
        return (row - extra) * 8 // self.bits

    def width_of(self, row: int) -> int:
        """Numbers per token and head a payload row of `row` bytes is read back as
        (a basis's width when the row holds coordinates in it)."""
        return len(self.basis[0]) if self.rank else self.codes_of(row)

    def bases(self) -> Array:
        """float32 [KH, Wd, rank]: each KV head's basis (rank > 0)."""
        return jnp.asarray(np.asarray(self.basis, np.float32))

    @property
    def calibrated(self) -> bool:
        """Scales fixed offline per KV head and channel: none stored per group."""
        return self.quantized and self.axis == "calibrated"

    def static_scale(self) -> Array:
        """axis 'calibrated': float32 [KH, 1, Wd], each head's and channel's calibrated
        range over the format's top level (a token's [KH, N, Wd] divides by it; with
        a rank, Wd is the rank: a range per coordinate)."""
        ranges = np.asarray(self.ranges, np.float32)
        return jnp.asarray(ranges[:, None, :] / np.float32(self.codes.top(self)))

    @property
    def codes(self) -> Format:
        """The storage format its codes are in (kvlab/cache/formats)."""
        return FORMATS.get(self.format)

    @property
    def has_zero(self) -> bool:
        return self.quantized and not self.calibrated and self.codes.has_zero(self)


def storages(model_cfg: Mapping, cache_cfg: Mapping, layer: int | None = None) -> tuple:
    """The storage of each tensor a layer caches, in `cached_tensors` order: of cache
    layer `layer` with the levels a format fitted per layer reads (`Format.table`,
    ValueError where cache.codebooks cannot give them) and its calibrated ranges
    (`calibrated_ranges`), or without (None: shapes and bytes, which neither
    changes).

    Grouped-query attention caches (k, v) under cache.k_* and cache.v_*;
    latent attention caches (c_kv, k_rope) under cache.latent_* and cache.rope_*.
    """
    layers = topology.num_cache_layers(model_cfg)
    out = []
    for tensor in cached_tensors(model_cfg):
        bits, name = cache_cfg[f"{tensor.prefix}_bits"], cache_cfg[f"{tensor.prefix}_format"]
        table, ranges, basis = (), (), ()
        # a topology coding runs of layers in bases (xKV) takes the ranks for its codes
        in_bases = topology.parse(model_cfg["topology"])[0].codes_in_bases
        rank = cache_cfg[f"{tensor.prefix}_rank"] if bits < 16 and not in_bases else 0
        if layer is not None and bits < 16:
            table = FORMATS.get(name).table(cache_cfg, tensor.prefix, bits, layer, layers)
            if cache_cfg[f"{tensor.prefix}_axis"] == "calibrated":
                ranges = calibrated_ranges(
                    cache_cfg["scales"], tensor, layer, layers, rank or tensor.width
                )
            if rank:
                basis = layer_basis(cache_cfg["bases"], tensor, rank, layer, layers)
        out.append(
            Storage(
                bits=bits,
                format=name,
                axis=cache_cfg[f"{tensor.prefix}_axis"],
                group_size=cache_cfg["group_size"],
                symmetric=cache_cfg["symmetric"],
                scale_dtype=cache_cfg["scale_dtype"],
                dtype=cache_cfg["dtype"],
                table=table,
                ranges=ranges,
                outliers=cache_cfg[f"{tensor.prefix}_outliers"] if bits < 16 else 0,
                rope=rope_numbers(model_cfg, tensor.width)
                if bits < 16 and tensor.prefix == "k" and cache_cfg["k_before_rope"]
                else (),
                sketch=cache_cfg["k_sketch"] if bits < 16 and tensor.prefix == "k" else 0,
                rank=rank,
                basis=basis,
                full_first=cache_cfg[f"{tensor.prefix}_full_first"] if bits < 16 else 0,
            )
        )
        _check_channel_tables(out[-1], tensor.width, cache_cfg, tensor.prefix)
    return tuple(out)


def _check_channel_tables(spec: Storage, width: int, cache_cfg: Mapping, prefix: str) -> None:
    """Refuses levels per channel group whose groups do not split the coded
    channels of a tensor `width` wide evenly."""
    groups, coded = spec.channel_tables, spec.coded_width(width)
    if groups and coded % groups:
        raise ValueError(
            f"cache.codebooks={cache_cfg['codebooks']!r} gives {prefix!r} levels for {groups} "
            f"channel groups, which do not split its {coded} coded channels evenly: "
            "calibrate a number of groups that divides them"
        )


def rope_numbers(model_cfg: Mapping, width: int) -> tuple:
    """`Storage.rope` of keys `width` wide: the model's RoPE as static numbers."""
    with jax.ensure_compile_time_eval():  # numbers, also while a program is traced
        inverse, factor = rope_frequencies(
            width, model_cfg["rope_theta"], model_cfg["rope_scaling"]
        )
        return tuple(float(x) for x in np.asarray(inverse)), float(factor)


def calibrated_ranges(path: str, tensor, layer: int, layers: int, width: int) -> tuple:
    """Layer `layer`'s ranges [KH][width] of `tensor` (a kvlab.config CachedTensor)
    from the .npz at cache.scales (kvlab.eval.calibrate.save_scales: float32[cache
    layers, KH, width] per tensor prefix, each the largest magnitude its head and
    channel, or coordinate of its basis, took over calibration text); ValueError
    naming the field where it cannot give them."""
    ranges = _layer_array(
        path, "scales", "ranges", f"{tensor.prefix}_axis='calibrated'", tensor.prefix,
        f"positive finite [{layers} cache layers, {tensor.heads} heads, {width} channels]",
        (layers, tensor.heads, width), positive=True,
    )  # fmt: skip
    return tuple(tuple(float(x) for x in head) for head in ranges[layer])


def layer_basis(path: str, tensor, rank: int, layer: int, layers: int) -> tuple:
    """Layer `layer`'s bases [KH][Wd][rank] of `tensor` from the .npz at cache.bases
    (kvlab.eval.calibrate.save_bases: float32[cache layers, KH, Wd, rank] per tensor
    prefix, orthonormal columns); ValueError naming the field where it cannot give
    them."""
    basis = _layer_array(
        path, "bases", "bases", f"{tensor.prefix}_rank={rank}", tensor.prefix,
        f"finite [{layers} cache layers, {tensor.heads} heads, {tensor.width} channels, "
        f"{rank} directions]",
        (layers, tensor.heads, tensor.width, rank),
    )  # fmt: skip
    gram = np.einsum("lkwr,lkws->lkrs", basis.astype(np.float64), basis)
    if np.abs(gram - np.eye(rank)).max() > 1e-3:
        raise ValueError(
            f"cache.bases={path!r}: {tensor.prefix!r}'s columns are not orthonormal (a head's "
            "coordinates would not read back): fit them with kvlab.eval.calibrate.bases"
        )
    return tuple(tuple(tuple(float(x) for x in row) for row in head) for head in basis[layer])


def _layer_array(
    path: str, field: str, what: str, user: str, prefix: str, described: str, shape: tuple,
    positive: bool = False,
) -> np.ndarray:  # fmt: skip
    """The array `prefix` of `shape` (`described`) in the .npz at cache.`field`,
    which cache.`user` reads and kvlab.eval.calibrate.save_`field` writes."""
    writer = f"kvlab.eval.calibrate.save_{field}"
    if not path:
        raise ValueError(
            f"cache.{user} reads its {what} from cache.{field}, which is empty: set it to "
            f"an .npz of {writer}"
        )
    arrays = read_arrays(path)
    if isinstance(arrays, str):
        raise ValueError(
            f"cache.{field}={path!r} cannot be read ({arrays}): set it to the .npz "
            f"{writer} wrote for this model"
        )
    if prefix not in arrays:
        raise ValueError(
            f"cache.{field}={path!r} holds no {what} for {prefix!r} (it holds "
            f"{sorted(arrays)}): calibrate them with cache.{user} set"
        )
    array = arrays[prefix]
    if array.shape != shape or not np.isfinite(array).all() or (positive and (array <= 0).any()):
        raise ValueError(
            f"cache.{field}={path!r}: {prefix!r} is {array.shape}, not {described}: "
            "calibrate it for this model"
        )
    return array


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a layer's tokens live (module docstring): static, hashable."""

    capacity: int  # S, tokens a row may hold
    residual: int  # tokens kept in full precision at least
    granularity: int  # g: tokens flushed together

    def settled(self, lengths):
        """q(n): tokens of a row of length n held quantized (works on ints and arrays)."""
        g = self.granularity
        if isinstance(lengths, int):
            return max(0, (lengths - self.residual) // g * g)
        return jnp.maximum(0, (lengths - self.residual) // g * g)

    @property
    def payload_len(self) -> int:  # P
        return self.settled(self.capacity)

    @property
    def ring_len(self) -> int:  # W: the most recent tokens that can be unsettled at once
        return min(self.residual + self.granularity - 1, self.capacity)


def quantized_layout(model_cfg: Mapping, cache_cfg: Mapping, capacity: int) -> Layout | None:
    """The layer layout of a quantized cache, or None when every tensor is 16-bit."""
    specs = storages(model_cfg, cache_cfg)
    if not any(s.quantized for s in specs):
        return None
    by_tokens = any(s.quantized and s.axis == "channel" for s in specs)
    return Layout(capacity, cache_cfg["residual"], cache_cfg["group_size"] if by_tokens else 1)


# ---------------------------------------------------------------------------
# Codes


def pack(codes: Array, bits: int) -> Array:
    """uint8 codes [..., Wd] -> uint8 [..., Wd * bits / 8]; value j of a byte in bits
    j*b.. where b divides 8; otherwise each run of 8 / gcd(8, b) codes fills
    b / gcd(8, b) bytes, little-endian (3 bits: 8 codes in 3 bytes)."""
    if 8 % bits:
        return _pack_across_bytes(codes, bits)
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    grouped = grouped.astype(jnp.uint8)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.bitwise_or.reduce(grouped << shifts, axis=-1)


def unpack(packed: Array, bits: int) -> Array:
    """The inverse of `pack`: uint8 [..., Wd * bits / 8] -> uint8 codes [..., Wd]."""
    if 8 % bits:
        return _unpack_across_bytes(packed, bits)
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    codes = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _run(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the shortest run of `bits`-bit codes that fills whole bytes."""
    common = math.gcd(8, bits)
    return 8 // common, bits // common


def _pack_across_bytes(codes: Array, bits: int) -> Array:
    count, size = _run(bits)
    runs = codes.reshape(*codes.shape[:-1], -1, count).astype(jnp.uint32)
    word = jnp.bitwise_or.reduce(runs << (jnp.arange(count, dtype=jnp.uint32) * bits), axis=-1)
    out = (word[..., None] >> (jnp.arange(size, dtype=jnp.uint32) * 8)) & jnp.uint32(0xFF)
    return out.astype(jnp.uint8).reshape(*codes.shape[:-1], -1)


def _unpack_across_bytes(packed: Array, bits: int) -> Array:
    count, size = _run(bits)
    runs = packed.reshape(*packed.shape[:-1], -1, size).astype(jnp.uint32)
    word = jnp.bitwise_or.reduce(runs << (jnp.arange(size, dtype=jnp.uint32) * 8), axis=-1)
    codes = (word[..., None] >> (jnp.arange(count, dtype=jnp.uint32) * bits)) & (2**bits - 1)
    return codes.astype(jnp.uint8).reshape(*packed.shape[:-1], -1)


def quantize(x: Array, spec: Storage, axis: int) -> tuple[Array, Array, Array | None]:
    """Codes (uint8, x's shape), scale and zero point (x's shape without `axis`) in
    the tensor's format (kvlab/cache/formats); the group sharing a scale runs along `axis`."""
    return spec.codes.quantize(x.astype(jnp.float32), spec, axis)


def levels(codes: Array, spec: Storage) -> Array:
    """The number each code stands for before its scale: float32, codes' shape."""
    return spec.codes.levels(codes, spec)


def dequantize(codes: Array, scale: Array, zero: Array | None, spec: Storage, axis: int) -> Array:
    """float32 numbers from codes, with the scale (and zero) broadcast along `axis`."""
    out = levels(codes, spec) * jnp.expand_dims(scale.astype(jnp.float32), axis)
    if zero is not None:
        out = out + jnp.expand_dims(zero.astype(jnp.float32), axis)
    return out


def by_groups(x: Array, spec: Storage) -> tuple[Array, int]:
    """x [B, KH, N, Wd] arranged so one scale's group runs along the returned axis.

    token axis: [B, KH, N, Wd/gs, gs], axis 4; channel: [B, KH, N/g, g, Wd], axis 3.
    """
    b, kh, n, width = x.shape
    if spec.axis == "token":
        return x.reshape(b, kh, n, width // spec.group_size, spec.group_size), 4
    return x.reshape(b, kh, n // spec.group_size, spec.group_size, width), 3


def quantize_tokens(
    x: Array, spec: Storage, positions: Array | None = None
) -> tuple[Array, Array | None, Array | None]:
    """Packed payload rows, scales and zeros for whole groups of tokens x [B, KH, N, Wd]
    (calibrated: codes of x over the static scale, no scale or zero stored; with
    outliers, each row's outliers after its codes, `split_outliers`; keys coded
    before RoPE: x turned back from its `positions` [B, N] first)."""
    x = x.astype(jnp.float32)
    if spec.rope:
        x = turn(x, spec.rope, _at(positions), back=True)
    if spec.rank:  # coordinates in each head's basis: [B, KH, N, rank]
        x = jnp.einsum("BKNw,Kwr->BKNr", x, spec.bases())
    extra = ()
    whole = x
    if spec.outliers:
        x, channels, numbers = split_outliers(x, spec)
        extra = (
            channels,
            jax.lax.bitcast_convert_type(numbers, jnp.uint8).reshape(*x.shape[:3], -1),
        )
    if spec.calibrated:
        codes, scale, zero = spec.codes.encode(x / spec.static_scale(), spec), None, None
    else:
        grouped, axis = by_groups(x, spec)
        codes, scale, zero = quantize(grouped, spec, axis)
    payload = jnp.concatenate([pack(codes.reshape(x.shape), spec.bits), *extra], -1)
    if spec.sketch:  # the residual left by the codes and outliers, sketched
        residual = whole - _dequantized(payload, scale, zero, spec, x.shape[-1])
        projected = residual @ sketch_matrix(spec.sketch, x.shape[-1], spec.sketch_seed).T
        norm = jnp.linalg.norm(residual, axis=-1, keepdims=True).astype(dtype_of(spec.scale_dtype))
        norm = jax.lax.bitcast_convert_type(norm, jnp.uint8).reshape(*x.shape[:3], -1)
        signs = pack((projected >= 0).astype(jnp.uint8), 1)
        payload = jnp.concatenate([payload, signs, norm], -1)
    return payload, scale, zero


def dequantize_tokens(
    payload: Array,
    scale: Array | None,
    zero: Array | None,
    spec: Storage,
    positions: Array | None = None,
) -> Array:
    """The inverse of `quantize_tokens` (up to the quantization error, and with a rank,
    the directions its basis leaves out): float32 [B, KH, N, Wd]."""
    dense = _dequantized(payload, scale, zero, spec, spec.codes_of(payload.shape[-1]))
    if spec.rank:
        dense = jnp.einsum("BKNr,Kwr->BKNw", dense, spec.bases())
    return turn(dense, spec.rope, _at(positions)) if spec.rope else dense


@functools.lru_cache(maxsize=16)
def _gaussian(rows: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def sketch_matrix(rows: int, width: int, seed: int) -> Array:
    """float32 [rows, width]: the residual sketch's projection, i.i.d. standard normal
    numbers drawn from `seed` (the program's constants)."""
    return jnp.asarray(_gaussian(rows, width, seed))


def sketch_scores(payload: Array, spec: Storage, q: Array) -> Array:
    """What the residual sketch adds to the scores of queries q [B, KH, M, Wd] over the
    payload rows [B, KH, P, .]: QJL's unbiased estimate of <q, residual>,
    sqrt(pi / 2) / m x |residual| x <S q, sign(S residual)> (TurboQuant's residual)."""
    width = spec.codes_of(payload.shape[-1])
    start = spec.coded_bytes(width)
    signs = unpack(payload[..., start : start + spec.sketch // 8], 1).astype(jnp.float32)
    norm = payload[..., start + spec.sketch // 8 :]
    norm = jax.lax.bitcast_convert_type(norm, dtype_of(spec.scale_dtype)).astype(jnp.float32)
    projected = q @ sketch_matrix(spec.sketch, width, spec.sketch_seed).T  # [B, KH, M, m]
    agreement = jnp.einsum("BKMm,BKPm->BKMP", projected, 2 * signs - 1)
    return agreement * (math.sqrt(math.pi / 2) / spec.sketch) * norm[:, :, None, :]


def turn(x: Array, rope: tuple, positions: Array, back: bool = False) -> Array:
    """x [B, KH, N, Wd] turned by RoPE at `positions` [B, N] (back: undone); `rope`
    is `Storage.rope`, the model's RoPE as static numbers (`rope_numbers`)."""
    inverse, factor = rope
    angles = -positions if back else positions
    turned = rotate(x.swapaxes(1, 2), angles, np.asarray(inverse, np.float32),
                    1 / factor if back else factor)  # fmt: skip
    return turned.swapaxes(1, 2)


def _at(positions: Array | None) -> Array:
    if positions is None:
        raise ValueError(
            "keys stored before RoPE (cache.k_before_rope) are coded and read at their "
            "positions, and none were given"
        )
    return positions


def _dequantized(
    payload: Array, scale: Array | None, zero: Array | None, spec: Storage, width: int
) -> Array:
    """The codes and outliers of payload rows (of `width` coded numbers) as float32 numbers."""
    codes = unpack(payload[..., : width * spec.bits // 8], spec.bits)
    if spec.calibrated:
        dense = levels(codes, spec) * spec.static_scale()
    else:
        grouped, axis = by_groups(codes, spec)
        dense = dequantize(grouped, scale, zero, spec, axis).reshape(codes.shape)
    if not spec.outliers:
        return dense
    tail = payload[..., width * spec.bits // 8 : spec.coded_bytes(width)]
    channels, numbers = tail[..., : spec.outliers], tail[..., spec.outliers :]
    dtype = dtype_of(spec.dtype)
    numbers = numbers.reshape(*numbers.shape[:-1], spec.outliers, dtype.itemsize)
    numbers = jax.lax.bitcast_convert_type(numbers, dtype).astype(jnp.float32)
    if dtype.itemsize == 1:
        numbers = numbers[..., 0]
    at = channels[..., None] == jnp.arange(width, dtype=jnp.uint8)  # [..., k, Wd]
    return jnp.where(at.any(-2), jnp.sum(jnp.where(at, numbers[..., None], 0.0), -2), dense)


def split_outliers(x: Array, spec: Storage) -> tuple[Array, Array, Array]:
    """Each token's and head's `spec.outliers` numbers largest against their range
    (calibrated: the layer's range of their channel; else their magnitude), and x
    with them set to 0 for the codes: (x, their channels uint8 [B, KH, N, k],
    the numbers in spec.dtype [B, KH, N, k]), KVQuant's dense-and-sparse split."""
    basis = jnp.abs(x) / spec.static_scale() if spec.calibrated else jnp.abs(x)
    _, channels = jax.lax.top_k(basis, spec.outliers)
    numbers = jnp.take_along_axis(x, channels, axis=-1).astype(dtype_of(spec.dtype))
    taken = (channels[..., None] == jnp.arange(x.shape[-1])).any(-2)
    return jnp.where(taken, 0.0, x), channels.astype(jnp.uint8), numbers
