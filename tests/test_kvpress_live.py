"""kvlab's eviction methods against NVIDIA kvpress itself: the same tokens kept.

Runs only where torch, transformers and kvpress import (pip install -e '.[peer]');
kvlab needs none of them, so elsewhere it is skipped. A small random model is
written by kvlab.save_hf and loaded by transformers; kvpress compresses a prompt
with each press once after its prefill, and kvlab compresses the same prompt
with the method's kvpress preset (kvlab.eval.benchmark.kvpress_evict, the
context compressed once after its prefill, cache.evict.when='after_prefill').
Every layer's every KV head must keep exactly kvpress's tokens (Jaccard 1.0):
kvpress's kept keys are found among the full prefill's keys, its AdaKV's by
the positions it masks. Budgets are chosen where neither side breaks a tie.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvlab
from kvlab.eval.benchmark import benchmark_cache
from kvlab.eval.calibrate import q_filters, save_filters

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

LENGTH, KEPT = 100, 0.5  # the prompt's tokens, and the share of them kept


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(kvlab config, params, transformers loader) of one random GQA model: the
    loader takes the attention implementation (ObservedAttentionPress reads eager
    attention's weights; AdaKVPress and ChunkKVPress refuse them)."""
    cfg = kvlab.base_config("tiny")
    cfg.model.update(num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=256)
    kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(3))
    folder = tmp_path_factory.mktemp("hf")
    kvlab.save_hf(cfg, params, folder)

    def load(attention: str):
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=attention
        ).eval()

    return cfg, params, load


@pytest.fixture(scope="module")
def filters(model, tmp_path_factory):
    """(kvlab's Q-Filters of the model, calibrated on random tokens, and their file)."""
    cfg, params, _ = model
    found = q_filters(cfg.model, params, np.random.default_rng(1).integers(0, 256, (2, 64)))
    path = str(tmp_path_factory.mktemp("calibration") / "qfilters.npz")
    save_filters(path, found)
    return found, path


def prompt():
    return np.random.default_rng(0).integers(0, 256, (1, LENGTH)).astype(np.int32)


def kvpress_kept(hf, press) -> list[list[set[int]]]:
    """Per layer, per KV head: the positions kvpress keeps of the prompt."""
    ids = torch.as_tensor(prompt(), dtype=torch.long)
    with torch.no_grad():
        full = transformers.DynamicCache()
        hf(ids, past_key_values=full)
        cache = transformers.DynamicCache()
        with press(hf):
            hf(ids, past_key_values=cache)
    out = []
    for index, (before, after) in enumerate(zip(full.layers, cache.layers, strict=True)):
        attention = hf.model.layers[index].self_attn
        masked = getattr(attention, "masked_key_indices", None)
        heads = []
        for h in range(before.keys.shape[1]):
            if masked is not None:  # AdaKV masks what it evicts in place
                _, head, position = (x.numpy() for x in masked)
                heads.append(set(range(LENGTH)) - set(position[head == h].tolist()))
                continue
            kept = after.keys[0, h].numpy()  # [n_kept, H]: which of the prompt's keys
            distance = np.linalg.norm(kept[:, None] - before.keys[0, h].numpy()[None], axis=-1)
            assert distance.min(-1).max() < 1e-5
            heads.append(set(distance.argmin(-1).tolist()))
        out.append(heads)
    return out


def kvlab_kept(cfg, params, method, ratio, **fields) -> list[list[set[int]]]:
    cache_cfg = benchmark_cache(cfg.cache, method, ratio, headroom=0)
    cache_cfg.evict.update(fields)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, LENGTH)
    _, cache = kvlab.Transformer(cfg.model).apply(
        {"params": params}, prompt(), cache=cache, compress=True
    )
    out = []
    for layer in cache.layers:
        p, positions = layer.policy, np.asarray(layer.positions[0])
        if p.pooled:
            tags = positions[0][positions[0] >= 0]
            out.append(
                [
                    set((tags[tags % p.kv_heads == h] // p.kv_heads).tolist())
                    for h in range(p.kv_heads)
                ]
            )
        else:
            out.append([set(row[row >= 0].tolist()) for row in positions])
    return out


def qfilter_press(ratio: float, found: np.ndarray):
    """kvpress's QFilterPress holding kvlab's filters (it would fetch its own from a hub)."""
    press = kvpress.QFilterPress(ratio)
    press.post_init_from_model = lambda model: None
    press.q_filters = torch.as_tensor(found)
    return press


# kvpress's press of each method (compression_ratio r) and kvlab's fields beside the preset.
CASES = {
    "knorm": (lambda r: kvpress.KnormPress(r), {}),
    "keydiff": (lambda r: kvpress.KeyDiffPress(r), {}),
    "tova": (lambda r: kvpress.TOVAPress(r), {}),
    "h2o": (lambda r: kvpress.ObservedAttentionPress(r), {}),
    "expected_attention": (lambda r: kvpress.ExpectedAttentionPress(r), {}),
    "snapkv": (
        lambda r: kvpress.SnapKVPress(r, window_size=8, kernel_size=5),
        dict(obs_window=8, recent=8),
    ),
    "adakv": (
        lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(r, window_size=8, kernel_size=5), 0.2),
        dict(obs_window=8, recent=8),
    ),
    # 100 tokens: 2 sinks, 5 scored partitions of 16 and a tail of 18; keeping 50 keeps
    # the 6 best ranks of each partition, no tie at the cut.
    "lagkv": (
        lambda r: kvpress.LagKVPress(r, n_sink=2, lag_size=16),
        dict(options={"lag_size": 16, "sink_tokens": 2}),
    ),
    "criticalkv:knorm": (lambda r: kvpress.CriticalKVPress(kvpress.KnormPress(r)), {}),
    # An epsilon that weighs against SnapKV's scores: their scale (the window's mean) counts.
    "criticalkv:snapkv": (
        lambda r: kvpress.CriticalKVPress(
            kvpress.SnapKVPress(r, window_size=8, kernel_size=5), epsilon=1e-2
        ),
        dict(obs_window=8, recent=8, options={"epsilon": 1e-2}),
    ),
    # 10 chunks of 10: kvpress keeps int(10 x 0.5) whole chunks, kvlab its budget of 50.
    "chunkkv:knorm": (
        lambda r: kvpress.ChunkKVPress(kvpress.KnormPress(r), chunk_length=10),
        dict(options={"chunk_length": 10}),
    ),
}


@pytest.mark.parametrize("method", [*CASES, "qfilter"])
def test_kvlab_keeps_kvpress_tokens(model, filters, method):
    cfg, params, load = model
    if method == "qfilter":
        press, fields = qfilter_press(1 - KEPT, filters[0]), dict(options={"filters": filters[1]})
    else:
        make, fields = CASES[method]
        press = make(1 - KEPT)
    theirs = kvpress_kept(load("eager" if method == "h2o" else "sdpa"), press)
    ours = kvlab_kept(cfg, params, method, KEPT, **fields)
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        for head, (a, b) in enumerate(zip(mine, peer, strict=True)):
            assert a == b, (
                f"{method}: layer {layer}, KV head {head}: only kvlab keeps {sorted(a - b)}, "
                f"only kvpress {sorted(b - a)}"
            )
