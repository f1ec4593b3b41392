"""Scale-out (kvlab/sharding.py): meshes, logical axes, sharded params, caches and
training; the Engine, the probe, sweeps and the scripts on a mesh.

Two kinds of tests. Those named test_on_mesh_* need 8 devices: the normal
suite runs on one, so `test_eight_host_devices_in_a_subprocess` runs them in
one child pytest with XLA_FLAGS forcing 8 host CPU devices (XLA reads the
flag once, when the backend starts, so it cannot change inside this process;
and forcing it for the whole suite would put every training test on an
8-device mesh, as mesh.data=-1 is the default). The child also lowers XLA's
LLVM optimisation, which halves its compile time; single-device references
and mesh results are computed under the same flags. Run them directly with

    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_sharding.py -k on_mesh

The rest run here, on one device, without compiling anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kvlab
import kvlab.eval
import kvlab.eval.calibrate
import kvlab.eval.probe
import kvlab.kernels.native as native
import kvlab.sweep
from kvlab import sharding, train
from kvlab.cache.factory import cache_shardings
from kvlab.config import frozen
from kvlab.model import param_axes
from tests.helpers import (
    ROOT,
    count_compiles,
    flags_with_devices,
    mla_config,
    run_config,
    write_corpus,
)

EIGHT = jax.device_count() >= 8
on_eight = pytest.mark.skipif(not EIGHT, reason="runs in test_eight_host_devices_in_a_subprocess")
CHILD_FLAGS = flags_with_devices(8)
TOLERANCE = 1e-5  # float32: a sharded program sums in another order than one device


def model_config(mesh=(1, 1, 1), corpus=None, **model):
    """A one-layer GQA model (4 heads, 2 KV heads) small enough to compile fast, its
    training section the same for every test (one compiled step per mesh)."""
    cfg = kvlab.base_config("tiny") if corpus is None else run_config(corpus)
    cfg.model.update(num_layers=1, embed_dim=32, mlp_dim=64, num_kv_heads=2)
    cfg.model.update(model)
    # A small learning rate: Adam's first step, g / (|g| + eps), would magnify the
    # reordered sums of near-zero gradients past the tolerance at lr 3e-3.
    cfg.train.update(batch_size=8, seq_len=16, warmup=0, lr=1e-4, steps=3, log_every=1)
    cfg.train.update(checkpoint_every=2, eval_every=100)
    cfg.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    return cfg


def specs(tree):
    return jax.tree.map(lambda s: s.spec, tree)


def same_layout(got: NamedSharding, want: P, ndim: int) -> bool:
    return got.is_equivalent_to(NamedSharding(got.mesh, want), ndim)


# ---------------------------------------------------------------------------
# One device: config, rules, logical names


def test_invalid_meshes_name_the_axis_value_and_fix():
    cfg = model_config()
    cfg.mesh.tensor = 3
    with pytest.raises(ValueError, match=r"mesh.tensor=3 does not divide model.num_heads=4.*"):
        kvlab.validate_config(cfg)
    cfg = model_config(num_heads=8)
    cfg.model.mlp_dim, cfg.mesh.tensor = 66, 4
    with pytest.raises(ValueError, match=r"mesh.tensor=4 does not divide model.mlp_dim=66"):
        kvlab.validate_config(cfg)
    cfg = model_config((3, 1, 1))
    with pytest.raises(ValueError, match=r"mesh.data \* mesh.fsdp=3 does not divide train.batch"):
        kvlab.validate_config(cfg)
    cfg = model_config((-1, -1, 1))
    with pytest.raises(ValueError, match=r"mesh.fsdp=-1 is the second -1"):
        kvlab.validate_config(cfg)
    cfg = model_config((0, 1, 1))
    with pytest.raises(ValueError, match=r"mesh.data=0 is below 1"):
        kvlab.validate_config(cfg)
    cfg = model_config()
    cfg.mesh.rules.heads = "tensor,model"
    with pytest.raises(ValueError, match=r"mesh.rules.heads='tensor,model' names 'model'"):
        kvlab.validate_config(cfg)

    # What depends on the device count, before any compile.
    cfg = model_config((2, 2, 1))
    with pytest.raises(ValueError, match=r"make 4 devices but there are 8: .* product is 8"):
        sharding.mesh_shape(cfg.mesh, 8)
    cfg = model_config((-1, 3, 1))
    with pytest.raises(ValueError, match=r"mesh.data=-1 .* fix 3 devices, which do not divide"):
        sharding.mesh_shape(cfg.mesh, 8)
    assert sharding.mesh_shape(model_config((-1, 2, 2)).mesh, 8) == dict(data=2, fsdp=2, tensor=2)
    cfg = model_config((1, -1, 1))
    cfg.train.batch_size = 4  # fsdp=-1 becomes 8 on 8 devices: too many for 4 rows
    with pytest.raises(ValueError, match=r"mesh.data \* mesh.fsdp=8 does not divide train"):
        kvlab.config.check_mesh_shape(cfg, sharding.mesh_shape(cfg.mesh, 8))
    with pytest.raises(ValueError, match=r"make 2 devices but there are 1"):
        sharding.make_mesh(model_config((2, 1, 1)))


def test_one_device_default_mesh_is_the_single_device():
    mesh = sharding.make_mesh(model_config((-1, 1, 1)))
    assert dict(mesh.shape) == dict(data=1, fsdp=1, tensor=1)
    assert list(mesh.devices.flat) == jax.devices()[:1]


def test_every_parameter_has_logical_names():
    """Named by the layers (flax's with_logical_partitioning) or, for attention,
    by the fallback; param trees themselves stay plain arrays."""
    expected = {
        "embed/embedding": ("vocab", "embed"),
        "final_norm/scale": ("norm",),
        "block_0/attention_norm/scale": ("norm",),
        "block_0/mlp_norm/scale": ("norm",),
        "block_0/attention/query/kernel": ("embed", "heads", "head_dim"),
        "block_0/attention/key/kernel": ("embed", "kv_heads", "head_dim"),
        "block_0/attention/value/kernel": ("embed", "kv_heads", "head_dim"),
        "block_0/attention/out/kernel": ("heads", "head_dim", "embed"),
        "block_0/mlp/gate/kernel": ("embed", "mlp"),
        "block_0/mlp/up/kernel": ("embed", "mlp"),
        "block_0/mlp/down/kernel": ("mlp", "embed"),
        "unembed/kernel": ("embed", "vocab"),
    }
    assert flat_names(model_config(tie_embeddings=False).model) == expected

    mla = flat_names(mla_config(q_rank=24).model)
    assert mla["block_0/attention/key_up"] == ("latent", "heads", "head_dim")
    assert mla["block_0/attention/value_up"] == ("latent", "heads", "head_dim")
    assert mla["block_0/attention/query_up/kernel"] == ("latent", "heads", "head_dim")
    assert mla["block_0/attention/kv_down/kernel"] == ("embed", "latent")
    assert mla["block_0/attention/kv_norm/scale"] == ("norm",)

    moe = model_config()
    moe.model.moe.update(num_experts=4, num_shared_experts=1, routing="sigmoid")
    names = flat_names(moe.model)
    assert names["block_0/mlp/gate"] == ("experts", "embed", "mlp")
    assert names["block_0/mlp/down"] == ("experts", "mlp", "embed")
    assert names["block_0/mlp/router/kernel"] == ("embed", "experts")
    assert names["block_0/mlp/router_bias"] == ("experts",)
    assert names["block_0/mlp/shared/up/kernel"] == ("embed", "mlp")
    for cfg in (model_config(), mla_config(q_rank=24), moe):  # a name for every dimension
        params = jax.eval_shape(lambda c=cfg: kvlab.init_params(c.model, jax.random.key(0)))
        for name, leaf in zip(flat_names(cfg.model).values(), jax.tree.leaves(params), strict=True):
            assert len(name) == leaf.ndim and None not in name

    params = jax.eval_shape(lambda: kvlab.init_params(model_config().model, jax.random.key(0)))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))


def flat_names(model_cfg) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(
        param_axes(model_cfg), is_leaf=lambda x: isinstance(x, P)
    )
    return {"/".join(k.key for k in path): tuple(spec) for path, spec in leaves}


def test_rules_split_what_divides_and_replicate_the_rest():
    rules = sharding.axis_rules()
    sizes = dict(data=2, fsdp=4, tensor=2)
    layout = lambda names, shape: sharding.fit(  # noqa: E731
        nn.logical_to_mesh_axes(names, rules),
        shape,
        sizes,
    )
    assert layout(("embed", "heads", "head_dim"), (64, 4, 16)) == P("fsdp", "tensor", None)
    assert layout(("embed", "kv_heads", "head_dim"), (64, 1, 16)) == P("fsdp", None, None)  # MQA
    assert layout(("batch", None), (8, 32)) == P(("data", "fsdp"), None)
    assert layout(("batch", None), (2, 32)) == P("data", None)  # the longest run that divides
    assert layout(("vocab", "embed"), (255, 6)) == P(None, None)
    one_head = layout(("cache_batch", "cache_heads", None, None), (4, 1, 8, 8))
    assert one_head == P("data", None, None, None)


def test_cache_bytes_per_device_by_the_rules():
    cfg = model_config()
    whole = kvlab.cache_bytes(cfg.model, cfg.cache, 4, 64)
    mesh = dict(data=2, fsdp=2, tensor=2)
    # Rows over data x fsdp, the two KV heads over tensor: an eighth each (row bytes: a
    # quarter).
    per_device = kvlab.cache_bytes(cfg.model, cfg.cache, 4, 64, per_device=True, mesh=mesh)
    rows = kvlab.cache.accounting.ROW_BYTES * 4
    assert per_device == (whole - rows) // 8 + rows // 4
    mqa = model_config(num_kv_heads=1)
    replicated = kvlab.cache_bytes(mqa.model, mqa.cache, 4, 64, per_device=True, mesh=mesh)
    assert replicated == kvlab.cache_bytes(mqa.model, mqa.cache, 1, 64)  # its one head on each
    # The rule cache_batch='data' (rows over data alone) keeps a row on both fsdp devices.
    cfg.mesh.rules.cache_batch = "data"
    rules = sharding.axis_rules(cfg.mesh)
    by_data = kvlab.cache_bytes(
        cfg.model, cfg.cache, 4, 64, per_device=True, mesh=mesh, rules=rules
    )
    assert by_data == (whole - rows) // 4 + rows // 2
    with pytest.raises(ValueError, match="needs the mesh"):
        kvlab.cache_bytes(cfg.model, cfg.cache, 4, 64, per_device=True)


def test_train_script_takes_the_mesh_and_refuses_one_that_does_not_fit(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "scripts/train.py",
            f"--workdir={tmp_path}",
            "--config.mesh.data=2",
            "--config.wandb.mode=disabled",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "mesh.data=2 x mesh.fsdp=1 x mesh.tensor=1 make 2 devices but there are 1" in (
        result.stderr
    )


def test_eight_host_devices_in_a_subprocess():
    if EIGHT:
        pytest.skip("this process has the devices: the test_on_mesh_* tests run here")
    # The child is a plain pytest run, not one of this run's xdist workers.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "on_mesh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**inherited, "XLA_FLAGS": CHILD_FLAGS, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


# ---------------------------------------------------------------------------
# Eight devices (run by the test above)


def mesh_of(cfg):
    devices = jax.devices()[: int(np.prod([cfg.mesh[a] for a in ("data", "fsdp", "tensor")]))]
    return sharding.make_mesh(cfg, devices), sharding.axis_rules(cfg.mesh)


def placed_params(cfg, params, mesh, rules):
    return jax.device_put(params, sharding.shardings(param_axes(cfg.model), params, mesh, rules))


@pytest.fixture(scope="module")
def gqa():
    """The (2, 2, 2) mesh, the model, its params on one device and on the mesh."""
    cfg = model_config((2, 2, 2))
    mesh, rules = mesh_of(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    model = kvlab.Transformer(cfg.model)
    return cfg, mesh, rules, model, params, placed_params(cfg, params, mesh, rules)


PARAM_LAYOUT = {  # on (data, fsdp, tensor) = (2, 2, 2), 4 heads, 2 KV heads
    "embed/embedding": P("tensor", "fsdp"),
    "final_norm/scale": P(),
    "block_0/attention_norm/scale": P(),
    "block_0/mlp_norm/scale": P(),
    "block_0/attention/query/kernel": P("fsdp", "tensor", None),
    "block_0/attention/key/kernel": P("fsdp", "tensor", None),
    "block_0/attention/value/kernel": P("fsdp", "tensor", None),
    "block_0/attention/out/kernel": P("tensor", None, "fsdp"),
    "block_0/mlp/gate/kernel": P("fsdp", "tensor"),
    "block_0/mlp/up/kernel": P("fsdp", "tensor"),
    "block_0/mlp/down/kernel": P("tensor", "fsdp"),
}


def assert_forward_unchanged(model, params, placed, mesh, rules):
    """The forward of `placed` over rows split on the mesh equals one device's of `params`."""
    tokens = np.random.default_rng(0).integers(0, 256, (8, 8)).astype(np.int32)
    want, _ = jax.jit(model.apply)({"params": params}, tokens)
    rows = jax.device_put(tokens, sharding.batch_sharding(mesh, rules))
    got, _ = jax.jit(model.apply)({"params": placed}, rows)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


@on_eight
def test_on_mesh_params_follow_the_rules_and_the_forward_is_unchanged(gqa):
    cfg, mesh, rules, model, params, placed = gqa
    leaves = jax.tree_util.tree_leaves_with_path(placed)
    layout = {"/".join(k.key for k in path): leaf for path, leaf in leaves}
    assert layout.keys() == PARAM_LAYOUT.keys()
    for name, leaf in layout.items():
        assert same_layout(leaf.sharding, PARAM_LAYOUT[name], leaf.ndim), (name, leaf.sharding)
    mqa = model_config((2, 2, 2), num_kv_heads=1)  # one KV head: whole on every tensor device
    abstract = jax.eval_shape(lambda: kvlab.init_params(mqa.model, jax.random.key(0)))
    key = sharding.shardings(param_axes(mqa.model), abstract, mesh, rules)["block_0"]
    assert key["attention"]["key"]["kernel"].spec == P("fsdp", None, None)

    assert_forward_unchanged(model, params, placed, mesh, rules)


@on_eight
def test_on_mesh_fused_params_keep_the_head_and_mlp_layout(gqa):
    cfg, mesh, rules, model, params, placed = gqa
    fused = kvlab.sampling.place_params(cfg.model, kvlab.fuse_projections(params), mesh, rules)
    block = fused["block_0"]  # [D, K, G + 2, H] split over K; [D, 2, F] over F
    assert same_layout(block["attention"]["qkv"]["kernel"].sharding, P("fsdp", "tensor"), 4)
    assert same_layout(block["mlp"]["gate_up"]["kernel"].sharding, P("fsdp", None, "tensor"), 3)
    assert_forward_unchanged(model, params, fused, mesh, rules)


@on_eight
def test_on_mesh_a_panel_tree_is_refused(gqa):
    cfg, mesh, rules, model, params, placed = gqa
    panels = native.panel_projections(kvlab.fuse_projections(params))
    with pytest.raises(ValueError, match="place_params on a mesh of 8 devices takes the param"):
        kvlab.sampling.place_params(cfg.model, panels, mesh, rules)


# Through the steps: 16-bit rows, and quantized pools with per-row rings and first
# tokens (the quantized math, scales and zero points included). Laid out only: the rest.
CACHES = {
    "dense": dict(),
    "paged_quantized": dict(
        kind="paged", page_size=16, k_bits=4, v_bits=4, residual=16, k_full_first=2
    ),
    # 6 of 11 tokens kept per KV head in pages (h2o), positions and scores per row
    "paged_evicting": dict(kind="paged", page_size=4, evict=dict(method="h2o", budget=6, recent=2)),
    # keys stored pruned of half their channels (ThinK), the channel ids per row and head
    "pruned_keys": dict(evict=dict(method="think:snapkv", budget=6, recent=2)),
    # a prompt stored whole, compressed to 4 every 2 decode steps; the count per row, the
    # buffered queries per row and KV head
    "decoding": dict(
        evict=dict(method="snapkv", budget=4, recent=2, when="decoding", interval=2, headroom=6)
    ),
}
LAID_OUT = {
    "quantized": dict(k_bits=4, v_bits=8, residual=16, v_full_first=3),
    "paged": dict(kind="paged", page_size=8),
}


@on_eight
@pytest.mark.parametrize("kind", CACHES)
def test_on_mesh_prefill_and_decode_through_the_cache_are_unchanged(gqa, kind):
    cfg, mesh, rules, model, params, placed = gqa
    cfg = ml_collections.ConfigDict(cfg.to_dict())  # the fixture's stays as it is
    cfg.cache.update(CACHES[kind])
    through_the_cache(cfg, mesh, rules, model, params, placed)


@on_eight
def test_on_mesh_the_methods_added_through_registries_are_unchanged():
    """Cross-layer attention (three layers, two cache layers), keys rotated
    before 4-bit storage and TOVA's eviction, together in a quantized pool laid
    out by the same rules (docs/adding-a-method.md)."""
    cfg = model_config((2, 2, 2), num_layers=3, topology="cla:2")
    cfg.cache.update(kind="paged", page_size=16, k_bits=4, v_bits=4, residual=16)
    cfg.cache.update(k_transform="hadamard", v_transform="hadamard")
    cfg.cache.evict.update(method="tova", budget=32, recent=2)  # the ring and 1 group of 16
    mesh, rules = mesh_of(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    placed = placed_params(cfg, params, mesh, rules)
    cache = through_the_cache(cfg, mesh, rules, kvlab.Transformer(cfg.model), params, placed)
    assert len(cache.layers) == 2


@on_eight
def test_on_mesh_a_hybrid_model_is_unchanged():
    """A sliding layer's ring of 4 slots beside a full layer's 4-bit codes
    (model.layer_types), laid out by the same rules."""
    cfg = model_config((2, 2, 2), num_layers=2, sliding_window=4, layer_types=("sliding", "full"))
    cfg.cache.update(k_bits=4, v_bits=4, k_axis="token")
    mesh, rules = mesh_of(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    placed = placed_params(cfg, params, mesh, rules)
    cache = through_the_cache(cfg, mesh, rules, kvlab.Transformer(cfg.model), params, placed)
    assert [type(layer).__name__ for layer in cache.layers] == ["EvictingLayer", "QuantizedLayer"]


@on_eight
def test_on_mesh_calibrated_scales_and_outliers_are_unchanged(tmp_path):
    """fp8 codes over static ranges per KV head and channel (no scale array; the
    ranges split with the heads they belong to as constants) and an outlier a
    token beside the keys' codes, in pages."""
    cfg = model_config((2, 2, 2), num_layers=1)
    ranges = np.random.default_rng(0).uniform(1.0, 4.0, (1, 2, cfg.model.head_dim))
    path = str(tmp_path / "scales.npz")
    kvlab.eval.calibrate.save_scales(path, {"k": ranges, "v": ranges * 2})
    cfg.cache.update(kind="paged", page_size=8, k_bits=8, v_bits=8, k_format="fp8")
    cfg.cache.update(v_format="fp8", k_axis="calibrated", v_axis="calibrated", scales=path)
    cfg.cache.update(k_outliers=1)
    mesh, rules = mesh_of(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    placed = placed_params(cfg, params, mesh, rules)
    cache = through_the_cache(cfg, mesh, rules, kvlab.Transformer(cfg.model), params, placed)
    assert all(t.scale is None for t in cache.layers[0].tensors)


@on_eight
def test_on_mesh_merged_layers_and_codes_in_a_basis_are_unchanged(tmp_path):
    """MiniCache's merged pair (directions, 16-bit or quantized, magnitudes, kept
    tokens and their positions split by rows and heads) beside a layer of its own; keys and
    values coded in 8 of their directions (the bases split with their heads as
    constants); and xKV's pair coded in 24 of its 2 x 16 directions, offline or
    fitted per prompt (each row's bases split with its rows and heads), its codes
    16-bit or quantized."""
    rng = np.random.default_rng(0)

    def run(cfg, bases=None):
        if bases is not None:
            path = str(tmp_path / f"bases_{cfg.model.topology}.npz".replace(":", "_"))
            kvlab.eval.calibrate.save_bases(path, {"k": bases, "v": bases})
            cfg.cache.bases = path
        mesh, rules = mesh_of(cfg)
        params = kvlab.init_params(cfg.model, jax.random.key(0))
        placed = placed_params(cfg, params, mesh, rules)
        cache = through_the_cache(cfg, mesh, rules, kvlab.Transformer(cfg.model), params, placed)
        return [type(layer).__name__ for layer in cache.layers]

    cfg = model_config((2, 2, 2), num_layers=3, topology="minicache:1,keep=0.25")
    assert run(cfg) == ["DenseLayer", "MergedLayer"]
    cfg.cache.update(k_bits=8, v_bits=8, k_axis="token", group_size=8)  # directions quantized
    assert run(cfg) == ["QuantizedLayer", "MergedLayer"]
    cfg = model_config((2, 2, 2), num_layers=1)
    cfg.cache.update(k_bits=8, v_bits=8, k_rank=8, v_rank=8, group_size=8, k_axis="token")
    width = cfg.model.head_dim
    run(cfg, np.linalg.qr(rng.normal(size=(1, 2, width, width)))[0][..., :8])
    cfg = model_config((2, 2, 2), num_layers=2, topology="xkv:2")
    cfg.cache.update(k_rank=24, v_rank=24)
    bases = np.linalg.qr(rng.normal(size=(1, 2, 2 * width, 2 * width)))[0][..., :24]
    assert run(cfg, bases) == ["SharedBasisLayer"]
    cfg.model.topology, cfg.cache.bases = "xkv:2,fit=prompt", ""  # each row's own, split by rows
    assert run(cfg) == ["SharedBasisLayer"]
    cfg.model.topology = "xkv:2"  # 8-bit codes: payload, scales and zeros split by rows and heads
    cfg.cache.update(k_bits=8, v_bits=8, k_axis="token", group_size=8)
    assert run(cfg, bases) == ["SharedBasisLayer"]


def through_the_cache(cfg, mesh, rules, model, params, placed):
    """A prefill and three decode steps on the mesh give one device's logits, with
    the cache laid out by the rules before and after; returns the cache."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, (4, 8)).astype(np.int32)
    steps = rng.integers(0, 256, (3, 4)).astype(np.int32)

    def run(params, cache):
        logits, cache = kvlab.prefill(model, params, cache, prompt)
        out = [logits]
        for token in steps:
            logits, cache = kvlab.decode_step(model, params, cache, token)
            out.append(logits[:, None])
        cache.check()
        return np.concatenate(out, axis=1), cache

    want, _ = run(params, kvlab.init_cache(cfg.model, cfg.cache, 4, 32))
    cache = kvlab.init_cache(cfg.model, cfg.cache, 4, 32, mesh=mesh, rules=rules)
    assert_cache_layout(cache)
    measured = kvlab.tree_bytes(cache, per_device=True)
    assert measured == kvlab.cache_bytes(cfg.model, cfg.cache, 4, 32, per_device=True, mesh=mesh)
    got, cache = run(placed, cache)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    assert_cache_layout(cache)  # the steps keep the layout
    return cache


ROWS = ("data", "fsdp")  # the default rule of cache rows, cache_batch


def assert_cache_layout(cache, heads=("tensor",)):
    """Rows over data x fsdp, cached heads over tensor (when given), pools by heads only."""
    by_rows = P(ROWS, *heads)
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        name = jax.tree_util.keystr(path)
        parts = (".ring", ".first_tokens", ".positions", ".scores", ".buffer")
        per_row = any(part in name for part in parts)
        pooled = isinstance(cache, kvlab.cache.PagedCache) and not per_row
        per_row_only = (
            "lengths",
            "errors",
            "block_tables",
            "kept_positions",
            "kept_distance",
            ".since",
            ".buffer.positions",
        )
        if any(part in name for part in per_row_only):
            want = P(ROWS)
        else:
            want = P(*heads) if pooled else by_rows
        assert same_layout(leaf.sharding, want, leaf.ndim), (name, leaf.sharding)


@on_eight
@pytest.mark.parametrize("kind", LAID_OUT)
def test_on_mesh_every_cache_kind_is_laid_out_by_the_rules(gqa, kind):
    cfg, mesh, rules, *_ = gqa
    cache_cfg = ml_collections.ConfigDict(cfg.cache.to_dict())
    cache_cfg.update(LAID_OUT[kind])
    cache = kvlab.init_cache(cfg.model, cache_cfg, 4, 32, mesh=mesh, rules=rules)
    assert_cache_layout(cache)
    measured = kvlab.tree_bytes(cache, per_device=True)
    assert measured == kvlab.cache_bytes(cfg.model, cache_cfg, 4, 32, per_device=True, mesh=mesh)
    assert measured < kvlab.tree_bytes(cache)


@on_eight
def test_on_mesh_one_cached_head_is_replicated_over_tensor(gqa):
    """MLA (and MQA) cache one head: it sits whole on every tensor device."""
    _, mesh, rules, *_ = gqa
    cfg = mla_config()
    cache = kvlab.init_cache(cfg.model, cfg.cache, 4, 32, mesh=mesh, rules=rules)
    assert_cache_layout(cache, heads=())
    per_device = kvlab.cache_bytes(cfg.model, cfg.cache, 4, 32, per_device=True, mesh=mesh)
    assert per_device == kvlab.tree_bytes(cache, per_device=True)
    assert per_device == kvlab.cache_bytes(cfg.model, cfg.cache, 1, 32)  # a quarter of the rows
    abstract = cache_shardings(jax.eval_shape(lambda: cache), mesh, rules)
    assert specs(abstract.lengths) == P(ROWS)


@on_eight
def test_on_mesh_generate_equals_one_device_and_keeps_the_rows_split(gqa):
    cfg, mesh, rules, model, params, placed = gqa
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, 256, (4, 6)).astype(np.int32)
    lengths = np.array([6, 3, 1, 5])
    generate = lambda params, prompts: kvlab.generate(  # noqa: E731
        model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=5, prompt_lengths=lengths
    )
    want = generate(params, prompts)
    rows = sharding.batch_sharding(mesh, rules)
    got = generate(placed, jax.device_put(prompts, rows))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert same_layout(got.sharding, P(("data", "fsdp"), None), 2)
    with count_compiles() as compiles:  # other prompts of the same shape: no new program
        generate(placed, jax.device_put(prompts[::-1].copy(), rows))
    assert compiles[0] == 0


@on_eight
def test_on_mesh_evaluation_through_a_cache_equals_one_device(gqa):
    cfg, mesh, rules, model, params, placed = gqa
    batches = [batch_of(cfg, seed) for seed in (3, 4)]
    want = kvlab.eval.evaluate(cfg.model, cfg.cache, params, batches, chunk=8)
    got = kvlab.eval.evaluate(cfg.model, cfg.cache, params, batches, chunk=8, mesh=mesh)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= TOLERANCE * max(1.0, abs(value)), key


def batch_of(cfg, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (8, 17)).astype(np.int32)
    weights = np.ones((8, 16), np.float32)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], weights=weights)


def one_step(cfg, host_state, batch):
    """One training step of `host_state` on cfg's mesh: (state on the mesh, loss)."""
    mesh, rules = mesh_of(cfg)
    model, train_cfg = kvlab.Transformer(cfg.model), frozen(cfg.train)
    placed = train.state_shardings(frozen(cfg.model), train_cfg, mesh, rules)
    state = jax.device_put(host_state, placed)
    state, metrics = train.compiled_step(model, train_cfg, mesh, rules)(state, batch)
    return state, float(metrics["loss"])


@pytest.fixture(scope="module")
def start_and_one_device():
    """A fresh train state (on the host) and one step of it on one device."""
    cfg = model_config((1, 1, 1))
    host = jax.device_get(train.init_state(cfg))
    state, loss = one_step(cfg, host, batch_of(cfg))
    return host, jax.device_get(state), loss


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOLERANCE, rtol=0)


@on_eight
@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_on_mesh_a_training_step_equals_one_device(start_and_one_device, mesh):
    host, want, want_loss = start_and_one_device
    cfg = model_config(mesh)
    state, loss = one_step(cfg, host, batch_of(cfg))
    assert abs(loss - want_loss) <= TOLERANCE
    assert_close(jax.device_get(state), want)
    # Parameters and both Adam moments where the rules put them.
    query = ("block_0", "attention", "query", "kernel")
    sizes = dict(zip(MESH, mesh, strict=True))
    want_spec = sharding.fit(P("fsdp", "tensor", None), (32, 4, 16), sizes)
    adam = state.opt_state[1][0]
    for tree in (state.params, adam.mu, adam.nu):
        leaf = tree
        for key in query:
            leaf = leaf[key]
        assert same_layout(leaf.sharding, want_spec, 3)
    assert state.step.sharding.is_fully_replicated


MESH = ("data", "fsdp", "tensor")


@on_eight
def test_on_mesh_a_checkpoint_from_one_mesh_resumes_on_another(tmp_path):
    """Saved by train() on (2, 4, 1), resumed on (1, 8, 1): the same run."""
    corpus = write_corpus(tmp_path / "corpus", files=4, words_per_file=300)

    def run_cfg(mesh):
        cfg = model_config(mesh, corpus=corpus)
        cfg.eval.update(batch_size=8, num_batches=1)
        return kvlab.validate_config(cfg)

    workdir = tmp_path / "run"
    whole, history = train.train(run_cfg((2, 4, 1)), workdir, progress=False)
    shutil.rmtree(workdir / "checkpoints" / "3")  # as if stopped after step 2
    resumed, again = train.train(run_cfg((1, 8, 1)), workdir, progress=False)
    losses = {line["step"]: line["train/loss"] for line in history if "train/loss" in line}
    assert again[0]["step"] == 3
    assert abs(again[0]["train/loss"] - losses[3]) <= TOLERANCE
    assert_close(jax.device_get(resumed), jax.device_get(whole))
    query = resumed.params["block_0"]["attention"]["query"]["kernel"]
    assert same_layout(query.sharding, P("fsdp"), 3)  # restored onto the new mesh
    _, params = train.load_params(workdir)  # and onto one device, for anything else
    assert all(len(leaf.devices()) == 1 for leaf in jax.tree.leaves(params))
    assert_close(params, jax.device_get(resumed.params))


# ---------------------------------------------------------------------------
# The Engine, the probe, the sweep and the scripts on a mesh


ENGINE_CACHE = dict(kind="paged", page_size=8, prefix_caching=True)


def engine_requests():
    """Ten prompts for 8 slots: slots are reused, and the last finds the first's
    prefix in the prefix cache."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 256, 9).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 11, 1, 7, 5, 13, 2, 9)]
    return [shared + [1], *prompts, shared + [2]]


def new_engine(cfg, params, mesh=None, rules=None):
    cache_cfg = ml_collections.ConfigDict(cfg.cache.to_dict())
    cache_cfg.update(ENGINE_CACHE)
    return kvlab.Engine(
        cfg.model,
        cache_cfg,
        params,
        max_slots=8,
        max_len=24,
        prefill_chunk=8,
        mesh=mesh,
        rules=rules,
    )


@pytest.fixture(scope="module")
def engine_on_one_device(gqa):
    cfg, *_, params, _ = gqa
    return new_engine(cfg, params).generate(engine_requests(), max_new_tokens=4)


@on_eight
@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 1, 2)])
def test_on_mesh_the_engine_equals_one_device(gqa, engine_on_one_device, mesh):
    """Slots split over data (x fsdp), heads over tensor: the same tokens, and the
    two warmed-up programs serve every step (the layout stays put)."""
    cfg, *_, params, _ = gqa
    cfg = model_config(mesh)
    on_mesh, rules = mesh_of(cfg)
    engine = new_engine(cfg, params, on_mesh, rules)
    engine.warm_up()
    with count_compiles() as compiles:
        got = engine.generate(engine_requests(), max_new_tokens=4)
    assert got == engine_on_one_device
    assert compiles[0] == 0
    assert engine.stats.prefill_tokens < engine.stats.prompt_tokens  # the prefix was reused
    assert_cache_layout(engine._cache)
    query = engine.params["block_0"]["attention"]["query"]["kernel"]
    assert same_layout(query.sharding, P(None, "tensor", None) if mesh[2] > 1 else P(), 3)


@on_eight
def test_on_mesh_the_probe_equals_one_device(gqa):
    """What kvlab.eval.probe.cache_error compares: logits and attention outputs through
    a quantized cache, fed in chunks."""
    cfg, mesh, rules, model, params, _ = gqa
    tokens = np.random.default_rng(6).integers(0, 256, (4, 16)).astype(np.int32)
    cache_cfg = ml_collections.ConfigDict(cfg.cache.to_dict())
    cache_cfg.update(k_bits=4, v_bits=4)
    run = lambda **on: kvlab.eval.probe.run_through_cache(  # noqa: E731
        model, params, tokens, cache_cfg, 8, **on
    )
    for got, want in zip(run(mesh=mesh, rules=rules), run(), strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


@on_eight
def test_on_mesh_a_sweep_evaluates_on_its_mesh(tmp_path, monkeypatch):
    """A checkpoint entry (nothing to train) evaluated on the config's mesh equals
    kvlab.eval.evaluate on one device."""
    llama = str(ROOT / "tests" / "fixtures" / "hf" / "llama")
    cfg = run_config(write_corpus(tmp_path / "corpus", files=4))
    cfg.eval.update(batch_size=4, num_batches=1, chunk=16, split="test")
    cfg.mesh.update(data=2, fsdp=2, tensor=2)
    cfg.sweep = {"name": "on_mesh"}
    grid = {"models": {"llama": {"hf": llama}}, "caches": {"16bit": {}, "K8": {"cache.k_bits": 8}}}
    meshes = []
    evaluate = kvlab.sweep.run.evaluate

    def recorded(function):
        def recording(*args, mesh=None, **kwargs):
            meshes.append(dict(mesh.shape))
            return function(*args, mesh=mesh, **kwargs)

        return recording

    monkeypatch.setattr(kvlab.sweep.run, "evaluate", recorded(evaluate))
    monkeypatch.setattr(
        kvlab.sweep.run, "evaluate_reference", recorded(kvlab.sweep.run.evaluate_reference)
    )
    # The first of two slices: the 16-bit unit alone (the reference, no merge).
    workdir = str(tmp_path / "sweep")
    (row,) = kvlab.sweep.run_sweep(cfg, grid, workdir, sweep_count=2, progress=False)
    assert meshes == [dict(data=2, fsdp=2, tensor=2)]

    unit = kvlab.sweep.expand(kvlab.sweep.split_sweep_config(cfg)[0], grid)[0]
    params = train.initial_params(unit.cfg)
    data = kvlab.data.make_dataset(unit.cfg.data, "test", unit.cfg.train.seq_len)
    want = evaluate(unit.cfg.model, unit.cfg.cache, params, data.eval_batches(4, 1), chunk=16)
    for key in ("ppl", "bits_per_byte", "cache_bytes_per_token"):
        assert abs(float(row[key]) - want[key]) <= TOLERANCE * max(1.0, want[key]), key


SCRIPTS = {  # each script's way to the mesh section, and a small run of it
    "generate.py": ["--config.mesh.data=2", "--config.mesh.tensor=4", "--max_new_tokens=2"],
    "quant_probe.py": ["--config.mesh.data=2", "--config.mesh.tensor=4", "--bits=4", "--seq_len=8"],
    "eval.py": ["--hf=tests/fixtures/hf/llama", "--mesh.data=2", "--mesh.tensor=4"],
}


def test_the_scripts_take_the_mesh_section():
    """On one device a mesh of 8 is refused naming the axes, before anything
    compiles: each script builds its mesh from the flags. On 8 forced devices
    generate.py runs there (one compiled loop of the tiny model)."""
    one = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    # Concurrently: the refusals are mostly interpreter start-up.
    runs = {name: script(name, args, one) for name, args in SCRIPTS.items()}
    rows = [f"--prompt={text}" for text in ("def ", "import ", "class ", "x = ")]
    mesh = ["--config.mesh.data=4", "--config.mesh.tensor=2", "--max_new_tokens=2"]
    on_eight = script("generate.py", mesh + rows, {**one, "XLA_FLAGS": CHILD_FLAGS})
    small = [
        "--cache=configs/gqa.py:tiny",
        "--cache.eval.num_batches=1",
        "--cache.train.seq_len=32",
    ]
    eval_on_eight = script("eval.py", SCRIPTS["eval.py"] + small, {**one, "XLA_FLAGS": CHILD_FLAGS})
    for name, run in runs.items():
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 2, (name, stderr[-3000:])
        assert "mesh.data=2 x mesh.fsdp=1 x mesh.tensor=4 make 8 devices but there are 1" in (
            stderr
        ), (name, stderr[-3000:])
    stdout, stderr = on_eight.communicate(timeout=300)
    assert on_eight.returncode == 0, stderr[-3000:]
    # 4 rows over data, 2 KV heads over tensor: an eighth of the tensors on each device.
    found = re.search(r"([\d,]+) bytes analytic, .* ([\d,]+) per device of the (mesh .*)", stdout)
    assert found, stdout
    whole, per_device = (int(found[i].replace(",", "")) for i in (1, 2))
    assert found[3] == "mesh data=4 x fsdp=1 x tensor=2 over 8 cpu devices"
    assert per_device < whole / 4
    # The evaluation says which mesh and devices it ran on.
    stdout, stderr = eval_on_eight.communicate(timeout=300)
    assert eval_on_eight.returncode == 0, stderr[-3000:]
    assert stdout.splitlines()[1] == "mesh data=2 x fsdp=1 x tensor=4 over 8 cpu devices", stdout


def script(name: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, f"scripts/{name}", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
