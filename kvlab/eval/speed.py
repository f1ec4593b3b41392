"""Decode speed and the memory roofline: what scripts/bench_decode.py and
scripts/device_check.py time.

A decode step reads every weight and the whole cache buffer once, so it cannot
beat (weight bytes + cache bytes) / bandwidth. `memory_bandwidth` measures
that bandwidth the way decode reads memory (a jitted reduction and a
matrix-vector product, best of a few; docs/references.md explains why an
elementwise copy would understate it); `decode_step_time` times greedy decode
steps in one compiled loop after a prefill that is not timed, and
`decode_step_times` several variants so, in turn within each round.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvlab.cache import init_cache
from kvlab.sampling import prefill


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn (after one untimed call that compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth(mib: int, repeats: int) -> dict:
    """Bytes/s read by a reduction over `mib` MiB and a matrix-vector product over half."""
    array = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    matrix = jnp.ones((8192, mib * 2**20 // 8 // 8192), jnp.float32)
    vector = jnp.ones((matrix.shape[1],), jnp.float32)
    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.dot)
    return {
        f"sum_{mib}MiB": array.nbytes / best_time(lambda: total(array), repeats),
        f"matvec_{mib // 2}MiB": matrix.nbytes / best_time(lambda: matvec(matrix, vector), repeats),
    }


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
def decode_loop(model, params, cache, token, steps):
    """`steps` greedy decode steps in one compiled loop; returns the last token and cache."""

    def step(_, carry):
        token, cache = carry
        logits, cache = model.apply({"params": params}, token[:, None], cache=cache)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, step, (token, cache))


def decode_step_time(
    cfg, model, params, tokens, steps: int, repeats: int, prefill_chunk: int = 512
) -> float:
    """Seconds per greedy decode step after a prefill of `tokens` [B, L] (not timed)."""
    times = decode_step_times({"": (cfg, model)}, params, tokens, steps, repeats, prefill_chunk)
    return times[""]


def decode_step_times(
    variants: dict, params, tokens, steps: int, repeats: int, prefill_chunk: int = 512
) -> dict:
    """Seconds per greedy decode step of each variant ({name: (cfg, model)}, the same
    params) after a prefill of `tokens` [B, L] (not timed): the variants are timed
    in turn, round after round (a first untimed round compiles), the best round of
    each kept, so that a shared machine's slow spells fall on every variant alike
    and the ratios between them hold. Each round prefills its cache anew (the
    loop donates it), so one variant's cache is held at a time."""
    batch, length = tokens.shape
    start_token = jnp.asarray(tokens[:, -1])
    best = dict.fromkeys(variants, float("inf"))
    for round_ in range(repeats + 1):
        for name, (cfg, model) in variants.items():
            # In chunks: attention over a whole long prompt at once would need
            # [T, S] scores per head.
            cache = init_cache(cfg.model, cfg.cache, batch, length + steps)
            for start in range(0, length, prefill_chunk):
                cache = prefill(model, params, cache, tokens[:, start : start + prefill_chunk])[1]
            jax.block_until_ready(cache)
            begin = time.perf_counter()
            jax.block_until_ready(decode_loop(model, params, cache, start_token, steps))
            if round_:
                best[name] = min(best[name], (time.perf_counter() - begin) / steps)
    return best


def random_prompt(vocab_size: int, batch: int, length: int) -> np.ndarray:
    """Seeded random tokens int32[batch, length]."""
    return np.random.default_rng(0).integers(0, vocab_size, (batch, length), np.int32)
