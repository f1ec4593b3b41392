"""Trains one model; resumes from the latest checkpoint in --workdir.

    python scripts/train.py --config configs/gqa.py:tiny --workdir runs/gqa
    python scripts/train.py --config configs/mla.py:tiny --workdir runs/mla \
        --config.train.steps=1000 --config.wandb.mode=disabled

    python scripts/train.py --hf path/to/hf_model --workdir runs/uptrain \
        --config.train.steps=200 --config.train.lr=1e-4     # continue a checkpoint
    python scripts/train.py --init_from runs/mla_converted --workdir runs/mla_uptrained

Workdir layout: kvlab/train/__init__.py. Evaluate the result through any cache with
scripts/eval.py --workdir runs/gqa. --hf DIR (kvlab.cli.with_hf) starts from a
local Hugging Face checkpoint's weights: train.init_from=DIR, the model section
(and a tokenizer.json) from it, every other section from --config.
--init_from DIR (kvlab.cli.with_run) does the same from a kvlab run: a training
workdir's latest checkpoint, or a conversion scripts/convert.py wrote.

On two hosts (README, "Running on more than one device"), the same command on
each, with JAX_COORDINATOR_ADDRESS=host0:port JAX_NUM_PROCESSES=2 and
JAX_PROCESS_ID=0 or 1 (or --config.mesh.distributed=True under SLURM or on a
TPU pod, which jax detects).
"""

from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, sharding
from kvlab.train import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and wandb files go here.")
_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to start from.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "A kvlab run (training workdir or conversion) to start from."
)
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    # Several hosts (mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
    # before anything below touches a device.
    sharding.initialize_distributed(cfg.mesh)
    if _HF.value is not None:
        cfg = cli.with_hf(cfg, _HF.value, init_from=_INIT_FROM.value)
    elif _INIT_FROM.value is not None:
        cfg = cli.with_run(cfg, _INIT_FROM.value)
    mesh = sharding.make_mesh(cfg)  # train() makes the same one; a bad mesh fails here
    if mesh.size > 1 and sharding.is_primary():
        print(f"training on the {sharding.describe_mesh(mesh)}", flush=True)
    _, history = train(cfg, _WORKDIR.value)
    evals = [line for line in history if "eval/loss" in line]
    if evals:
        last = evals[-1]
        print(
            f"step {last['step']}: validation loss {last['eval/loss']:.4f}, "
            f"ppl {last['eval/ppl']:.3f}, bits/byte {last['eval/bits_per_byte']:.4f}"
        )
    else:
        print(f"{_WORKDIR.value} already holds a finished run of {cfg.train.steps} steps")


if __name__ == "__main__":
    cli.run(main)
