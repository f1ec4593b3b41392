"""The training loop: one pure, donated, jitted AdamW step over batches split by rows.

    state, history = kvlab.train.train(cfg, workdir)
    step = compiled_step(model, frozen(cfg.train), mesh, rules)
    state, metrics = step(state, batch)          # metrics["finite"]: what was finite

`train` resumes from the newest good checkpoint of `workdir` (workdir.py),
logs every `train.log_every` steps (metrics.jsonl, wandb), evaluates the
plain forward on the validation split every `train.eval_every` and saves
every `train.checkpoint_every`; a step that is not finite is not kept and
stops the run with NonFiniteLoss. `score` and `summarize` are the metrics
kvlab.eval reports through a cache too.
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
from jax.sharding import Mesh, NamedSharding

from kvlab import sharding
from kvlab.config import frozen
from kvlab.data import make_dataset, validate_config
from kvlab.files import write_atomic, write_error
from kvlab.logging import Run
from kvlab.model import Transformer
from kvlab.train.state import TrainState, init_state, learning_rate, optimizer, state_shardings
from kvlab.train.workdir import (
    checkpoint_manager,
    initial_params,
    latest_good_state,
    placed_like,
    save,
    store_run_config,
)


class NonFiniteLoss(FloatingPointError):
    """A training step's loss, gradient norm, updated weights or optimizer state
    was NaN or infinite."""


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
    store_run_config(cfg, workdir, write=primary)  # every host refuses another model

    model = Transformer(cfg.model)
    frozen_train = frozen(tcfg)
    step_fn = compiled_step(model, frozen_train, mesh, rules)
    batch_placed = sharding.batch_sharding(mesh, rules)  # as compiled_step takes batches
    manager = checkpoint_manager(workdir, tcfg)
    try:
        # Restored onto this run's mesh, whatever mesh saved it.
        placed = state_shardings(model.config, frozen_train, mesh, rules)
        template = placed_like(jax.eval_shape(lambda: init_state(cfg)), placed)
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
