"""TOVA (kvlab/cache/evict/tova.py) against its definition (arXiv:2401.06104):
each step keeps the tokens the step's last query attends to most, averaged over
all of the layer's query heads, the same for every KV head."""

import jax
import jax.numpy as jnp
import numpy as np

import kvlab
from tests.cache.test_evict import evicting, layer0_attention, run
from tests.helpers import VARIANTS, build, intermediates, random_tokens


def test_one_prefill_keeps_what_the_last_query_attends_to_most():
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=5)
    _, params, _ = build(cfg)
    last = layer0_attention(cfg, params, tokens)[:, :, -1]  # [B, N, T]: the last query's
    score = last.mean(1)  # over every query head
    _, cache = run(cfg, evicting(cfg, "tova", budget=5, recent=1), tokens, [12])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)  # [B, K, 5]
    for b in range(2):
        best = np.argsort(-score[b, :11], kind="stable")[:4]
        for h in range(cfg.model.num_kv_heads):  # every KV head keeps the same tokens
            np.testing.assert_array_equal(kept[b, h], np.sort([*best, 11]))


def test_decoding_evicts_what_each_step_attends_to_least():
    """Token by token through a budget of 5 (recent 0): each step adds its token
    and drops the kept one (or itself) its query gives the least attention,
    softmax over what is kept, mean over the heads: the layer's query and keys
    recomputed here from the weights (layer 0 reads the embeddings alone)."""
    cfg = VARIANTS["gqa"]()
    model = cfg.model
    tokens = random_tokens(cfg, (1, 14), seed=2)
    _, params, _ = build(cfg)
    captured = intermediates(cfg, params, tokens)["block_0"]["attention"]
    positions = jnp.arange(14)[None]
    rope = lambda x: kvlab.rope.apply_rope(  # noqa: E731
        x, positions, model.rope_theta, model.rope_scaling
    )
    q = np.asarray(rope(captured["query"]["__call__"][0]), np.float64)[0]  # [T, N, H]
    k = np.asarray(rope(captured["key"]["__call__"][0]), np.float64)[0]  # [T, K, H]
    groups = model.num_heads // model.num_kv_heads
    kept = []
    for t in range(14):
        candidates = [*kept, t]
        if len(candidates) > 5:
            keys = np.repeat(k[candidates], groups, axis=1)  # [C, N, H]
            s = np.einsum("nh,cnh->nc", q[t], keys) / np.sqrt(model.head_dim)
            p = np.exp(s - s.max(-1, keepdims=True))
            attention = (p / p.sum(-1, keepdims=True)).mean(0)  # [C]
            candidates.pop(int(np.argmin(attention)))
        kept = candidates
    _, cache = run(cfg, evicting(cfg, "tova", budget=5, recent=0), tokens, [1] * 14)
    layer = cache.layers[0]
    for h in range(model.num_kv_heads):
        np.testing.assert_array_equal(np.sort(np.asarray(layer.positions[0, h])), kept)


def test_its_bytes_are_the_budget_of_each_kv_head_and_a_position_per_slot():
    """Counted independently: per layer and row, K heads x budget slots of keys and
    values (float32, head_dim each) and an int32 position per slot; per row a
    length and error flags. tova keeps nothing else (no score per slot)."""
    cfg = VARIANTS["gqa"]()
    model = cfg.model
    cache_cfg = evicting(cfg, "tova", budget=6)
    cache = kvlab.init_cache(model, cache_cfg, batch_size=3, max_len=64)
    slots = model.num_kv_heads * 6
    per_layer = 2 * slots * model.head_dim * 4 + slots * 4
    expected = 3 * (model.num_layers * per_layer + 4 + 4)
    assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(model, cache_cfg, 3, 64) == expected
    assert all(layer.scores is None for layer in cache.layers)


def test_it_runs_quantized_paged_and_latent():
    """Through a KIVI cache's settling groups, page pools and a latent model: the
    logits are finite, and where the budget holds the sequence they are the full
    cache's."""
    for name, fields in (("gqa", {}), ("mla_absorbed", {})):
        cfg = VARIANTS[name]()
        tokens = random_tokens(cfg, (2, 9))
        full, _ = run(cfg, cfg.cache, tokens)
        held, _ = run(cfg, evicting(cfg, "tova", budget=16, **fields), tokens)
        np.testing.assert_allclose(held, full, atol=1e-5)
        paged = evicting(cfg, "tova", budget=4)
        paged.update(kind="paged", page_size=4)
        out, cache = run(cfg, paged, tokens)
        assert np.isfinite(out).all()
        assert int(jax.tree.leaves(cache.layers[0].positions)[0].shape[-1]) == 4
