"""Attention backends: the kernels behind attention over a stored block and the
cache write, chosen by name (`model.attention_impl`).

    backend = kvlab.backends.get("pallas")   # registered, or its plug-in imported now
    kvlab.backends.register(MyKernels())     # a researcher's own, under MyKernels.name

kvlab's core is plain JAX: `kvlab.attention.core.attend` is the reference
(every block under one softmax, long stored blocks streamed a slice at a
time) and `kvlab.cache.placement.write_tokens` the one cache write, and both
run on any platform. A `Backend` may take over parts of them: `partial`
computes the softmax partial of one block of stored tokens (its peak, sum and
weighted sum, merged with the others' as flash-decoding merges them), `pooled`
the same for a pool of slots owned by several KV heads (AdaKV's), `write`
writes new tokens into a cache buffer, `top_k_last` finds an evicting layer's
few lowest-priority candidates (kvlab.cache.evict.top_k_last the reference),
and `scope` wraps a model's forward
(a plug-in may intercept the model's modules there, e.g. projections whose
weights it stores in a layout of its own). Each returns None (or does
nothing) for what it declines, and the reference runs instead, so a backend
is exactly as general as the XLA path it falls back to.

A backend must keep a program lowered for another platform free of its own
platform's calls: wrap them in `jax.lax.platform_dependent` (the branch is
picked when the program is lowered, so a program exported for TPU or CUDA
from a CPU host holds no CPU-only call), never in a check of
`jax.default_backend()` at trace time.

Built in: "xla" (the reference: declines everything). Plug-ins, imported on
first `get`: "pallas" (kvlab/kernels/pallas: Pallas kernels, Triton on CUDA,
Mosaic on TPU and the Pallas interpreter on CPU) and "native"
(kvlab/kernels/native: C++ kernels for the CPU through XLA's FFI). Other
packages register theirs through the entry-point group `kvlab.backends`
(`name = "package.module:backend_object"`), or by calling `register`
(`BACKENDS`, a kvlab.registry.Registry: `register`, `names`, `get`).

To check a program for hardware this host does not have, export it for that
platform inside `lowering_for(platform)` (nothing is compiled):

    with kvlab.backends.lowering_for("tpu"):
        exported = jax.export.export(jax.jit(step), platforms=("tpu",))(*abstract_args)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from kvlab.registry import Registry

# Plug-ins shipped with kvlab: imported when first asked for (each registers itself).
PLUGINS = {"pallas": "kvlab.kernels.pallas", "native": "kvlab.kernels.native"}
ENTRY_POINTS = "kvlab.backends"
# The chip a program lowered for TPU from another host is lowered for (Mosaic asks).
TPU_KIND = "TPU v5 lite"


class Backend:
    """Kernels for attention over stored blocks and for cache writes. This base
    declines everything: it is the XLA reference ("xla"). Subclasses override
    what they compute.

    claims(block, attention): whether `attend` should attend this block on its
        own and ask `partial` for it (blocks not claimed, and claimed ones
        partial declines, take the reference path).
    partial(block, attention): (peak [B, K, T, G, 1], total [B, K, T, G, 1],
        out [B, K, M, Hv]) of the block's keys and values under the queries
        `attention` (kvlab.attention.core.Attention) holds, or None.
    pooled(block, attention): the partial, as `partial` gives it, of a pool's
        block (kvlab.cache.protocols.Pooled keys and values: each slot read by
        the query heads of its own KV head alone) in an unobserved step, or
        None (attend then reads the arrays under the block's mask).
    readers(block, attention): the block with readers (kvlab.cache.protocols.
        Reader) of the backend's in place of its keys and values, for a step
        that observes attention (every block under one softmax, its weights
        kept for the mass), or None (the reference's products).
    write(buffer, new, slots, axis): the buffer with the new tokens written
        (kvlab.cache.placement.write_tokens' contract), or None.
    top_k_last(x, k): int32 [..., k], the indices of the k largest of float32
        x [..., C] in XLA's total order, among equals the later first
        (kvlab.cache.evict.top_k_last's contract: the candidates an evicting
        layer drops), or None.
    scope(): a context around a model's forward (`kvlab.Transformer`).
    decode_params(params): the weights in the backend's own layout for decode
        (the same function, read faster by its kernels; one way), or as given.
    unavailable_reason(): why its kernels cannot run in this process, or None.
    """

    name = "xla"

    def unavailable_reason(self) -> str | None:
        return None

    def decode_params(self, params):
        return params

    def claims(self, block, attention) -> bool:
        return False

    def partial(self, block, attention) -> tuple | None:
        return None

    def pooled(self, block, attention) -> tuple | None:
        return None

    def readers(self, block, attention):
        return None

    def write(self, buffer, new, slots, axis: int):
        return None

    def top_k_last(self, x, k: int):
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        yield


BACKENDS = Registry("attention backend", "model.attention_impl", PLUGINS, ENTRY_POINTS)
register, names, get = BACKENDS.register, BACKENDS.names, BACKENDS.get
REFERENCE = register(Backend())
_ACTIVE: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "kvlab_backend", default=None
)


@contextlib.contextmanager
def running(backend: Backend) -> Iterator[None]:
    """A model's forward under `backend` (kvlab.Transformer enters it): within,
    `backend` writes the caches (`writer`) and its `scope` is open."""
    token = _ACTIVE.set(backend)
    try:
        with backend.scope():
            yield
    finally:
        _ACTIVE.reset(token)


def writer() -> Backend:
    """The backend of the forward being traced (`running`); the reference outside one."""
    return _ACTIVE.get() or REFERENCE


def lowering_for(platform: str, device_kind: str = TPU_KIND):
    """The context in which a program traced on this host is lowered for `platform`
    (jax.export): for "tpu" an abstract mesh of one core of `device_kind`, since
    the Mosaic kernels' lowering asks which chip it is for; for others, none."""
    if platform != "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    return jax.sharding.use_abstract_mesh(mesh)
