"""kvlab.save_hf's checkpoints through transformers itself.

Runs only where torch and transformers import (pip install -e '.[hf]'); kvlab
needs neither, so elsewhere it is skipped and tests/checkpoints/hf/test_read.py, which compares
against logits transformers stored in the fixtures, stands in for it.
"""

import jax
import numpy as np
import pytest

import kvlab
from tests.checkpoints.hf.helpers import ALL, FIXTURES, reference
from tests.helpers import TOLERANCE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def transformers_logits(folder, tokens) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("name", ALL)
def test_transformers_computes_the_exported_fixture(name, tmp_path):
    cfg, params = kvlab.load_hf(FIXTURES / name)
    kvlab.save_hf(cfg, params, tmp_path)
    ref = reference(name)
    logits = transformers_logits(tmp_path, ref["tokens"])
    np.testing.assert_allclose(logits, ref["logits"], atol=TOLERANCE, rtol=0)


def model_section(**changes):
    """The tiny model with fields changed; sections given as dicts are updated."""
    model = kvlab.base_config("tiny").model
    for key, value in changes.items():
        if isinstance(value, dict):
            model[key].update(value)
        else:
            model[key] = value
    return model


# kvlab models no fixture covers, each exported as the family that computes it.
KVLAB_MODELS = {
    "llama_tied_yarn": dict(
        num_kv_heads=2,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_len=32, mscale=0.0),
    ),
    "qwen3_llama3_rope": dict(
        qk_norm=True,
        rope_scaling=dict(type="llama3", factor=8.0, original_max_len=64),
        tie_embeddings=False,
    ),
    # Gemma-3-like hybrid attention: sliding layers of window 3 between full ones.
    "qwen2_hybrid": dict(
        qkv_bias=True,
        num_layers=4,
        sliding_window=3,
        layer_types=("sliding", "full", "sliding", "full"),
    ),
    "deepseek_v2_dense": dict(
        attention="mla",
        head_dim=24,
        mla=dict(kv_rank=32, q_rank=24, rope_dim=8, nope_dim=16, v_head_dim=16),
    ),
    "deepseek_v2_groups": dict(
        attention="mla",
        head_dim=24,
        mla=dict(kv_rank=32, rope_dim=8, nope_dim=16, v_head_dim=16),
        moe=dict(
            num_experts=8,
            experts_per_token=2,
            expert_dim=16,
            num_groups=4,
            groups_per_token=2,
            num_shared_experts=2,
            first_dense_layers=1,
        ),
    ),
    "deepseek_v3_groups": dict(
        attention="mla",
        head_dim=24,
        mla=dict(kv_rank=32, q_rank=24, rope_dim=8, nope_dim=16, v_head_dim=16),
        moe=dict(
            num_experts=8,
            experts_per_token=2,
            expert_dim=16,
            num_groups=4,
            groups_per_token=2,
            routing="sigmoid",
            normalize_weights=True,
            routed_scale=2.5,
        ),
        rope_scaling=dict(
            type="yarn", factor=4.0, original_max_len=32, mscale=0.707, mscale_all_dim=0.707
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(KVLAB_MODELS))
def test_transformers_computes_what_kvlab_computes(name, tmp_path):
    cfg = kvlab.base_config("tiny")
    cfg.model = model_section(**KVLAB_MODELS[name])
    kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    # Norm scales, biases and the router bias start at 1 or 0: move every weight.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noise = [
        0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
    ]
    params = jax.tree.unflatten(tree, [x + n for x, n in zip(leaves, noise, strict=True)])
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12), np.int32)
    expected, _ = jax.jit(kvlab.Transformer(cfg.model).apply)({"params": params}, tokens)
    kvlab.save_hf(cfg, params, tmp_path)
    logits = transformers_logits(tmp_path, tokens)
    np.testing.assert_allclose(logits, np.asarray(expected), atol=TOLERANCE, rtol=0)
