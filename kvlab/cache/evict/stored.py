"""The stored tensors of an evicting layer: arrays in the cache dtype,
QuantizedTensors quantized per token as they are stored, or keys stored with a
subset of their channels (PrunedKeys: a wrapper that prunes key channels,
ThinK, kvlab/cache/evict/think.py). layers.py reads and writes its slots
through these (paged.py writes its page pools itself).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from kvlab.cache.placement import write_tokens
from kvlab.cache.quant import PayloadReader, QuantizedTensor, dequantize_tokens, quantize_tokens
from kvlab.config import dtype_of


@struct.dataclass
class PrunedKeys:
    """Keys whose slots store `channels` of their `width` channels, chosen per row
    and KV head at the row's first write (a wrapper's `key_channels`).

    kept      [B, K, S, Wk] in the cache dtype: channel channels[b, k, j] of each key at j
    channels  int32[B, K, Wk], ascending
    width     W, the keys' channels (static)

    A key reads as zero in the channels not kept, so attention scores are the
    kept channels' products (ChannelReader gathers the queries' kept channels).
    """

    kept: Array
    channels: Array
    width: int = struct.field(pytree_node=False)

    @property
    def dtype(self):
        return self.kept.dtype

    def narrow(self, x: Array) -> Array:
        """Keys x [B, K, N, W] as stored: their kept channels [B, K, N, Wk]."""
        return jnp.take_along_axis(x, self.channels[:, :, None, :], axis=-1)

    def expand(self, kept: Array) -> Array:
        """Kept channels [B, K, N, Wk] as float32 keys [B, K, N, W], zero elsewhere."""
        b, k, n, _ = kept.shape
        out = jnp.zeros((b, k, n, self.width), jnp.float32)
        rows = jnp.arange(b)[:, None, None, None], jnp.arange(k)[None, :, None, None]
        tokens = jnp.arange(n)[None, None, :, None]
        return out.at[rows[0], rows[1], tokens, self.channels[:, :, None, :]].set(
            kept.astype(jnp.float32)
        )

    def seen(self, x: Array, chosen: Array) -> Array:
        """A step's keys x [B, K, T, W] as its queries see them: in the rows whose
        channels are `chosen` (bool[B]) zero in the pruned ones, as stored; whole
        in a row's first write, which chooses them after its attention."""
        b, k, _ = self.channels.shape
        rows = jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None]
        kept = jnp.zeros((b, k, self.width), bool).at[rows[0], rows[1], self.channels].set(True)
        keep = kept[:, :, None, :] | ~chosen[:, None, None, None]
        return jnp.where(keep, x, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class ChannelReader:
    """Attention over PrunedKeys (kvlab.cache.protocols.Reader): each query's kept
    channels meet the stored ones, nothing is expanded."""

    keys: PrunedKeys

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, k, s, _ = self.keys.kept.shape
        return (b, k, s, self.keys.width)

    @property
    def step(self) -> int:
        """float32 keys are read whole, as a float32 array is (one product per head
        at memory bandwidth); 16-bit ones a slice at a time, widened in cache."""
        kept = self.keys.kept
        return kept.shape[2] if kept.dtype == jnp.float32 else 1

    # float32 products, as a quantized payload's (PayloadReader) and a streamed
    # 16-bit slice's: the queries and weights are not rounded to the cache dtype.

    def scores(self, q: Array) -> Array:
        gathered = jnp.take_along_axis(q, self.keys.channels[:, :, None, :], axis=-1)
        kept = self.keys.kept.astype(jnp.float32)
        return jnp.einsum("BKMd,BKSd->BKMS", gathered.astype(jnp.float32), kept)

    def weighted_sum(self, w: Array) -> Array:
        kept = self.keys.kept.astype(jnp.float32)
        return self.keys.expand(jnp.einsum("BKMS,BKSd->BKMd", w.astype(jnp.float32), kept))

    def dequantize(self) -> Array:
        return self.keys.expand(self.keys.kept)

    def chunk(self, start, size: int):
        kept = jax.lax.dynamic_slice_in_dim(self.keys.kept, start, size, axis=2)
        return ChannelReader(self.keys.replace(kept=kept))


def reader_of(tensor):
    """What attention reads a stored tensor through."""
    if isinstance(tensor, PrunedKeys):
        return ChannelReader(tensor)
    return tensor.reader() if isinstance(tensor, QuantizedTensor) else tensor


def as_pending(x: Array, tensor) -> Array:
    """New tokens as `write` takes them: in the cache dtype."""
    if not isinstance(tensor, QuantizedTensor):
        return x.astype(tensor.dtype)
    return x.astype(dtype_of(tensor.spec.dtype))


def as_stored(x: Array, tensor, lengths: Array | None = None) -> Array:
    """New tokens (from `as_pending`) as attention will see them stored:
    quantized ones as their dequantized codes; pruned keys without their pruned
    channels in rows past their first write (`lengths` [B]: the rows' lengths
    before the step, PrunedKeys.seen)."""
    if isinstance(tensor, PrunedKeys):
        return tensor.seen(x, lengths > 0)
    if not isinstance(tensor, QuantizedTensor) or not tensor.spec.quantized:
        return x
    return dequantize_tokens(*quantize_tokens(x, tensor.spec), tensor.spec)


def as_read(x: Array, tensor, lengths: Array):
    """New tokens as attention reads them stored: `as_stored`, but keys with a
    residual sketch through their codes and sketch (a PayloadReader), as their
    payload rows are read once written."""
    if isinstance(tensor, QuantizedTensor) and tensor.spec.sketch:
        payload, scale, zero = quantize_tokens(x, tensor.spec)
        return PayloadReader(QuantizedTensor(payload, scale, zero, None, tensor.spec))
    return as_stored(x, tensor, lengths)


def stored_values(tensor) -> Array:
    """The stored tokens as an array [B, KH, S, W] (knorm's key norms)."""
    if isinstance(tensor, PrunedKeys):
        return tensor.expand(tensor.kept)
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize()
    return tensor.astype(jnp.float32)


def put_tokens(tensor, new: Array, slots: Array):
    """`new` [B, KH, T, W] written at `slots` [B, T] or per head [B, E, T]."""
    if isinstance(tensor, PrunedKeys):
        return tensor.replace(kept=write_tokens(tensor.kept, tensor.narrow(new), slots, axis=2))
    if not isinstance(tensor, QuantizedTensor):
        return write_tokens(tensor, new, slots, axis=2)
    return tensor.put(new, slots)


def tensor_heads(tensor) -> int:
    """KH: the heads a stored tensor holds."""
    if isinstance(tensor, PrunedKeys):
        return tensor.kept.shape[1]
    array = tensor.payload if isinstance(tensor, QuantizedTensor) else tensor
    return array.shape[1]


def tensor_width(tensor) -> int:
    """W: numbers per token and head (a quantized payload's, unpacked; pruned keys'
    whole width)."""
    if isinstance(tensor, (QuantizedTensor, PrunedKeys)):
        return tensor.width
    return tensor.shape[3]
