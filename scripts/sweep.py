"""Runs a sweep (or one slice of it) and writes results.csv and pareto.png.

    python scripts/sweep.py --config configs/sweeps/cache_pareto.py:tiny --workdir runs/cache_pareto
    python scripts/sweep.py --config ... --workdir DIR --sweep_index 2 --sweep_count 8  # a slice
    python scripts/sweep.py --config ... --workdir DIR --merge                         # join them
    python scripts/sweep.py --workdir DIR --replot --long_bytes   # redraw pareto.png only

Overrides reach every unit: --config.train.steps=100 --config.wandb.mode=disabled.
On several hosts, the same command on each with JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID (or --config.mesh.distributed=True under
SLURM or on a TPU pod): every model trains and evaluates on a mesh spanning
them, process 0 writes sweep.json, the slices, results.csv, summary.csv and
pareto.png. `--long_bytes` puts the bytes a token adds to a long cache
(cache_bytes_per_token_long) on the plot's x instead of the evaluation
window's; `--replot` redraws pareto.png from DIR/summary.csv alone.
Layout of DIR and the grid format: kvlab/sweep/ (__init__.py, grid.py).
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from kvlab import cli, sharding
from kvlab.config import import_config_file
from kvlab.sweep import merge, replot, run_sweep, split_sweep_config

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/sweeps/cache_pareto.py:tiny", "Sweep config file (get_config, get_grid)."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory.")
_INDEX = flags.DEFINE_integer("sweep_index", 0, "Which slice of the grid to run.")
_COUNT = flags.DEFINE_integer("sweep_count", 1, "How many slices the grid is cut into.")
_MERGE = flags.DEFINE_bool("merge", False, "Only join the slices already in --workdir.")
_REPLOT = flags.DEFINE_bool(
    "replot", False, "Only redraw --workdir's pareto.png from its summary.csv."
)
_LONG_BYTES = flags.DEFINE_bool(
    "long_bytes",
    False,
    "Plot against the bytes a token adds to a long cache (cache_bytes_per_token_long) "
    "instead of the evaluation window's bytes per token.",
)
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    workdir = _WORKDIR.value
    if _REPLOT.value:
        print(f"plot: {replot(workdir, long_bytes=_LONG_BYTES.value)}")
        return
    if _MERGE.value:
        rows = merge(workdir, long_bytes=_LONG_BYTES.value)
    else:
        cfg = _CONFIG.value
        # Several hosts (mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
        # before anything below touches a device.
        sharding.initialize_distributed(split_sweep_config(cfg)[0].mesh)
        path = config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]
        module = import_config_file(path)
        if not hasattr(module, "get_grid"):
            raise ValueError(f"sweep config {path!r} has no get_grid(cfg) function: add one")
        rows = run_sweep(
            cfg,
            module.get_grid(cfg),
            workdir,
            sweep_index=_INDEX.value,
            sweep_count=_COUNT.value,
            long_bytes=_LONG_BYTES.value,
        )
        if not sharding.is_primary():  # process 0 wrote and reports
            return
        if _COUNT.value > 1:
            done = cli.count(len(rows), "row")
            print(f"slice {_INDEX.value} of {_COUNT.value}: {done}; merge with --merge")
            return
    print(f"{cli.count(len(rows), 'result')}: {os.path.join(workdir, 'results.csv')}")
    print(f"plot: {os.path.join(workdir, 'pareto.png')}")
    mode = recorded_wandb_mode(workdir)
    if mode != "disabled":
        print(f"wandb runs ({mode}): {workdir}/**/wandb/")


def recorded_wandb_mode(workdir: str) -> str:
    """The sweep's wandb.mode as workdir/sweep.json records it (kvlab/sweep/run.py)."""
    with open(os.path.join(workdir, "sweep.json")) as f:
        return json.load(f)["config"]["wandb"]["mode"]


if __name__ == "__main__":
    cli.run(main)
