"""Storage formats: how a quantized cache turns numbers into codes and back.

    cfg.cache.k_format = "fp8"   # keys as float8 e4m3 codes with a scale per group
    cfg.cache.v_format = "nf"    # values on the normal-float grid (normal_float.py)

A format is chosen per cached tensor (`cache.<prefix>_format`) and works on
one group of numbers sharing a scale (kvlab/cache/quant/ lays the groups out
along tokens or channels, packs the codes 8 / bits to a byte and keeps a
full-precision window): `quantize` gives each number a code of `bits` bits, the
group's scale and, where the format has one, its zero point; `levels` gives
the number a code stands for before its scale. Dequantizing is
levels x scale (+ zero), and attention reads the codes through those two
alone (kvlab.cache.quant.PayloadReader), so a new format works with every
cache kind (dense, paged, evicting), the engine and the mesh as it is.

What a format stores is `bits` per number plus `scale_numbers` numbers of
cache.scale_dtype per group (the scale, and the zero point where there is
one): kvlab.cache.accounting counts its bytes from that. Kernels that read
codes themselves (kvlab/kernels) name the formats they dequantize and
decline the others, which then take the reference path: a format needs no
kernel to be exact.

Registered by name (kvlab.registry.FORMATS): "int" and "fp8" here,
"nf" in normal_float.py, "codebook" (levels fitted per layer offline) in
codebook.py; a new one is a file that subclasses `Format` and
registers itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from kvlab.config import dtype_of
from kvlab.registry import FORMATS

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def round_outwards(value: Array, dtype, up: bool) -> Array:
    """value rounded to `dtype`, then moved one step outwards if rounding went inwards
    (a scale rounded up, a zero point down: no number of the group is clipped)."""
    rounded = value.astype(dtype)
    wrong = (rounded.astype(jnp.float32) < value) if up else (rounded.astype(jnp.float32) > value)
    outward = jnp.nextafter(rounded, jnp.array(jnp.inf if up else -jnp.inf, dtype))
    return jnp.where(wrong, outward, rounded)


def absmax_scale(x: Array, axis: int, top_level: float, scale_dtype: str) -> tuple[Array, Array]:
    """The scale that maps the group's largest magnitude to `top_level` (stored in
    `scale_dtype`, rounded up) and x divided by it (float32, x's shape)."""
    top = jnp.max(jnp.abs(x), axis=axis)
    scale = round_outwards(top / top_level, dtype_of(scale_dtype), up=True)
    safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    return scale, x / jnp.expand_dims(safe, axis)


def nearest_levels(scaled: Array, levels) -> Array:
    """Codes of numbers already scaled to [-1, 1] as the nearest of `levels`
    (ascending, in [-1, 1]; a bisection on their midpoints; a number beyond the
    ends takes the end): a format of fixed levels ('nf', 'codebook')."""
    levels = np.asarray(levels, np.float32)
    between = jnp.asarray((levels[1:] + levels[:-1]) / 2)
    return jnp.searchsorted(between, scaled).astype(jnp.uint8)


class Format:
    """Codes for the numbers of one group. `spec` is the tensor's
    kvlab.cache.quant.Storage (bits, axis, group_size, symmetric, scale_dtype).

    widths: the bit-widths it stores a number in (cache.<prefix>_bits).
    has_zero(spec): whether a zero point is stored beside each scale.
    quantize(x, spec, axis): codes (uint8, x's shape, each below 2^bits), the
        scale and the zero point (or None), both x's shape without `axis`:
        the group runs along `axis`. x is float32. By default the scale maps
        the group's largest magnitude to `top` and `encode` gives the codes.
    levels(codes, spec): float32, codes' shape: the number each code stands for
        before its scale (dequantized = levels x scale + zero).
    top(spec): the largest level's magnitude, what a scale maps the largest
        magnitude to (a calibrated scale, cache.<prefix>_axis='calibrated', too).
    encode(scaled, spec): the codes of numbers already divided by their scale,
        a number beyond +-top taking the end level (a calibrated scale's numbers
        may lie beyond the range it was fitted to).
    """

    name: str
    widths: tuple[int, ...] = (8, 4, 2)

    def has_zero(self, spec) -> bool:
        return False

    def scale_numbers(self, spec) -> int:
        """Numbers of cache.scale_dtype stored per group."""
        return 1 + self.has_zero(spec)

    def table(self, cache_cfg, prefix: str, bits: int, layer: int, layers: int) -> tuple:
        """The static levels of layer `layer` (of `layers`) a format fitted per layer
        reads (`Storage.table`; codebook.py), () for one that needs none; raises
        ValueError naming the cache field that cannot give them."""
        return ()

    def top(self, spec) -> float:
        return 1.0

    def encode(self, scaled: Array, spec) -> Array:
        raise NotImplementedError

    def quantize(self, x: Array, spec, axis: int) -> tuple[Array, Array, Array | None]:
        scale, scaled = absmax_scale(x, axis, self.top(spec), spec.scale_dtype)
        return self.encode(scaled, spec), scale, None

    def levels(self, codes: Array, spec) -> Array:
        raise NotImplementedError


class IntCodes(Format):
    """Round-to-nearest integer levels: with a zero point (asymmetric, 2^b levels
    from the group's minimum) or without (cache.symmetric: 2^b - 1 levels around
    0, stored offset by 2^(b-1)). |x - dequantized| <= scale / 2."""

    name = "int"

    def has_zero(self, spec) -> bool:
        return not spec.symmetric

    def top(self, spec) -> float:
        return float(2 ** (spec.bits - 1) - 1)

    def encode(self, scaled: Array, spec) -> Array:
        """Symmetric codes: round(scaled), within +-top, offset by 2^(bits-1)."""
        top = self.top(spec)
        return (jnp.clip(jnp.round(scaled), -top, top) + 2 ** (spec.bits - 1)).astype(jnp.uint8)

    def quantize(self, x: Array, spec, axis: int) -> tuple[Array, Array, Array | None]:
        if spec.symmetric:
            return super().quantize(x, spec, axis)
        scale_dtype = dtype_of(spec.scale_dtype)
        low = round_outwards(jnp.min(x, axis=axis), scale_dtype, up=False)
        span = jnp.max(x, axis=axis) - low.astype(jnp.float32)
        scale = round_outwards(span / (2**spec.bits - 1), scale_dtype, up=True)
        safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
        codes = jnp.round(
            (x - jnp.expand_dims(low.astype(jnp.float32), axis)) / jnp.expand_dims(safe, axis)
        )
        return jnp.clip(codes, 0, 2**spec.bits - 1).astype(jnp.uint8), scale, low

    def levels(self, codes: Array, spec) -> Array:
        offset = 2 ** (spec.bits - 1) if spec.symmetric else 0
        return codes.astype(jnp.float32) - offset


class Fp8Codes(Format):
    """float8 e4m3 of the number over its group's scale (the largest magnitude maps
    to 448); no zero point, 8 bits only."""

    name = "fp8"
    widths = (8,)

    def top(self, spec) -> float:
        return FP8_MAX

    def encode(self, scaled: Array, spec) -> Array:
        """e4m3 of the number, saturating at +-448 (e4m3fn has no infinity)."""
        saturated = jnp.clip(scaled, -FP8_MAX, FP8_MAX)
        return jax.lax.bitcast_convert_type(saturated.astype(FP8), jnp.uint8)

    def levels(self, codes: Array, spec) -> Array:
        return jax.lax.bitcast_convert_type(codes, FP8).astype(jnp.float32)


INT = FORMATS.register(IntCodes())
FORMATS.register(Fp8Codes())
