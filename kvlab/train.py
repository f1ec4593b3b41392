"""Training: AdamW with warm-up and cosine decay, one jitted step, orbax checkpoints.

    state, history = kvlab.train.train(cfg, workdir)

A run's working directory holds

    workdir/config.json        the whole config the run was started with
    workdir/checkpoints/<step> orbax checkpoints of the train state (the last
                               `train.keep`, every `train.checkpoint_every` steps
                               and at the end)
    workdir/metrics.jsonl      one JSON line per logged step (train and eval)
    workdir/wandb/             the wandb run (offline by default; `wandb sync`)

A run started in a working directory that holds checkpoints resumes from the
latest one. Batches are a pure function of (seed, step) (kvlab/data), so a
resumed run continues exactly the loss curve of an uninterrupted one (bitwise
on CPU). A step whose loss or gradient is not finite leaves the state as it was
and the run stops with `NonFiniteLoss` before anything else is saved, so the
latest checkpoint is always the last good state.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from flax import struct

from kvlab.config import base_config, frozen, validate_config
from kvlab.data import make_dataset
from kvlab.logging import Run
from kvlab.model import Transformer


class NonFiniteLoss(FloatingPointError):
    """The loss or the gradient norm of a training step was NaN or infinite."""


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied
    params: dict
    opt_state: optax.OptState


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


def init_state(cfg: ml_collections.ConfigDict) -> TrainState:
    """Fresh parameters (seeded by train.seed) and optimizer state, in one compiled call."""
    model, tx = Transformer(cfg.model), optimizer(cfg.train)

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init(jax.random.key(cfg.train.seed))


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


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def train_step(model: Transformer, train_cfg, state: TrainState, batch) -> tuple:
    """One AdamW update on one batch; returns (state, metrics).

    A non-finite loss or gradient leaves the state untouched (metrics report
    finite=False and the host stops the run).
    """

    def loss_fn(params):
        sums = token_losses(model, params, batch)
        return sums["nll"] / jnp.maximum(sums["weight"], 1.0), sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer(train_cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    stepped = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), stepped, state)
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
    return summarize(totals)


def summarize(totals: Mapping) -> dict:
    """loss (nats per target), perplexity, bits per target and accuracy from sums."""
    loss = totals["nll"] / max(totals["weight"], 1.0)
    return {
        "loss": loss,
        "ppl": float(np.exp(loss)),
        "bits_per_byte": loss / np.log(2.0),
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
    return ocp.CheckpointManager(directory, options=options)


def restore(manager: ocp.CheckpointManager, template: TrainState, step: int | None = None):
    """The state saved at `step` (default the latest), shaped like `template`."""
    step = manager.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def load_params(workdir: str, step: int | None = None):
    """(config, params) of a finished or interrupted run in `workdir`."""
    cfg = load_run_config(workdir)
    manager = checkpoint_manager(workdir, cfg.train)
    if manager.latest_step() is None:
        raise ValueError(f"workdir={workdir!r} holds no checkpoint: train a model there first")
    state = restore(manager, jax.eval_shape(lambda: init_state(cfg)), step)
    manager.close()
    return cfg, state.params


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"workdir={workdir!r} has no config.json: it is not a kvlab training directory"
        )
    with open(path) as f:
        stored = json.load(f)
    # Fields added to the schema after the run was saved take their defaults.
    cfg = base_config()
    for name, section in stored.items():
        _merge(cfg[name], section)
    return validate_config(cfg)


def _merge(target: ml_collections.ConfigDict, values: Mapping) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping) and key in target:
            _merge(target[key], value)
        else:
            target[key] = value


def _write_run_config(cfg: ml_collections.ConfigDict, workdir: str) -> None:
    """Stores the config, refusing to resume a different model or data."""
    path = os.path.join(workdir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            stored = json.load(f)
        for section in ("model", "data"):
            if stored[section] != json.loads(cfg[section].to_json()):
                raise ValueError(
                    f"workdir={workdir!r} holds a run with another {section} section: "
                    f"use a fresh workdir, or the config stored in {path}"
                )
    with open(path, "w") as f:
        f.write(cfg.to_json(indent=2))


# ---------------------------------------------------------------------------
# The loop


class _Log:
    """Metrics on their way out: checked for finiteness, averaged over the steps
    since the last flush, appended to metrics.jsonl and sent to wandb."""

    def __init__(self, workdir: str, run: Run, bar: tqdm.tqdm, tokens_per_step: int):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.run, self.bar, self.tokens_per_step = run, bar, tokens_per_step
        self.history: list[dict] = []
        self.pending: list[tuple[int, dict]] = []  # (step, metrics still on the device)
        self.clock = time.perf_counter()

    def record(self, step: int, metrics: dict) -> None:
        self.history.append({"step": step, **metrics})
        with open(self.path, "a") as f:
            f.write(json.dumps(self.history[-1]) + "\n")
        self.run.log(metrics, step=step)

    def flush(self, step: int, manager: ocp.CheckpointManager) -> None:
        """Checks and logs the steps run since the last flush."""
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])
        for (bad, _), m in zip(self.pending, fetched, strict=True):
            if not m["finite"]:
                raise NonFiniteLoss(
                    f"step {bad}: loss={float(m['loss'])}, grad_norm={float(m['grad_norm'])} is "
                    f"not finite; the run stopped and the latest checkpoint "
                    f"(step {manager.latest_step()}) is the last good state. Lower train.lr "
                    "or raise train.warmup"
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

    Resumes from the latest checkpoint there; every `train.eval_every` steps
    logs the loss on the validation split (plain forward). Returns the final
    state and the metrics logged by this call (the lines added to metrics.jsonl).
    """
    validate_config(cfg)
    tcfg = cfg.train
    train_data = make_dataset(cfg.data, "train", tcfg.seq_len)
    eval_batches = make_dataset(cfg.data, "validation", tcfg.seq_len).eval_batches(
        cfg.eval.batch_size, cfg.eval.num_batches
    )
    os.makedirs(workdir, exist_ok=True)
    _write_run_config(cfg, workdir)

    model = Transformer(cfg.model)
    frozen_train = frozen(tcfg)
    manager = checkpoint_manager(workdir, tcfg)
    if manager.latest_step() is None:
        state = init_state(cfg)
    else:
        state = restore(manager, jax.eval_shape(lambda: init_state(cfg)))
    start = int(state.step)
    if start >= tcfg.steps:
        manager.close()
        return state, []  # a finished run: nothing to do

    name = name or os.path.basename(os.path.abspath(workdir))
    config = cfg.to_dict()
    run = Run(cfg.wandb, name=name, config=config, workdir=workdir, job_type="train", group=group)
    bar = tqdm.tqdm(total=tcfg.steps, initial=start, disable=not progress, desc=name, unit="step")
    log = _Log(workdir, run, bar, tokens_per_step=tcfg.batch_size * tcfg.seq_len)
    try:
        with run, bar:
            for step in range(start + 1, tcfg.steps + 1):
                batch = train_data.batch(step - 1, tcfg.batch_size, tcfg.seed)
                state, metrics = train_step(model, frozen_train, state, batch)
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
                    manager.save(step, args=ocp.args.StandardSave(state))
            run.summary({k: v for line in log.history for k, v in line.items() if k != "step"})
    finally:
        manager.close()
    return state, log.history
