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
      payload  uint8[B, KH, P, Wd * bits / 8]  codes, 8 / bits per byte, low bits first,
               then the token's outliers (cache.<prefix>_outliers: a channel byte and
               the number in cache.dtype each; `Storage.row_bytes`)
               (at 16 bits: cache.dtype[B, KH, P, Wd], no scale or zero; with
               cache.<prefix>_rank = r, the r coordinates of the token in its head's
               basis are coded in place of its Wd numbers, and scales count r)
      scale    [B, KH, P, Wd / group_size] (token axis) or [B, KH, P / g, Wd] (channel),
               or None (axis "calibrated": static ranges per head and channel)
      zero     as scale, or None (a format without one: symmetric int, fp8, nf)
      ring     cache.dtype[B, KH, W, Wd], or None when W = 0
      first_tokens  cache.dtype[B, KH, N, Wd]: positions 0..N-1 of the row as they came
               (cache.<prefix>_full_first, N at most P), or None

Reads keep a token's representation a pure function of the row's length when
the query was made, so a query at position p sees token i quantized exactly
when i < settled(p + 1), as token-by-token decode would, whatever the chunk
size. Attention reads payloads without building a dequantized copy where the
math allows: per-token scales multiply the query-key products and fold into the
probabilities for V; per-channel scales multiply the query group by group;
static ones multiply the query and the output. A tensor coded in a basis B is
read as its coordinates with B folded into the query (q B) and the output
((w c) B^T). A tensor with outliers, or keys coded before RoPE
(cache.k_before_rope: turned back from their position before they are coded,
turned again at the position their row holds when read, and mapped back
through their basis first), is read dequantized. A tensor that
keeps its first positions (KVQuant's attention sink, IntactKV) still codes them
in the payload as any other, but attention reads them from `first_tokens`, as a
16-bit cache reads its tokens (FirstTokens, over the payload and the settling
group alike).
"""

from kvlab.cache.quant.layer import (
    Flush,
    QuantizedLayer,
    init_layer,
    write_flush,
    write_ring,
)
from kvlab.cache.quant.storage import (
    Layout,
    Storage,
    dequantize,
    dequantize_tokens,
    levels,
    pack,
    quantize,
    quantize_tokens,
    quantized_layout,
    storages,
    unpack,
)
from kvlab.cache.quant.tensor import (
    FirstTokens,
    PayloadReader,
    Phases,
    QuantizedTensor,
    empty_tensor,
    init_tensor,
    read_slice,
)

__all__ = [
    "FirstTokens",
    "Flush",
    "Layout",
    "PayloadReader",
    "Phases",
    "QuantizedLayer",
    "QuantizedTensor",
    "Storage",
    "dequantize",
    "dequantize_tokens",
    "empty_tensor",
    "init_layer",
    "init_tensor",
    "levels",
    "pack",
    "quantize",
    "quantize_tokens",
    "quantized_layout",
    "read_slice",
    "storages",
    "unpack",
    "write_flush",
    "write_ring",
]
