"""The stored tensors of an evicting layer: arrays in the cache dtype, or
QuantizedTensors quantized per token as they are stored. layers.py reads and
writes its slots through these (paged.py writes its page pools itself).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.placement import write_tokens
from kvlab.cache.quant import QuantizedTensor, dequantize_tokens, quantize_tokens
from kvlab.config import dtype_of


def reader_of(tensor):
    """What attention reads a stored tensor through."""
    return tensor.reader() if isinstance(tensor, QuantizedTensor) else tensor


def as_pending(x: Array, tensor) -> Array:
    """New tokens as `write` takes them: in the cache dtype."""
    if not isinstance(tensor, QuantizedTensor):
        return x.astype(tensor.dtype)
    return x.astype(dtype_of(tensor.spec.dtype))


def as_stored(x: Array, tensor) -> Array:
    """New tokens (from `as_pending`) as attention will see them stored:
    quantized ones as their dequantized codes."""
    if not isinstance(tensor, QuantizedTensor) or not tensor.spec.quantized:
        return x
    return dequantize_tokens(*quantize_tokens(x, tensor.spec), tensor.spec)


def stored_values(tensor) -> Array:
    """The stored tokens as an array [B, KH, S, W] (knorm's key norms)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize()
    return tensor.astype(jnp.float32)


def put_tokens(tensor, new: Array, slots: Array):
    """`new` [B, KH, T, W] written at `slots` [B, T] or per head [B, E, T]."""
    if not isinstance(tensor, QuantizedTensor):
        return write_tokens(tensor, new, slots, axis=2)
    if not tensor.spec.quantized:
        return tensor.replace(payload=write_tokens(tensor.payload, new, slots, axis=2))
    payload, scale, zero = quantize_tokens(new, tensor.spec)
    return tensor.replace(
        payload=write_tokens(tensor.payload, payload, slots, axis=2),
        scale=write_tokens(tensor.scale, scale, slots, axis=2),
        zero=None if zero is None else write_tokens(tensor.zero, zero, slots, axis=2),
    )


def tensor_heads(tensor) -> int:
    """KH: the heads a stored tensor holds."""
    array = tensor.payload if isinstance(tensor, QuantizedTensor) else tensor
    return array.shape[1]


def tensor_width(tensor) -> int:
    """W: numbers per token and head (a quantized payload's, unpacked)."""
    return tensor.width if isinstance(tensor, QuantizedTensor) else tensor.shape[3]
