"""Scale-out: the device mesh, logical axis rules and the shardings they give.

MaxText's scheme (flax logical partitioning, GSPMD): every parameter dimension
has a logical name (embed, heads, kv_heads, head_dim, mlp, vocab, latent,
experts, norm), batches have `batch`, caches `cache_batch`, `cache_heads`,
`cache_pages`; the config's `mesh.rules` (flax's `nn.logical_axis_rules`
format once read by `axis_rules`) map each name to mesh axes; jit and XLA
place the arrays and insert the communication. kvlab writes no collective.

    mesh = make_mesh(cfg)                          # Mesh (data, fsdp, tensor), sizes from cfg.mesh
    rules = axis_rules(cfg.mesh)                   # ((logical, mesh axes), ...), hashable
    specs = kvlab.model.param_axes(cfg.model)      # PartitionSpec(logical names) per parameter
    params = jax.device_put(params, shardings(specs, params, mesh, rules))
    kvlab.init_cache(..., mesh=mesh, rules=rules)  # the cache laid out (kvlab/cache/factory.py)
    batch_sharding(mesh, rules)                    # rows over data x fsdp

Defaults (docs/design.md, "Scale-out"): weights' model-width side over `fsdp`;
heads, key/value heads, MLP width and vocabulary over `tensor`; batches over
`data` x `fsdp`; cache rows over `data`, cached heads over `tensor`. A
dimension whose size the mesh axes of its rule do not divide keeps the longest
leading run of those axes that does (`fit`): the key projection of MQA's one
head, the one cached head of MQA and MLA, a batch of 2 rows on data x fsdp =
2 x 4 are replicated where they cannot be split. The query heads,
feed-forward widths and training batch must divide
(kvlab.config.check_mesh_shape names the axis before anything compiles).

Parameters get their names from `kvlab.layers.logical` (flax's
`nn.with_logical_partitioning`), read by `kvlab.model.param_axes`; a
parameter created without names would be replicated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kvlab.config import MESH_AXES, check_mesh_shape, mesh_axes, validate_mesh_config

# ---------------------------------------------------------------------------
# The mesh


def mesh_shape(mesh_cfg: Mapping, num_devices: int) -> dict[str, int]:
    """The sizes of `mesh_cfg` (the config's mesh section) on `num_devices`
    devices, -1 resolved; ValueError naming the axes when they do not multiply
    to the device count."""
    given = {axis: mesh_cfg[axis] for axis in MESH_AXES}
    rest = [axis for axis, size in given.items() if size == -1]
    fixed = math.prod(size for size in given.values() if size != -1)
    shown = " x ".join(f"mesh.{axis}={size}" for axis, size in given.items())
    if rest:
        if num_devices % fixed:
            raise ValueError(
                f"mesh.{rest[0]}=-1 takes the devices the other axes leave, but {shown} "
                f"fix {fixed} devices, which do not divide the {num_devices} devices there "
                f"are: give mesh sizes whose product divides {num_devices}"
            )
        given[rest[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"{shown} make {fixed} devices but there are {num_devices}: give sizes whose "
            f"product is {num_devices} (set one of them to -1 to take the rest; "
            "mesh.data=-1 is the default)"
        )
    return given


def make_mesh(cfg: Mapping, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh of `cfg.mesh` over `devices` (default: all).

    Checks the whole config against the resolved sizes first
    (kvlab.config.check_mesh_shape: query heads, feed-forward widths and the
    training batch must divide), so a bad mesh fails before anything compiles.
    """
    validate_mesh_config(cfg)
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg["mesh"], len(devices))
    check_mesh_shape(cfg, shape)
    sizes = tuple(shape[axis] for axis in MESH_AXES)
    return jax.make_mesh(
        sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def axis_rules(mesh_cfg: Mapping | None = None) -> tuple:
    """`mesh.rules` as flax's logical axis rules: ((logical, mesh axes | None), ...).

    Without a mesh section, the defaults (kvlab.config.LOGICAL_AXIS_RULES).
    Hashable, so a jitted function may take it as a static argument."""
    from kvlab.config import base_config

    rules = (mesh_cfg or base_config().mesh)["rules"]
    pairs = []
    for name in sorted(rules):
        axes = mesh_axes(rules, name)
        pairs.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(pairs)


def fit(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh | Mapping[str, int]) -> PartitionSpec:
    """`spec` (mesh axes per dimension) with each dimension keeping the longest
    leading run of its mesh axes whose product divides its size (jit needs even
    splits): a dimension no axis divides is replicated. `mesh` may be a Mesh or
    its axis sizes."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    fitted = []
    for size, entry in zip(shape, entries, strict=True):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        while names and size % math.prod(sizes[name] for name in names):
            names = names[:-1]
        fitted.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*fitted)


def pieces(logical: str, size: int, mesh: Mesh | Mapping[str, int], rules: tuple) -> int:
    """Into how many parts `rules` split a dimension of `size` named `logical`
    on `mesh` (a Mesh or its axis sizes), after `fit`."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    (entry,) = fit(nn.logical_to_mesh_axes((logical,), rules), (size,), sizes)
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(sizes[name] for name in names)


def named_sharding(
    logical: PartitionSpec, shape: Sequence[int], mesh: Mesh, rules: tuple
) -> NamedSharding:
    """The sharding of an array of `shape` whose dimensions have the `logical` names."""
    spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    return NamedSharding(mesh, fit(spec, shape, mesh))


def shardings(logical_tree, abstract_tree, mesh: Mesh, rules: tuple):
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) from the tree of
    their logical PartitionSpecs."""
    return jax.tree.map(
        lambda logical, leaf: named_sharding(logical, leaf.shape, mesh, rules),
        logical_tree,
        abstract_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: tuple, batch_size: int | None = None) -> NamedSharding:
    """Batches [B, ...] split by rows (logical axis `batch`: data x fsdp). With
    `batch_size`, fitted to it; without, the rule as it is (the caller checked
    that it divides, as validation does for train.batch_size)."""
    spec = nn.logical_to_mesh_axes(("batch",), rules)
    if batch_size is not None:
        spec = fit(spec, (batch_size,), mesh)
    return NamedSharding(mesh, spec)
