"""MiniCache (Liu et al., arXiv:2405.14366): adjacent deep layers' caches merged.

    cfg.model.topology = "minicache:15"              # layers 15, 16 | 17, 18 | ... merged
    cfg.model.topology = "minicache:15,t=0.6,keep=0.05"

From layer D (the argument; half the depth when omitted) on, each pair of
adjacent layers keeps one cache layer. Both layers compute their own keys and
values as the model always did (no parameter changes: a trained model
merges as it is); per token and KV head the pair's two keys x0, x1 are stored
as one direction e = SLERP(x0 / |x0|, x1 / |x1|; t) and the two magnitudes
|x0|, |x1|, and a layer reads its keys back as e |x_j| (values alike): W + 2
numbers per token and head where the pair held 2 W. t weighs the deeper layer
(0: the first layer's direction, exact for it; MiniCache's 0.6 by default).

Tokens whose directions disagree do not merge well: per row, the ceil(keep x
max_len) tokens of largest angular distance so far (the mean over KV heads,
keys and values, of the angle between the two layers' vectors) are also kept
unmerged for both layers, and each layer reads those instead of their merged
form (MiniCache retains the tokens past a distance threshold; a count keeps
the arrays' shapes static: a token enters when it is farther than the
nearest kept one, and the one it displaces is read merged from then on).

A step's own tokens are read unmerged by both layers; they merge when written,
so a prompt prefilled whole attends exactly and is merged after, as MiniCache
compresses a prefilled cache (the logits of a sequence depend on how it is
chunked, as they do under `cache.evict.when='after_prefill'`). The directions
are kept in cache.dtype, or with cache.k_bits / v_bits below 16 quantized per
token in groups of cache.group_size numbers in the tensor's format (MiniCache
beside KIVI-style quantization: int, nf, fp8 per token; the magnitudes and the
tokens kept unmerged stay in cache.dtype). The cache must be a dense one of a
grouped-query model without eviction, transforms, windows or bases, and
quantized directions refuse what a per-token code has not (by field:
kvlab.cache.topology.quantized_code_checks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec
from jaxtyping import Array

from kvlab.cache.placement import Placement, write_tokens
from kvlab.cache.quant.storage import storages
from kvlab.cache.quant.tensor import empty_tensor
from kvlab.cache.topology import Topology, check_joint_cache, quantized_code_checks
from kvlab.config import dtype_of
from kvlab.registry import TOPOLOGIES

DEFAULTS = {"t": 0.6, "keep": 0.05}
INDEX_BYTES = 4  # a kept token's position (int32) and its distance (float32), each


def parse(arg: str, num_layers: int) -> tuple[int, float, float]:
    """(first merged layer D, t, keep) of an argument 'D[,t=T][,keep=K]' ('' or
    no D: half the depth)."""
    fields = [f for f in arg.split(",") if f] if arg else []
    first = num_layers // 2
    if fields and "=" not in fields[0]:
        first = int(fields.pop(0))
    options = dict(DEFAULTS)
    for field in fields:
        name, _, value = field.partition("=")
        options[name] = float(value)
    return first, options["t"], options["keep"]


def kept_tokens(keep: float, max_len: int) -> int:
    """R: the tokens a row keeps unmerged."""
    return math.ceil(keep * max_len)


class MiniCache(Topology):
    """Layers D, D+1 | D+2, D+3 | ... merged in pairs (a last odd layer alone)."""

    name = "minicache"
    every_layer_produces = True

    def check(self, arg: str, num_layers: int, field: str) -> None:
        usage = f"set {field}='minicache[:D][,t=T][,keep=K]' (e.g. 'minicache:{num_layers // 2}')"
        try:
            first, t, keep = parse(arg, num_layers)
        except ValueError:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r} is not D[,t=T][,keep=K] (numbers): {usage}"
            ) from None
        fields = [f.partition("=")[0] for f in arg.split(",") if "=" in f]
        unknown = set(fields) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"{field}: {sorted(unknown)} are not options of minicache: {usage}")
        if not 1 <= first <= num_layers - 2:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r} merges from layer {first}, but a pair "
                f"needs 1 <= D <= {num_layers - 2} of model.num_layers={num_layers} (layer 0 "
                f"is never merged): {usage}"
            )
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"{field}: t={t} is not in [0, 1] (the second layer's share): {usage}")
        if not 0.0 <= keep < 1.0:
            raise ValueError(
                f"{field}: keep={keep} is not in [0, 1) (the share of tokens kept whole): {usage}"
            )

    def layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        first, _, _ = parse(arg, num_layers)
        return tuple(i if i < first else first + (i - first) // 2 for i in range(num_layers))

    def joint_layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        owner = self.layers(arg, num_layers)
        return tuple(c for c in sorted(set(owner)) if owner.count(c) == 2)

    def check_cache(self, arg: str, model_cfg: Mapping, cache_cfg: Mapping) -> None:
        width = model_cfg["head_dim"]
        more = [
            check for p in ("k", "v") if cache_cfg[f"{p}_bits"] < 16
            for check in [
                (f"cache.{p}_rank", cache_cfg[f"{p}_rank"], bool(cache_cfg[f"{p}_rank"]),
                 "codes directions in their channels, not in a basis", "0"),
                *quantized_code_checks(cache_cfg, p, width, "model.head_dim", "a direction",
                                       "after RoPE, as its layers read them"),
            ]
        ]  # fmt: skip
        check_joint_cache("MiniCache", model_cfg, cache_cfg, more)

    def build(self, arg, model_cfg, cache_cfg, batch: int, max_len: int, index=0) -> MergedLayer:
        _, t, keep = parse(arg, model_cfg["num_layers"])
        heads, width = model_cfg["num_kv_heads"], model_cfg["head_dim"]
        dtype = dtype_of(cache_cfg["dtype"])
        kept = kept_tokens(keep, max_len)
        specs = storages(model_cfg, cache_cfg)
        return MergedLayer(
            directions=tuple(empty_tensor(s, batch, heads, width, max_len, 0) for s in specs),
            norms=tuple(jnp.zeros((batch, heads, max_len, 2), dtype) for _ in "kv"),
            kept=tuple(jnp.zeros((batch, heads, 2, kept, width), dtype) for _ in "kv"),
            kept_positions=jnp.full((batch, kept), -1, jnp.int32),
            kept_distance=jnp.zeros((batch, kept), jnp.float32),
            t=t,
        )

    def layer_bytes(self, arg, model_cfg, cache_cfg, rows: int, max_len: int, split) -> int:
        _, _, keep = parse(arg, model_cfg["num_layers"])
        heads = model_cfg["num_kv_heads"]
        heads //= split("cache_heads", heads)
        element = dtype_of(cache_cfg["dtype"]).itemsize
        width, kept = model_cfg["head_dim"], kept_tokens(keep, max_len)
        directions = sum(s.stored_bytes(max_len, width) for s in storages(model_cfg, cache_cfg))
        others = 2 * (max_len * 2 + 2 * kept * width) * element  # magnitudes, kept tokens
        return rows * (heads * (directions + others) + kept * 2 * INDEX_BYTES)


TOPOLOGIES.register(MiniCache())


def slerp(x0: Array, x1: Array, t: float) -> tuple[Array, Array, Array]:
    """(the direction SLERP(x0 / |x0|, x1 / |x1|; t), float32[..., W]; the magnitudes
    [..., 2]; the angle between them [...]) of vectors x0, x1 [..., W]."""
    x0, x1 = x0.astype(jnp.float32), x1.astype(jnp.float32)
    n0 = jnp.linalg.norm(x0, axis=-1, keepdims=True)
    n1 = jnp.linalg.norm(x1, axis=-1, keepdims=True)
    tiny = jnp.finfo(jnp.float32).tiny
    u0, u1 = x0 / jnp.maximum(n0, tiny), x1 / jnp.maximum(n1, tiny)
    angle = jnp.arccos(jnp.clip(jnp.sum(u0 * u1, -1, keepdims=True), -1.0, 1.0))
    sine = jnp.sin(angle)
    near = sine < 1e-6  # (anti)parallel: linear weights, which SLERP tends to
    w0 = jnp.where(near, 1 - t, jnp.sin((1 - t) * angle) / jnp.where(near, 1.0, sine))
    w1 = jnp.where(near, t, jnp.sin(t * angle) / jnp.where(near, 1.0, sine))
    return w0 * u0 + w1 * u1, jnp.concatenate([n0, n1], -1), angle[..., 0]


@struct.dataclass
class MergedLayer:
    """Two adjacent layers' keys and values merged (module docstring).

    directions  (k, v) QuantizedTensor of S tokens of W numbers (no ring), each
                token's merged direction: in cache.dtype, or packed codes and scales
    norms       (k, v) cache.dtype[B, K, S, 2]   each layer's magnitude of it
    kept        (k, v) cache.dtype[B, K, 2, R, W]  the R tokens kept unmerged, per layer
    kept_positions  int32[B, R]   their positions (-1: none yet)
    kept_distance   float32[B, R] their angular distance (mean angle / pi)
    t           static: the deeper layer's SLERP weight
    """

    directions: tuple
    norms: tuple
    kept: tuple
    kept_positions: Array
    kept_distance: Array
    t: float = struct.field(pytree_node=False)

    joint = True  # read per member, written by the run's last layer

    @property
    def capacity(self) -> int:
        return self.directions[0].payload.shape[2]

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((d.payload.shape[1], d.width) for d in self.directions)

    def read(self, fresh: tuple, placement: Placement, member: int):
        """Layer `member` (0, 1)'s blocks: its merged tokens (those kept unmerged
        masked out), its kept tokens, and the step's own, as given."""
        dtype = self.norms[0].dtype
        fresh = tuple(x.astype(dtype) for x in fresh)
        batch, capacity = self.kept_positions.shape[0], self.capacity
        written = jnp.arange(capacity) < placement.lengths[:, None]  # [B, S]
        # [B, S]: the kept tokens' slots (a scatter of R, not a comparison of S x R)
        at = jnp.where(self.kept_positions < 0, capacity, self.kept_positions)
        rows = jnp.arange(batch)[:, None]
        kept_slot = jnp.zeros((batch, capacity), bool).at[rows, at].set(True, mode="drop")
        pairs = zip(self.directions, self.norms, strict=True)
        merged = tuple(
            (d.dequantize() * n[..., member : member + 1]).astype(dtype) for d, n in pairs
        )
        blocks = [(merged, (written & ~kept_slot)[:, None, :])]
        if self.kept_positions.shape[1]:
            kept = tuple(x[:, :, member] for x in self.kept)
            blocks.append((kept, (self.kept_positions >= 0)[:, None, :]))
        return [*blocks, (fresh, placement.fresh_mask)], fresh

    def observe(self, placement: Placement) -> None:
        return None

    def write(self, pendings: tuple, placement: Placement) -> MergedLayer:
        """Both layers' tokens of the step (`pendings`: each layer's (k, v) [B, K, T, W])
        merged into their slots, and the R least mergeable tokens so far kept."""
        (k0, v0), (k1, v1) = pendings
        directions, norms, angles = [], [], []
        for i, (x0, x1) in enumerate(((k0, k1), (v0, v1))):
            direction, magnitude, angle = slerp(x0, x1, self.t)
            slots = placement.slots
            directions.append(self.directions[i].put(direction, slots))
            norms.append(
                write_tokens(self.norms[i], magnitude.astype(self.norms[i].dtype), slots, 2)
            )
            angles.append(angle)  # [B, K, T]
        layer = self.replace(directions=tuple(directions), norms=tuple(norms))
        if not self.kept_positions.shape[1]:
            return layer
        distance = jnp.mean(jnp.stack(angles), axis=(0, 2)) / jnp.pi  # [B, T]
        return layer._keep(distance, placement, ((k0, k1), (v0, v1)))

    def _keep(self, distance: Array, placement: Placement, pairs: tuple) -> MergedLayer:
        """The R tokens of largest distance among those kept and the step's stored ones."""
        stored = placement.slots < self.capacity  # [B, T]: real tokens that fit
        empty = self.kept_positions < 0
        candidates = jnp.concatenate(
            [jnp.where(empty, -jnp.inf, self.kept_distance), jnp.where(stored, distance, -jnp.inf)],
            axis=1,
        )  # [B, R + T]; ties keep the earlier (kept first)
        positions = jnp.concatenate([self.kept_positions, placement.positions], axis=1)
        best, order = jax.lax.top_k(candidates, self.kept_positions.shape[1])  # [B, R]
        chosen = jnp.where(best > -jnp.inf, jnp.take_along_axis(positions, order, 1), -1)
        kept = []
        for held, (x0, x1) in zip(self.kept, pairs, strict=True):
            new = jnp.stack([x0, x1], axis=2).astype(held.dtype)  # [B, K, 2, T, W]
            pool = jnp.concatenate([held, new], axis=3)  # [B, K, 2, R + T, W]
            kept.append(jnp.take_along_axis(pool, order[:, None, None, :, None], axis=3))
        return self.replace(
            kept=tuple(kept),
            kept_positions=chosen,
            kept_distance=jnp.where(best > -jnp.inf, best, 0.0),
        )

    def axes(self) -> MergedLayer:
        """The logical axes of its arrays (kvlab.cache.factory.cache_axes)."""
        rows = PartitionSpec("cache_batch", "cache_heads", None, None)
        pairs = PartitionSpec("cache_batch", "cache_heads", None, None, None)
        return self.replace(
            directions=tuple(jax.tree.map(lambda _: rows, d) for d in self.directions),
            norms=(rows, rows),
            kept=(pairs, pairs),
            kept_positions=PartitionSpec("cache_batch", None),
            kept_distance=PartitionSpec("cache_batch", None),
        )
