"""Plug-ins from installed packages (kvlab/registry.py): a package that names a
scorer in the entry-point group `kvlab.scorers` (docs/adding-a-method.md)."""

import importlib.metadata
import sys

import numpy as np
import pytest

import kvlab
from kvlab.registry import SCORERS
from tests.cache.test_evict import evicting, layer0_keys, run
from tests.helpers import VARIANTS, build, random_tokens, tiny_config

PLUGIN = '''
"""Keys by their first channel, the largest kept: a scorer of another package."""

from kvlab.cache.evict.scorers import Candidates, Scorer


class FirstChannel(Scorer):
    name = "first_channel"

    def score(self, c: Candidates):
        return c.keys()[..., 0, 0]  # [B, E, C]


FIRST_CHANNEL = FirstChannel()
'''


def install(site) -> None:
    """A package in folder `site`, as pip lays it out: its module and its dist-info
    naming the scorer in the group."""
    (site / "kvlab_first_channel.py").write_text(PLUGIN)
    info = site / "kvlab_first_channel-0.1.dist-info"
    info.mkdir()
    metadata = "Metadata-Version: 2.1\nName: kvlab-first-channel\nVersion: 0.1\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(
        "[kvlab.scorers]\nfirst_channel = kvlab_first_channel:FIRST_CHANNEL\n"
    )


def test_an_installed_packages_scorer_is_found_evicts_and_is_read_once(
    tmp_path, monkeypatch, request
):
    """Before the install the name is refused naming the field; once the package
    is on sys.path validation takes it and the cache evicts by it, keeping what
    its definition keeps. The group's entry points are read once while nothing
    is installed, however often validation asks, and again after an install
    (sys.path or a folder of it changed). The registry and sys.modules are as
    before once the test ends (other tests list every registered method)."""
    monkeypatch.setattr(SCORERS, "_registered", dict(SCORERS._registered))
    request.addfinalizer(lambda: sys.modules.pop("kvlab_first_channel", None))
    reads = []
    real = importlib.metadata.entry_points

    def counted(**kwargs):
        reads.append(kwargs.get("group"))
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    cfg = tiny_config()
    cfg.cache.evict.update(method="first_channel", budget=16, recent=2)
    with pytest.raises(ValueError, match=r"cache.evict.method='first_channel'"):
        kvlab.validate_config(cfg)
    cfg.cache.evict.update(method="knorm")
    for _ in range(20):
        kvlab.validate_config(cfg)
    assert reads.count("kvlab.scorers") <= 1, reads

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    install(site)
    assert "first_channel" in SCORERS.names()  # sys.path changed: read again
    cfg.cache.evict.update(method="first_channel")
    kvlab.validate_config(cfg)
    assert SCORERS.get("first_channel").name == "first_channel"
    read = reads.count("kvlab.scorers")
    for _ in range(20):
        kvlab.validate_config(cfg)
    assert reads.count("kvlab.scorers") == read

    # a block of 7 then a token a step through a budget of 5 (recent 0): a score that
    # does not change keeps, per KV head, the 5 keys of largest first channel of all
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 13), seed=3)
    _, params, _ = build(cfg)
    keys = layer0_keys(cfg, params, tokens)[..., 0]  # [B, T, K]
    cache_cfg = evicting(cfg, "first_channel", budget=5, recent=0)
    _, cache = run(cfg, cache_cfg, tokens, [7] + [1] * 6)
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)  # [B, K, 5]
    largest = np.sort(np.argsort(-keys, axis=1)[:, :5], axis=1)  # [B, 5, K]
    np.testing.assert_array_equal(kept, np.swapaxes(largest, 1, 2))
