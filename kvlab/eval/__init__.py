"""Evaluation through a cache: what generation with that cache sees.

    result = kvlab.eval.evaluate(cfg.model, cfg.cache, params, batches, chunk=32)
    reference = kvlab.eval.evaluate_reference(cfg.model, full_cache(cfg.cache), params, batches)
    rows = kvlab.eval.evaluate_tasks(cfg, cfg.cache, params, ("needle",), (256, 512))
    errors = kvlab.eval.cache_error(model, params, tokens, cache_cfg, reference_cfg, chunk)

    perplexity.py   perplexity, accuracy and bytes per token of held-out windows through
                    a cache, and how far its next-token distributions move from a
                    reference cache's (KL, top-1 agreement, delta ppl)
    tasks.py        the long-context tasks (kvlab/data/tasks.py) through a cache at
                    several lengths, the needle's depth x length grid and heat map
    probe.py        per-layer attention outputs and logits of a cache against a reference
    benchmark.py    kvpress's protocol: each context compressed once after its prefill,
                    its questions answered greedily (RULER's records, kvlab/data/ruler.py)
    calibrate.py    what an eviction method computes offline from calibration text and
                    stores with the run (Q-Filters)

Training's plain-forward evaluation (kvlab.train.evaluate_forward) and the
metrics both report (score, summarize) are kvlab.train's; the sweeps
(kvlab.sweep) evaluate every (model, cache) of a grid through these.
"""

from kvlab.eval.perplexity import (
    Reference,
    cache_bytes_per_token,
    check_finite,
    compare_logits,
    evaluate,
    evaluate_reference,
    full_cache,
    full_precision,
    loss_change,
)
from kvlab.eval.probe import cache_error, run_through_cache
from kvlab.eval.tasks import evaluate_tasks, needle_matrix, plot_needle_grid

__all__ = [
    "Reference",
    "cache_bytes_per_token",
    "cache_error",
    "check_finite",
    "compare_logits",
    "evaluate",
    "evaluate_reference",
    "evaluate_tasks",
    "full_cache",
    "full_precision",
    "loss_change",
    "needle_matrix",
    "plot_needle_grid",
    "run_through_cache",
]
