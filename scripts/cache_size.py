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
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli
from kvlab.cache.accounting import ROW_BYTES, elements_per_token_and_layer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:base", "kvlab config file.")
_LENGTHS = flags.DEFINE_list(
    "lengths", ["512", "2048", "8192", "32768", "131072"], "Sequence lengths."
)
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes.")
_COMPARE = flags.DEFINE_bool(
    "compare", False, "Also compare MHA, GQA, MQA and MLA per-token caches on this model."
)
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


def attention_variants(cfg) -> tuple[int, list[tuple[str, object]]]:
    """The model's heads under MHA, every GQA grouping, MQA and MLA.

    Head width d_h is the config's head_dim (for an MLA config: its nope_dim).
    The MLA variant is the config's own, or DeepSeek-V2's proportions
    (kv_rank = 4 d_h, rope_dim = d_h / 2) when the config is not MLA.
    """
    model = cfg.model
    width = model.mla.nope_dim if model.attention == "mla" else model.head_dim
    heads = model.num_heads
    variants = []
    for kv_heads in sorted({d for d in range(1, heads + 1) if heads % d == 0}, reverse=True):
        variant = model.copy_and_resolve_references()
        variant.update(attention="gqa", num_kv_heads=kv_heads, head_dim=width)
        name = {heads: "MHA", 1: "MQA"}.get(kv_heads, f"GQA, {kv_heads} groups")
        variants.append((name, variant))
    variant = model.copy_and_resolve_references()
    if model.attention != "mla":
        variant.mla.update(kv_rank=4 * width, rope_dim=width // 2, nope_dim=width, v_head_dim=width)
        variant.update(attention="mla", num_kv_heads=heads, head_dim=width + width // 2)
    variants.append((f"MLA, d_c={variant.mla.kv_rank}, d_R={variant.mla.rope_dim}", variant))
    return width, variants


def attention_comparison(cfg) -> dict:
    """Per-token cache of each attention design on one model (DeepSeek-V2 Table 1)."""
    width, variants = attention_variants(cfg)
    rows = []
    for name, model in variants:
        elements = elements_per_token_and_layer(model)
        rows.append(
            dict(
                attention=name,
                elements_per_token_and_layer=elements,
                bytes_per_token=kvlab.cache_bytes(model, cfg.cache, 1, 1) - ROW_BYTES,
            )
        )
    for row in rows:
        row["fraction_of_mha"] = row["bytes_per_token"] / rows[0]["bytes_per_token"]
        row["equivalent_gqa_groups"] = row["elements_per_token_and_layer"] / (2 * width)
    return dict(head_dim=width, rows=rows)


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    result = size_table(cfg, [int(n) for n in _LENGTHS.value], [int(b) for b in _BATCHES.value])
    result["config"] = cfg.model.to_dict() | {"cache": cfg.cache.to_dict()}
    if _COMPARE.value:
        result["attention_comparison"] = attention_comparison(cfg)
    if _JSON.value:
        print(json.dumps(result, indent=2))
        return
    m = cfg.model
    print(
        f"{cli.attention_label(m)}; {m.num_layers} layers, head_dim {m.head_dim}, "
        f"cache {cfg.cache.dtype}"
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
    if _COMPARE.value:
        comparison = result["attention_comparison"]
        print(
            f"\nper-token cache of this model's {m.num_heads} heads of width "
            f"d_h={comparison['head_dim']} under each attention design (DeepSeek-V2 Table 1):"
        )
        print(
            f"{'attention':<26} {'elements/layer':>15} {'bytes/token':>12} {'vs MHA':>7} "
            f"{'= GQA groups':>13}"
        )
        for row in comparison["rows"]:
            print(
                f"{row['attention']:<26} {row['elements_per_token_and_layer']:>15,} "
                f"{human(row['bytes_per_token']):>12} {row['fraction_of_mha']:>7.3f} "
                f"{row['equivalent_gqa_groups']:>13.2f}"
            )


if __name__ == "__main__":
    cli.run(main)
