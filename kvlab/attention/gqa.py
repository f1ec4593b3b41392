"""Multi-head, grouped-query and multi-query attention with a KV cache.

MHA (arXiv:1706.03762), GQA (arXiv:2305.13245) and MQA (arXiv:1911.02150) differ
only in `num_kv_heads` (K): N query heads share K key/value heads in groups of
G = N / K. The cache stores K heads, never N.

    GroupedQueryAttention(config)(x [B, T, D], placement, layer | None)
        -> (out [B, T, D], layer)

Options that Hugging Face families use: `model.qkv_bias` gives the query, key
and value projections biases (Qwen2, Qwen2.5); `model.qk_norm` normalises
each head's query and key (RMSNorm over H, modules `query_norm`, `key_norm`)
before RoPE (Qwen3); `model.rope_scaling` stretches RoPE (kvlab/rope.py).

With a cache layer (dense or quantized, kvlab/cache), the queries attend over
what the layer holds and over the new keys and values as the layer will hold
them; then the layer stores the new ones. Under a cross-layer topology
(model.topology, kvlab/cache/topology) a consuming layer (`produces=False`)
has no key or value projection and is given the producing layer's read
(kvlab.attention.core.Read) in place of a cache layer. The cache's transforms
(`placement.transforms`, kvlab/cache/transforms) rotate the keys and values
before they are stored, the queries alike, and the output back. Without a
cache (the plain forward) the queries attend over the new tokens alone.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import FrozenConfigDict

from kvlab.attention.core import Queries, attend, through_layer
from kvlab.cache.placement import Placement
from kvlab.cache.transforms import IDENTITY
from kvlab.config import dtype_of
from kvlab.layers import RMSNorm, projection
from kvlab.rope import apply_rope

# The projections' logical axes (kvlab/sharding.py maps them to mesh axes)
QUERY_AXES = ("embed", "heads", "head_dim")  # [D, N, H]
KEY_AXES = ("embed", "kv_heads", "head_dim")  # [D, K, H], keys and values
OUT_AXES = ("heads", "head_dim", "embed")  # [N, H, D]
FUSED_AXES = ("embed", "kv_heads", None, "head_dim")  # [D, K, G + 2, H]


class GroupedQueryAttention(nn.Module):
    config: FrozenConfigDict  # the model section
    # Cross-layer topologies (kvlab/cache/topology): a layer that does not produce
    # has no key or value projection and attends over the `Read` it is given; one
    # that does not commit returns its read for the layers after it.
    produces: bool = True
    commits: bool = True

    @nn.compact
    def __call__(self, x, placement: Placement, layer=None):
        cfg = self.config
        heads, kv_heads = (cfg.num_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)
        fresh = None
        # [B, T, N, H] and [B, T, K, H]
        if self.has_variable("params", "qkv"):  # kvlab.fuse_projections' layout
            q, k, v = _fused_qkv(cfg, x)
        else:
            q = projection(cfg, heads, "query", bias=cfg.qkv_bias, axes=QUERY_AXES)(x)
            if self.produces:
                k = projection(cfg, kv_heads, "key", bias=cfg.qkv_bias, axes=KEY_AXES)(x)
                v = projection(cfg, kv_heads, "value", bias=cfg.qkv_bias, axes=KEY_AXES)(x)
        if cfg.qk_norm:
            q = RMSNorm(cfg, name="query_norm")(q)
        raw = q  # [B, T, N, H] before RoPE, for scorers
        q = apply_rope(q, placement.positions, cfg.rope_theta, cfg.rope_scaling)
        if self.produces:
            if cfg.qk_norm:
                k = RMSNorm(cfg, name="key_norm")(k)
            k = apply_rope(k, placement.positions, cfg.rope_theta, cfg.rope_scaling)
            # [B, K, T, H]
            fresh = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        out_projection = projection(cfg, cfg.embed_dim, "out", axis=(-2, -1), axes=OUT_AXES)

        # The cache's transforms: keys and values as it stores them, queries
        # rotated alike, the output rotated back (kvlab/cache/transforms).
        keys, values = placement.transforms or (IDENTITY, IDENTITY)
        q = keys.forward(q)
        if fresh is not None:
            fresh = (keys.forward(fresh[0]), values.forward(fresh[1]))

        # What the layer holds, and the new tokens as it will hold them.
        def attention(regions, observe, cached):
            blocks = [(k, v, mask) for (k, v), mask in regions]
            impl = cfg.attention_impl if cached else "xla"
            return attend(q, blocks, observe=observe, impl=impl)

        def by_kv_head(x):  # [B, T, N, H] -> [B, K, T, G, H]: each KV head's query heads
            b, t = x.shape[:2]
            return x.reshape(b, t, cfg.num_kv_heads, -1, x.shape[-1]).transpose(0, 2, 1, 3, 4)

        def rotate(x, positions, span=1):  # raw [B, K, Q, H] as queries at positions [B, Q]
            turned = x.swapaxes(1, 2)
            turned = apply_rope(turned, positions, cfg.rope_theta, cfg.rope_scaling, span)
            return keys.forward(turned.swapaxes(1, 2))

        def output_norms(v):  # v [B, K, X, H] as stored -> [B, K, G, X]: |W_o v|_1 per head
            v = values.inverse(v).astype(jnp.float32)
            heads, width = cfg.num_heads, cfg.head_dim
            stored = self.variables["params"]["out"]
            few = v.shape[2] < width  # a step's new tokens: every query head at once
            if "kernel" in stored:
                kernel = stored["kernel"].astype(jnp.float32)  # [N, H, D]
            elif few:
                # A backend's own layout: project each value in each query head's
                # place alone, N x X rows (not the N x H that read the kernel back).
                alone = jnp.repeat(v, heads // cfg.num_kv_heads, axis=1)  # [B, N, X, H]
                alone = alone[:, :, :, None, :] * jnp.eye(heads)[:, None, :, None]
                out = out_projection(alone.astype(dtype_of(cfg.dtype))).astype(jnp.float32)
                return jnp.abs(out).sum(-1).reshape(*v.shape[:2], -1, v.shape[2])
            else:  # read the kernel back through the projection: N x H rows
                basis = jnp.eye(heads * width, dtype=dtype_of(cfg.dtype))
                rows = out_projection(basis.reshape(-1, heads, width))
                kernel = rows.astype(jnp.float32).reshape(heads, width, -1)
            per_head = kernel.reshape(cfg.num_kv_heads, -1, *kernel.shape[1:])  # [K, G, H, D]
            if few:
                return jnp.abs(jnp.einsum("bkxh,kghd->bkgxd", v, per_head)).sum(-1)
            norm = lambda w: jnp.abs(jnp.einsum("bkxh,khd->bkxd", v, w)).sum(-1)  # noqa: E731
            # one query head at a time: many values' projections are large
            return jax.lax.map(norm, per_head.swapaxes(0, 1)).transpose(1, 2, 0, 3)

        def queries():  # for scorers (kvlab.attention.core.Queries)
            return Queries(by_kv_head(q), by_kv_head(raw), rotate, output_norms, x)

        out, layer = through_layer(
            layer, fresh, placement, attention, self.commits, queries=queries
        )
        return out_projection(values.inverse(out)), layer


def _fused_qkv(cfg, x):
    """Queries, keys and values from one product with the `qkv` kernel [D, K, G + 2, H]:
    for each key/value head its G query heads, then its key, then its value
    (kvlab.model.fuse_projections; query head n = k * G + g, as attend groups them)."""
    groups = cfg.num_heads // cfg.num_kv_heads
    features = (cfg.num_kv_heads, groups + 2, cfg.head_dim)
    qkv = projection(cfg, features, "qkv", bias=cfg.qkv_bias, axes=FUSED_AXES)(x)
    q = qkv[..., :groups, :].reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
    return q, qkv[..., groups, :], qkv[..., groups + 1, :]
