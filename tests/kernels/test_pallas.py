"""Pallas stored-attention kernels (interpret mode): equal to a jnp reference and to core.attend.

Every storage kind is built the way the caches hold it (quantize_tokens codes,
page pools reached through shuffled block tables with -1 tails) and read back
by the reference through kvlab's own gather_pages and dequantize_tokens. Both
kernels, Triton's (CUDA) and Mosaic's (TPU), run in the Pallas interpreter;
one test lowers them to Triton IR for a CUDA target, another to Mosaic for a
TPU (nothing here runs on a GPU or a TPU).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
import kvlab.kernels.pallas as pallas_backend
from kvlab.attention.core import MASKED, attend
from kvlab.cache.paged import gather_pages
from kvlab.cache.quant import QuantizedTensor, Storage, dequantize_tokens, quantize_tokens
from kvlab.kernels.pallas import mosaic, triton
from kvlab.kernels.pallas.plan import Stored, merge_partials
from kvlab.kernels.pallas.triton import stored_attention
from tests.attention.test_stream import decode_logits
from tests.helpers import ROOT

TOLERANCE = 1e-5  # relative to the largest |value| of what is compared
# These programs are tiny and each compiles once: XLA's lowest optimization level halves
# the compile time that dominates the tests.
compiled = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


# Each kernel and the options only it takes: Triton's blocks and splits are free;
# Mosaic's block is a page where a pool is read, and it does not split rows.
KERNELS = {"triton": triton, "mosaic": mosaic}
OWN_OPTIONS = {"triton": ("block_tokens", "num_splits"), "mosaic": ()}


def interpreted(queries, keys, values, lengths, kernel="triton", **options):
    """A kernel's stored_attention in interpret mode inside a jitted program (as a
    model calls it); options the kernel does not take are dropped."""
    keys = keys if isinstance(keys, tuple) else (keys,)
    shared = next((j for j, k in enumerate(keys) if k is values), None)
    dropped = {"block_tokens", "num_splits"} - set(OWN_OPTIONS[kernel])
    options = {k: v for k, v in options.items() if k not in dropped}

    def run(q, k, v, n):
        v = v if shared is None else k[shared]
        return KERNELS[kernel].stored_attention(q, k, v, n, **options)

    return compiled(run)(queries, keys, values, lengths)


def storage(bits, fmt="int", axis="token", group=4, symmetric=False, dtype="float32"):
    return Storage(bits, fmt, axis, group, symmetric, "bfloat16", dtype)


# ---------------------------------------------------------------------------
# Building stored tensors as the caches hold them


@functools.partial(compiled, static_argnums=(1, 2))
def encode(x, spec, dtype):
    """[B', K, R, W] numbers as stored: (data, scale, zero) arrays; 16-bit when spec is None."""
    if spec is None:
        return x.astype(dtype), None, None
    return quantize_tokens(x, spec)


def page_tables(rng, lengths, pages_per_row, page_size):
    """Block tables over a pool of every row's pages plus one spare, in shuffled order;
    a row holds no page (-1) past the pages its length needs. Returns (tables, pool size)."""
    num_pages = len(lengths) * pages_per_row + 1
    order = rng.permutation(num_pages)
    tables = order[: len(lengths) * pages_per_row].reshape(len(lengths), pages_per_row)
    held = np.arange(pages_per_row)[None, :] < -(-np.asarray(lengths)[:, None] // page_size)
    return jnp.asarray(np.where(held, tables, -1), jnp.int32), num_pages


def make_stored(rng, spec, shape, dtype="float32", paged=None):
    """A Stored of random numbers [B, K, S, W] as a cache holds them: dense rows, or
    (paged=(tables, P, L)) a pool of P pages whose contents the tables point into."""
    batch, heads, tokens, width = shape
    if paged is None:
        data, scale, zero = encode(rng.standard_normal(shape, np.float32), spec, dtype)
        if spec is None:
            return Stored(data)
        return Stored.of(QuantizedTensor(data, scale, zero, None, spec))
    tables, num_pages, page_size = paged
    noise = rng.standard_normal((1, heads, num_pages * page_size, width), np.float32)
    # Quantized as one long row: pages hold whole channel groups (page_size % group_size == 0).
    arrays = encode(noise, spec, dtype)
    pools = [None if a is None else a.reshape(heads, num_pages, -1, a.shape[-1]) for a in arrays]
    return Stored(*pools, spec, tables)


def dense_view(stored: Stored, tokens: int):
    """What core.attend reads for a Stored: the 16-bit rows, or a PayloadReader of the
    quantized rows (pools gathered with gather_pages), and the float32 numbers."""
    arrays = [stored.data, stored.scale, stored.zero]
    if stored.pages is not None:
        scale_rows = tokens
        if stored.spec is not None and stored.spec.axis == "channel":
            scale_rows = tokens // stored.spec.group_size
        sizes = [tokens, scale_rows, scale_rows]
        arrays = [
            None if a is None else gather_pages(a, stored.pages, n)
            for a, n in zip(arrays, sizes, strict=True)
        ]
    data, scale, zero = arrays
    if stored.spec is None:
        return data, data
    tensor = QuantizedTensor(data, scale, zero, None, stored.spec)
    return tensor.reader(), dequantize_tokens(data, scale, zero, stored.spec)


def reference_partial(queries, keys, values, mask, scale):
    """(acc, peak, total) over dense keys [B, K, S, H_j] and values, mask broadcast to
    [B, K, M, S]; 16-bit arrays take attend's casts, float32 ones are exact."""
    scores = sum(
        jnp.einsum("BKMH,BKSH->BKMS", q.astype(k.dtype), k, preferred_element_type=jnp.float32)
        for q, k in zip(queries, keys, strict=True)
    )
    scores = jnp.where(mask, scores * scale, MASKED)
    peak = jnp.max(scores, axis=-1, keepdims=True, initial=MASKED)
    weights = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    acc = jnp.einsum(
        "BKMS,BKSH->BKMH", weights.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    return acc, peak, weights.sum(axis=-1, keepdims=True)


def reference(queries, keys, values, lengths, scale, tokens):
    """The reference over Stored tensors, dequantized (quant.dequantize_tokens) and
    gathered (paged.gather_pages) first."""
    dense_keys = [dense_view(k, tokens)[1] for k in keys]
    mask = (jnp.arange(tokens) < lengths[:, None])[:, None, None, :]
    return reference_partial(queries, dense_keys, dense_view(values, tokens)[1], mask, scale)


stored_reference = compiled(reference, static_argnums=(4, 5))


def assert_close(actual, expected, tolerance=TOLERANCE):
    """Equal within `tolerance` of the largest magnitude; MASKED (nothing seen) exactly."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    empty = expected == MASKED
    np.testing.assert_array_equal(actual[empty], expected[empty])
    scale = max(1.0, np.abs(expected[~empty]).max(initial=0.0))
    np.testing.assert_allclose(
        actual[~empty], expected[~empty], rtol=tolerance, atol=tolerance * scale
    )


def assert_partials_close(actual, expected, tolerance=TOLERANCE):
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == jnp.float32
        assert_close(a, e, tolerance)


def fold(q, heads):
    """[B, T, N, H] -> [B, K, T x G, H], as core.attend folds queries."""
    return rearrange(q, "B T (K G) H -> B K (T G) H", K=heads)


def unfold(x, length):
    return rearrange(x, "B K (T G) H -> B T (K G) H", T=length)


# ---------------------------------------------------------------------------
# Every storage kind against the reference and against core.attend

FORMATS = [
    pytest.param(16, "int", False, "float32", id="16bit-f32"),
    # bfloat16 probabilities are rounded against each block's running max, attend's
    # against the row's: the same roundings only where one block holds the row.
    pytest.param(16, "int", False, "bfloat16", id="16bit-bf16-one-block"),
    *[
        pytest.param(b, "int", s, "float32", id=f"int{b}-{'sym' if s else 'asym'}")
        for b in (8, 4, 2)
        for s in (False, True)
    ],
    pytest.param(8, "fp8", False, "float32", id="fp8"),
]
BATCH, HEADS, LENGTH, GROUPS, TOKENS, PAGE = 3, 2, 2, 2, 40, 8
LENGTHS = [0, TOKENS, 23]  # empty, full and ragged rows
KEY_WIDTHS, VALUE_WIDTH = (16, 8, 8), 16


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("bits", "fmt", "symmetric", "dtype"), FORMATS)
def test_every_storage_equals_reference_and_attend(bits, fmt, symmetric, dtype, kernel):
    """One format in its four (axis, layout) combinations: keys in three parts (channel
    axis in pages, token axis in rows, token axis in pages), values on the channel axis
    in rows; GQA groups of 2, 2 queries per row, rows of length 0, full and ragged with
    shuffled pages and -1 tails; Triton in 3 blocks of 16 tokens in 2 splits, Mosaic a
    page (8 tokens) per step."""
    rng = np.random.default_rng(bits + symmetric)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    tables, num_pages = page_tables(rng, LENGTHS, TOKENS // PAGE, PAGE)

    def stored(axis, paged, width):
        spec = None if bits == 16 else storage(bits, fmt, axis, symmetric=symmetric)
        pages = (tables, num_pages, PAGE) if paged else None
        return make_stored(rng, spec, (BATCH, HEADS, TOKENS, width), dtype, pages)

    keys = (stored("channel", True, 16), stored("token", False, 8), stored("token", True, 8))
    values = stored("channel", False, VALUE_WIDTH)
    q = tuple(
        jnp.asarray(rng.standard_normal((BATCH, LENGTH, HEADS * GROUPS, w)), jnp.float32)
        for w in KEY_WIDTHS
    )
    scale = sum(KEY_WIDTHS) ** -0.5
    one_block = dtype == "bfloat16"
    got = interpreted(
        tuple(fold(part, HEADS) for part in q),
        keys,
        values,
        lengths,
        kernel,
        scale=scale,
        block_tokens=TOKENS if one_block else 16,
        num_splits=1 if one_block else 2,
        interpret=True,
    )
    fresh_k = tuple(
        jnp.asarray(rng.standard_normal((BATCH, HEADS, LENGTH, w)), dtype) for w in KEY_WIDTHS
    )
    fresh_v = jnp.asarray(rng.standard_normal((BATCH, HEADS, LENGTH, VALUE_WIDTH)), dtype)
    expected, fresh, through_attend = xla_path(q, keys, values, lengths, fresh_k, fresh_v, scale)
    # Mosaic reads pages of 8 even for bfloat16: probabilities rounded against each
    # page's running max, within bfloat16's error of the row's.
    assert_partials_close(got, expected, 1e-2 if one_block and kernel == "mosaic" else TOLERANCE)
    # As one block of the XLA path: the stored partial merged with the step's own
    # tokens' partial equals core.attend over both blocks (rows of length 0 included).
    acc, _, total = merge_partials(got, fresh)
    tolerance = TOLERANCE if dtype == "float32" else 1e-2
    assert_close(unfold(acc / total, LENGTH), through_attend, tolerance)


@functools.partial(compiled, static_argnums=(6,))
def xla_path(q, keys, values, lengths, fresh_k, fresh_v, scale):
    """For queries q (parts [B, T, N, H_j]): the reference partial over the stored
    tokens, the fresh tokens' partial (causal among the T), and core.attend (the XLA
    path) over both, the stored tokens read as the caches read them."""
    batch, length, num_heads = q[0].shape[:3]
    heads = fresh_v.shape[1]
    queries = tuple(fold(part, heads) for part in q)
    stored = reference(queries, keys, values, lengths, scale, TOKENS)
    causal = jnp.tril(jnp.ones((length, length), bool))
    folded_causal = jnp.repeat(causal, num_heads // heads, axis=0)[None, None]  # [1, 1, M, T]
    fresh = reference_partial(queries, fresh_k, fresh_v, folded_causal, scale)
    stored_mask = (jnp.arange(TOKENS) < lengths[:, None])[:, None, :]
    blocks = [
        (tuple(dense_view(k, TOKENS)[0] for k in keys), dense_view(values, TOKENS)[0], stored_mask),
        (fresh_k, fresh_v, jnp.broadcast_to(causal, (batch, length, length))),
    ]
    return stored, fresh, attend(q, blocks, scale=scale)


# ---------------------------------------------------------------------------
# Latent attention: two key parts of different widths, the latent also the value

LATENT, ROPE = 256, 32


@pytest.mark.parametrize("kernel", KERNELS)
def test_absorbed_latent_attention_equals_reference_reading_the_latent_once(kernel):
    """MLA absorbed: q = (latent part [B, 1, M, 256], RoPE part [B, 1, M, 32]); the
    values are the latent Stored itself, so the kernel reads it once."""
    rng = np.random.default_rng(7)
    batch, heads, tokens, queries_per_head = 2, 1, 48, 8  # 8 query heads, one decode token
    lengths_list = [48, 5]
    lengths = jnp.asarray(lengths_list, jnp.int32)
    tables, num_pages = page_tables(rng, lengths_list, tokens // 16, 16)
    pages = (tables, num_pages, 16)
    latent_spec = storage(4, axis="channel", group=8)
    latent = make_stored(rng, latent_spec, (batch, heads, tokens, LATENT), paged=pages)
    rope = make_stored(rng, None, (batch, heads, tokens, ROPE), paged=pages)
    queries = tuple(
        jnp.asarray(rng.standard_normal((batch, heads, queries_per_head, w)), jnp.float32)
        for w in (LATENT, ROPE)
    )
    scale = (LATENT + ROPE) ** -0.5
    got = interpreted(
        queries,
        (latent, rope),
        latent,
        lengths,
        kernel,
        scale=scale,
        block_tokens=16,
        interpret=True,
    )
    assert got[0].shape == (batch, heads, queries_per_head, LATENT)
    expected = stored_reference(queries, (latent, rope), latent, lengths, scale, tokens)
    assert_partials_close(got, expected)

    # The kernel takes the latent's codes and scales once, not again as the values.
    def kernel_inputs(shared: bool):
        def run(q, k, n):
            values = k[0] if shared else Stored(*[getattr(k[0], f) for f in FIELDS])
            return KERNELS[kernel].stored_attention(q, k, values, n, scale=scale, interpret=True)

        jaxpr = jax.make_jaxpr(run)(queries, (latent, rope), lengths).jaxpr
        while not any(e.primitive.name == "pallas_call" for e in jaxpr.eqns):  # inside jit
            jaxpr = next(e.params["jaxpr"] for e in jaxpr.eqns if "jaxpr" in e.params).jaxpr
        return len(next(e for e in jaxpr.eqns if e.primitive.name == "pallas_call").invars)

    assert kernel_inputs(shared=True) == kernel_inputs(shared=False) - 3  # codes, scales, zeros


FIELDS = ("data", "scale", "zero", "spec", "pages")


# ---------------------------------------------------------------------------
# Random shapes

specs = (
    st.none()
    | st.builds(
        storage,
        bits=st.sampled_from([8, 4, 2]),
        axis=st.sampled_from(["token", "channel"]),
        group=st.sampled_from([2, 4]),
        symmetric=st.booleans(),
    )
    | st.builds(
        storage, bits=st.just(8), fmt=st.just("fp8"), axis=st.sampled_from(["token", "channel"])
    )
)


@settings(max_examples=6)  # each example compiles (and interprets) its own kernel
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    length=st.integers(1, 2),
    groups=st.integers(1, 3),
    widths=st.tuples(st.sampled_from([8, 16]), st.sampled_from([4, 8, 16])),
    key_spec=specs,
    value_spec=specs,
    page_size=st.sampled_from([0, 4, 8]),  # 0: dense
    pages_per_row=st.integers(1, 4),
    rows=st.integers(1, 24),  # dense
    block_units=st.integers(1, 3),
    num_splits=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(list(KERNELS)),
)
def test_random_shapes_equal_reference(
    batch,
    heads,
    length,
    groups,
    widths,
    key_spec,
    value_spec,
    page_size,
    pages_per_row,
    rows,
    block_units,
    num_splits,
    seed,
    kernel,
):
    rng = np.random.default_rng(seed)
    key_width, value_width = widths
    tensors = [(key_spec, key_width), (value_spec, value_width)]
    # Dense rows and pages must hold whole channel groups.
    unit = math.lcm(*[s.group_size for s, _ in tensors if s and s.axis == "channel"], 1)
    tokens = pages_per_row * page_size if page_size else unit * -(-rows // unit)
    lengths_list = list(rng.integers(0, tokens + 1, batch))
    lengths_list[0] = rng.choice([0, tokens])
    lengths = jnp.asarray(lengths_list, jnp.int32)
    pages = None
    if page_size:
        tables, num_pages = page_tables(rng, lengths_list, pages_per_row, page_size)
        pages = (tables, num_pages, page_size)
    keys, values = (make_stored(rng, s, (batch, heads, tokens, w), paged=pages) for s, w in tensors)
    queries = jnp.asarray(rng.standard_normal((batch, heads, length * groups, key_width)))
    block_tokens = math.lcm(page_size or 1, unit) * block_units
    got = interpreted(
        queries,
        keys,
        values,
        lengths,
        kernel,
        scale=0.3,
        block_tokens=block_tokens,
        num_splits=num_splits,
        interpret=True,
    )
    expected = stored_reference((queries,), (keys,), values, lengths, 0.3, tokens)
    assert_partials_close(got, expected)


def test_bfloat16_products_err_like_a_bfloat16_cache():
    """compute_dtype='bfloat16' rounds tiles, queries and probabilities (tensor cores):
    within bfloat16's error of the reference, and not the float32 numbers."""
    rng = np.random.default_rng(5)
    lengths_list = [37, 12]
    tables, num_pages = page_tables(rng, lengths_list, 5, 8)
    pages = (tables, num_pages, 8)
    keys = make_stored(rng, storage(4, axis="channel"), (2, 2, 40, 16), paged=pages)
    values = make_stored(rng, storage(4), (2, 2, 40, 16))
    lengths = jnp.asarray(lengths_list, jnp.int32)
    queries = jnp.asarray(rng.standard_normal((2, 2, 4, 16)), jnp.float32)
    options = dict(scale=0.25, block_tokens=16, interpret=True, compute_dtype="bfloat16")
    got = interpreted(queries, keys, values, lengths, **options)
    expected = stored_reference((queries,), (keys,), values, lengths, 0.25, 40)
    assert_partials_close(got, expected, tolerance=2e-2)
    assert np.abs(np.asarray(got[0]) - np.asarray(expected[0])).max() > 1e-4


# ---------------------------------------------------------------------------
# What lies past a row's length


@pytest.mark.parametrize("kernel", KERNELS)
def test_slots_past_the_length_are_never_read_into_the_result(kernel):
    """NaN in every slot past a row's length (a reused page, unwritten codes) leaves
    the partial what it is over the visible tokens."""
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 1, 24, 16)).astype(np.float32)
    values = rng.standard_normal((2, 1, 24, 16)).astype(np.float32)
    lengths = jnp.asarray([10, 17], jnp.int32)
    past = np.arange(24)[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
    poisoned = [Stored(jnp.asarray(np.where(past, np.nan, x))) for x in (keys, values)]
    queries = jnp.asarray(rng.standard_normal((2, 1, 3, 16)), jnp.float32)
    got = interpreted(
        queries, poisoned[0], poisoned[1], lengths, kernel, scale=0.25, interpret=True
    )
    clean = [Stored(jnp.asarray(np.where(past, 0.0, x))) for x in (keys, values)]
    expected = stored_reference((queries,), (clean[0],), clean[1], lengths, 0.25, 24)
    assert all(np.isfinite(np.asarray(x)).all() for x in got)
    assert_partials_close(got, expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nothing_stored_gives_the_empty_partial(kernel):
    queries = jnp.ones((2, 1, 3, 8))
    empty = Stored(jnp.zeros((2, 1, 0, 8)))
    lengths = jnp.zeros(2, jnp.int32)
    acc, peak, total = KERNELS[kernel].stored_attention(queries, empty, empty, lengths, scale=1.0)
    assert acc.shape == (2, 1, 3, 8) and not acc.any() and not total.any()
    assert (peak == MASKED).all()


# ---------------------------------------------------------------------------
# The Triton lowering (on CPU: no GPU compiles or runs it here)


def lowering_cases():
    """Paged int4 channel keys with int2 token values; an absorbed latent (paged fp8
    latent shared as the values, bf16 RoPE key) with bfloat16 products; dense int8
    keys with narrow bf16 values: [(queries, keys, values, compute dtype)], lengths."""
    rng = np.random.default_rng(0)
    tables, num_pages = page_tables(rng, [40, 64], 4, 16)
    pages = (tables, num_pages, 16)
    latent = make_stored(rng, storage(8, "fp8", group=32), (2, 1, 64, 256), paged=pages)
    cases = [
        (
            (jnp.zeros((2, 2, 4, 64)),),
            (make_stored(rng, storage(4, axis="channel", group=16), (2, 2, 64, 64), paged=pages),),
            make_stored(rng, storage(2, group=16), (2, 2, 64, 64), paged=pages),
            "float32",
        ),
        (
            (jnp.zeros((2, 1, 16, 256)), jnp.zeros((2, 1, 16, 32))),
            (latent, make_stored(rng, None, (2, 1, 64, 32), "bfloat16", paged=pages)),
            latent,
            "bfloat16",
        ),
        (
            (jnp.zeros((2, 2, 1, 64), jnp.bfloat16),),
            (make_stored(rng, storage(8, symmetric=True, group=32), (2, 2, 64, 64)),),
            make_stored(rng, None, (2, 2, 64, 8), "bfloat16"),  # Hv < 16: no tl.dot
            "float32",
        ),
    ]
    return cases, jnp.asarray([40, 64], jnp.int32)


def test_kernels_lower_to_triton_for_a_cuda_target(monkeypatch):
    """Each of lowering_cases lowers to Triton IR that verifies, with num_warps and
    num_stages from triton.TUNING (4 and 2 for heads of 64, 8 and 2 for a bfloat16
    latent of 256)."""
    verified = []
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:  # jax moved its internals: check the lowering without verifying
        registration = None
    if registration is not None:
        lower_module = registration.lowering.lower_jaxpr_to_triton_module

        def verifying(*args, **kwargs):
            result = lower_module(*args, **kwargs)
            verified.append(result.module.operation.verify())
            return result

        monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verifying)
    cases, lengths = lowering_cases()
    for queries, keys, values, compute in cases:
        shared = values is keys[0]

        def run(q, k, v, n, shared=shared, compute=compute):
            v = k[0] if shared else v
            options = dict(scale=0.1, block_tokens=32, num_splits=2, compute_dtype=compute)
            return stored_attention(q, k, v, n, **options)

        exported = jax.export.export(
            jax.jit(run),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(queries, keys, values, lengths)
        text = exported.mlir_module()
        assert "xla.gpu.triton" in text
        # num_warps and num_stages from the table, by the widest head and the dtype
        _, warps, stages = triton.tuning(max(q.shape[-1] for q in queries), compute)
        assert f"num_warps = {warps} : i32" in text and f"num_stages = {stages} : i32" in text
    assert verified == [True] * len(cases) or registration is None


def test_kernels_lower_to_mosaic_for_a_tpu_target():
    """Each of lowering_cases lowers to one Mosaic kernel (tpu_custom_call) for a
    TPU v5e, reading pools a page per step and dense rows in one block of 64."""
    cases, lengths = lowering_cases()
    for queries, keys, values, compute in cases:
        shared = values is keys[0]

        def run(q, k, v, n, shared=shared, compute=compute):
            v = k[0] if shared else v
            return mosaic.stored_attention(q, k, v, n, scale=0.1, compute_dtype=compute)

        with kvlab.backends.lowering_for("tpu"):
            exported = jax.export.export(jax.jit(run), platforms=["tpu"])(
                queries, keys, values, lengths
            )
        assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 1


def test_mosaic_refuses_pools_of_two_page_sizes_and_blocks_that_do_not_divide():
    """A Mosaic step reads one page of every pool, and dense rows in blocks that
    divide them: other layouts are refused naming the fix (the backend then takes
    the reference path: `takes`)."""
    pool = Stored(jnp.zeros((1, 5, 8, 16)), pages=jnp.zeros((2, 3), jnp.int32))
    other = Stored(jnp.zeros((1, 7, 4, 16)), pages=jnp.zeros((2, 6), jnp.int32))
    lengths = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match=r"page sizes=\[4, 8\] differ"):
        mosaic.stored_attention(GOOD_QUERIES, pool, other, lengths, scale=1.0)
    assert not mosaic.takes(GOOD_QUERIES, pool, other, lengths, scale=1.0, interpret=True)
    assert triton.takes(GOOD_QUERIES, pool, other, lengths, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="block_tokens=16 is not the page size 8"):
        mosaic.stored_attention(GOOD_QUERIES, pool, pool, lengths, scale=1.0, block_tokens=16)
    with pytest.raises(ValueError, match="block_tokens=16 does not divide the 24 slots"):
        mosaic.stored_attention(GOOD_QUERIES, GOOD, GOOD, lengths, scale=1.0, block_tokens=16)
    for bad in (0, -8, True, 8.0):
        with pytest.raises(ValueError, match=f"block_tokens={bad} is not a positive int"):
            mosaic.stored_attention(GOOD_QUERIES, GOOD, GOOD, lengths, scale=1.0, block_tokens=bad)


# ---------------------------------------------------------------------------
# Arguments are refused before anything is traced

GOOD_QUERIES = jnp.zeros((2, 1, 3, 16))
GOOD = Stored(jnp.zeros((2, 1, 24, 16)))
CODES = quantize_tokens(jnp.zeros((2, 1, 24, 16)), storage(4, axis="channel"))
POOL = Stored(jnp.zeros((1, 5, 8, 16)), pages=jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=jnp.zeros((2, 1, 3))), r"q\[0\]=float32\(2, 1, 3\) is not a float \[B, K, M, H\]"),
        (dict(q=jnp.zeros((2, 1, 3, 8))), r"q\[0\].shape=\(2, 1, 3, 8\) has width 8"),
        (dict(keys=(GOOD, GOOD)), r"keys=2 parts do not match the 1 query parts"),
        (dict(keys=Stored(jnp.zeros((2, 2, 24, 16)))), r"keys\[0\].data.shape=\(2, 2, 24, 16\)"),
        (dict(keys=Stored(CODES[0])), r"keys\[0\].data.dtype=uint8 is not a float type"),
        (
            dict(keys=Stored(CODES[0], CODES[1], None, storage(4, axis="channel"))),
            r"keys\[0\].zero.shape=None is not \(2, 1, 6, 16\)",
        ),
        (
            dict(keys=Stored(CODES[0], CODES[1][:, :, :3], CODES[2], storage(4, axis="channel"))),
            r"keys\[0\].scale.shape=\(2, 1, 3, 16\) is not \(2, 1, 6, 16\)",
        ),
        (dict(values=Stored(jnp.zeros((2, 1, 16, 16)))), r"token capacities \[24, 16\] differ"),
        (dict(lengths=jnp.zeros(3, jnp.int32)), r"lengths=int32\(3,\) is not an int array"),
        (dict(lengths=jnp.zeros(2)), r"lengths=float32\(2,\) is not an int array"),
        (dict(scale=jnp.float32(1.0)), r"scale=1.0 is not a real number"),
        (dict(keys=POOL, values=POOL, block_tokens=12), r"block_tokens=12 is not a multiple of 8"),
        (dict(block_tokens=0), r"block_tokens=0 is not a positive int"),
        (dict(num_splits=0), r"num_splits=0 is not a positive int"),
        (
            dict(keys=Stored(POOL.data, pages=jnp.zeros((3, 3), jnp.int32))),
            r"keys\[0\].pages.shape=\(3, 3\) is not \[B, n\] with B=2",
        ),
        # The Triton backend needs power-of-two tiles of at least 16 tokens.
        (dict(block_tokens=8, interpret=False), r"block_tokens=8 is not a power of two >= 16"),
        (
            dict(
                q=jnp.zeros((2, 1, 3, 12)),
                keys=Stored(jnp.zeros((2, 1, 24, 12))),
                interpret=False,
            ),
            r"gives a width of 12, not a power of two",
        ),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(change, message):
    arguments = dict(q=GOOD_QUERIES, keys=GOOD, values=GOOD, lengths=jnp.zeros(2, jnp.int32))
    arguments |= dict(scale=1.0, block_tokens=None, interpret=True) | change
    q, keys, values, lengths = (arguments.pop(n) for n in ("q", "keys", "values", "lengths"))
    with pytest.raises(ValueError, match=message):
        stored_attention(q, keys, values, lengths, **arguments)


@pytest.mark.parametrize(
    "config, cache",
    [
        ("gqa.py:tiny", dict(kind="paged", k_bits=4, v_bits=2, group_size=4, page_size=8)),
        ("gqa.py:tiny", dict(kind="paged", page_size=8)),
        ("mla.py:tiny", dict(latent_bits=8, rope_bits=4, group_size=4)),
    ],
)
@pytest.mark.parametrize("on_cpu", ["cuda", "tpu"])
def test_pallas_kernels_give_the_xla_logits(config, cache, on_cpu, monkeypatch):
    """model.attention_impl='pallas' (each platform's kernel in interpret mode on
    CPU) reads paged KIVI, paged 16-bit and quantized latent caches to the XLA
    path's logits."""
    monkeypatch.setattr(pallas_backend, "ON_CPU", on_cpu)
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}")
    cfg.cache.update(cache)
    cfg.model.num_layers = 1
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 40), np.int32)
    xla = decode_logits(cfg, params, tokens, 10**9)
    cfg.model.attention_impl = "pallas"
    np.testing.assert_allclose(decode_logits(cfg, params, tokens, 10**9), xla, atol=1e-5)
