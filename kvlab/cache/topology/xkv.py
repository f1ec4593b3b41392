"""A basis shared by a run of adjacent layers (xKV, arXiv:2503.18893): their keys and
values coded together.

    cfg.model.topology = "xkv:2"          # layers 0, 1 | 2, 3 | ... coded in pairs
    cfg.model.topology = "xkv:4,from=8"   # runs of four from layer 8
    cfg.cache.update(k_rank=64, v_rank=96, bases="runs/x/xkv.npz")
    cfg.model.topology = "xkv:2,fit=prompt"  # each row's bases from its prompt (no file)

xKV finds that the caches of adjacent layers share their dominant singular
vectors, so a run of G layers is coded in one low-rank subspace: per token and
KV head, the run's G keys side by side, [x_1 | ... | x_G] (G x W numbers), are
coded as their r coordinates in an orthonormal basis B [G W, r] (r =
cache.k_rank; values alike with cache.v_rank), and layer j reads its keys back
as c B_j^T, B_j its W rows of B. Keys are coded before RoPE (turned back from
their positions when written and turned again when read: a dense cache's
slots are positions), where a projection's keys lie in few directions. The
bases are fitted offline, the leading eigenvectors of the run's second moment
over calibration text (kvlab.eval.calibrate.bases), and read from cache.bases
([runs, K, G W, r] per tensor); or, with 'fit=prompt', as xKV fits them: per
row, from the tokens of its first step (its prompt prefilled whole; a chunked
prompt's first chunk), the leading right singular vectors of those tokens
(the same directions, from their SVD), computed in the program as the row starts
and kept with it in cache.dtype (`fitted`, counted in the bytes). At full rank
(r = G W) each layer reads back exactly what it wrote. Every layer keeps its
projections, as MiniCache's do; a step's own tokens are read uncoded, so a
prompt prefilled whole attends exactly. Layers outside whole runs keep their
own caches, as the cache section says. The codes are kept in cache.dtype, or
with cache.k_bits / v_bits below 16 quantized per token in groups of
cache.group_size coordinates in the tensor's format (xKV with quantized codes;
kvlab/cache/quant: int, fp8, nf), read back dequantized. The cache must be a
dense one of a grouped-query model without eviction, transforms or windows, and
quantized codes have no fields a run's coordinates do not have: levels fitted
per layer, calibrated scales, channel groups, outliers, sketches, first tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec
from jaxtyping import Array

from kvlab.cache.placement import Placement
from kvlab.cache.quant.storage import rope_numbers, storages, turn
from kvlab.cache.quant.tensor import empty_tensor
from kvlab.cache.topology import Topology, check_joint_cache, quantized_code_checks
from kvlab.config import dtype_of
from kvlab.files import read_arrays
from kvlab.registry import TOPOLOGIES


def parse(arg: str) -> tuple[int, int, bool]:
    """(run length G, first coded layer D, bases fitted per prompt) of an argument
    'G[,from=D][,fit=prompt]'."""
    fields = arg.split(",")
    share, first, per_prompt = int(fields[0]), 0, False
    for field in fields[1:]:
        name, _, value = field.partition("=")
        if name == "from":
            first = int(value)
        elif (name, value) == ("fit", "prompt"):
            per_prompt = True
        else:
            raise ValueError(name)
    return share, first, per_prompt


class SharedBasis(Topology):
    """Runs of G adjacent layers from layer D, coded in one basis per run and KV head."""

    name = "xkv"
    every_layer_produces = True
    codes_in_bases = True  # cache.<prefix>_rank and cache.bases are the runs'

    def check(self, arg: str, num_layers: int, field: str) -> None:
        usage = (
            f"set {field}='xkv:G[,from=D][,fit=prompt]' (G >= 2 adjacent layers a run, "
            "e.g. 'xkv:2')"
        )
        try:
            share, first, _ = parse(arg)
        except ValueError:
            spec = self.name + ":" + arg
            raise ValueError(f"{field}={spec!r} is not G[,from=D][,fit=prompt]: {usage}") from None
        if share < 2 or not 0 <= first <= num_layers - share:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r} codes no run of at least 2 of "
                f"model.num_layers={num_layers} layers (G={share}, from layer {first}): {usage}"
            )

    def layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        share, first, _ = parse(arg)
        runs = (num_layers - first) // share
        coded = first + runs * share  # layers from here on keep their own

        def owner(i: int) -> int:
            if i < first:
                return i
            return first + (i - first) // share if i < coded else first + runs + i - coded

        return tuple(owner(i) for i in range(num_layers))

    def joint_layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        share, first, _ = parse(arg)
        return tuple(range(first, first + (num_layers - first) // share))

    def check_cache(self, arg: str, model_cfg: Mapping, cache_cfg: Mapping) -> None:
        share, _, per_prompt = parse(arg)
        width = share * model_cfg["head_dim"]
        bases = cache_cfg["bases"]
        more = [
            ("cache.bases", bases, not bases and not per_prompt,
             "reads each run's bases from it", "the .npz of kvlab.eval.calibrate.save_bases"),
            ("cache.bases", bases, bases and per_prompt,
             "fits each row's bases from its prompt (fit=prompt) and reads no file", "''"),
        ] + [
            (f"cache.{p}_rank", cache_cfg[f"{p}_rank"], not 1 <= cache_cfg[f"{p}_rank"] <= width,
             f"codes a run's {share} x model.head_dim = {width} numbers in that many directions",
             f"1..{width}")
            for p in ("k", "v")
        ] + [
            check for p in ("k", "v") if cache_cfg[f"{p}_bits"] < 16
            for check in quantized_code_checks(
                cache_cfg, p, cache_cfg[f"{p}_rank"], f"cache.{p}_rank", "the run's basis",
                "before RoPE already",
            )
        ]  # fmt: skip
        check_joint_cache("xKV", model_cfg, cache_cfg, more)

    def build(self, arg, model_cfg, cache_cfg, batch: int, max_len: int, index: int = 0):
        share, first, per_prompt = parse(arg)
        runs = len(self.joint_layers(arg, model_cfg["num_layers"]))
        heads, width = model_cfg["num_kv_heads"], model_cfg["head_dim"]
        dtype = dtype_of(cache_cfg["dtype"])
        ranks = tuple(cache_cfg[f"{p}_rank"] for p in ("k", "v"))
        bases, fitted = (), None
        if per_prompt:  # a row's own, from its first step
            fitted = tuple(jnp.zeros((batch, heads, share * width, r), dtype) for r in ranks)
        else:
            bases = tuple(
                run_bases(cache_cfg, p, index - first, runs, heads, share * width)
                for p in ("k", "v")
            )
        codes = tuple(
            empty_tensor(spec, batch, heads, r, max_len, 0)
            for spec, r in zip(storages(model_cfg, cache_cfg), ranks, strict=True)
        )
        return SharedBasisLayer(
            codes=codes,
            bases=bases,
            rope=rope_numbers(model_cfg, width),
            share=share,
            fitted=fitted,
        )

    def layer_bytes(self, arg, model_cfg, cache_cfg, rows: int, max_len: int, split) -> int:
        share, _, per_prompt = parse(arg)
        heads = model_cfg["num_kv_heads"]
        heads //= split("cache_heads", heads)
        element = dtype_of(cache_cfg["dtype"]).itemsize
        basis = share * model_cfg["head_dim"] if per_prompt else 0  # a row's own bases
        per_row = 0
        for spec, p in zip(storages(model_cfg, cache_cfg), ("k", "v"), strict=True):
            rank = cache_cfg[f"{p}_rank"]
            per_row += spec.stored_bytes(max_len, rank) + basis * rank * element
        return rows * heads * per_row


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

    codes   (k, v) QuantizedTensor of S tokens of r numbers (no ring): in
            cache.dtype, or packed codes with their groups' scales
    bases   static: (k, v) [K][G W][r] (constants of the program); () with `fitted`
    rope    static: the keys' RoPE numbers (kvlab.cache.quant.storage.rope_numbers)
    share   static: G
    fitted  fit=prompt: (k, v) cache.dtype[B, K, G W, r], each row's bases from its
            first step; None for offline bases
    """

    codes: tuple
    bases: tuple = struct.field(pytree_node=False)
    rope: tuple = struct.field(pytree_node=False)
    share: int = struct.field(pytree_node=False)  # G, the layers of the run
    fitted: tuple | None = None

    joint = True  # read per member, written by the run's last layer

    @property
    def capacity(self) -> int:
        return self.codes[0].payload.shape[2]

    @property
    def width(self) -> int:
        """W: a member's channels (its share of a basis's rows)."""
        rows = self.fitted[0].shape[2] if self.fitted else len(self.bases[0][0])
        return rows // self.share

    def _bases(self) -> tuple:
        """Per tensor, the bases as float32 [B or 1, K, G W, r]."""
        if self.fitted is not None:
            return tuple(b.astype(jnp.float32) for b in self.fitted)
        return tuple(jnp.asarray(np.asarray(b, np.float32))[None] for b in self.bases)

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((c.payload.shape[1], self.width) for c in self.codes)

    def read(self, fresh: tuple, placement: Placement, member: int):
        """Layer `member`'s blocks: every stored token read back through its rows of
        the bases (keys turned by RoPE at their slots), then the step's own."""
        dtype = dtype_of(self.codes[0].spec.dtype)
        batch, capacity, width = self.codes[0].payload.shape[0], self.capacity, self.width
        positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
        read = []
        for i, (codes, basis) in enumerate(zip(self.codes, self._bases(), strict=True)):
            rows = basis[:, :, member * width : (member + 1) * width]  # [B or 1, K, W, r]
            x = jnp.einsum("BKSr,BKwr->BKSw", codes.dequantize(), rows)
            read.append((turn(x, self.rope, positions) if i == 0 else x).astype(dtype))
        written = jnp.arange(capacity) < placement.lengths[:, None]
        fresh = tuple(x.astype(dtype) for x in fresh)
        return [(tuple(read), written[:, None, :]), (fresh, placement.fresh_mask)], fresh

    def observe(self, placement: Placement) -> None:
        return None

    def write(self, pendings: tuple, placement: Placement) -> SharedBasisLayer:
        """Every member's tokens of the step (keys turned back from their positions),
        side by side, coded in the bases and written to their slots; with
        fit=prompt, a row's first step fits its bases from them first."""
        codes, fitted = [], []
        for i, (stored, basis) in enumerate(zip(self.codes, self._bases(), strict=True)):
            members = [p[i].astype(jnp.float32) for p in pendings]  # each [B, K, T, W]
            if i == 0:
                members = [turn(x, self.rope, placement.positions, back=True) for x in members]
            side = jnp.concatenate(members, axis=-1)  # [B, K, T, G W]
            if self.fitted is not None:
                basis = _fit(side, placement, basis).astype(dtype_of(stored.spec.dtype))
                fitted.append(basis)
                basis = basis.astype(jnp.float32)  # coded in the bases as kept
            coded = jnp.einsum("BKTw,BKwr->BKTr", side, basis)
            codes.append(stored.put(coded, placement.slots))
        return self.replace(codes=tuple(codes), fitted=tuple(fitted) if fitted else None)

    def alike(self) -> SharedBasisLayer:
        """The layer without its bases, which differ from run to run (the model's check
        of a cache compares the rest)."""
        return self.replace(bases=())

    def axes(self) -> SharedBasisLayer:
        """The logical axes of its arrays (kvlab.cache.factory.cache_axes)."""
        rows = PartitionSpec("cache_batch", "cache_heads", None, None)
        fitted = None if self.fitted is None else (rows, rows)
        codes = tuple(jax.tree.map(lambda _: rows, c) for c in self.codes)
        return self.replace(codes=codes, fitted=fitted)


def _fit(side: Array, placement: Placement, kept: Array) -> Array:
    """float32[B, K, G W, r]: each row's bases, `kept` [B, K, G W, r] except in the
    rows whose first step this is: the r leading right singular vectors of the
    step's real tokens `side` [B, K, T, G W] (an SVD of the tokens, not an
    eigendecomposition of their second moment, which squares its condition), in
    order, each column's largest entry positive."""
    rank = kept.shape[-1]
    real = jnp.arange(side.shape[2])[None, :] < placement.num_tokens[:, None]  # [B, T]
    x = jnp.where(real[:, None, :, None], side, 0.0)
    if x.shape[2] < rank:  # at least r singular vectors (those of zeros: any)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, rank - x.shape[2]), (0, 0)))
    basis = jnp.linalg.svd(x, full_matrices=False)[2][..., :rank, :].swapaxes(-1, -2)
    largest = jnp.take_along_axis(basis, jnp.abs(basis).argmax(-2, keepdims=True), axis=-2)
    basis = basis * jnp.where(largest < 0, -1.0, 1.0)
    starting = (placement.lengths == 0) & (placement.num_tokens > 0)
    return jnp.where(starting[:, None, None, None], basis, kept)
