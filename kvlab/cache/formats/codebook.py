"""Codebook codes (cache.<prefix>_format='codebook'): levels fitted to the model's own numbers.

    codebooks = kvlab.eval.calibrate.codebooks(cfg.model, cfg.cache, params, tokens)
    kvlab.eval.calibrate.save_codebooks("runs/x/codebooks.npz", codebooks)
    cfg.cache.k_format = "codebook"            # and v_format, at the width it was fitted at
    cfg.cache.codebooks = "runs/x/codebooks.npz"

A non-uniform scalar quantizer per layer (KVQuant's per-layer non-uniform
datatype, arXiv:2401.18079; the optimal scalar quantizer of TurboQuant's recipe
when the tensor is rotated first, cache.<prefix>_transform): a group is scaled
by its largest magnitude, as 'nf' scales it, and each number takes the nearest
of the layer's 2^bits levels in [-1, 1]. The levels are fitted offline by
Lloyd-Max (k-means in one dimension) on the layer's cached numbers over
calibration text, each divided by its group's largest magnitude as stored
(kvlab.eval.calibrate.codebooks), and kept in an .npz beside the run: one
array per cached tensor ('k', 'v'; a latent model's 'latent', 'rope'),
float32[cache layers, 2^bits], read by `cache.codebooks`. Or levels per
channel group (KVQuant fits its datatypes per channel): float32[cache layers,
G, 2^bits], the coded numbers of a token split into G runs of W / G adjacent
channels (coordinates, under a cache.<prefix>_rank), each run with its own
levels (`kvlab.eval.calibrate.codebooks(..., channel_groups=G)`). A layer's
levels are part of its tensor's static storage (`Storage.table`: its levels,
or one tuple of them per channel group), in the compiled program as constants
(2^bits numbers per layer and group), not in the cache's bytes; a group of
numbers stores its scale and no zero point, as 'nf' does, so the cache's bytes
are those of 'nf' at the same width.

The codes and levels a format is handed are channel-last ([..., W]), or as
kvlab.cache.quant.by_groups arranges them: [..., W / gs, gs] for scales per
token (axis 'token', five axes), [..., g, W] per channel; levels per channel
group follow each number's channel from that.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import Array

from kvlab.cache.formats import Format, nearest_levels
from kvlab.files import read_arrays
from kvlab.registry import FORMATS


def read_codebooks(path: str) -> dict:
    """The arrays of a codebook file (read once per version of the file)."""
    books = read_arrays(path)
    if isinstance(books, str):
        raise ValueError(
            f"cache.codebooks={path!r} cannot be read ({books}): set it to the .npz "
            "kvlab.eval.calibrate.save_codebooks wrote for this model"
        )
    return books


class Codebook(Format):
    """Levels per layer from cache.codebooks (module docstring)."""

    name = "codebook"
    widths = (8, 4, 3, 2)  # 3 bits: 8 codes in 3 bytes (kvlab.cache.quant.pack)

    def table(self, cache_cfg, prefix: str, bits: int, layer: int, layers: int) -> tuple:
        path = cache_cfg["codebooks"]
        field = f"cache.{prefix}_format='codebook'"
        if not path:
            raise ValueError(
                f"{field} reads its levels from cache.codebooks, which is empty: set it to "
                "an .npz of kvlab.eval.calibrate.save_codebooks"
            )
        books = read_codebooks(path)
        if prefix not in books:
            raise ValueError(
                f"cache.codebooks={path!r} holds no levels for {prefix!r} (it holds "
                f"{sorted(books)}): calibrate them with {field} set"
            )
        levels = books[prefix]
        shape = (layers, 2**bits)
        if (
            levels.ndim not in (2, 3)
            or (levels.shape[0], levels.shape[-1]) != shape
            or not (np.isfinite(levels).all())
        ):
            raise ValueError(
                f"cache.codebooks={path!r}: {prefix!r} is {levels.shape}, not finite "
                f"[{layers} cache layers, {2**bits} levels] for cache.{prefix}_bits={bits} "
                f"(nor [{layers} cache layers, channel groups, {2**bits} levels]): calibrate "
                "it for this model and width"
            )
        rows = levels[layer] if levels.ndim == 3 else levels[layer][None]
        rows = np.sort(rows, axis=-1)
        if np.abs(rows).max() > 1 or (np.diff(rows, axis=-1) <= 0).any():
            raise ValueError(
                f"cache.codebooks={path!r}: layer {layer}'s {prefix!r} levels are not "
                "distinct numbers in [-1, 1]: calibrate them again"
            )
        tables = tuple(tuple(float(x) for x in row) for row in rows)
        return tables if levels.ndim == 3 else tables[0]

    def encode(self, scaled: Array, spec) -> Array:
        return _by_channel_group(scaled, spec, nearest_levels)

    def levels(self, codes: Array, spec) -> Array:
        look_up = lambda c, table: jnp.asarray(np.asarray(table, np.float32))[c]  # noqa: E731
        return _by_channel_group(codes, spec, look_up)


def _by_channel_group(x: Array, spec, apply) -> Array:
    """`apply(numbers, levels)` to each channel group's numbers of `x` (module
    docstring: channel-last, or as by_groups arranges them), x's shape; to all
    of them where the layer has one codebook."""
    if not spec.channel_tables:
        return apply(x, spec.table)
    trailing = 2 if spec.axis == "token" and x.ndim == 5 else 1
    lead, width = x.shape[:-trailing], int(np.prod(x.shape[-trailing:]))
    groups = len(spec.table)
    runs = x.reshape(*lead, groups, width // groups)
    out = [apply(runs[..., g, :], table) for g, table in enumerate(spec.table)]
    return jnp.stack(out, axis=-2).reshape(x.shape)


FORMATS.register(Codebook())
