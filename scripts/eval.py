"""Perplexity (or MQAR accuracy) of a trained model through a cache.

    python scripts/eval.py --workdir runs/gqa                      # the run's own cache section
    python scripts/eval.py --workdir runs/gqa --cache configs/kv_k8v4.py:tiny
    python scripts/eval.py --workdir runs/gqa --cache configs/gqa.py:tiny \
        --cache.cache.k_bits=4 --json

The model, data and eval sections come from the run (workdir/config.json); the
cache section from --cache (a config file; its other sections are ignored) with
any --cache.cache.* overrides. Every window of held-out text goes through the cache in
prefill chunks (kvlab/eval.py), so the numbers are what generation with that
cache sees. Prints ppl, bits per byte, cache bytes per token (analytic and
measured) and the change against the same cache at 16 bits.
"""

import json

from absl import flags
from ml_collections import config_flags

from kvlab import cli
from kvlab.config import validate_cache_config
from kvlab.data import make_dataset
from kvlab.eval import evaluate, full_precision
from kvlab.train import load_params

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (scripts/train.py).")
_CACHE = config_flags.DEFINE_config_file(
    "cache", None, "Config file whose cache section to evaluate through (default: the run's)."
)
_SPLIT = flags.DEFINE_enum(
    "split", None, ["validation", "test"], "Held-out split (default eval.split)."
)
_CHUNK = flags.DEFINE_integer("chunk", None, "Tokens per prefill step (default eval.chunk).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    cfg, params = load_params(_WORKDIR.value, _STEP.value)
    cache_cfg = _CACHE.value.cache if _CACHE.value is not None else cfg.cache
    validate_cache_config(cache_cfg, cfg.model)
    split = _SPLIT.value or cfg.eval.split
    chunk = _CHUNK.value or cfg.eval.chunk
    data = make_dataset(cfg.data, split, cfg.train.seq_len)
    batches = data.eval_batches(cfg.eval.batch_size, cfg.eval.num_batches)
    result = evaluate(cfg.model, cache_cfg, params, batches, chunk=chunk)
    baseline = evaluate(cfg.model, full_precision(cache_cfg), params, batches, chunk=chunk)
    metric = data.metric
    report = {
        "workdir": _WORKDIR.value,
        "split": split,
        "metric": metric,
        **result,
        "baseline_16bit": baseline,
        "delta_vs_16bit_pct": 100 * (result[metric] / baseline[metric] - 1),
    }
    if _JSON.value:
        print(json.dumps(report, indent=2))
        return
    print(f"{_WORKDIR.value}: {split} split, {result['targets']} targets, chunks of {chunk}")
    print(f"{'':>18} {'this cache':>12} {'16-bit':>12}")
    for key in ("ppl", "bits_per_byte", "accuracy", "cache_bytes_per_token"):
        print(f"{key:>18} {result[key]:>12.4f} {baseline[key]:>12.4f}")
    print(f"{'measured bytes/tok':>18} {result['cache_bytes_per_token_measured']:>12.4f}")
    print(f"{metric} change against 16 bits: {report['delta_vs_16bit_pct']:+.3f}%")


if __name__ == "__main__":
    cli.run(main)
