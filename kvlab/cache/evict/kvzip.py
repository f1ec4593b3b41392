"""KVzip (arXiv:2505.23416): a context's tokens scored by how much the model needs
them to repeat the context.

    cfg.cache.evict.method = "kvzip"       # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.when = "after_prefill"
    probes = SCORERS.get("kvzip").probe_tokens(tokenizer.encode, context)
    model.apply(..., context + probes, cache, compress=len(context))

The step that compresses a context is fed the context and, after it, a request to
repeat it ("\\n\\nRepeat the previous context exactly.", then "\\n") and the
context again: the probes (Placement.context). They attend as any later tokens
do (to the context and, causally, to each other) and are never stored; the row's
length ends at its context. A context token's score in a layer is the largest
probability any probe gave it from any query head of its KV head's group
(`Scorer.peaks`); the first `sinks` tokens score 2, above any probability, so
they stay (kvpress 0.5.5's n_sink). The tokens a layer keeps are chosen over all
its KV heads together (one pool per layer, as AdaKV's without a floor: kvpress's
`layerwise=True`), so heads keep unequal shares at the bytes of a uniform budget.

Option `layerwise` (default True, kvpress's `layerwise=True`): every layer keeps
the same share. False (the kvpress preset's): the layers keep unequal shares at
the same bytes, the shares all layers' tokens ranked together gave the
calibration contexts (`options.scores`: an .npz whose 'calibration' [L, R, K, T]
holds their KVzip scores, kvlab.eval.calibrate.kvzip_calibration;
scorers.global_shares), the sinks first.

Differences from kvpress's KVzipPress, by design: with `layerwise=False` (its
default) kvpress splits each context anew by its own scores; kvlab's layers
hold static slots, so the split is the calibration contexts'. kvpress repeats
a context longer than 2,048 tokens a chunk at a time, each chunk's probes
scoring that chunk; kvlab repeats it whole in one step (the same scores for a
context up to 2,048 tokens). kvpress's pipeline wraps the context in the
tokenizer's chat template, whose prefix it does not score; kvlab's benchmark
feeds the plain context. KVzip+'s normalization is not here.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvlab.cache.evict.scorers import (
    CALIBRATION,
    Candidates,
    Scorer,
    calibrated_shares,
    read_artefact,
)
from kvlab.registry import SCORERS

REPEAT = "\n\nRepeat the previous context exactly."
SUFFIX = "\n"  # kvpress's for a tokenizer without a chat template


class KVzip(Scorer):
    """The largest probability a probe (the context's reconstruction) gave each token."""

    name, observes, peaks, pooled = "kvzip", "probes", True, True
    prefix_unsafe = "its heads share one pool, so a prefix's tokens are not in slot order"
    defaults = types.MappingProxyType({"sinks": 4, "layerwise": True, "scores": ""})

    def check(self, options: Mapping, field: str) -> None:
        sinks = options["sinks"]
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(
                f"{field}.sinks={sinks!r} is no count of first tokens: set an int >= 0"
            )
        if not options["layerwise"]:
            read_calibration(options["scores"])

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        options = {**self.defaults, **dict(evict["options"].items())}
        if options["layerwise"]:
            return None
        scores = read_calibration(options["scores"])
        first = np.arange(scores.shape[-1]) < options["sinks"]
        what = f"cache.evict.options.scores={options['scores']!r} holds the KVzip scores"
        return calibrated_shares(scores, first, evict, context, layers, what)

    def probe_tokens(self, encode: Callable[[str], list], context: list) -> list:
        return [*encode(REPEAT), *encode(SUFFIX), *context]

    def score(self, c: Candidates) -> Array:
        # A step without probes (tokens after the compression that overflow the
        # headroom) has no scores: the sinks stay, then the earlier tokens.
        peak = 0.0 if c.mass is None else c.mass.max(-1)  # [B, E, C]: a group's best
        return jnp.where(c.positions < c.options["sinks"], 2.0, peak)


FIX = (
    "write the calibration contexts' KVzip scores there with "
    "kvlab.eval.calibrate.save_kvzip_scores(path, kvzip_calibration(...)) "
    "(scripts/benchmark.py does for --methods kvzip), or set options.layerwise=True"
)


def read_calibration(path: str) -> np.ndarray:
    """The KVzip scores [L, R, K, T] of the calibration contexts at `path`."""
    return read_artefact(path, "calibration", CALIBRATION, "scores", FIX)


SCORERS.register(KVzip())
