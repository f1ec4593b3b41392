"""Feed-forward layers: the SwiGLU MLP and DeepSeek's mixture of experts.

SwiGLU (arXiv:2002.05202) is down(silu(gate(x)) * up(x)). The mixture of
experts is DeepSeekMoE (arXiv:2401.06066) as DeepSeek-V2 (arXiv:2405.04434)
and DeepSeek-V3 (arXiv:2412.19437) use it: E fine-grained routed experts, each
a SwiGLU of width F = model.moe.expert_dim, of which a router picks k =
experts_per_token per token, plus shared experts every token passes through
(one SwiGLU of width num_shared_experts x F). Layers 0..first_dense_layers-1
keep the dense MLP of width model.mlp_dim (`uses_experts`).

    MLP(config, hidden_dim=None)(x [..., D]) -> [..., D]    width model.mlp_dim unless given
    MoE(config)(x [B, T, D]) -> [B, T, D]                   shared(x) + sum_k w_k expert_k(x)
    route(logits float32[N, E], bias float32[E] | None, moe) -> (int32[N, k], float32[N, k])
    routed_experts(x [N, D], experts int32[N, k], weights float32[N, k],
                   gate [E, D, F], up [E, D, F], down [E, F, D]) -> float32[N, D]

N is tokens (B x T flattened), E routed experts, F an expert's hidden width,
k experts per token, M = N x k the (token, expert) assignments.

The math is Hugging Face transformers' DeepseekV2Moe and DeepseekV3MoE (with
their DeepseekV2TopkRouter and DeepseekV3TopkRouter; transformers 5.x): the
router is stored and run in float32, whatever the model's dtypes, as HF keeps
it; `routing='softmax'` is V2's greedy or group-limited greedy choice,
`routing='sigmoid'` V3's choice with a per-expert score-correction bias that
only picks experts (see `route`); the routed sum is added to the shared
experts' output. Two differences, both outside real checkpoints: the routed
sum is accumulated in float32 and cast once (HF adds each expert's part in
the compute dtype; identical in float32), and `normalize_weights` also applies
to softmax routing (HF's V2 ignores norm_topk_prob, which every V2 checkpoint
sets False).

Parameters of an MoE layer (under block_i/mlp):

    router/kernel  float32[D, E]   HF mlp.gate.weight, transposed
    router_bias    float32[E]      routing='sigmoid' only: HF mlp.gate.e_score_correction_bias
    gate, up       [E, D, F]       the routed experts' projections, stacked
    down           [E, F, D]
    shared/{gate,up,down}/kernel   the shared experts as one MLP (num_shared_experts > 0)
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import default_kernel_init
from jaxtyping import Array, Float, Int
from ml_collections import FrozenConfigDict

from kvlab.config import dtype_of
from kvlab.layers import logical, projection


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), hidden width
    `hidden_dim` (default model.mlp_dim)."""

    config: FrozenConfigDict  # the model section
    hidden_dim: int | None = None

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        width = cfg.mlp_dim if self.hidden_dim is None else self.hidden_dim
        if self.has_variable("params", "gate_up"):  # kvlab.fuse_projections' layout
            both = projection(cfg, (2, width), "gate_up", axes=("embed", None, "mlp"))(x)
            gate, up = both[..., 0, :], both[..., 1, :]
        else:
            gate = projection(cfg, width, "gate", axes=("embed", "mlp"))(x)  # [B, T, F]
            up = projection(cfg, width, "up", axes=("embed", "mlp"))(x)
        return projection(cfg, cfg.embed_dim, "down", axes=("mlp", "embed"))(nn.silu(gate) * up)


def uses_experts(model: Mapping, index: int) -> bool:
    """Whether layer `index` of `model` runs the mixture of experts (else the dense MLP).

    DeepSeek's rule: every layer from model.moe.first_dense_layers on whose index
    is a multiple of model.moe.every (HF first_k_dense_replace, moe_layer_freq).
    """
    moe = model["moe"]
    routed = index >= moe["first_dense_layers"] and index % moe["every"] == 0
    return moe["num_experts"] > 0 and routed


def route(
    logits: Float[Array, "N E"], bias: Float[Array, " E"] | None, moe: Mapping
) -> tuple[Int[Array, "N k"], Float[Array, "N k"]]:
    """Each token's experts and their weights, as DeepSeek's routers choose them.

    `logits` are the router's float32 outputs; `moe` the model.moe section.

    - routing='softmax' (DeepSeek-V2): scores = softmax(logits). With
      num_groups > 1 (HF topk_method='group_limited_greedy') the experts form
      num_groups equal groups, a group scores its best expert, and only the
      best groups_per_token groups may be chosen; num_groups = 1 is HF 'greedy'.
    - routing='sigmoid' (DeepSeek-V3): scores = sigmoid(logits); experts are
      chosen by scores + bias (the score-correction bias), a group scoring
      the sum of its two best; the weights come from the scores without bias.

    The k best allowed experts are chosen (excluded groups count as -inf);
    their scores are divided by their sum (+1e-20) when normalize_weights,
    then multiplied by routed_scale. Experts come out best first.
    """
    num_experts = logits.shape[-1]
    if moe["routing"] == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias
    groups = moe["num_groups"]
    if groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], groups, num_experts // groups)
        if moe["routing"] == "softmax":
            group_scores = grouped.max(axis=-1)  # [N, G]
        else:
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        _, kept = jax.lax.top_k(group_scores, moe["groups_per_token"])  # [N, g]
        allowed = jnp.any(jax.nn.one_hot(kept, groups, dtype=jnp.bool_), axis=-2)  # [N, G]
        allowed = jnp.repeat(allowed, num_experts // groups, axis=-1)  # [N, E]
        choice = jnp.where(allowed, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, moe["experts_per_token"])  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe["normalize_weights"]:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * moe["routed_scale"]


def routed_experts(
    x: Float[Array, "N D"],
    experts: Int[Array, "N k"],
    weights: Float[Array, "N k"],
    gate: Float[Array, "E D F"],
    up: Float[Array, "E D F"],
    down: Float[Array, "E F D"],
) -> Float[Array, "N D"]:
    """sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n]), float32: each expert runs
    only on the tokens routed to it.

    Why this layout: the M = N x k assignments are sorted by expert, so each
    expert's tokens are one contiguous run of rows, and a scan walks the runs
    in blocks of C = ceil(M / E) rows, one expert per block, skipping empty
    blocks under `lax.cond`. A run of n rows takes ceil(n / C) blocks, so at
    most M / C + E <= 2E blocks run, computing at most 2M rows and reading
    each used expert's weights about once (a decode step reads only the k
    experts of each token, like the weights HF's loop touches).
    `jax.lax.ragged_dot` would express the same grouped product, but on CPU it
    lowers to a dense product over every expert for every row (E times the
    work and an [E, M, D] buffer), and gathering each token's k experts'
    weights copies k x 3 x D x F numbers per token, too much for a prefill of
    a real checkpoint. A scan with cond is also differentiable, so MoE models train.
    """
    gate, up, down = jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)  # indexed by tracers
    num_tokens, k = experts.shape
    num_experts, embed_dim, _ = gate.shape
    assignments = num_tokens * k
    block = -(-assignments // num_experts)  # C rows per block
    num_blocks = assignments // block + num_experts  # static bound on sum_e ceil(n_e / C)

    flat = experts.reshape(assignments)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k  # [M] the token of each sorted assignment
    counts = jnp.bincount(flat, length=num_experts)  # [E] tokens routed to each expert
    run_start = jnp.cumsum(counts) - counts  # first sorted row of each expert's run
    blocks = -(-counts // block)  # [E] blocks each expert's run takes
    blocks_end = jnp.cumsum(blocks)
    index = jnp.arange(num_blocks)
    owner = jnp.searchsorted(blocks_end, index, side="right")  # [num_blocks]; E past the last
    expert = jnp.minimum(owner, num_experts - 1)
    offset = (index - (blocks_end - blocks)[expert]) * block
    start = run_start[expert] + offset  # first sorted row of each block
    size = jnp.where(owner < num_experts, jnp.clip(counts[expert] - offset, 0, block), 0)

    # [M + C, D]: C spare rows, so a block's slice never runs past the end.
    rows = jnp.concatenate([x[token], jnp.zeros((block, embed_dim), x.dtype)])

    def step(out, block_of):
        e, first, used = block_of

        def run(out):
            xb = jax.lax.dynamic_slice_in_dim(rows, first, block)  # [C, D]
            hidden = nn.silu(xb @ gate[e]) * (xb @ up[e])  # [C, F]
            # A block shorter than C also writes the rows after its run: they are the
            # next run's and the next block overwrites them (blocks go in order), or
            # they are spare rows.
            return jax.lax.dynamic_update_slice_in_dim(out, hidden @ down[e], first, 0)

        return jax.lax.cond(used > 0, run, lambda out: out, out), None

    out, _ = jax.lax.scan(step, jnp.zeros_like(rows), (expert, start, size))
    weighted = out[:assignments].astype(jnp.float32) * weights.reshape(assignments)[order, None]
    # [N, D]: each token's k weighted expert outputs summed
    return jnp.zeros((num_tokens, embed_dim), jnp.float32).at[token].add(weighted)


class MoE(nn.Module):
    """DeepSeek's mixture-of-experts feed-forward (model.moe): float32 router, routed
    experts weighted by `route`, plus the shared experts. x [B, T, D] -> [B, T, D]."""

    config: FrozenConfigDict  # the model section

    @nn.compact
    def __call__(self, x):
        cfg, moe = self.config, self.config.moe
        num_experts, embed_dim, width = moe.num_experts, cfg.embed_dim, moe.expert_dim
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        # Choices are discrete: the router is kept and run in float32 (as HF keeps
        # it), its matmul at full precision.
        router = nn.DenseGeneral(
            num_experts,
            use_bias=False,
            name="router",
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
            kernel_init=logical(default_kernel_init, ("embed", "experts")),
        )
        logits = router(x.astype(jnp.float32)).reshape(-1, num_experts)  # [N, E]
        bias = None
        if moe.routing == "sigmoid":
            zeros = logical(nn.initializers.zeros, ("experts",))
            bias = self.param("router_bias", zeros, (num_experts,), jnp.float32)
        experts, weights = route(logits, bias, moe)  # [N, k]

        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        into = logical(init, ("experts", "embed", "mlp"))  # [E, D, F]
        out_of = logical(init, ("experts", "mlp", "embed"))  # [E, F, D]
        gate = self.param("gate", into, (num_experts, embed_dim, width), param_dtype)
        up = self.param("up", into, (num_experts, embed_dim, width), param_dtype)
        down = self.param("down", out_of, (num_experts, width, embed_dim), param_dtype)
        routed = routed_experts(
            x.reshape(-1, embed_dim),
            experts,
            weights,
            jnp.asarray(gate, dtype),
            jnp.asarray(up, dtype),
            jnp.asarray(down, dtype),
        )
        out = routed.astype(dtype).reshape(x.shape)  # [B, T, D]
        if moe.num_shared_experts:
            out = out + MLP(cfg, moe.num_shared_experts * width, name="shared")(x)
        return out
