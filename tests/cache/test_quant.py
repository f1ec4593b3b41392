"""Quantized caches: codes, error bounds, layout, accounting and chunk invariance."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.attention.core import attend
from kvlab.cache.formats import normal_float
from kvlab.cache.quant import (
    Layout,
    PayloadReader,
    QuantizedLayer,
    Storage,
    dequantize_tokens,
    init_layer,
    pack,
    quantize_tokens,
    unpack,
)
from tests.helpers import (
    ROOT,
    TOLERANCE,
    build,
    mla_config,
    random_tokens,
    run_in_chunks,
    tiny_config,
)

# ---------------------------------------------------------------------------
# Codes


@given(
    bits=st.sampled_from([8, 4, 3, 2, 1]),
    rows=st.integers(1, 3),
    width=st.sampled_from([8, 16, 24]),
    seed=st.integers(0, 2**16),
)
def test_pack_and_unpack_round_trip(bits, rows, width, seed):
    """Codes round trip, Wd * bits / 8 bytes a row, and the bytes are the codes'
    bits one after another, low bits first (3 bits: across byte boundaries)."""
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, width), dtype=np.uint8)
    packed = pack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (rows, width * bits // 8)
    np.testing.assert_array_equal(unpack(packed, bits), codes)
    stream = ((codes[..., None] >> np.arange(bits)) & 1).reshape(rows, -1)  # LSB first
    expected = (stream.reshape(rows, -1, 8) << np.arange(8)).sum(-1)
    np.testing.assert_array_equal(np.asarray(packed), expected)


def test_four_two_bit_codes_share_a_byte_low_bits_first():
    np.testing.assert_array_equal(pack(jnp.array([[1, 2, 3, 0]], jnp.uint8), 2), [[0b00111001]])
    np.testing.assert_array_equal(pack(jnp.array([[5, 12]], jnp.uint8), 4), [[0xC5]])


def storage(bits=8, fmt="int", axis="token", group=4, symmetric=False, scale_dtype="bfloat16"):
    return Storage(bits, fmt, axis, group, symmetric, scale_dtype, "float32")


specs = (
    st.builds(
        storage,
        bits=st.sampled_from([8, 4, 2]),
        axis=st.sampled_from(["token", "channel"]),
        group=st.sampled_from([1, 2, 4, 8]),
        symmetric=st.booleans(),
        scale_dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    )
    | st.builds(
        storage,
        fmt=st.just("fp8"),
        axis=st.sampled_from(["token", "channel"]),
        group=st.sampled_from([1, 4, 8]),
        scale_dtype=st.sampled_from(["float32", "bfloat16"]),
    )
    | st.builds(
        storage,
        bits=st.sampled_from([8, 4, 2]),
        fmt=st.just("nf"),
        axis=st.sampled_from(["token", "channel"]),
        group=st.sampled_from([1, 4, 8]),
        scale_dtype=st.sampled_from(["float32", "bfloat16"]),
    )
)


def round_trip(x, spec):
    payload, scale, zero = quantize_tokens(jnp.asarray(x), spec)
    return np.asarray(dequantize_tokens(payload, scale, zero, spec)), scale


@given(spec=specs, seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_quantize_then_dequantize_stays_within_the_format_bound(spec, seed, magnitude):
    rng = np.random.default_rng(seed)
    # [B, KH, N, Wd] with an offset, so asymmetric codes have something to do
    x = (rng.standard_normal((2, 2, 8, 8)) + rng.uniform(-2, 2)) * magnitude
    x = x.astype(np.float32)
    restored, scale = round_trip(x, spec)
    scale = np.asarray(scale, np.float32)
    # The scale of each number's group, broadcast back to x's shape.
    if spec.axis == "token":
        per_number = np.repeat(scale, spec.group_size, axis=-1)
    else:
        per_number = np.repeat(scale, spec.group_size, axis=2)
    if spec.format == "fp8":
        # 3 mantissa bits: half an ulp is 2^-4 of the number; subnormals 2^-10 of the scale.
        bound = np.maximum(np.abs(x) * 2.0**-4, per_number * 2.0**-10)
    elif spec.format == "nf":  # half the widest gap between the grid's levels
        bound = per_number * np.diff(normal_float.grid(spec.bits)).max() / 2
    else:
        bound = per_number / 2
    assert (np.abs(restored - x) <= bound * (1 + 1e-5) + 1e-6 * np.abs(x)).all()


def test_error_grows_as_bits_fall():
    x = np.random.default_rng(0).standard_normal((1, 4, 64, 64)).astype(np.float32)
    errors = [np.abs(round_trip(x, storage(bits, group=16))[0] - x).mean() for bits in (8, 4, 2)]
    assert errors[0] < errors[1] < errors[2]
    assert errors[0] < 0.01 and errors[2] > 0.1


def test_constant_group_is_exact():
    x = np.full((1, 1, 4, 4), 0.75, np.float32)
    for spec in (
        storage(),
        storage(symmetric=True),
        storage(fmt="fp8"),
        storage(bits=2),
        storage(4, "nf"),
    ):
        np.testing.assert_allclose(round_trip(x, spec)[0], x, rtol=2**-8)


@given(spec=specs, seed=st.integers(0, 2**16))
def test_payload_reader_equals_attention_over_dequantized_numbers(spec, seed):
    """Scales applied after the products give what dequantizing first gives."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 2, 8, 8)).astype(np.float32)
    payload, scale, zero = quantize_tokens(jnp.asarray(x), spec)
    tensor = kvlab.cache.QuantizedTensor(payload, scale, zero, None, spec)
    reader, dense = PayloadReader(tensor), tensor.dequantize()
    assert reader.shape == dense.shape
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.random((2, 2, 3, 8)), jnp.float32)
    np.testing.assert_allclose(
        reader.scores(q), jnp.einsum("bkmd,bksd->bkms", q, dense), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(
        reader.weighted_sum(w), jnp.einsum("bkms,bksd->bkmd", w, dense), rtol=1e-5, atol=1e-4
    )


# ---------------------------------------------------------------------------
# Layout and accounting


@given(
    capacity=st.integers(1, 100),
    residual_groups=st.integers(0, 3),
    group=st.sampled_from([1, 4, 16]),
)
def test_layout_holds_every_token_and_wastes_less_than_a_group(capacity, residual_groups, group):
    layout = Layout(capacity, residual_groups * group, group)
    lengths = np.arange(capacity + 1)
    settled = np.asarray(layout.settled(jnp.asarray(lengths)))
    assert (np.diff(settled) >= 0).all() and (settled % group == 0).all()
    assert (settled <= lengths).all() and (settled <= layout.payload_len).all()
    assert (lengths - settled <= layout.ring_len).all()  # the recent tokens fit the ring
    assert capacity <= layout.payload_len + layout.ring_len < capacity + group


def quantized_config(model="gqa", **cache):
    cfg = tiny_config() if model == "gqa" else mla_config()
    cfg.cache.update(cache)
    return kvlab.validate_config(cfg)


@st.composite
def quantized_configs(draw, models=("gqa", "mla")):
    """Random quantized caches over the tiny models: every field of the cache section."""
    model = draw(st.sampled_from(models))
    prefixes = ("k", "v") if model == "gqa" else ("latent", "rope")
    group = draw(st.sampled_from([2, 4]))
    cache = dict(
        group_size=group,
        symmetric=draw(st.booleans()),
        scale_dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        residual=group * draw(st.integers(0, 2)),
    )
    for prefix in prefixes:
        fmt = draw(st.sampled_from(["int", "int", "fp8", "nf"]))
        cache[f"{prefix}_format"] = fmt
        widths = [16, 8, 4, 3, 2] if fmt == "nf" else [16, 8, 4, 2]  # nf: 8 codes in 3 bytes
        cache[f"{prefix}_bits"] = 8 if fmt == "fp8" else draw(st.sampled_from(widths))
        cache[f"{prefix}_axis"] = draw(st.sampled_from(["token", "channel"]))
    if all(cache[f"{p}_bits"] == 16 for p in prefixes):
        cache[f"{prefixes[0]}_bits"] = 4
    for prefix in prefixes:  # a row's first positions kept beside the codes
        if cache[f"{prefix}_bits"] < 16:
            cache[f"{prefix}_full_first"] = draw(st.sampled_from([0, 0, 1, 5]))
    return quantized_config(model, **cache)


@given(cfg=quantized_configs(), batch=st.integers(1, 3), max_len=st.integers(1, 40))
def test_analytic_bytes_equal_measured_bytes(cfg, batch, max_len):
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=batch, max_len=max_len)
    assert all(isinstance(layer, QuantizedLayer) for layer in cache.layers)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len) == kvlab.tree_bytes(cache)


@pytest.mark.parametrize("bits,most", [(8, 0.54), (4, 0.29), (2, 0.17)])
def test_bytes_against_the_16_bit_cache(bits, most):
    """group_size 64 and bfloat16 scales with zero points: 8-bit <= 0.54, 4-bit <= 0.29."""
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:base")
    full = kvlab.cache_bytes(cfg.model, cfg.cache, 8, 4096)
    cfg.cache.update(k_bits=bits, v_bits=bits, k_axis="token", group_size=64)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 8, 4096) / full <= most
    abstract = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, 8, 4096))
    assert kvlab.tree_bytes(abstract) == kvlab.cache_bytes(cfg.model, cfg.cache, 8, 4096)


def test_latent_and_rope_key_are_quantized_for_mla():
    cfg = quantized_config("mla", latent_bits=4, rope_bits=8, rope_axis="token", group_size=8)
    layer = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=16).layers[0]
    c_kv, k_rope = layer.tensors
    # kv_rank 64 at 4 bits: 32 bytes a token; rope_dim 8 at 8 bits: 8 bytes.
    assert c_kv.payload.dtype == jnp.uint8 and c_kv.payload.shape == (2, 1, 16, 32)
    assert k_rope.payload.shape == (2, 1, 16, 8)
    assert c_kv.scale.shape == (2, 1, 16, 8) and k_rope.scale.shape == (2, 1, 16, 1)


# ---------------------------------------------------------------------------
# Semantics through the model


def run_chunks(apply, params, cfg, tokens, chunks, max_len):
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=tokens.shape[0], max_len=max_len)
    return run_in_chunks(apply, params, cache, tokens, chunks)


@st.composite
def chunkings(draw, length, width):
    """Random chunk sizes of at most `width` covering `length` tokens."""
    chunks = []
    while sum(chunks) < length:
        chunks.append(draw(st.integers(1, min(width, length - sum(chunks)))))
    return chunks


@settings(max_examples=6)  # each example compiles its layer step
@given(
    specs=st.tuples(specs, specs),
    residual_groups=st.integers(0, 2),
    chunks=chunkings(14, 6),
    seed=st.integers(0, 2**16),
)
def test_chunks_see_exactly_what_token_by_token_decode_sees(specs, residual_groups, chunks, seed):
    """One quantized layer fed the same keys and values token by token or in chunks
    (padded to one width): every query attends over the same numbers."""
    group = specs[0].group_size
    specs = tuple(dataclasses.replace(s, group_size=group) for s in specs)
    length, width, heads, dim = 14, 6, 2, 8
    layout = Layout(
        length, residual_groups * group, group if any(s.axis == "channel" for s in specs) else 1
    )
    rng = np.random.default_rng(seed)
    # [B, KH, N + width, Wd] keys and values; queries [B, N + width, 2 * KH, Wd]
    k, v = (
        jnp.asarray(rng.standard_normal((2, heads, length + width, dim)), jnp.float32)
        for _ in range(2)
    )
    q = jnp.asarray(rng.standard_normal((2, length + width, 2 * heads, dim)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=4)
    def step(cache, k, v, q, size):
        placement = cache.place(k.shape[2], jnp.full((2,), size))
        layer = cache.layers[0]
        regions, pending = layer.read((k, v), placement)
        out = attend(q, [(keys, values, mask) for (keys, values), mask in regions])
        layer = layer.write(pending, placement)
        return out, cache.replace(layers=(layer,), lengths=cache.lengths + size)

    def run(sizes):
        cache = kvlab.Cache(
            layers=(init_layer(specs, layout, 2, [(heads, dim)] * 2),),
            lengths=jnp.zeros(2, jnp.int32),
            errors=jnp.zeros(2, jnp.int32),
            tensors=(),
            transforms=("none", "none"),
        )
        outs, start = [], 0
        for size in sizes:
            span = 1 if size == 1 else width
            piece = slice(start, start + span)
            out, cache = step(cache, k[:, :, piece], v[:, :, piece], q[:, piece], size)
            outs.append(out[:, :size])
            start += size
        return jnp.concatenate(outs, axis=1)

    np.testing.assert_allclose(run(chunks), run([1] * length), atol=1e-5, rtol=1e-5)


@settings(max_examples=3)  # each example compiles whole models (the layer test below: more)
@given(cfg=quantized_configs(), chunks=chunkings(12, 6))
def test_chunked_model_matches_token_by_token_decode(cfg, chunks):
    """Through the model, chunked and token-by-token runs compute the keys and values
    themselves, in differently shaped products that round differently (~1e-7). A
    number that sits on a quantization boundary can then take the neighbouring
    code, so logits agree to float noise except there: bounded here, not exact."""
    length, width = 12, 6
    model, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, length + width + 3), seed=len(chunks))
    stepwise, cache = run_chunks(apply, params, cfg, tokens, [1] * length, length + 3)
    chunked_cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=length + 3)
    chunked, start = [], 0
    for size in chunks:
        logits, chunked_cache = apply(
            {"params": params},
            tokens[:, start : start + width],
            cache=chunked_cache,
            num_tokens=jnp.full((2,), size),
        )
        chunked.append(logits[:, :size])
        start += size
    differences = jnp.abs(jnp.concatenate(chunked, axis=1) - stepwise)
    assert float(jnp.median(differences)) <= 1e-5
    assert float(differences.max()) <= 0.05
    # The two caches hold the same tokens the same way: decoding on agrees.
    for step in range(length, length + 3):
        a, cache = apply({"params": params}, tokens[:, step : step + 1], cache=cache)
        b, chunked_cache = apply(
            {"params": params}, tokens[:, step : step + 1], cache=chunked_cache
        )
        assert float(jnp.max(jnp.abs(a - b))) <= 0.05


KIVI = dict(k_bits=2, v_bits=2, k_axis="channel", v_axis="token", group_size=4, residual=4)


def test_each_row_of_a_ragged_batch_equals_the_row_alone():
    cfg = quantized_config(**KIVI)
    model, params, apply = build(cfg)
    lengths = np.array([9, 2, 6])
    prompts = random_tokens(cfg, (3, 9), seed=3)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=3, max_len=16)
    batched, cache = apply(
        {"params": params}, prompts, cache=cache, num_tokens=jnp.asarray(lengths)
    )
    step = random_tokens(cfg, (3, 1), seed=4)
    after, _ = apply({"params": params}, step, cache=cache)
    for row, n in enumerate(lengths):
        # Alone in a batch of three: the other rows hold nothing (num_tokens 0).
        alone = kvlab.init_cache(cfg.model, cfg.cache, batch_size=3, max_len=16)
        counts = jnp.zeros(3, jnp.int32).at[row].set(n)
        logits, alone = apply({"params": params}, prompts, cache=alone, num_tokens=counts)
        assert float(jnp.max(jnp.abs(logits[row, :n] - batched[row, :n]))) <= TOLERANCE
        only_row = (jnp.arange(3) == row).astype(jnp.int32)
        logits, _ = apply({"params": params}, step, cache=alone, num_tokens=only_row)
        assert float(jnp.max(jnp.abs(logits[row] - after[row]))) <= TOLERANCE


def test_residual_window_holds_recent_tokens_in_full_precision():
    """After n tokens: rows [0, settled(n)) quantized, the rest exact in the ring."""
    cfg = quantized_config(
        k_bits=4, v_bits=4, k_axis="channel", v_axis="token", group_size=4, residual=4
    )
    exact = kvlab.validate_config(tiny_config())
    model, params, apply = build(cfg)
    tokens = random_tokens(cfg, (1, 11), seed=7)
    _, cache = run_chunks(apply, params, cfg, tokens, [5, 1, 5], 12)
    _, reference = run_chunks(apply, params, exact, tokens, [5, 1, 5], 12)
    layer, truth = cache.layers[0], reference.layers[0]
    layout = layer.layout
    settled = layout.settled(11)
    assert (layout.residual, layout.granularity, settled) == (4, 4, 4)  # 11 - 4 = 7 -> 4
    for tensor, true in zip(layer.tensors, truth.tensors, strict=True):
        true = np.asarray(true[0, :, :11])  # [K, 11, H]
        for position in range(settled, 11):  # recent: exactly the values
            np.testing.assert_allclose(
                tensor.ring[0, :, position % layout.ring_len], true[:, position], atol=1e-6
            )
        settled_values = np.asarray(tensor.dequantize()[0, :, :settled])
        assert np.abs(settled_values - true[:, :settled]).max() < 0.3  # 4-bit, not exact
        assert not np.array_equal(settled_values, true[:, :settled])


def _primitives(jaxpr, inside=False):
    """(primitive name, whether under a cond) of every equation of a jaxpr, nested ones too."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, inside
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's own
                if hasattr(sub, "eqns"):
                    yield from _primitives(sub, inside or eqn.primitive.name == "cond")


@pytest.mark.parametrize("lengths", [(1, 6), (3, 6)])
def test_steps_where_no_group_settles_quantize_nothing(lengths):
    """A decode step settles a group in one step of g: quantizing happens only under
    a cond taken when some row settles one, and otherwise the flush is empty."""
    spec = Storage(4, "int", "channel", 4, False, "float32", "float32")
    layout = Layout(capacity=16, residual=0, granularity=4)
    layer = init_layer((spec, spec), layout, 2, [(2, 8)] * 2)
    lengths = jnp.asarray(lengths, jnp.int32)
    placement = kvlab.cache.dense.place_after(lengths, 16, 1, jnp.ones(2, jnp.int32))
    rng = np.random.default_rng(0)
    fresh = tuple(jnp.asarray(rng.standard_normal((2, 2, 1, 8)), jnp.float32) for _ in range(2))

    def read(layer, fresh):
        blocks, flush = layer.read(fresh, placement)
        return blocks[-1][0], flush.positions

    rounds = [
        inside
        for name, inside in _primitives(jax.make_jaxpr(read)(layer, fresh).jaxpr)
        if name == "round"
    ]
    assert rounds and all(rounds)  # every rounding to a code is under the cond
    values, positions = read(layer, fresh)
    settles = np.asarray(lengths) + 1 == 4  # row 0 of (3, 6): tokens 0..3 settle
    assert np.array_equal(np.asarray(positions[:, 0]) >= 0, settles)
    if not settles.any():
        assert all(not np.asarray(v).any() for v in values)  # the skipped branch: zeros
    else:
        # The settled tokens are the fresh one (position 3) and the ring's (zeros here).
        step = float(jnp.abs(fresh[0]).max()) / 15  # one 4-bit level of the widest span
        np.testing.assert_allclose(values[0][0, :, 3], fresh[0][0, :, 0], atol=step)


def test_sixteen_bits_is_the_unquantized_cache_exactly():
    plain = tiny_config()
    sixteen = quantized_config(
        k_bits=16, v_bits=16, k_axis="token", residual=8, group_size=8, symmetric=True
    )
    model, params, apply = build(plain)
    tokens = random_tokens(plain, (2, 10))
    a, cache_a = run_chunks(apply, params, plain, tokens, [6, 1, 3], 12)
    b, cache_b = run_chunks(apply, params, sixteen, tokens, [6, 1, 3], 12)
    assert isinstance(cache_b.layers[0], kvlab.cache.DenseLayer)
    np.testing.assert_array_equal(a, b)


def test_key_and_value_widths_act_independently():
    model, params, apply = build(tiny_config())
    tokens = random_tokens(tiny_config(), (2, 12), seed=5)
    outputs = {}
    for name, cache in {"K4V16": dict(k_bits=4), "K16V4": dict(v_bits=4), "K16V16": dict()}.items():
        cfg = quantized_config(**cache, k_axis="token", group_size=16)
        outputs[name], stored = run_chunks(apply, params, cfg, tokens, [12], 12)
        if name == "K4V16":  # the values are stored exactly
            values = stored.layers[0].tensors[1]
            assert values.payload.dtype == jnp.float32 and values.scale is None
    assert float(jnp.max(jnp.abs(outputs["K4V16"] - outputs["K16V4"]))) > 1e-3
    for name in ("K4V16", "K16V4"):
        assert float(jnp.max(jnp.abs(outputs[name] - outputs["K16V16"]))) > 1e-3


def test_quantized_decode_compiles_once():
    cfg = quantized_config(**KIVI)
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=40)
    _, cache = kvlab.prefill(model, params, cache, random_tokens(cfg, (2, 5)))
    before = kvlab.decode_step._cache_size()
    for step in range(30):
        _, cache = kvlab.decode_step(model, params, cache, np.full((2,), step, np.int32))
    assert kvlab.decode_step._cache_size() == before + 1
    np.testing.assert_array_equal(cache.lengths, [35, 35])


# ---------------------------------------------------------------------------
# Bad configs


def with_cache(model="gqa", **fields):
    cfg = kvlab.load_config(f"{ROOT}/configs/{model}.py:tiny")
    section = cfg.cache.to_dict()
    section.update(fields)
    cfg.cache = ml_collections.ConfigDict(section)
    return cfg


@pytest.mark.parametrize(
    "model,fields,words",
    [
        ("gqa", dict(k_bits=5), r"cache.k_bits=5 is not supported: use one of 16, 8, 4, 3, 2"),
        (
            "gqa",
            dict(k_bits=3),
            r"cache.k_format='int' needs 8 or 4 or 2 bits .* stores 3 bits \('nf', 'codebook'\)",
        ),
        ("gqa", dict(v_bits=4, v_format="fp8"), r"cache.v_format='fp8' needs 8 bits"),
        (
            "gqa",
            dict(k_bits=8, k_axis="token", group_size=6),
            r"cache.group_size=6 does not divide model.head_dim=16",
        ),
        (
            "gqa",
            dict(k_bits=4, k_axis="channel", group_size=4, residual=6),
            r"cache.residual=6 is not a multiple of cache.group_size=4",
        ),
        ("gqa", dict(v_axis="head"), r"cache.v_axis='head' is not supported"),
        ("gqa", dict(k_format="nf4"), r"cache.k_format='nf4' is not supported"),
        ("gqa", dict(group_size=0), r"cache.group_size=0 is below 1"),
        ("gqa", dict(residual=-1), r"cache.residual=-1 is below 0"),
        ("gqa", dict(scale_dtype="int8"), r"cache.scale_dtype='int8' is not supported"),
        ("gqa", dict(latent_bits=4), r"cache.latent_bits=4 applies to a tensor .* does not cache"),
        ("mla", dict(k_bits=8), r"cache.k_bits=8 applies to a tensor model.attention='mla'"),
        (
            "mla",
            dict(rope_bits=4, rope_axis="token", group_size=16),
            r"cache.group_size=16 does not divide model.mla.rope_dim=8",
        ),
    ],
)
def test_bad_quantization_configs_name_the_field(model, fields, words):
    cfg = with_cache(model, **fields)
    with pytest.raises(ValueError, match=words):
        kvlab.validate_config(cfg)
    with pytest.raises(ValueError, match=words):
        kvlab.init_cache(cfg.model, cfg.cache, batch_size=1, max_len=8)


def test_widths_that_do_not_pack_into_bytes_are_refused():
    cfg = mla_config(rope_dim=2)
    cfg.cache.update(rope_bits=2, rope_axis="channel", group_size=4)
    with pytest.raises(ValueError, match=r"cache.rope_bits=2 packs model.mla.rope_dim=2 numbers"):
        kvlab.validate_config(cfg)


@pytest.mark.parametrize("name", ["kv_int8", "kv_k8v4", "kv_kivi2"])
def test_quantized_config_files_load(name):
    cfg = kvlab.load_config(f"{ROOT}/configs/{name}.py:tiny")
    assert cfg.cache.k_bits < 16 and cfg.cache.v_bits < 16
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=1, max_len=64)
    assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(cfg.model, cfg.cache, 1, 64)
