"""Converting a trained model's attention to one that caches less.

    cfg, params = kvlab.checkpoints.to_gqa(cfg, params, num_kv_heads=2)

MHA -> GQA / MQA (GQA, arXiv:2305.13245): each group of consecutive KV heads
becomes one head whose key and value projections (and biases) are the mean of
the group's. Query head n reads KV head n // G, so the query heads that read a
group's heads before read the pooled head after. Pooling is exact when the
heads of each group are already equal; otherwise the converted model is a
starting point for uptraining (the paper uptrains with ~5% of pre-training
compute).

    cfg, params = kvlab.checkpoints.to_mla(cfg, params, kv_rank, rope_pairs=1,
                                           select="norm", tokens=calibration,
                                           factor="weights")

MHA / GQA -> latent attention (MHA2MLA, arXiv:2502.14837; TransMLA,
arXiv:2502.07864). Per source KV head, `rope_pairs` of its head_dim / 2 RoPE
frequency pairs keep their rotation (partial RoPE) and become that head's RoPE
key, cached as in DeepSeek's decoupled design but one per KV head
(`model.mla.rope_heads`, `model.mla.rope_pairs`). The other channels of every
key lose their rotation, and they and all values are factored jointly: the
[D, K (H - 2r) + K H] matrix of those key and value columns is split by its
SVD, U S V^T, into a down projection U_R S_R^(1/2) to a latent of width
`kv_rank` and up projections S_R^(1/2) V_R^T, each query head taking its KV
head's (`factor='weights'`, the best rank-kv_rank approximation of the weights;
`factor='activations'` instead minimizes the error of the keys and values
themselves over the calibration `tokens`' attention inputs x, by the SVD of
L^T W with E[x^T x] = L L^T, as activation-aware factorizations such as
SVD-LLM, arXiv:2403.07378, do). The latent has no norm
(`mla.latent_norm=False`): it is linear in x.
Per token and layer the cache holds kv_rank + K x 2r numbers instead of 2 K H.

Which pairs keep RoPE (`select`), as MHA2MLA compares them:
- 'norm': per KV head, the pairs whose query and key norms contribute most,
  mean ||q_pair|| x mean ||k_pair|| over the calibration `tokens` summed over
  the group's query heads (MHA2MLA's 2-norm choice);
- 'uniform': every (H/2 / r)-th pair from the first;
- 'high': the r highest frequencies (pairs 0..r-1);
- 'low': the r lowest.

What is exact: with every pair kept and kv_rank at the matrix's full rank
(min(D, K H)) the converted model computes the source's logits up to float
rounding; at full rank with fewer pairs it computes the source with the
dropped pairs unrotated. Below full rank the SVD is the best rank-kv_rank
approximation of the stacked weights, a starting point for uptraining.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from kvlab.config import check_count
from kvlab.data import make_dataset, validate_config
from kvlab.model import Transformer, unfuse_projections
from kvlab.rope import softmax_mscale

SELECTIONS = ("norm", "uniform", "high", "low")
FACTORS = ("weights", "activations")
CALIBRATION_WINDOWS = 16  # training windows that rank RoPE pairs for select='norm'


def parse_target(target: str) -> tuple[str, dict]:
    """('gqa', {num_kv_heads}) or ('mla', {kv_rank, rope_pairs, select, factor}) of
    a target 'gqa:N' or 'mla:R[,rope=P][,select=S][,factor=F]' (scripts/convert.py's
    --to, a sweep model entry's 'convert'); rope defaults to 1 pair, select to
    'norm', factor to 'weights'."""
    kind, _, value = target.partition(":")
    fields = value.split(",")
    usage = "pass gqa:N with N KV heads (e.g. gqa:1) or mla:R[,rope=P][,select=S][,factor=F]"
    if kind == "gqa" and len(fields) == 1 and fields[0].isdigit() and int(fields[0]) >= 1:
        return "gqa", {"num_kv_heads": int(fields[0])}
    if kind != "mla" or not fields[0].isdigit():
        raise ValueError(f"{target!r} is not a conversion: {usage}")
    options = {"kv_rank": int(fields[0]), "rope_pairs": 1, "select": "norm"}
    for field in fields[1:]:
        name, _, given = field.partition("=")
        if name == "rope" and given.isdigit():
            options["rope_pairs"] = int(given)
        elif name == "select" and given in SELECTIONS:
            options["select"] = given
        elif name == "factor" and given in FACTORS:
            options["factor"] = given
        else:
            raise ValueError(
                f"{target!r}: {field!r} is not an option of mla: pass rope=P (RoPE pairs "
                f"kept per KV head), select= one of {', '.join(SELECTIONS)} or factor= one "
                f"of {', '.join(FACTORS)}"
            )
    return "mla", options


def convert(
    cfg: ml_collections.ConfigDict,
    params: Mapping,
    target: str,
    calibration: int = CALIBRATION_WINDOWS,
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) converted as `target` (parse_target) says. select='norm'
    ranks RoPE pairs over `calibration` windows of the training split of
    `cfg.data` (the source's own text and tokenizer), drawn as training step 0."""
    kind, options = parse_target(target)
    if kind == "gqa":
        return to_gqa(cfg, params, **options)
    if options["select"] == "norm" or options.get("factor") == "activations":
        data = make_dataset(cfg.data, "train", cfg.train.seq_len)
        count = check_count("calibration", calibration)
        options["tokens"] = data.batch(0, count, cfg.train.seed)["inputs"]
    return to_mla(cfg, params, **options)


def to_gqa(
    cfg: ml_collections.ConfigDict, params: Mapping, num_kv_heads: int
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of the same model with `num_kv_heads` KV heads, pooled by mean.

    The source must use grouped-query attention with a multiple of
    `num_kv_heads` KV heads; the config is copied, never changed in place.
    """
    num_kv_heads = check_count("num_kv_heads", num_kv_heads)
    params = unfuse_projections(params)
    source = cfg.model
    if source.attention != "gqa":
        raise ValueError(
            f"model.attention={source.attention!r}: to_gqa pools the KV heads of "
            "grouped-query attention; convert a model with model.attention='gqa'"
        )
    if source.num_kv_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} does not divide the source's model.num_kv_heads="
            f"{source.num_kv_heads}: pick a divisor (1 = MQA)"
        )
    ratio = source.num_kv_heads // num_kv_heads
    converted = cfg.copy_and_resolve_references()
    converted.model.num_kv_heads = num_kv_heads
    validate_config(converted)

    def pool(path, leaf):
        names = [getattr(key, "key", None) for key in path]
        if "attention" not in names or not {"key", "value"} & set(names):
            return leaf
        # kernel [D, K, H] or bias [K, H]: the head axis is second to last
        heads = leaf.shape[:-2] + (num_kv_heads, ratio) + leaf.shape[-1:]
        return leaf.reshape(heads).mean(axis=-2, dtype="float32").astype(leaf.dtype)

    return converted, jax.tree_util.tree_map_with_path(pool, dict(params))


def to_mla(
    cfg: ml_collections.ConfigDict,
    params: Mapping,
    kv_rank: int,
    rope_pairs: int = 1,
    select: str = "norm",
    tokens=None,
    factor: str = "weights",
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of the model with latent attention (module docstring).

    The source uses grouped-query attention without biases, q/k norms or a
    softmax mscale; `tokens` int32[B, T] are the calibration batch that
    select='norm' and factor='activations' need.
    """
    params = unfuse_projections(params)
    source = cfg.model
    kv_rank = check_count("kv_rank", kv_rank)
    half = source.head_dim // 2
    rope_pairs = check_count("rope_pairs", rope_pairs)
    if rope_pairs > half:
        raise ValueError(
            f"rope_pairs={rope_pairs}: a head of model.head_dim={source.head_dim} has "
            f"{half} RoPE pairs; keep 1..{half}"
        )
    if select not in SELECTIONS:
        raise ValueError(f"select={select!r} is not a choice: use one of {SELECTIONS}")
    if factor not in FACTORS:
        raise ValueError(f"factor={factor!r} is not a choice: use one of {FACTORS}")
    calibrated = select == "norm" or factor == "activations"
    if calibrated and tokens is None:
        raise ValueError(
            f"select={select!r} with factor={factor!r} needs calibration tokens: pass "
            "tokens=int32[B, T] (or select 'uniform', 'high' or 'low' with factor 'weights')"
        )
    if tokens is not None and not calibrated:
        raise ValueError(
            f"tokens are for select='norm' or factor='activations'; select={select!r} with "
            f"factor={factor!r} takes none"
        )
    _check_source(source)
    heads, kv_heads, width = source.num_heads, source.num_kv_heads, source.head_dim
    full_rank = min(source.embed_dim, kv_heads * (2 * width - 2 * rope_pairs))
    if kv_rank > full_rank:
        raise ValueError(
            f"kv_rank={kv_rank} exceeds the full rank {full_rank} of the stacked key and value "
            f"projections (min of model.embed_dim={source.embed_dim} and their "
            f"{kv_heads * (2 * width - 2 * rope_pairs)} columns): pass at most {full_rank}"
        )
    captured = _calibration(cfg, params, tokens) if calibrated else None
    kept = _kept_pairs(cfg, rope_pairs, select, captured)  # [L, K, r]

    converted = cfg.copy_and_resolve_references()
    model = converted.model
    model.attention = "mla"
    model.num_kv_heads = heads
    model.mla.update(
        kv_rank=kv_rank,
        q_rank=0,
        rope_dim=2 * rope_pairs,
        nope_dim=width - 2 * rope_pairs,
        v_head_dim=width,
        latent_norm=False,
        rope_heads=kv_heads,
        rope_pairs=tuple(tuple(tuple(int(i) for i in head) for head in layer) for layer in kept),
    )
    validate_config(converted)
    params = dict(params)
    for i in range(source.num_layers):
        block = dict(params[f"block_{i}"])
        # E[x^T x] of the layer's attention input, which the factorization weighs by
        inputs = None if factor == "weights" else _second_moment(captured[f"block_{i}"])
        block["attention"] = _latent_attention(block["attention"], kept[i], kv_rank, heads, inputs)
        params[f"block_{i}"] = block
    return converted, params


def _check_source(source) -> None:
    if source.attention != "gqa":
        raise ValueError(
            f"model.attention={source.attention!r}: to_mla converts grouped-query attention "
            "(MHA, GQA, MQA); the source is latent already"
        )
    if source.topology != "layerwise":
        raise ValueError(
            f"model.topology={source.topology!r}: to_mla factors each layer's own key and value "
            "projections, which layers sharing a cache layer lack; convert a layerwise model"
        )
    for name in ("qkv_bias", "qk_norm"):
        if source[name]:
            raise ValueError(
                f"model.{name}=True: to_mla factors bias-free, unnormed key projections "
                "(kvlab's latent attention has neither); convert a model without them"
            )
    if softmax_mscale(source.rope_scaling) != 1.0:
        raise ValueError(
            "model.rope_scaling.mscale_all_dim is set: latent attention would scale its "
            "softmax by it where the source does not; set it to 0 before converting"
        )


def _rope_channels(pairs: np.ndarray, width: int) -> np.ndarray:
    """The channels of RoPE pairs `pairs` in a head of `width`, as [first halves, second halves]."""
    return np.concatenate([pairs, pairs + width // 2])


def _nope_channels(pairs: np.ndarray, width: int) -> np.ndarray:
    """The channels of a head of `width` outside the kept pairs, in order."""
    return np.setdiff1d(np.arange(width), _rope_channels(pairs, width))


def _kept_pairs(cfg, count: int, select: str, captured) -> np.ndarray:
    """int[L, K, count]: the RoPE pairs each layer's KV heads keep, sorted."""
    model = cfg.model
    layers, kv_heads, half = model.num_layers, model.num_kv_heads, model.head_dim // 2
    if select != "norm":
        pairs = {
            "high": np.arange(count),
            "low": np.arange(half - count, half),
            "uniform": np.arange(count) * half // count,
        }[select]
        return np.broadcast_to(pairs, (layers, kv_heads, count))
    contribution = _pair_contributions(cfg, captured)  # [L, K, H/2]
    # The `count` largest, sorted by pair index; ties go to the higher frequency.
    ranked = np.argsort(-contribution, axis=-1, kind="stable")[..., :count]
    return np.sort(ranked, axis=-1)


def _calibration(cfg, params, tokens) -> Mapping:
    """What the source computes on the calibration `tokens`, per block: its
    attention input (`attention_norm`) and its queries and keys before RoPE."""
    names = ("attention_norm", "query", "key")
    _, variables = Transformer(cfg.model).apply(
        {"params": params},
        jnp.asarray(tokens),
        capture_intermediates=lambda module, _: module.name in names,
        mutable=["intermediates"],
    )
    return variables["intermediates"]


def _second_moment(block: Mapping) -> np.ndarray:
    """float64[D, D]: E[x^T x] over the calibration tokens of a block's attention input."""
    x = np.asarray(block["attention_norm"]["__call__"][0], np.float64)
    x = x.reshape(-1, x.shape[-1])
    return x.T @ x / len(x)


def _pair_contributions(cfg, captured: Mapping) -> np.ndarray:
    """float[L, K, H/2]: per layer, KV head and RoPE pair, the mean norm of the
    pair in the keys times that in the queries, summed over the group's queries.

    Norms are taken before RoPE (a rotation keeps a pair's norm)."""
    model = cfg.model
    half, kv_heads = model.head_dim // 2, model.num_kv_heads
    contributions = []
    for i in range(model.num_layers):
        attention = captured[f"block_{i}"]["attention"]
        norms = {}
        for name in ("query", "key"):
            x = np.asarray(attention[name]["__call__"][0], np.float64)  # [B, T, heads, H]
            pair_norm = np.hypot(x[..., :half], x[..., half:])  # [B, T, heads, H/2]
            norms[name] = pair_norm.mean(axis=(0, 1))  # [heads, H/2]
        query = norms["query"].reshape(kv_heads, -1, half).sum(axis=1)  # [K, H/2]
        contributions.append(query * norms["key"])
    return np.stack(contributions)


def _factorize(matrix: np.ndarray, rank: int, inputs: np.ndarray | None) -> tuple:
    """(down [D, R], up [R, C]) with down @ up the rank-R matrix closest to
    `matrix` [D, C]: in Frobenius norm, or with `inputs` = E[x^T x] = L L^T in
    the expected error of x @ matrix, E||x (matrix - down up)||^2 = ||L^T (matrix
    - down up)||^2: the SVD of L^T matrix, mapped back through L^-T. The
    singular values are split evenly between the two."""
    if inputs is None:
        u, singular, vt = np.linalg.svd(matrix, full_matrices=False)
        root = np.sqrt(singular[:rank])
        return u[:, :rank] * root, root[:, None] * vt[:rank]
    # A small ridge keeps L invertible where the calibration never reached a direction.
    ridge = 1e-6 * np.trace(inputs) / len(inputs) + np.finfo(np.float64).tiny
    lower = np.linalg.cholesky(inputs + ridge * np.eye(len(inputs)))
    u, singular, vt = np.linalg.svd(lower.T @ matrix, full_matrices=False)
    root = np.sqrt(singular[:rank])
    down = np.linalg.solve(lower.T, u[:, :rank] * root)
    return down, root[:, None] * vt[:rank]


def _latent_attention(
    attention: Mapping, kept: np.ndarray, rank: int, heads: int, inputs: np.ndarray | None
) -> dict:
    """A grouped-query layer's params as latent attention's (module docstring);
    `inputs` is E[x^T x] of the layer's input for factor='activations'."""
    query, key, value = (attention[name]["kernel"] for name in ("query", "key", "value"))
    dtype = query.dtype
    embed, kv_heads, width = key.shape
    group = heads // kv_heads
    key64, value64 = np.asarray(key, np.float64), np.asarray(value, np.float64)
    rope = [_rope_channels(pairs, width) for pairs in kept]
    nope = [_nope_channels(pairs, width) for pairs in kept]
    # [D, K (H - 2r) + K H]: the no-position key columns of every KV head, then the values
    stacked = np.concatenate(
        [np.concatenate([key64[:, k, nope[k]] for k in range(kv_heads)], axis=1)]
        + [value64.reshape(embed, -1)],
        axis=1,
    )
    down, up = _factorize(stacked, rank, inputs)  # [D, R], [R, K (H - 2r) + K H]
    nope_width = width - rope[0].size
    key_up = up[:, : kv_heads * nope_width].reshape(rank, kv_heads, nope_width)
    value_up = up[:, kv_heads * nope_width :].reshape(rank, kv_heads, width)
    # Query head n reads KV head n // group: its channels reordered as [nope | rope].
    query64 = np.asarray(query, np.float64)
    order = [np.concatenate([nope[n // group], rope[n // group]]) for n in range(heads)]
    new_query = np.stack([query64[:, n, order[n]] for n in range(heads)], axis=1)
    key_rope = np.stack([key64[:, k, rope[k]] for k in range(kv_heads)], axis=1)  # [D, K, 2r]

    def cast(x):
        return jnp.asarray(x, dtype)

    converted = {
        "query": {"kernel": cast(new_query)},
        "kv_down": {"kernel": cast(down)},
        "key_rope": {"kernel": cast(key_rope)},
        "value_up": cast(np.repeat(value_up, group, axis=1)),
        "out": attention["out"],
    }
    if nope_width:  # every pair kept: no key part in the latent
        converted["key_up"] = cast(np.repeat(key_up, group, axis=1))
    return converted
