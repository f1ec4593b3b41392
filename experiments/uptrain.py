"""Recovering a converted model's perplexity by uptraining: GQA, MQA and MLA from one MHA source.

    python experiments/uptrain.py --workdir runs/uptrain
    python experiments/uptrain.py --workdir runs/uptrain --source_workdir runs/mha --wandb
    python experiments/uptrain.py --workdir DIR --source_hf path/to/hf_model \
        --config.data.source=text --config.data.path=notes.txt --mla_fractions=4

A trained source model (a kvlab training run, `--source_workdir`; a Hugging
Face folder, `--source_hf`; else `--config` trained here for `--source_steps`
steps into workdir/source, resumed if it is there) is converted to attention
that caches less:

- GQA with half its KV heads and MQA with one (`--gqa_kv_heads`): each
  group's key and value projections are pooled by their mean
  (kvlab.checkpoints.to_gqa; arXiv:2305.13245);
- MLA at 1/n of its cache for each n in `--mla_fractions` (MHA2MLA,
  arXiv:2502.14837; kvlab.checkpoints.to_mla): r RoPE frequency pairs per KV head
  keep their rotation as that head's RoPE key, chosen by `--select`, and the
  rest of K and V is factored jointly by SVD into a latent of width kv_rank
  (of the weights, or with `--factor=activations` weighted by the calibration
  windows' attention inputs; models named mla-...-act).
  Its cache holds kv_rank + K x 2r numbers per token and layer against the
  source's 2 K head_dim, so kv_rank = 2 K head_dim / n - 2 K r. r is
  `--rope_pairs`, or (0, the default) the most whose keys fill at most half of
  the MLA cache: 4, 2 and 1 at 1/2, 1/4 and 1/8 of a tiny MHA's; an entry
  n:r sets it for one conversion.

Each converted model is uptrained from its own weights (train.init_from) for
`--uptrain_steps` steps on the source's data, and its validation perplexity
(plain causal forward on the held-out split train() evaluates on, which a
16-bit cache reproduces; kvlab/eval/perplexity.py) is taken before uptraining (step 0) and
every `--eval_every` steps. Cache bytes per token are kvlab.eval's for
`--config`'s cache section; the fraction of the source's is what a long cache
adds per token (kvlab.eval.cache_bytes_per_token's `_long`).

The model comes from the source; data, eval, cache and wandb from `--config`.
Under --workdir: source/ (a source trained here), models/<name>/converted (the
converted weights as a kvlab run at step 0: scripts/eval.py --workdir reads
it) and models/<name>/uptrain (the uptraining run), results.json, results.md
(perplexity vs cache bytes per token, before and after) and curves.png.
`--wandb` logs every training run and one run holding the table, the curves
and the plot (offline unless --config.wandb.mode says otherwise). Rerunning in
the same workdir resumes every run and redoes only the evaluation.
"""

import io
import json
import os
import time

import ml_collections
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, train
from kvlab.checkpoints import convert
from kvlab.checkpoints.hf import config_from_hf
from kvlab.data import make_dataset
from kvlab.eval import cache_bytes_per_token
from kvlab.files import write_atomic
from kvlab.logging import Run
from kvlab.model import Transformer

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/mha.py:tiny", "The source's training config; data, eval, cache, wandb."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/uptrain", "Where runs and results go.")
_SOURCE_WORKDIR = flags.DEFINE_string("source_workdir", None, "A kvlab training run to convert.")
_SOURCE_HF = flags.DEFINE_string("source_hf", None, "A Hugging Face folder to convert.")
_SOURCE_STEPS = flags.DEFINE_integer(
    "source_steps", 2000, "Training steps of a source trained here (no --source_*)."
)
_UPTRAIN_STEPS = flags.DEFINE_integer("uptrain_steps", 400, "Uptraining steps per model.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "Steps between validation perplexities.")
_LR = flags.DEFINE_float("uptrain_lr", 3e-3, "Peak uptraining learning rate (cosine to lr/10).")
_WARMUP = flags.DEFINE_integer("uptrain_warmup", 20, "Uptraining warm-up steps.")
_GQA = flags.DEFINE_list(
    "gqa_kv_heads", ["half", "1"], "KV heads of each GQA conversion: a count (1 = MQA) or half."
)
_MLA_FRACTIONS = flags.DEFINE_list(
    "mla_fractions",
    ["2", "4", "8"],
    "MLA conversions to 1/n of the source's cache: n, or n:pairs to override --rope_pairs.",
)
_ROPE_PAIRS = flags.DEFINE_integer(
    "rope_pairs", 0, "RoPE pairs kept per KV head (MLA); 0 = as many as half the cache holds."
)
_SELECT = flags.DEFINE_enum(
    "select", "norm", ["norm", "uniform", "high", "low"], "Which RoPE pairs MLA keeps."
)
_FACTOR = flags.DEFINE_enum(
    "factor",
    "weights",
    list(convert.FACTORS),
    "MLA's SVD: of the weights, or weighted by the calibration windows' attention inputs.",
)
_CALIBRATION = flags.DEFINE_integer(
    "calibration_sequences",
    32,
    "Training windows --select=norm and --factor=activations measure on.",
)
_WANDB = flags.DEFINE_bool("wandb", False, "Log the runs and the results to wandb.")


def load_source(cfg: ml_collections.ConfigDict, workdir: str) -> tuple:
    """(config, params) of the source: --source_workdir, --source_hf, or `cfg`
    trained for --source_steps into workdir/source. The model section is the
    source's, every other section `cfg`'s."""
    if _SOURCE_WORKDIR.value and _SOURCE_HF.value:
        raise ValueError(
            f"--source_workdir={_SOURCE_WORKDIR.value} and --source_hf={_SOURCE_HF.value} "
            "both name the source: pass one of them"
        )
    if _SOURCE_HF.value:
        cfg = config_from_hf(cfg, _SOURCE_HF.value)
        params = train.initial_params(cfg)
    elif _SOURCE_WORKDIR.value:
        stored, params = train.load_params(_SOURCE_WORKDIR.value)
        cfg = cfg.copy_and_resolve_references()
        cfg.model = stored.model
    else:
        cfg = cfg.copy_and_resolve_references()
        steps = _SOURCE_STEPS.value
        cfg.train.update(steps=steps, eval_every=max(1, steps // 4))
        state, _ = train.train(cfg, os.path.join(workdir, "source"), group="uptrain")
        params = state.params
    cfg = cfg.copy_and_resolve_references()
    cfg.train.init_from = ""  # the conversions start from their own weights
    return kvlab.validate_config(cfg), params


def conversions(cfg: ml_collections.ConfigDict) -> dict:
    """name -> (what it is, function of (cfg, params) to the converted (cfg, params))."""
    model = cfg.model
    if model.attention != "gqa":
        raise ValueError(
            f"model.attention={model.attention!r}: the conversions start from grouped-query "
            "attention (MHA, GQA); pass a source with model.attention='gqa'"
        )
    heads, source_numbers = model.num_kv_heads, 2 * model.num_kv_heads * model.head_dim
    planned = {}
    for text in _GQA.value:
        if text != "half" and not text.isdigit():
            raise ValueError(
                f"--gqa_kv_heads entry {text!r} is not a count of KV heads: pass e.g. half,1"
            )
        count = heads // 2 if text == "half" else int(text)
        name = "mqa" if count == 1 else f"gqa{count}"
        planned[name] = (
            f"{cli.count(count, 'KV head')}, each the mean of a group of "
            f"{cli.count(heads // count, 'source head')}",
            lambda c, p, count=count: convert.to_gqa(c, p, count),
        )
    for text in _MLA_FRACTIONS.value:
        n, rope_pairs = mla_fraction(text)
        name = f"mla-1of{n}" if rope_pairs is None else f"mla-1of{n}-r{rope_pairs}"
        if _FACTOR.value == "activations":  # another model: its own folders
            name += "-act"
        if rope_pairs is None:
            rope_pairs = _ROPE_PAIRS.value or default_rope_pairs(model, source_numbers // n)
        kv_rank = source_numbers // n - 2 * heads * rope_pairs
        if source_numbers % n or kv_rank < 1:
            raise ValueError(
                f"--mla_fractions={text}: 1/{n} of the source's {source_numbers} cached numbers "
                f"per token and layer leaves kv_rank={kv_rank} beside {heads} KV heads x "
                f"{rope_pairs} RoPE pairs x 2: pick a smaller n or fewer RoPE pairs"
            )
        planned[name] = (
            f"MLA, kv_rank {kv_rank}, {rope_pairs} RoPE pair(s) per KV head ({_SELECT.value}, "
            f"SVD of the {_FACTOR.value})",
            lambda c, p, kv_rank=kv_rank, rope_pairs=rope_pairs: convert.to_mla(
                c,
                p,
                kv_rank,
                rope_pairs=rope_pairs,
                select=_SELECT.value,
                tokens=calibration(c),
                factor=_FACTOR.value,
            ),
        )
    return planned


def default_rope_pairs(model: ml_collections.ConfigDict, numbers: int) -> int:
    """RoPE pairs per KV head whose keys fill at most half of `numbers` cached per
    token and layer (at least 1, at most all of a head's). On the tiny byte-level
    model the pairs matter more than latent width: at 1/2 of the cache, 4 pairs
    and kv_rank 32 convert to a far lower perplexity than 1 pair and kv_rank 56."""
    fitting = numbers // 2 // (2 * model.num_kv_heads)
    return max(1, min(fitting, model.head_dim // 2))


def mla_fraction(text: str) -> tuple[int, int | None]:
    """(n, RoPE pairs or None) of an --mla_fractions entry 'n' or 'n:pairs'."""
    n, _, pairs = text.partition(":")
    if not n.isdigit() or int(n) < 1 or (pairs and (not pairs.isdigit() or int(pairs) < 1)):
        raise ValueError(
            f"--mla_fractions entry {text!r} is not n or n:pairs (1/n of the source's cache, "
            "pairs RoPE pairs per KV head): pass e.g. 4 or 2:2"
        )
    return int(n), int(pairs) if pairs else None


def calibration(cfg: ml_collections.ConfigDict):
    """Training windows int32 [B, T] for --select=norm or --factor=activations (else None)."""
    if _SELECT.value != "norm" and _FACTOR.value != "activations":
        return None
    data = make_dataset(cfg.data, "train", cfg.train.seq_len)
    return data.batch(0, _CALIBRATION.value, cfg.train.seed)["inputs"]


def validation_batches(cfg: ml_collections.ConfigDict) -> list:
    """The held-out batches train() evaluates on."""
    data = make_dataset(cfg.data, "validation", cfg.train.seq_len)
    return data.eval_batches(cfg.eval.batch_size, cfg.eval.num_batches)


def validation_ppl(cfg: ml_collections.ConfigDict, params, batches: list) -> float:
    """Perplexity of `params` on `batches` (plain causal forward, as train() evaluates)."""
    return train.evaluate_forward(Transformer(cfg.model), params, batches)["ppl"]


def bytes_per_token(cfg: ml_collections.ConfigDict) -> dict:
    """The cache's bytes per token of a train.seq_len window, and per further token."""
    sizes = cache_bytes_per_token(cfg.model, cfg.cache, cfg.train.seq_len)
    return {"window": sizes["cache_bytes_per_token"], "long": sizes["cache_bytes_per_token_long"]}


def start_converted(cfg: ml_collections.ConfigDict, params, folder: str) -> None:
    """`params` as a kvlab run at step 0 in `folder` (train.start_workdir), which
    train.init_from reads; a folder already holding the same model is kept."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        train.start_workdir(cfg, params, folder)
        return
    held = json.loads(train.load_run_config(folder).model.to_json())
    if held != json.loads(cfg.model.to_json()):
        raise ValueError(
            f"{folder} holds another converted model (another source, --select or "
            "--rope_pairs?): delete it, or pass a new --workdir"
        )


def uptrain(cfg: ml_collections.ConfigDict, params, batches: list, folder: str, name: str) -> list:
    """Uptrains the converted model from `params`; returns [(step, ppl), ...] from step 0."""
    converted = os.path.join(folder, "converted")
    start_converted(cfg, params, converted)
    # The config as the folder stores it, so that init_from's field-by-field check
    # of the model section compares what was read from the same file.
    cfg = train.load_run_config(converted)
    steps = _UPTRAIN_STEPS.value
    cfg.train.update(
        steps=steps,
        lr=_LR.value,
        warmup=min(_WARMUP.value, steps),
        eval_every=_EVAL_EVERY.value,
        checkpoint_every=steps,
        init_from=converted,
    )
    run = os.path.join(folder, "uptrain")
    train.train(cfg, run, name=name, group="uptrain")
    curve = [(0, validation_ppl(cfg, params, batches))]
    with open(os.path.join(run, "metrics.jsonl")) as lines:  # this call's and earlier calls'
        for line in map(json.loads, lines):
            if "eval/ppl" in line:
                curve.append((line["step"], line["eval/ppl"]))
    return curve


def main(argv):
    del argv
    start = time.perf_counter()
    workdir = _WORKDIR.value
    cfg = kvlab.validate_config(_CONFIG.value)
    if not _WANDB.value:
        cfg.wandb.mode = "disabled"
    cfg, source_params = load_source(cfg, workdir)
    source_seconds = time.perf_counter() - start
    source_bytes = bytes_per_token(cfg)
    batches = validation_batches(cfg)
    report = {
        "source": {
            "name": _SOURCE_HF.value or _SOURCE_WORKDIR.value or os.path.join(workdir, "source"),
            "attention": cli.attention_label(cfg.model),
            "cache_bytes_per_token": source_bytes["window"],
            "ppl": validation_ppl(cfg, source_params, batches),
            "seconds": source_seconds,  # loading it, or training it here
        },
        "uptrain": {
            "steps": _UPTRAIN_STEPS.value,
            "lr": _LR.value,
            "warmup": _WARMUP.value,
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.train.seq_len,
            "eval_tokens": cfg.eval.batch_size * cfg.eval.num_batches * cfg.train.seq_len,
        },
        "models": [],
    }
    for name, (description, conversion) in conversions(cfg).items():
        clock = time.perf_counter()
        converted, params = conversion(cfg, source_params)
        sizes = bytes_per_token(converted)
        curve = uptrain(converted, params, batches, os.path.join(workdir, "models", name), name)
        report["models"].append(
            {
                "name": name,
                "conversion": description,
                "attention": cli.attention_label(converted.model),
                "cache_bytes_per_token": sizes["window"],
                "cache_fraction": sizes["long"] / source_bytes["long"],
                "ppl_before": curve[0][1],
                "curve": curve,
                "ppl_after": curve[-1][1],
                "seconds": time.perf_counter() - clock,
            }
        )
        print(f"{name}: ppl {curve[0][1]:.3f} -> {curve[-1][1]:.3f}")
    report["seconds"] = time.perf_counter() - start
    write_results(report, workdir)
    if _WANDB.value:
        log_results(cfg, report, workdir)
    print(table(report))


def write_results(report: dict, workdir: str) -> None:
    """results.json, results.md and curves.png under `workdir`, each replaced atomically."""
    os.makedirs(workdir, exist_ok=True)
    write_atomic(os.path.join(workdir, "results.json"), json.dumps(report, indent=2) + "\n")
    write_atomic(os.path.join(workdir, "results.md"), table(report) + "\n")
    write_atomic(os.path.join(workdir, "curves.png"), plot(report))


def table(report: dict) -> str:
    """Perplexity against cache bytes per token, before and after uptraining (markdown)."""
    source, steps = report["source"], report["uptrain"]["steps"]
    lines = [
        f"| model | cache bytes/token | of source | ppl converted | ppl after {steps} steps |",
        "|---|---:|---:|---:|---:|",
        f"| source ({source['attention']}) | {source['cache_bytes_per_token']:.1f} | 1 "
        f"| {source['ppl']:.3f} | |",
    ]
    for m in report["models"]:
        lines.append(
            f"| {m['name']} | {m['cache_bytes_per_token']:.1f} | {m['cache_fraction']:.3g} "
            f"| {m['ppl_before']:.3f} | {m['ppl_after']:.3f} |"
        )
    return "\n".join(lines)


def plot(report: dict) -> bytes:
    """curves.png: perplexity against uptraining steps, and after them against bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    source, models = report["source"], report["models"]
    fig, (curves, after) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for i, m in enumerate(models):
        steps, ppl = zip(*m["curve"], strict=True)
        curves.plot(steps, ppl, marker=".", color=f"C{i}", label=m["name"])
        after.scatter(m["cache_bytes_per_token"], m["ppl_after"], color=f"C{i}")
        after.annotate(
            m["name"],
            (m["cache_bytes_per_token"], m["ppl_after"]),
            textcoords="offset points",
            xytext=(6, 0),
            va="center",
        )
    after.scatter(source["cache_bytes_per_token"], source["ppl"], color="black", marker="*")
    after.annotate(
        "source",
        (source["cache_bytes_per_token"], source["ppl"]),
        textcoords="offset points",
        xytext=(6, 0),
        va="center",
    )
    for ax in (curves, after):
        ax.axhline(source["ppl"], color="black", ls="--", lw=1, label="source")
        ax.set_ylabel("validation perplexity")
    if max(m["ppl_before"] for m in models) > 3 * source["ppl"]:
        curves.set_yscale("log")
        curves.yaxis.set_major_formatter(ScalarFormatter())
        curves.yaxis.set_minor_formatter(ScalarFormatter())
    curves.set_xlabel("uptraining steps")
    curves.set_title(f"converted from {source['attention']}")
    curves.legend()
    after.set_xscale("log", base=2)
    after.xaxis.set_major_formatter(ScalarFormatter())
    after.set_xlim(right=after.get_xlim()[1] * 1.4)  # room for the labels
    after.set_xlabel("cache bytes per token")
    after.set_title(f"after {report['uptrain']['steps']} uptraining steps")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def log_results(cfg: ml_collections.ConfigDict, report: dict, workdir: str) -> None:
    """One wandb run: the curves (val_ppl/<model> per uptraining step), the table, the plot."""
    columns = ["model", "attention", "cache_bytes_per_token", "ppl_before", "ppl_after"]
    source = report["source"]
    rows = [["source", source["attention"], source["cache_bytes_per_token"], source["ppl"], None]]
    rows += [[m["name"], m["attention"], *(m[c] for c in columns[2:])] for m in report["models"]]
    with Run(
        cfg.wandb,
        name="uptrain-results",
        config={"uptrain": report["uptrain"], "model": cfg.model.to_dict()},
        workdir=workdir,
        job_type="uptrain",
        group="uptrain",
    ) as run:
        by_step = {}
        for m in report["models"]:
            for step, ppl in m["curve"]:
                by_step.setdefault(step, {})[f"val_ppl/{m['name']}"] = ppl
        for step in sorted(by_step):
            run.log({**by_step[step], "val_ppl/source": source["ppl"]}, step=step)
        run.table("results", columns=columns, rows=rows)
        run.image("curves", os.path.join(workdir, "curves.png"))
        run.summary({f"ppl_after/{m['name']}": m["ppl_after"] for m in report["models"]})


if __name__ == "__main__":
    cli.run(main)
