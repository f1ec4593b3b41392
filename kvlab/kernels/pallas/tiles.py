"""The arithmetic inside both kernels (triton.py, mosaic.py): one block of tokens.

A kernel loads a block's stored data and scale rows as its platform loads them;
from there the numbers are the same on every platform: `dequantized` turns the
loaded codes into float32 numbers (PayloadReader's math, `kvlab.cache.quant`'s
`unpack` and `dequantize`), and `softmax_step` folds the block into the running
(acc, peak, total) of the online softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvlab.attention.core import MASKED
from kvlab.cache.quant import dequantize, unpack
from kvlab.kernels.pallas.plan import DOT_MIN, CallPlan, TensorPlan


def scale_rows(tensor: TensorPlan, size: int) -> int:
    """Rows of scales a block of `size` tokens holds: one per token, or per channel
    group of group_size tokens."""
    spec = tensor.spec
    return size // spec.group_size if spec is not None and spec.axis == "channel" else size


def dequantized(tensor: TensorPlan, data: Array, scales: list, size: int) -> Array:
    """A block [size, width] from its loaded data [size, X] and scale rows (scale, then
    zero where the spec has one): 16-bit numbers as they are, codes unpacked and scaled
    in float32."""
    spec = tensor.spec
    if spec is None:
        return data
    codes = unpack(data, spec.bits)  # [size, width]
    if spec.axis == "channel":  # one scale per channel and group of tokens
        grouped, axis = codes.reshape(size // spec.group_size, spec.group_size, tensor.width), 1
    else:  # one scale per token and group of channels
        grouped, axis = codes.reshape(size, tensor.scale_width, spec.group_size), 2
    scale, zero = scales[0], (scales[1] if tensor.has_zero else None)
    return dequantize(grouped, scale, zero, spec, axis).reshape(size, tensor.width)


def narrowed(tile: Array, call: CallPlan) -> Array:
    """A tile [block, W] in the products' dtype when that is narrower than its own."""
    dtype = jnp.dtype(call.compute)
    return tile.astype(dtype) if dtype.itemsize < tile.dtype.itemsize else tile


def contract(a: Array, b: Array, dims: tuple[int, int]) -> Array:
    """float32 a . b over a's axis dims[0] and b's axis dims[1] (2-D operands of one
    dtype): a matrix product where every side is at least DOT_MIN, else multiply and
    sum (tl.dot's smallest side; float32 products at full precision either way)."""
    out_a, out_b = a.shape[1 - dims[0]], b.shape[1 - dims[1]]
    if min(out_a, out_b, a.shape[dims[0]]) >= DOT_MIN:
        return jax.lax.dot_general(
            a,
            b,
            (((dims[0],), (dims[1],)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    a = a.astype(jnp.float32) if dims[0] == 1 else a.astype(jnp.float32).T  # [out_a, n]
    b = b.astype(jnp.float32) if dims[1] == 1 else b.astype(jnp.float32).T  # [out_b, n]
    return jnp.sum(a[:, None, :] * b[None, :, :], axis=-1)


def softmax_step(carry, queries: list, keys: list, value: Array, visible: Array, call: CallPlan):
    """(acc [M, Hv], peak [M], total [M]) with one more block folded in: the query
    parts [M, H_j] against the key tiles [block, H_j], the value tile [block, Hv];
    only tokens `visible` [block] count (slots past a length may hold anything)."""
    acc, peak, total = carry
    scores = 0.0
    for part, tile in zip(queries, keys, strict=True):
        scores = scores + contract(part.astype(tile.dtype), tile, (1, 1))  # [M, block]
    scores = jnp.where(visible[None, :], scores * call.scale, MASKED)
    new_peak = jnp.maximum(peak, scores.max(axis=-1))
    correction = jnp.exp(peak - new_peak)
    weights = jnp.where(visible[None, :], jnp.exp(scores - new_peak[:, None]), 0.0)
    value = jnp.where(visible[:, None], value, jnp.zeros((), value.dtype))  # NaN past a length
    acc = acc * correction[:, None] + contract(weights.astype(value.dtype), value, (1, 0))
    total = total * correction + weights.sum(axis=-1)
    return acc, new_peak, total
