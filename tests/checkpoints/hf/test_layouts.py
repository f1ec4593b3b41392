"""Checkpoint tensors -> kvlab parameters (kvlab/checkpoints/hf/layouts.py): laid out
as init_params lays them out, DeepSeek's interleaved RoPE channels in halves.

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import jax
import numpy as np

import kvlab
from tests.checkpoints.hf.helpers import (
    FIXTURES,
    read_tensors,
)


def test_params_are_laid_out_as_init_params(loaded):
    for name in ("qwen2", "deepseek_v3"):
        cfg, params = loaded(name)
        expected = jax.eval_shape(lambda c=cfg: kvlab.init_params(c.model, jax.random.key(0)))
        assert jax.tree.structure(params) == jax.tree.structure(expected)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
            lambda x: (x.shape, x.dtype), expected
        )


def test_interleaved_rope_channels_are_reordered_to_halves(loaded):
    """DeepSeek's rope key rows [latent; rope] come back with channels 0,2,4,.. then 1,3,5,.."""
    cfg, params = loaded("deepseek_v2")
    stored = read_tensors(FIXTURES / "deepseek_v2")[
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    ]
    rank, rope = cfg.model.mla.kv_rank, cfg.model.mla.rope_dim
    key_rope = np.asarray(params["block_0"]["attention"]["key_rope"]["kernel"])[:, 0]  # [D, Hr]
    np.testing.assert_array_equal(key_rope[:, : rope // 2], stored[rank::2].T)
    np.testing.assert_array_equal(key_rope[:, rope // 2 :], stored[rank + 1 :: 2].T)
