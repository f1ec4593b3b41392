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
    initialize_distributed(cfg.mesh)               # several hosts: first, before any device
    process_rows(batch_sharding(mesh, rules), B)   # the rows of a batch this host reads
    rows_array(local, rows, B, placed)             # the global batch from each host's rows
    put_global(params, shardings), fetch(array)    # host copies onto / back from every host

Defaults (docs/scale-out.md): weights' model-width side over `fsdp`;
heads, key/value heads, MLP width and vocabulary over `tensor`; batches over
`data` x `fsdp`, and so are cache rows; cached heads over `tensor`. A
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
import os
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kvlab.config import (
    MESH_AXES,
    base_config,
    check_mesh_shape,
    mesh_axes,
    validate_mesh_config,
)

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


def describe_mesh(mesh: Mesh) -> str:
    """The mesh and its devices in words: 'mesh data=2 x fsdp=2 x tensor=2 over 8 cpu
    devices' (and ', N hosts' past one)."""
    devices = list(mesh.devices.flat)
    kinds = sorted({d.platform for d in devices})
    hosts = len({d.process_index for d in devices})
    axes = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    where = f", {hosts} hosts" if hosts > 1 else ""
    return f"mesh {axes} over {mesh.size} {'/'.join(kinds)} device{'s' * (mesh.size != 1)}{where}"


def axis_rules(mesh_cfg: Mapping | None = None) -> tuple:
    """`mesh.rules` as flax's logical axis rules: ((logical, mesh axes | None), ...).

    Without a mesh section, the defaults (kvlab.config.LOGICAL_AXIS_RULES).
    Hashable, so a jitted function may take it as a static argument."""
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


# ---------------------------------------------------------------------------
# Several hosts

# The environment that names a multi-host run explicitly, the same on every host
# but the id: process 0's host:port, the number of processes, this one's index.
# jax reads the first itself; without them, with mesh.distributed=True, it
# detects the run from SLURM, Open MPI, a Cloud TPU pod or Kubernetes.
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed(
    mesh_cfg: Mapping | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Joins this process to a multi-host run (`jax.distributed.initialize`) when
    `mesh_cfg["distributed"]` is True or the environment (`environ`, default
    os.environ) sets one of DISTRIBUTED_ENV; returns whether it is in one.

    Call it before anything touches a device (jax refuses afterwards: a
    RuntimeError says so); once joined, later calls return True. Afterwards
    `jax.devices()` lists every host's devices, `make_mesh` spans them, and
    on CPU the hosts' collectives go through gloo (jax's default). Raises
    ValueError naming the variable when the environment is half set, or when
    mesh.distributed=True finds neither the variables nor a cluster jax detects.
    """
    if jax.distributed.is_initialized():
        return True
    environ = os.environ if environ is None else environ
    given = {name: environ[name] for name in DISTRIBUTED_ENV if environ.get(name)}
    asked = mesh_cfg is not None and mesh_cfg["distributed"] is True
    if not given and not asked:
        return False
    address, count, index = DISTRIBUTED_ENV
    if (count in given) != (index in given):
        have, lack = (count, index) if count in given else (index, count)
        raise ValueError(
            f"{have}={given[have]} is set but {lack} is not: set both on every host "
            f"({count} the number of processes, {index} this one's index from 0), "
            "or neither, for jax to detect them (SLURM, a TPU pod)"
        )
    num_processes = process_id = None
    if count in given:
        num_processes, process_id = _env_int(given, count, 1), _env_int(given, index, 0)
        if process_id >= num_processes:
            raise ValueError(
                f"{index}={process_id} is not below {count}={num_processes}: number the "
                f"processes 0..{num_processes - 1}"
            )
        if address not in given:
            raise ValueError(
                f"{count} and {index} are set but {address} is not: set it to process 0's "
                "host:port (a free port) on every host"
            )
    # What asked for several hosts, for the errors below.
    why = ", ".join([f"{name}={value}" for name, value in given.items()])
    why = why or "mesh.distributed=True"
    try:
        jax.distributed.initialize(
            coordinator_address=given.get(address),
            num_processes=num_processes,
            process_id=process_id,
        )
    except RuntimeError as error:  # a device was touched first
        raise RuntimeError(
            f"{why} asks for several hosts, but {error} Call "
            "kvlab.sharding.initialize_distributed first (scripts/train.py does)"
        ) from error
    except ValueError as error:  # nothing set and no cluster detected
        said = str(error).rstrip(".")
        raise ValueError(
            f"{why} asks for several hosts, but jax found none ({said}; it detects "
            f"SLURM, Open MPI, Cloud TPU pods and Kubernetes): set {address}=host:port, "
            f"{count} and {index} on every host, or mesh.distributed=False for one host"
        ) from error
    return True


def _env_int(given: Mapping[str, str], name: str, minimum: int) -> int:
    try:
        value = int(given[name])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={given[name]!r} is not an integer >= {minimum}: set one")
    return value


def is_primary() -> bool:
    """Whether this process writes a run's files (config, metrics, wandb, results):
    process 0 of a multi-host run, or the only process. Touches no device when
    there is one process."""
    return not jax.distributed.is_initialized() or jax.process_index() == 0


def process_rows(placed: NamedSharding, batch_size: int) -> np.ndarray:
    """The rows of a batch [batch_size, ...] laid out by `placed` that this
    process's devices hold, ascending: what this host reads (every row when
    there is one process)."""
    held = set()
    for index in placed.addressable_devices_indices_map((batch_size,)).values():
        held.update(range(batch_size)[index[0]])
    return np.array(sorted(held), dtype=np.int64)


def rows_array(local: np.ndarray, rows: np.ndarray, batch_size: int, placed: NamedSharding):
    """The global array [batch_size, ...] laid out by `placed` from `local`, this
    process's rows of it (`rows`, ascending, as `process_rows` gives them):
    each device gets its slice, read from the rows this host holds
    (jax.make_array_from_callback; no host reads another's rows)."""

    def piece(index):  # one device's part: slices of the global [B, ...]
        wanted = np.searchsorted(rows, np.arange(batch_size)[index[0]])
        return local[wanted][(slice(None), *index[1:])]

    return jax.make_array_from_callback((batch_size, *local.shape[1:]), placed, piece)


def put_global(tree, shardings_tree):
    """`jax.device_put(tree, shardings_tree)`, also onto a mesh that spans
    processes: there a leaf not yet laid out across them (a host's copy,
    numpy or one device's, the same on every host) is given to this host's
    devices piece by piece (jax.make_array_from_callback). With one process,
    exactly device_put."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings_tree)
    if isinstance(shardings_tree, jax.sharding.Sharding):  # one for every leaf
        shardings_tree = jax.tree.map(lambda _: shardings_tree, tree)

    def put(leaf, placed):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return jax.device_put(leaf, placed)  # already global: jax reshards
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # a key: its words
            words = put(jax.random.key_data(leaf), placed)
            return jax.random.wrap_key_data(words, impl=jax.random.key_impl(leaf))
        whole = np.asarray(leaf)
        return jax.make_array_from_callback(whole.shape, placed, lambda index: whole[index])

    return jax.tree.map(put, tree, shardings_tree)


def fetch(array) -> np.ndarray:
    """The whole of `array` on this host, whichever processes hold its parts
    (multihost_utils.process_allgather when some live elsewhere; every host
    gets the same values)."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
