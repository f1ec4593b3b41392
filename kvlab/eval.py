"""Perplexity and recall through a cache: what generation with that cache sees.

    result = kvlab.eval.evaluate(model_cfg, cache_cfg, params, batches, chunk=32)

Each held-out window of T tokens goes through a fresh cache of capacity T in
prefill chunks of `chunk` tokens: every chunk attends to the tokens already in
the cache as the cache stores them (quantized, latent, ...), exactly as a
decode step would, and its logits are scored against the next tokens. Cached
storage is chunk-invariant (kvlab/cache/quant.py), so any chunk size gives the
logits token-by-token decoding gives; larger chunks are only faster. With a
16-bit dense cache the result equals the plain forward's.

The result holds loss (nats per target), ppl, bits_per_token (bits per
target), bits_per_byte (per UTF-8 byte of the text the targets cover: the
batches' `target_bytes` with data.tokenizer, else a target is a byte and it
equals bits_per_token), accuracy (argmax hits; MQAR's metric),
targets (how many were scored) and the cache's bytes per token: analytic
(`cache_bytes` of one sequence of T tokens over T), measured (`tree_bytes`
of that cache over T) and long (what each further token adds to a long cache,
without the fixed full-precision window).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import ml_collections
from jax.sharding import Mesh

from kvlab import sharding
from kvlab.cache import cache_bytes, init_cache, tree_bytes
from kvlab.config import CACHED_PREFIXES, check_count, frozen, validate_cache_config
from kvlab.model import Transformer
from kvlab.sampling import place_params
from kvlab.train import score, summarize, target_bytes


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _score_chunk(model: Transformer, params, cache, inputs, targets, weights):
    logits, cache = model.apply({"params": params}, inputs, cache=cache)
    return cache, score(logits, targets, weights)


def cache_bytes_per_token(model_cfg: Mapping, cache_cfg: Mapping, seq_len: int) -> dict:
    """Bytes per token of one sequence's cache holding `seq_len` tokens.

    `cache_bytes_per_token` (analytic) and `..._measured` (the leaves of a
    real cache) include everything stored for the sequence: payloads, scales,
    zero points, the full-precision residual window and the length counter.
    `..._long` is what each further token adds to a long cache.
    """
    analytic = cache_bytes(model_cfg, cache_cfg, batch_size=1, seq_len=seq_len)
    measured = tree_bytes(jax.eval_shape(lambda: init_cache(model_cfg, cache_cfg, 1, seq_len)))
    # Far from the start, a token adds its payload and its share of the scales;
    # the full-precision window and a partly filled group are a fixed cost.
    short, long = 1024 * cache_cfg.group_size, 2048 * cache_cfg.group_size
    growth = cache_bytes(model_cfg, cache_cfg, 1, long) - cache_bytes(
        model_cfg, cache_cfg, 1, short
    )
    return {
        "cache_bytes_per_token": analytic / seq_len,
        "cache_bytes_per_token_measured": measured / seq_len,
        "cache_bytes_per_token_long": growth / (long - short),
    }


def evaluate(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    params,
    batches: Sequence[Mapping],
    *,
    chunk: int,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
) -> dict:
    """Loss, perplexity, bits per byte and accuracy of `params` over `batches`
    (dicts of inputs/targets/weights [B, T]) run through `cache_cfg`.

    With `mesh` (kvlab/sharding.py) the evaluation runs there: params placed by
    their logical axes, each window's cache laid out (init_cache(mesh=)) and its
    rows split as far as the batch divides, by `rules` (default
    kvlab.sharding.axis_rules()). A mesh of one device runs the single-device
    program.

    A mesh spanning several hosts (kvlab.sharding.initialize_distributed) is fed
    as training is: every host holds `batches` (the same on each), gives its
    devices only the rows they hold (sharding.process_rows, rows_array), and
    after the cross-host reduction every host returns the same result."""
    validate_cache_config(cache_cfg, model_cfg)
    chunk = check_count("eval.chunk", chunk)
    if not batches:
        raise ValueError("no evaluation batches: the held-out split produced no windows")
    model = Transformer(model_cfg)
    cache_cfg = frozen(cache_cfg)
    mesh = None if mesh is None or mesh.size == 1 else mesh
    if mesh is not None:
        rules = sharding.axis_rules() if rules is None else rules
        params = place_params(model.config, params, mesh, rules)
    scored = []  # per-chunk sums, fetched once at the end
    seq_len = None
    for batch in batches:
        size, seq_len = batch["inputs"].shape
        cache = init_cache(model.config, cache_cfg, size, seq_len, mesh=mesh, rules=rules)
        if mesh is not None:  # this host's rows of the batch, as training reads them
            placed = sharding.batch_sharding(mesh, rules, size)
            rows = sharding.process_rows(placed, size)
        for start in range(0, seq_len, chunk):
            part = {k: batch[k][:, start : start + chunk] for k in ("inputs", "targets", "weights")}
            if mesh is not None:
                part = {
                    k: sharding.rows_array(v[rows], rows, size, placed) for k, v in part.items()
                }
            cache, sums = _score_chunk(
                model, params, cache, part["inputs"], part["targets"], part["weights"]
            )
            scored.append(sums)
        cache.check()  # after each window: a flag names the rows it was given bad values
    scored = jax.device_get(scored)  # replicated scalars: every host holds the totals
    totals = {k: sum(float(sums[k]) for sums in scored) for k in ("nll", "correct", "weight")}
    return {
        **summarize(totals, target_bytes(batches)),
        **cache_bytes_per_token(model.config, cache_cfg, seq_len),
    }


def full_precision(cache_cfg: Mapping) -> ml_collections.ConfigDict:
    """The same cache with every tensor stored at 16 bits (the baseline)."""
    baseline = ml_collections.ConfigDict(cache_cfg)
    for prefix in CACHED_PREFIXES:
        baseline[f"{prefix}_bits"] = 16
    return baseline
