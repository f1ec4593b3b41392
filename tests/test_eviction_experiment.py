"""configs/sweeps/eviction.py and experiments/eviction.py: the grid spans every
policy, ratio and family, and a two-model slice of it runs end to end."""

import csv

from kvlab.cache.evict import scorer_of
from kvlab.config import evict_methods, import_config_file
from kvlab.sweep import expand, split_sweep_config
from tests.helpers import ROOT, run_experiment

CONFIG = f"{ROOT}/configs/sweeps/eviction.py"


def test_the_eviction_grid_spans_every_policy_ratio_and_family():
    module = import_config_file(CONFIG)
    sweep_cfg = module.get_config("tiny")
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, module.get_grid(sweep_cfg))
    assert sweep.name == "eviction_tiny"
    by_model = {}
    for u in units:
        by_model.setdefault(u.model, {})[u.cache] = u.cfg
    assert list(by_model) == ["mha", "gqa2", "mqa", "mla64", "mqar-mha"]
    assert by_model["mqar-mha"]["16bit"].data.source == "mqar"
    for model, caches in by_model.items():
        evicted = {(c.cache.evict.method, c.cache.evict.ratio) for c in caches.values()}
        attention = caches["16bit"].model.attention
        for method in evict_methods()[1:]:
            scorer = scorer_of(method)
            # every method that scores this attention kind, needs nothing calibrated
            # and no probes after a context
            applies = scorer is None or (
                attention in scorer.attention_kinds
                and not scorer.calibrated
                and scorer.observes != "probes"
            )
            for ratio in module.RATIOS:
                assert ((method, ratio) in evicted) == applies, (model, method, ratio)
        assert caches["16bit"].cache.evict.method == "none"
        assert caches["snapkv12.5"].cache.evict.ratio == 0.125
        assert "h2o50+K8V8" in caches or "h2o50+L8R16" in caches
    mha = by_model["mha"]
    assert mha["snapkv50+K4V4"].cache.k_bits == 4 and mha["snapkv50+K4V4"].cache.k_axis == "token"
    assert mha["K4V4-kivi"].cache.k_axis == "channel"
    assert "L4R16" not in mha and "K8V8" not in by_model["mla64"]


def test_a_slice_of_the_experiment_runs_end_to_end(tmp_path):
    workdir, results = tmp_path / "sweep", tmp_path / "results"
    flags = [
        f"--workdir={workdir}",
        f"--results={results}",
        "--models=mqar-mha",
        "--caches=h2o50+K8V8",  # and the 16-bit baseline
        "--slices=1",
        "--config.sweep.mqar_steps=2",
        "--config.train.batch_size=2",
        "--config.train.seq_len=32",
        "--config.eval.batch_size=2",
        "--config.eval.num_batches=1",
    ]
    run_experiment("eviction.py", flags)
    with open(results / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["cache"], r["metric"]) for r in rows] == [
        ("mqar-mha", "16bit", "accuracy"),
        ("mqar-mha", "h2o50+K8V8", "accuracy"),
    ]
    evicted = [(r["evict_method"], r["evict_ratio"]) for r in rows]
    assert evicted == [("none", "1.0"), ("h2o", "0.5")]
    full, evicted = (float(r["cache_bytes_per_token"]) for r in rows)
    assert evicted < full / 2  # half the tokens at 8 bits, with their positions and scores
    assert (results / "recall.png").read_bytes()[:4] == b"\x89PNG"
    assert not (results / "perplexity.png").exists()  # no byte model in this slice
    summary = (results / "summary.md").read_text()
    assert "## Recall (MQAR accuracy)" in summary and "| mqar-mha | " in summary
