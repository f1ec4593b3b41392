"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434).

Keys and values are compressed into one latent per token, c_kv = RMSNorm(x W_DKV)
of width R = mla.kv_rank, and each head's non-positional key and its value are
linear up-projections of it (W_UK [R, N, nope], W_UV [R, N, Hv]). Position
enters through a separate RoPE key of width Hr = mla.rope_dim, shared by all
heads ("decoupled RoPE"). The cache holds only c_kv and k_rope:
R + Hr numbers per token and layer instead of 2 x N x head_dim.

Models converted from grouped-query attention (MHA2MLA, arXiv:2502.14837;
kvlab/checkpoints/convert.py) keep part of each source KV head's rotary key, so they
cache Kr = mla.rope_heads RoPE keys (query head n reads key n // (N / Kr)),
each rotating its layer's frequency pairs `mla.rope_pairs` of a head_dim-wide RoPE,
and their latent is linear in x (mla.latent_norm=False): R + Kr x Hr numbers.

Queries are full rank (x W_Q) or, with mla.q_rank > 0, low rank with their own
norm (RMSNorm(x W_DQ) W_UQ); each head's query is [nope | rope]. The two latent
norms use mla.norm_eps (DeepSeek-V2 fixes them at 1e-6). Under a scaled RoPE
(model.rope_scaling, kvlab/rope.py) the softmax scale is multiplied by
`softmax_mscale` twice (yarn's mscale), as DeepSeek-V2 does.

    MultiHeadLatentAttention(config)(x [B, T, D], placement, layer | None)
        -> (out [B, T, D], layer)

Two ways to attend over the latent, equal up to float rounding:

- expanded ("naive"): up-project every cached latent to per-head keys and
  values [B, N, S, .] each step, then attend as multi-head attention;
- absorbed: fold W_UK into the query (q_nope W_UK^T is a query in latent
  space, [B, T, N, R]) and attend over c_kv itself as one shared KV head; apply
  W_UV to the [B, T, N, R] attention output. Nothing per head is built over the
  cached length, so a decode step reads (R + Hr) numbers per cached token.

Which path runs: every step over a cache follows `mla.absorb`, prefill chunks
included, so a sequence's logits do not depend on how it was chunked. The
plain forward (cache=None: training, full-sequence scoring) always expands:
with T queries over the same T keys the expansion is paid once per token, while
latent-space scores cost 2R + Hr multiply-adds per query-key pair against
nope + Hr + Hv expanded (R = 4 nope in DeepSeek-V2). For a long prompt
prefilled through a cache, absorb=False is the cheaper choice; for decode,
absorbed reads ~N x (nope + Hv) / (R + Hr) times less (bench_decode.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import FrozenConfigDict

from kvlab.attention.core import attend, through_layer
from kvlab.attention.gqa import KEY_AXES, OUT_AXES, QUERY_AXES
from kvlab.cache.placement import Placement
from kvlab.cache.protocols import Reader
from kvlab.cache.transforms import IDENTITY
from kvlab.config import dtype_of
from kvlab.layers import RMSNorm, logical, projection
from kvlab.rope import rope_frequencies, rotate, softmax_mscale


def _dense(x) -> jax.Array:
    """An array for what may be a reader of stored data (a quantized payload)."""
    return x.dequantize() if isinstance(x, Reader) else x


def expanded_attention(
    q_nope, q_rope, blocks, key_up, value_up, scale, observe=None, impl="xla", latent=IDENTITY
):
    """Per-head K/V expanded from each block's latent, then multi-head attention.

    q_nope [B, T, N, nope], q_rope [B, T, N, Hr]; blocks: sequence of
    (c_kv [B, 1, S, R], k_rope [B, Kr, S, Hr], mask bool[B, T or 1, S]);
    key_up [R, N, nope] (None when nope is 0: keys are their RoPE part alone),
    value_up [R, N, Hv] -> [B, T, N, Hv]; with `observe`, also the mass each
    block's tokens received (kvlab.attention.core.attend), per query head.
    `latent`: the transform the blocks' latents are stored under, undone before
    the up-projections (kvlab/cache/transforms).
    """
    dtype = q_rope.dtype
    heads = q_rope.shape[2]
    expanded = []
    for c_kv, k_rope, mask in blocks:
        c_kv = latent.inverse(_dense(c_kv))[:, 0].astype(dtype)  # [B, S, R]
        # [B, N, S, Hv]
        v = jnp.einsum("BSR,RNH->BNSH", c_kv, value_up.astype(dtype))
        # Each head's RoPE key (one shared by all, or one per group): [B, N, S, Hr]
        k_rope = _dense(k_rope).astype(dtype)
        k_rope = jnp.repeat(k_rope, heads // k_rope.shape[1], axis=1)
        if key_up is None:
            expanded.append(((k_rope,), v, mask))
            continue
        # [B, N, S, nope]
        k_nope = jnp.einsum("BSR,RNH->BNSH", c_kv, key_up.astype(dtype))
        expanded.append(((k_nope, k_rope), v, mask))
    queries = (q_rope,) if key_up is None else (q_nope, q_rope)
    return attend(queries, expanded, scale, observe, impl)


def absorbed_attention(
    q_nope, q_rope, blocks, key_up, value_up, scale, observe=None, impl="xla", latent=IDENTITY
):
    """Attention in latent space: W_UK folded into the query, W_UV applied after.

    Same arguments and result as `expanded_attention`. The latent is one KV
    head shared by all N query heads, read as both key part and value; the
    RoPE keys are read by their groups of query heads. Under a `latent`
    transform the latent-space query is transformed alike and the output back.
    """
    dtype = q_rope.dtype
    if key_up is None:  # no key part in the latent: scores are the RoPE part's
        read = [((k_rope,), c_kv, mask) for c_kv, k_rope, mask in blocks]
        out = attend((q_rope,), read, scale, observe, impl)  # [B, T, N, R]
    else:
        # [B, T, N, R]: each head's query against the latent
        q_latent = latent.forward(_per_head(q_nope, key_up.astype(dtype), 2))
        read = [((c_kv, k_rope), c_kv, mask) for c_kv, k_rope, mask in blocks]
        out = attend((q_latent, q_rope), read, scale, observe, impl)  # [B, T, N, R]
    out, mass = (out, None) if observe is None else out
    out = _per_head(latent.inverse(out), value_up.astype(dtype), 0)  # [B, T, N, Hv]
    return out if observe is None else (out, mass)


def _per_head(x, up, contracted: int) -> jax.Array:
    """x [B, T, N, I] times each head's matrix of `up` [R, N, H]: its R axis
    (contracted=0, -> [B, T, N, H]) or its H axis (contracted=2, -> [B, T, N, R]).

    The einsum of the same product lets XLA:CPU compute it transposed ([N, O,
    B*T]) and then transpose it element by element: for a batch of prompts
    ([8, 128, 12, 256]) 20 ms against 4 ms for this product over heads ([N, B,
    T, O]) and a transpose that moves whole rows of O.
    """
    out = jax.lax.dot_general(x, up, (((3,), (contracted,)), ((2,), (1,))))  # [N, B, T, O]
    return jnp.transpose(out, (1, 2, 0, 3))


UP_AXES = ("latent", "heads", "head_dim")  # [R, N, .]: up projections from a latent


def rope_frequencies_of(model, index: int) -> tuple:
    """(keys' [Kr, Hr/2] or [Hr/2], queries' [N, Hr/2] or [Hr/2] inverse frequencies,
    cos/sin factor) of layer `index` of a latent attention `model` section.

    Without `mla.rope_pairs`, RoPE over rope_dim channels (DeepSeek-V2); with
    them, RoPE key k turns the pairs listed for it of a head_dim-wide RoPE, and
    so do the queries that read it.
    """
    mla = model.mla
    if not mla.rope_pairs:
        frequency, factor = rope_frequencies(mla.rope_dim, model.rope_theta, model.rope_scaling)
        return frequency, frequency, factor
    frequency, factor = rope_frequencies(model.head_dim, model.rope_theta, model.rope_scaling)
    keys = jnp.asarray(frequency)[np.asarray(mla.rope_pairs[index])]  # [Kr, Hr/2]
    return keys, jnp.repeat(keys, model.num_heads // mla.rope_heads, axis=0), factor


class MultiHeadLatentAttention(nn.Module):
    config: FrozenConfigDict  # the model section
    index: int = 0  # the layer's place in the stack (mla.rope_pairs are per layer)
    # Cross-layer topologies (kvlab/cache/topology): a layer that does not produce
    # has no kv_down, kv_norm or key_rope (its own key_up and value_up read the
    # producer's latent) and attends over the `Read` it is given; one that does
    # not commit returns its read for the layers after it.
    produces: bool = True
    commits: bool = True

    @nn.compact
    def __call__(self, x, placement: Placement, layer=None):
        cfg, mla = self.config, self.config.mla
        heads = cfg.num_heads
        # [B, T, N, nope + Hr]
        if mla.q_rank:
            c_q = projection(cfg, mla.q_rank, "query_down", axes=("embed", "latent"))(x)
            c_q = RMSNorm(cfg, eps=mla.norm_eps, name="query_norm")(c_q)
            q = projection(cfg, (heads, cfg.head_dim), "query_up", axes=UP_AXES)(c_q)
        else:
            q = projection(cfg, (heads, cfg.head_dim), "query", axes=QUERY_AXES)(x)
        q_nope = q[..., : mla.nope_dim]
        key_frequency, query_frequency, factor = rope_frequencies_of(cfg, self.index)
        q_rope = rotate(q[..., mla.nope_dim :], placement.positions, query_frequency, factor)
        fresh = None
        if self.produces:
            # What the cache holds: [B, T, R] and [B, T, Kr, Hr]
            c_kv = projection(cfg, mla.kv_rank, "kv_down", axes=("embed", "latent"))(x)
            if mla.latent_norm:
                c_kv = RMSNorm(cfg, eps=mla.norm_eps, name="kv_norm")(c_kv)
            k_rope = projection(cfg, (mla.rope_heads, mla.rope_dim), "key_rope", axes=KEY_AXES)(x)
            k_rope = rotate(k_rope, placement.positions, key_frequency, factor)
            # [B, 1, T, R] and [B, Kr, T, Hr], as the cache holds them
            fresh = (c_kv[:, None], k_rope.transpose(0, 2, 1, 3))

        up_init = logical(nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)), UP_AXES)
        param_dtype = dtype_of(cfg.param_dtype)
        # nope_dim is 0 when a conversion keeps every RoPE pair: no key_up then.
        key_up = None
        if mla.nope_dim:
            key_shape = (mla.kv_rank, heads, mla.nope_dim)
            key_up = self.param("key_up", up_init, key_shape, param_dtype)
        value_up = self.param(
            "value_up", up_init, (mla.kv_rank, heads, mla.v_head_dim), param_dtype
        )
        out_projection = projection(cfg, cfg.embed_dim, "out", axis=(-2, -1), axes=OUT_AXES)
        # 1 / sqrt(nope + Hr), the per-head query/key width, times yarn's correction squared
        mscale = softmax_mscale(cfg.rope_scaling)
        scale = cfg.head_dim**-0.5 * mscale * mscale

        # The cache's transforms (kvlab/cache/transforms): the latent and RoPE keys
        # as it stores them; the RoPE queries rotated alike (the latent's in attend_latent).
        latent, rope = placement.transforms or (IDENTITY, IDENTITY)
        q_rope = rope.forward(q_rope)
        if fresh is not None:
            fresh = (latent.forward(fresh[0]), rope.forward(fresh[1]))

        def attention(regions, observe, cached):
            blocks = [(c_kv, k_rope, mask) for (c_kv, k_rope), mask in regions]
            if not cached:  # the plain forward expands (module docstring)
                return expanded_attention(q_nope, q_rope, blocks, key_up, value_up, scale)
            attend_latent = absorbed_attention if mla.absorb else expanded_attention
            return attend_latent(
                q_nope, q_rope, blocks, key_up, value_up, scale, observe, cfg.attention_impl,
                latent,
            )  # fmt: skip

        def against_latent():  # [B, 1, T, N, R]: the queries against the latent, for scorers
            return latent.forward(_per_head(q_nope, key_up.astype(q_nope.dtype), 2))[:, None]

        # None when the latent holds no key part
        queries = None if key_up is None else against_latent
        out, layer = through_layer(
            layer, fresh, placement, attention, self.commits, queries=queries
        )
        return out_projection(out), layer
