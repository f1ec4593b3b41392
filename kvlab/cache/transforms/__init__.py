"""Key/value transforms: a cached tensor changed before it is stored, and folded
into what reads it, so attention computes what it computed without.

    cfg.cache.k_transform = "hadamard"   # keys rotated before they are quantized
    cfg.cache.v_transform = "hadamard"   # values too; the output is rotated back

A transform is an orthogonal map R of a tensor's last axis (R R^T = I), chosen
per cached tensor (`cache.<prefix>_transform`: k, v; a latent model's latent
and rope). The cache applies it to the tensor's new tokens before they are
stored (x -> x R: quantized, paged, evicted as any stored tokens are) and the
attention module folds it into the reads: queries against rotated keys are
rotated alike (q R . k R = q . k), and attention over rotated values is
rotated back (P (v R) R^T = P v); a latent model's expanded path rotates the
latent back before its up-projections. So at 16 bits the logits are unchanged
up to float rounding, and a kernel reading stored tokens needs to know
nothing: it sees rotated queries and rotated tokens. What changes is what
quantization sees: a rotation spreads a few large channels over all of them
(QuaRot, arXiv:2404.00456; SpinQuant; TurboQuant).

The cache carries its transforms' names (`Cache.transforms`, static) and hands
them to every attention module with each step's placement
(`Placement.transforms`): nothing else is threaded through the model. A
transform stores nothing (`cache_bytes` is unchanged) and is registered by name
(kvlab.registry.TRANSFORMS): "none" here, "hadamard" in hadamard.py; a new
one is a file that subclasses `Transform` and registers itself.
"""

from __future__ import annotations

from jax import Array

from kvlab.registry import TRANSFORMS


class Transform:
    """An orthogonal map of the last axis: `forward(x)` is x R, `inverse(y)` is
    y R^T. This base is the identity ("none")."""

    name = "none"

    def check(self, width: int, field: str) -> None:
        """ValueError naming `field` when the transform cannot take a tensor `width` wide."""

    def forward(self, x: Array) -> Array:
        return x

    def inverse(self, y: Array) -> Array:
        return y


IDENTITY = TRANSFORMS.register(Transform())


def resolve(names: tuple[str, ...]) -> tuple[Transform, ...]:
    """The transforms a cache's names stand for (kvlab.registry.TRANSFORMS)."""
    return tuple(TRANSFORMS.get(name) for name in names)
