"""Checkpoint tensors <-> kvlab parameters: names, shapes and layouts.

    links = tensor_links(cfg.model)            # every tensor of the model, in order
    link.to_kvlab(*checkpoint_arrays) -> parameter arrays; link.to_hf(*parameters) -> tensors

A checkpoint is a folder as `save_pretrained` writes it: config.json and the
weights in model.safetensors, or in shards named by model.safetensors.index.json.
transformers stores a linear map as weight [out, in]; kvlab's kernels are
[in..., out...] (axis letters: docs/architecture.md):

    embed_tokens [V, D]                   -> embed/embedding [V, D]
    q_proj [N*H, D], k_proj/v_proj [K*H, D] -> attention/{query,key,value}/kernel [D, N|K, H]
    q/k/v_proj.bias [N*H], [K*H]          -> attention/{query,key,value}/bias [N|K, H]
    q_norm, k_norm [H]                    -> attention/{query,key}_norm/scale [H]
    o_proj [D, N*H]                       -> attention/out/kernel [N, H, D]
    gate_proj, up_proj [F, D], down_proj [D, F] -> mlp/{gate,up,down}/kernel [D, F], [F, D]
    input_layernorm, post_attention_layernorm [D] -> attention_norm, mlp_norm/scale
    norm [D], lm_head [V, D]              -> final_norm/scale, unembed/kernel [D, V]

DeepSeek's latent attention (R = kv_lora_rank, Hr = qk_rope_head_dim):

    q_proj or q_b_proj [N*(nope+Hr), D|q_rank] rows per head [nope; rope]
                                          -> query or query_up/kernel [D|q_rank, N, nope+Hr]
    q_a_proj [q_rank, D], q_a_layernorm   -> query_down/kernel, query_norm/scale
    kv_a_proj_with_mqa [R+Hr, D] rows [latent; rope key]
                                          -> kv_down/kernel [D, R], key_rope/kernel [D, 1, Hr]
    kv_a_layernorm [R]                    -> kv_norm/scale
    kv_b_proj [N*(nope+Hv), R] rows per head [nope key; value]
                                          -> key_up [R, N, nope], value_up [R, N, Hv]
    mlp.gate [E, D] (+ e_score_correction_bias [E])  -> mlp/router/kernel [D, E] (+ router_bias)
    mlp.experts.e.{gate,up,down}_proj     -> mlp/{gate,up,down} [E, D, F], [E, F, D]
    mlp.shared_experts.*                  -> mlp/shared/*

DeepSeek rotates interleaved channel pairs (2j, 2j+1); kvlab rotates halves
(j, j + Hr/2), as Llama does. Each RoPE block (a query head's rope part, the
shared rope key) is reordered [0, 2, 4, ..., 1, 3, 5, ...] on import and back
on export; q . k is unchanged because queries and keys move alike. (DeepSeek-V3
with rope_interleave=false is already in halves and is not reordered.) The
layouts are transposes, reshapes and permutations: nothing is rounded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import ml_collections
import numpy as np
from flax import traverse_util

from kvlab.model import init_params
from kvlab.moe import uses_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorLink:
    """Checkpoint tensors <-> kvlab parameters, and how values move between them."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # checkpoint names and shapes
    params: tuple[tuple[str, ...], ...]  # kvlab parameter paths
    to_kvlab: Callable[..., tuple[np.ndarray, ...]]  # checkpoint arrays -> parameter arrays
    to_hf: Callable[..., tuple[np.ndarray, ...]]  # parameter arrays -> checkpoint arrays


def _same(name: str, path: tuple, shape: tuple) -> TensorLink:
    """A tensor kvlab keeps as it is (norm scales, the embedding, a router bias)."""
    return TensorLink(((name, shape),), (path,), lambda w: (w,), lambda p: (p,))


def _flat(name: str, path: tuple, shape: tuple) -> TensorLink:
    """A bias [N*H] kept per head [N, H]."""
    return TensorLink(
        ((name, (math.prod(shape),)),),
        (path,),
        lambda w: (w.reshape(shape),),
        lambda p: (p.reshape(-1),),
    )


def _halves_order(width: int, rope: int) -> np.ndarray:
    """kvlab channel j takes checkpoint channel order[j]: the last `rope` channels
    go from interleaved pairs to halves ([0, 2, 4, ..., 1, 3, 5, ...]), the rest stay."""
    start = width - rope
    return np.concatenate(
        [np.arange(start), start + np.arange(0, rope, 2), start + np.arange(1, rope, 2)]
    )


def _linear(
    name: str, path: tuple, kernel_shape: tuple, inputs: int = 1, rope: int = 0
) -> TensorLink:
    """nn.Linear weight [out, in] <-> kernel [in..., out...] (`inputs` leading axes
    are the input); `rope` > 0 reorders the last rope channels of every output group."""
    fan_in, fan_out = math.prod(kernel_shape[:inputs]), math.prod(kernel_shape[inputs:])
    order = _halves_order(kernel_shape[-1], rope)
    inverse = np.argsort(order)

    def to_kvlab(w):
        return (w.T.reshape(kernel_shape)[..., order],)

    def to_hf(kernel):
        return (kernel[..., inverse].reshape(fan_in, fan_out).T,)

    return TensorLink(((name, (fan_out, fan_in)),), (path,), to_kvlab, to_hf)


def _latent_and_rope_key(name: str, path: tuple, model, rope: int) -> TensorLink:
    """kv_a_proj_with_mqa [R + Hr, D], rows [latent; rope key] <-> kv_down/kernel
    [D, R] and key_rope/kernel [D, 1, Hr]."""
    rank, rope_dim = model.mla.kv_rank, model.mla.rope_dim
    order = _halves_order(rope_dim, rope)
    inverse = np.argsort(order)

    def to_kvlab(w):
        return w[:rank].T, w[rank:].T[:, None, order]

    def to_hf(kv_down, key_rope):
        return (np.concatenate([kv_down.T, key_rope[:, 0, inverse].T]),)

    return TensorLink(
        ((name, (rank + rope_dim, model.embed_dim)),),
        ((*path, "kv_down", "kernel"), (*path, "key_rope", "kernel")),
        to_kvlab,
        to_hf,
    )


def _key_value_up(name: str, path: tuple, model) -> TensorLink:
    """kv_b_proj [N * (nope + Hv), R], rows per head [nope key; value] <->
    key_up [R, N, nope] and value_up [R, N, Hv]."""
    heads, mla = model.num_heads, model.mla
    rank, nope, value = mla.kv_rank, mla.nope_dim, mla.v_head_dim

    def to_kvlab(w):
        w = w.reshape(heads, nope + value, rank).transpose(2, 0, 1)  # [R, N, nope + Hv]
        return w[..., :nope], w[..., nope:]

    def to_hf(key_up, value_up):
        w = np.concatenate([key_up, value_up], axis=-1)  # [R, N, nope + Hv]
        return (w.transpose(1, 2, 0).reshape(heads * (nope + value), rank),)

    return TensorLink(
        ((name, (heads * (nope + value), rank)),),
        ((*path, "key_up"), (*path, "value_up")),
        to_kvlab,
        to_hf,
    )


def _experts(names: Sequence[str], path: tuple, shape: tuple) -> TensorLink:
    """One weight [out, in] per expert <-> the experts' kernels stacked [E, in, out]."""
    fan_in, fan_out = shape
    return TensorLink(
        tuple((name, (fan_out, fan_in)) for name in names),
        (path,),
        lambda *ws: (np.stack([w.T for w in ws]),),
        lambda stacked: tuple(kernel.T for kernel in stacked),
    )


def _mlp(prefix: str, path: tuple, embed_dim: int, hidden_dim: int) -> list[TensorLink]:
    return [
        _linear(prefix + "gate_proj.weight", (*path, "gate", "kernel"), (embed_dim, hidden_dim)),
        _linear(prefix + "up_proj.weight", (*path, "up", "kernel"), (embed_dim, hidden_dim)),
        _linear(prefix + "down_proj.weight", (*path, "down", "kernel"), (hidden_dim, embed_dim)),
    ]


def _grouped_attention(prefix: str, path: tuple, model) -> list[TensorLink]:
    embed, heads, kv_heads, width = (
        model.embed_dim,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
    )
    shapes = {"q": (heads, width), "k": (kv_heads, width), "v": (kv_heads, width)}
    names = {"q": "query", "k": "key", "v": "value"}
    links = [
        _linear(f"{prefix}{x}_proj.weight", (*path, names[x], "kernel"), (embed, *shapes[x]))
        for x in "qkv"
    ]
    links.append(
        _linear(prefix + "o_proj.weight", (*path, "out", "kernel"), (heads, width, embed), 2)
    )
    if model.qkv_bias:
        links += [
            _flat(f"{prefix}{x}_proj.bias", (*path, names[x], "bias"), shapes[x]) for x in "qkv"
        ]
    if model.qk_norm:
        links += [
            _same(f"{prefix}{x}_norm.weight", (*path, f"{names[x]}_norm", "scale"), (width,))
            for x in "qk"
        ]
    return links


def _latent_attention(prefix: str, path: tuple, model, interleaved: bool) -> list[TensorLink]:
    mla, heads, embed = model.mla, model.num_heads, model.embed_dim
    rope = mla.rope_dim if interleaved else 0
    width = mla.nope_dim + mla.rope_dim
    if mla.q_rank:
        links = [
            _linear(
                prefix + "q_a_proj.weight", (*path, "query_down", "kernel"), (embed, mla.q_rank)
            ),
            _same(prefix + "q_a_layernorm.weight", (*path, "query_norm", "scale"), (mla.q_rank,)),
            _linear(
                prefix + "q_b_proj.weight",
                (*path, "query_up", "kernel"),
                (mla.q_rank, heads, width),
                rope=rope,
            ),
        ]
    else:
        links = [
            _linear(
                prefix + "q_proj.weight",
                (*path, "query", "kernel"),
                (embed, heads, width),
                rope=rope,
            )
        ]
    return links + [
        _latent_and_rope_key(prefix + "kv_a_proj_with_mqa.weight", path, model, rope),
        _same(prefix + "kv_a_layernorm.weight", (*path, "kv_norm", "scale"), (mla.kv_rank,)),
        _key_value_up(prefix + "kv_b_proj.weight", path, model),
        _linear(
            prefix + "o_proj.weight", (*path, "out", "kernel"), (heads, mla.v_head_dim, embed), 2
        ),
    ]


def _feed_forward(prefix: str, path: tuple, model, index: int) -> list[TensorLink]:
    embed = model.embed_dim
    if not uses_experts(model, index):
        return _mlp(prefix, path, embed, model.mlp_dim)
    moe = model.moe
    num_experts, width = moe.num_experts, moe.expert_dim
    links = [_linear(prefix + "gate.weight", (*path, "router", "kernel"), (embed, num_experts))]
    if moe.routing == "sigmoid":
        links.append(
            _same(prefix + "gate.e_score_correction_bias", (*path, "router_bias"), (num_experts,))
        )
    for hf_name, name, shape in (
        ("gate_proj", "gate", (embed, width)),
        ("up_proj", "up", (embed, width)),
        ("down_proj", "down", (width, embed)),
    ):
        names = [f"{prefix}experts.{e}.{hf_name}.weight" for e in range(num_experts)]
        links.append(_experts(names, (*path, name), shape))
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * width
        links += _mlp(prefix + "shared_experts.", (*path, "shared"), embed, shared)
    return links


def tensor_links(model, interleaved: bool = True) -> list[TensorLink]:
    """Every checkpoint tensor of `model` and the kvlab parameters it holds (load_hf,
    save_hf and kvlab.checkpoints.gguf map tensors through these)."""
    vocab, embed = model.vocab_size, model.embed_dim
    links = [_same("model.embed_tokens.weight", ("embed", "embedding"), (vocab, embed))]
    for i in range(model.num_layers):
        prefix, block = f"model.layers.{i}.", f"block_{i}"
        links += [
            _same(prefix + "input_layernorm.weight", (block, "attention_norm", "scale"), (embed,)),
            _same(
                prefix + "post_attention_layernorm.weight", (block, "mlp_norm", "scale"), (embed,)
            ),
        ]
        attention = (prefix + "self_attn.", (block, "attention"), model)
        if model.attention == "mla":
            links += _latent_attention(*attention, interleaved)
        else:
            links += _grouped_attention(*attention)
        links += _feed_forward(prefix + "mlp.", (block, "mlp"), model, i)
    links.append(_same("model.norm.weight", ("final_norm", "scale"), (embed,)))
    if not model.tie_embeddings:
        links.append(_linear("lm_head.weight", ("unembed", "kernel"), (embed, vocab)))
    return links


@functools.lru_cache(maxsize=16)
def _expected_shapes(model) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every parameter path of Transformer(model) and its shape (nothing allocated)."""
    shapes = jax.eval_shape(functools.partial(init_params, model), jax.random.key(0))
    return {path: tuple(x.shape) for path, x in traverse_util.flatten_dict(shapes).items()}


def check_params(shapes: Mapping[tuple, tuple], model, what: str) -> None:
    """Refuses parameters that are not exactly Transformer(model)'s, naming the first
    path that is missing, extra or of another shape."""
    expected = _expected_shapes(ml_collections.FrozenConfigDict(model))
    for path, shape in expected.items():
        name = "/".join(path)
        if path not in shapes:
            raise ValueError(
                f"{what} has no parameter {name} of shape {shape}, which the model needs"
            )
        if tuple(shapes[path]) != shape:
            raise ValueError(
                f"parameter {name} of {what} has shape {tuple(shapes[path])} but the model's "
                f"config gives {shape}"
            )
    extra = sorted("/".join(path) for path in set(shapes) - set(expected))
    if extra:
        raise ValueError(
            f"{what} has parameters the model does not use: {', '.join(extra[:5])}: pass the "
            "params of kvlab.Transformer(cfg.model) for this config"
        )
