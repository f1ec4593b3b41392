"""Scorers that read the queries (Candidates.queries): TOVA written from the
queries and the keys alone, as a scorer registered here, keeps the tokens the
registered TOVA keeps (which reads the attention mass the layer observed) and
gives its logits, for one cache layer per model layer and for cross-layer
runs; a latent model offers its queries against the latent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlab.cache.evict.scorers import Candidates, Scorer
from kvlab.registry import SCORERS
from tests.cache.test_evict import evicting, run
from tests.helpers import VARIANTS, random_tokens


class TovaFromQueries(Scorer):
    """TOVA (arXiv:2401.06104): the last query's attention over the candidates,
    averaged over every query head, computed here from the queries and keys."""

    name, observes = "tova_from_queries", "last"

    def score(self, c: Candidates):
        keys = c.keys()[:, :, :, 0]  # [B, K, C, W]
        width = keys.shape[-1]
        logits = jnp.einsum("bkqw,bkcw->bkqc", c.queries, keys) / np.sqrt(width)
        logits = jnp.where(c.valid[:, :, None], logits, -jnp.inf)
        weights = c.query_weights  # [B, Q]: the last query's heads (of each attending layer)
        per_head = jnp.einsum("bkqc,bq->bkc", jax.nn.softmax(logits, -1), weights)
        per_head = per_head / weights.sum(-1)[:, None, None]
        return jnp.broadcast_to(per_head.mean(1, keepdims=True), per_head.shape)


SCORERS.register(TovaFromQueries())


@pytest.mark.parametrize("topology", ["layerwise", "cla:2"])
@pytest.mark.parametrize("chunks", [[20, 1, 1, 1, 1], [7, 7, 7, 3]])
def test_tova_from_the_queries_keeps_what_tova_keeps(topology, chunks):
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers, cfg.model.topology = 3, topology
    tokens = random_tokens(cfg, (2, sum(chunks)), seed=3)
    logits, cache = run(cfg, evicting(cfg, "tova", budget=6, recent=1), tokens, chunks, 32)
    mine, recomputed = run(
        cfg, evicting(cfg, "tova_from_queries", budget=6, recent=1), tokens, chunks, 32
    )
    for kept, again in zip(cache.layers, recomputed.layers, strict=True):
        np.testing.assert_array_equal(
            np.sort(np.asarray(kept.positions), -1), np.sort(np.asarray(again.positions), -1)
        )
    np.testing.assert_allclose(mine, logits, atol=1e-5)


class Shapes(Scorer):
    """Keeps the newest; records what it was handed (at trace time)."""

    name, observes, seen = "shapes", "window", []

    def score(self, c: Candidates):
        Shapes.seen.append((c.queries.shape, c.query_weights.shape, c.keys().shape))
        return c.positions.astype(jnp.float32)


SCORERS.register(Shapes())


@pytest.mark.parametrize("variant", ["mla_absorbed", "mla_expanded"])
def test_a_latent_model_offers_its_queries_against_the_latent(variant):
    cfg = VARIANTS[variant]()
    Shapes.seen.clear()
    tokens = random_tokens(cfg, (2, 9))
    run(cfg, evicting(cfg, "shapes", budget=4, obs_window=3), tokens, [9], 16)
    heads, rank = cfg.model.num_heads, cfg.model.mla.kv_rank
    for queries, weights, keys in Shapes.seen:  # one query head per latent: K = 1
        assert queries == (2, 1, 9 * heads, rank) and weights == (2, 9 * heads)
        assert keys[1] == 1 and keys[-1] == rank
