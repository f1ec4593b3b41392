"""kvlab/kernels/native: the kernels compute the products XLA computes, the backend
hands them the blocks and writes it takes, and the build is cached and safe."""

import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
import kvlab.kernels.native as native
from kvlab.attention import core
from kvlab.cache.placement import scatter_tokens
from kvlab.kernels.native import ffi, to_panels
from tests.attention.test_stream import decode_logits
from tests.helpers import (
    ROOT,
    TOLERANCE,
    native_attention_at_any_size,
    random_tokens,
    run_in_chunks,
    small_model_configs,
    tiny_config,
)
from tests.test_model import _perturbed, max_diff

needs_native = pytest.mark.skipif(
    not native.available(),
    reason=f"kvlab.kernels.native unavailable: {native.unavailable_reason()}",
)
PRODUCTS = [t for t in ffi.TARGETS if t not in ("kvlab_write_tokens", "kvlab_top_k_last")]


def reference(x, kernel):
    return np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)


def check_products(got, spec: str, a, b, parts=None):
    """got is einsum(spec, a, b) within float32 rounding of each sum's terms
    (sums may cancel), or of the terms' parts when b's numbers are sums of
    parts (`parts`: their magnitudes added)."""
    want = np.einsum(spec, np.asarray(a, np.float64), b)
    parts = np.abs(b) if parts is None else parts
    terms = np.einsum(spec, np.abs(np.asarray(a, np.float64)), parts)
    assert got.shape == want.shape
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 1e-5 * terms + 1e-30)


def relative_error(got, want):
    return float(
        np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.abs(want).max(), 1e-30)
    )


@given(
    rows=st.integers(1, 2 * ffi.MAX_ROWS + 3),
    depth=st.integers(1, 70),
    panels=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_panel_matmul_is_x_times_the_kernel(rows, depth, panels, seed):
    """Every row count (a decode step's few, a prompt's many), any depth."""
    rng = np.random.default_rng(seed)
    kernel = rng.standard_normal((depth, panels * native.PANEL), np.float32)
    x = rng.standard_normal((rows, depth), np.float32)
    stored = to_panels(jnp.asarray(kernel))
    assert stored.shape == (panels, depth, native.PANEL)
    b, k, j = rng.integers(panels), rng.integers(depth), rng.integers(native.PANEL)
    assert stored[b, k, j] == kernel[k, native.PANEL * b + j]  # the layout's definition
    got = jax.jit(native.panel_product)(jnp.asarray(x), stored)
    assert got.shape == (rows, panels * native.PANEL) and got.dtype == jnp.float32
    assert relative_error(got, reference(x, kernel)) < 1e-5
    # Under vmap each slice is one call.
    stacked = jnp.stack([jnp.asarray(x), 2 * jnp.asarray(x)])
    both = jax.vmap(native.panel_product, in_axes=(0, None))(stacked, stored)
    np.testing.assert_allclose(both[1], 2 * np.asarray(got), rtol=1e-5, atol=1e-5)


@needs_native
def test_the_native_kernel_runs_for_float32_only():
    x, panels = jnp.ones((ffi.MAX_ROWS, 8)), jnp.ones((2, 8, native.PANEL))

    def targets(x, panels):
        return str(jax.make_jaxpr(native.panel_product)(x, panels)).count("kvlab_panel_matmul")

    assert targets(x, panels) == 1
    assert targets(jnp.ones((1000, 8)), panels) == 1  # a prompt's rows too
    assert targets(x.astype(jnp.bfloat16), panels.astype(jnp.bfloat16)) == 0
    assert targets(x, panels.astype(jnp.bfloat16)) == 0
    # Outside the compiled call the kernel's result is used as it is: no NaN, no garbage
    # in rows or columns a tile does not fill.
    x = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8)
    got = native.panel_product(x, panels)
    np.testing.assert_array_equal(got, np.tile(np.asarray(x).sum(1, keepdims=True), (1, 64)))


def test_mismatched_operands_are_refused():
    with pytest.raises(ValueError, match=r"x \(2, 8\) and panels \(1, 9, 32\) do not multiply"):
        ffi.panel_matmul(jnp.ones((2, 8)), jnp.ones((1, 9, 32)))
    with pytest.raises(ValueError, match="do not multiply"):
        ffi.panel_matmul(jnp.ones((2, 8)), jnp.ones((1, 8, 16)))


def test_a_failing_or_missing_compiler_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # runs, and fails
    with pytest.raises(RuntimeError, match="building kernels.cc failed"):
        ffi.build(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the partial output is removed
    monkeypatch.setenv("CXX", "kvlab-no-such-compiler")
    with pytest.raises(FileNotFoundError, match=r"no C\+\+ compiler 'kvlab-no-such-compiler'"):
        ffi.build(tmp_path)


@pytest.mark.parametrize(
    "cpu, wanted, chosen",
    [
        ({"avx512f", "avx2", "fma", "f16c"}, None, "AVX-512F"),
        ({"avx512f", "avx2", "fma", "f16c"}, "AVX2", "AVX2"),
        ({"avx2", "fma", "f16c"}, None, "AVX2"),
        ({"avx2", "fma", "f16c"}, "AVX-512F", "KVLAB_NATIVE_ISA=AVX-512F: this CPU has no avx512f"),
        ({"avx2", "fma"}, None, "this CPU has neither AVX-512F nor AVX2 with FMA and F16C"),
        ({"avx512f", "fma"}, "SSE4", "KVLAB_NATIVE_ISA='SSE4' is none of AVX-512F, AVX2"),
    ],
)
def test_the_kernels_are_built_for_the_best_instruction_set_the_cpu_has(
    cpu, wanted, chosen, monkeypatch
):
    """AVX-512F where the CPU has it, else AVX2 with FMA and F16C (avx2.h), or the
    one KVLAB_NATIVE_ISA names; a reason where there is none, never a build that
    would fault on the first call."""
    monkeypatch.setattr(ffi, "_cpu_flags", lambda: cpu)
    monkeypatch.setenv("KVLAB_NATIVE_ISA", wanted or "")
    if chosen not in ("AVX-512F", "AVX2"):
        with pytest.raises(LookupError, match=f"^{re.escape(chosen)}$"):
            ffi.isa()
        return
    name, flags = ffi.isa()
    assert name == chosen and ("-mavx512f" in flags) == (chosen == "AVX-512F")


@pytest.mark.skipif(
    not native.available() or ffi.isa()[0] != "AVX-512F",
    reason="the AVX2 build is what test_native runs where AVX-512F is missing",
)
def test_the_avx2_build_computes_what_the_avx512_build_computes():
    """On a CPU with AVX-512F this file tests the AVX-512 build; the AVX2 one
    (avx2.h in place of the AVX-512 intrinsics) is tested here, in a process of
    its own, by the kernels' property tests over every product and the top-k."""
    tests = (
        "attention_products_are_the_einsums or owned_products or pool_products"
        " or quantized_products or top_k_last_is_the_top_k"
    )
    env = {**os.environ, "KVLAB_NATIVE_ISA": "AVX2", "KVLAB_HYPOTHESIS_EXAMPLES": "4"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", __file__, "-k", tests]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


def test_without_the_kernels_the_panel_layout_runs_on_xla():
    """KVLAB_NATIVE=0 (or no compiler, or another CPU): available() says why, and a
    panel tree computes through XLA's product what the kernel tree computes."""
    code = """
import jax, jax.numpy as jnp, kvlab
import kvlab.kernels.native as native
assert not native.available() and native.unavailable_reason() == "KVLAB_NATIVE=0"
cfg = kvlab.load_config("configs/gqa.py:tiny")
params = kvlab.init_params(cfg.model, jax.random.key(0))
panels = native.panel_projections(kvlab.fuse_projections(params))
want = kvlab.Transformer(cfg.model).apply({"params": params}, tokens := jnp.ones((2, 3), int))[0]
cfg.model.attention_impl = "native"
got = kvlab.Transformer(cfg.model).apply({"params": panels}, tokens)[0]
assert float(jnp.abs(got - want).max()) < 1e-4, float(jnp.abs(got - want).max())
"""
    env = {**os.environ, "KVLAB_NATIVE": "0", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)


@needs_native
@given(
    slices=st.integers(1, 5),
    rows=st.integers(1, ffi.MAX_ROWS + 2),
    length=st.integers(1, 40),
    width=st.integers(1, 70),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    cut=st.integers(0, 41),
    seed=st.integers(0, 2**16),
)
def test_attention_products_are_the_einsums(slices, rows, length, width, dtype, cut, seed):
    """Scores (16 keys a vector, then one by one) and weighted sums (64 columns a
    pass) for every tail: lengths and widths not multiples of 16 or 64, keys and
    values stored in float32 or widened from 16 bits, up to a limit (past it
    scores are 0 and weights, here NaN, are not read); the kernels take any
    size (ATTENTION_MIN_BYTES is the backend's speed choice), up to MAX_ROWS
    query rows: more are refused (the backend leaves them to XLA)."""
    check_attention_products(slices, rows, length, width, seed, dtype, min(cut, length))


def check_attention_products(slices, rows, length, width, seed, dtype, seen):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((slices, 1, rows, width), np.float32)
    stored = jnp.asarray(rng.standard_normal((slices, 1, length, width)), dtype)
    k = np.asarray(stored.astype(jnp.float32))  # the numbers the cache holds
    w = rng.standard_normal((slices, 1, rows, length), np.float32)
    w_past = w.copy()
    w_past[..., seen:] = np.nan

    if rows > ffi.MAX_ROWS:
        with pytest.raises(ValueError, match=f"at most MAX_ROWS={ffi.MAX_ROWS} query rows"):
            ffi.scores(jnp.asarray(q), stored, seen)
        with pytest.raises(ValueError, match=f"at most MAX_ROWS={ffi.MAX_ROWS} query rows"):
            ffi.weighted_sum(jnp.asarray(w), stored, seen)
        return
    scores = jax.jit(ffi.scores)(jnp.asarray(q), stored, seen)
    check_products(scores[..., :seen], "pqmh,pqsh->pqms", q, k[:, :, :seen])
    assert np.all(np.asarray(scores[..., seen:]) == 0)
    out = jax.jit(ffi.weighted_sum)(jnp.asarray(w_past), stored, seen)
    check_products(out, "pqms,pqsh->pqmh", w[..., :seen], k[:, :, :seen])
    other = jnp.asarray(np.concatenate([k, k]))  # one more slice
    with pytest.raises(ValueError, match="do not match"):
        ffi.scores(jnp.asarray(q), other)
    with pytest.raises(ValueError, match="do not match"):
        ffi.weighted_sum(jnp.asarray(w), other)


@needs_native
@given(
    length=st.integers(1, 40),
    width=st.sampled_from([8, 16, 24, 64]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_key_scores_alike_alone_and_in_a_block(length, width, dtype, seed):
    """The kernel sums keys a block at a time and a row's last few one by one:
    each in the same order, so a key's score does not depend on how many keys
    follow it (a cache's scores do not change as it grows)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, 2, 3, width)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 2, 48, width)), dtype)
    whole = np.asarray(ffi.scores(q, k))
    np.testing.assert_array_equal(np.asarray(ffi.scores(q, k[:, :, :length])), whole[..., :length])


@needs_native
def test_a_decode_step_runs_on_the_kernels(monkeypatch):
    """With panels and attention_impl='native', a decode step's products are the
    kernels' (not silently XLA's; attention's from ATTENTION_MIN_BYTES of cache,
    here 0); a prompt's projections too, its attention XLA's, and so is
    attention over a small cache."""
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.attention_impl = "native"
    model = kvlab.Transformer(cfg.model)
    params = native.panel_projections(kvlab.init_params(cfg.model, jax.random.key(0)))
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=64)

    def calls(length):
        tokens = jnp.zeros((2, length), jnp.int32)
        text = str(jax.make_jaxpr(model.apply)({"params": params}, tokens, cache=cache))
        return {target: text.count(target) for target in ffi.TARGETS}

    layers = cfg.model.num_layers
    assert calls(1)["kvlab_scores"] == 0  # 64 slots: far below ATTENTION_MIN_BYTES
    native_attention_at_any_size(monkeypatch)
    step = calls(1)
    assert step["kvlab_scores"] == step["kvlab_weighted_sum"] == 2 * layers  # cache, new token
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    panelled = sum(path[-1].key == "panels" for path in paths)
    assert panelled > layers and step["kvlab_panel_matmul"] == panelled  # each once
    prompt = {target: 0 for target in ffi.TARGETS} | {"kvlab_panel_matmul": panelled}
    assert calls(32) == prompt


@needs_native
@pytest.mark.parametrize("config", ["gqa.py:tiny", "mla.py:tiny"])
@pytest.mark.parametrize("scores, weighted_sum", [(0, 1 << 40), (1 << 40, 0)])
def test_each_product_takes_the_kernels_from_its_own_size(
    monkeypatch, config, scores, weighted_sum
):
    """ATTENTION_MIN_BYTES is per product: keys reach the scores kernel and values
    the weighted-sum kernel each from its own size, a latent (keys and values at
    once) from both; a block read partly by the kernels and partly by XLA gives
    the XLA path's logits."""
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}")
    cfg.model.attention_impl = "native"
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = random_tokens(cfg, (2, 9), seed=3)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=16)
    _, cache = kvlab.Transformer(cfg.model).apply({"params": params}, tokens[:, :8], cache=cache)
    least = {name: {"scores": scores, "weighted_sum": weighted_sum} for name, _, _ in ffi.ISAS}
    monkeypatch.setattr(ffi, "ATTENTION_MIN_BYTES", least)

    def step(impl):
        model_cfg = cfg.model.copy_and_resolve_references()
        model_cfg.attention_impl = impl
        apply = functools.partial(kvlab.Transformer(model_cfg).apply, {"params": params})
        text = str(jax.make_jaxpr(apply)(tokens[:, 8:], cache=cache))
        return {t: text.count(t) for t in PRODUCTS}, apply(tokens[:, 8:], cache=cache)[0]

    (calls, got), (_, want) = step("native"), step("xla")
    layers, latent = cfg.model.num_layers, cfg.model.attention == "mla"
    # each layer's cache block and its new token; a latent's rope keys are keys alone
    assert calls["kvlab_scores"] == (2 * layers if scores == 0 else 0)
    assert calls["kvlab_weighted_sum"] == (2 * layers if weighted_sum == 0 and not latent else 0)
    assert max_diff(got, want) <= TOLERANCE


@needs_native
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_a_quantized_cache_is_read_by_the_kernels(kind):
    """With attention_impl='native', a decode step reads each layer's quantized
    keys and values (a row's own or page pools) with the quantized kernels at
    any cache size, the other blocks' products staying XLA's for a small
    cache; a prompt (more rows than MAX_ROWS) takes XLA's products, and so
    does attention_impl='xla'."""
    cfg = kvlab.load_config(f"{ROOT}/configs/kv_kivi2.py:tiny")
    cfg.model.attention_impl = "native"
    cfg.cache.kind = kind
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=64)

    def calls(model_cfg, length):
        tokens = jnp.zeros((2, length), jnp.int32)
        apply = kvlab.Transformer(model_cfg).apply
        text = str(jax.make_jaxpr(apply)({"params": params}, tokens, cache=cache))
        return {target: text.count(target) for target in PRODUCTS}

    layers = cfg.model.num_layers
    step = calls(cfg.model, 1)
    assert step["kvlab_quant_scores"] == step["kvlab_quant_weighted_sum"] == layers
    assert step["kvlab_scores"] == step["kvlab_weighted_sum"] == 0  # small: XLA's
    assert calls(cfg.model, 32) == {target: 0 for target in PRODUCTS}
    xla = cfg.model.copy_and_resolve_references()
    xla.attention_impl = "xla"
    assert calls(xla, 1) == {target: 0 for target in PRODUCTS}


def native_model(**cache_fields):
    """gqa.py:tiny with attention_impl='native' and these cache fields: its
    (apply, params, cache of 2 rows x 64 slots, layers, calls), calls(T) counting
    each kernel's calls in the jaxpr of a T-token step."""
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.attention_impl = "native"
    cfg.cache.update(cache_fields)
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=64)
    apply = kvlab.Transformer(cfg.model).apply

    def calls(length):
        tokens = jnp.zeros((2, length), jnp.int32)
        text = str(jax.make_jaxpr(apply)({"params": params}, tokens, cache=cache))
        return {target: text.count(target) for target in ffi.TARGETS}

    return apply, params, cache, cfg.model.num_layers, calls


@needs_native
def test_a_paged_cache_is_read_through_its_tables():
    """With attention_impl='native', a decode step reads each layer's float32
    page pools with the kernels a page at a time at any length (nothing
    gathered); a prompt takes XLA's products."""
    *_, layers, calls = native_model(kind="paged")
    step = calls(1)
    assert step["kvlab_scores"] == step["kvlab_weighted_sum"] == layers  # the pools
    assert all(calls(32)[target] == 0 for target in PRODUCTS)


@needs_native
def test_codes_that_do_not_fit_are_refused():
    """Queries of another width, weights of another length, and scales that do
    not fit the codes (which only the kernel sees) are errors, not reads past
    the arrays."""
    from kvlab.cache import quant

    spec = quant.Storage(4, "int", "token", 8, False, "bfloat16", "float32")
    x = jnp.ones((2, 1, 16, 32), jnp.float32)
    codes = native.codes(quant.QuantizedTensor(*quant.quantize_tokens(x, spec), None, spec))
    with pytest.raises(ValueError, match="do not match"):
        ffi.quant_scores(jnp.ones((2, 1, 1, 16)), codes, 16)
    with pytest.raises(ValueError, match="do not match"):
        ffi.quant_weighted_sum(jnp.ones((2, 1, 1, 15)), codes, 16)
    shifted = dataclasses.replace(codes, scale=codes.scale[:, :, :8])  # 8 tokens' scales
    with pytest.raises(Exception, match="scales do not fit the codes"):
        jax.block_until_ready(ffi.quant_scores(jnp.ones((2, 1, 1, 32)), shifted, 16))


@needs_native
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    rows=st.integers(1, ffi.MAX_ROWS),
    per_page=st.integers(1, 9),
    width=st.integers(1, 70),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    cut=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_pool_products_are_those_of_the_gathered_tokens(
    batch, heads, rows, per_page, width, dtype, cut, seed
):
    """Scores and weighted sums over a page pool through shuffled block tables
    (entries -1 and past the pool read the nearest page, as gather_pages
    clips them) equal the products over the gathered tokens, up to a limit."""
    from kvlab.cache.paged import gather_pages

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    length = int(rng.integers(1, n * per_page + 1))
    seen = int(cut * length)
    pool = jnp.asarray(rng.standard_normal((heads, batch * n + 2, per_page, width)), dtype)
    pages = rng.permutation(pool.shape[1])[: batch * n].reshape(batch, n)
    pages[rng.random(pages.shape) < 0.2] = -1
    pages[rng.random(pages.shape) < 0.1] = pool.shape[1] + 3
    pages = jnp.asarray(pages, jnp.int32)
    tokens = np.asarray(gather_pages(pool, pages, length).astype(jnp.float32), np.float64)
    q = rng.standard_normal((batch, heads, rows, width), np.float32)
    w = rng.standard_normal((batch, heads, rows, length), np.float32)
    w_past = w.copy()
    w_past[..., seen:] = np.nan

    scores = jax.jit(ffi.pool_scores, static_argnums=3)(q, pool, pages, length, seen)
    check_products(scores[..., :seen], "bkmh,bksh->bkms", q, tokens[:, :, :seen])
    assert np.all(np.asarray(scores[..., seen:]) == 0)
    out = jax.jit(ffi.pool_weighted_sum)(jnp.asarray(w_past), pool, pages, seen)
    check_products(out, "bkms,bksh->bkmh", w[..., :seen], tokens[:, :, :seen])
    with pytest.raises(ValueError, match="do not match"):  # more tokens than the tables hold
        ffi.pool_scores(q, pool, pages, n * per_page + 1, seen)


@needs_native
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    rows=st.integers(1, ffi.MAX_ROWS),
    length=st.integers(1, 200),
    width=st.integers(1, 70),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_owned_products_read_each_slot_with_its_own_heads_queries(
    batch, heads, rows, length, width, dtype, seed
):
    """Over a pool of slots each owned by one KV head (AdaKV's), each slot is read
    by its owner's queries alone, the owner its tag mod K (tags small and near
    int32's limits). The kernels list a row's slots by owner (head 0's in slot
    order, then head 1's, ...; a slot of no head, a negative tag, is not
    listed) and exchange the softmax's exponents and weights in that order:
    a listed slot's exponent is its scaled product less its head's peak, -inf
    past the listed ones, whose weights (here NaN) are never read; a head that
    owns nothing has peak -inf and sums 0. A listing that could not be the
    pool's is refused before anything is read."""
    rng = np.random.default_rng(seed)
    scale = float(rng.uniform(0.1, 2.0))
    small = rng.integers(-2, 4 * heads, (batch, length))
    large = rng.integers(-(2**31), 2**31, (batch, length))
    tags = np.where(rng.random((batch, length)) < 0.5, small, large).astype(np.int32)
    tags[0][tags[0] % heads == heads - 1] = -1  # the last head of row 0 owns no slot
    owner = np.where(tags >= 0, tags % heads, -1)
    stored = jnp.asarray(rng.standard_normal((batch, length, width)), dtype)
    tokens = np.asarray(stored.astype(jnp.float32), np.float64)
    q = rng.standard_normal((batch, heads, rows, width), np.float32)
    order = [np.concatenate([np.flatnonzero(o == k) for k in range(heads)]) for o in owner]

    exponents, peaks, listings = jax.jit(ffi.owned_scores, static_argnums=3)(q, stored, tags, scale)
    exponents, peaks = np.asarray(exponents, np.float64), np.asarray(peaks, np.float64)
    for b, slots in enumerate(order):  # where each head's slots start, then the list
        starts = np.cumsum([0, *(np.sum(owner[b] == k) for k in range(heads))])
        np.testing.assert_array_equal(listings[b, : heads + 2], [*starts, length])
        unowned = np.flatnonzero(owner[b] < 0)  # listed last
        np.testing.assert_array_equal(listings[b, heads + 2 :], [*slots, *unowned])
    by_head = scale * np.einsum("bkmh,bsh->bkms", q.astype(np.float64), tokens)
    terms = scale * np.einsum("bkmh,bsh->bkms", np.abs(q.astype(np.float64)), np.abs(tokens))
    mine = np.stack([owner == k for k in range(heads)], 1)[:, :, None, :]  # [B, K, 1, S]
    top = np.where(mine, by_head, -np.inf).max(-1)  # [B, K, M]
    held = np.isfinite(top)
    np.testing.assert_array_equal(np.isneginf(peaks), ~held)
    assert np.all(np.abs(peaks[held] - top[held]) <= 1e-5 * terms.max(-1)[held] + 1e-30)
    assert np.all(np.isneginf(peaks[0, heads - 1]))
    for b, slots in enumerate(order):
        own = owner[b, slots]
        want = by_head[b, own, :, slots].T - peaks[b, own].T  # [M, listed]
        bound = 2e-5 * terms[b].max((0, 2)).max() + 1e-30
        assert np.all(np.abs(exponents[b, :, : len(slots)] - want) <= bound)
        assert np.all(np.isneginf(exponents[b, :, len(slots) :]))

    w = rng.standard_normal((batch, rows, length), np.float32)
    listed = w.copy()
    for b, slots in enumerate(order):
        listed[b, :, len(slots) :] = np.nan
    sums, totals = jax.jit(ffi.owned_weighted_sum, static_argnums=3)(
        jnp.asarray(listed), stored, listings, heads
    )
    weights = np.zeros((batch, heads, rows, length))  # each slot's weight, by head
    for b, slots in enumerate(order):
        weights[b, owner[b, slots], :, slots] = w[b, :, : len(slots)].T
    check_products(sums, "bkms,bsh->bkmh", weights, tokens)
    np.testing.assert_allclose(totals, weights.sum(-1), rtol=1e-5, atol=1e-5 * length)
    assert np.all(np.asarray(sums)[0, heads - 1] == 0) and np.all(np.asarray(totals)[0, -1] == 0)
    with pytest.raises(ValueError, match="do not match"):
        ffi.owned_scores(q, stored, tags[:, :-1] if length > 1 else tags[:0])
    listed_count = int(listings[0, heads])
    for at, slot in ((0, length), (listed_count - 1, -1)):  # past the pool; negative, last
        broken = np.asarray(listings).copy()
        broken[0, heads + 2 + at] = slot
        if listed_count > 0:
            with pytest.raises(Exception, match="not owned_scores' for this pool"):
                sums = ffi.owned_weighted_sum(jnp.asarray(listed), stored, broken, heads)
                jax.block_until_ready(sums)


@needs_native
@pytest.mark.parametrize(
    "config, method, dtype, interval",
    [
        ("gqa.py:tiny", "adakv", "float32", 4),
        ("gqa.py:tiny", "adakv", "bfloat16", 4),  # 16 bits: streamed on XLA's path
        ("gqa.py:tiny", "h2o", "float32", 1),  # observes every step
        ("mha.py:tiny", "tova", "float32", 1),  # one query row per KV head: XLA's
        ("mla.py:tiny", "tova", "float32", 2),  # a latent, read as keys and values
    ],
)
def test_evicting_caches_decode_alike_on_the_kernels(config, method, dtype, interval, monkeypatch):
    """With attention_impl='native', an evicting cache decodes to the XLA path's
    logits and keeps the same tokens: a step that observes attention (for the
    mass a scorer reads) takes the kernels' products for float32 arrays read
    by 2 query rows or more per KV head (Backend.readers; one row is XLA's
    matrix-vector product), and AdaKV's pool (one pool of slots for every KV head)
    is read in the other steps by the owned kernels, each slot with its own KV
    head's queries (Backend.pooled; a 16-bit pool is streamed on XLA's path,
    so that its products are float32 ones there too)."""
    monkeypatch.setattr(core, "STREAM_TOKENS", 8)
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}")
    cfg.cache.dtype = dtype
    cfg.cache.evict.update(method=method, budget=12, recent=2, interval=interval)
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = random_tokens(cfg, (2, 40), 0)
    layers, runs = cfg.model.num_layers, {}
    for impl in ("xla", "native"):
        cfg.model.attention_impl = impl
        model = kvlab.Transformer(cfg.model)
        cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=40)
        step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c))  # noqa: B023
        text = str(jax.make_jaxpr(step)(cache, tokens[:, :1]))
        owned = text.count("kvlab_owned_scores")
        assert owned == text.count("kvlab_owned_weighted_sum")
        assert owned == (layers if impl == "native" and method == "adakv" else 0)
        if dtype == "float32":  # the observed step's products
            one_row = config == "mha.py:tiny"  # a decode step's query rows per KV head
            assert (text.count("kvlab_scores") >= 2 * layers) == (impl == "native" and not one_row)
        # a decode step's few drops a head: the kernel (Backend.top_k_last)
        assert (text.count("kvlab_top_k_last") >= layers) == (impl == "native")
        logits, positions = [], []
        _, cache = step(cache, tokens[:, :24])
        for t in range(24, 40):
            out, cache = step(cache, tokens[:, t : t + 1])
            logits.append(out)
            positions.append([layer.positions for layer in cache.layers])
        runs[impl] = logits, positions
    np.testing.assert_allclose(runs["native"][0], runs["xla"][0], atol=1e-5, rtol=1e-4)
    for xla, got in zip(runs["xla"][1], runs["native"][1], strict=True):
        for a, b in zip(xla, got, strict=True):
            np.testing.assert_array_equal(a, b)


SPECIAL = np.array(
    [0.0, -0.0, 1.0, -1.0, 2.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45], np.float32
)


@needs_native
@settings(max_examples=60)
@given(
    rows=st.integers(1, 3),
    length=st.integers(1, 70),
    data=st.data(),
    kind=st.sampled_from(["special", "ties", "normal", "mostly_equal"]),
    seed=st.integers(0, 2**16),
)
def test_top_k_last_is_the_top_k_of_the_reversed_row(rows, length, data, kind, seed):
    """The kernel's indices are exactly those of XLA's top-k of each reversed row
    (kvlab.cache.evict.top_k_last): XLA's total order of floats (NaN above +inf,
    +0 above -0, a negative NaN lowest), among equals the later index first, in
    rows shorter and longer than its blocks of 16 whatever k, with runs of equal
    numbers as long as the row."""
    k = data.draw(st.integers(1, length))
    rng = np.random.default_rng(seed)
    if kind == "special":
        x = rng.choice(SPECIAL, (rows, length))
        x[rng.random((rows, length)) < 0.2] = -np.float32(np.nan)  # sign bit set
    elif kind == "ties":
        x = rng.integers(0, 4, (rows, length)).astype(np.float32)
    elif kind == "mostly_equal":  # a full pool's slots (-inf) and a few free ones
        x = np.full((rows, length), -np.inf, np.float32)
        x[rng.random((rows, length)) < 0.05] = -rng.integers(0, length, 1)
    else:
        x = rng.normal(size=(rows, length)).astype(np.float32)
    x = jnp.asarray(x, jnp.float32)
    got = jax.jit(lambda x: ffi.top_k_last(x, k))(x)
    np.testing.assert_array_equal(got, kvlab.cache.evict.top_k_last(x, k))


@needs_native
def test_the_backend_takes_a_few_of_a_float32_row_and_declines_the_rest():
    """Backend.top_k_last: the kernel for float32 rows and k <= TOP_FEW (a decode
    step's drops), None (XLA's top-k) for more or other types; refused by the
    call itself for k outside 1..C."""
    backend = kvlab.backends.get("native")
    x = jnp.arange(40, dtype=jnp.float32).reshape(2, 20)
    kernel = lambda k: (
        "kvlab_top_k_last"
        in str(  # noqa: E731
            jax.make_jaxpr(lambda x: backend.top_k_last(x, k))(x)
        )
    )
    assert kernel(1) and kernel(native.TOP_FEW)
    assert backend.top_k_last(x, native.TOP_FEW + 1) is None
    assert backend.top_k_last(x.astype(jnp.bfloat16), 2) is None
    for k in (0, 21):
        with pytest.raises(ValueError, match="top_k_last takes"):
            ffi.top_k_last(x, k)


@needs_native
@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    axis_at=st.integers(1, 3),
    length=st.integers(1, 12),
    tokens=st.integers(1, 4),
    per_head=st.booleans(),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_16_bit_writes_in_place_equal_the_scatter(
    lead, axis_at, length, tokens, per_head, dtype, seed
):
    """The backend's write of a 16-bit buffer (the in-place kernel on one CPU)
    puts exactly what the scatter puts in a float32 copy of it, along any axis,
    with slots per row or per head, and drops slots outside the buffer
    (negative, or past its end) instead of wrapping them."""
    rng = np.random.default_rng(seed)
    axis = min(axis_at, len(lead) + 1)
    shape = (2, *lead[: axis - 1], length, *lead[axis - 1 :])
    buffer = jnp.asarray(rng.standard_normal(shape), dtype)
    new_shape = list(shape)
    new_shape[axis] = tokens
    new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    heads = shape[1] if per_head and axis == 2 else None
    slot_shape = (2, tokens) if heads is None else (2, heads, tokens)
    # Distinct slots per row (and head), some outside the buffer on either side.
    rows = [rng.permutation(np.arange(-2, length + 2))[:tokens] for _ in range(2 * (heads or 1))]
    slots = jnp.asarray(np.stack(rows), jnp.int32).reshape(slot_shape)
    assert ffi.writes_in_place(buffer)
    write = jax.jit(native.backend.write, static_argnums=3)
    assert (
        "kvlab_write_tokens"
        in jax.jit(native.backend.write, static_argnums=3).lower(buffer, new, slots, axis).as_text()
    )
    got = write(buffer, new, slots, axis)
    with pytest.raises(ValueError, match="write_tokens takes"):  # a slot more than tokens
        flat, fresh = buffer.reshape(2, 1, length, -1), new.reshape(2, 1, tokens, -1)
        ffi.write_tokens(flat, fresh, jnp.zeros((2, 1, tokens + 1), jnp.int32))
    want = scatter_tokens(buffer.astype(jnp.float32), new.astype(jnp.float32), slots, axis)
    assert got.dtype == buffer.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want))


@needs_native
def test_a_16_bit_cache_is_written_in_place_and_read_by_the_kernels(monkeypatch):
    """With attention_impl='native', a bfloat16 cache's decode step writes each
    layer's keys and values with the in-place kernel (XLA:CPU would rewrite the
    whole buffer through float32, which the compiled step must not do) and reads
    a cache long enough to stream (here from 16 slots) with the kernels widening
    16 bits in registers; a prompt's products stay XLA's."""
    from kvlab.attention import core

    monkeypatch.setattr(core, "STREAM_TOKENS", 8)
    apply, params, cache, layers, calls = native_model(dtype="bfloat16")
    step = calls(1)
    assert step["kvlab_write_tokens"] == 2 * layers
    assert step["kvlab_scores"] == step["kvlab_weighted_sum"] == layers  # the stored block
    prompt = calls(32)
    assert prompt["kvlab_write_tokens"] == 2 * layers
    assert prompt["kvlab_scores"] == prompt["kvlab_weighted_sum"] == 0
    tokens = jnp.zeros((2, 1), jnp.int32)
    compiled = jax.jit(apply).lower({"params": params}, tokens, cache=cache).compile().as_text()
    whole = jax.tree_util.tree_leaves(cache)[0].shape  # [B, KH, S, H]
    assert f"f32[{','.join(map(str, whole))}]" not in compiled


def test_a_damaged_library_is_built_again_once_and_cached(tmp_path):
    """A truncated file under the library's name (a disk that filled up, a copy
    cut short) is replaced, not a reason to run without the kernels. The build
    writes through a temporary name, removes one a build killed long ago left,
    and keeps one another process is writing; the next call finds it."""
    if not native.available():  # load() builds nothing on a CPU the kernels cannot run on
        pytest.skip(f"the kernels do not load here: {native.unavailable_reason()}")
    # The library's name is the same in any directory: this process's, built already.
    name = ffi.build().name
    cache = tmp_path / "fresh"
    cache.mkdir()
    (cache / name).write_bytes(b"\x7fELF truncated")
    killed, recent = cache / ".kernels-killed.so", cache / ".kernels-building.so"
    killed.write_bytes(b"partial")  # a build killed two hours ago: removed
    os.utime(killed, (killed.stat().st_atime, killed.stat().st_mtime - 7200))
    recent.write_bytes(b"partial")  # another process's build under way: kept
    code = "from kvlab.kernels.native import ffi; print(ffi.load())"
    env = {**os.environ, "KVLAB_NATIVE_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    assert done.stdout.decode().strip() == str(native.unavailable_reason()), done.stderr[-2000:]
    assert not killed.exists() and recent.exists()
    recent.unlink()
    library = cache / name
    assert library.stat().st_size > 1000
    built = library.stat().st_mtime_ns
    assert ffi.build(cache) == library and library.stat().st_mtime_ns == built
    assert sorted(p.name for p in cache.iterdir()) == [name]


def test_panels_of_another_shape_are_refused():
    """A reshape would take them silently (24 inputs fill 8-wide rows): the
    projection names the mismatch instead."""
    from kvlab.layers import Projection

    projection = Projection(64, name="proj")
    panels = to_panels(jnp.ones((8, 64)))
    with native.backend.scope():  # as a forward under attention_impl='native'
        with pytest.raises(ValueError, match=r"proj: panels \(2, 8, 32\) do not map 24 inputs"):
            projection.apply({"params": {"panels": panels}}, jnp.ones((3, 24)))
        assert projection.apply({"params": {"panels": panels}}, jnp.ones((3, 8))).shape == (3, 64)


# ---------------------------------------------------------------------------
# Attention over quantized payloads (quant_scores, quant_weighted_sum)


@st.composite
def quantized_tokens(draw):
    """(Storage, a QuantizedTensor of random tokens [slices, 1, S, H]) for any code
    format, axis, group, zero points, scale dtype and width the config admits."""
    from kvlab.cache import quant

    fmt = draw(st.sampled_from(["int", "fp8"]))
    bits = 8 if fmt == "fp8" else draw(st.sampled_from([8, 4, 2]))
    axis = draw(st.sampled_from(["token", "channel"]))
    group = draw(st.sampled_from([1, 2, 4, 8, 16, 24, 32]))
    per_byte = 8 // bits
    if draw(st.booleans()):  # whole 16-byte chunks per token: codes read straight (one row)
        width = 64 * draw(st.integers(1, 3))
        group = group if axis == "channel" or width % group == 0 else 16
    elif axis == "token":  # the group divides the width, which packs into whole bytes
        width = group * per_byte * draw(st.integers(1, max(1, 80 // (group * per_byte))))
    else:
        width = per_byte * draw(st.integers(1, 80 // per_byte))
    if axis == "token":
        length = draw(st.integers(1, 70))
    else:  # the group divides the length
        length = group * draw(st.integers(1, max(1, 70 // group)))
    spec = quant.Storage(
        bits=bits,
        format=fmt,
        axis=axis,
        group_size=group,
        symmetric=draw(st.booleans()),
        scale_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        dtype="float32",
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal((draw(st.integers(1, 4)), 1, length, width), np.float32)
    x[..., : length // 3, :] *= 8  # rows and channels of different ranges
    return quant.QuantizedTensor(*quant.quantize_tokens(jnp.asarray(x), spec), None, spec)


@needs_native
@given(
    tensor=quantized_tokens(),
    rows=st.one_of(st.just(1), st.integers(1, ffi.MAX_ROWS)),
    cut=st.floats(0, 1),
    per_page=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_quantized_products_are_those_of_the_dequantized_tokens(tensor, rows, cut, per_page, seed):
    """Scores and weighted sums over the packed codes equal float64 products with
    quant.dequantize_tokens' numbers, for every format, axis, group, scale dtype
    and tail, read straight from the codes (one row, whole 16-byte chunks) or
    through rows of dequantized tokens, from a row's own arrays or from page
    pools through block tables; tokens past the limit score 0 and their
    weights are never read (NaN there changes nothing). Scales are folded into
    sums as XLA's path folds them, so the bound is float32 rounding of the
    numbers' parts."""
    from kvlab.cache import quant

    rng = np.random.default_rng(seed)
    slices, _, length, width = tensor.reader().shape
    limit = round(cut * length)
    codes = native.codes(tensor)
    dense = np.asarray(tensor.dequantize(), np.float64)[:, :, :limit]
    # The size of each number's parts, level * scale and zero: a sum may cancel them.
    spec = tensor.spec
    levels = np.asarray(quant.levels(quant.unpack(tensor.payload, spec.bits), spec), np.float64)
    levels = np.abs(levels) + codes.offset  # the offset is a part too

    def per_number(x):
        x = np.abs(np.asarray(x, np.float64))
        return np.repeat(x, spec.group_size, axis=3 if spec.axis == "token" else 2)

    parts = levels * per_number(tensor.scale)
    if tensor.zero is not None:
        parts = parts + per_number(tensor.zero)
    parts = parts[:, :, :limit]
    q = rng.standard_normal((slices, 1, rows, width), np.float32)
    w = rng.random((slices, 1, rows, length), np.float32)
    w[..., limit:] = np.nan

    for read in (codes, in_pages(codes, per_page * (spec.group_size if codes.channel else 1), rng)):
        scores = np.asarray(jax.jit(lambda q, n, c=read: ffi.quant_scores(q, c, n))(q, limit))
        assert scores.shape == (slices, 1, rows, length)
        check_products(scores[..., :limit], "pqmh,pqsh->pqms", q, dense, parts)
        assert np.all(scores[..., limit:] == 0)
        out = jax.jit(lambda w, n, c=read: ffi.quant_weighted_sum(w, c, n))(w, limit)
        assert out.shape == (slices, 1, rows, width)
        check_products(out, "pqms,pqsh->pqmh", w[..., :limit], dense, parts)


def in_pages(codes, per_page: int, rng):
    """The same codes as page pools of `per_page` tokens in shuffled order with a
    spare page, through block tables with one entry more than the rows need, -1
    (unallocated; read as page 0, masked)."""
    batch, heads, length, _ = codes.shape
    count = -(-length // per_page)
    order = rng.permutation(batch * count + 1)
    tables = np.full((batch, count + 1), -1, np.int32)
    tables[:, :count] = order[: batch * count].reshape(batch, count)

    def pool(x):
        x = np.asarray(x)
        per = per_page * x.shape[2] // length  # rows of x per page (scale rows: / group)
        x = np.pad(x, ((0, 0), (0, 0), (0, count * per - x.shape[2]), (0, 0)))
        pages = np.zeros((heads, batch * count + 1, per, x.shape[3]), x.dtype)
        for row in range(batch):
            for j in range(count):
                pages[:, tables[row, j]] = x[row, :, j * per : (j + 1) * per]
        return jnp.asarray(pages)

    zero = None if codes.zero is None else pool(codes.zero)
    return dataclasses.replace(
        codes,
        payload=pool(codes.payload),
        scale=pool(codes.scale),
        zero=zero,
        pages=jnp.asarray(tables),
        length=length,
    )


# ---------------------------------------------------------------------------
# The backend in a model


@pytest.mark.parametrize(
    "config, cache, stream_tokens",
    [
        ("gqa.py:tiny", dict(), 10**9),
        ("gqa.py:tiny", dict(window=16), 10**9),  # a ring of 16 slots, masked as a band
        ("mla.py:tiny", dict(), 10**9),
        # 16-bit arrays, widened in registers by the kernels (streamed on XLA's path)
        ("gqa.py:tiny", dict(dtype="bfloat16"), 8),
        ("mla.py:tiny", dict(dtype="bfloat16"), 8),  # one latent, read as keys and values
        ("gqa.py:tiny", dict(dtype="float16", v_bits=4, group_size=4), 8),  # beside codes
        # page pools, read through the block tables by the kernels
        ("gqa.py:tiny", dict(kind="paged", page_size=8), 8),
        ("gqa.py:tiny", dict(kind="paged", page_size=8, dtype="bfloat16", v_bits=4), 8),
        # quantized payloads, read in place by the kernels (streamed on XLA's path)
        ("gqa.py:tiny", dict(k_bits=4, v_bits=2, group_size=4), 8),  # KIVI, zero points
        ("gqa.py:tiny", dict(k_bits=8, v_bits=8, k_axis="token", symmetric=True), 8),
        ("gqa.py:tiny", dict(k_bits=8, v_bits=4, k_format="fp8", scale_dtype="float16"), 8),
        ("gqa.py:tiny", dict(k_bits=2, v_bits=4, residual=8, group_size=4, window=24), 8),
        ("mla.py:tiny", dict(latent_bits=4, rope_bits=8, group_size=4), 8),
        ("gqa.py:tiny", dict(kind="paged", k_bits=4, v_bits=2, group_size=4, page_size=8), 8),
        ("gqa.py:tiny", dict(kind="paged", k_bits=8, v_bits=8, k_axis="token", page_size=8), 8),
    ],
)
def test_native_kernels_give_the_xla_logits(config, cache, stream_tokens, monkeypatch):
    """model.attention_impl='native' (the kernels' products for float32 arrays,
    here for any cache size, 16-bit arrays and quantized payloads) decodes dense,
    16-bit, windowed, latent and quantized caches (rows' own or paged) to the
    XLA path's logits;
    where the kernels are unavailable it is the XLA path."""
    native_attention_at_any_size(monkeypatch)
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}")
    if "window" in cache:
        cfg.model.sliding_window = cache.pop("window")
    cfg.cache.update(cache)
    cfg.model.num_layers = 1  # each layer reads its cache alike; compiling is the time
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 40), np.int32)
    xla = decode_logits(cfg, params, tokens, stream_tokens)
    cfg.model.attention_impl = "native"
    got = decode_logits(cfg, params, tokens, stream_tokens)
    # float32 sums in another order (whole, not in slices): within 1e-5 plus 1e-4 of a logit
    np.testing.assert_allclose(got, xla, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------
# Weights in 32-column panels (panel_projections)


def _kernels(params):
    """{path: (kernel, number of input axes)} of every projection panel_projections converts."""
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [k.key for k in path]
        if names[-1] == "kernel" and names[-2] != "router" and leaf.shape[-1] % 32 == 0:
            found["/".join(names[:-1])] = (leaf, 2 if names[-2] == "out" else 1)
    return found


@settings(max_examples=4)  # each example compiles two forwards and a decode step
@given(
    cfg=small_model_configs(),
    option=st.sampled_from(["plain", "experts", "wide"]),
    seed=st.integers(0, 3),
)
def test_panel_projections_compute_the_same_model(cfg, option, seed):
    if option == "experts":  # 32 experts: the router could be panelled, and is not
        cfg.model.moe.update(
            num_experts=32, expert_dim=8, num_shared_experts=1, experts_per_token=2
        )
    elif option == "wide":  # every projection and the vocabulary a multiple of 32 wide
        cfg.model.update(embed_dim=32, mlp_dim=32, vocab_size=64)
        if cfg.model.attention == "gqa":
            cfg.model.head_dim = 32
    kvlab.config.validate_model_config(cfg.model)
    model = kvlab.Transformer(cfg.model)
    params = kvlab.fuse_projections(
        _perturbed(kvlab.init_params(cfg.model, jax.random.key(seed)), seed)
    )
    panels = native.panel_projections(params)

    # Each kernel [K..., N...] with N % 32 == 0 became panels [N / 32, K, 32], where
    # panels[b, k, j] is the kernel flattened to [K, N] at [k, 32 b + j].
    converted = _kernels(params)
    flat = {
        "/".join(k.key for k in path[:-1]): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(panels)
        if path[-1].key == "panels" and path[0].key != "embed"  # the table: below
    }
    assert flat.keys() == converted.keys()
    if option == "wide":
        assert any(name.endswith("mlp/down") for name in flat)
    for name, (kernel, inputs) in converted.items():
        matrix = np.asarray(kernel).reshape(int(np.prod(kernel.shape[:inputs])), -1)
        width = matrix.shape[1]
        np.testing.assert_array_equal(
            flat[name], matrix.reshape(-1, width // 32, 32).swapaxes(0, 1)
        )
    if option == "experts":
        assert "kernel" in panels["block_0"]["mlp"]["router"]
    table = params["embed"]["embedding"]
    if cfg.model.tie_embeddings and cfg.model.vocab_size % 32 == 0:  # one table, both uses
        assert set(panels["embed"]) == {"panels"}
        v = seed % cfg.model.vocab_size
        np.testing.assert_array_equal(panels["embed"]["panels"][v // 32, :, v % 32], table[v])
    else:
        np.testing.assert_array_equal(panels["embed"]["embedding"], table)
    assert kvlab.tree_bytes(panels) == kvlab.tree_bytes(params)
    assert native.panel_projections(panels).keys() == panels.keys()  # converted once

    # Under attention_impl='native': a prompt (18 rows), then chunks of 8 rows and a
    # decode step of 2 (the kernels throughout where they run, attention's too for
    # the chunks and the step) through a cache with unwritten slots.
    tokens = random_tokens(cfg, (2, 9), seed)
    want, _ = jax.jit(model.apply)({"params": params}, tokens)
    cfg.model.attention_impl = "native"
    native_apply = jax.jit(kvlab.Transformer(cfg.model).apply)
    got, _ = native_apply({"params": panels}, tokens)
    assert max_diff(got, want) <= TOLERANCE
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=16)
    with pytest.MonkeyPatch.context() as patch:  # attention's kernels for any cache size
        native_attention_at_any_size(patch)
        stepwise, _ = run_in_chunks(native_apply, panels, cache, tokens, [4, 1, 4])
    assert max_diff(stepwise, want) <= TOLERANCE


def test_a_panel_tree_is_refused_where_it_cannot_go():
    cfg = tiny_config(head_dim=32)  # query, key and value 32 wide: panelled
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    panels = native.panel_projections(params)
    fused = native.panel_projections(kvlab.fuse_projections(params))
    for convert, tree in ((kvlab.fuse_projections, panels), (kvlab.unfuse_projections, fused)):
        with pytest.raises(ValueError, match=r"projections hold a kernel .*, not \['panels'\]"):
            convert(tree)
    with pytest.raises(ValueError, match=r"params has no parameter block_0/attention/key/kernel"):
        kvlab.save_hf(cfg, panels, "/nonexistent/never-written")


@needs_native
def test_criticalkv_weighs_values_alike_through_projections_stored_as_panels():
    """CriticalKV reads each head's output projection: from panels (the backend's
    layout) it projects a step's few new values head by head, or rebuilds the
    kernel for many (a 20-token prefill, above the head width of 16), and weighs
    them as from the kernel, so the same tokens stay with the same weights."""
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.cache.evict.update(method="criticalkv:knorm", budget=8, recent=0, interval=2)
    params = kvlab.init_params(cfg.model, jax.random.key(1))
    tokens = random_tokens(cfg, (2, 24), 4)
    kept = []
    for impl, weights in (("xla", params), ("native", native.panel_projections(params))):
        cfg.model.attention_impl = impl
        cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=24)
        model = kvlab.Transformer(cfg.model)
        for start, end in ((0, 20), (20, 21), (21, 22), (22, 23), (23, 24)):
            _, cache = model.apply({"params": weights}, tokens[:, start:end], cache=cache)
            kept.append([(layer.positions, layer.weights) for layer in cache.layers])
    steps = len(kept) // 2
    for xla, panelled in zip(kept[:steps], kept[steps:], strict=True):
        for (positions, weights), (same_positions, same_weights) in zip(xla, panelled, strict=True):
            np.testing.assert_array_equal(positions, same_positions)
            np.testing.assert_allclose(weights, same_weights, rtol=1e-5)
