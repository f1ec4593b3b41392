"""A run's working directory: orbax checkpoints with checksums, config.json,
the weights a run starts from (the layout: kvlab/train/__init__.py).

    manager = checkpoint_manager(workdir, cfg.train)
    save(manager, state)                          # at state.step, with its sha256
    state = latest_good_state(manager, template)  # the newest that restores, or None
    cfg, params = load_params(workdir)            # a finished or interrupted run's weights
    start_workdir(cfg, params, workdir)           # a new run at step 0 holding `params`

A save the OS refuses raises kvlab.files.WriteError in one line (the step, the
folder, the reason); a checkpoint that does not restore, or whose arrays differ
from the checksum saved with it, raises DamagedCheckpoint, and
latest_good_state skips it with a warning. The echoes of a failed orbax call
(its worker threads' logs, tensorstore futures collected unretrieved, writes
never started at exit) are dropped, since the error reaches the caller anyway.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from kvlab import sharding
from kvlab.checkpoints.hf import load_hf
from kvlab.config import complete_config, dtype_of
from kvlab.data import validate_config
from kvlab.files import WriteError, read_json, remedy, store_json
from kvlab.model import unfuse_projections
from kvlab.train.state import TrainState, init_state


class DamagedCheckpoint(ValueError):
    """A checkpoint does not restore, or its arrays differ from what was saved."""


def checkpoint_manager(workdir: str, train_cfg: Mapping) -> ocp.CheckpointManager:
    # Saved synchronously: the next step donates the state's buffers.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=train_cfg.keep, create=True, enable_async_checkpointing=False
    )
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    # One unnamed item, fixed here: left to guess, orbax takes the layout from
    # the first step folder it reads, and a stray empty one makes it expect
    # several named items for every step.
    return ocp.CheckpointManager(
        directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


# The step metadata key of a checkpoint's checksum (state_checksum).
CHECKSUM_KEY = "kvlab_sha256"


def state_checksum(state: TrainState) -> str:
    """sha256 over every leaf of `state`: its tree path, dtype, shape and bytes.

    The whole arrays, whatever their layout: on several hosts every process
    gathers them (`process_allgather`, a collective all must call), so all agree."""
    if all(getattr(leaf, "is_fully_addressable", True) for leaf in jax.tree.leaves(state)):
        values = jax.device_get(state)
    else:
        values = multihost_utils.process_allgather(state, tiled=True)
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(values):
        array = np.ascontiguousarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save(manager: ocp.CheckpointManager, state: TrainState) -> None:
    """Saves `state` at its step, its checksum in the step's orbax metadata.

    A save the OS refuses (disk full, a file-size limit, no permission) raises
    WriteError naming the step, the folder, the reason and what to do, after
    removing what it had written; the checkpoints saved before stay whole (orbax
    writes a step into a temporary folder and renames it when complete).
    """
    step, checksum = int(state.step), state_checksum(state)
    previous = manager.latest_step()
    try:
        with _quiet_orbax_echoes():
            manager.save(
                step, args=ocp.args.StandardSave(state), custom_metadata={CHECKSUM_KEY: checksum}
            )
    except Exception as error:  # orbax raises tensorstore's ValueError, or an OSError
        reason = _os_reason(error)
        if reason is None:
            raise  # not the OS refusing: a bug, with its traceback
        directory = os.fspath(manager.directory)
        if sharding.is_primary():  # a partial step: free its space, as the message asks
            pattern = os.path.join(glob.escape(directory), f"{step}.orbax-checkpoint-tmp*")
            for partial in glob.glob(pattern):
                shutil.rmtree(partial, ignore_errors=True)
        raise _not_saved(directory, step, previous, *reason) from error


def _not_saved(
    directory: str, step: int, previous: int | None, code: int, reason: str, file: str | None
) -> WriteError:
    """The WriteError of step `step`'s save into `directory`, which the OS refused
    (`_os_reason`'s code, reason and file); `previous` is the last complete step."""
    if file is not None:
        inside = os.path.commonpath([directory, os.path.abspath(file)]) == directory
        reason += f", writing {os.path.relpath(file, directory) if inside else file}"
    resumes = (
        f"training resumes from the last complete checkpoint, step {previous}"
        if previous is not None
        else "no checkpoint was saved before it, so the run starts over"
    )
    return WriteError(
        code,
        reason,
        os.path.join(directory, str(step)),
        f"checkpoint step {step} was not saved in {directory} ({reason}): "
        f"{remedy(code, directory)}, then run again: {resumes}",
    )


# tensorstore's words for an OS failure, closing its message: '... Failed writing:
# "<file>": Failed to write 7559 bytes to file 7: File too large [os_error_code='27']',
# at times with the spec it was opening between the two ('[tensorstore_spec='{\"driver\"
# ...}']'), whose escaped quotes are no file.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TENSORSTORE_FILE = re.compile(r'Failed writing: "([^"]+)"')


def _innermost_line(error: BaseException) -> str:
    """'<type>: <first line>' of the innermost exception behind `error` (its
    cause's cause...), at most 300 characters: under orbax's wrappers ('Encountered
    error while reading array index...'), tensorstore's words for what went wrong."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]


def _os_reason(error: BaseException) -> tuple[int, str, str | None] | None:
    """(errno, the OS's reason, the file or None) of the innermost OS failure
    behind `error`: an OSError in its chain of causes, or one tensorstore
    reports in its message (orbax raises it as a ValueError); None when the OS
    refused nothing."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            filename = None if error.filename is None else os.fsdecode(error.filename)
            found = (error.errno, error.strerror or os.strerror(error.errno), filename)
        elif match := _TENSORSTORE_OS_ERROR.search(str(error)):
            code = int(match.group(1))
            files = _TENSORSTORE_FILE.findall(str(error)[: match.start()])
            found = (code, os.strerror(code), files[-1] if files else None)
        error = error.__cause__ or error.__context__
    return found


@contextlib.contextmanager
def _quiet_orbax_echoes():
    """Keeps quiet the echoes of a failed orbax save or restore, whose error
    reaches the caller anyway as the exception orbax raises: while it runs, its
    worker threads' log of that error with its traceback (absl ERROR
    '_SignalingThread.run() raised an exception'); from then on, what it leaves
    behind (`_drop_orbax_leftovers`)."""
    _drop_orbax_leftovers()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_not_a_thread_echo)
    try:
        yield
    finally:
        absl_logger.removeFilter(_not_a_thread_echo)


def _not_a_thread_echo(record: logging.LogRecord) -> bool:
    return "_SignalingThread.run() raised an exception" not in str(record.msg)


_ORBAX = f"{os.sep}orbax{os.sep}"  # in the path of orbax's source files


def _drop_orbax_leftovers() -> None:
    """Installs, once, a sys.unraisablehook and an asyncio log filter that drop
    what a failed orbax call leaves behind, as late as the interpreter's exit;
    everything else passes. Each is the error orbax raised, again:

    - a tensorstore write finishing after orbax closed the event loop it reports
      to ('Event loop is closed', unraisable);
    - an orbax read abandoned when another failed, raising as it is collected
      (unraisable, its object an orbax coroutine);
    - an orbax task whose failure orbax raised from another, collected
      unretrieved, a tensorstore future of its failed write and orbax's gather of
      them (asyncio ERROR 'Task exception was never retrieved', 'Future exception
      ...', '_GatheringFuture exception ...');
    - orbax's writes of the step that were never started (RuntimeWarning
      'coroutine ... was never awaited', as the interpreter exits).
    """
    logging.getLogger("asyncio").addFilter(_not_an_orbax_task)  # once: filters are a set
    # orbax's writes of a failed save, never started, collected at the interpreter's exit
    warnings.filterwarnings(
        "ignore",
        message=r"coroutine 'async_serialize_from_host\.<locals>\.\w+' was never awaited",
        category=RuntimeWarning,
    )
    if getattr(sys.unraisablehook, "drops_orbax_leftovers", False):
        return
    previous_hook = sys.unraisablehook

    def hook(unraisable) -> None:
        value, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
        closed = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        if not (closed or (code is not None and _ORBAX in code.co_filename)):
            previous_hook(unraisable)

    hook.drops_orbax_leftovers = True
    sys.unraisablehook = hook


def _not_an_orbax_task(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an orbax task or future collected with its
    failure unretrieved: its text names orbax's code or its temporary step folder."""
    message = record.getMessage()
    unretrieved = message.startswith(
        (
            "Task exception was never retrieved",
            "Future exception was never retrieved",
            "_GatheringFuture exception was never retrieved",  # orbax's gather of its writes
        )
    )
    return not (unretrieved and (_ORBAX in message or ".orbax-checkpoint-tmp" in message))


def restore(
    manager: ocp.CheckpointManager, template: TrainState, step: int | None = None
) -> TrainState:
    """The state saved at `step` (default the latest), shaped like `template`.

    Raises ValueError naming the steps there are when there is no checkpoint
    at `step`, and DamagedCheckpoint when it does not restore (files truncated
    or missing) or its arrays no longer match the checksum saved with them.
    """
    steps = list(manager.all_steps())
    if not steps:
        raise ValueError(f"{manager.directory} holds no checkpoint: train a model there first")
    step = max(steps) if step is None else step
    if step not in steps:
        raise ValueError(
            f"step={step!r} has no checkpoint in {manager.directory}, which holds steps "
            f"{steps}: pass one of those (or no step, for the latest)"
        )
    where = f"checkpoint step {step} in {manager.directory}"
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
        with _quiet_orbax_echoes():
            state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        saved = (manager.metadata(step).custom_metadata or {}).get(CHECKSUM_KEY)
    except Exception as error:  # orbax and tensorstore raise many kinds for damaged files
        raise DamagedCheckpoint(f"{where} does not restore ({_innermost_line(error)})") from error
    if saved is not None and saved != state_checksum(state):  # None: saved before checksums
        raise DamagedCheckpoint(f"{where} does not match the checksum saved with it")
    return state


def latest_good_state(
    manager: ocp.CheckpointManager, template: TrainState, set_aside: str | None = None
) -> TrainState | None:
    """The state of the newest checkpoint that restores (see `restore`); None when
    there is no checkpoint.

    Each newer, damaged one is skipped with a warning saying why; with
    `set_aside` (a folder) it is also moved there, so that a resumed run can
    save its step again. Raises ValueError when no checkpoint restores.
    """
    damaged = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            state = restore(manager, template, step)
        except DamagedCheckpoint as error:
            damaged.append((step, error))
            continue
        for bad_step, error in damaged:
            moved = ""
            if set_aside is not None:
                moved = f"; moved it to {_move_aside(manager, bad_step, set_aside)}"
            warnings.warn(f"{error}: skipped it for step {step}{moved}", stacklevel=2)
        manager.reload()
        return state
    if damaged:
        raise ValueError(
            f"no checkpoint restores ({'; '.join(str(error) for _, error in damaged)}): move "
            f"{manager.directory} aside to start the run over"
        )
    return None


def _move_aside(manager: ocp.CheckpointManager, step: int, folder: str) -> str:
    """Moves checkpoint `step` into `folder` (as <step>, or <step>-<n> if taken); returns where."""
    os.makedirs(folder, exist_ok=True)
    target, n = os.path.join(folder, str(step)), 0
    while os.path.exists(target):
        n += 1
        target = os.path.join(folder, f"{step}-{n}")
    if sharding.is_primary():  # one host moves it; the others wait until it has
        shutil.move(os.path.join(manager.directory, str(step)), target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"kvlab: checkpoint {step} set aside")
    return target


def load_params(workdir: str, step: int | None = None):
    """(config, params) of a finished or interrupted run in `workdir`: the
    checkpoint at `step`, or the newest one that restores."""
    cfg = load_run_config(workdir)
    manager = checkpoint_manager(workdir, cfg.train)
    try:
        # Onto this process's first device, whatever mesh the run was saved from.
        one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        template = placed_like(jax.eval_shape(lambda: init_state(cfg)), one_device)
        if step is None:
            state = latest_good_state(manager, template)
            if state is None:
                raise ValueError(
                    f"workdir={workdir!r} holds no checkpoint: train a model there first"
                )
        else:
            try:
                state = restore(manager, template, step)
            except DamagedCheckpoint as error:
                raise DamagedCheckpoint(
                    f"{error}: pass another step, or none for the newest that restores"
                ) from error
    finally:
        manager.close()
    return cfg, state.params


def start_workdir(cfg: ml_collections.ConfigDict, params, workdir: str) -> None:
    """A new training workdir whose step-0 checkpoint holds `params` (fresh
    optimizer state): what load_params, `train.init_from`, scripts/eval.py
    --workdir read, and what train() resumes from (kvlab.checkpoints.convert's models,
    which no Hugging Face family holds)."""
    validate_config(cfg)
    if os.path.exists(os.path.join(workdir, "config.json")):
        raise ValueError(f"workdir={workdir!r} already holds a run (config.json): pick a new one")
    os.makedirs(workdir, exist_ok=True)
    store_run_config(cfg, workdir)
    manager = checkpoint_manager(workdir, cfg.train)
    try:
        save(manager, init_state(cfg, unfuse_projections(params)))  # checkpoints stay unfused
    finally:
        manager.close()


def placed_like(abstract, shardings):
    """ShapeDtypeStructs of `abstract` carrying `shardings` (a tree like it, or one
    for every leaf): the targets orbax restores onto."""
    if not isinstance(shardings, TrainState):
        shardings = jax.tree.map(lambda _: shardings, abstract)
    return jax.tree.map(
        lambda leaf, placed: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed),
        abstract,
        shardings,
    )


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config stored in workdir/config.json; fields added to the schema
    since the run was saved take their defaults."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"workdir={workdir!r} has no config.json: it is not a kvlab training directory"
        )
    return validate_config(ml_collections.ConfigDict(read_json(path)))


def store_run_config(cfg: ml_collections.ConfigDict, workdir: str, write: bool = True) -> None:
    """Records the config in workdir/config.json (rewritten only when it changed),
    refusing to resume a different model or data; `write=False` only refuses."""
    store_json(
        os.path.join(workdir, "config.json"),
        json.loads(cfg.to_json()),
        fixed=("model", "data"),
        owner="a run",
        write=write,
        normalize=lambda stored: json.loads(
            complete_config(ml_collections.ConfigDict(stored)).to_json()
        ),
    )


def initial_params(cfg: ml_collections.ConfigDict):
    """The weights `train.init_from` names, shaped and typed as `cfg.model`'s.

    A kvlab training workdir gives its latest good checkpoint's parameters; a
    Hugging Face directory (config.json with a model_type) is imported with
    kvlab.load_hf. The source's model must be `cfg.model` (dtypes aside):
    a different one is refused naming the first field that differs.
    """
    path = cfg.train.init_from
    with open(os.path.join(path, "config.json")) as file:
        stored = json.load(file)
    if "model_type" in stored:
        source, params = load_hf(path)
    else:
        source, params = load_params(path)
    ignored = ("dtype", "param_dtype")
    # Plain dicts: ConfigDicts of equal fields compare unequal when one is locked.
    wanted, held = cfg.model.to_dict(), source.model.to_dict()
    for key, value in wanted.items():
        if key not in ignored and held.get(key) != value:
            raise ValueError(
                f"train.init_from={path!r} holds a model with model.{key}="
                f"{held.get(key)!r} but the config has {value!r}: start from a config "
                "whose model section is the source's (its config.json, or kvlab.load_hf's)"
            )
    dtype = dtype_of(cfg.model.param_dtype)
    return jax.tree.map(lambda leaf: jnp.asarray(leaf, dtype), params)
