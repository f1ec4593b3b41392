"""How much each key and value bit-width changes a model's attention and logits.

    python scripts/quant_probe.py --config configs/kv_kivi2.py:tiny
    python scripts/quant_probe.py --config configs/gqa.py:tiny --bits=16,8,4,2 --json
    python scripts/quant_probe.py --workdir runs/gqa --config configs/kv_kivi2.py:tiny
    python scripts/quant_probe.py --hf path/to/hf_model --config configs/kv_kivi2.py:tiny
    python scripts/quant_probe.py --config configs/gqa.py:tiny --config.mesh.tensor=2

For every pair (key bits, value bits) from --bits, the model reads a stretch of
real text (a Python standard-library source file, as bytes) through that cache
in chunks of --chunk tokens, and kvlab.eval.probe.cache_error compares its
attention outputs and logits with a 16-bit cache's. The config's other cache
settings (axes, group size, residual, zero points) apply to every pair; for a
latent-attention model the pairs are (latent bits, RoPE-key bits).

Without --workdir or --hf the weights are randomly initialised (--seed): a
random model's attention is flatter than a trained one's, which makes key
errors matter less than they do in a trained model (a tiny MHA trained 2,000
steps, configs/kv_kivi2.py:tiny, --seq_len=128 --batch_size=4: KL 9.3e-4 with
2-bit keys, 2.8e-4 with 2-bit values; the same model with random weights
5.4e-3 and 2.0e-2). Measure a real one: --workdir RUN takes the model,
data.tokenizer and weights of a kvlab training run (its latest checkpoint, or
--step), the cache and mesh sections still from --config; --hf DIR
(kvlab.cli.with_hf) takes the model and its weights from a local Hugging
Face checkpoint, and the text goes through its tokenizer.json when the folder
holds one. The table's first line (and the JSON's "weights") says which
weights were measured. Contradicting flags (--workdir or --hf with each other,
--seed, --step elsewhere, --config.model.*) and a run with no checkpoint are
refused before anything compiles.

Both caches run on the mesh of the config's mesh section
(kvlab.sharding.make_mesh; default data parallel over every device, the rows
split as far as --batch_size divides); on one device nothing moves.
"""

import json
import os

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, sharding
from kvlab.config import cached_prefixes
from kvlab.data import load_tokenizer
from kvlab.eval.probe import cache_error
from kvlab.train import checkpoint_manager, initial_params, load_params, load_run_config

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_BITS = flags.DEFINE_list("bits", ["16", "8", "4", "2"], "Bit-widths to pair up.")
_LENGTH = flags.DEFINE_integer("seq_len", 256, "Tokens per row.")
_BATCH = flags.DEFINE_integer("batch_size", 2, "Rows (consecutive stretches of the text).")
_CHUNK = flags.DEFINE_integer("chunk", 16, "Tokens fed per step.")
_SEED = flags.DEFINE_integer("seed", 0, "Parameter seed of the random weights.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")
_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to measure.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run (scripts/train.py) to measure.")
_STEP = flags.DEFINE_integer("step", None, "The --workdir checkpoint step (default: the latest).")


def text_tokens(batch: int, length: int, tokenizer: str = "") -> np.ndarray:
    """The standard library's os.py as bytes (or through `tokenizer`), cut into rows."""
    text = open(os.__file__, "rb").read()
    if tokenizer:
        data = np.asarray(load_tokenizer(tokenizer).encode(text.decode()), np.int32)
    else:
        data = np.frombuffer(text, np.uint8).astype(np.int32)
    if data.size < batch * length:
        raise ValueError(
            f"--batch_size x --seq_len = {batch * length} exceeds the text's "
            f"{data.size} tokens: ask for fewer tokens"
        )
    return data[: batch * length].reshape(batch, length)


def with_workdir(cfg, workdir: str, **others: object):
    """`cfg` measuring the kvlab run in `workdir`: its model and data.tokenizer
    (the text must be read as it was trained), the rest from `cfg`. Refused,
    naming the flag: any of `others` that is set, --config.model.* overrides,
    a --config data.tokenizer the run does not read."""
    cli.refuse_other_weights(f"--workdir={workdir}", "config", others)
    run = load_run_config(workdir)
    cfg = cfg.copy_and_resolve_references()
    if cfg.data.tokenizer and cfg.data.tokenizer != run.data.tokenizer:
        raise ValueError(
            f"--config's data.tokenizer={cfg.data.tokenizer!r} but --workdir={workdir} was "
            f"trained on data.tokenizer={run.data.tokenizer!r}: drop the config's tokenizer"
        )
    cfg.model, cfg.data.tokenizer = run.model, run.data.tokenizer
    return kvlab.validate_config(cfg)


def run_step(workdir: str, step: int | None) -> int:
    """`step`, or the newest checkpoint step of the run in `workdir` (nothing written)."""
    if step is not None:
        return step  # kvlab.train.restore refuses a step the run does not hold
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        manager = checkpoint_manager(workdir, load_run_config(workdir).train)
        try:
            steps = manager.all_steps()
        finally:
            manager.close()
        if steps:
            return max(steps)
    raise ValueError(
        f"--workdir={workdir} holds no checkpoint: train a model there first "
        "(scripts/train.py), or drop --workdir to measure random weights"
    )


def choose_weights(cfg):
    """(config, weights) as --workdir, --hf or --seed say: `weights` names them for
    the table and the JSON, and `load_weights` reads them. Contradicting flags
    and a run with no checkpoint are refused here, before anything compiles."""
    seed = _SEED.value if flags.FLAGS["seed"].present else None
    if _HF.value is not None:
        cfg = cli.with_hf(cfg, _HF.value, workdir=_WORKDIR.value, step=_STEP.value, seed=seed)
        return cfg, {"source": "hf", "path": _HF.value}
    if _WORKDIR.value is not None:
        cfg = with_workdir(cfg, _WORKDIR.value, seed=seed)
        step = run_step(_WORKDIR.value, _STEP.value)
        return cfg, {"source": "run", "workdir": _WORKDIR.value, "step": step}
    if _STEP.value is not None:
        raise ValueError(f"--step={_STEP.value} picks a checkpoint: pass the run's --workdir too")
    return cfg, {"source": "random", "seed": _SEED.value}


def load_weights(cfg, weights: dict):
    """The parameters `weights` (choose_weights) names, shaped as `cfg.model`."""
    if weights["source"] == "hf":
        return initial_params(cfg)
    if weights["source"] == "run":
        return load_params(weights["workdir"], weights["step"])[1]
    return kvlab.init_params(cfg.model, jax.random.key(weights["seed"]))


def weights_label(weights: dict) -> str:
    if weights["source"] == "hf":
        return f"weights of the Hugging Face checkpoint {weights['path']}"
    if weights["source"] == "run":
        return f"weights trained in {weights['workdir']}, step {weights['step']}"
    return f"random weights (seed {weights['seed']})"


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    # Several hosts (mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
    # before anything below touches a device.
    sharding.initialize_distributed(cfg.mesh)
    cfg, weights = choose_weights(cfg)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)  # before any compile
    params = load_weights(cfg, weights)
    model = kvlab.Transformer(cfg.model)
    tokens = text_tokens(_BATCH.value, _LENGTH.value, cfg.data.tokenizer)
    key, value = cached_prefixes(cfg.model)
    reference = cfg.cache.copy_and_resolve_references()
    reference.update({f"{key}_bits": 16, f"{value}_bits": 16})
    rows = []
    for key_bits in [int(b) for b in _BITS.value]:
        for value_bits in [int(b) for b in _BITS.value]:
            cache = cfg.cache.copy_and_resolve_references()
            cache.update({f"{key}_bits": key_bits, f"{value}_bits": value_bits})
            error = cache_error(
                model, params, tokens, cache, reference, _CHUNK.value, mesh=mesh, rules=rules
            )
            error["attention_relative_error"] = float(np.mean(error["attention_relative_error"]))
            rows.append(
                {
                    f"{key}_bits": key_bits,
                    f"{value}_bits": value_bits,
                    "cache_bytes": kvlab.cache_bytes(cfg.model, cache, _BATCH.value, _LENGTH.value),
                }
                | error
            )
    if not sharding.is_primary():  # every host has the same rows; process 0 prints
        return
    if _JSON.value:
        print(json.dumps(dict(weights=weights, config=cfg.to_dict(), rows=rows), indent=2))
        return
    print(f"{cli.attention_label(cfg.model)}; {weights_label(weights)}")
    print(
        f"{key:>6} {value:>6} {'attn rel err':>13} {'logit |err|':>12} {'KL':>10} "
        f"{'top-1 same':>11} {'loss change':>12} {'bytes':>10}"
    )
    for row in rows:
        print(
            f"{row[f'{key}_bits']:>6} {row[f'{value}_bits']:>6} "
            f"{row['attention_relative_error']:>13.5f} {row['logit_mean_abs_error']:>12.5f} "
            f"{row['kl_from_reference']:>10.2e} {row['top1_agreement']:>11.4f} "
            f"{row['loss_change']:>+12.5f} {row['cache_bytes']:>10,}"
        )


if __name__ == "__main__":
    cli.run(main)
