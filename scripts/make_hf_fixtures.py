"""Writes the Hugging Face checkpoints kvlab's import and export are tested on.

    pip install -e '.[hf]'     # torch and transformers, needed by this script only
    python scripts/make_hf_fixtures.py --out tests/fixtures/hf

Each fixture is a tiny random model of one family, saved by transformers' own
`save_pretrained(safe_serialization=True)` in float32 (config.json,
model.safetensors, or shards and model.safetensors.index.json), with
`reference.npz` beside it: a fixed token batch `tokens` int32[B, T] (T = 12,
or 24 for the sliding-window fixture: six windows), the model's
`logits` float32[B, T, V] on it, and `generated` int32[B, T + 8], its greedy
continuation by `generate`. tests/checkpoints/hf/ checks kvlab.load_hf
against these without torch. Seeds are fixed, so reruns write the same models
(up to torch's random-number stream across versions).

Weights are redrawn at a scale where every part of the model moves the
logits (transformers initialises with std 0.02, leaving logits near zero):
linear maps and embeddings with std 1/sqrt(fan-in), norm scales near 1,
biases near 0.1. The script prints the smallest gap between the two best
logits along the greedy path: kvlab's greedy tokens can only be compared where
it is well above float32 rounding.

A fixture with a sliding window proves something only if transformers applies
it: the script recomputes its logits with the window removed (same weights)
and in both attention implementations, eager and sdpa, and stops unless the
window changes every position from the window on and nothing before it.

This script deliberately does not import kvlab: it runs in an environment
with torch and transformers, which kvlab itself does not need.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
import transformers

VOCAB = 256  # kvlab's byte vocabulary: a loaded config validates with the default data section
BATCH, LENGTH, NEW_TOKENS = 2, 12, 8
# Fixtures whose token batch is longer than LENGTH: many positions past the window.
LENGTHS = {"mistral_window": 24}

# name -> (config class, config fields, save_pretrained keywords)
FIXTURES = {
    # GQA (4 query heads, 2 KV heads), untied, Llama 3.1 RoPE bands that all
    # fall inside head_dim 16: kept, blended and interpolated frequencies.
    "llama": (
        transformers.LlamaConfig,
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    # q/k/v biases, tied embeddings, a large RoPE base.
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
        ),
        {},
    ),
    # Per-head q/k RMSNorm, head_dim 24 != hidden / heads, linear RoPE scaling.
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        {},
    ),
    # MQA (one KV head), no sliding window, sharded into several files.
    "mistral": (
        transformers.MistralConfig,
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        {"max_shard_size": "100KB"},
    ),
}

# DeepSeek-V2: MLA with low-rank queries, then without; one dense layer, two
# MoE layers (4 routed experts, 2 per token, one shared); yarn RoPE with mscale.
# Greedy routing: transformers' DeepSeek-V2 ignores norm_topk_prob, so it stays False.
_DEEPSEEK = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    rms_norm_eps=1e-5,  # the latent norms keep 1e-6 whatever this says
    topk_method="greedy",
    norm_topk_prob=False,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)
FIXTURES["deepseek_v2_q_lora"] = (
    transformers.DeepseekV2Config,
    dict(_DEEPSEEK, q_lora_rank=12),
    {},
)
FIXTURES["deepseek_v2"] = (transformers.DeepseekV2Config, dict(_DEEPSEEK, q_lora_rank=None), {})
# DeepSeek-V3: sigmoid routing with its score-correction bias, 2 expert groups
# of which a token may use 1, normalised weights; plain RoPE.
FIXTURES["deepseek_v3"] = (
    transformers.DeepseekV3Config,
    dict(
        {k: v for k, v in _DEEPSEEK.items() if k not in ("topk_method", "rope_scaling")},
        q_lora_rank=12,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
    ),
    {},
)
# Mistral with a sliding window of 4 (each query sees its last 4 positions),
# GQA 4/2, untied. Added last: a fixture's seed is its place in this dict.
FIXTURES["mistral_window"] = (
    transformers.MistralConfig,
    dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        tie_word_embeddings=False,
    ),
    {},
)


def redraw_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights at a scale where every part of the model moves the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * noise)  # RMSNorm scales
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * noise)
            else:  # embeddings [V, D], [out, in] linear maps, stacked experts [E, out, in]
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def check_window(model: torch.nn.Module, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """Stops unless transformers applies model's sliding window W in eager and sdpa
    attention: without the window (same weights) positions < W keep their logits
    and every position >= W changes."""
    window = model.config.sliding_window
    for implementation in ("eager", "sdpa"):
        for sliding_window in (window, None):
            config = model.config.__class__.from_dict(
                dict(model.config.to_dict(), sliding_window=sliding_window)
            )
            other = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=implementation
            ).eval()
            other.load_state_dict(model.state_dict())
            with torch.no_grad():
                change = (other(tokens).logits.float() - logits).abs().amax(-1)  # [B, T]
            if sliding_window is not None:
                assert float(change.max()) < 1e-5, (implementation, float(change.max()))
                continue
            before, after = float(change[:, :window].max()), float(change[:, window:].min())
            assert before < 1e-5 and after > 1e-2, (implementation, before, after)
            print(
                f"  {implementation}: removing window {window} moves logits at positions "
                f">= {window} by >= {after:.2g}, before it by {before:.2g}"
            )


def write_fixture(
    folder: str, config_class, fields: dict, save_options: dict, seed: int, length: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    config = config_class(vocab_size=VOCAB, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw_weights(model, generator)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True, **save_options)

    tokens = torch.randint(0, VOCAB, (BATCH, length), generator=generator)
    with torch.no_grad():
        logits = model(tokens).logits.float()
        if getattr(model.config, "sliding_window", None) is not None:
            check_window(model, tokens, logits)
        generated = model.generate(
            tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        path = model(generated).logits[:, length - 1 : -1].float()
    # generate's cache computes what one forward over its output computes
    assert torch.equal(path.argmax(-1), generated[:, length:]), folder
    best_two = torch.topk(path, 2, dim=-1).values
    gap = float((best_two[..., 0] - best_two[..., 1]).min())
    np.savez_compressed(
        os.path.join(folder, "reference.npz"),
        tokens=tokens.numpy().astype(np.int32),
        logits=logits.numpy(),
        generated=generated.numpy().astype(np.int32),
    )
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    total = sum(sizes.values()) / 1024
    print(f"{folder}: {total:.0f} KB, greedy gap {gap:.2g}", json.dumps(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/fixtures/hf", help="folder for the fixtures")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="fixtures to write")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for seed, (name, (config_class, fields, save_options)) in enumerate(FIXTURES.items()):
        if args.only and name not in args.only:
            continue
        folder = os.path.join(args.out, name)
        length = LENGTHS.get(name, LENGTH)
        write_fixture(folder, config_class, fields, save_options, seed, length)


if __name__ == "__main__":
    main()
