"""Long stored blocks read a slice at a time (flash-decoding, kvlab/attention/core.py).

Attention over a block of stored data (quantized payloads, page pools, 16-bit
arrays, and float32 arrays read by several queries) streams it when it spans at
least two slices; the result must equal reading the same tokens whole, for
every storage kind, ragged rows and query shape. STREAM_TOKENS is lowered so
small shapes stream.
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
import kvlab.attention.core as core
from kvlab.cache import quant
from kvlab.cache.paged import PagedPayloadReader, PagedReader
from tests.helpers import ROOT


def pooled(x: np.ndarray, per_page: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """x [B, KH, N, X] as a pool [KH, pages, per_page, X] in shuffled page order
    with one spare page, and block tables [B, N / per_page]."""
    b, kh, n, width = x.shape
    count = n // per_page
    order = rng.permutation(b * count + 1)
    pool = np.zeros((kh, b * count + 1, per_page, width), x.dtype)
    tables = order[: b * count].reshape(b, count)
    for row in range(b):
        for j in range(count):
            pool[:, tables[row, j]] = x[row, :, j * per_page : (j + 1) * per_page]
    return pool, tables.astype(np.int32)


def stored(kind, x, spec, paged, per_page, rng):
    """(what attention reads, the same tokens as a float32 array)."""
    if kind in ("bf16", "f32"):
        x = jnp.asarray(x, jnp.bfloat16 if kind == "bf16" else jnp.float32)
        if paged:
            pool, tables = pooled(np.asarray(x), per_page, rng)
            reader = PagedReader(jnp.asarray(pool), jnp.asarray(tables), x.shape[2])
            return reader, np.asarray(x, np.float32)
        return x, np.asarray(x, np.float32)
    tensor = quant.QuantizedTensor(*quant.quantize_tokens(jnp.asarray(x), spec), None, spec)
    dense = np.asarray(tensor.dequantize())
    if not paged:
        return tensor.reader(), dense
    g = spec.group_size if spec.axis == "channel" else 1
    arrays = {}
    for name in ("payload", "scale", "zero"):
        array = getattr(tensor, name)
        if array is not None:
            entries = per_page if name == "payload" else per_page // g  # per page
            pool, tables = pooled(np.asarray(array), entries, np.random.default_rng(7))
            arrays[name] = jnp.asarray(pool)
    rows = x.shape[2]
    reader = PagedPayloadReader(tensor.replace(**arrays), jnp.asarray(tables), rows, rows // g)
    return reader, dense


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["f32", "bf16", "int8", "int4", "int2", "fp8"]),
    axis=st.sampled_from(["token", "channel"]),
    symmetric=st.booleans(),
    paged=st.booleans(),
    pages_per_slice=st.sampled_from([1, 2]),
    slices=st.integers(2, 5),
    queries=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    latent=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_streamed_block_equals_the_whole_block(
    kind, axis, symmetric, paged, pages_per_slice, slices, queries, groups, latent, seed
):
    rng = np.random.default_rng(seed)
    batch, kv_heads, width, group = 2, 2, 8, 4
    per_page = 4
    size = per_page * pages_per_slice  # STREAM_TOKENS
    tokens = size * slices + (0 if paged else group * int(rng.integers(0, 2)))  # S % size != 0
    bits = {"int8": 8, "int4": 4, "int2": 2, "fp8": 8}.get(kind, 16)
    spec = quant.Storage(
        bits, "fp8" if kind == "fp8" else "int", axis, group, symmetric, "bfloat16", "float32"
    )
    if kind == "fp8" and axis == "channel":
        spec = quant.Storage(8, "fp8", "token", group, True, "bfloat16", "float32")
    keys = rng.standard_normal((batch, kv_heads, tokens, width), np.float32)
    values = rng.standard_normal((batch, kv_heads, tokens, width), np.float32)
    k_read, k_dense = stored(kind, keys, spec, paged, per_page, rng)
    v_read, v_dense = stored(kind, values, spec, paged, per_page, rng)
    # Ragged rows (one empty), queries seeing the stored tokens and the fresh ones.
    lengths = np.array([int(rng.integers(0, tokens + 1)), tokens])[:batch]
    mask = np.arange(tokens)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    q = rng.standard_normal((batch, queries, kv_heads * groups, width), np.float32)
    fresh = (
        rng.standard_normal((batch, kv_heads, queries, width), np.float32),
        rng.standard_normal((batch, kv_heads, queries, width), np.float32),
        np.tril(np.ones((queries, queries), bool))[None].repeat(batch, 0),
    )
    if latent:  # two key parts, the values are the first (absorbed latent attention)
        rope = rng.standard_normal((batch, kv_heads, tokens, 4), np.float32)
        q = (q, rng.standard_normal((batch, queries, kv_heads * groups, 4), np.float32))
        streamed = [((k_read, rope), k_read, mask)]
        whole = [((k_dense, rope), k_dense, mask)]
        fresh = ((fresh[0], fresh[0][..., :4]), fresh[0], fresh[2])
    else:
        streamed = [(k_read, v_read, mask)]
        whole = [(k_dense, v_dense, mask)]

    def attention(blocks):  # readers are closed over: they are no jit arguments
        return lambda q: core.attend(q, [*blocks, fresh])

    with mock.patch.object(core, "STREAM_TOKENS", size):  # traced under the patch
        loops = "while" in str(jax.make_jaxpr(attention(streamed))(q))
        # A float32 array is read whole by one query (a decode step), streamed by several.
        assert loops == (kind != "f32" or paged or queries > 1)
        out = np.asarray(jax.jit(attention(streamed))(q))
    expected = np.asarray(jax.jit(attention(whole))(q))
    np.testing.assert_allclose(out, expected, atol=1e-5 * max(1.0, np.abs(expected).max()))


def decode_logits(cfg, params, tokens, stream_tokens: int) -> np.ndarray:
    """Last-token logits of a 37-token prefill and three decode steps."""
    model = kvlab.Transformer(cfg.model)
    with mock.patch.object(core, "STREAM_TOKENS", stream_tokens):
        cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 48)
        step = jax.jit(lambda c, t: kvlab.prefill(model, params, c, t))  # traced under the patch
        logits, cache = step(cache, tokens[:, :37])
        steps = [logits[:, -1]]
        for t in range(37, 40):
            out, cache = step(cache, tokens[:, t : t + 1])
            steps.append(out[:, -1])
        cache.check()
    return np.stack(steps)


@pytest.mark.parametrize(
    "config, cache",
    [
        ("gqa.py:tiny", dict(kind="paged", k_bits=4, v_bits=2, group_size=4, page_size=8)),
        ("gqa.py:tiny", dict(k_bits=4, v_bits=4, k_axis="token", group_size=4)),
        ("mla.py:tiny", dict(latent_bits=4, group_size=4)),
    ],
)
def test_streamed_decode_equals_whole_decode_in_the_model(config, cache):
    """Prefill and decode through paged and dense KIVI caches (4-bit per-channel
    keys, 2-bit values), per-token 4-bit, and a 4-bit latent cache: logits with
    streaming equal those without."""
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}")
    cfg.cache.update(cache)
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 40), np.int32)
    whole = decode_logits(cfg, params, tokens, 10**9)
    np.testing.assert_allclose(decode_logits(cfg, params, tokens, 8), whole, atol=1e-5)


def test_attention_impl_is_checked():
    cfg = kvlab.base_config("tiny")
    cfg.model.attention_impl = "triton"
    with pytest.raises(ValueError, match="model.attention_impl"):
        kvlab.validate_config(cfg)
