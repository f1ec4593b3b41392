"""kvlab's eviction methods against NVIDIA kvpress itself: the same tokens kept.

Runs only where torch, transformers and kvpress import (pip install -e '.[peer]');
kvlab needs none of them, so elsewhere it is skipped. A small random model is
written by kvlab.save_hf and loaded by transformers; kvpress compresses a prompt
with each press once after its prefill, and kvlab compresses the same prompt
with the method's kvpress preset (kvlab.eval.benchmark.kvpress_evict, the
context compressed once after its prefill, cache.evict.when='after_prefill').
Every layer's every KV head must keep exactly kvpress's tokens (Jaccard 1.0):
kvpress's kept keys are found among the full prefill's keys, its AdaKV's by
the positions it masks (scripts/kvpress_agreement.py holds the comparison and
runs it on a real model). Budgets are chosen where neither side breaks a tie.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import numpy as np
import pytest

import kvlab
from kvlab.eval.calibrate import (
    duo_patterns,
    fast_kvzip_calibration,
    init_gates,
    kvzip_calibration,
    q_filters,
    save_filters,
    save_gates,
    save_kvzip_scores,
    save_patterns,
)
from tests.helpers import ROOT

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


@functools.cache  # its flags are defined once
def agreement():
    """scripts/kvpress_agreement.py, which holds the comparison (loaded by its path)."""
    spec = importlib.util.spec_from_file_location(
        "kvpress_agreement", ROOT / "scripts" / "kvpress_agreement.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    compare = agreement()
    if method == "qfilter":
        press = compare.qfilter_press(1 - KEPT, filters[0])
        fields = dict(options={"filters": filters[1]})
    else:
        make, fields = CASES[method]
        press = make(1 - KEPT)
    theirs = compare.kvpress_kept(load("eager" if method == "h2o" else "sdpa"), press, prompt())
    ours = compare.kvlab_kept(cfg, params, method, KEPT, prompt(), **fields)
    assert_same(method, ours, theirs)


def assert_same(method, ours, theirs):
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        for head, (a, b) in enumerate(zip(mine, peer, strict=True)):
            assert a == b, (
                f"{method}: layer {layer}, KV head {head}: only kvlab keeps {sorted(a - b)}, "
                f"only kvpress {sorted(b - a)}"
            )


def assert_nested(method, ours, theirs, heads: int):
    """Per layer, kvlab keeps a subset of kvpress's tokens (over the layer's heads
    together) short of it by under 2 x `heads`: both keep the layer's best, kvpress
    as many as all layers' tokens ranked together give it, kvlab that count to
    its heads' slots; the layers keep unequal counts."""
    counts = []
    for layer, (mine, peer) in enumerate(zip(ours, theirs, strict=True)):
        a = {(h, p) for h, kept in enumerate(mine) for p in kept}
        b = {(h, p) for h, kept in enumerate(peer) for p in kept}
        assert a <= b and len(b - a) < 2 * heads, (method, layer, sorted(a - b), sorted(b - a))
        counts.append(len(b))
    assert len(set(counts)) > 1, (method, counts)


def test_think_keeps_kvpress_tokens_and_channels(model):
    """ComposedPress([SnapKVPress, ThinKPress(0.5)]) is think:snapkv: the same
    tokens, and in every layer and KV head the same half of the key channels
    (those kvpress leaves unzeroed, kvlab stores)."""
    cfg, params, load = model
    compare = agreement()
    make, fields = CASES["snapkv"]
    press = kvpress.ComposedPress([make(1 - KEPT), kvpress.ThinKPress(0.5)])
    theirs = compare.kvpress_kept(load("sdpa"), press, prompt())
    ours = compare.kvlab_kept(cfg, params, "think:snapkv", KEPT, prompt(), **fields)
    assert_same("think:snapkv", ours, theirs)
    cache = compare.kvlab_compressed(cfg, params, "think:snapkv", KEPT, prompt(), **fields)
    channels = compare.kvpress_channels(load("sdpa"), press, prompt())
    assert {len(head) for layer in channels for head in layer} == {cfg.model.head_dim // 2}
    assert_same("think:snapkv channels", compare.kvlab_channels(cache), channels)


def test_per_layer_and_composed_presses_keep_kvpress_tokens(model):
    """PerLayerCompressionPress over KnormPress (compression 0.25, 0.5, 0.75 by
    layer) is per_layer:knorm with weights 0.75, 0.5, 0.25 at ratio 0.5; ComposedPress
    of KeyDiffPress then KnormPress, each at 0.5, is keydiff+knorm keeping 0.25
    with share 0.5 (knorm scores each survivor alone)."""
    cfg, params, load = model
    compare = agreement()
    press = kvpress.PerLayerCompressionPress(kvpress.KnormPress(), [0.25, 0.5, 0.75])
    theirs = compare.kvpress_kept(load("sdpa"), press, prompt())
    assert [len(layer[0]) for layer in theirs] == [75, 50, 25]
    weights = {"options": {"weights": [0.75, 0.5, 0.25]}}
    assert_same(
        "per_layer",
        compare.kvlab_kept(cfg, params, "per_layer:knorm", 0.5, prompt(), **weights),
        theirs,
    )
    press = kvpress.ComposedPress([kvpress.KeyDiffPress(0.5), kvpress.KnormPress(0.5)])
    theirs = compare.kvpress_kept(load("sdpa"), press, prompt())
    assert {len(head) for layer in theirs for head in layer} == {25}
    ours = compare.kvlab_kept(cfg, params, "keydiff+knorm", 0.25, prompt(), options={"share": 0.5})
    assert_same("composed", ours, theirs)


def test_duo_attention_keeps_kvpress_tokens(model, tmp_path):
    """DuoAttentionPress with kvlab's calibrated head scores (its pattern loader
    handed them, sinks 4, recent 16) streams the same half of the heads: kvlab at
    the budget they need (60 = 3 retrieval heads x 100 + 3 streaming x 20, over 6)
    keeps exactly the tokens kvpress leaves unmasked."""
    cfg, params, load = model
    patterns = duo_patterns(cfg.model, params, np.random.default_rng(2).integers(0, 256, (2, 64)))
    path = str(tmp_path / "duo.npz")
    save_patterns(path, patterns)
    press = kvpress.DuoAttentionPress(head_compression_ratio=0.5)
    press.load_attention_pattern = lambda model: (4, 16, patterns.astype(np.float64))
    theirs = agreement().kvpress_kept(load("sdpa"), press, prompt())
    assert sorted(len(head) for layer in theirs for head in layer) == [20] * 3 + [100] * 3
    options = {"patterns": path, "head_ratio": 0.5, "sink_size": 4, "recent_size": 16}
    ours = agreement().kvlab_kept(
        cfg, params, "duo_attention", KEPT, prompt(), budget=60, options=options
    )
    assert_same("duo_attention", ours, theirs)


@pytest.mark.parametrize("layerwise", [True, False])
def test_kvzip_keeps_kvpress_tokens(model, tmp_path, layerwise):
    """KVzipPress reads the model folder's tokenizer for its request to repeat the
    context: with a byte-level one of the model's 256 ids (no chat template) it
    repeats the plain context, as kvlab's probes do. layerwise (each layer its
    share): both keep the same half of every layer's tokens over its heads
    together. Not layerwise (all layers' tokens ranked together; kvlab's shares
    calibrated on the prompt itself, calibrate.kvzip_calibration): nested sets
    (`assert_nested`)."""
    tokenizers = pytest.importorskip("tokenizers")
    cfg, params, _ = model
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(["".join(alphabet)], trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = kvlab.data.load_tokenizer(str(tmp_path / "tokenizer.json"))
    folder = tmp_path / "hf"
    kvlab.save_hf(cfg, params, folder, tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    press = kvpress.KVzipPress(1 - KEPT, layerwise=layerwise)
    theirs = agreement().kvpress_kept(hf, press, prompt())
    options = {"layerwise": layerwise}
    if not layerwise:
        options["scores"] = str(tmp_path / "scores.npz")
        scores = kvzip_calibration(cfg.model, params, prompt(), tokenizer.encode)
        save_kvzip_scores(options["scores"], scores)
    ours = agreement().kvlab_kept(
        cfg, params, "kvzip", KEPT, prompt(), tokenizer.encode, options=options
    )
    if layerwise:
        assert sum(len(head) for head in theirs[0]) == LENGTH * cfg.model.num_kv_heads // 2
        assert_same("kvzip", ours, theirs)
    else:
        assert_nested("kvzip", ours, theirs, cfg.model.num_kv_heads)


def random_gates(m, seed: int) -> dict:
    """Fast KVzip's gates for model config `m`: untrained projections, random sink
    keys and bias."""
    gates = init_gates(m.num_layers, m.embed_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads)
    gates = {name: np.asarray(array) for name, array in gates.items()}
    rng = np.random.default_rng(seed)
    gates["sink_keys"] = rng.normal(size=gates["sink_keys"].shape)
    gates["bias"] = rng.normal(size=gates["bias"].shape)
    return gates


def test_fast_kvzip_keeps_kvpress_tokens(model, tmp_path):
    """FastKVzipPress (layerwise) holding kvlab's gates as its torch modules (random
    ones: untrained projections, random sink keys and bias) scores each token from
    its attention input as kvlab does: both keep the same half of every layer's
    tokens over its heads together, the first 4 and the last 2 (2% of 100) first."""
    cfg, params, load = model
    m = cfg.model
    gates = random_gates(m, 4)
    path = str(tmp_path / "gates.npz")
    save_gates(path, gates)
    theirs = agreement().kvpress_kept(
        load("sdpa"), agreement().fast_kvzip_press(1 - KEPT, gates), prompt()
    )
    assert sum(len(head) for head in theirs[0]) == LENGTH * m.num_kv_heads // 2
    ours = agreement().kvlab_kept(
        cfg, params, "fast_kvzip", KEPT, prompt(), options={"gates": path, "layerwise": True}
    )
    assert_same("fast_kvzip", ours, theirs)


def test_fast_kvzip_across_layers_keeps_kvpress_tokens(model, tmp_path):
    """FastKVzipPress(layerwise=False) ranks all layers' tokens together; kvlab's
    layerwise=False gives each layer the share that ranking gave the calibration
    contexts, here the prompt itself (calibrate.fast_kvzip_calibration): every
    layer keeps the best of its tokens on both sides, kvlab to its KV heads'
    slots, so the sets nest and differ by under 2 x K tokens; the layers' counts
    are unequal."""
    cfg, params, load = model
    m = cfg.model
    gates = random_gates(m, 5)
    press = agreement().fast_kvzip_press(1 - KEPT, gates, layerwise=False)
    theirs = agreement().kvpress_kept(load("sdpa"), press, prompt())
    gates["calibration"] = fast_kvzip_calibration(m, params, gates, prompt())
    path = str(tmp_path / "gates.npz")
    save_gates(path, gates)
    options = {"gates": path, "layerwise": False}
    ours = agreement().kvlab_kept(cfg, params, "fast_kvzip", KEPT, prompt(), options=options)
    assert_nested("fast_kvzip", ours, theirs, m.num_kv_heads)


def test_decoding_press_keeps_kvpress_tokens(model):
    """DecodingPress over KnormPress against cache.evict.when='decoding': 60 tokens
    prefilled whole, 60 more fed one by one with their positions, as kvpress's
    pipeline decodes, every 8 steps each head back to 40 (seven compressions);
    then every layer and KV head holds the same keys on both sides
    (scripts/kvpress_agreement.py's decoding_agreement)."""
    cfg, params, load = model
    # No id twice: a key's norm is its token's before RoPE in layer 0, so a repeated
    # id would tie there and either side could keep either copy.
    ids = np.random.default_rng(5).permutation(256)[None, :120].astype(np.int32)
    jaccard = agreement().decoding_agreement(load("sdpa"), cfg, params, "knorm", ids, 2 / 3, 8)
    assert len(jaccard) == cfg.model.num_layers * cfg.model.num_kv_heads
    assert min(jaccard) == 1.0


def test_decoding_press_over_snapkv_scores_by_the_buffered_queries(model):
    """DecodingPress over SnapKVPress scores each compression by the last 4 of the
    hidden states it buffered since the last one; kvlab's decoding layer by the
    queries it buffered (evict.QueryBuffer): the same keys in every layer and KV
    head after seven compressions. No pooling (kernel 1): kvpress keeps a compressed
    cache in score order, so its later compressions would pool other neighbours."""
    cfg, params, load = model
    ids = np.random.default_rng(6).permutation(256)[None, :120].astype(np.int32)
    base = kvpress.SnapKVPress(window_size=4, kernel_size=1)
    jaccard = agreement().decoding_agreement(
        load("sdpa"), cfg, params, "snapkv", ids, 2 / 3, 8, base, obs_window=4, kernel=1, recent=4
    )
    assert len(jaccard) == cfg.model.num_layers * cfg.model.num_kv_heads
    assert min(jaccard) == 1.0
