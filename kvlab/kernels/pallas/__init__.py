"""Pallas kernels as a backend: model.attention_impl='pallas'.

The kernels (kvlab/kernels/pallas/triton.py; plan.py checks their arguments)
read one layer's stored tokens as the cache keeps them (dense rows, page pools
through block tables, packed codes with their scales) and compute the block's
softmax partial. The backend claims every block of stored data (quantized
payloads, page pools), and takes one when its mask is one prefix per row for
every query (a payload's settled tokens, a pool's written ones); a mask that is
no prefix (an evicting window's band) takes the reference path at run time. Where the program is
lowered for CUDA the Triton kernel runs; for the CPU, the Pallas interpreter
(the kernel's own arithmetic, slowly: tests); for any other platform (TPU,
until kernels for it exist), and on CUDA for shapes Triton's tiles cannot take
(`triton.compiles`), the reference path alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvlab import backends
from kvlab.attention.core import Attention, on_platforms, tensors
from kvlab.cache.paged import PagedPayloadReader, PagedReader
from kvlab.cache.protocols import Reader
from kvlab.cache.quant import PayloadReader
from kvlab.kernels.pallas.triton import Stored, compiles, stored_attention

# The storage formats (kvlab/cache/formats) whose codes the kernels dequantize.
READS = ("int", "fp8")
# Where the program is lowered for each platform: the compiled kernel or the interpreter.
INTERPRET = {"cuda": False, "cpu": True}


def stored(x) -> Stored | None:
    """A block's keys or values as the kernels read them, or None."""
    if isinstance(x, (PayloadReader, PagedPayloadReader)) and x.tensor.spec.format not in READS:
        return None  # codes the kernels do not dequantize: the reference reads them
    if isinstance(x, PayloadReader):
        return Stored.of(x.tensor)
    if isinstance(x, PagedPayloadReader):
        return Stored.of(x.tensor, x.pages)
    if isinstance(x, PagedReader):
        return Stored(x.pool, pages=x.pages)
    return None


class Pallas(backends.Backend):
    """model.attention_impl='pallas' (module docstring)."""

    name = "pallas"

    def claims(self, block, attention: Attention) -> bool:
        return any(isinstance(x, Reader) for x in tensors(block))

    def partial(self, block, attention: Attention):
        """The kernel's partial where it reads the block (every tensor stored
        data, every key part with the values' heads, a mask of one row), else None."""
        k, v, mask = block
        batch, kv_heads, length, groups = attention.shape
        if mask.ndim != 3 or mask.shape[1] != 1:
            return None
        if any(heads != kv_heads for heads in attention.part_heads):
            return None
        read = {id(x): stored(x) for x in tensors(block)}
        if any(x is None for x in read.values()):
            return None
        lengths = mask[:, 0].sum(axis=-1, dtype=jnp.int32)
        prefix = jnp.all(mask[:, 0] == (jnp.arange(mask.shape[-1]) < lengths[:, None]))
        parts = k if isinstance(k, tuple) else (k,)
        keys, values = tuple(read[id(x)] for x in parts), read[id(v)]

        def kernel(platform: str):
            def run():
                out, peak, total = stored_attention(
                    tuple(attention.folded),
                    keys,
                    values,
                    lengths,
                    scale=attention.scale,
                    interpret=INTERPRET[platform],
                )
                rows = (batch, kv_heads, length, groups, 1)
                return peak.reshape(rows), total.reshape(rows), out

            return jax.lax.cond(prefix, run, lambda: attention.partial(block))

        triton = compiles(attention.folded, keys, values, lengths, scale=attention.scale)
        return on_platforms(kernel, lambda: attention.partial(block), cpu=True, cuda=triton)


backend = backends.register(Pallas())
