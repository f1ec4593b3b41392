"""Small shared helpers for the tests: tiny models and a compile counter."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import kvlab

ROOT = pathlib.Path(__file__).resolve().parents[1]


def native_attention_at_any_size(monkeypatch) -> None:
    """The native kernels take attention's float32 products over a cache of any size
    (ffi.ATTENTION_MIN_BYTES is the backend's speed choice, per build)."""
    from kvlab.kernels.native import ffi

    at_any_size = {name: dict.fromkeys(ffi.PRODUCTS, 0) for name, _, _ in ffi.ISAS}
    monkeypatch.setattr(ffi, "ATTENTION_MIN_BYTES", at_any_size)


def flags_with_devices(count: int) -> str:
    """This run's XLA flags (tests/conftest.py's) with `count` host CPU devices
    forced: a child process's, compiled as the tests compile."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"


TOLERANCE = 1e-4  # float32 max abs difference allowed between equal computations


def tiny_config(**model_overrides):
    """The tiny config with model fields changed; the model and cache sections are
    validated (a model test may use a vocabulary smaller than the byte data's)."""
    cfg = kvlab.base_config("tiny")
    cfg.model.update(model_overrides)
    kvlab.config.validate_model_config(cfg.model)
    kvlab.config.validate_cache_config(cfg.cache, cfg.model)
    return cfg


def mla_config(**mla_overrides):
    """The tiny latent-attention config (configs/mla.py:tiny) with fields of model.mla changed."""
    cfg = kvlab.load_config(f"{ROOT}/configs/mla.py:tiny")
    cfg.model.mla.update(mla_overrides)
    cfg.model.head_dim = cfg.model.mla.nope_dim + cfg.model.mla.rope_dim
    return kvlab.validate_config(cfg)


# Every attention design the model tests cover, by name.
VARIANTS = {
    "mha": lambda: tiny_config(num_kv_heads=4),
    "gqa": lambda: tiny_config(num_kv_heads=2),
    "mqa": lambda: tiny_config(num_kv_heads=1),
    "mla_absorbed": lambda: mla_config(absorb=True),
    "mla_expanded": lambda: mla_config(absorb=False),
    "mla_low_rank_query": lambda: mla_config(absorb=True, q_rank=24),
}


def build(cfg, seed: int = 0):
    """(model, params, jitted apply) for a config; shared between tests so that
    each shape compiles once per test session."""
    return _build(kvlab.config.frozen(cfg.model), seed)


@functools.cache
def _build(model_cfg, seed):
    model = kvlab.Transformer(model_cfg)
    params = kvlab.init_params(model_cfg, jax.random.key(seed))
    return model, params, jax.jit(model.apply)


def intermediates(cfg, params, tokens) -> dict:
    """The plain forward's intermediates of `tokens` (flax's capture_intermediates:
    ["block_0"]["attention"]["key"]["__call__"][0], ...), one compiled program per
    model and shape: a forward run op by op compiles an op per new shape."""
    return _capture(kvlab.config.frozen(cfg.model))(params, tokens)


@functools.cache
def _capture(model_cfg):
    model = kvlab.Transformer(model_cfg)

    def capture(params, tokens):
        return model.apply(
            {"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"]
        )[1]["intermediates"]

    return jax.jit(capture)


def last_logits(cfg, cache_cfg, tokens, prompt: int, count: int = 4, capacity: int = 32):
    """The logits at the last `count` positions of `tokens` [B, T] fed through a cache
    of cfg.model and `cache_cfg` (capacity tokens a row): a prefill of the first
    `prompt`, then a token a step. Checks the cache's error flags and that the bytes
    it counts are the tree's."""
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, tokens.shape[0], capacity)
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, tokens.shape[1])]
    out = []
    for start, end in steps:
        logits, cache = apply({"params": params}, tokens[:, start:end], cache=cache)
        out.extend(np.moveaxis(np.asarray(logits), 1, 0))
    cache.check()
    assert kvlab.cache_bytes(cfg.model, cache_cfg, tokens.shape[0], capacity) == kvlab.tree_bytes(
        cache
    )
    return np.stack(out[-count:])


# Other layouts of the same cache, each of which must give its logits (`same_logits`).
LAYOUTS = {
    "paged": {"kind": "paged", "page_size": 8},
    # a budget that holds every token of 15
    "evicting": {"evict": {"method": "snapkv", "budget": 24, "recent": 2}},
    "native": {"attention_impl": "native"},  # its kernels decline what they cannot read
    "chunked": {"prompt": 1},  # a token a step
}


def same_logits(cfg, cache_cfg, tokens, layout: dict, prompt: int = 12):
    """`last_logits` of `cache_cfg` and of it changed by `layout` (cache fields, or
    `attention_impl`, `evict`, `prompt`: a LAYOUTS entry), asserted equal within
    2e-5; returns the first."""
    other_cfg = cfg.copy_and_resolve_references()
    other_cache = cache_cfg.copy_and_resolve_references()
    fields = dict(layout)
    other_cfg.model.attention_impl = fields.pop("attention_impl", cfg.model.attention_impl)
    other_cache.evict.update(fields.pop("evict", {}))
    other_prompt = fields.pop("prompt", prompt)
    other_cache.update(fields)
    want = last_logits(cfg, cache_cfg, tokens, prompt)
    got = last_logits(other_cfg, other_cache, tokens, other_prompt)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    return want


def run_in_chunks(apply, params, cache, tokens, chunk_sizes):
    """Feeds tokens through the cache chunk by chunk; returns all logits and the cache."""
    logits, start = [], 0
    for size in chunk_sizes:
        out, cache = apply({"params": params}, tokens[:, start : start + size], cache=cache)
        logits.append(out)
        start += size
    return np.concatenate(logits, axis=1), cache


def plain_rope(x, positions, theta):
    """RoPE as kvlab computed it before scalings existed, kept to hold the model to the bit."""
    half = x.shape[-1] // 2
    inverse_frequency = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, :, None, None] * inverse_frequency
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def right_padded(rows) -> np.ndarray:
    """int32[len(rows), longest]: each row's tokens, then zeros."""
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens


def random_tokens(cfg, shape, seed: int = 0):
    return np.random.default_rng(seed).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)


@st.composite
def small_model_configs(draw, attention=("gqa", "mla")):
    """Random small but complete models: head sharing or latent attention (with
    random ranks, query path, decode path, latent norm, RoPE keys shared or one
    per group with their own frequency pairs), widths, ties, RoPE base."""
    num_heads = draw(st.sampled_from([1, 2, 4, 6]))
    divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    cfg = tiny_config(
        num_layers=draw(st.integers(1, 2)),
        num_heads=num_heads,
        num_kv_heads=draw(st.sampled_from(divisors)),
        head_dim=draw(st.sampled_from([2, 4, 8, 16])),
        embed_dim=draw(st.sampled_from([8, 24, 32])),
        mlp_dim=draw(st.sampled_from([16, 40])),
        vocab_size=draw(st.sampled_from([7, 64, 256])),
        tie_embeddings=draw(st.booleans()),
        rope_theta=draw(st.sampled_from([100.0, 10_000.0])),
    )
    if draw(st.sampled_from(attention)) == "mla":
        mla = cfg.model.mla
        mla.kv_rank = draw(st.integers(1, 24))
        mla.q_rank = draw(st.sampled_from([0, 5, 16]))
        mla.rope_dim = draw(st.sampled_from([2, 4, 8]))
        mla.nope_dim = draw(st.integers(0, 12))
        mla.v_head_dim = draw(st.integers(1, 12))
        mla.absorb = draw(st.booleans())
        mla.latent_norm = draw(st.booleans())
        mla.rope_heads = draw(st.sampled_from(divisors))
        cfg.model.attention = "mla"
        cfg.model.head_dim = mla.nope_dim + mla.rope_dim
        cfg.model.num_kv_heads = num_heads
        if draw(st.booleans()):  # the pairs a conversion keeps (kvlab/checkpoints/convert.py)
            pairs = st.permutations(range(cfg.model.head_dim // 2)).map(
                lambda order: tuple(order[: mla.rope_dim // 2])
            )
            layer = st.tuples(*[pairs] * mla.rope_heads)
            mla.rope_pairs = draw(st.tuples(*[layer] * cfg.model.num_layers))
    kvlab.config.validate_model_config(cfg.model)
    return cfg


@contextlib.contextmanager
def count_compiles():
    """Counts XLA compilations inside the block: `with count_compiles() as n: ...; n[0]`."""
    count = [0]

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


WORDS = (
    "cache key value head query token layer page bits scale group latent rank "
    "decode prefill attention model train sweep"
).split()


def write_corpus(folder, files: int = 12, words_per_file: int = 600, seed: int = 0):
    """A folder of small text files of random words: a corpus a model learns fast."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(files):
        words = rng.choice(WORDS, words_per_file)
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words) + "\n")
    return folder


def run_config(corpus, source: str = "text", **train_overrides):
    """A tiny config for training tests: short sequences, few steps, no wandb."""
    cfg = kvlab.base_config("tiny")
    cfg.data.source = source
    cfg.data.path = str(corpus) if source == "text" else ""
    cfg.train.update(
        steps=8, batch_size=4, seq_len=32, warmup=0, log_every=2, eval_every=4, checkpoint_every=4
    )
    cfg.train.update(train_overrides)
    cfg.eval.update(batch_size=4, num_batches=2, chunk=8)
    cfg.wandb.mode = "disabled"
    return kvlab.validate_config(cfg)


def run_experiment(script: str, flags: list[str]) -> subprocess.CompletedProcess:
    """Runs experiments/<script> at tiny sizes; fails the test with its stderr's end."""
    result = subprocess.run(
        [sys.executable, f"experiments/{script}", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # with this process's XLA_FLAGS: tests/conftest.py's, for compiling fast
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
