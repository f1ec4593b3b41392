"""Building blocks shared by the attention variants and the model.

projection(config, features, name, axis=-1, bias=False, axes=None) -> Projection
Embedding(config)(tokens [B, T]) -> [B, T, D];  (x [B, T, D], head=True) -> [B, T, V]
RMSNorm(config, eps=None)(x [..., D]) -> [..., D]      (arXiv:1910.07467)
logical(init, names) -> init; with logical_axes(): ... (parameters' logical axis names)

Parameters carry logical axis names (embed, heads, mlp, ...; kvlab/sharding.py
maps them to mesh axes) through flax's `nn.with_logical_partitioning`, but only
while `logical_axes()` is active: kvlab.sharding traces the model's init inside
it to read the names (`nn.get_partition_spec`). Everywhere else the
initialisers are the plain ones, so `model.init`, `init_params` and every
parameter tree stay plain arrays and compile to the same program as without names.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import default_kernel_init
from ml_collections import FrozenConfigDict

from kvlab.config import dtype_of

_NAMED = contextvars.ContextVar("kvlab_logical_axes", default=False)


@contextlib.contextmanager
def logical_axes() -> Iterator[None]:
    """Parameters created inside carry their logical axis names (flax
    LogicallyPartitioned boxes); trace an init here, never a training step."""
    token = _NAMED.set(True)
    try:
        yield
    finally:
        _NAMED.reset(token)


def logical(init: Callable, names: Sequence[str | None]) -> Callable:
    """`init` whose parameter carries the logical axis `names` (one per dimension)
    inside `logical_axes()`, and `init` itself elsewhere."""
    if _NAMED.get():
        return nn.with_logical_partitioning(init, tuple(names))
    return init


def projection(
    config, features, name: str, axis=-1, bias: bool = False, axes: Sequence | None = None
) -> Projection:
    """A linear map in the model's compute and parameter dtypes, bias-free unless
    `bias` (then a `bias` of shape `features`, initialised to zeros).

    `axes` names the kernel's dimensions (inputs, then features) for sharding;
    None leaves them to kvlab.sharding's fallback by parameter path."""
    kernel_init, bias_init = default_kernel_init, nn.initializers.zeros_init()
    if axes is not None:
        num_features = 1 if isinstance(features, int) else len(features)
        kernel_init = logical(kernel_init, axes)
        bias_init = logical(bias_init, tuple(axes)[-num_features:])
    return Projection(
        features,
        axis=axis,
        use_bias=bias,
        name=name,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        kernel_init=kernel_init,
        bias_init=bias_init,
    )


class Projection(nn.DenseGeneral):
    """A linear map over trailing input axes (nn.DenseGeneral): kvlab's own class,
    so a backend can recognise its projections (kvlab/kernels/native stores
    their kernels in panels)."""


class Embedding(nn.Module):
    """The token embedding E [V, D] (nn.Embed's parameter `embedding`, its
    initialiser and dtypes), used both ways: `embed(tokens)` looks rows up
    ([...] -> [..., D] in model.dtype), `embed(x, head=True)` is the tied output
    head x E^T ([..., D] -> [..., V]). One compact method, so a backend may
    intercept both (kvlab/kernels/native reads the table from panels)."""

    config: FrozenConfigDict  # the model section

    @property
    def dtype(self):
        return dtype_of(self.config.dtype)

    @nn.compact
    def __call__(self, inputs: jax.Array, head: bool = False) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(stddev=cfg.embed_dim**-0.5)
        table = self.param(
            "embedding",
            logical(init, ("vocab", "embed")),
            (cfg.vocab_size, cfg.embed_dim),
            dtype_of(cfg.param_dtype),
        )
        if head:  # as nn.Embed.attend
            query, table = nn.dtypes.promote_dtype(inputs, table, dtype=self.dtype)
            return jnp.dot(query, table.T)
        (table,) = nn.dtypes.promote_dtype(table, dtype=self.dtype, inexact=False)
        return jnp.take(table, inputs, axis=0)  # as nn.Embed.__call__


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel scale, computed in float32."""

    config: FrozenConfigDict  # the model section
    eps: float | None = None  # None: model.norm_eps

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale",
            logical(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            dtype_of(self.config.param_dtype),
        )
        eps = self.config.norm_eps if self.eps is None else self.eps
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (normed * scale.astype(jnp.float32)).astype(dtype_of(self.config.dtype))
