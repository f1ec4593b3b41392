"""The mixture of experts routes as Hugging Face's DeepSeek-V2/V3 routers do, its
grouped expert product equals running every expert on every token, and a
model with MoE layers decodes through a cache as its plain forward computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.moe import MoE, route, routed_experts, uses_experts
from tests.helpers import TOLERANCE, mla_config, random_tokens, tiny_config


def moe_section(**fields):
    moe = kvlab.base_config("tiny").model.moe
    moe.update(fields)
    return kvlab.config.frozen(moe)


# -- Reference: HF's routers, written out in numpy --------------------------------------------


def hf_route(logits, bias, moe):
    """[N, E] weights (0 where an expert is not chosen) by the rules of transformers'
    DeepseekV2TopkRouter ('softmax') and DeepseekV3TopkRouter ('sigmoid')."""
    logits = np.asarray(logits, np.float64)
    num_tokens, num_experts = logits.shape
    groups, size = moe.num_groups, num_experts // moe.num_groups
    if moe.routing == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = scores
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + np.asarray(bias, np.float64)
    if groups > 1:  # V2: 'group_limited_greedy'; V3 always (one group changes nothing)
        grouped = choice.reshape(num_tokens, groups, size)
        if moe.routing == "softmax":
            group_scores = grouped.max(-1)  # a group's best expert
        else:
            group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)  # its two best
        best_groups = np.argsort(-group_scores, -1)[:, : moe.groups_per_token]
        kept = np.zeros((num_tokens, groups), bool)
        kept[np.arange(num_tokens)[:, None], best_groups] = True
        fill = 0.0 if moe.routing == "softmax" else -np.inf  # as HF masks each
        choice = np.where(np.repeat(kept, size, -1), choice, fill)
    chosen = np.argsort(-choice, -1)[:, : moe.experts_per_token]
    weights = np.take_along_axis(scores, chosen, -1)  # V3: without the bias
    if moe.normalize_weights:
        weights /= weights.sum(-1, keepdims=True) + 1e-20
    dense = np.zeros_like(scores)
    dense[np.arange(num_tokens)[:, None], chosen] = weights * moe.routed_scale
    return dense


def as_dense(experts, weights, num_experts):
    experts, weights = np.asarray(experts), np.asarray(weights)
    dense = np.zeros((experts.shape[0], num_experts))
    dense[np.arange(experts.shape[0])[:, None], experts] = weights
    return dense


ROUTERS = {
    "v2_greedy": dict(routing="softmax", experts_per_token=3),
    "v2_group_limited": dict(routing="softmax", num_groups=4, groups_per_token=2),
    "softmax_normalized": dict(routing="softmax", normalize_weights=True, routed_scale=2.0),
    "v3": dict(
        routing="sigmoid",
        experts_per_token=3,
        num_groups=4,
        groups_per_token=2,
        normalize_weights=True,
        routed_scale=2.5,
    ),
    "v3_one_group": dict(routing="sigmoid", experts_per_token=4),
}


@pytest.mark.parametrize("router", ROUTERS)
def test_route_matches_the_hf_rules(router):
    moe = moe_section(num_experts=16, **ROUTERS[router])
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 16)).astype(np.float32) * 2
    bias = rng.standard_normal(16).astype(np.float32)  # negative ones too
    experts, weights = jax.jit(route, static_argnums=2)(logits, bias, moe)
    assert experts.shape == weights.shape == (64, moe.experts_per_token)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    got = as_dense(experts, weights, 16)
    np.testing.assert_array_equal(got > 0, hf_route(logits, bias, moe) > 0)  # same experts
    np.testing.assert_allclose(got, hf_route(logits, bias, moe), rtol=1e-5, atol=1e-7)


def test_v2_groups_score_their_best_expert_v3_its_two_best():
    # Group 0 holds the best expert (0.9) but group 1 the best pair (0.8 + 0.7).
    probabilities = np.array([[0.9, 0.1, 0.8, 0.7]], np.float32)
    common = dict(num_experts=4, experts_per_token=1, num_groups=2, groups_per_token=1)
    v2 = moe_section(routing="softmax", **common)
    experts, _ = route(jnp.log(probabilities), None, v2)
    assert int(experts[0, 0]) == 0
    v3 = moe_section(routing="sigmoid", **common)
    logits = jnp.log(probabilities / (1 - probabilities))  # sigmoid(logits) = probabilities
    experts, weights = route(logits, jnp.zeros(4), v3)
    assert int(experts[0, 0]) == 2
    np.testing.assert_allclose(weights, [[0.8]], rtol=1e-6)
    # The correction bias chooses; the weight stays the unbiased score.
    experts, weights = route(logits, jnp.array([0.0, 0.0, 0.0, 0.2]), v3)
    assert int(experts[0, 0]) == 3
    np.testing.assert_allclose(weights, [[0.7]], rtol=1e-6)
    # Excluded groups count as -inf (transformers 5), not 0: below-zero choices still win.
    experts, _ = route(logits, jnp.full(4, -2.0), v3)
    assert int(experts[0, 0]) == 2


# -- The grouped expert product ---------------------------------------------------------------


@jax.jit
def every_expert_on_every_token(x, experts, weights, gate, up, down):
    """The dense reference: all E experts on all N tokens, weighted by the router."""
    hidden = jax.nn.silu(jnp.einsum("ND,EDF->ENF", x, gate)) * jnp.einsum("ND,EDF->ENF", x, up)
    outputs = jnp.einsum("ENF,EFD->END", hidden, down)
    rows = jnp.arange(x.shape[0])[:, None]
    combine = jnp.zeros((x.shape[0], gate.shape[0])).at[rows, experts].add(weights)  # [N, E]
    return jnp.einsum("NE,END->ND", combine, outputs)


def random_experts(seed, num_tokens, k, num_experts, dim=6, width=5, skewed=False):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if skewed:  # every token to the same few experts: one long run, the others empty
        experts = np.tile(np.arange(k), (num_tokens, 1))
    else:
        experts = np.argsort(rng.random((num_tokens, num_experts)), -1)[:, :k]
    return (
        normal(num_tokens, dim),
        experts.astype(np.int32),
        rng.random((num_tokens, k)).astype(np.float32),
        normal(num_experts, dim, width),
        normal(num_experts, dim, width),
        normal(num_experts, width, dim),
    )


@pytest.mark.parametrize(
    "num_tokens, k, num_experts, skewed",
    [(1, 2, 4, False), (33, 3, 8, False), (9, 2, 8, True), (5, 1, 1, False)],
)
def test_routed_experts_equal_every_expert_on_every_token(num_tokens, k, num_experts, skewed):
    args = random_experts(num_tokens, num_tokens, k, num_experts, skewed=skewed)
    got = jax.jit(routed_experts)(*args)
    assert got.shape == (num_tokens, 6) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, every_expert_on_every_token(*args), rtol=1e-5, atol=1e-5)


def test_routed_experts_differentiate_like_the_dense_reference():
    x, experts, weights, gate, up, down = random_experts(1, 11, 2, 4)
    target = np.random.default_rng(2).standard_normal((11, 6)).astype(np.float32)

    def loss(fn):
        return lambda x, w, g, u, d: jnp.sum(fn(x, experts, w, g, u, d) * target)

    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(loss(routed_experts), argnums))(x, weights, gate, up, down)
    want = jax.jit(jax.grad(loss(every_expert_on_every_token), argnums))(x, weights, gate, up, down)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# -- The layer --------------------------------------------------------------------------------


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def random_params(module, *inputs, seed=0):
    """Parameters of `module` drawn at random from their shapes (norm scales 1, the rest
    normal / sqrt(fan-in), so a sigmoid router's correction bias is random too):
    no init compile."""
    shapes = jax.eval_shape(module.init, jax.random.key(0), *inputs)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        if path[-1].key == "scale":
            return jnp.ones(shape.shape, shape.dtype)
        fan_in = shape.shape[-2] if len(shape.shape) == 3 else shape.shape[0]
        return jnp.asarray(rng.standard_normal(shape.shape) / np.sqrt(fan_in), shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def test_moe_layer_is_shared_plus_weighted_routed_experts():
    cfg = tiny_config(embed_dim=16)
    cfg.model.moe.update(num_experts=8, expert_dim=6, num_shared_experts=2, **ROUTERS["v3"])
    kvlab.config.validate_model_config(cfg.model)
    model_cfg = kvlab.config.frozen(cfg.model)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    layer = MoE(model_cfg)
    params = random_params(layer, x)
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {
        "router": {"kernel": (16, 8)},
        "router_bias": (8,),
        "gate": (8, 16, 6),
        "up": (8, 16, 6),
        "down": (8, 6, 16),
        "shared": {
            "gate": {"kernel": (16, 12)},
            "up": {"kernel": (16, 12)},
            "down": {"kernel": (12, 16)},
        },
    }
    p = jax.tree.map(np.asarray, params)
    got = layer.apply({"params": p}, x)  # outside jit, numpy weights (as a checkpoint loads)

    tokens = x.reshape(10, 16)
    combine = hf_route(tokens @ p["router"]["kernel"], p["router_bias"], model_cfg.moe)  # [N, E]
    routed = sum(
        combine[:, [e]] * swiglu(tokens, p["gate"][e], p["up"][e], p["down"][e]) for e in range(8)
    )
    shared = p["shared"]
    shared = swiglu(
        tokens, shared["gate"]["kernel"], shared["up"]["kernel"], shared["down"]["kernel"]
    )
    np.testing.assert_allclose(got.reshape(10, 16), routed + shared, rtol=1e-5, atol=1e-5)


def mlp_kinds(cfg):
    """Per block: 'moe' or the dense MLP's hidden width, read from the parameter shapes."""
    shapes = jax.eval_shape(
        kvlab.Transformer(cfg.model).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)
    )["params"]
    return [
        "moe" if "router" in mlp else mlp["gate"]["kernel"].shape[1]
        for mlp in (shapes[f"block_{i}"]["mlp"] for i in range(cfg.model.num_layers))
    ]


def test_dense_layers_before_first_dense_layers_and_between_every():
    cfg = tiny_config(num_layers=5)
    cfg.model.moe.update(num_experts=4, first_dense_layers=1)
    assert mlp_kinds(cfg) == [176, "moe", "moe", "moe", "moe"]
    cfg.model.moe.update(every=2)
    assert mlp_kinds(cfg) == [176, 176, "moe", 176, "moe"]
    assert [uses_experts(cfg.model, i) for i in range(5)] == [False, False, True, False, True]
    cfg.model.moe.update(first_dense_layers=5)
    assert mlp_kinds(cfg) == [176] * 5


def compiled_programs(cfg):
    """The lowered programs of init and of the plain forward: equal text, equal bits."""
    model, tokens = kvlab.Transformer(cfg.model), jnp.zeros((1, 6), jnp.int32)
    init = jax.jit(model.init).lower(jax.random.key(0), tokens)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return init.as_text(), jax.jit(model.apply).lower(variables, tokens).as_text()


def test_without_moe_layers_the_model_is_the_dense_one():
    dense = tiny_config(num_layers=1)
    assert mlp_kinds(dense) == [176]
    moe_off = tiny_config(num_layers=1)
    moe_off.model.moe.update(num_experts=4, first_dense_layers=1)  # experts, but no MoE layer
    assert compiled_programs(moe_off) == compiled_programs(dense)  # same params, same logits
    moe_off.model.moe.update(first_dense_layers=0)
    assert compiled_programs(moe_off) != compiled_programs(dense)


# -- The model through a cache ----------------------------------------------------------------


def moe_models():
    """One layer each, mixture of experts: the cache's side is the attention's."""
    gqa = tiny_config(num_kv_heads=2, num_layers=1)
    gqa.model.moe.update(num_experts=8, expert_dim=16, **ROUTERS["v2_group_limited"])
    mla = mla_config(absorb=True)
    mla.model.num_layers = 1
    mla.model.moe.update(num_experts=8, expert_dim=16, num_shared_experts=1, **ROUTERS["v3"])
    return {"gqa": gqa, "mla": mla}


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_cached_decode_equals_the_plain_forward(attention):
    cfg = moe_models()[attention]
    kvlab.config.validate_model_config(cfg.model)
    assert mlp_kinds(cfg) == ["moe"]
    model = kvlab.Transformer(cfg.model)
    params = random_params(model, jnp.zeros((1, 1), jnp.int32))  # MLA: a random bias too
    apply = jax.jit(model.apply)
    tokens = random_tokens(cfg, (2, 13))
    full, _ = apply({"params": params}, tokens[:, :12])

    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=12)
    # A prefill of 5 real tokens padded to 8 (the padding is routed too), then single tokens.
    logits, cache = apply(
        {"params": params}, tokens[:, :8], cache=cache, num_tokens=jnp.array([5, 5])
    )
    cached = [logits[:, :5]]
    for position in range(5, 12):
        logits, cache = apply({"params": params}, tokens[:, position : position + 1], cache=cache)
        cached.append(logits)
    cache.check()
    assert float(jnp.max(jnp.abs(jnp.concatenate(cached, axis=1) - full))) <= TOLERANCE


# -- Validation -------------------------------------------------------------------------------

BAD_FIELDS = [
    (dict(num_experts=-1), r"model.moe.num_experts=-1 is below 0"),
    (dict(expert_dim=True), r"model.moe.expert_dim=True is not an integer"),
    (dict(every=0), r"model.moe.every=0 is below 1"),
    (dict(routing="topk"), r"model.moe.routing='topk' is not supported: use one of 'softmax'"),
    (dict(routed_scale=float("nan")), r"model.moe.routed_scale=nan is not a finite number > 0"),
    (dict(normalize_weights=1), r"model.moe.normalize_weights=1 is not a bool"),
    (
        dict(experts_per_token=5),
        r"model.moe.experts_per_token=5 exceeds model.moe.num_experts=4: set "
        r"model.moe.experts_per_token <= 4",
    ),
    (
        dict(first_dense_layers=3),
        r"model.moe.first_dense_layers=3 exceeds model.num_layers=2: set",
    ),
    (
        dict(num_groups=3),
        r"model.moe.num_groups=3 does not divide model.moe.num_experts=4 into equal groups: "
        r"set model.moe.num_groups to one of \[1, 2, 4\]",
    ),
    (
        dict(num_groups=2, groups_per_token=3),
        r"model.moe.groups_per_token=3 exceeds model.moe.num_groups=2",
    ),
    (
        dict(num_groups=2, groups_per_token=1, experts_per_token=3),
        r"model.moe.experts_per_token=3 exceeds the 2 experts in model.moe.groups_per_token=1 "
        r"groups of 2: set model.moe.experts_per_token <= 2 or raise",
    ),
    (
        dict(routing="sigmoid", num_groups=4, groups_per_token=2),
        r"model.moe.num_groups=4 leaves one expert per group, but model.moe.routing='sigmoid' "
        r"scores a group by its two best experts",
    ),
]


@pytest.mark.parametrize("fields, message", BAD_FIELDS)
def test_bad_moe_fields_are_refused(fields, message):
    model = kvlab.base_config("tiny").model.to_dict()  # a dict takes values of any type
    model["moe"].update(num_experts=4)
    model["moe"].update(fields)
    with pytest.raises(ValueError, match=message):
        kvlab.config.validate_model_config(model)


def test_moe_section_is_completed_and_unknown_fields_refused():
    cfg = kvlab.base_config("tiny")
    del cfg.model.moe
    assert kvlab.validate_config(cfg).model.moe.num_experts == 0
    cfg.model.moe.num_expert = 4
    with pytest.raises(ValueError, match=r"model.moe.num_expert is not a kvlab config field"):
        kvlab.validate_config(cfg)
