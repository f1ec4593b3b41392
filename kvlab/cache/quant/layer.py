"""One quantized layer: settled groups flushed from the full-precision ring into
the payloads, and the blocks attention reads (kvlab/cache/quant/__init__.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from kvlab.cache.placement import Placement, write_tokens
from kvlab.cache.quant.storage import Layout, Storage, dequantize_tokens, quantize_tokens
from kvlab.cache.quant.tensor import FirstTokens, PayloadReader, QuantizedTensor, init_tensor
from kvlab.config import dtype_of


@struct.dataclass
class Flush:
    """Tokens leaving the ring this step, in whole groups (what `write` stores).

    positions int32[B, F*g] (-1 where nothing settles); per tensor: payload rows
    [B, KH, F*g, .] (packed codes, or the numbers themselves at 16 bits),
    scales and zeros, and its first tokens with the step's written (or None).
    """

    positions: Array
    fresh: tuple  # the step's new tokens per tensor, cache dtype [B, KH, T, Wd]
    payloads: tuple
    scales: tuple
    zeros: tuple
    firsts: tuple  # per tensor: cache dtype [B, KH, N, Wd] (cache.<prefix>_full_first) or None


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
                    payload, scale, zero = quantize_tokens(taken, tensor.spec, positions)
                    value = dequantize_tokens(payload, scale, zero, tensor.spec, positions)
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
        firsts = tuple(
            None if t.first_tokens is None else write_first(t.first_tokens, new, layout, placement)
            for t, new in zip(self.tensors, fresh, strict=True)
        )
        return Flush(positions, fresh, payloads, scales, zeros, firsts), values

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
        readers = readers or tuple(t.reader() for t in self.tensors)
        readers = tuple(_exact_first(r, f) for r, f in zip(readers, flush.firsts, strict=True))
        blocks = [(readers, (payload_positions < before[:, None, None]) & rule(payload_positions))]
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
        settled_values = tuple(  # keys with a sketch are read as the payload reads them
            _exact_first(
                PayloadReader(QuantizedTensor(payload, scale, zero, None, t.spec))
                if t.spec.sketch
                else value,
                first,
                before,
            )
            for t, value, payload, scale, zero, first in zip(
                self.tensors, settled_values, flush.payloads, flush.scales, flush.zeros,
                flush.firsts, strict=True,
            )
        )  # fmt: skip
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
    for tensor, new, payload, scale, zero, first in zip(
        tensors, flush.fresh, flush.payloads, flush.scales, flush.zeros, flush.firsts, strict=True
    ):
        rows = put(tensor.payload, payload, flush.positions)
        if tensor.spec.quantized and not tensor.spec.calibrated:
            if tensor.spec.axis == "token":
                scale_slots = flush.positions
            else:  # one scale row per group of g tokens
                scale_slots = flush.positions[:, ::g] // g
            scale = put(tensor.scale, scale, scale_slots)
            if zero is not None:
                zero = put(tensor.zero, zero, scale_slots)
        ring = None if tensor.ring is None else write_ring(tensor.ring, new, layout, placement)
        written.append(QuantizedTensor(rows, scale, zero, ring, tensor.spec, first))
    return tuple(written)


def write_ring(ring: Array, new: Array, layout: Layout, placement: Placement) -> Array:
    """The ring [B, KH, W, Wd] with the step's tokens `new` [B, KH, T, Wd] that stay
    unsettled written at slot position mod W."""
    after = layout.settled(placement.lengths + placement.num_tokens)
    positions = placement.positions
    stays = (positions >= after[:, None]) & (placement.slots < layout.capacity)
    ring_slots = jnp.where(stays, positions % layout.ring_len, layout.ring_len)
    return write_tokens(ring, new, ring_slots, axis=2)


def _exact_first(stored, first: Array | None, start=0):
    """`stored` (a Reader or an array of tokens from position `start` on) with a
    row's first positions read exactly from `first` (FirstTokens), or as it is."""
    return stored if first is None else FirstTokens(stored, first, start)


def write_first(first: Array, new: Array, layout: Layout, placement: Placement) -> Array:
    """The first tokens [B, KH, N, Wd] with the step's tokens `new` [B, KH, T, Wd] at
    positions below N written (slot = position); padding and later positions dropped."""
    n = first.shape[2]
    kept = (placement.positions < n) & (placement.slots < layout.capacity)
    return write_tokens(first, new, jnp.where(kept, placement.positions, n), axis=2)


def init_layer(specs: tuple[Storage, ...], layout: Layout, batch: int, shapes) -> QuantizedLayer:
    """An empty quantized layer; shapes: (heads, width) per cached tensor."""
    return QuantizedLayer(
        tuple(init_tensor(s, layout, batch, h, w) for s, (h, w) in zip(specs, shapes, strict=True)),
        layout,
    )
