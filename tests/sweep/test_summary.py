"""The sweep's summary (kvlab/sweep/summary.py): the paired bootstrap. The merge
itself runs in tests/sweep/test_run.py, after real slices."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.sweep import (
    bootstrap,
)


@settings(max_examples=25, deadline=None)
@given(
    seeds=st.integers(1, 3),
    windows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    metric=st.sampled_from(["ppl", "accuracy"]),
)
def test_the_bootstrap_is_deterministic_paired_and_exact_where_nothing_varies(
    seeds, windows, seed, metric
):
    rng = np.random.default_rng(seed)
    weight = rng.integers(1, 40, (seeds, windows)).astype(np.float64)
    sums = {
        "nll": weight * rng.uniform(1, 3, weight.shape),
        "correct": weight * rng.uniform(0, 1, weight.shape),
        "weight": weight,
    }
    other = {**sums, "nll": sums["nll"] * 1.1, "correct": sums["correct"] * 0.9}
    result = bootstrap(metric, other, sums)
    assert result == bootstrap(metric, other, sums)  # a fixed numpy seed: the same draws
    assert (
        result["ci_low"] <= result["ci_high"] and result["delta_ci_low"] <= result["delta_ci_high"]
    )
    # worse everywhere (10% more nll, 10% fewer hits): the whole interval says so
    worse = result["delta_ci_low"] > 0 if metric == "ppl" else result["delta_ci_high"] <= 0
    assert worse
    # paired with itself: exactly 0, and no width
    same = bootstrap(metric, sums, sums)
    assert (same["delta"], same["delta_ci_low"], same["delta_ci_high"]) == (0.0, 0.0, 0.0)
    # every seed and window alike: the interval is the mean itself
    alike = {k: np.full((seeds, windows), v[0, 0]) for k, v in sums.items()}
    flat = bootstrap(metric, alike)
    assert flat["ci_low"] == flat["mean"] == flat["ci_high"]
    with pytest.raises(ValueError, match=r"\[seeds, windows\]"):
        bootstrap(metric, sums, {k: np.tile(v, 2) for k, v in sums.items()})
