"""The sweep's grid (kvlab/sweep/grid.py): entries expand into units and slice
exactly, bad axes and sections are refused, the shipped sweep configs expand."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.cache import bits_label
from kvlab.config import import_config_file
from kvlab.eval import full_cache
from kvlab.sweep import (
    COLUMNS,
    Unit,
    expand,
    family,
    slice_units,
    split_sweep_config,
)
from tests.helpers import ROOT
from tests.sweep.helpers import GRID, sweep_config


@given(units=st.integers(0, 40), count=st.integers(1, 12))
def test_slices_cover_the_grid_exactly_once_and_in_order(units, count):
    grid = [Unit(f"m{i // 5}", f"c{i % 5}", None) for i in range(units)]
    slices = [slice_units(grid, i, count) for i in range(count)]
    assert [u for part in slices for u in part] == grid
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_bad_slices_are_refused():
    with pytest.raises(ValueError, match="--sweep_index=3"):
        slice_units([], 3, 3)
    with pytest.raises(ValueError, match="--sweep_count=0 is below 1"):
        slice_units([], 0, 0)
    with pytest.raises(ValueError, match="--sweep_index=-1 is below 0"):
        slice_units([], -1, 2)
    with pytest.raises(ValueError, match="--sweep_count=True is not an integer"):
        slice_units([], 0, True)
    assert slice_units(list("abcd"), np.int64(1), np.int32(2)) == ["c", "d"]


def test_cache_entries_apply_to_the_models_that_cache_their_tensors(tmp_path):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    units = expand(cfg, GRID)
    assert [(u.model, u.cache) for u in units] == [
        ("mqa", "16bit"),
        ("mqa", "K8V4"),
        ("mla", "16bit"),
        ("mla", "L4R16"),
    ]
    assert units[1].cfg.cache.v_bits == 4 and units[1].cfg.model.num_kv_heads == 1
    assert units[3].cfg.cache.latent_bits == 4 and units[3].cfg.model.attention == "mla"


def test_cache_entries_reach_nested_fields_and_the_baseline_keeps_every_token(tmp_path):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    snapkv = {"cache.evict.method": "snapkv", "cache.evict.ratio": 0.5}
    quantized = {"cache.k_bits": 8, "cache.v_bits": 8, "cache.k_axis": "token"}
    grid = {
        "models": {"mqa": {"model.num_kv_heads": 1}},
        "caches": {"snapkv50+K8V8": {**snapkv, **quantized}},
    }
    (unit,) = expand(cfg, grid)
    evicted = unit.cfg.cache
    assert (evicted.evict.method, evicted.evict.ratio, evicted.k_bits) == ("snapkv", 0.5, 8)
    baseline = full_cache(evicted)  # what delta_vs_16bit_pct compares with
    assert (baseline.evict.method, baseline.k_bits, baseline.v_bits) == ("none", 16, 16)
    assert (evicted.evict.method, evicted.k_bits) == ("snapkv", 8)  # a copy
    assert COLUMNS.index("evict_method") < COLUMNS.index("evict_ratio")
    with pytest.raises(ValueError, match="'cache.evict.metod' in caches"):
        expand(cfg, {"models": {"a": {}}, "caches": {"c": {"cache.evict.metod": "h2o"}}})


@pytest.mark.parametrize(
    "grid, match",
    [
        ({"models": {"a": {"model.num_kv_head": 2}}, "caches": {"c": {}}}, "'model.num_kv_head'"),
        ({"models": {"a": {}}, "caches": {"c": {"cache.kbits": 8}}}, "'cache.kbits'"),
        ({"models": {"a": {}}, "caches": {"c": {"k_bits": 8}}}, "'k_bits'"),
        ({"models": {"a": {}}, "caches": {"c": {"train.steps": 8}}}, "only change cache"),
        ({"models": {"a": {}}, "caches": {"c": {"cache.k_bits": 3}}}, "cache.k_bits=3"),
        ({"models": {"a": {}}, "caches": {}, "seeds": [1]}, "'seeds'"),
        ({"models": {"mla-1/2": {}}, "caches": {"c": {}}}, "use one without '/', e.g. 'mla-1-2'"),
        ({"models": {"..": {}}, "caches": {"c": {}}}, r"models\['..'\]: a model's name"),
        # An empty cell reads as None, and sweep.json's units are keyed by text.
        ({"models": {"a": {}}, "caches": {"": {}}}, r"caches\[''\]: an entry's name must be"),
        ({"models": {"": {}}, "caches": {"c": {}}}, r"models\[''\]: .* name it 'base'"),
        ({"models": {16: {}}, "caches": {"c": {}}}, r"models\[16\]: .* name it '16'"),
        ({"models": {"a": {}}, "caches": {4: {}}}, r"caches\[4\]: .* name it '4'"),
    ],
)
def test_unknown_or_misplaced_sweep_axes_are_refused(tmp_path, grid, match):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    with pytest.raises(ValueError, match=match):
        expand(cfg, grid)


@pytest.mark.parametrize(
    "sweep, match",
    [
        ({"name": "s", "seeds": 0}, "sweep.seeds=0 is below 1"),
        ({"name": "s", "seeds": 1.5}, "sweep.seeds=1.5 is not an integer"),
        ({"name": ""}, "sweep.name='' must be non-empty text"),
    ],
)
def test_bad_sweep_sections_are_refused(tmp_path, sweep, match):
    cfg = sweep_config(tmp_path)
    cfg.sweep = sweep
    with pytest.raises(ValueError, match=match):
        split_sweep_config(cfg)


def test_the_default_sweep_config_spans_every_lever():
    module = import_config_file(f"{ROOT}/configs/sweeps/cache_pareto.py")
    sweep_cfg = module.get_config("tiny")
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, module.get_grid(sweep_cfg))
    families = {(u.cfg.model.attention, u.cfg.model.num_kv_heads) for u in units}
    assert len({u.model for u in units}) >= 4 and len(families) >= 4
    bits = {(u.cfg.cache.k_bits, u.cfg.cache.v_bits) for u in units}
    assert {(16, 16), (8, 8), (8, 4), (4, 8), (2, 2)} <= bits
    assert any(u.cfg.cache.latent_bits < 16 for u in units)
    assert sweep.name == "cache_pareto_tiny" and sweep.seeds == 1
    three = module.get_config("tiny3")
    _, sweep = split_sweep_config(three)
    assert (sweep.name, sweep.seeds, three.train.steps) == ("cache_pareto_tiny3", 3, 500)
    with pytest.raises(ValueError, match="'tiny-3'"):
        module.get_config("tiny-3")


def test_the_recall_sweep_trains_four_designs_at_one_parameter_budget():
    """configs/sweeps/recall.py: MHA, GQA, MQA and MLA on MQAR with 3 seeds, their
    parameter counts (kvlab.init_params) within 2% of each other, each through
    its 16-bit cache and quantized caches of 8, 4 and 2 bits."""
    module = import_config_file(f"{ROOT}/configs/sweeps/recall.py")
    sweep_cfg = module.get_config("tiny")
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, module.get_grid(sweep_cfg), seeds=sweep.seeds)
    assert (sweep.name, sweep.seeds) == ("recall_tiny", 3)
    assert {u.cfg.data.source for u in units} == {"mqar"}
    assert {u.cfg.train.seed for u in units} == {0, 1, 2}
    counts = {}
    for unit in units:
        if unit.model not in counts:
            init = functools.partial(kvlab.init_params, unit.cfg.model, jax.random.key(0))
            shapes = jax.eval_shape(init)  # the parameters' shapes, nothing compiled
            counts[unit.model] = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    print("parameters:", counts)
    assert {family(u.cfg.model) for u in units} == {"mha", "gqa", "mqa", "mla"}
    assert max(counts.values()) <= 1.02 * min(counts.values())
    for model in counts:
        bits = [
            bits_label(u.cfg.model, u.cfg.cache)
            for u in units
            if u.model == model and u.cfg.train.seed == 0
        ]
        assert len(bits) == 4 and bits[0] in ("K16V16", "L16R16")
        assert {b[1] for b in bits[1:]} == {"8", "4", "2"}
