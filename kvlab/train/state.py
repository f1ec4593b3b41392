"""The train state and the optimizer: AdamW with warm-up and cosine decay.

    state = init_state(cfg, params=None, mesh=mesh)     # TrainState(step, params, opt_state)
    placed = state_shardings(cfg.model, cfg.train, mesh, rules)   # a TrainState of shardings

Parameters and Adam moments are split by the parameters' logical axes
(kvlab.model.param_axes, kvlab/sharding.py); the step and counts are
replicated. Checkpoints (workdir.py) hold the state as it is laid out here.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct
from jax.sharding import Mesh

from kvlab import sharding
from kvlab.config import frozen
from kvlab.model import Transformer, param_axes


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
