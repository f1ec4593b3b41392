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
float32[cache layers, 2^bits], read by `cache.codebooks`. A layer's levels are
part of its tensor's static storage (`Storage.table`), in the compiled program
as constants (2^bits numbers per layer), not in the cache's bytes; a group
stores its scale and no zero point, as 'nf' does, so the cache's bytes are
those of 'nf' at the same width.
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
        if levels.shape != (layers, 2**bits) or not np.isfinite(levels).all():
            raise ValueError(
                f"cache.codebooks={path!r}: {prefix!r} is {levels.shape}, not finite "
                f"[{layers} cache layers, {2**bits} levels] for cache.{prefix}_bits={bits}: "
                "calibrate it for this model and width"
            )
        row = np.sort(levels[layer])
        if np.abs(row).max() > 1 or (np.diff(row) <= 0).any():
            raise ValueError(
                f"cache.codebooks={path!r}: layer {layer}'s {prefix!r} levels are not "
                "distinct numbers in [-1, 1]: calibrate them again"
            )
        return tuple(float(x) for x in row)

    def encode(self, scaled: Array, spec) -> Array:
        return nearest_levels(scaled, spec.table)

    def levels(self, codes: Array, spec) -> Array:
        return jnp.asarray(np.asarray(spec.table, np.float32))[codes]


FORMATS.register(Codebook())
