"""What a cache choice does to a model's outputs, against a reference cache.

    cache_error(model, params, tokens [B, T], cache_cfg, reference_cfg, chunk,
                mesh=None, rules=None) -> dict

Both caches run the same tokens through the model in chunks of `chunk` tokens
(prefill with decode semantics), and the probe compares what comes out:

- attention: per layer, |out - out_ref| / |out_ref| of the attention output
  (before the output projection's residual add), over all real tokens;
- logits: mean and max |logits - logits_ref| over all positions; over the
  positions whose next token is in `tokens` (all but the last of each row), as
  kvlab.eval.compare_logits scores them (the project's one KL): mean
  KL(p_ref || p) in nats, the share of positions whose top token is unchanged,
  and the change in next-token loss (nats) on the tokens themselves.

With `mesh` (kvlab/sharding.py) both runs happen there: parameters laid out by
their logical axes, each cache by the cache rules, the tokens' rows split as
the cache's are (as far as B divides); a mesh of one device runs the
single-device program.

Used by scripts/quant_probe.py to check how sensitive keys and values are to
their bit-widths (KIVI, arXiv:2402.02750; KVQuant, arXiv:2401.18079).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from kvlab import sharding
from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.attention.mla import MultiHeadLatentAttention
from kvlab.cache.factory import init_cache
from kvlab.eval.perplexity import compare_logits
from kvlab.model import Transformer
from kvlab.sampling import place_params


def _is_attention(module: nn.Module, method: str) -> bool:
    return method == "__call__" and isinstance(
        module, GroupedQueryAttention | MultiHeadLatentAttention
    )


@functools.partial(jax.jit, static_argnums=0)
def _step(model: Transformer, params, cache, piece):
    """Logits [B, t, V], attention outputs [L, B, t, D] and the cache after piece [B, t]."""
    (logits, cache), state = model.apply(
        {"params": params}, piece, cache=cache, capture_intermediates=_is_attention
    )
    blocks = state["intermediates"]
    outputs = [blocks[f"block_{i}"]["attention"]["__call__"][0][0] for i in range(len(blocks))]
    return logits, jnp.stack(outputs), cache


def run_through_cache(
    model: Transformer,
    params,
    tokens,
    cache_cfg: Mapping,
    chunk: int,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
):
    """Logits [B, T, V] and per-layer attention outputs [L, B, T, D] of tokens fed
    in chunks (on `mesh` when given: params and tokens are placed here)."""
    batch, length = tokens.shape
    if mesh is not None and mesh.size > 1:
        rules = sharding.axis_rules() if rules is None else rules
        params = place_params(model.config, params, mesh, rules)
        rows = sharding.named_sharding(PartitionSpec("cache_batch"), tokens.shape, mesh, rules)
        tokens = sharding.put_global(tokens, rows)
    else:
        mesh = None
    cache = init_cache(model.config, cache_cfg, batch, length, mesh=mesh, rules=rules)

    logits, outputs = [], []
    for start in range(0, length, chunk):
        piece = tokens[:, start : start + chunk]
        piece_logits, piece_outputs, cache = _step(model, params, cache, piece)
        logits.append(piece_logits)
        outputs.append(piece_outputs)
    cache.check()
    return jnp.concatenate(logits, axis=1), jnp.concatenate(outputs, axis=2)


def cache_error(
    model: Transformer,
    params,
    tokens,
    cache_cfg: Mapping,
    reference_cfg: Mapping,
    chunk: int,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
) -> dict:
    """Output error of `cache_cfg` against `reference_cfg` (module docstring)."""
    run = lambda cfg: run_through_cache(model, params, tokens, cfg, chunk, mesh, rules)  # noqa: E731
    logits, attention = run(cache_cfg)
    ref_logits, ref_attention = run(reference_cfg)
    norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=(1, 2, 3)))  # noqa: E731  per layer
    attention_error = norm(attention - ref_attention) / norm(ref_attention)
    # Positions 0..T-2 predict tokens 1..T-1: the distributions are scored there.
    targets = tokens[:, 1:]  # [B, T-1]
    sums, _ = compare_logits(
        logits[:, :-1], ref_logits[:, :-1], targets, jnp.ones(targets.shape, jnp.float32)
    )
    scored = sums["weight"]
    return dict(
        attention_relative_error=[float(e) for e in np.asarray(attention_error)],
        logit_mean_abs_error=float(jnp.abs(logits - ref_logits).mean()),
        logit_max_abs_error=float(jnp.abs(logits - ref_logits).max()),
        kl_from_reference=float(sums["kl"] / scored),
        top1_agreement=float(sums["agree"] / scored),
        loss_change=float((sums["nll"] - sums["reference_nll"]) / scored),
    )
