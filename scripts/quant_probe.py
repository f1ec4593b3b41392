"""How much each key and value bit-width changes a model's attention and logits.

    python scripts/quant_probe.py --config configs/kv_kivi2.py:tiny
    python scripts/quant_probe.py --config configs/gqa.py:tiny --bits=16,8,4,2 --json
    python scripts/quant_probe.py --hf path/to/hf_model --config configs/kv_kivi2.py:tiny
    python scripts/quant_probe.py --config configs/gqa.py:tiny --config.mesh.tensor=2

For every pair (key bits, value bits) from --bits, the model reads a stretch of
real text (a Python standard-library source file, as bytes) through that cache
in chunks of --chunk tokens, and kvlab.probe.cache_error compares its
attention outputs and logits with a 16-bit cache's. The config's other cache
settings (axes, group size, residual, zero points) apply to every pair; for a
latent-attention model the pairs are (latent bits, RoPE-key bits).

The weights are randomly initialised (seeded): a random model's attention is
flatter than a trained one's, which makes key errors matter less than they do
in a trained model. Read the numbers as a property of this model, or measure
a real one: --hf DIR (kvlab.cli.with_hf) takes the model and its weights from
a local Hugging Face checkpoint, and the text goes through its tokenizer.json
when the folder holds one.

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
from kvlab.probe import cache_error
from kvlab.train import initial_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_BITS = flags.DEFINE_list("bits", ["16", "8", "4", "2"], "Bit-widths to pair up.")
_LENGTH = flags.DEFINE_integer("seq_len", 256, "Tokens per row.")
_BATCH = flags.DEFINE_integer("batch_size", 2, "Rows (consecutive stretches of the text).")
_CHUNK = flags.DEFINE_integer("chunk", 16, "Tokens fed per step.")
_SEED = flags.DEFINE_integer("seed", 0, "Parameter seed.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")
_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to measure.")


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


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    # Several hosts (mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
    # before anything below touches a device.
    sharding.initialize_distributed(cfg.mesh)
    if _HF.value is not None:
        cfg = cli.with_hf(cfg, _HF.value)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)  # before any compile
    if _HF.value is not None:
        params = initial_params(cfg)
    else:
        params = kvlab.init_params(cfg.model, jax.random.key(_SEED.value))
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
        print(json.dumps(dict(config=cfg.to_dict(), rows=rows), indent=2))
        return
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
