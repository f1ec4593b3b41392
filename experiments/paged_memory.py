"""KV memory wasted, and sequences that fit a memory budget: paged against contiguous.

    python experiments/paged_memory.py --workdir runs/paged_memory
    python experiments/paged_memory.py --config configs/mla.py:base --budget_gib=40

A workload of sequences with log-normal prompt and output lengths (the shape
vLLM's paper measures) is laid into a cache two ways:

- contiguous: each sequence reserves max_len tokens up front (a dense cache of
  capacity max_len per row, since its final length is unknown when it starts);
- paged: each sequence takes pages of cache.page_size tokens from one pool
  (kvlab.cache.PageAllocator) as it grows, and returns them when it finishes.

Waste is reserved-but-unused token slots over reserved slots, once every
sequence has reached its final length. The budget question packs sequences, in
arrival order, into `--budget_gib` of cache (bytes per token from
kvlab.cache_bytes for --config) and counts how many fit. Writes results.json
and memory.png under --workdir.
"""

import json
import os

import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli
from kvlab.cache import OutOfPages, PageAllocator

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:base", "Model and cache.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/paged_memory", "Where results go.")
_SEQUENCES = flags.DEFINE_integer("sequences", 2000, "Sequences in the workload.")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "Longest sequence the model serves.")
_PAGE_SIZES = flags.DEFINE_list("page_sizes", ["8", "16", "32", "64"], "Page sizes to compare.")
_BUDGET = flags.DEFINE_float("budget_gib", 8.0, "Cache memory for the packing question (GiB).")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")


def workload(count: int, max_len: int, seed: int) -> np.ndarray:
    """Final lengths (prompt + output) of `count` sequences, log-normal, capped at max_len."""
    rng = np.random.default_rng(seed)
    prompt = rng.lognormal(mean=np.log(160), sigma=0.9, size=count)
    output = rng.lognormal(mean=np.log(120), sigma=0.9, size=count)
    return np.clip(np.round(prompt + output), 2, max_len).astype(int)


def paged_pages(lengths: np.ndarray, page_size: int) -> int:
    """Pages the allocator has handed out once every sequence reached its length."""
    allocator = PageAllocator(int(sum(-(-int(n) // page_size) for n in lengths)))
    for n in lengths:
        allocator.allocate(-(-int(n) // page_size))  # a page each time a page fills
    return allocator.num_in_use


def fit_in_budget(
    lengths: np.ndarray, budget_tokens: int, page_size: int | None, max_len: int
) -> int:
    """Sequences that fit, in arrival order, in a budget of token slots."""
    if page_size is None:
        return min(len(lengths), budget_tokens // max_len)
    allocator = PageAllocator(max(1, budget_tokens // page_size))
    fitted = 0
    for n in lengths:
        try:
            allocator.allocate(-(-int(n) // page_size))
        except OutOfPages:
            break
        fitted += 1
    return fitted


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    max_len = _MAX_LEN.value
    lengths = workload(_SEQUENCES.value, max_len, _SEED.value)
    used = int(lengths.sum())
    per_token = kvlab.cache_bytes(cfg.model, cfg.cache, 1, 1 << 16) / (1 << 16)
    budget_tokens = int(_BUDGET.value * 2**30 / per_token)

    contiguous = len(lengths) * max_len
    rows = [
        {
            "layout": "contiguous",
            "page_size": None,
            "reserved_tokens": contiguous,
            "waste": 1 - used / contiguous,
            "sequences_in_budget": fit_in_budget(lengths, budget_tokens, None, max_len),
        }
    ]
    for page_size in map(int, _PAGE_SIZES.value):
        reserved = paged_pages(lengths, page_size) * page_size
        rows.append(
            {
                "layout": "paged",
                "page_size": page_size,
                "reserved_tokens": reserved,
                "waste": 1 - used / reserved,
                "sequences_in_budget": fit_in_budget(lengths, budget_tokens, page_size, max_len),
            }
        )
    report = {
        "config": config_flags.get_config_filename(flags.FLAGS["config"]),
        "sequences": len(lengths),
        "max_len": max_len,
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "used_tokens": used,
        "cache_bytes_per_token": per_token,
        "budget_gib": _BUDGET.value,
        "budget_tokens": budget_tokens,
        "rows": rows,
    }
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(_WORKDIR.value, "memory.png"))
    print(json.dumps(report, indent=2))


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        r["layout"] if r["page_size"] is None else f"paged L={r['page_size']}"
        for r in report["rows"]
    ]
    fig, (waste, fits) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    waste.bar(labels, [100 * r["waste"] for r in report["rows"]], color="tab:red")
    waste.set_ylabel("reserved KV slots left unused (%)")
    fits.bar(labels, [r["sequences_in_budget"] for r in report["rows"]], color="tab:blue")
    fits.set_ylabel(f"sequences in {report['budget_gib']:g} GiB of cache")
    for ax in (waste, fits):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(
        f"{report['sequences']} sequences, log-normal lengths "
        f"(median {report['median_length']:.0f}, max_len {report['max_len']})"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
