"""A randomized Hadamard rotation (QuaRot, arXiv:2404.00456; TurboQuant's first step).

    cfg.cache.k_transform = "hadamard"   # kvlab.registry.TRANSFORMS ships it by this name

R = D H / sqrt(n): fixed pseudo-random signs D (seed 0, the same in every
process), then the n x n Walsh-Hadamard matrix H, normalized, for power-of-two
widths n. It spreads a few large channels of a key over every channel, so a
per-token scale no longer serves one outlier channel at the cost of the rest,
and computes in n log2 n additions (the fast transform: log2 n butterflies of
sums and differences), in float32.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import Array

from kvlab.cache.transforms import Transform
from kvlab.registry import TRANSFORMS

SEED = 0


def walsh_hadamard(x: Array) -> Array:
    """x @ H / sqrt(n) along the last axis (n a power of two), H symmetric: its
    own inverse."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    y, half = x.astype(jnp.float32), 1
    while half < n:
        pairs = y.reshape(*lead, n // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        half *= 2
    return y / math.sqrt(n)


def signs(n: int) -> np.ndarray:
    """The fixed random signs D of width n."""
    return np.random.default_rng(SEED).choice(np.array([-1.0, 1.0], np.float32), n)


class Hadamard(Transform):
    """x -> (x * signs) H / sqrt(n), and back."""

    name = "hadamard"

    def check(self, width: int, field: str) -> None:
        if width & (width - 1):
            raise ValueError(
                f"{field}='hadamard' rotates power-of-two widths, and this tensor is {width} "
                f"wide: set {field}='none' or give the tensor a power-of-two width"
            )

    def forward(self, x: Array) -> Array:
        return walsh_hadamard(x * signs(x.shape[-1])).astype(x.dtype)

    def inverse(self, y: Array) -> Array:
        return (walsh_hadamard(y) * signs(y.shape[-1])).astype(y.dtype)


TRANSFORMS.register(Hadamard())
