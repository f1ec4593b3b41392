"""Training: AdamW with warm-up and cosine decay, one jitted step, orbax checkpoints.

    state, history = kvlab.train.train(cfg, workdir)
    cfg, params = kvlab.train.load_params(workdir)

    state.py     the train state, the optimizer, where each array lives on a mesh
    loop.py      train(): the jitted step (train_step, compiled_step), batches,
                 metrics, the plain-forward evaluation (score, summarize)
    workdir.py   a run's working directory: orbax checkpoints with checksums
                 (save, restore, latest_good_state), config.json, load_params,
                 start_workdir, initial_params (train.init_from)

A run's working directory holds

    workdir/config.json        the whole config the run was last started with
    workdir/checkpoints/<step> orbax checkpoints of the train state (the last
                               `train.keep`, every `train.checkpoint_every` steps
                               and at the end), each with the sha256 of its
                               arrays in its orbax metadata
    workdir/damaged_checkpoints/<step>  checkpoints a resume found damaged
    workdir/metrics.jsonl      one JSON line per logged step (train and eval)
    workdir/wandb_run_id       the wandb run every restart continues
    workdir/wandb/             the wandb run (offline by default; `wandb sync`)

A run started in a working directory that holds checkpoints resumes from the
newest one that restores and matches its checksum: a truncated, partly deleted
or altered one is skipped with a warning and moved to damaged_checkpoints/.
Lines of metrics.jsonl after the restored step are dropped, as those steps run
again. Batches are a pure function of (seed, step) (kvlab/data), so a resumed
run continues exactly the loss curve of an uninterrupted one (bitwise on CPU).
A step whose loss, gradient, updated weights or optimizer state is not finite
leaves the state as it was and the run stops with `NonFiniteLoss` before
anything else is saved, so the latest checkpoint is always the last good state.
The files a later run reads are replaced atomically (kvlab/files.py).
A checkpoint the OS refuses to save (disk full, a file-size limit, no
permission) stops the run with `kvlab.files.WriteError`, one line naming the
step, the folder and the reason; orbax writes a step into a temporary folder
renamed when complete, so the checkpoints saved before are kept and the run
started again resumes from the last of them.

Every run is on the mesh of its config (`cfg.mesh`, kvlab/sharding.py; one
device by default when there is one): the jitted step (`compiled_step`) keeps
parameters and Adam moments split by their logical axes and takes batches split
by rows over data x fsdp; checkpoints hold the split arrays and a resumed run
restores them onto its own mesh, whatever mesh saved them.
"""

from kvlab.train.loop import (
    NonFiniteLoss,
    all_finite,
    compiled_step,
    evaluate_forward,
    host_batch,
    score,
    summarize,
    target_bytes,
    token_losses,
    train,
    train_step,
)
from kvlab.train.state import TrainState, init_state, learning_rate, optimizer, state_shardings
from kvlab.train.workdir import (
    CHECKSUM_KEY,
    DamagedCheckpoint,
    checkpoint_manager,
    initial_params,
    latest_good_state,
    load_params,
    load_run_config,
    restore,
    save,
    start_workdir,
    state_checksum,
)

__all__ = [
    "CHECKSUM_KEY",
    "DamagedCheckpoint",
    "NonFiniteLoss",
    "TrainState",
    "all_finite",
    "checkpoint_manager",
    "compiled_step",
    "evaluate_forward",
    "host_batch",
    "init_state",
    "initial_params",
    "latest_good_state",
    "learning_rate",
    "load_params",
    "load_run_config",
    "optimizer",
    "restore",
    "save",
    "score",
    "start_workdir",
    "state_checksum",
    "state_shardings",
    "summarize",
    "target_bytes",
    "token_losses",
    "train",
    "train_step",
]
