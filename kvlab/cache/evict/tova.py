"""TOVA (arXiv:2401.06104): the tokens the step's last query attends to least go.

    cfg.cache.evict.method = "tova"     # kvlab.registry.SCORERS ships it by this name

The score of a token is the attention the last (real) query of a step gives
it, averaged over every query head of the layer (kvpress's TOVAPress: the
mean over heads, repeated for each KV head), so all of a layer's KV heads
keep the same tokens. The `recent` latest positions stay whatever their score
(cache.evict.recent; with 0, TOVA's own rule, the step's new token competes
too and goes when its query gives itself the least attention). A whole method
in one file: the scorer and its registration; the layer, the budgets, the
bytes, the label and the sweeps do the rest.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer, attention
from kvlab.registry import SCORERS


class Tova(Scorer):
    """The last query's attention, the mean over the layer's heads."""

    name, observes = "tova", "last"
    stepwise = True  # its definition evicts at every step (the default interval: 1)

    def score(self, c: Candidates) -> Array:
        # Each KV head's mass is the mean over its query heads; the groups are
        # equal, so their mean is the mean over every query head. Candidate j is
        # the same token in every head: the heads get equal scores, so they
        # keep and evict alike from the first step on.
        per_head = attention(c)  # [B, E, C]
        return jnp.broadcast_to(per_head.mean(1, keepdims=True), per_head.shape)


SCORERS.register(Tova())
