"""What a cache choice does to a model's outputs, against a reference cache.

    cache_error(model, params, tokens [B, T], cache_cfg, reference_cfg, chunk) -> dict

Both caches run the same tokens through the model in chunks of `chunk` tokens
(prefill with decode semantics), and the probe compares what comes out:

- attention: per layer, |out - out_ref| / |out_ref| of the attention output
  (before the output projection's residual add), over all real tokens;
- logits: mean and max |logits - logits_ref|, mean KL(p_ref || p), the share of
  positions whose top token is unchanged, and the change in next-token loss
  (nats) on the tokens themselves.

Used by scripts/quant_probe.py to check how sensitive keys and values are to
their bit-widths (KIVI, arXiv:2402.02750; KVQuant, arXiv:2401.18079).
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.attention.mla import MultiHeadLatentAttention
from kvlab.cache.factory import init_cache
from kvlab.model import Transformer


def _is_attention(module: nn.Module, method: str) -> bool:
    return method == "__call__" and isinstance(
        module, GroupedQueryAttention | MultiHeadLatentAttention
    )


def run_through_cache(model: Transformer, params, tokens, cache_cfg: Mapping, chunk: int):
    """Logits [B, T, V] and per-layer attention outputs [L, B, T, D] of tokens fed in chunks."""
    batch, length = tokens.shape
    cache = init_cache(model.config, cache_cfg, batch, length)

    @jax.jit
    def step(cache, piece):
        (logits, cache), state = model.apply(
            {"params": params}, piece, cache=cache, capture_intermediates=_is_attention
        )
        blocks = state["intermediates"]
        outputs = [blocks[f"block_{i}"]["attention"]["__call__"][0][0] for i in range(len(blocks))]
        return logits, jnp.stack(outputs), cache

    logits, outputs = [], []
    for start in range(0, length, chunk):
        piece_logits, piece_outputs, cache = step(cache, tokens[:, start : start + chunk])
        logits.append(piece_logits)
        outputs.append(piece_outputs)
    cache.check()
    return jnp.concatenate(logits, axis=1), jnp.concatenate(outputs, axis=2)


def cache_error(
    model: Transformer, params, tokens, cache_cfg: Mapping, reference_cfg: Mapping, chunk: int
) -> dict:
    """Output error of `cache_cfg` against `reference_cfg` (module docstring)."""
    logits, attention = run_through_cache(model, params, tokens, cache_cfg, chunk)
    ref_logits, ref_attention = run_through_cache(model, params, tokens, reference_cfg, chunk)
    norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=(1, 2, 3)))  # noqa: E731  per layer
    attention_error = norm(attention - ref_attention) / norm(ref_attention)
    log_p, log_ref = jax.nn.log_softmax(logits), jax.nn.log_softmax(ref_logits)
    kl = jnp.sum(jnp.exp(log_ref) * (log_ref - log_p), axis=-1)
    targets = tokens[:, 1:, None]
    loss = -jnp.take_along_axis(log_p[:, :-1], targets, axis=-1).mean()
    ref_loss = -jnp.take_along_axis(log_ref[:, :-1], targets, axis=-1).mean()
    return dict(
        attention_relative_error=[float(e) for e in np.asarray(attention_error)],
        logit_mean_abs_error=float(jnp.abs(logits - ref_logits).mean()),
        logit_max_abs_error=float(jnp.abs(logits - ref_logits).max()),
        kl_from_reference=float(kl.mean()),
        top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
        loss_change=float(loss - ref_loss),
    )
