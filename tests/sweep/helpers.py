"""What the sweep's tests share: a grid of two model entries and three cache
entries, and a sweep config of two training steps over a test corpus."""

from tests.helpers import run_config

GRID = {
    "models": {
        "mqa": {"model.num_kv_heads": 1},
        "mla": {
            "model.attention": "mla",
            "model.num_kv_heads": 4,
            "model.head_dim": 24,
            "model.mla.kv_rank": 32,
        },
    },
    "caches": {
        "16bit": {},
        "K8V4": {"cache.k_bits": 8, "cache.v_bits": 4},
        "L4R16": {"cache.latent_bits": 4},
    },
}


def sweep_config(corpus):
    cfg = run_config(corpus, steps=2, checkpoint_every=2, eval_every=2)
    cfg.eval.update(batch_size=2, num_batches=1, chunk=32, split="test")
    cfg.sweep = {"name": "test_sweep"}
    return cfg
