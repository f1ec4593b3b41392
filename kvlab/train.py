"""Training: AdamW with warm-up and cosine decay, one jitted step, orbax checkpoints.

    state, history = kvlab.train.train(cfg, workdir)

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

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from kvlab import sharding
from kvlab.config import complete_config, dtype_of, frozen
from kvlab.data import make_dataset, validate_config
from kvlab.files import WriteError, read_json, remedy, store_json, write_atomic, write_error
from kvlab.hf import load_hf
from kvlab.logging import Run
from kvlab.model import Transformer, param_axes, unfuse_projections


class NonFiniteLoss(FloatingPointError):
    """A training step's loss, gradient norm, updated weights or optimizer state
    was NaN or infinite."""


class DamagedCheckpoint(ValueError):
    """A checkpoint does not restore, or its arrays differ from what was saved."""


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied
    params: dict
    # optimizer()'s optax.OptState, a tuple (one state per transform of the chain);
    # annotated as the tuple because optax's alias does not resolve outside optax.
    opt_state: tuple


def learning_rate(train_cfg: Mapping) -> optax.Schedule:
    """Linear warm-up to `lr`, then cosine decay to lr / 10 at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train_cfg.lr,
        warmup_steps=train_cfg.warmup,
        decay_steps=max(train_cfg.steps, train_cfg.warmup + 1),
        end_value=train_cfg.lr / 10,
    )


def optimizer(train_cfg: Mapping) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; norms' scales and biases are not decayed."""
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.clip),
        optax.adamw(
            learning_rate(train_cfg),
            b1=0.9,
            b2=0.95,
            weight_decay=train_cfg.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def init_state(
    cfg: ml_collections.ConfigDict, params=None, *, mesh: Mesh | None = None, rules=None
) -> TrainState:
    """Fresh optimizer state over `params`, or over fresh parameters (seeded by
    train.seed), in one compiled call; with `mesh`, built laid out on it
    (`state_shardings`, by `rules`, default those of cfg.mesh)."""
    model, tx = Transformer(cfg.model), optimizer(cfg.train)

    def init(params):
        if params is None:
            # The key is made inside: an array made outside would sit on one
            # device, which a mesh over several hosts cannot take as an input.
            key = jax.random.key(cfg.train.seed)
            params = model.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    placed = None
    if mesh is not None:
        rules = sharding.axis_rules(cfg.mesh) if rules is None else rules
        placed = state_shardings(frozen(cfg.model), frozen(cfg.train), mesh, rules)
    return jax.jit(init, out_shardings=placed)(params)


def state_shardings(model_cfg, train_cfg, mesh: Mesh, rules: tuple) -> TrainState:
    """Where each array of the train state lives on `mesh`: the parameters by
    their logical axes (kvlab.model.param_axes, `rules`), each optimizer moment
    as the parameter it follows, counts and the step replicated."""
    model, tx = Transformer(model_cfg), optimizer(train_cfg)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    )
    params = sharding.shardings(param_axes(model_cfg), abstract, mesh, rules)
    by_path = {
        _key_names(path): (leaf.shape, placed)
        for (path, leaf), placed in zip(
            jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(params), strict=True
        )
    }

    def follow(path, leaf):
        # The moments of the parameter whose path ends this one's (mu/.../kernel).
        names = _key_names(path)
        for start in range(len(names)):
            shape, placed = by_path.get(names[start:], (None, None))
            if shape == leaf.shape:
                return placed
        return sharding.replicated(mesh)

    opt_state = jax.tree_util.tree_map_with_path(follow, jax.eval_shape(tx.init, abstract))
    return TrainState(step=sharding.replicated(mesh), params=params, opt_state=opt_state)


def _key_names(path) -> tuple:
    return tuple(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


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


def token_losses(model: Transformer, params, batch) -> dict:
    """Sums over the weighted targets of one batch: negative log-likelihood,
    correct argmax predictions and the weight itself (plain causal forward)."""
    logits, _ = model.apply({"params": params}, batch["inputs"])
    return score(logits, batch["targets"], batch["weights"])


def score(logits, targets, weights) -> dict:
    """Weighted sums of the next-token loss and of argmax hits for logits [B, T, V]."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(hits * weights),
        "weight": jnp.sum(weights),
    }


def all_finite(tree) -> jax.Array:
    """True when every floating-point number in `tree` is finite (a bool scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


@functools.cache
def compiled_step(model: Transformer, train_cfg, mesh: Mesh, rules: tuple):
    """`train_step` for this model and train section, jitted once per mesh: the
    state donated and kept where `state_shardings` puts it, batches split by
    rows (`batch`: data x fsdp), metrics replicated. XLA inserts the gathers of
    FSDP-split weights and the reductions of gradients; call it as
    `state, metrics = step(state, batch)`."""
    placed = state_shardings(model.config, train_cfg, mesh, rules)
    return jax.jit(
        functools.partial(train_step, model, train_cfg),
        in_shardings=(placed, sharding.batch_sharding(mesh, rules)),
        out_shardings=(placed, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def train_step(model: Transformer, train_cfg, state: TrainState, batch) -> tuple:
    """One AdamW update on one batch; returns (state, metrics). Pure: run it
    through `compiled_step`.

    The step keeps the new state only when everything it would keep is finite:
    the loss and gradient norm, and also the updated weights and optimizer
    state, which a learning rate too large for float32 overflows while the
    loss is still finite. Otherwise the state stays as it was and
    metrics["finite"] says which part was not (the host stops the run).
    """

    def loss_fn(params):
        sums = token_losses(model, params, batch)
        return sums["nll"] / jnp.maximum(sums["weight"], 1.0), sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer(train_cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = {
        "loss": jnp.isfinite(loss),
        "grad_norm": jnp.isfinite(grad_norm),
        "params": all_finite(params),
        "opt_state": all_finite(opt_state),
    }
    keep = finite["loss"] & finite["grad_norm"] & finite["params"] & finite["opt_state"]
    stepped = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), stepped, state)
    metrics = {
        "loss": loss,
        "accuracy": sums["correct"] / jnp.maximum(sums["weight"], 1.0),
        "grad_norm": grad_norm,
        "lr": learning_rate(train_cfg)(stepped.step - 1),
        "finite": finite,
    }
    return state, metrics


@functools.partial(jax.jit, static_argnums=0)
def _eval_step(model: Transformer, params, batch) -> dict:
    return token_losses(model, params, batch)


def evaluate_forward(model: Transformer, params, batches) -> dict:
    """Loss and accuracy over held-out batches with the plain causal forward."""
    totals = {"nll": 0.0, "correct": 0.0, "weight": 0.0}
    for batch in batches:
        sums = jax.device_get(_eval_step(model, params, batch))
        totals = {k: totals[k] + float(sums[k]) for k in totals}
    return summarize(totals, target_bytes(batches))


def target_bytes(batches) -> float | None:
    """UTF-8 bytes of text the weighted targets of `batches` cover, from their
    `target_bytes` (tokenized text); None for batches without it, whose targets
    are bytes themselves (or, for MQAR, no text at all)."""
    if not batches or any("target_bytes" not in batch for batch in batches):
        return None
    return sum(
        float(np.sum(np.asarray(b["target_bytes"], np.float64) * b["weights"])) for b in batches
    )


def summarize(totals: Mapping, num_bytes: float | None = None) -> dict:
    """loss (nats per target), perplexity, bits per token and per byte, and accuracy from sums.

    bits_per_byte divides the bits by `num_bytes`, the UTF-8 bytes the targets
    cover (`target_bytes`), when given; without it every target is a byte and
    it equals bits_per_token.
    """
    loss = totals["nll"] / max(totals["weight"], 1.0)
    bits_per_token = loss / np.log(2.0)
    if num_bytes is None:
        bits_per_byte = bits_per_token
    else:
        bits_per_byte = totals["nll"] / np.log(2.0) / max(num_bytes, 1.0)
    return {
        "loss": loss,
        "ppl": float(np.exp(loss)),
        "bits_per_token": bits_per_token,
        "bits_per_byte": bits_per_byte,
        "accuracy": totals["correct"] / max(totals["weight"], 1.0),
        "targets": int(totals["weight"]),
    }


# ---------------------------------------------------------------------------
# Checkpoints


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
# "<file>": Failed to write 7559 bytes to file 7: File too large [os_error_code='27']'.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_QUOTED = re.compile(r'"([^"]+)"')


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
            files = _QUOTED.findall(str(error)[: match.start()])
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
      unretrieved, and a tensorstore future of its failed write (asyncio ERROR
      'Task exception was never retrieved', 'Future exception ...');
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
        ("Task exception was never retrieved", "Future exception was never retrieved")
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
        template = _placed(jax.eval_shape(lambda: init_state(cfg)), one_device)
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
    --workdir read, and what train() resumes from (kvlab.convert's models,
    which no Hugging Face family holds)."""
    validate_config(cfg)
    if os.path.exists(os.path.join(workdir, "config.json")):
        raise ValueError(f"workdir={workdir!r} already holds a run (config.json): pick a new one")
    os.makedirs(workdir, exist_ok=True)
    _store_run_config(cfg, workdir)
    manager = checkpoint_manager(workdir, cfg.train)
    try:
        save(manager, init_state(cfg, unfuse_projections(params)))  # checkpoints stay unfused
    finally:
        manager.close()


def _placed(abstract, shardings):
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


def _store_run_config(cfg: ml_collections.ConfigDict, workdir: str, write: bool = True) -> None:
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


def _drop_replayed_metrics(workdir: str, step: int) -> None:
    """Keeps the lines of workdir/metrics.jsonl up to `step`, the restored one: the
    steps after it run again. A torn line (a run killed mid-write) goes too."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            logged = json.loads(line)
        except json.JSONDecodeError:
            continue
        if logged["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        write_atomic(path, "".join(kept))


def _wandb_run(cfg: ml_collections.ConfigDict, workdir: str, name: str, group) -> Run:
    """The run's wandb run: the one workdir/wandb_run_id names (a restart goes
    on logging there), else a new one whose id is stored there."""
    path = os.path.join(workdir, "wandb_run_id")
    stored = None
    if os.path.isfile(path):
        with open(path) as f:
            stored = f.read().strip() or None
    run = Run(
        cfg.wandb,
        name=name,
        config=cfg.to_dict(),
        workdir=workdir,
        job_type="train",
        group=group,
        run_id=stored,
    )
    if run.id is not None and run.id != stored:
        write_atomic(path, run.id + "\n")
    return run


# ---------------------------------------------------------------------------
# The loop


def host_batch(dataset, step: int, batch_size: int, seed: int, placed: NamedSharding) -> dict:
    """Training batch `step` (dataset.batch(step, batch_size, seed)) as arrays laid
    out by `placed`, this process reading only the rows its devices hold
    (`sharding.process_rows`): a pure function of (seed, step, process index), so
    a resumed multi-host run reads what an uninterrupted one read, and the hosts
    together the batch one host would. With one process: every row, as before."""
    rows = sharding.process_rows(placed, batch_size)
    local = dataset.batch(step, batch_size, seed, rows=rows)
    return {
        name: sharding.rows_array(array, rows, batch_size, placed) for name, array in local.items()
    }


class _Log:
    """Metrics on their way out: checked for finiteness, averaged over the steps
    since the last flush, appended to metrics.jsonl and sent to wandb."""

    def __init__(self, workdir: str | None, run: Run, bar: tqdm.tqdm, tokens_per_step: int):
        # None: a host other than the primary, which keeps the history but writes nothing.
        self.path = None if workdir is None else os.path.join(workdir, "metrics.jsonl")
        self.run, self.bar, self.tokens_per_step = run, bar, tokens_per_step
        self.history: list[dict] = []
        self.pending: list[tuple[int, dict]] = []  # (step, metrics still on the device)
        self.clock = time.perf_counter()

    def record(self, step: int, metrics: dict) -> None:
        self.history.append({"step": step, **metrics})
        if self.path is not None:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(self.history[-1]) + "\n")
            except OSError as error:  # a torn last line is dropped when the run resumes
                outcome = "training resumes from its last complete checkpoint"
                raise write_error(self.path, error, outcome) from error
        self.run.log(metrics, step=step)

    def flush(self, step: int, manager: ocp.CheckpointManager) -> None:
        """Checks and logs the steps run since the last flush."""
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])
        for (bad, _), m in zip(self.pending, fetched, strict=True):
            parts = [part for part, finite in m["finite"].items() if not finite]
            if parts:
                latest = manager.latest_step()
                kept = f"the latest checkpoint (step {latest}) is the last good state"
                raise NonFiniteLoss(
                    f"step {bad}: {', '.join(parts)} not finite (loss={float(m['loss'])}, "
                    f"grad_norm={float(m['grad_norm'])}); the step was not kept, the run "
                    f"stopped and {kept if latest is not None else 'no checkpoint was saved'}. "
                    "Lower train.lr or raise train.warmup"
                )
        elapsed = time.perf_counter() - self.clock
        metrics = {
            f"train/{k}": float(np.mean([m[k] for m in fetched]))
            for k in ("loss", "accuracy", "grad_norm")
        }
        metrics["train/lr"] = float(fetched[-1]["lr"])
        metrics["train/tokens_per_s"] = len(fetched) * self.tokens_per_step / elapsed
        self.record(step, metrics)
        self.bar.set_postfix(
            loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}"
        )
        self.pending = []
        self.clock = time.perf_counter()


def train(
    cfg: ml_collections.ConfigDict,
    workdir: str,
    *,
    name: str | None = None,
    group: str | None = None,
    progress: bool = True,
) -> tuple[TrainState, list[dict]]:
    """Trains `cfg.model` on `cfg.data` for `cfg.train.steps` steps in `workdir`.

    Resumes from the newest checkpoint there that restores (damaged ones are
    skipped with a warning and moved aside); every `train.eval_every` steps
    logs the loss on the validation split (plain forward). Returns the final
    state and the metrics logged by this call (the lines added to metrics.jsonl).
    """
    validate_config(cfg)
    sharding.initialize_distributed(cfg.mesh)  # several hosts, when asked (a no-op after the first)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)
    primary = sharding.is_primary()  # writes config, metrics and wandb; all save checkpoints
    tcfg = cfg.train
    train_data = make_dataset(cfg.data, "train", tcfg.seq_len)
    eval_batches = make_dataset(cfg.data, "validation", tcfg.seq_len).eval_batches(
        cfg.eval.batch_size, cfg.eval.num_batches
    )
    os.makedirs(workdir, exist_ok=True)
    _store_run_config(cfg, workdir, write=primary)  # every host refuses another model

    model = Transformer(cfg.model)
    frozen_train = frozen(tcfg)
    step_fn = compiled_step(model, frozen_train, mesh, rules)
    batch_placed = sharding.batch_sharding(mesh, rules)  # as compiled_step takes batches
    manager = checkpoint_manager(workdir, tcfg)
    try:
        # Restored onto this run's mesh, whatever mesh saved it.
        placed = state_shardings(model.config, frozen_train, mesh, rules)
        template = _placed(jax.eval_shape(lambda: init_state(cfg)), placed)
        damaged = os.path.join(workdir, "damaged_checkpoints")
        state = latest_good_state(manager, template, set_aside=damaged)
        if state is None:  # a new run: random weights, or those train.init_from names
            params = initial_params(cfg) if tcfg.init_from else None
            state = init_state(cfg, params, mesh=mesh, rules=rules)
        start = int(state.step)
        if start >= tcfg.steps:
            return state, []  # a finished run: nothing to do
        if primary:
            _drop_replayed_metrics(workdir, start)

        name = name or os.path.basename(os.path.abspath(workdir))
        run = _wandb_run(cfg, workdir, name, group)  # a no-op but on the primary host
        bar = tqdm.tqdm(
            total=tcfg.steps,
            initial=start,
            disable=not (progress and primary),
            desc=name,
            unit="step",
        )
        log = _Log(workdir if primary else None, run, bar, tcfg.batch_size * tcfg.seq_len)
        with run, bar:
            for step in range(start + 1, tcfg.steps + 1):
                batch = host_batch(train_data, step - 1, tcfg.batch_size, tcfg.seed, batch_placed)
                state, metrics = step_fn(state, batch)
                log.pending.append((step, metrics))
                bar.update(1)
                last = step == tcfg.steps
                if step % tcfg.log_every == 0 or last:
                    log.flush(step, manager)
                if step % tcfg.eval_every == 0 or last:
                    log.flush(step, manager)
                    result = evaluate_forward(model, state.params, eval_batches)
                    log.record(step, {f"eval/{k}": v for k, v in result.items()})
                if step % tcfg.checkpoint_every == 0 or last:
                    log.flush(step, manager)
                    save(manager, state)
            run.summary({k: v for line in log.history for k, v in line.items() if k != "step"})
    finally:
        manager.close()
    return state, log.history
