"""Perplexity (or MQAR accuracy) of a trained model through a cache.

    python scripts/eval.py --workdir runs/gqa                      # the run's own cache section
    python scripts/eval.py --workdir runs/gqa --cache configs/kv_k8v4.py:tiny
    python scripts/eval.py --workdir runs/gqa --cache configs/gqa.py:tiny \
        --cache.cache.k_bits=4 --json
    python scripts/eval.py --hf path/to/hf_model --cache configs/kv_kivi2.py:tiny \
        --cache.data.source=text --cache.data.path=notes.txt      # your own checkpoint
    python scripts/eval.py --workdir runs/gqa --mesh.data=2 --mesh.tensor=4  # on 8 devices
    python scripts/eval.py --workdir runs/gqa --seq_len 512 --rope_scaling type=yarn,factor=4

The model, data and eval sections come from the run (workdir/config.json); the
cache section from --cache (a config file; its other sections are ignored) with
any --cache.cache.* overrides. With --hf instead of --workdir (a local Hugging
Face checkpoint, kvlab.cli.with_hf) the model section and the weights come from
the checkpoint, its tokenizer.json (if any) reads the text, and every other
section (data, eval, train.seq_len, cache) from --cache (default:
kvlab.base_config()'s). Every window of held-out
text goes through the cache in prefill chunks (kvlab/eval/perplexity.py), so the numbers
are what generation with that cache sees. The baseline is the model's full
cache (kvlab.eval.full_cache: 16 bits, every token kept), evaluated once with
its logits kept: the cache is scored against it token by token as it runs
(the KL divergence of the next-token distributions, mean and 99th percentile
in nats, top-1 agreement, the change in perplexity), at no further forward
pass. Prints both caches in full (bits, axes, groups, residual, layout,
eviction), the windows evaluated, ppl, bits per byte, accuracy, cache bytes per
token (analytic and measured) and the change against the full cache; a result
that is not a finite number stops the script with an error instead. Windows are
eval.seq_len tokens (0: train.seq_len), --seq_len overriding it; past the
trained length, --rope_scaling sets model.rope_scaling for the evaluation
(kvlab.config.parse_rope_scaling: 'linear', 'yarn', 'llama3', ... with factor=).

The evaluation runs on the mesh --mesh.* describe (the config's mesh section,
kvlab.sharding.make_mesh; default data parallel over every device, whatever
mesh the run trained on): weights by their logical axes, each window's rows
and cache split over it. On one device nothing moves. On several hosts, the
same command on each with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID (or --mesh.distributed=True where jax detects the cluster):
the mesh spans them, each host feeds its rows, process 0 prints.
"""

import json

from absl import flags
from ml_collections import config_flags

from kvlab import cli, sharding
from kvlab.cache import cache_label
from kvlab.config import (
    base_config,
    check_count,
    eval_seq_len,
    parse_rope_scaling,
    validate_cache_config,
)
from kvlab.data import make_dataset
from kvlab.eval import check_finite, evaluate, evaluate_reference, full_cache

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
_SPLIT = flags.DEFINE_enum(
    "split", None, ["validation", "test"], "Held-out split (default eval.split)."
)
_CHUNK = flags.DEFINE_integer("chunk", None, "Tokens per prefill step (default eval.chunk).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", None, "Tokens per evaluation window (default eval.seq_len, else train.seq_len)."
)
_ROPE = flags.DEFINE_string(
    "rope_scaling", None, "model.rope_scaling for the evaluation, e.g. type=yarn,factor=4."
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_MESH = config_flags.DEFINE_config_dict(
    "mesh",
    base_config().mesh,
    "The device mesh to evaluate on (the config's mesh section): --mesh.data, --mesh.fsdp, "
    "--mesh.tensor, --mesh.rules.<logical>.",
)


def main(argv):
    del argv
    # Several hosts (--mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
    # before anything below touches a device.
    sharding.initialize_distributed(_MESH.value)
    cfg, params, source = cli.evaluated_weights(
        _WORKDIR.value, _HF.value, _CACHE.value, _STEP.value
    )
    if _SEQ_LEN.value is not None:
        cfg.eval.seq_len = check_count("--seq_len", _SEQ_LEN.value)
    if _ROPE.value is not None:
        cfg.model.rope_scaling = parse_rope_scaling(_ROPE.value, cfg.train.seq_len)
    cache_cfg = cfg.cache
    validate_cache_config(cache_cfg, cfg.model)
    split = _SPLIT.value or cfg.eval.split
    chunk = _CHUNK.value or cfg.eval.chunk
    cfg.mesh = _MESH.value
    on_mesh = dict(chunk=chunk, mesh=sharding.make_mesh(cfg), rules=sharding.axis_rules(cfg.mesh))
    seq_len = eval_seq_len(cfg)
    data = make_dataset(cfg.data, split, seq_len)
    batches = data.eval_batches(cfg.eval.batch_size, cfg.eval.num_batches)
    full = full_cache(cache_cfg)
    label, full_label = cache_label(cfg.model, cache_cfg), cache_label(cfg.model, full)
    # once, its logits kept: the cache's run compares with them as it goes
    reference = evaluate_reference(cfg.model, full, params, batches, **on_mesh)
    baseline = check_finite(reference.result, f"{source} through the full cache {full_label}")
    if cache_cfg.to_dict() == full.to_dict():
        result = baseline
    else:
        result = evaluate(cfg.model, cache_cfg, params, batches, **on_mesh, reference=reference)
        check_finite(result, f"{source} through the cache {label}")
    metric = data.metric
    report = {
        "workdir": _WORKDIR.value,
        "hf": _HF.value,
        "split": split,
        "seq_len": seq_len,
        "windows": sum(len(b["inputs"]) for b in batches),
        "batches": len(batches),
        "rope_scaling": cfg.model.rope_scaling.to_dict(),
        "metric": metric,
        "cache": label,
        **result,
        "baseline_cache": full_label,
        "baseline": baseline,
        "delta_vs_full_pct": 100 * (result[metric] / baseline[metric] - 1),
    }
    if not sharding.is_primary():  # every host has the same numbers; process 0 reports them
        return
    if _JSON.value:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{source}: {split} split, {report['windows']} windows of {seq_len} tokens in "
        f"{cli.count(len(batches), 'batch')}, {result['targets']} targets, chunks of {chunk}"
    )
    if on_mesh["mesh"].size > 1:
        print(sharding.describe_mesh(on_mesh["mesh"]))
    print(f"{'this cache':>18} {label}")
    print(f"{'full cache':>18} {full_label}")
    print(f"{'':>18} {'this cache':>12} {'full cache':>12}")
    for key in ("ppl", "bits_per_byte", "accuracy", "cache_bytes_per_token"):
        print(f"{key:>18} {result[key]:>12.4f} {baseline[key]:>12.4f}")
    print(f"{'measured bytes/tok':>18} {result['cache_bytes_per_token_measured']:>12.4f}")
    print(f"{metric} change against the full cache: {report['delta_vs_full_pct']:+.3f}%")
    print(
        f"against the full cache: KL mean {result['kl_mean']:.5f} nats, "
        f"p99 {result['kl_p99']:.5f}; top-1 agreement {100 * result['top1_agreement']:.2f}%; "
        f"ppl {result['delta_ppl']:+.4f}"
    )


if __name__ == "__main__":
    cli.run(main)
