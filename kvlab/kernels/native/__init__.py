"""kvlab's C++ CPU kernels as a backend: model.attention_impl='native'.

    cfg.model.attention_impl = "native"                      # kvlab.backends.get("native")
    params = kvlab.kernels.native.panel_projections(params)  # optional: decode weights in panels

Importing this module builds the kernels (kvlab/kernels/native/ffi.py, once
per machine, about 3 s) and registers the backend. What it computes where a
program is lowered for the CPU (`jax.lax.platform_dependent`: a program
lowered for TPU or CUDA, from any host, holds the reference path alone):

- attention over a block it claims (kvlab.backends.Backend): quantized
  payloads (`NativePayload`: packed codes and scales read in place, a few
  tokens dequantized at a time in the core's caches), float page pools
  through their block tables (`NativePool`), bfloat16/float16 arrays long
  enough to be streamed (`NativeRows`, widened in registers) and float32
  arrays of at least ATTENTION_MIN_BYTES (per build and product) read by 2
  to 16 queries per head,
  and keys pruned of channels as such arrays of their kept channels where
  they are whole vectors wide (`NativeChannels`, ThinK);
- attention over a pool of slots owned by several KV heads (AdaKV's `Pooled`
  block, `Backend.pooled`), each slot's products computed for its own head's
  query heads alone (`owned_partial`) instead of every query head's masked;
  each block whole, up to one past the last slot any query sees, as one
  partial merged with the others';
- the cache write of a 16-bit buffer in a one-device process, in place
  (XLA:CPU updates such a buffer through a float32 copy of all of it);
- an evicting layer's few drops of a step (`Backend.top_k_last`, up to
  TOP_FEW of them a head): the blocks of each head's candidates that can
  hold them;
- with `panel_projections(params)`, every projection whose output width is a
  multiple of 32, and a tied embedding table, as 32-column panels read by
  one kernel call each (XLA:CPU runs a one-row product on one core and
  repacks the weights of a 2-16 row product on every call): the model's
  projections (flax's nn.DenseGeneral) and its `kvlab.layers.Embedding` are
  intercepted (`flax.linen.intercept_methods`) while a forward runs under
  this backend (`scope`). The conversion is one way and for one device.

Without the kernels (no C++ compiler, an x86-64 CPU without AVX-512F or AVX2, or
KVLAB_NATIVE=0; `unavailable_reason()` says which) the backend declines
everything and the model runs the reference path; a panel tree then runs
XLA's product over the panels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from einops import rearrange
from jax import Array

from kvlab import backends
from kvlab.attention.core import (
    MASKED,
    Attention,
    narrow,
    on_platforms,
    pooled,
    scores_of,
    streamed_alone,
    tensors,
    unpooled,
    weighted_sum_of,
)
from kvlab.cache.evict import ChannelReader, top_k_last
from kvlab.cache.paged import PagedPayloadReader, PagedReader
from kvlab.cache.placement import scatter_tokens
from kvlab.cache.protocols import Pooled, Reader
from kvlab.cache.quant import PayloadReader, QuantizedTensor
from kvlab.kernels.native import ffi
from kvlab.layers import Embedding

PANEL = ffi.PANEL  # columns per panel
READS = ("int", "fp8")  # the storage formats (kvlab/cache/formats) the kernels dequantize
_UNAVAILABLE = ffi.load()  # built and registered here, never while a program is traced


TOP_FEW = 16  # top_k_last's k it takes: more (a compression's) go to XLA's top-k
LANES = 16  # float32 numbers of a vector: keys of another width are read masked, a key at a time


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can."""
    return _UNAVAILABLE


def available() -> bool:
    return _UNAVAILABLE is None


# ---------------------------------------------------------------------------
# Readers of stored blocks


class ReadWhole:
    """A Reader the kernels read whole: its one slice is all S tokens (`step`
    is S, `chunk` the reader itself), so attention never streams it."""

    @property
    def step(self) -> int:
        return self.shape[2]

    def chunk(self, start, size: int):
        return self  # start 0 and size S: the one slice


@dataclasses.dataclass(frozen=True)
class NativeRows(ReadWhole):
    """An array of keys or values (float32, or 16 bits widened to float32 in
    registers as it is read: no float32 copy) read whole and only up to `limit`
    tokens."""

    array: Array
    limit: Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.array.shape

    def scores(self, q: Array) -> Array:
        return ffi.scores(q.astype(jnp.float32), self.array, self.limit)

    def weighted_sum(self, w: Array) -> Array:
        return ffi.weighted_sum(w.astype(jnp.float32), self.array, self.limit)

    def dequantize(self) -> Array:
        return self.array.astype(jnp.float32)


def codes(tensor: QuantizedTensor, pages=None, length=None) -> ffi.Codes:
    """A quantized tensor's payload, scales and zero points (or their page pools,
    read through block tables `pages` with `length` tokens per row) as the
    kernels read them."""
    spec = tensor.spec
    return ffi.Codes(
        payload=tensor.payload,
        scale=tensor.scale,
        zero=tensor.zero,
        bits=spec.bits,
        fp8=spec.format == "fp8",
        offset=2 ** (spec.bits - 1) if spec.format == "int" and spec.symmetric else 0,
        channel=spec.axis == "channel",
        group=spec.group_size,
        pages=pages,
        length=length,
    )


@dataclasses.dataclass(frozen=True)
class NativePayload(ReadWhole):
    """A quantized payload (a row's, or page pools') whose products the kernels
    compute, dequantizing a few tokens at a time in the core's caches: read
    whole, only its first `limit` tokens."""

    reader: Reader  # the PayloadReader or PagedPayloadReader it replaces
    codes: ffi.Codes
    limit: Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.reader.shape

    def scores(self, q: Array) -> Array:
        return ffi.quant_scores(q, self.codes, self.limit)

    def weighted_sum(self, w: Array) -> Array:
        return ffi.quant_weighted_sum(w, self.codes, self.limit)

    def dequantize(self) -> Array:
        return self.reader.dequantize()


@dataclasses.dataclass(frozen=True)
class NativePool(ReadWhole):
    """A page pool (float32, or 16 bits widened in registers) whose products the
    kernels compute a page at a time through the block tables: nothing is
    gathered, the pool is read whole and only up to `limit` tokens."""

    reader: PagedReader
    limit: Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.reader.shape

    def scores(self, q: Array) -> Array:
        r = self.reader
        return ffi.pool_scores(q, r.pool, r.pages, r.length, self.limit)

    def weighted_sum(self, w: Array) -> Array:
        return ffi.pool_weighted_sum(w, self.reader.pool, self.reader.pages, self.limit)

    def dequantize(self) -> Array:
        return self.reader.dequantize()


@dataclasses.dataclass(frozen=True)
class NativeChannels(ReadWhole):
    """Keys pruned of channels (kvlab.cache.evict.ChannelReader) whose kept
    channels the kernels read as keys of that width (`rows`), against the
    queries' kept channels."""

    reader: ChannelReader
    rows: NativeRows

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.reader.shape

    def scores(self, q: Array) -> Array:
        kept = self.reader.keys.channels[:, :, None, :]
        return self.rows.scores(jnp.take_along_axis(q, kept, axis=-1))

    def weighted_sum(self, w: Array) -> Array:
        return self.reader.keys.expand(self.rows.weighted_sum(w))

    def dequantize(self) -> Array:
        return self.reader.dequantize()


@dataclasses.dataclass(frozen=True)
class OnCpu(ReadWhole):
    """float32 keys or values whose products are the kernels' (`NativeRows`)
    where the program is lowered for the CPU and the reference's elsewhere:
    read in a step that observes attention (`Native.readers`)."""

    rows: NativeRows

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.rows.shape

    def scores(self, q: Array) -> Array:
        reference = lambda: scores_of(q, self.rows.array)  # noqa: E731
        return on_platforms(lambda _: self.rows.scores(q), reference, cpu=True)

    def weighted_sum(self, w: Array) -> Array:
        reference = lambda: weighted_sum_of(w, self.rows.array)  # noqa: E731
        return on_platforms(lambda _: self.rows.weighted_sum(w), reference, cpu=True)

    def dequantize(self) -> Array:
        return self.rows.array


def _read(x, limit, rows: int, long: bool, products: tuple[str, ...]):
    """What the kernels read `x` (a block's keys or values, for `products`: ffi.PRODUCTS)
    through, `x` itself where XLA's product stays, or None where the block cannot be
    theirs."""
    spec = x.tensor.spec if isinstance(x, (PayloadReader, PagedPayloadReader)) else None
    if spec is not None and (spec.format not in READS or not spec.grouped_codes):
        return None  # codes the kernels do not dequantize: the reference reads them
    if isinstance(x, PayloadReader):
        payload = codes(x.tensor)
    elif isinstance(x, PagedPayloadReader):
        payload = codes(x.tensor, x.pages, x.shape[2])
    elif isinstance(x, PagedReader):
        # 16-bit pools are theirs where the reference would stream them: its
        # products are float32 ones there, as the kernels' are.
        if not ffi.reads_pool(x.pool, rows) or (x.dtype != jnp.float32 and not long):
            return x if ffi.reads_pool(x.pool, rows) else None
        return NativePool(x, limit)
    elif isinstance(x, ChannelReader):  # its kept channels, as an array of keys
        if x.keys.kept.shape[-1] % LANES:  # a key each product would read masked
            return x
        inner = _read(x.keys.kept, limit, rows, long, products)
        return NativeChannels(x, inner) if isinstance(inner, NativeRows) else x
    elif isinstance(x, Reader):
        return None
    elif narrow(x):  # a long 16-bit array, widened in registers as the reference widens it
        return NativeRows(x, limit) if long and rows <= ffi.MAX_ROWS else x
    else:
        return NativeRows(x, limit) if ffi.takes_attention(x, rows, products) else x
    return NativePayload(x, payload, limit) if ffi.reads(payload, rows) else None


def _limit(mask) -> Array:
    """One past the last slot any query sees."""
    return jnp.max(jnp.where(mask, jnp.arange(1, mask.shape[-1] + 1), 0))


def native_block(block, attention: Attention):
    """The block with what the kernels read swapped in (`_read`), or None when
    they read none of it or cannot read all of its stored data."""
    k, v, mask = block
    long = streamed_alone(block)  # where the reference's products are float32 ones too
    limit = _limit(mask)
    keys = {id(x) for x in tensors(block)[:-1]}
    products = lambda x: ("scores",) * (id(x) in keys) + ("weighted_sum",) * (x is v)  # noqa: E731
    # a latent is keys and values: swapped once, for both products
    swapped = {id(x): _read(x, limit, attention.rows, long, products(x)) for x in tensors(block)}
    if any(x is None for x in swapped.values()):
        return None
    if all(swapped[id(x)] is x for x in tensors(block)):
        return None
    parts = tuple(swapped[id(x)] for x in (k if isinstance(k, tuple) else (k,)))
    return (parts if isinstance(k, tuple) else parts[0], swapped[id(v)], mask)


def reads_owned(block, attention: Attention) -> bool:
    """Whether the kernels read a pool's block (`Pooled` keys and values, one key
    part) each slot with its own KV head's queries alone (`owned_partial`): a
    16-bit pool where the reference would stream it, its products float32
    ones there as the kernels' are."""
    k, v, _ = block
    if not (pooled(block) and isinstance(k, Pooled)) or len(attention.folded) != 1:
        return False
    if narrow(v.array) and not streamed_alone(unpooled(block, attention.query_heads)):
        return False
    rows = attention.shape[2] * attention.shape[3] // v.heads  # T x G per KV head
    return all(ffi.reads_owned(x.array, rows) for x in (k, v))


def owned_partial(block, attention: Attention):
    """The partial of a pool's block with each slot's products computed for its
    own KV head's query heads alone (ffi.owned_scores, owned_weighted_sum): the
    reference's masked read of the pool does K times the products."""
    k, v, _ = block
    heads = v.heads
    length = attention.shape[2]
    q = rearrange(attention.folded[0], "B 1 (T K G) H -> B K (T G) H", T=length, K=heads)
    exponents, top, listings = ffi.owned_scores(q, k.array[:, 0], v.tags, attention.scale)
    peak = jnp.maximum(top, MASKED)  # a head of no slot: MASKED, as attend's
    weights = jnp.exp(exponents)  # [B, M, S], the kernels' listed order: 0 past the slots
    out, total = ffi.owned_weighted_sum(weights, v.array[:, 0], listings, heads)
    as_pool = lambda x: rearrange(x, "B K (T G) -> B 1 T (K G) 1", T=length)  # noqa: E731
    return as_pool(peak), as_pool(total), rearrange(out, "B K (T G) H -> B 1 (T K G) H", T=length)


# ---------------------------------------------------------------------------
# Projections and the embedding in 32-column panels


def to_panels(kernel: Array, num_inputs: int = 1) -> Array:
    """A kernel [K..., N...] (`num_inputs` input axes) as 32-column panels
    [N / 32, K, 32]: panels[b, k, j] is the kernel flattened to [K, N] at
    [k, 32 b + j]. N must be a multiple of 32."""
    depth = math.prod(kernel.shape[:num_inputs])
    flat = kernel.reshape(depth, -1, PANEL)
    return jnp.transpose(flat, (1, 0, 2))


def panel_product(x: Array, panels: Array) -> Array:
    """x [M, K] @ W for W as panels [N / 32, K, 32]: the kernel for float32 where
    the program is lowered for the CPU, else one XLA product over the panels."""
    if not (available() and x.dtype == panels.dtype == jnp.float32):
        return ffi.panel_einsum(x, panels)
    return on_platforms(
        lambda _: ffi.panel_matmul(x, panels), lambda: ffi.panel_einsum(x, panels), cpu=True
    )


def panel_projections(params: Mapping) -> dict:
    """`params` (fused or not, kvlab.fuse_projections) for decode on one CPU:
    every projection kernel whose output width N is a multiple of 32 stored as
    `panels` [N / 32, K, 32] (`to_panels`), and a tied embedding table [V, D]
    as the embedding's `panels` [V / 32, D, 32], the panels of its transpose,
    which serve both the lookup and the output head. The model computes the
    same function from it under model.attention_impl='native' (module
    docstring). One way and for one device: convert a float32 tree at load and
    keep the original if it will be trained, saved, exported, converted or
    sharded (each refuses this tree). The MoE router and routed experts stay
    as they are."""

    def convert(node, name=None):
        if not isinstance(node, Mapping):
            return node
        node = {key: convert(child, key) for key, child in node.items()}
        kernel = node.get("kernel")
        if name != "router" and kernel is not None and kernel.shape[-1] % PANEL == 0:
            node["panels"] = to_panels(node.pop("kernel"), num_inputs=2 if name == "out" else 1)
        return node

    params = convert(params)
    embed = params.get("embed", {})
    tied = "embedding" in embed and "unembed" not in params
    if tied and embed["embedding"].shape[0] % PANEL == 0:  # untied: the lookup reads it as it is
        params["embed"] = {"panels": to_panels(embed["embedding"].T)}
    return params


def _project(module: nn.DenseGeneral, inputs: Array) -> Array:
    """A projection whose kernel is stored as panels: one panel_product."""
    features = (module.features,) if isinstance(module.features, int) else tuple(module.features)
    axes = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
    if sorted(a % inputs.ndim for a in axes) != list(range(inputs.ndim - len(axes), inputs.ndim)):
        raise ValueError(f"{module.name}: panels contract trailing axes, not {module.axis}")
    lead = inputs.shape[: inputs.ndim - len(axes)]
    panels = module.get_variable("params", "panels")
    bias = module.get_variable("params", "bias")
    depth, width = math.prod(inputs.shape[len(lead) :]), math.prod(features)
    if panels.shape[1] != depth or panels.shape[0] * panels.shape[2] != width:
        raise ValueError(
            f"{module.name}: panels {panels.shape} do not map {depth} inputs to {width} "
            "outputs: pass the panel_projections of this model's parameters"
        )
    x, panels, bias = module.promote_dtype(
        inputs.reshape(-1, depth), panels, bias, dtype=module.dtype
    )
    out = panel_product(x, panels).reshape(*lead, *features)
    return out if bias is None else out + bias


def _embed(module: Embedding, inputs: Array, head: bool = False) -> Array:
    """The tied embedding stored as the panels of its transpose: row v of the
    table is column v of the panels (the lookup), and the head is one product."""
    table = module.get_variable("params", "panels")  # [V / 32, D, 32]
    dtype = module.dtype
    if not head:
        return table[inputs // PANEL, :, inputs % PANEL].astype(dtype)
    x = inputs.astype(dtype)
    flat = panel_product(x.reshape(-1, x.shape[-1]), table.astype(dtype))
    return flat.reshape(*x.shape[:-1], -1)


def _panels(next_fun, args, kwargs, context):
    """flax method interceptor: projections and the embedding stored as panels."""
    module = context.module
    if context.method_name == "__call__" and module.has_variable("params", "panels"):
        if isinstance(module, Embedding):
            return _embed(module, *args, **kwargs)
        if isinstance(module, nn.DenseGeneral):
            return _project(module, *args, **kwargs)
    return next_fun(*args, **kwargs)


# ---------------------------------------------------------------------------
# The backend


class Native(backends.Backend):
    """model.attention_impl='native' (module docstring)."""

    name = "native"

    def unavailable_reason(self) -> str | None:
        return unavailable_reason()

    def decode_params(self, params):
        return panel_projections(params)

    def claims(self, block, attention: Attention) -> bool:
        return available() and native_block(block, attention) is not None

    def partial(self, block, attention: Attention):
        swapped = native_block(block, attention)
        return on_platforms(
            lambda _: attention.whole(swapped), lambda: attention.partial(block), cpu=True
        )

    def pooled(self, block, attention: Attention):
        if not (available() and reads_owned(block, attention)):
            return None
        return on_platforms(
            lambda _: owned_partial(block, attention),
            lambda: attention.partial(unpooled(block, attention.query_heads)),
            cpu=True,
        )

    def readers(self, block, attention: Attention):
        """float32 arrays as `OnCpu` readers, at any size, from 2 query rows per
        KV head: in a step that observes attention XLA:CPU hands each of the
        step's small products and reductions to YNNPACK, at a cost of 0.4-3 ms
        each in its first run (the first compression of configs/gqa.py:small at
        8k tokens took 54 ms against 14 for one that reads no attention). A
        single row (a decode step of multi-head attention) stays XLA's
        matrix-vector product, at memory speed as in a step that observes
        nothing (`ffi.takes_attention`): through the kernels h2o and tova
        decoded configs/mha.py:small at 8k no faster than the full cache
        (docs/benchmarks.md)."""
        if not available() or not 2 <= attention.rows <= ffi.MAX_ROWS:
            return None
        k, v, mask = block
        limit = _limit(mask)

        def swap(x):
            if isinstance(x, jax.Array) and x.dtype == jnp.float32:
                return OnCpu(NativeRows(x, limit))
            return x

        if not any(swap(x) is not x for x in tensors(block)):
            return None
        return (tuple(map(swap, k)) if isinstance(k, tuple) else swap(k), swap(v), mask)

    def write(self, buffer, new, slots, axis: int):
        if not (available() and ffi.writes_in_place(buffer)):
            return None
        return on_platforms(
            lambda _: _write_in_place(buffer, new, slots, axis),
            lambda: scatter_tokens(buffer, new, slots, axis),
            cpu=True,
        )

    def top_k_last(self, x, k: int):
        """A few (at most TOP_FEW: a decode step's drops) by the kernel, which
        reads only the blocks of a row that can hold them (XLA:CPU's top-k of a
        reversed row costs three to fifteen times more; docs/backends.md)."""
        if not (available() and x.dtype == jnp.float32 and 0 < k <= min(TOP_FEW, x.shape[-1])):
            return None
        return on_platforms(lambda _: ffi.top_k_last(x, k), lambda: top_k_last(x, k), cpu=True)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with nn.intercept_methods(_panels):
            yield


def _write_in_place(buffer, new, slots, axis: int):
    """write_tokens by the kernel: the buffer seen as [B, X, S, Y] (X the axes
    before `axis`, Y those after), only the new tokens written."""
    lead, trail = buffer.shape[1:axis], buffer.shape[axis + 1 :]
    shape = (buffer.shape[0], math.prod(lead), buffer.shape[axis], math.prod(trail))
    fresh = new.reshape(shape[0], shape[1], new.shape[axis], shape[3])
    slots = slots if slots.ndim == 3 else slots[:, None, :]  # [B, 1 or X, T]
    return ffi.write_tokens(buffer.reshape(shape), fresh, slots).reshape(buffer.shape)


backend = backends.register(Native())
