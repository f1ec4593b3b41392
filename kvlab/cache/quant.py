"""Quantized KV caches: each cached tensor in 16, 8, 4 or 2 bits, with a full-precision window.

KIVI (arXiv:2402.02750) and KVQuant (arXiv:2401.18079): keys and values are
stored in few bits with a scale (and a zero point) per group of numbers; keys
are more sensitive than values, so each tensor has its own width. A group is
`group_size` numbers of one token along the feature axis (axis "token": one
scale per token and group of channels) or `group_size` tokens of one channel
(axis "channel": one scale per channel and group of tokens, KIVI's choice for
keys). The codes are in the tensor's storage format (`cache.<prefix>_format`,
kvlab/cache/formats: "int" round-to-nearest levels with a zero point or
symmetric, "fp8" e4m3, "nf" the normal-float grid, or a registered one).
Scales and zero points are stored in `scale_dtype`, rounded outwards so no
number is clipped: |x - dequantize(quantize(x))| <= scale / 2 for int codes.

Layout of one layer (every tensor of the layer shares it):

    settled tokens [0, q)  quantized, in `payload` rows (row = position)
    recent tokens  [q, n)  in full precision (cache.dtype), in the `ring`
                           (slot = position mod W)

with n the row's length and q = settled(n) = floor((n - residual) / g) * g,
g = group_size if a tensor of the layer groups along tokens, else 1. So the
`residual` most recent tokens (and those of an unfinished token group) stay in
full precision, and tokens move to quantized storage in whole groups
("flushed") as the row grows. A row of capacity S needs P = settled(S)
payload rows and W = min(residual + g - 1, S) ring slots.

    QuantizedTensor (one cached tensor, KH heads of width Wd)
      payload  uint8[B, KH, P, Wd * bits / 8]  codes, 8 / bits per byte, low bits first
               (at 16 bits: cache.dtype[B, KH, P, Wd], no scale or zero)
      scale    [B, KH, P, Wd / group_size] (token axis) or [B, KH, P / g, Wd] (channel)
      zero     as scale, or None (a format without one: symmetric int, fp8, nf)
      ring     cache.dtype[B, KH, W, Wd], or None when W = 0

Reads keep a token's representation a pure function of the row's length when
the query was made, so a query at position p sees token i quantized exactly
when i < settled(p + 1), as token-by-token decode would, whatever the chunk
size. Attention reads payloads without building a dequantized copy where the
math allows: per-token scales multiply the query-key products and fold into the
probabilities for V; per-channel scales multiply the query group by group.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from kvlab.cache.formats import Format
from kvlab.cache.placement import Placement, write_tokens
from kvlab.config import cached_tensors, dtype_of
from kvlab.registry import FORMATS


@dataclasses.dataclass(frozen=True)
class Storage:
    """How one cached tensor is stored (static, hashable)."""

    bits: int  # 16: cache dtype, unquantized
    format: str  # a kvlab.registry.FORMATS name: "int", "fp8", "nf", ...
    axis: str  # "token" | "channel"
    group_size: int
    symmetric: bool  # int only: no zero point
    scale_dtype: str
    dtype: str  # the cache dtype (16-bit payload and the ring)

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def codes(self) -> Format:
        """The storage format its codes are in (kvlab/cache/formats)."""
        return FORMATS.get(self.format)

    @property
    def has_zero(self) -> bool:
        return self.quantized and self.codes.has_zero(self)


def storages(model_cfg: Mapping, cache_cfg: Mapping) -> tuple[Storage, ...]:
    """The storage of each tensor a layer caches, in `cached_tensors` order.

    Grouped-query attention caches (k, v) under cache.k_* and cache.v_*;
    latent attention caches (c_kv, k_rope) under cache.latent_* and cache.rope_*.
    """
    return tuple(
        Storage(
            bits=cache_cfg[f"{tensor.prefix}_bits"],
            format=cache_cfg[f"{tensor.prefix}_format"],
            axis=cache_cfg[f"{tensor.prefix}_axis"],
            group_size=cache_cfg["group_size"],
            symmetric=cache_cfg["symmetric"],
            scale_dtype=cache_cfg["scale_dtype"],
            dtype=cache_cfg["dtype"],
        )
        for tensor in cached_tensors(model_cfg)
    )


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
    """uint8 codes [..., Wd] -> uint8 [..., Wd * bits / 8]; value j of a byte in bits j*b.."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    grouped = grouped.astype(jnp.uint8)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.bitwise_or.reduce(grouped << shifts, axis=-1)


def unpack(packed: Array, bits: int) -> Array:
    """The inverse of `pack`: uint8 [..., Wd * bits / 8] -> uint8 codes [..., Wd]."""
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    codes = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


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


def _grouped(x: Array, spec: Storage) -> tuple[Array, int]:
    """x [B, KH, N, Wd] arranged so one scale's group runs along the returned axis.

    token axis: [B, KH, N, Wd/gs, gs], axis 4; channel: [B, KH, N/g, g, Wd], axis 3.
    """
    b, kh, n, width = x.shape
    if spec.axis == "token":
        return x.reshape(b, kh, n, width // spec.group_size, spec.group_size), 4
    return x.reshape(b, kh, n // spec.group_size, spec.group_size, width), 3


def quantize_tokens(x: Array, spec: Storage) -> tuple[Array, Array, Array | None]:
    """Packed payload rows, scales and zeros for whole groups of tokens x [B, KH, N, Wd]."""
    grouped, axis = _grouped(x, spec)
    codes, scale, zero = quantize(grouped, spec, axis)
    return pack(codes.reshape(x.shape), spec.bits), scale, zero


def dequantize_tokens(payload: Array, scale: Array, zero: Array | None, spec: Storage) -> Array:
    """The inverse of `quantize_tokens` (up to the quantization error): float32 [B, KH, N, Wd]."""
    codes = unpack(payload, spec.bits)
    grouped, axis = _grouped(codes, spec)
    return dequantize(grouped, scale, zero, spec, axis).reshape(codes.shape)


# ---------------------------------------------------------------------------
# One cached tensor


@struct.dataclass
class QuantizedTensor:
    """One cached tensor of a quantized layer (fields and shapes: module docstring)."""

    payload: Array
    scale: Array | None
    zero: Array | None
    ring: Array | None
    spec: Storage = struct.field(pytree_node=False)

    @property
    def width(self) -> int:
        """W: numbers per token and head (the payload's last axis, unpacked)."""
        packed = self.payload.shape[-1]
        return packed if not self.spec.quantized else packed * 8 // self.spec.bits

    def reader(self):
        """What the attention function reads the settled tokens through."""
        return self.payload if not self.spec.quantized else PayloadReader(self)

    def dequantize(self) -> Array:
        """The settled tokens as float32 [B, KH, P, Wd]."""
        if not self.spec.quantized:
            return self.payload.astype(jnp.float32)
        return dequantize_tokens(self.payload, self.scale, self.zero, self.spec)


@dataclasses.dataclass(frozen=True)
class PayloadReader:
    """Attention over a quantized payload without dequantizing it.

    scores(q [B, KH, M, Wd]) -> float32 [B, KH, M, P]
    weighted_sum(w [B, KH, M, P]) -> float32 [B, KH, M, Wd]
    """

    tensor: QuantizedTensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape [B, KH, P, Wd] of what it reads."""
        b, kh, p, _ = self.tensor.payload.shape
        return (b, kh, p, self.tensor.width)

    def dequantize(self) -> Array:
        return self.tensor.dequantize()

    @property
    def step(self) -> int:
        """Slices start on whole scale groups (channel axis: group_size tokens)."""
        return self.tensor.spec.group_size if self.tensor.spec.axis == "channel" else 1

    def chunk(self, start, size: int):
        """The stored tokens start..start+size-1 (kvlab.cache.protocols.Reader; `read_slice`)."""
        take = functools.partial(jax.lax.dynamic_slice_in_dim, axis=2)
        return read_slice(self.tensor, take, start, size)

    def _levels(self):
        t = self.tensor
        grouped, _ = _grouped(levels(unpack(t.payload, t.spec.bits), t.spec), t.spec)
        zero = None if t.zero is None else t.zero.astype(jnp.float32)
        return grouped, t.scale.astype(jnp.float32), zero

    def scores(self, q: Array) -> Array:
        q = q.astype(jnp.float32)
        b, kh, m, width = q.shape
        lv, scale, zero = self._levels()
        if self.tensor.spec.axis == "token" and lv.shape[3] == 1:
            # One scale per token and head: lv [B, KH, P, Wd]; scale, zero [B, KH, P]
            lv, scale = lv[:, :, :, 0], scale[..., 0]
            out = jnp.einsum("BKMd,BKPd->BKMP", q, lv) * scale[:, :, None, :]
            if zero is not None:
                out = out + q.sum(-1)[..., None] * zero[:, :, None, :, 0]
            return out
        if self.tensor.spec.axis == "token":
            # lv [B, KH, P, ng, gs]; scale, zero [B, KH, P, ng]
            qg = q.reshape(b, kh, m, *lv.shape[3:])
            partial = jnp.einsum("BKMgd,BKPgd->BKMPg", qg, lv)
            out = jnp.einsum("BKMPg,BKPg->BKMP", partial, scale)
            if zero is not None:
                out = out + jnp.einsum("BKMg,BKPg->BKMP", qg.sum(-1), zero)
            return out
        # lv [B, KH, J, g, Wd]; scale, zero [B, KH, J, Wd]: scale the query per group.
        scaled = q[:, :, :, None, :] * scale[:, :, None]  # [B, KH, M, J, Wd]
        out = jnp.einsum("BKMJd,BKJtd->BKMJt", scaled, lv)
        if zero is not None:
            out = out + jnp.einsum("BKMd,BKJd->BKMJ", q, zero)[..., None]
        return out.reshape(b, kh, m, lv.shape[2] * lv.shape[3])

    def weighted_sum(self, w: Array) -> Array:
        w = w.astype(jnp.float32)
        b, kh, m, _ = w.shape
        lv, scale, zero = self._levels()
        if self.tensor.spec.axis == "token" and lv.shape[3] == 1:
            # Fold each token's scale into its probability: lv [B, KH, P, Wd]
            out = jnp.einsum("BKMP,BKPd->BKMd", w * scale[:, :, None, :, 0], lv[:, :, :, 0])
            if zero is not None:
                out = out + jnp.einsum("BKMP,BKP->BKM", w, zero[..., 0])[..., None]
            return out
        if self.tensor.spec.axis == "token":
            # Fold each token's scales into its probability.
            folded = w[..., None] * scale[:, :, None]  # [B, KH, M, P, ng]
            out = jnp.einsum("BKMPg,BKPgd->BKMgd", folded, lv)
            if zero is not None:
                out = out + jnp.einsum("BKMP,BKPg->BKMg", w, zero)[..., None]
            return out.reshape(b, kh, m, lv.shape[3] * lv.shape[4])
        wg = w.reshape(b, kh, m, *lv.shape[2:4])  # [B, KH, M, J, g]
        partial = jnp.einsum("BKMJt,BKJtd->BKMJd", wg, lv)
        out = jnp.einsum("BKMJd,BKJd->BKMd", partial, scale)
        if zero is not None:
            out = out + jnp.einsum("BKMJ,BKJd->BKMd", wg.sum(-1), zero)
        return out


def read_slice(tensor: QuantizedTensor, take, start, size: int):
    """What attention reads stored tokens start..start+size-1 of `tensor` through.

    `take(array, first, count)` gives entries first..first+count-1 along the
    token axis of its payload, scale or zero array (a slice; page pools gather).
    A slice fits in cache, so it is dequantized whole (one elementwise pass,
    then plain products; below 8 bits one array per code position in a byte,
    `_phases`) unless one scale per token lets the scale fold into the products
    (PayloadReader's own math).
    """
    spec = tensor.spec
    if spec.axis == "channel":
        scale_start, scale_size = start // spec.group_size, size // spec.group_size
    else:
        scale_start, scale_size = start, size
    sliced = tensor.replace(
        payload=take(tensor.payload, start, size),
        scale=take(tensor.scale, scale_start, scale_size),
        zero=None if tensor.zero is None else take(tensor.zero, scale_start, scale_size),
        ring=None,
    )
    if spec.axis == "token" and sliced.scale.shape[-1] == 1:
        return PayloadReader(sliced)
    if spec.bits < 8:
        return Phases(_phases(sliced))
    return sliced.dequantize()


def _phases(t: QuantizedTensor) -> tuple[Array, ...]:
    """The stored tokens dequantized as 8 / bits float32 arrays [B, KH, N, Wd * bits / 8]:
    array j holds channels j, j + 8 / bits, ... (the codes in bits j*b.. of each byte),
    so unpacking needs no interleaving of the codes (module docstring: `pack`)."""
    spec, per_byte = t.spec, 8 // t.spec.bits
    b, kh, n, packed = t.payload.shape
    scale = t.scale.astype(jnp.float32)
    zero = None if t.zero is None else t.zero.astype(jnp.float32)
    phases = []
    for j in range(per_byte):
        codes = (t.payload >> jnp.uint8(j * spec.bits)) & jnp.uint8(2**spec.bits - 1)
        lv = levels(codes, spec)
        if spec.axis == "channel":  # scale [B, KH, N / g, Wd]: this phase's channels
            g = spec.group_size
            lv = lv.reshape(b, kh, n // g, g, packed) * scale[..., None, j::per_byte]
            if zero is not None:
                lv = lv + zero[..., None, j::per_byte]
        else:  # scale [B, KH, N, Wd / gs]: channel i * per_byte + j in group i // (gs / per_byte)
            groups = scale.shape[-1]
            lv = lv.reshape(b, kh, n, groups, packed // groups) * scale[..., None]
            if zero is not None:
                lv = lv + zero[..., None]
        phases.append(lv.reshape(b, kh, n, packed))
    return tuple(phases)


@dataclasses.dataclass(frozen=True)
class Phases:
    """A dequantized slice as `_phases` gives it: attention's products per phase."""

    arrays: tuple

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, kh, n, width = self.arrays[0].shape
        return (b, kh, n, width * len(self.arrays))

    @property
    def step(self) -> int:
        return 1

    def scores(self, q: Array) -> Array:
        q = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, len(self.arrays))
        return sum(jnp.einsum("BKMd,BKSd->BKMS", q[..., j], x) for j, x in enumerate(self.arrays))

    def weighted_sum(self, w: Array) -> Array:
        w = w.astype(jnp.float32)
        out = jnp.stack([jnp.einsum("BKMS,BKSd->BKMd", w, x) for x in self.arrays], axis=-1)
        return out.reshape(*out.shape[:-2], -1)

    def dequantize(self) -> Array:
        return jnp.stack(self.arrays, axis=-1).reshape(self.shape)

    def chunk(self, start, size: int) -> Array:
        return jax.lax.dynamic_slice_in_dim(self.dequantize(), start, size, axis=2)


def init_tensor(
    spec: Storage, layout: Layout, batch: int, heads: int, width: int
) -> QuantizedTensor:
    return empty_tensor(spec, batch, heads, width, layout.payload_len, layout.ring_len)


def empty_tensor(
    spec: Storage, batch: int, heads: int, width: int, rows: int, ring: int
) -> QuantizedTensor:
    """A zero tensor of `rows` payload rows (a multiple of group_size on the channel
    axis) and `ring` ring slots, KH = `heads`."""
    p, w = rows, ring
    dtype = dtype_of(spec.dtype)
    ring = jnp.zeros((batch, heads, w, width), dtype) if w else None
    if not spec.quantized:
        return QuantizedTensor(jnp.zeros((batch, heads, p, width), dtype), None, None, ring, spec)
    payload = jnp.zeros((batch, heads, p, width * spec.bits // 8), jnp.uint8)
    if spec.axis == "token":
        scale_shape = (batch, heads, p, width // spec.group_size)
    else:
        scale_shape = (batch, heads, p // spec.group_size, width)
    scale = jnp.zeros(scale_shape, dtype_of(spec.scale_dtype))
    zero = jnp.zeros(scale_shape, dtype_of(spec.scale_dtype)) if spec.has_zero else None
    return QuantizedTensor(payload, scale, zero, ring, spec)


# ---------------------------------------------------------------------------
# One layer


@struct.dataclass
class Flush:
    """Tokens leaving the ring this step, in whole groups (what `write` stores).

    positions int32[B, F*g] (-1 where nothing settles); per tensor: payload rows
    [B, KH, F*g, .] (packed codes, or the numbers themselves at 16 bits),
    scales and zeros.
    """

    positions: Array
    fresh: tuple  # the step's new tokens per tensor, cache dtype [B, KH, T, Wd]
    payloads: tuple
    scales: tuple
    zeros: tuple


@struct.dataclass
class QuantizedLayer:
    """One layer's cached tensors, quantized (module docstring)."""

    tensors: tuple
    layout: Layout = struct.field(pytree_node=False)

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    def _flush(self, fresh: tuple, placement: Placement) -> tuple[Flush, tuple]:
        """Gathers the tokens settled by this step and quantizes them; also gives the
        numbers they stand for (dequantized, [B, KH, F*g, Wd] per tensor)."""
        layout, lengths = self.layout, placement.lengths
        length = placement.positions.shape[1]
        g = layout.granularity
        groups = -(-length // g)  # F: at most this many groups settle in one step
        before, after = layout.settled(lengths), layout.settled(lengths + placement.num_tokens)
        offsets = jnp.arange(groups * g, dtype=jnp.int32)
        positions = before[:, None] + offsets  # [B, F*g]
        valid = positions < after[:, None]
        from_fresh = positions >= lengths[:, None]
        fresh_index = jnp.clip(positions - lengths[:, None], 0, length - 1)

        def settle():
            payloads, scales, zeros, values = [], [], [], []
            for tensor, new in zip(self.tensors, fresh, strict=True):
                # [B, KH, F*g, Wd], full precision as the ring holds it
                taken = jnp.take_along_axis(new, fresh_index[:, None, :, None], axis=2)
                if tensor.ring is not None:
                    slot = positions % layout.ring_len
                    kept = jnp.take_along_axis(tensor.ring, slot[:, None, :, None], axis=2)
                    taken = jnp.where(from_fresh[:, None, :, None], taken, kept)
                if tensor.spec.quantized:
                    payload, scale, zero = quantize_tokens(taken, tensor.spec)
                    value = dequantize_tokens(payload, scale, zero, tensor.spec)
                else:
                    payload, scale, zero, value = taken, None, None, taken
                payloads.append(payload)
                scales.append(scale)
                zeros.append(zero)
                values.append(value)
            return tuple(payloads), tuple(scales), tuple(zeros), tuple(values)

        # Decoding, a group settles in one step of g. The other steps, where no row
        # settles one, skip the gather and the (de)quantization: their flush is zeros,
        # all masked (positions -1), as the unused groups' numbers were before.
        shapes = jax.eval_shape(settle)
        nothing = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)  # noqa: E731
        payloads, scales, zeros, values = jax.lax.cond(jnp.any(valid), settle, nothing)
        positions = jnp.where(valid, positions, -1)  # -1: nothing settles there (dropped)
        return Flush(positions, fresh, payloads, scales, zeros), values

    def read(self, fresh: tuple, placement: Placement, visible=None, readers=None):
        """Blocks to attend over and what `write` will store (see DenseLayer.read).

        fresh: the step's new tokens per tensor, [B, KH, T, Wd]. `visible(query
        positions [B, T, 1], key positions [B, 1, X])`, when given, is a further
        bool rule ANDed into every block's mask (an evicting window's band).
        `readers`: what attention reads the settled tokens through (default each
        tensor's `reader()`; page pools pass their own, kvlab/cache/paged.py).
        """
        layout, lengths = self.layout, placement.lengths
        fresh = tuple(
            x.astype(t.ring.dtype if t.ring is not None else dtype_of(t.spec.dtype))
            for x, t in zip(fresh, self.tensors, strict=True)
        )
        flush, settled_values = self._flush(fresh, placement)
        before = layout.settled(lengths)  # [B]
        # Per query at position p: tokens below settled(p + 1) are seen quantized.
        seen_settled = layout.settled(placement.positions + 1)[:, :, None]  # [B, T, 1]

        q_positions = placement.positions[:, :, None]  # [B, T, 1]
        rule = (lambda keys: visible(q_positions, keys)) if visible else (lambda keys: True)  # noqa: E731
        payload_positions = jnp.arange(layout.payload_len)[None, None, :]
        blocks = [
            (
                readers or tuple(t.reader() for t in self.tensors),
                (payload_positions < before[:, None, None]) & rule(payload_positions),
            )
        ]
        if layout.ring_len:
            slots = jnp.arange(layout.ring_len)
            # The latest position below the row's length that lives in each slot.
            ring_positions = lengths[:, None] - 1 - (lengths[:, None] - 1 - slots) % layout.ring_len
            live = ring_positions >= before[:, None]  # [B, W]
            blocks.append(
                (
                    tuple(t.ring for t in self.tensors),
                    live[:, None, :]
                    & (ring_positions[:, None, :] >= seen_settled)
                    & rule(ring_positions[:, None, :]),
                )
            )
        fresh_positions = placement.positions[:, None, :]  # [B, 1, T]
        fresh_mask = placement.fresh_mask & (fresh_positions >= seen_settled)
        blocks.append((fresh, fresh_mask & rule(fresh_positions)))
        flushed = flush.positions[:, None, :]  # [B, 1, F*g]; -1 where nothing settles
        blocks.append((settled_values, (flushed >= 0) & (flushed < seen_settled) & rule(flushed)))
        return blocks, flush

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.payload.shape[1], t.width) for t in self.tensors)

    def observe(self, placement: Placement) -> None:
        """Keeps every token: no query's attention is needed."""
        return None

    def write(self, flush: Flush, placement: Placement, mass=None) -> QuantizedLayer:
        """Stores the settled groups in the payloads and the rest of the new tokens in the ring."""
        put = functools.partial(write_tokens, axis=2)
        tensors = write_flush(self.tensors, self.layout, flush, placement, put)
        return QuantizedLayer(tensors, self.layout)


def write_flush(tensors: tuple, layout: Layout, flush: Flush, placement: Placement, put) -> tuple:
    """The tensors with the step's settled groups written and its other tokens in the ring.

    `put(array, new, slots)` writes token rows at each row's slots of a payload,
    scale or zero array (per-row arrays: `write_tokens`; page pools: the pages'
    slots, kvlab/cache/paged.py); only the flushed groups are written. The
    ring is per row in every layout.
    """
    g = layout.granularity
    written = []
    for tensor, new, payload, scale, zero in zip(
        tensors, flush.fresh, flush.payloads, flush.scales, flush.zeros, strict=True
    ):
        rows = put(tensor.payload, payload, flush.positions)
        if tensor.spec.quantized:
            if tensor.spec.axis == "token":
                scale_slots = flush.positions
            else:  # one scale row per group of g tokens
                scale_slots = flush.positions[:, ::g] // g
            scale = put(tensor.scale, scale, scale_slots)
            if zero is not None:
                zero = put(tensor.zero, zero, scale_slots)
        ring = None if tensor.ring is None else write_ring(tensor.ring, new, layout, placement)
        written.append(QuantizedTensor(rows, scale, zero, ring, tensor.spec))
    return tuple(written)


def write_ring(ring: Array, new: Array, layout: Layout, placement: Placement) -> Array:
    """The ring [B, KH, W, Wd] with the step's tokens `new` [B, KH, T, Wd] that stay
    unsettled written at slot position mod W."""
    after = layout.settled(placement.lengths + placement.num_tokens)
    positions = placement.positions
    stays = (positions >= after[:, None]) & (placement.slots < layout.capacity)
    ring_slots = jnp.where(stays, positions % layout.ring_len, layout.ring_len)
    return write_tokens(ring, new, ring_slots, axis=2)


def init_layer(specs: tuple[Storage, ...], layout: Layout, batch: int, shapes) -> QuantizedLayer:
    """An empty quantized layer; shapes: (heads, width) per cached tensor."""
    return QuantizedLayer(
        tuple(init_tensor(s, layout, batch, h, w) for s, (h, w) in zip(specs, shapes, strict=True)),
        layout,
    )
