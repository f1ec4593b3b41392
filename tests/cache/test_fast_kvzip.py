"""Fast KVzip (kvlab/cache/evict/fast_kvzip.py) against its definition
(arXiv:2601.17668, as kvpress 0.5.5's FastKVzipGate scores a token): a small
gate per layer reads each token's attention input and predicts its KVzip
score; the gates are fitted offline to the calibration text's KVzip scores, and
a compressed context keeps each layer's best-scored tokens over its heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict.fast_kvzip import GATE_ARRAYS, gate_scores
from kvlab.cache.evict.scorers import global_shares
from kvlab.eval import calibrate
from tests.cache.test_after_prefill import kept
from tests.cache.test_evict import evicting
from tests.cache.test_kvzip import assert_ranked_together
from tests.helpers import VARIANTS, build, intermediates, random_tokens

CONTEXT, MAX_LEN, HEADROOM = 40, 64, 8


def encode(text):  # a tokenizer for the test's vocabulary
    return [ord(ch) % 50 for ch in text]


def random_gates(layers, width, kv_heads, groups, d=4, sinks=3, seed=0) -> dict:
    """Gates of random numbers everywhere (sink keys, bias and norms too)."""
    shapes = dict(L=layers, D=width, K=kv_heads, G=groups, d=d, J=sinks)
    rng = np.random.default_rng(seed)
    return {
        name: rng.normal(size=[shapes[axis] for axis in axes.strip("[]").split(", ")])
        for name, axes in GATE_ARRAYS.items()
    }


def kvpress_gate(gates, hidden):
    """float64 [K, T]: kvpress's FastKVzipGate.forward over one layer's hidden
    states [T, D], its torch weights made from `gates` (q_proj [K G d, D] and its
    bias, k_proj [K d, D], q_norm, k_norm, k_base [K, 1, J, d], b [K, 1, G])."""
    d = gates["q_norm"].shape[-1]
    kv_heads, groups = gates["bias"].shape
    q_proj = gates["q_kernel"].reshape(hidden.shape[1], -1).T
    k_proj = gates["k_kernel"].reshape(hidden.shape[1], -1).T

    def rms(x, weight):  # Qwen3RMSNorm
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * weight

    queries = rms(
        (hidden @ q_proj.T + gates["q_bias"].reshape(-1)).reshape(-1, kv_heads, groups, d),
        gates["q_norm"],
    )
    keys = rms((hidden @ k_proj.T).reshape(-1, kv_heads, 1, d), gates["k_norm"])
    queries = queries.transpose(1, 0, 3, 2)  # head x seq x dim x group
    keys = keys.transpose(1, 0, 2, 3)  # head x seq x 1 x dim
    logit = keys @ queries / np.sqrt(d) + gates["bias"][:, None, None, :]  # [K, T, 1, G]
    base = gates["sink_keys"][:, None] @ queries / np.sqrt(d)  # [K, T, J, G]
    score = 1 / (1 + np.exp(base - logit).sum(2, keepdims=True))
    return score.mean(-1)[..., 0]


@settings(max_examples=10, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    groups=st.integers(1, 3),
    d=st.integers(1, 8),
    sinks=st.integers(1, 5),
    tokens=st.integers(1, 9),
    seed=st.integers(0, 99),
)
def test_the_gate_is_kvpress_fast_kvzip_gate(kv_heads, groups, d, sinks, tokens, seed):
    """gate_scores over random gates and hidden states: kvpress's gate in float64."""
    gates = random_gates(1, 12, kv_heads, groups, d, sinks, seed)
    hidden = np.random.default_rng(seed + 1).normal(size=(tokens, 12))
    layer = {name: jnp.asarray(array[0], jnp.float32) for name, array in gates.items()}
    got = gate_scores(layer, jnp.asarray(hidden, jnp.float32))
    np.testing.assert_allclose(
        got, kvpress_gate({k: v[0] for k, v in gates.items()}, hidden), rtol=1e-4, atol=1e-6
    )


def attention_inputs(cfg, params, tokens) -> list:
    """float64 [T, D] per layer: each layer's attention input over one row."""
    blocks = intermediates(cfg, params, jnp.asarray(tokens)[None])
    return [
        np.asarray(blocks[f"block_{i}"]["attention_norm"]["__call__"][0][0], np.float64)
        for i in range(cfg.model.num_layers)
    ]


def gates_file(cfg, path, seed=0) -> str:
    m = cfg.model
    gates = random_gates(
        m.num_layers, m.embed_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads, seed=seed
    )
    calibrate.save_gates(path, gates)
    return str(path)


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_a_compressed_context_keeps_each_layers_best_gate_scores(ratio, tmp_path):
    """After one compressing prefill, each layer's pool holds over its KV heads
    together the floor(ratio x length) x K tokens of highest float64 gate score,
    the first `sinks` and the last 2% (of 40: none; of 29: none) ranked first."""
    cfg = VARIANTS["gqa"]()
    path = gates_file(cfg, tmp_path / "gates.npz")
    options = {"gates": path, "sinks": 2, "window_ratio": 0.1}
    cache_cfg = evicting(
        cfg,
        "fast_kvzip",
        when="after_prefill",
        ratio=ratio,
        headroom=HEADROOM,
        recent=0,
        options=options,
    )
    _, params, apply = build(cfg)
    # distinct tokens: the first layer's input is the token's embedding alone
    context = np.random.default_rng(1).permutation(cfg.model.vocab_size)[:CONTEXT]
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, MAX_LEN)
    _, cache = apply({"params": params}, context[None], cache=cache, compress=True)
    stored = {k: v for k, v in np.load(path).items()}
    heads = cfg.model.num_kv_heads
    for layer, hidden in enumerate(attention_inputs(cfg, params, context)):
        score = kvpress_gate({k: v[layer] for k, v in stored.items()}, hidden)  # [K, T]
        score[:, :2] = 2.0  # the sinks
        score[:, CONTEXT - 4 :] = 2.0  # the last 10% of 40
        target = int(ratio * CONTEXT) * heads
        order = np.argsort(-score.reshape(-1), kind="stable")
        best = score.reshape(-1)[order]
        assert (
            best[target - 1] == 2.0 or best[target - 1] - best[target] > 1e-5
        )  # no tie at the cut
        head, position = np.divmod(order[:target], CONTEXT)
        expect = [sorted(position[head == h].tolist()) for h in range(heads)]
        assert kept(cache.layers[layer])[0] == expect, layer
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 1, MAX_LEN) == kvlab.tree_bytes(cache)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    rows=st.integers(1, 3),
    heads=st.integers(1, 3),
    length=st.integers(1, 12),
    keep=st.floats(0.0, 1.0),
    seed=st.integers(0, 99),
)
def test_global_shares_are_each_layers_part_of_all_layers_best(
    layers, rows, heads, length, keep, seed
):
    """global_shares over distinct random scores: a layer's kept tokens in each
    context are its scores at or above the context's cut (kvpress's
    layerwise=False prunes the int(n x (1 - keep)) lowest of all n), their mean
    count over the mean layer's; so the shares average 1 and no layer is asked
    for more than its tokens (keep x share <= 1)."""
    rng = np.random.default_rng(seed)
    scores = rng.permutation(layers * rows * heads * length).reshape(layers, rows, heads, length)
    scores = scores.astype(np.float64)
    shares = global_shares(scores, keep)
    kept = np.zeros(layers)
    for row in range(rows):
        every = np.sort(scores[:, row].ravel())
        pruned = int(every.size * (1 - keep))
        cut = every[pruned] if pruned < every.size else np.inf
        kept += (scores[:, row] >= cut).sum((1, 2)) / rows
    if kept.sum() == 0:  # nothing kept anywhere: every layer alike
        kept[:] = 1
    np.testing.assert_allclose(shares, kept / kept.mean())
    assert abs(shares.mean() - 1) < 1e-9
    assert (keep * shares <= 1 + 1e-9).all()


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_unequal_layer_shares_follow_the_calibrated_contexts_ranking(ratio, tmp_path):
    """layerwise=False, the gates' calibration being the compressed context's own
    scores (calibrate.fast_kvzip_calibration): each layer keeps its best tokens
    over its heads together, as many as all layers' best ranked together put in
    it (kvpress's layerwise=False), to the slots of its KV heads (fewer by under
    2 x K); the layers keep unequal counts."""
    cfg = VARIANTS["gqa"]()
    m = cfg.model
    _, params, apply = build(cfg)
    context = np.random.default_rng(1).permutation(m.vocab_size)[:CONTEXT]
    gates = random_gates(m.num_layers, m.embed_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads)
    gates["calibration"] = calibrate.fast_kvzip_calibration(m, params, gates, context[None])
    calibrate.save_gates(tmp_path / "gates.npz", gates)
    options = {
        "gates": str(tmp_path / "gates.npz"),
        "sinks": 2,
        "window_ratio": 0.1,
        "layerwise": False,
    }
    cache_cfg = evicting(
        cfg,
        "fast_kvzip",
        when="after_prefill",
        ratio=ratio,
        headroom=HEADROOM,
        recent=0,
        options=options,
    )
    cache = kvlab.init_cache(m, cache_cfg, 1, MAX_LEN)
    _, cache = apply({"params": params}, context[None], cache=cache, compress=True)
    stored = dict(np.load(tmp_path / "gates.npz"))
    scores = []
    for layer, hidden in enumerate(attention_inputs(cfg, params, context)):
        score = kvpress_gate({k: v[layer] for k, v in stored.items()}, hidden)  # [K, T]
        score[:, :2] = score[:, CONTEXT - 4 :] = 2.0  # the sinks, the last 10% of 40
        scores.append(score)
    assert_ranked_together(cache, np.stack(scores), ratio)
    assert kvlab.cache_bytes(m, cache_cfg, 1, MAX_LEN) == kvlab.tree_bytes(cache)


def test_each_slot_carries_its_tokens_score_from_its_arrival(tmp_path):
    """Evicting every few steps as tokens come (cache.evict.when='every_step'), in
    pages: each kept slot's carried score is its token's gate score, from the
    attention input of the step that brought it (captured in the same run)."""
    cfg = VARIANTS["gqa"]()
    path = gates_file(cfg, tmp_path / "g.npz")
    cache_cfg = evicting(cfg, "fast_kvzip", budget=8, options={"gates": path})
    cache_cfg.update(kind="paged", page_size=8)
    model, params, _ = build(cfg)
    tokens = random_tokens(cfg, (1, 21), seed=2)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    inputs = [[] for _ in range(cfg.model.num_layers)]
    for start, end in ((0, 7), (7, 8), (8, 9), (9, 21)):
        (_, cache), state = model.apply(
            {"params": params},
            tokens[:, start:end],
            cache=cache,
            capture_intermediates=True,
            mutable=["intermediates"],
        )
        for layer, seen in enumerate(inputs):
            block = state["intermediates"][f"block_{layer}"]
            seen.append(np.asarray(block["attention_norm"]["__call__"][0][0], np.float64))
    stored = dict(np.load(path))
    heads = cfg.model.num_kv_heads
    for layer, seen in enumerate(inputs):
        want = kvpress_gate({k: v[layer] for k, v in stored.items()}, np.concatenate(seen))
        tags = np.asarray(cache.layers[layer].positions)[0, 0]
        held = tags >= 0
        assert held.sum() == 8 * heads
        carried = np.asarray(cache.layers[layer].scores)[0, 0][held]
        np.testing.assert_allclose(
            carried, want[tags[held] % heads, tags[held] // heads], rtol=1e-4, err_msg=layer
        )


def test_fitted_gates_predict_kvzip_scores_better_than_untrained_ones(tmp_path):
    """calibrate.fast_kvzip_gates over two contexts: the gates' cross-entropy against
    the contexts' KVzip scores falls below the untrained gates'; calibrate_scorers
    writes them once where cache.evict.options.gates reads them, and a cache
    compresses by them."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    contexts = np.stack([random_tokens(cfg, (CONTEXT,), seed=s) for s in (3, 4)])
    hidden, targets = calibrate.gate_data(cfg.model, params, contexts, encode)
    m = cfg.model
    assert hidden.shape == (m.num_layers, 2 * CONTEXT, m.embed_dim)
    assert targets.shape == (m.num_layers, m.num_kv_heads, 2 * CONTEXT)
    assert (targets > 0).all() and (targets <= 1).all()
    untrained = calibrate.init_gates(
        m.num_layers, m.embed_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads
    )
    fitted = calibrate.fast_kvzip_gates(m, params, contexts, encode, steps=100)
    before = float(calibrate.gate_loss(untrained, hidden, targets))
    after = float(calibrate.gate_loss(jax.tree.map(jnp.asarray, fitted), hidden, targets))
    assert after < 0.9 * before, (before, after)
    calibrate.calibrate_scorers(["fast_kvzip"], tmp_path, m, params, encode, tokens=contexts)
    options = {}
    calibrate.with_artefacts(options, ["fast_kvzip"], tmp_path)
    assert options == {"gates": str(tmp_path / "fast_kvzip_gates.npz")}
    written = dict(np.load(options["gates"]))
    assert written.keys() == {*GATE_ARRAYS, "calibration"}
    # the fitted gates' scores of the calibration contexts, for layerwise=False's shares
    np.testing.assert_allclose(
        written["calibration"],
        calibrate.fast_kvzip_calibration(m, params, written, contexts),
        rtol=1e-5,
        atol=1e-6,
    )
    cache_cfg = evicting(
        cfg, "fast_kvzip", when="after_prefill", ratio=0.5, headroom=HEADROOM, options=options
    )
    cache = kvlab.init_cache(m, cache_cfg, 1, MAX_LEN)
    logits, cache = apply({"params": params}, contexts[:1], cache=cache, compress=True)
    assert np.isfinite(logits).all()
    for layer in cache.layers:
        assert int(layer.stored(cache.lengths).sum()) == CONTEXT // 2 * m.num_kv_heads


def test_what_it_cannot_score_is_refused_naming_the_field(tmp_path):
    """Refused before anything compiles: a layout whose tokens settle in groups
    later (KIVI's residual window), a latent, a bad window share or sink count, no
    gates file; gates of the wrong model or inconsistent arrays at the first step."""
    cfg = VARIANTS["gqa"]()
    path = gates_file(cfg, tmp_path / "g.npz")
    settling = evicting(cfg, "fast_kvzip", 4, options={"gates": path})
    settling.update(residual=8, group_size=8)
    with pytest.raises(ValueError, match=r"cache.residual=0"):
        kvlab.init_cache(cfg.model, settling, 1, 32)
    mla = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="fast_kvzip"):
        kvlab.init_cache(mla.model, evicting(mla, "fast_kvzip", options={"gates": path}), 1, 32)
    for options, message in (
        ({"gates": path, "window_ratio": 1.0}, r"options.window_ratio=1.0"),
        ({"gates": path, "sinks": -1}, r"options.sinks=-1"),
        ({"gates": str(tmp_path / "none.npz")}, r"options.gates=.*names no file"),
        ({"gates": path, "layerwise": "no"}, r"options.layerwise='no' is not of its default"),
        ({"gates": path, "layerwise": False}, r"no .npz file with an array 'calibration'"),
    ):
        with pytest.raises(ValueError, match=message):
            kvlab.init_cache(cfg.model, evicting(cfg, "fast_kvzip", options=options), 1, 32)
    m = cfg.model
    deeper = random_gates(m.num_layers + 1, m.embed_dim, m.num_kv_heads, 2)
    deeper["calibration"] = np.zeros((m.num_layers + 1, 1, m.num_kv_heads, 5))
    calibrate.save_gates(tmp_path / "deeper.npz", deeper)
    deep = {"gates": str(tmp_path / "deeper.npz"), "layerwise": False}
    with pytest.raises(ValueError, match=rf"scores of {m.num_layers + 1} layer.*calibrate them"):
        kvlab.init_cache(m, evicting(cfg, "fast_kvzip", ratio=0.5, options=deep), 1, 32)
    _, params, apply = build(cfg)
    wide = VARIANTS["gqa"]()
    wide.model.embed_dim *= 2
    other = gates_file(wide, tmp_path / "wide.npz")
    cache = kvlab.init_cache(
        cfg.model, evicting(cfg, "fast_kvzip", options={"gates": other}), 1, 32
    )
    with pytest.raises(ValueError, match="calibrate them for this model"):
        apply({"params": params}, random_tokens(cfg, (1, 4)), cache=cache)
    gates = random_gates(2, cfg.model.embed_dim, 2, 2)
    gates["bias"] = gates["bias"][:, :1]
    np.savez(tmp_path / "odd.npz", **gates)
    with pytest.raises(ValueError, match=r"do not fit its q_kernel.*'bias'"):
        kvlab.init_cache(
            cfg.model,
            evicting(cfg, "fast_kvzip", options={"gates": str(tmp_path / "odd.npz")}),
            1,
            32,
        )
