"""How big the KV cache gets, against the weights, over context length and batch.

    python scripts/cache_size.py --config configs/gqa.py:base
    python scripts/cache_size.py --config configs/mha.py:small --json

For each batch size and sequence length: the cache's analytic bytes
(kvlab.cache_bytes), its measured bytes (kvlab.tree_bytes of an abstract cache,
nothing allocated), and the ratio to the weights' bytes. The cache grows
linearly in both; the row where the ratio first passes 1 is marked, and the
number of cached tokens (batch x length) at which the cache outgrows the
weights is printed.
"""

import json

import jax
from absl import app, flags
from ml_collections import config_flags

import kvlab

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:base", "kvlab config file.")
_LENGTHS = flags.DEFINE_list(
    "lengths", ["512", "2048", "8192", "32768", "131072"], "Sequence lengths."
)
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024


def size_table(cfg, lengths, batch_sizes) -> dict:
    weights = kvlab.tree_bytes(
        jax.eval_shape(lambda: kvlab.init_params(cfg.model, jax.random.key(0)))
    )
    # Bytes one more cached token costs (the difference removes per-row bookkeeping).
    per_token = kvlab.cache_bytes(cfg.model, cfg.cache, 1, 2) - kvlab.cache_bytes(
        cfg.model, cfg.cache, 1, 1
    )
    rows = []
    for batch in batch_sizes:
        for length in lengths:
            analytic = kvlab.cache_bytes(cfg.model, cfg.cache, batch, length)
            abstract = jax.eval_shape(
                lambda b=batch, n=length: kvlab.init_cache(cfg.model, cfg.cache, b, n)
            )
            rows.append(
                dict(
                    batch_size=batch,
                    seq_len=length,
                    cache_bytes=analytic,
                    measured_bytes=kvlab.tree_bytes(abstract),
                    ratio_to_weights=analytic / weights,
                )
            )
    return dict(
        weights_bytes=weights,
        cache_bytes_per_token=per_token,
        tokens_where_cache_exceeds_weights=-(-weights // per_token),
        rows=rows,
    )


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    result = size_table(cfg, [int(n) for n in _LENGTHS.value], [int(b) for b in _BATCHES.value])
    result["config"] = cfg.model.to_dict() | {"cache": cfg.cache.to_dict()}
    if _JSON.value:
        print(json.dumps(result, indent=2))
        return
    m = cfg.model
    print(
        f"{m.num_layers} layers, {m.num_heads} query heads, {m.num_kv_heads} KV heads, "
        f"head_dim {m.head_dim}, cache {cfg.cache.dtype}"
    )
    print(
        f"weights: {human(result['weights_bytes'])}; cache per token: "
        f"{human(result['cache_bytes_per_token'])}; the cache outgrows the weights past "
        f"{result['tokens_where_cache_exceeds_weights']:,} cached tokens (batch x length)"
    )
    print(f"{'batch':>6} {'seq_len':>8} {'cache':>12} {'measured':>12} {'cache/weights':>14}")
    previous = None
    for row in result["rows"]:
        if row["batch_size"] != previous:
            previous, marked = row["batch_size"], False
        mark = ""
        if row["ratio_to_weights"] > 1 and not marked:
            mark, marked = "  <- cache > weights", True
        print(
            f"{row['batch_size']:>6} {row['seq_len']:>8} {human(row['cache_bytes']):>12} "
            f"{human(row['measured_bytes']):>12} {row['ratio_to_weights']:>14.3f}{mark}"
        )


if __name__ == "__main__":
    app.run(main)
