"""Normal-float codes (cache.<prefix>_format='nf'): QLoRA's NF4 grid (arXiv:2305.14314).

The 2^b levels are quantiles of the standard normal, scaled to [-1, 1], with
an exact zero: 2^(b-1) on the positive side and 2^(b-1) - 1 on the negative,
from probabilities evenly spaced between 1/2 and `offset` (at 4 bits
offset = 1 - (1/32 + 1/30) / 2, the paper's 0.9677). A group is scaled by its
largest magnitude and each number takes the nearest level, so levels are
dense where normally distributed numbers are: for such numbers it loses less
than evenly spaced integer levels at the same bytes (one scale per group, no
zero point).
"""

from __future__ import annotations

import statistics

import jax.numpy as jnp
import numpy as np
from jax import Array

from kvlab.cache.formats import Format, nearest_levels
from kvlab.registry import FORMATS


def grid(bits: int) -> np.ndarray:
    """The 2^bits levels, ascending, from -1 to 1 with 0 among them (float32)."""
    positive, negative = 2 ** (bits - 1), 2 ** (bits - 1) - 1
    offset = 1 - (1 / (2 * 2**bits) + 1 / (2 * (2**bits - 1))) / 2
    quantile = statistics.NormalDist().inv_cdf

    def side(count: int) -> list[float]:
        return [quantile(p) for p in np.linspace(offset, 0.5, count + 1)[:-1]]

    levels = np.array(sorted([*side(positive), 0.0, *(-x for x in side(negative))]))
    return (levels / np.abs(levels).max()).astype(np.float32)


class NormalFloat(Format):
    """Levels on the normal-float grid of `spec.bits` (module docstring)."""

    name = "nf"
    widths = (8, 4, 3, 2)

    def encode(self, scaled: Array, spec) -> Array:
        return nearest_levels(scaled, grid(spec.bits))

    def levels(self, codes: Array, spec) -> Array:
        return jnp.asarray(grid(spec.bits))[codes]


FORMATS.register(NormalFloat())
