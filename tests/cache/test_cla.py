"""Cross-layer attention (model.topology='cla:N', kvlab/cache/topology/cla.py):
runs of N adjacent layers share one cache layer. The model equals a reference
written from the definition, its cache threads through dense, paged,
quantized and evicting layers as the plain forward computes, and it holds
ceil(L / N) layers' bytes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.topology import cache_layers
from tests.helpers import VARIANTS, build, plain_rope, random_tokens, run_in_chunks, tiny_config


def cla(cfg, share: int, num_layers: int):
    cfg = cfg.copy_and_resolve_references()
    cfg.model.num_layers, cfg.model.topology = num_layers, f"cla:{share}"
    return cfg


def rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def reference(cfg, params, tokens, weights_of=None):
    """The grouped-query decoder from its definition, float32: the first layer
    of each run of `share` computes keys and values from its own input, and
    every layer of the run attends over those with its own queries. Each
    layer's attention weights [B, N, T, S] are appended to `weights_of`."""
    m = cfg.model
    share = int(m.topology.split(":")[1])
    length = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    causal = jnp.tril(jnp.ones((length, length), bool))
    x = params["embed"]["embedding"][tokens]
    for i in range(m.num_layers):
        p = params[f"block_{i}"]
        h = rms(x, p["attention_norm"]["scale"], m.norm_eps)
        a = p["attention"]
        q = plain_rope(
            jnp.einsum("btd,dnh->btnh", h, a["query"]["kernel"]), positions, m.rope_theta
        )
        if i % share == 0:
            assert {"key", "value"} <= a.keys()
            k = jnp.einsum("btd,dkh->btkh", h, a["key"]["kernel"])
            k, v = (
                plain_rope(k, positions, m.rope_theta),
                jnp.einsum("btd,dkh->btkh", h, a["value"]["kernel"]),
            )
            k, v = (jnp.repeat(t, m.num_heads // m.num_kv_heads, axis=2) for t in (k, v))
        else:
            assert not {"key", "value"} & a.keys()
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(m.head_dim)
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        if weights_of is not None:
            weights_of.append(weights)
        out = jnp.einsum("bnts,bsnh->btnh", weights, v)
        x = x + jnp.einsum("btnh,nhd->btd", out, a["out"]["kernel"])
        f = p["mlp"]
        h = rms(x, p["mlp_norm"]["scale"], m.norm_eps)
        gate, up = (h @ f[name]["kernel"] for name in ("gate", "up"))
        x = x + (jax.nn.silu(gate) * up) @ f["down"]["kernel"]
    x = rms(x, params["final_norm"]["scale"], m.norm_eps)
    return x @ params["embed"]["embedding"].T


@pytest.mark.parametrize(("share", "num_layers"), [(2, 4), (3, 4), (4, 4)])
def test_cla_equals_the_reference_from_its_definition(share, num_layers):
    cfg = cla(VARIANTS["gqa"](), share, num_layers)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 11))
    want = reference(cfg, params, tokens)
    got, _ = apply({"params": params}, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert cache_layers(cfg.model) == tuple(i // share for i in range(num_layers))


CACHES = {
    "dense": {},
    "paged": {"kind": "paged", "page_size": 4},
    "quantized 16-bit residual": {"k_bits": 8, "v_bits": 8, "residual": 32, "group_size": 16},
    "evicting, nothing to evict": {"evict": {"method": "snapkv", "budget": 16, "obs_window": 2}},
}


@pytest.mark.parametrize("name", ["gqa", "mla_absorbed", "mla_expanded"])
@pytest.mark.parametrize("kind", list(CACHES))
def test_cla_through_a_cache_equals_its_plain_forward(name, kind):
    """Prefill chunks and decode steps through each kind of cache give the
    plain forward's logits: every layer of a run reads the one cache layer
    before the run's last writes it. (A quantized cache whose residual holds
    every token and an evicting one whose budget does are exact.)"""
    cfg = cla(VARIANTS[name](), 2, 3)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(CACHES[kind])
    if name != "gqa":  # a latent model caches the latent and RoPE keys
        for prefix in ("k", "v"):
            bits = cache_cfg.get(f"{prefix}_bits")
            cache_cfg[f"{prefix}_bits"] = 16
            cache_cfg[{"k": "latent", "v": "rope"}[prefix] + "_bits"] = bits
        if kind.startswith("quantized"):
            cache_cfg.rope_bits = 16  # rope_dim 8: one group of 16 does not divide it
    checked = cfg.copy_and_resolve_references()
    checked.cache = cache_cfg
    kvlab.validate_config(checked)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 9))
    want, _ = apply({"params": params}, tokens)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
    assert len(cache.layers) == 2
    got, cache = run_in_chunks(apply, params, cache, tokens, [4, 1, 3, 1])
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=0)
    assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(cfg.model, cache_cfg, 2, 16)
    assert not np.asarray(cache.errors).any()


def test_an_evicting_cla_cache_scores_by_the_mean_attention_of_the_run():
    """H2O's score of a token after a prefill is the attention it received
    (summed over the queries, averaged over each KV head's query heads): under
    CLA, averaged over the layers of the run that read it, as computed from the
    reference's weights. Below the budget, decode steps keep budget slots per
    head in each of the ceil(L / N) cache layers, with finite logits."""
    cfg = cla(VARIANTS["gqa"](), 2, 2)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.evict.update(method="h2o", budget=12, recent=0)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 10), seed=3)
    weights = []
    reference(cfg, params, tokens, weights)
    m = cfg.model
    per_layer = [
        w.reshape(2, m.num_kv_heads, -1, *w.shape[2:]).mean(2).sum(2) for w in weights
    ]  # [B, K, S]
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
    _, cache = apply({"params": params}, tokens, cache=cache)
    (layer,) = cache.layers
    order = np.argsort(np.where(layer.positions < 0, 99, layer.positions), axis=-1)[..., :10]
    got = np.take_along_axis(np.asarray(layer.scores), order, axis=-1)
    np.testing.assert_allclose(got, (per_layer[0] + per_layer[1]) / 2, atol=2e-5)
    assert not np.allclose(got, per_layer[0], atol=1e-3)  # not the producer's alone

    cfg = cla(cfg, 2, 3)
    cache_cfg.evict.update(budget=6, recent=2)
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
    logits, cache = run_in_chunks(apply, params, cache, random_tokens(cfg, (2, 14)), [8] + [1] * 6)
    assert np.isfinite(np.asarray(logits)).all()
    assert [layer.positions.shape[-1] for layer in cache.layers] == [6, 6]
    assert (np.asarray(cache.layers[0].positions) >= 0).all()


@settings(deadline=None, max_examples=25)
@given(
    share=st.integers(2, 5),
    num_layers=st.integers(1, 9),
    attention=st.sampled_from(["gqa", "mla_absorbed"]),
    bits=st.sampled_from([16, 8, 4]),
    kind=st.sampled_from(["dense", "paged"]),
)
def test_cla_holds_the_bytes_of_ceil_layers_over_share(share, num_layers, attention, bits, kind):
    """A CLA model caches what a layerwise model of ceil(L / N) layers caches
    (16-bit dense: counted from the definition); the allocated tree and
    cache_bytes agree, and a cache for the layerwise model of L layers is
    refused by name."""
    cfg = cla(VARIANTS[attention](), share, num_layers)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(kind=kind, page_size=16)
    cache_cfg["k_bits" if attention == "gqa" else "latent_bits"] = bits
    batch, max_len, layers = 2, 32, math.ceil(num_layers / share)
    got = kvlab.cache_bytes(cfg.model, cache_cfg, batch, max_len)
    cache = kvlab.init_cache(cfg.model, cache_cfg, batch, max_len)
    assert len(cache.layers) == layers
    assert kvlab.tree_bytes(cache) == got
    assert got == kvlab.cache_bytes(_layerwise(cfg.model, layers), cache_cfg, batch, max_len)
    if bits == 16 and kind == "dense":
        itemsize = jnp.dtype(cache_cfg.dtype).itemsize
        tensors = kvlab.config.cached_tensors(cfg.model)
        per_layer = sum(batch * t.heads * max_len * t.width * itemsize for t in tensors)
        assert got == layers * per_layer + batch * 8  # + each row's length and error flags
    if layers != num_layers:
        wrong = kvlab.init_cache(_layerwise(cfg.model, num_layers), cache_cfg, batch, max_len)
        with pytest.raises(ValueError, match=f"model.topology='cla:{share}'"):
            kvlab.model.check_cache(kvlab.config.frozen(cfg.model), wrong)


def _layerwise(model_cfg, num_layers: int):
    model_cfg = model_cfg.copy_and_resolve_references()
    model_cfg.num_layers, model_cfg.topology = num_layers, "layerwise"
    return model_cfg


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("cla:1", "N >= 2"),
        ("cla:two", "N >= 2"),
        ("cla", "N >= 2"),
        ("layerwise:2", "takes no argument"),
        ("ring", "names no cache topology"),
    ],
)
def test_a_bad_topology_is_refused_by_name(spec, problem):
    with pytest.raises(ValueError, match=problem) as error:
        tiny_config(topology=spec)
    assert "model.topology" in str(error.value)


def test_cla_refuses_per_layer_rope_pairs():
    cfg = VARIANTS["mla_absorbed"]()
    m = cfg.model
    m.topology = "cla:2"
    m.mla.rope_pairs = tuple(
        ((tuple(range(m.mla.rope_dim // 2)),) * m.mla.rope_heads) for _ in range(m.num_layers)
    )
    with pytest.raises(ValueError, match="model.mla.rope_pairs"):
        kvlab.validate_config(cfg)


def test_cla_consumers_have_no_key_or_value_projections():
    cfg = cla(VARIANTS["mla_absorbed"](), 2, 3)
    params = build(cfg)[1]
    made = {"kv_down", "key_rope"}
    assert made <= params["block_0"]["attention"].keys()
    assert not made & params["block_1"]["attention"].keys()
    assert made <= params["block_2"]["attention"].keys()
    assert {"key_up", "value_up"} <= params["block_1"]["attention"].keys()
