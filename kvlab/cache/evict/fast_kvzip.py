"""Fast KVzip (arXiv:2601.17668): KVzip's scores predicted from each token's hidden
state by a small gate per layer, learned offline, so a context is scored as it
is read: no probes, no second pass over it.

    gates = kvlab.eval.calibrate.fast_kvzip_gates(model_cfg, params, tokens, encode)  # offline
    kvlab.eval.calibrate.save_gates(path, gates)
    cfg.cache.evict.method = "fast_kvzip"  # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.options = {"gates": path}

A layer's gate reads the attention's input x [D] of each token (after the
layer's norm: what its query, key and value projections read) and, per KV head
k of G query heads, makes G small queries q_g = RMSNorm(W_q x + b_q) and one
small key u = RMSNorm(W_k x) (width d = 16), and scores the token

    mean over g of  1 / (1 + sum_j exp(s_j . q_g / sqrt(d) - (u . q_g / sqrt(d) + b_g)))

with `sink keys` s_j (16 per KV head) learned beside them: the share a softmax
over the token and the sinks would give the token, a number in [0, 1] as
KVzip's probabilities are (`gate_scores`; kvpress 0.5.5's FastKVzipGate, whose
q_proj, k_proj, q_norm, k_norm, k_base and b are `GATE_ARRAYS`' q_kernel,
k_kernel, q_norm, k_norm, sink_keys and bias). The gates are fitted to the
calibration text's KVzip scores (kvlab/cache/evict/kvzip.py: each token's
largest probability from a probe) by binary cross-entropy, as the reference
trains them (kvlab.eval.calibrate.fast_kvzip_gates).

A token is scored once, as it arrives, and its score carried in its slot (the
scorer `keeps` it: four bytes a slot, in the cache's bytes). The first `sinks`
positions (kvpress's n_sink, 4) and the last `window_ratio` of a row's tokens
(kvpress's window_ratio, 0.02 of the context, read when the row competes) rank
above every score and stay. A layer's tokens are chosen over all its KV heads
together (one pool, as kvzip's). The gates read hidden states, which only the
step that brings a token has: a quantized layout whose tokens settle in groups
later is refused, and grouped-query attention only (the gate scores per KV head).

Option `layerwise` (default True, kvpress's `layerwise=True`): every layer keeps
the same share. False: the layers keep unequal shares at the same bytes, the
shares kvpress's default (`layerwise=False`) gives when it ranks a whole model's
tokens together, measured on the calibration text: the gates file holds the
fitted gates' scores of its contexts (`calibration`, [L, R, K, T]), and a
layer's share is the mean over those R contexts of its tokens among the best
of all layers' at the kept ratio (`scorers.global_shares`), the sinks and
window first.

Differences from kvpress's FastKVzipPress: with `layerwise=False` kvpress
splits each context anew by its own scores; kvlab's layers hold static slots,
so the split is the calibration contexts' (a layer keeps its best tokens either
way, so its set and kvpress's nest; on a context that was calibrated on, their
counts agree within 2 x K, kvlab's budgets being per KV head). kvpress
downloads the authors' gates for a few models, kvlab fits them for any model on
the standard library's text (a fit of the same architecture, not those weights).
The reference's training adds b twice where its inference adds it once; kvlab
trains and scores with one.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

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

FIX = (
    "write them with kvlab.eval.calibrate.save_gates (scripts/benchmark.py "
    "calibrates them for --methods fast_kvzip)"
)
# Each array of a gates file, its axes: L cache layers, D the model's width, K KV
# heads, G query heads each, d the gate's width, J sink keys.
GATE_ARRAYS = types.MappingProxyType(
    {
        "q_kernel": "[L, D, K, G, d]",
        "q_bias": "[L, K, G, d]",
        "k_kernel": "[L, D, K, d]",
        "q_norm": "[L, d]",
        "k_norm": "[L, d]",
        "sink_keys": "[L, K, J, d]",
        "bias": "[L, K, G]",
    }
)
NORM_EPS = 1e-6  # the gate's RMSNorm (kvpress's Qwen3RMSNorm default)


def gate_scores(gates: Mapping, hidden: Array) -> Array:
    """float32[..., K, T]: one layer's gate (`gates`: GATE_ARRAYS' arrays without
    the layer axis) over hidden states [..., T, D] (module docstring)."""
    x = hidden.astype(jnp.float32)
    width = gates["q_norm"].shape[-1]
    q = _rms(jnp.einsum("...td,dkgi->...tkgi", x, gates["q_kernel"]) + gates["q_bias"])
    q = q * gates["q_norm"]
    u = _rms(jnp.einsum("...td,dki->...tki", x, gates["k_kernel"])) * gates["k_norm"]
    scale = 1.0 / math.sqrt(width)
    logit = jnp.einsum("...tki,...tkgi->...ktg", u, q) * scale + gates["bias"][:, None, :]
    sinks = jnp.einsum("kji,...tkgi->...ktgj", gates["sink_keys"], q) * scale
    share = 1.0 / (1.0 + jnp.exp(sinks - logit[..., None]).sum(-1))  # [..., K, T, G]
    return share.mean(-1)


def _rms(x: Array) -> Array:
    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS))


class FastKVzip(Scorer):
    """The learned gate's score of each token, carried from its arrival."""

    name, observes, keeps, pooled, calibrated = "fast_kvzip", "all", True, True, True
    attention_kinds = ("gqa",)
    reads_hidden = True
    prefix_unsafe = "the gate's scores of a cached prefix's tokens are not in its pages"
    defaults = types.MappingProxyType(
        {"gates": "", "sinks": 4, "window_ratio": 0.02, "layerwise": True}
    )

    @property
    def reads_mass(self) -> bool:
        return False  # the hidden states alone

    def check(self, options: Mapping, field: str) -> None:
        sinks, ratio = options["sinks"], options["window_ratio"]
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(
                f"{field}.sinks={sinks!r} is no count of first tokens: set an int >= 0"
            )
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio < 1:
            raise ValueError(
                f"{field}.window_ratio={ratio!r} is no share of a row's tokens: set a "
                "number in [0, 1)"
            )
        gates = read_gates(options["gates"])
        if not options["layerwise"]:
            calibration_scores(options["gates"], gates)

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...] | None:
        options = {**self.defaults, **dict(evict["options"].items())}
        if options["layerwise"]:
            return None
        path = options["gates"]
        scores = calibration_scores(path, read_gates(path))
        first = protected(scores.shape[-1], options["sinks"], options["window_ratio"])
        what = f"cache.evict.options.gates={path!r} holds the calibration's scores"
        return calibrated_shares(scores, first, evict, context, layers, what)

    def score(self, c: Candidates) -> Array:
        if c.hidden is None or c.group != 1:
            raise ValueError(
                "cache.evict.method='fast_kvzip' scores each token by its hidden state as "
                "it arrives, which this layer does not hand it: use grouped-query "
                "attention and a layout that stores tokens one by one (cache.residual=0)"
            )
        path = c.options["gates"]
        gates = layer_gates(read_gates(path), c.layer, path, c.kv_heads, c.hidden.shape[-1])
        new = gate_scores(gates, c.hidden)  # [B, K, T]: head-major as a pool's new tags
        new = new.reshape(new.shape[0], 1, -1) if c.tags.shape[1] == 1 else new
        return jnp.concatenate([c.state, new], axis=-1)

    def priority(self, c: Candidates, score: Array) -> Array:
        window = jnp.floor(c.end * c.options["window_ratio"]).astype(jnp.int32)
        stays = (c.positions < c.options["sinks"]) | (c.positions >= c.end - window)
        return jnp.where(c.valid & stays, 2.0, score)


def read_gates(path: str) -> dict[str, np.ndarray]:
    """GATE_ARRAYS' arrays of the gates file at `path` (read once per version),
    checked to be one gate per layer of one shape."""
    gates = {
        name: read_artefact(path, name, shape, "gates", FIX) for name, shape in GATE_ARRAYS.items()
    }
    layers, width, heads, groups, d = gates["q_kernel"].shape
    sinks = gates["sink_keys"].shape[2]
    expected = {
        "q_kernel": (layers, width, heads, groups, d),
        "q_bias": (layers, heads, groups, d),
        "k_kernel": (layers, width, heads, d),
        "q_norm": (layers, d),
        "k_norm": (layers, d),
        "sink_keys": (layers, heads, sinks, d),
        "bias": (layers, heads, groups),
    }
    wrong = {name: gates[name].shape for name in expected if gates[name].shape != expected[name]}
    if wrong:
        raise ValueError(
            f"cache.evict.options.gates={path!r} holds arrays that do not fit its q_kernel "
            f"{gates['q_kernel'].shape} [L, D, K, G, d]: {wrong}; {FIX}"
        )
    return gates


def calibration_scores(path: str, gates: Mapping) -> np.ndarray:
    """The gates file's scores of its calibration contexts ([L, R, K, T], CALIBRATION),
    checked against its gates' layers and KV heads."""
    fix = "calibrate the gates anew (kvlab.eval.calibrate.fast_kvzip_gates writes them)"
    scores = read_artefact(path, "calibration", CALIBRATION, "gates", fix)
    layers, _, heads = gates["q_kernel"].shape[:3]
    if scores.shape[0] != layers or scores.shape[2] != heads:
        raise ValueError(
            f"cache.evict.options.gates={path!r} holds calibration scores {scores.shape} "
            f"{CALIBRATION} for gates of {layers} layer(s) and {heads} KV head(s): {fix}"
        )
    return scores


def protected(length: int, sinks: int, window_ratio: float) -> np.ndarray:
    """bool[length]: the positions of a `length`-token context that rank first (the
    first `sinks` and the last floor(length x window_ratio), as `priority`)."""
    positions = np.arange(length)
    return (positions < sinks) | (positions >= length - math.floor(length * window_ratio))


def layer_gates(gates: Mapping, layer: int, path: str, kv_heads: int, width: int) -> dict:
    """Cache layer `layer`'s gate of `gates` (read_gates), checked against the
    model's `kv_heads` and `width` (D)."""
    q_kernel = gates["q_kernel"]
    if q_kernel.shape[0] <= layer or q_kernel.shape[1:3] != (width, kv_heads):
        raise ValueError(
            f"cache.evict.options.gates={path!r} holds gates {q_kernel.shape} [L, D, K, G, d], "
            f"not for cache layer {layer} of a model of width {width} with {kv_heads} KV "
            "heads: calibrate them for this model"
        )
    return {name: jnp.asarray(array[layer]) for name, array in gates.items()}


SCORERS.register(FastKVzip())
