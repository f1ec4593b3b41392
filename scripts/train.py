"""Trains one model; resumes from the latest checkpoint in --workdir.

    python scripts/train.py --config configs/gqa.py:tiny --workdir runs/gqa
    python scripts/train.py --config configs/mla.py:tiny --workdir runs/mla \
        --config.train.steps=1000 --config.wandb.mode=disabled

Workdir layout: kvlab/train.py. Evaluate the result through any cache with
scripts/eval.py --workdir runs/gqa.
"""

from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli
from kvlab.train import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and wandb files go here.")
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
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
