"""A seeded random orthogonal rotation (SpinQuant's random start, arXiv:2405.16406;
TurboQuant's random rotation, arXiv:2504.19874), for any width.

    cfg.cache.k_transform = "orthogonal"   # kvlab.registry.TRANSFORMS ships it by this name

R is the orthogonal factor of the QR decomposition of an n x n standard normal
matrix drawn with a fixed seed (0, the same in every process), its columns'
signs set by R's diagonal so that R is Haar-distributed; one R per width n,
computed once on the host in float64. Unlike the Hadamard rotation it takes any
width (a latent of 512 + 64 channels, a head of 80) and costs a dense n x n
product per token instead of n log2 n additions.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import Array

from kvlab.cache.transforms import Transform
from kvlab.registry import TRANSFORMS

SEED = 0


@functools.cache
def rotation(n: int) -> np.ndarray:
    """float32[n, n] the seeded Haar-random orthogonal matrix of width n."""
    gaussian = np.random.default_rng([SEED, n]).standard_normal((n, n))
    q, r = np.linalg.qr(gaussian)
    return (q * np.sign(np.diag(r))).astype(np.float32)


class Orthogonal(Transform):
    """x -> x R, and back (y R^T), R = rotation(width)."""

    name = "orthogonal"

    def forward(self, x: Array) -> Array:
        return (x.astype(jnp.float32) @ rotation(x.shape[-1])).astype(x.dtype)

    def inverse(self, y: Array) -> Array:
        return (y.astype(jnp.float32) @ rotation(y.shape[-1]).T).astype(y.dtype)


TRANSFORMS.register(Orthogonal())
