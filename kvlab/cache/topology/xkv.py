"""A basis shared by a run of adjacent layers (xKV, arXiv:2503.18893): their keys and
values coded together.

    cfg.model.topology = "xkv:2"          # layers 0, 1 | 2, 3 | ... coded in pairs
    cfg.model.topology = "xkv:4,from=8"   # runs of four from layer 8
    cfg.cache.update(k_rank=64, v_rank=96, bases="runs/x/xkv.npz")

xKV finds that the caches of adjacent layers share their dominant singular
vectors, so a run of G layers is coded in one low-rank subspace: per token and
KV head, the run's G keys side by side, [x_1 | ... | x_G] (G x W numbers), are
coded as their r coordinates in an orthonormal basis B [G W, r] (r =
cache.k_rank; values alike with cache.v_rank), and layer j reads its keys back
as c B_j^T, B_j its W rows of B. Keys are coded before RoPE (turned back from
their positions when written and turned again when read: a dense cache's
slots are positions), where a projection's keys lie in few directions. The
bases are fitted offline, the leading eigenvectors of the run's second moment
over calibration text (kvlab.eval.calibrate.bases: xKV computes its SVD per
prompt; a fixed basis keeps the program static), and read from cache.bases
([runs, K, G W, r] per tensor). At full rank (r = G W) each layer reads back
exactly what it wrote. Every layer keeps its projections, as MiniCache's do;
a step's own tokens are read uncoded, so a prompt prefilled whole attends
exactly. Layers outside whole runs keep their own caches, as the cache section
says. The codes are 16-bit (cache.dtype): the cache must be a dense 16-bit one
of a grouped-query model without eviction, transforms or windows.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from kvlab.cache.placement import Placement, write_tokens
from kvlab.cache.quant.storage import rope_numbers, turn
from kvlab.cache.topology import Topology, check_joint_cache
from kvlab.config import dtype_of
from kvlab.files import read_arrays
from kvlab.registry import TOPOLOGIES


def parse(arg: str) -> tuple[int, int]:
    """(run length G, first coded layer D) of an argument 'G[,from=D]'."""
    fields = arg.split(",")
    share, first = int(fields[0]), 0
    for field in fields[1:]:
        name, _, value = field.partition("=")
        if name != "from":
            raise ValueError(name)
        first = int(value)
    return share, first


class SharedBasis(Topology):
    """Runs of G adjacent layers from layer D, coded in one basis per run and KV head."""

    name = "xkv"
    every_layer_produces = True
    codes_in_bases = True  # cache.<prefix>_rank and cache.bases are the runs'

    def check(self, arg: str, num_layers: int, field: str) -> None:
        usage = f"set {field}='xkv:G[,from=D]' (G >= 2 adjacent layers a run, e.g. 'xkv:2')"
        try:
            share, first = parse(arg)
        except ValueError:
            spec = self.name + ":" + arg
            raise ValueError(f"{field}={spec!r} is not G[,from=D]: {usage}") from None
        if share < 2 or not 0 <= first <= num_layers - share:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r} codes no run of at least 2 of "
                f"model.num_layers={num_layers} layers (G={share}, from layer {first}): {usage}"
            )

    def layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        share, first = parse(arg)
        runs = (num_layers - first) // share
        coded = first + runs * share  # layers from here on keep their own

        def owner(i: int) -> int:
            if i < first:
                return i
            return first + (i - first) // share if i < coded else first + runs + i - coded

        return tuple(owner(i) for i in range(num_layers))

    def joint_layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        share, first = parse(arg)
        return tuple(range(first, first + (num_layers - first) // share))

    def check_cache(self, arg: str, model_cfg: Mapping, cache_cfg: Mapping) -> None:
        share, _ = parse(arg)
        width = share * model_cfg["head_dim"]
        more = [
            ("cache.bases", cache_cfg["bases"], not cache_cfg["bases"],
             "reads each run's bases from it", "the .npz of kvlab.eval.calibrate.save_bases"),
        ] + [
            (f"cache.{p}_rank", cache_cfg[f"{p}_rank"], not 1 <= cache_cfg[f"{p}_rank"] <= width,
             f"codes a run's {share} x model.head_dim = {width} numbers in that many directions",
             f"1..{width}")
            for p in ("k", "v")
        ]  # fmt: skip
        check_joint_cache("xKV", model_cfg, cache_cfg, more)

    def build(self, arg, model_cfg, cache_cfg, batch: int, max_len: int, index: int = 0):
        share, first = parse(arg)
        runs = len(self.joint_layers(arg, model_cfg["num_layers"]))
        heads, width = model_cfg["num_kv_heads"], model_cfg["head_dim"]
        bases = tuple(
            run_bases(cache_cfg, p, index - first, runs, heads, share * width) for p in ("k", "v")
        )
        dtype = dtype_of(cache_cfg["dtype"])
        return SharedBasisLayer(
            codes=tuple(jnp.zeros((batch, heads, max_len, len(b[0][0])), dtype) for b in bases),
            bases=bases,
            rope=rope_numbers(model_cfg, width),
            share=share,
        )

    def layer_bytes(self, arg, model_cfg, cache_cfg, rows: int, max_len: int, split) -> int:
        heads = model_cfg["num_kv_heads"]
        heads //= split("cache_heads", heads)
        element = dtype_of(cache_cfg["dtype"]).itemsize
        ranks = cache_cfg["k_rank"] + cache_cfg["v_rank"]
        return rows * heads * max_len * ranks * element


TOPOLOGIES.register(SharedBasis())


def run_bases(cache_cfg: Mapping, prefix: str, run: int, runs: int, heads: int, width: int):
    """Run `run`'s bases [K][G W][rank] of tensor `prefix` from cache.bases ([runs, K,
    G W, rank], orthonormal columns); ValueError naming the field where it cannot."""
    path, rank = cache_cfg["bases"], cache_cfg[f"{prefix}_rank"]
    arrays = read_arrays(path)
    fix = "fit them with kvlab.eval.calibrate.bases for this model and topology"
    if isinstance(arrays, str) or prefix not in arrays:
        why = arrays if isinstance(arrays, str) else f"it holds {sorted(arrays)}"
        raise ValueError(f"cache.bases={path!r} gives no bases for {prefix!r} ({why}): {fix}")
    basis = arrays[prefix]
    shape = (runs, heads, width, rank)
    if basis.shape != shape or not np.isfinite(basis).all():
        raise ValueError(
            f"cache.bases={path!r}: {prefix!r} is {basis.shape}, not finite {list(shape)} "
            f"[runs, heads, the run's channels, cache.{prefix}_rank]: {fix}"
        )
    gram = np.einsum("nkwr,nkws->nkrs", basis.astype(np.float64), basis)
    if np.abs(gram - np.eye(rank)).max() > 1e-3:
        raise ValueError(f"cache.bases={path!r}: {prefix!r}'s columns are not orthonormal: {fix}")
    return tuple(tuple(tuple(float(x) for x in row) for row in head) for head in basis[run])


@struct.dataclass
class SharedBasisLayer:
    """A run's keys and values as their coordinates in its bases (module docstring).

    codes  (k, v) cache.dtype[B, K, S, r]
    bases  static: (k, v) [K][G W][r] (constants of the program)
    rope   static: the keys' RoPE numbers (kvlab.cache.quant.storage.rope_numbers)
    share  static: G
    """

    codes: tuple
    bases: tuple = struct.field(pytree_node=False)
    rope: tuple = struct.field(pytree_node=False)
    share: int = struct.field(pytree_node=False)  # G, the layers of the run

    joint = True  # read per member, written by the run's last layer

    @property
    def capacity(self) -> int:
        return self.codes[0].shape[2]

    @property
    def width(self) -> int:
        """W: a member's channels (its share of a basis's rows)."""
        return len(self.bases[0][0]) // self.share

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((c.shape[1], self.width) for c in self.codes)

    def read(self, fresh: tuple, placement: Placement, member: int):
        """Layer `member`'s blocks: every stored token read back through its rows of
        the bases (keys turned by RoPE at their slots), then the step's own."""
        dtype = self.codes[0].dtype
        batch, capacity, width = self.codes[0].shape[0], self.capacity, self.width
        positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
        read = []
        for i, (codes, basis) in enumerate(zip(self.codes, self.bases, strict=True)):
            mine = np.asarray(basis, np.float32)[:, member * width : (member + 1) * width]
            rows = jnp.asarray(mine)  # [K, W, r]
            x = jnp.einsum("BKSr,Kwr->BKSw", codes.astype(jnp.float32), rows)
            read.append((turn(x, self.rope, positions) if i == 0 else x).astype(dtype))
        written = jnp.arange(capacity) < placement.lengths[:, None]
        fresh = tuple(x.astype(dtype) for x in fresh)
        return [(tuple(read), written[:, None, :]), (fresh, placement.fresh_mask)], fresh

    def observe(self, placement: Placement) -> None:
        return None

    def write(self, pendings: tuple, placement: Placement) -> SharedBasisLayer:
        """Every member's tokens of the step (keys turned back from their positions),
        side by side, coded in the bases and written to their slots."""
        codes = []
        for i, (stored, basis) in enumerate(zip(self.codes, self.bases, strict=True)):
            members = [p[i].astype(jnp.float32) for p in pendings]  # each [B, K, T, W]
            if i == 0:
                members = [turn(x, self.rope, placement.positions, back=True) for x in members]
            side = jnp.concatenate(members, axis=-1)  # [B, K, T, G W]
            coded = jnp.einsum("BKTw,Kwr->BKTr", side, jnp.asarray(np.asarray(basis, np.float32)))
            codes.append(write_tokens(stored, coded.astype(stored.dtype), placement.slots, axis=2))
        return self.replace(codes=tuple(codes))

    def alike(self) -> SharedBasisLayer:
        """The layer without its bases, which differ from run to run (the model's check
        of a cache compares the rest)."""
        return self.replace(bases=())

    def axes(self) -> SharedBasisLayer:
        """The logical axes of its arrays (kvlab.cache.factory.cache_axes)."""
        rows = PartitionSpec("cache_batch", "cache_heads", None, None)
        return self.replace(codes=(rows, rows))
