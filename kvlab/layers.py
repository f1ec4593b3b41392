"""Building blocks shared by the attention variants and the model.

projection(config, features, name, axis=-1, bias=False) -> nn.DenseGeneral
RMSNorm(config, eps=None)(x [..., D]) -> [..., D]      (arXiv:1910.07467)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import FrozenConfigDict

from kvlab.config import dtype_of


def projection(config, features, name: str, axis=-1, bias: bool = False) -> nn.DenseGeneral:
    """A linear map in the model's compute and parameter dtypes, bias-free unless
    `bias` (then a `bias` of shape `features`, initialised to zeros)."""
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=bias,
        name=name,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
    )


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel scale, computed in float32."""

    config: FrozenConfigDict  # the model section
    eps: float | None = None  # None: model.norm_eps

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", nn.initializers.ones, (x.shape[-1],), dtype_of(self.config.param_dtype)
        )
        eps = self.config.norm_eps if self.eps is None else self.eps
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (normed * scale.astype(jnp.float32)).astype(dtype_of(self.config.dtype))
