"""Long-context recall and perplexity against context length, through a cache.

    python scripts/eval_tasks.py --workdir runs/gqa --tasks needle,multikey,vartrack \
        --lengths 256,512,1024                                    # the run's own cache
    python scripts/eval_tasks.py --workdir runs/gqa --cache configs/kv_k8v4.py:tiny \
        --cache.cache.k_bits=2 --cache.cache.v_bits=2 --tasks needle --plot needle_k2v2.png
    python scripts/eval_tasks.py --workdir runs/gqa --lengths 128,512 \
        --rope_scaling type=yarn,factor=4 --json                  # past the training length
    python scripts/eval_tasks.py --workdir runs/mqar --tasks mqar --lengths 128,256,512

The model, data and eval sections come from the run (workdir/config.json), the
cache section from --cache (a config file; its other sections are ignored; with
--hf instead of --workdir also its data, eval and train sections, as
scripts/eval.py reads them). For each length of --lengths (default
eval.task_lengths, else eval.seq_len, else train.seq_len) it evaluates held-out
perplexity over windows of that length (--ppl; kvlab/eval/perplexity.py) and every task of
--tasks (default eval.tasks; kvlab/data/tasks.py, kvlab/eval/tasks.py) through the
cache, and prints one line per length: the length sweep. The needle task runs at every depth of
--depths (default eval.depths) and its depth x length accuracy is drawn as a
heat map (--plot, default workdir/needle.png; '' for none).

--rope_scaling sets model.rope_scaling for the evaluation ('type=linear,factor=4',
'type=yarn,factor=4', 'type=llama3,factor=8'; llama3 and yarn default
original_max_len to train.seq_len; 'none' is plain RoPE), so a model can be read
past the length it trained on. --batch_size and --num_batches override
eval.batch_size and eval.num_batches (sequences per task, length and depth).
Every length and task is checked, and every batch generated, before anything
compiles; a length a task cannot fit is refused naming the field and the minimum.
"""

import json
import os
import textwrap

from absl import flags
from ml_collections import config_flags

from kvlab import cli, sharding
from kvlab.cache import cache_label
from kvlab.config import (
    EVAL_TASKS,
    base_config,
    eval_seq_len,
    parse_rope_scaling,
    validate_cache_config,
    validate_eval_config,
    validate_model_config,
)
from kvlab.data import make_dataset
from kvlab.data.tasks import check_tasks
from kvlab.eval import check_finite, evaluate
from kvlab.eval.tasks import evaluate_tasks, needle_matrix, plot_needle_grid
from kvlab.sweep import family

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (scripts/train.py).")
_HF = flags.DEFINE_string(
    "hf", None, "A Hugging Face checkpoint folder to evaluate instead of --workdir."
)
_CACHE = config_flags.DEFINE_config_file(
    "cache",
    None,
    "Config file whose cache section to evaluate through (default: the run's); with --hf "
    "also the data, eval and train sections.",
)
_TASKS = flags.DEFINE_list(
    "tasks", None, f"Tasks to score, any of {', '.join(EVAL_TASKS)} (default eval.tasks)."
)
_LENGTHS = flags.DEFINE_list(
    "lengths", None, "Context lengths in tokens (default eval.task_lengths, else eval.seq_len)."
)
_DEPTHS = flags.DEFINE_list("depths", None, "Needle depths in [0, 1] (default eval.depths).")
_PPL = flags.DEFINE_bool("ppl", True, "Also held-out perplexity at each length.")
_ROPE = flags.DEFINE_string(
    "rope_scaling", None, "model.rope_scaling for the evaluation, e.g. type=yarn,factor=4."
)
_SPLIT = flags.DEFINE_enum(
    "split", None, ["validation", "test"], "Held-out split (default eval.split)."
)
_CHUNK = flags.DEFINE_integer("chunk", None, "Tokens per prefill step (default eval.chunk).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Sequences per batch (default eval.batch_size).")
_BATCHES = flags.DEFINE_integer("num_batches", None, "Batches (default eval.num_batches).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_PLOT = flags.DEFINE_string(
    "plot", None, "Needle heat map (PNG) path (default workdir/needle.png; '' for none)."
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_MESH = config_flags.DEFINE_config_dict(
    "mesh", base_config().mesh, "The device mesh to evaluate on (the config's mesh section)."
)


def _numbers(flag, values, kind):
    try:
        return tuple(kind(value) for value in values)
    except ValueError:
        raise ValueError(
            f"--{flag}={','.join(values)} is not a list of {kind.__name__}s: give e.g. "
            + ("256,512" if kind is int else "0,0.5,1")
        ) from None


def configure(cfg):
    """The run's config with the flags' overrides applied and checked."""
    ev = cfg.eval
    if _TASKS.value is not None:
        ev.tasks = tuple(_TASKS.value)
    if _LENGTHS.value is not None:
        ev.task_lengths = _numbers("lengths", _LENGTHS.value, int)
    if _DEPTHS.value is not None:
        ev.depths = _numbers("depths", _DEPTHS.value, float)
    for flag, field in ((_SPLIT, "split"), (_CHUNK, "chunk"), (_BATCH, "batch_size")):
        if flag.value is not None:
            ev[field] = flag.value
    if _BATCHES.value is not None:
        ev.num_batches = _BATCHES.value
    if _ROPE.value is not None:
        cfg.model.rope_scaling = parse_rope_scaling(_ROPE.value, cfg.train.seq_len)
    validate_model_config(cfg.model)
    validate_cache_config(cfg.cache, cfg.model)
    validate_eval_config(cfg)
    check_tasks(cfg)
    return cfg


def perplexity(cfg, params, lengths, on_mesh, source):
    """Held-out perplexity (or MQAR accuracy) at each length: one row per length."""
    ev = cfg.eval
    data = [make_dataset(cfg.data, ev.split, length) for length in lengths]  # refusals first
    label = cache_label(cfg.model, cfg.cache)
    rows = []
    for length, dataset in zip(lengths, data, strict=True):
        batches = dataset.eval_batches(ev.batch_size, ev.num_batches)
        result = evaluate(cfg.model, cfg.cache, params, batches, **on_mesh)
        check_finite(result, f"{source} at {length} tokens through the cache {label}")
        rows.append(dict(seq_len=length, metric=dataset.metric, **result))
    return rows


def main(argv):
    del argv
    sharding.initialize_distributed(_MESH.value)
    cfg, params, source = cli.evaluated_weights(
        _WORKDIR.value, _HF.value, _CACHE.value, _STEP.value
    )
    cfg = configure(cfg)
    cfg.mesh = _MESH.value
    on_mesh = dict(chunk=cfg.eval.chunk, mesh=sharding.make_mesh(cfg))
    on_mesh["rules"] = sharding.axis_rules(cfg.mesh)
    lengths = tuple(cfg.eval.task_lengths) or (eval_seq_len(cfg),)
    ppl = perplexity(cfg, params, lengths, on_mesh, source) if _PPL.value else []
    rows = evaluate_tasks(cfg, cfg.cache, params, lengths=lengths, **on_mesh)
    label = cache_label(cfg.model, cfg.cache)
    plot = None
    if any(r["task"] == "needle" for r in rows):
        plot = _PLOT.value
        if plot is None:
            plot = os.path.join(_WORKDIR.value or ".", "needle.png")
        if plot and sharding.is_primary():
            matrix, depths, needle_lengths = needle_matrix(rows)
            title = textwrap.fill(f"needle accuracy: {family(cfg.model).upper()}, {label}", 90)
            plot_needle_grid(plot, matrix, depths, needle_lengths, title=title)
    if not sharding.is_primary():
        return
    report = {
        "workdir": _WORKDIR.value,
        "hf": _HF.value,
        "cache": label,
        "rope_scaling": cfg.model.rope_scaling.to_dict(),
        "split": cfg.eval.split,
        "lengths": list(lengths),
        "perplexity": ppl,
        "tasks": rows,
        "needle_plot": plot or None,
    }
    if _JSON.value:
        print(json.dumps(report, indent=2))
        return
    scaling = cfg.model.rope_scaling
    rope = "plain RoPE" if scaling.type == "none" else f"RoPE {scaling.type} x{scaling.factor:g}"
    print(f"{source}: {rope}, {cfg.eval.split} split")
    if on_mesh["mesh"].size > 1:
        print(sharding.describe_mesh(on_mesh["mesh"]))
    print(f"cache: {label}")
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    metric = ppl[0]["metric"] if ppl else None
    header = [f"{'length':>8}"] + ([f"{metric:>10}"] if ppl else []) + [f"{t:>10}" for t in tasks]
    print(" ".join(header))
    for i, length in enumerate(lengths):
        line = [f"{length:>8}"] + ([f"{ppl[i][metric]:>10.4f}"] if ppl else [])
        by_task = {r["task"]: r for r in rows if r["seq_len"] == length}
        line += [f"{by_task[t]['accuracy']:>10.4f}" for t in tasks]
        print(" ".join(line))
    if plot:
        print(f"needle depth x length heat map: {plot}")


if __name__ == "__main__":
    cli.run(main)
