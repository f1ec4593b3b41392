"""Building blocks shared by the attention variants and the model.

projection(config, features, name, axis=-1, bias=False, axes=None) -> Projection
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
import math
from collections.abc import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import default_kernel_init
from ml_collections import FrozenConfigDict

from kvlab import native
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
    """nn.DenseGeneral over trailing input axes that also reads its kernel as
    `panels` [N / 32, K, 32], the kernel [K..., N...] flattened to [K, N] in
    32-column panels (kvlab.model.panel_projections): then one
    kvlab.native.panel_matmul, which a decode step's few rows run at memory
    speed on CPU. With a `kernel` it is nn.DenseGeneral unchanged."""

    def __call__(self, inputs):
        if not self.has_variable("params", "panels"):
            return super().__call__(inputs)
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        inputs_axes = sorted(a % inputs.ndim for a in axes)
        if inputs_axes != list(range(inputs.ndim - len(axes), inputs.ndim)):
            raise ValueError(f"{self.name}: panels contract trailing axes, not {self.axis}")
        lead = inputs.shape[: inputs.ndim - len(axes)]
        panels, bias = self.get_variable("params", "panels"), self.get_variable("params", "bias")
        depth, width = math.prod(inputs.shape[len(lead) :]), math.prod(features)
        if panels.shape[1] != depth or panels.shape[0] * panels.shape[2] != width:
            raise ValueError(
                f"{self.name}: panels {panels.shape} do not map {depth} inputs to {width} "
                "outputs: pass the panel_projections of this model's parameters"
            )
        x, panels, bias = self.promote_dtype(
            inputs.reshape(-1, panels.shape[1]), panels, bias, dtype=self.dtype
        )
        out = native.panel_matmul(x, panels).reshape(*lead, *features)
        return out if bias is None else out + bias


def to_panels(kernel: jax.Array, num_inputs: int = 1) -> jax.Array:
    """A kernel [K..., N...] (`num_inputs` input axes) as 32-column panels
    [N / 32, K, 32]; N must be a multiple of 32."""
    depth = math.prod(kernel.shape[:num_inputs])
    flat = kernel.reshape(depth, -1, native.PANEL)
    return jnp.transpose(flat, (1, 0, 2))


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
