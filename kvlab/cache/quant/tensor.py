"""One cached tensor of a quantized layer (QuantizedTensor) and what attention
reads its settled tokens through: the payload without a dequantized copy
(PayloadReader), a slice dequantized per code position (Phases), and a row's
first positions kept in the cache dtype beside either (FirstTokens)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from kvlab.cache.placement import write_tokens
from kvlab.cache.protocols import Reader
from kvlab.cache.quant.storage import (
    Layout,
    Storage,
    by_groups,
    dequantize_tokens,
    levels,
    quantize_tokens,
    sketch_scores,
    unpack,
)
from kvlab.config import dtype_of


@struct.dataclass
class QuantizedTensor:
    """One cached tensor of a quantized layer (fields and shapes: module docstring)."""

    payload: Array
    scale: Array | None
    zero: Array | None
    ring: Array | None
    spec: Storage = struct.field(pytree_node=False)
    first_tokens: Array | None = None  # cache.dtype[B, KH, N, Wd]: positions 0..N-1 exactly

    @property
    def width(self) -> int:
        """W: numbers per token and head (the payload's last axis, unpacked; read back
        through a basis, its width)."""
        packed = self.payload.shape[-1]
        return packed if not self.spec.quantized else self.spec.width_of(packed)

    def reader(self):
        """What the attention function reads the settled tokens through."""
        return self.payload if not self.spec.quantized else PayloadReader(self)

    def put(self, new: Array, slots: Array) -> QuantizedTensor:
        """The tensor with tokens `new` [B, KH, T, Wd] (float, any dtype) written at
        payload rows `slots` [B, T] or per head [B, E, T] (kvlab.cache.placement.
        write_tokens): in the cache dtype, or quantized per token with their scales."""
        if not self.spec.quantized:
            payload = new.astype(self.payload.dtype)
            return self.replace(payload=write_tokens(self.payload, payload, slots, axis=2))
        payload, scale, zero = quantize_tokens(new, self.spec)
        return self.replace(
            payload=write_tokens(self.payload, payload, slots, axis=2),
            scale=None if scale is None else write_tokens(self.scale, scale, slots, axis=2),
            zero=None if zero is None else write_tokens(self.zero, zero, slots, axis=2),
        )

    def dequantize(self, first=0) -> Array:
        """The settled tokens as float32 [B, KH, P, Wd]; row i holds position first + i."""
        if not self.spec.quantized:
            return self.payload.astype(jnp.float32)
        b, _, p, _ = self.payload.shape
        positions = jnp.broadcast_to(first + jnp.arange(p, dtype=jnp.int32), (b, p))
        return dequantize_tokens(self.payload, self.scale, self.zero, self.spec, positions)


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
        """The codes' levels grouped as `by_groups` groups them, their scales and zeros."""
        t = self.tensor
        grouped, _ = by_groups(levels(unpack(t.payload, t.spec.bits), t.spec), t.spec)
        zero = None if t.zero is None else t.zero.astype(jnp.float32)
        return grouped, t.scale.astype(jnp.float32), zero

    def _calibrated(self) -> Array:
        """axis 'calibrated': the codes' levels [B, KH, P, Wd], before the static scale."""
        t = self.tensor
        return levels(unpack(t.payload, t.spec.bits), t.spec)

    def _coordinates(self) -> PayloadReader:
        """A basis's coordinates read as a tensor of their own (Storage.folds_basis)."""
        return PayloadReader(self.tensor.replace(spec=self.tensor.spec.coordinates()))

    def scores(self, q: Array) -> Array:
        q = q.astype(jnp.float32)
        spec = self.tensor.spec
        if spec.folds_basis:  # (q B) . c over the coordinates
            return self._coordinates().scores(jnp.einsum("BKMd,Kdr->BKMr", q, spec.bases()))
        if self.tensor.spec.read_dequantized:  # outliers in place, keys after RoPE
            scores = jnp.einsum("BKMd,BKPd->BKMP", q, self.dequantize())
            if self.tensor.spec.sketch:
                scores = scores + sketch_scores(self.tensor.payload, self.tensor.spec, q)
            return scores
        if self.tensor.spec.calibrated:  # the static scale folds into the query
            scaled = q * self.tensor.spec.static_scale()
            return jnp.einsum("BKMd,BKPd->BKMP", scaled, self._calibrated())
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
        spec = self.tensor.spec
        if spec.folds_basis:  # (w c) B^T
            return jnp.einsum("BKMr,Kdr->BKMd", self._coordinates().weighted_sum(w), spec.bases())
        if self.tensor.spec.read_dequantized:
            return jnp.einsum("BKMP,BKPd->BKMd", w, self.dequantize())
        if self.tensor.spec.calibrated:  # ... and into the output
            out = jnp.einsum("BKMP,BKPd->BKMd", w, self._calibrated())
            return out * self.tensor.spec.static_scale()
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


@dataclasses.dataclass(frozen=True)
class FirstTokens:
    """Stored tokens read through `rest` but for a row's first positions, read from
    `first` as a 16-bit cache reads them (queries and weights in its dtype):
    cache.<prefix>_full_first, KVQuant's attention sink kept exact.

    rest: a Reader, or a float32 array, [B, KH, X, Wd] whose row j holds position
    start + j (start: an int, or int32[B] per row); first: [B, KH, N, Wd], row i
    holding position i.
    """

    rest: Reader | Array
    first: Array
    start: Array | int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.rest.shape

    @property
    def step(self) -> int:
        return self.rest.step if isinstance(self.rest, Reader) else 1

    def _positions(self) -> Array:
        """int32 [B or 1, 1, 1, X]: the position each of rest's rows holds."""
        start = jnp.reshape(jnp.asarray(self.start, jnp.int32), (-1, 1, 1, 1))
        return start + jnp.arange(self.shape[2], dtype=jnp.int32)

    def scores(self, q: Array) -> Array:
        positions, n = self._positions(), self.first.shape[2]
        if isinstance(self.rest, Reader):
            rest = self.rest.scores(q)
        else:
            rest = jnp.einsum("BKMd,BKXd->BKMX", q.astype(jnp.float32), self.rest)
        exact = jnp.einsum(  # [B, KH, M, N]
            "BKMd,BKNd->BKMN", q.astype(self.first.dtype), self.first,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        at = jnp.broadcast_to(jnp.clip(positions, 0, n - 1), rest.shape)
        return jnp.where(positions < n, jnp.take_along_axis(exact, at, axis=-1), rest)

    def weighted_sum(self, w: Array) -> Array:
        positions, n = self._positions(), self.first.shape[2]
        w = w.astype(jnp.float32)
        kept = jnp.where(positions < n, 0.0, w)
        if isinstance(self.rest, Reader):
            out = self.rest.weighted_sum(kept)
        else:
            out = jnp.einsum("BKMX,BKXd->BKMd", kept, self.rest)
        # Each first position's weight: its column of w where rest holds it, else 0.
        column = jnp.arange(n, dtype=jnp.int32) - positions[..., :1]  # [B or 1, 1, 1, N]
        inside = (column >= 0) & (column < w.shape[3])
        at = jnp.broadcast_to(jnp.clip(column, 0, w.shape[3] - 1), (*w.shape[:3], n))
        first_w = jnp.where(inside, jnp.take_along_axis(w, at, axis=-1), 0.0)
        return out + jnp.einsum(
            "BKMN,BKNd->BKMd", first_w.astype(self.first.dtype), self.first,
            preferred_element_type=jnp.float32,
        )  # fmt: skip

    def dequantize(self) -> Array:
        rest = self.rest.dequantize() if isinstance(self.rest, Reader) else self.rest
        positions, n = self._positions()[:, 0, 0], self.first.shape[2]  # [B or 1, X]
        at = jnp.clip(positions, 0, n - 1)[:, None, :, None]  # [B or 1, 1, X, 1]
        exact = jnp.take_along_axis(self.first, at, axis=2).astype(jnp.float32)
        return jnp.where(positions[:, None, :, None] < n, exact, rest)

    def chunk(self, start, size: int) -> FirstTokens:
        """Tokens start..start+size-1; the first ones widened to float32, as a long
        16-bit block's slices are (kvlab.attention.core)."""
        if isinstance(self.rest, Reader):
            rest = self.rest.chunk(start, size)
        else:
            rest = jax.lax.dynamic_slice_in_dim(self.rest, start, size, axis=2)
        return FirstTokens(rest, self.first.astype(jnp.float32), self.start + start)


def read_slice(tensor: QuantizedTensor, take, start, size: int):
    """What attention reads stored tokens start..start+size-1 of `tensor` through.

    `take(array, first, count)` gives entries first..first+count-1 along the
    token axis of its payload, scale or zero array (a slice; page pools gather).
    A slice fits in cache, so it is dequantized whole (one elementwise pass,
    then plain products; below 8 bits one array per code position in a byte,
    `_phases`) unless one scale per token, or a calibrated scale, lets the scale
    fold into the products (PayloadReader's own math).
    """
    spec = tensor.spec
    if spec.axis == "channel":
        scale_start, scale_size = start // spec.group_size, size // spec.group_size
    else:
        scale_start, scale_size = start, size
    sliced = tensor.replace(
        payload=take(tensor.payload, start, size),
        scale=None if tensor.scale is None else take(tensor.scale, scale_start, scale_size),
        zero=None if tensor.zero is None else take(tensor.zero, scale_start, scale_size),
        ring=None,
    )
    if spec.sketch or spec.folds_basis:  # the sketch beside the codes; the basis folded
        return PayloadReader(sliced)
    if spec.read_dequantized:
        return sliced.dequantize(first=start)
    if spec.calibrated or (spec.axis == "token" and sliced.scale.shape[-1] == 1):
        return PayloadReader(sliced)
    if spec.bits < 8 and 8 % spec.bits == 0 and not spec.channel_tables:
        return Phases(_phases(sliced))  # a phase's channels are strided: one table
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
    tensor = empty_tensor(spec, batch, heads, width, layout.payload_len, layout.ring_len)
    first = spec.first_rows(layout.payload_len)
    if not first:
        return tensor
    first_tokens = jnp.zeros((batch, heads, first, width), dtype_of(spec.dtype))
    return tensor.replace(first_tokens=first_tokens)


def empty_tensor(
    spec: Storage, batch: int, heads: int, width: int, rows: int, ring: int
) -> QuantizedTensor:
    """A zero tensor of `rows` payload rows (a multiple of group_size on the channel
    axis) and `ring` ring slots, KH = `heads`, without first tokens (`init_tensor`)."""
    p, w = rows, ring
    dtype = dtype_of(spec.dtype)
    ring = jnp.zeros((batch, heads, w, width), dtype) if w else None
    if not spec.quantized:
        return QuantizedTensor(jnp.zeros((batch, heads, p, width), dtype), None, None, ring, spec)
    payload = jnp.zeros((batch, heads, p, spec.row_bytes(width)), jnp.uint8)
    if spec.calibrated:  # the scales are the layer's static ranges, not stored
        return QuantizedTensor(payload, None, None, ring, spec)
    coded = spec.coded_width(width)
    if spec.axis == "token":
        scale_shape = (batch, heads, p, coded // spec.group_size)
    else:
        scale_shape = (batch, heads, p // spec.group_size, coded)
    scale = jnp.zeros(scale_shape, dtype_of(spec.scale_dtype))
    zero = jnp.zeros(scale_shape, dtype_of(spec.scale_dtype)) if spec.has_zero else None
    return QuantizedTensor(payload, scale, zero, ring, spec)
