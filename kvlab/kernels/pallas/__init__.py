"""Pallas kernels as a backend: model.attention_impl='pallas'.

The kernels read one layer's stored tokens as the cache keeps them (dense
rows, page pools through block tables, packed codes with their scales) and
compute the block's softmax partial: triton.py for CUDA, mosaic.py for TPU,
both checked by plan.py and sharing tiles.py's arithmetic. The backend claims
every block of stored data (quantized payloads, page pools), and takes one
when its mask is one prefix per row for every query (a payload's settled
tokens, a pool's written ones); a mask that is no prefix (an evicting
window's band) takes the reference path at run time. The kernel is chosen
by the platform the program is lowered for: Triton for CUDA, Mosaic for TPU,
each compiled, and on the CPU the Pallas interpreter running `ON_CPU`'s
kernel (its arithmetic, slowly: tests). Shapes a kernel does not take
(`takes`: Triton's power-of-two tiles, Mosaic's one page size) and every
other platform take the reference path alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvlab import backends
from kvlab.attention.core import Attention, on_platforms, tensors
from kvlab.cache.paged import PagedPayloadReader, PagedReader
from kvlab.cache.protocols import Reader
from kvlab.cache.quant import PayloadReader
from kvlab.kernels.pallas import mosaic, triton
from kvlab.kernels.pallas.plan import Stored

# The storage formats (kvlab/cache/formats) whose codes the kernels dequantize.
READS = ("int", "fp8")
# The kernel compiled for each platform the program may be lowered for.
KERNELS = {"cuda": triton, "tpu": mosaic}
# The kernel the Pallas interpreter runs where the program is lowered for the CPU.
ON_CPU = "cuda"


def stored(x) -> Stored | None:
    """A block's keys or values as the kernels read them, or None."""
    spec = x.tensor.spec if isinstance(x, (PayloadReader, PagedPayloadReader)) else None
    if spec is not None and (spec.format not in READS or not spec.grouped_codes):
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
                out, peak, total = KERNELS.get(platform, KERNELS[ON_CPU]).stored_attention(
                    tuple(attention.folded),
                    keys,
                    values,
                    lengths,
                    scale=attention.scale,
                    interpret=platform == "cpu",
                )
                rows = (batch, kv_heads, length, groups, 1)
                return peak.reshape(rows), total.reshape(rows), out

            return jax.lax.cond(prefix, run, lambda: attention.partial(block))

        takes = {
            platform: module.takes(
                attention.folded,
                keys,
                values,
                lengths,
                scale=attention.scale,
                interpret=platform == "cpu",
            )
            for platform, module in {**KERNELS, "cpu": KERNELS[ON_CPU]}.items()
        }
        return on_platforms(kernel, lambda: attention.partial(block), **takes)


backend = backends.register(Pallas())
