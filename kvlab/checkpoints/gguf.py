"""llama.cpp's GGUF files (Llama architecture) into kvlab.

    cfg, params, tokenizer = kvlab.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=None)
    ids = tokenizer.encode("The KV cache")          # kvlab.data.tokenizer.Tokenizer

The file is read with the `gguf` package (llama.cpp's own Python reader; the
optional extra `kvlab[real]`): its metadata through `GGUFReader`, its tensors
dequantized by `gguf.quants.dequantize`, tensor names through the package's
HF <-> GGUF name map. Nothing here decodes the format by hand.

What is read (keys as llama.cpp writes them; `llama.` is general.architecture):

    llama.block_count, embedding_length, feed_forward_length    -> num_layers, embed_dim, mlp_dim
    llama.attention.head_count, head_count_kv, key_length       -> num_heads, num_kv_heads, head_dim
    llama.rope.freq_base, rope.dimension_count (= head_dim)     -> rope_theta
    llama.rope.scaling.type none | linear (+ scaling.factor)    -> rope_scaling
    llama.attention.layer_norm_rms_epsilon                      -> norm_eps
    tokenizer.ggml.tokens (its length)                          -> vocab_size
    no output.weight                                            -> tie_embeddings
    tokenizer.ggml.{model, pre, tokens, merges, token_type, eos_token_id} -> the tokenizer

llama.context_length is not read: kvlab has no position limit and plain RoPE
does not depend on it. Architectures other than 'llama', experts, sliding
windows, partial rotary dimensions, other RoPE scalings and Llama 3.1's
rope_freqs tensor are refused by name.

Tensors. GGUF lists a tensor's dimensions fastest first (ne0 = in); the reader
returns numpy arrays [out, in], the rows transformers stores, so each tensor is
the HF tensor of the same role (the package's name map: blk.N.attn_q.weight <->
model.layers.N.self_attn.q_proj.weight, token_embd <-> embed_tokens, output <->
lm_head, ...) and kvlab's HF layouts (kvlab/checkpoints/hf/layouts.py) place
it. Types read: F32, F16, Q8_0 and Q4_1, dequantized to float32 and then cast
to model.param_dtype.

RoPE rows. llama.cpp's converter reorders the rows of attn_q and attn_k so
that ggml rotates interleaved pairs: for each head (n_head for Q, n_head_kv
for K) the rows [first half; second half] (transformers' rotate_half) become
(0, H/2), (1, H/2 + 1), ...:

    gguf = hf.reshape(n, 2, H/2, D).swapaxes(1, 2).reshape(n * H, D)

`unpermute_rope_rows` inverts it exactly (a reshape and a swap, nothing rounded).

The tokenizer. `tokenizer.ggml.model == 'gpt2'` is GPT-2 style byte-level BPE:
a `tokenizers` BPE over the token list and merges ('a b' strings), with the
byte-level pre-tokenizer of `tokenizer.ggml.pre` ('gpt-2' / 'default': GPT-2's
split; 'smollm', 'starcoder', 'refact': digits one by one first, as llama.cpp
splits them) and the byte-level decoder. Control tokens (token_type 3) are
special added tokens, user-defined ones (4) plain added tokens, so
"<|im_start|>" in text is one id, as in llama.cpp and transformers. Other
tokenizer models (SentencePiece 'llama', ...) and pre-tokenizers are refused.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
import numpy as np
import tokenizers

from kvlab.checkpoints.hf import dtype_name, imported_params, refuse_nonfinite, tensor_links
from kvlab.config import base_config
from kvlab.data import Tokenizer, validate_config

ARCHITECTURE = "llama"
# Tensor types kvlab dequantizes (through gguf.quants.dequantize).
TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_1")
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's byte-level split
# (llama.cpp's pre-tokenizer regexes for these names).
PRE_TOKENIZERS = {
    "default": False,
    "gpt-2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values that become added tokens
_INSTALL = "install the gguf package: pip install 'kvlab[real]' (or pip install gguf)"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"kvlab.load_gguf reads GGUF files with the gguf package: {_INSTALL}"
        ) from None
    return gguf


class _Metadata:
    """A GGUF file's key-value metadata; problems are reported naming the file and the key."""

    def __init__(self, reader, file: str, float32):
        self.reader, self.file, self.float32 = reader, file, float32
        self.architecture = None
        self.architecture = self.get("general.architecture")

    def __contains__(self, key: str) -> bool:
        return key.format(arch=self.architecture) in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` ('{arch}' is general.architecture); `default` when absent."""
        field = self.reader.fields.get(key.format(arch=self.architecture))
        if field is None:
            return default
        value = field.contents()
        if field.types == [self.float32]:
            # the shortest decimal of the stored float32 (1e-05, not 9.999999747378752e-06)
            value = float(str(np.float32(value)))
        return value

    def refuse(self, key: str, value: Any, problem: str, fix: str) -> None:
        raise ValueError(
            f"{self.file}: {key.format(arch=self.architecture)}={value!r} {problem}: {fix}"
        )

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(
                f"{self.file} has no {key.format(arch=self.architecture)}: a "
                f"{self.architecture} GGUF file sets it; the file is incomplete"
            )
        return value

    def count(self, key: str, default: int | None = None) -> int:
        """An integer >= 1; required unless a default is given."""
        value = self.get(key, default) if default is not None else self.required(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.refuse(
                key,
                value,
                "is not a count (one integer >= 1)",
                "kvlab reads one value for every layer; per-layer lists are not supported",
            )
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """A finite number > 0; required unless a default is given."""
        value = self.get(key, default) if default is not None else self.required(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < np.inf:
            self.refuse(key, value, "is not a finite number > 0", "the file is damaged")
        return float(value)


def _dtype_name(dtype: Any) -> str:
    """The config dtype name: `dtype` if given, else float32 (what dequantization gives)."""
    return dtype_name(dtype, "float32", "float32")


def _model_section(meta: _Metadata, tensors: set[str], dtype: str) -> ml_collections.ConfigDict:
    """kvlab's model section for the file's metadata, key by key."""
    _check_architecture(meta)
    heads = meta.count("{arch}.attention.head_count")
    embed_dim = meta.count("{arch}.embedding_length")
    head_dim = _head_dim(meta, heads, embed_dim)
    model = base_config().model
    model.rope_scaling.update(_rope_scaling(meta, tensors))
    model.update(
        attention="gqa",
        vocab_size=_vocab_size(meta),
        num_layers=meta.count("{arch}.block_count"),
        embed_dim=embed_dim,
        num_heads=heads,
        num_kv_heads=meta.count("{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        mlp_dim=meta.count("{arch}.feed_forward_length"),
        rope_theta=meta.number("{arch}.rope.freq_base", 10_000.0),
        norm_eps=meta.number("{arch}.attention.layer_norm_rms_epsilon"),
        tie_embeddings="output.weight" not in tensors,
        dtype=dtype,
        param_dtype=dtype,
    )
    return model


def _check_architecture(meta: _Metadata) -> None:
    """Refuses architectures other than llama, experts and sliding windows."""
    if meta.architecture != ARCHITECTURE:
        meta.refuse(
            "general.architecture",
            meta.architecture,
            "is not an architecture kvlab reads from GGUF",
            f"load_gguf reads {ARCHITECTURE!r} files (Llama, SmolLM, Mistral without a window); "
            "for other families convert the Hugging Face checkpoint and use kvlab.load_hf",
        )
    for key, problem in (
        ("{arch}.expert_count", "makes the feed-forward a mixture of experts"),
        ("{arch}.attention.sliding_window", "limits attention to a window"),
    ):
        if meta.get(key, 0):
            meta.refuse(key, meta.get(key), problem, "kvlab's GGUF import reads dense Llama models")


def _head_dim(meta: _Metadata, heads: int, embed_dim: int) -> int:
    """model.head_dim: key_length, equal to value_length and rotated whole."""
    if "{arch}.attention.key_length" not in meta and embed_dim % heads:
        meta.refuse(
            "{arch}.embedding_length",
            embed_dim,
            f"is not a multiple of attention.head_count={heads} and there is no key_length",
            "the file is damaged",
        )
    head_dim = meta.count("{arch}.attention.key_length", embed_dim // heads)
    value_dim = meta.count("{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        meta.refuse(
            "{arch}.attention.value_length",
            value_dim,
            f"differs from key_length={head_dim}",
            "kvlab's grouped attention has one head_dim for keys and values",
        )
    rotated = meta.count("{arch}.rope.dimension_count", head_dim)
    if rotated != head_dim:
        meta.refuse(
            "{arch}.rope.dimension_count",
            rotated,
            f"rotates only part of each head (head_dim={head_dim})",
            "kvlab rotates whole heads",
        )
    return head_dim


def _rope_scaling(meta: _Metadata, tensors: set[str]) -> dict:
    """model.rope_scaling's fields: none or linear; Llama 3.1's rope_freqs is refused."""
    scaling = meta.get("{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        meta.refuse(
            "{arch}.rope.scaling.type",
            scaling,
            "is a RoPE scaling kvlab does not read from GGUF",
            "load_gguf reads 'none' and 'linear'; load the Hugging Face checkpoint with "
            "kvlab.load_hf for llama3 or yarn scaling",
        )
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{meta.file} holds rope_freqs.weight (Llama 3.1's RoPE scaling baked into "
            "per-frequency factors): kvlab does not read it from GGUF; load the Hugging Face "
            "checkpoint with kvlab.load_hf (rope_scaling llama3)"
        )
    if scaling == "linear":
        return {"type": "linear", "factor": meta.number("{arch}.rope.scaling.factor")}
    return {}


def _vocab_size(meta: _Metadata) -> int:
    """The length of tokenizer.ggml.tokens, which {arch}.vocab_size must equal if given."""
    vocab_size = len(meta.required("tokenizer.ggml.tokens"))
    stated = meta.get("{arch}.vocab_size", vocab_size)
    if stated != vocab_size:
        meta.refuse(
            "{arch}.vocab_size",
            stated,
            f"differs from the {vocab_size} tokens of tokenizer.ggml.tokens",
            "the file is damaged",
        )
    return vocab_size


# ---------------------------------------------------------------------------
# Tensors


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [first half; second half] -> interleaved
    pairs. weight [num_heads * H, D] -> [num_heads * H, D]."""
    rows = weight.shape[0]
    # [num_heads, 2, H/2, D] -> [num_heads, H/2, 2, D]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `permute_rope_rows`: GGUF's attn_q / attn_k rows back to
    transformers' (and kvlab's) halves. weight [num_heads * H, D]."""
    rows = weight.shape[0]
    # [num_heads, H/2, 2, D] -> [num_heads, 2, H/2, D]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize(gguf, tensor, file: str) -> np.ndarray:
    """float32 [out, in] (numpy's order: the reverse of GGUF's dimension list)."""
    kind = tensor.tensor_type.name
    if kind not in TENSOR_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} in {file} is stored as {kind}: kvlab dequantizes "
            f"{', '.join(TENSOR_TYPES)}; requantize the model to one of them (llama.cpp's "
            "llama-quantize, e.g. Q8_0) or convert it from F16"
        )
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(
        shape
    )


def _read_params(gguf, reader, file: str, model, allow_nonfinite: bool) -> dict:
    stored = {tensor.name: tensor for tensor in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.num_layers)
    heads = {"attn_q": model.num_heads, "attn_k": model.num_kv_heads}
    values: dict[tuple[str, ...], np.ndarray] = {}
    used = set()
    for link in tensor_links(model):
        arrays = []
        for hf_name, shape in link.tensors:
            name = names.get_name(hf_name, try_suffixes=(".weight",))
            where = " and ".join("/".join(path) for path in link.params)
            if name not in stored:
                raise ValueError(
                    f"{file} has no tensor {name!r}, which a llama model as its metadata "
                    f"describes needs (kvlab's {where}): the file is incomplete or its "
                    "metadata does not describe its tensors"
                )
            tensor = stored[name]
            found = tuple(reversed([int(d) for d in tensor.shape]))
            if found != shape:
                raise ValueError(
                    f"tensor {name!r} in {file} has shape {found} ([out, in]) but the metadata "
                    f"makes it {shape} (kvlab's {where}): the file is damaged"
                )
            array = _dequantize(gguf, tensor, file)
            if not allow_nonfinite:
                refuse_nonfinite(array, f"tensor {name!r} in {file} (dequantized)")
            role = name.split(".")[-2]
            if role in heads:
                array = unpermute_rope_rows(array, heads[role])
            arrays.append(array)
            used.add(name)
        values.update(zip(link.params, link.to_kvlab(*arrays), strict=True))
    left = sorted(set(stored) - used)
    if left:
        shown = ", ".join(map(repr, left[:5])) + (f" and {len(left) - 5} more" if left[5:] else "")
        raise ValueError(
            f"{file} holds tensors a llama model as its metadata describes has no place for: "
            f"{shown}; kvlab refuses rather than drop weights (check llama.block_count)"
        )
    return imported_params(values, model, allow_nonfinite)


# ---------------------------------------------------------------------------
# Tokenizer


def _tokenizer(meta: _Metadata, file: str) -> Tokenizer:
    """The byte-level BPE tokenizer of the file's tokenizer.ggml.* metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        meta.refuse(
            "tokenizer.ggml.model",
            kind,
            "is not a tokenizer kvlab builds from GGUF metadata",
            "load_gguf builds GPT-2 style byte-level BPE ('gpt2'); for SentencePiece ('llama') "
            "and others load the model's tokenizer.json with kvlab.data.tokenizer.load_tokenizer",
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        meta.refuse(
            "tokenizer.ggml.pre",
            pre,
            "is a pre-tokenizer kvlab does not rebuild",
            f"kvlab rebuilds {', '.join(map(repr, PRE_TOKENIZERS))}; load the model's "
            "tokenizer.json with kvlab.data.tokenizer.load_tokenizer",
        )
    tokens = list(meta.required("tokenizer.ggml.tokens"))
    vocabulary = {token: index for index, token in enumerate(tokens)}
    if len(vocabulary) != len(tokens):
        raise ValueError(f"{file}: tokenizer.ggml.tokens lists a token twice: the file is damaged")
    merges = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            meta.refuse("tokenizer.ggml.merges", merge, "is not a pair 'a b'", "file is damaged")
        merges.append(pair)
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        meta.refuse(
            "tokenizer.ggml.token_type",
            f"<{len(types)} values>",
            f"does not give one type per token ({len(tokens)})",
            "the file is damaged",
        )
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocabulary, merges, fuse_unk=False))
    byte_level = tokenizers.pre_tokenizers.ByteLevel(
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)), use_regex=True
    )
    if PRE_TOKENIZERS[pre]:
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
            [tokenizers.pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = tokenizers.decoders.ByteLevel()
    added = tokenizers.AddedToken
    backend.add_special_tokens(
        [
            added(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            added(t, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None and not 0 <= eos < len(tokens):
        meta.refuse(
            "tokenizer.ggml.eos_token_id", eos, f"is not a token id (< {len(tokens)})", "fix it"
        )
    return Tokenizer.wrap(backend, path=file, end_token=eos)


def load_gguf(
    path: str | os.PathLike, dtype: Any = None, *, allow_nonfinite: bool = False
) -> tuple[ml_collections.ConfigDict, dict, Tokenizer]:
    """(config, params, tokenizer) of the Llama-architecture GGUF file at `path`.

    The config is base_config()'s with the model section mapped from the
    file's metadata, then validated; model.dtype and model.param_dtype are
    `dtype` ('float32', 'bfloat16', 'float16' or a JAX/numpy dtype), float32
    by default. The params are jax arrays in that dtype, laid out as
    kvlab.init_params(cfg.model, key) lays them out. The tokenizer is a
    kvlab.data.tokenizer.Tokenizer (end_token: tokenizer.ggml.eos_token_id);
    `kvlab.save_hf(cfg, params, DIR, tokenizer=tokenizer)` makes a folder the
    scripts' --hf reads. NaN or infinite weights (as dequantized, or from the
    cast to `dtype`) are refused naming the tensor, unless allow_nonfinite.
    """
    gguf = _gguf()
    file = os.fspath(path)
    if not os.path.isfile(file):
        raise ValueError(f"path={file!r} is not a file: pass a .gguf file")
    try:
        reader = gguf.GGUFReader(file)
    except Exception as error:  # the reader raises ValueError / struct errors for other files
        raise ValueError(
            f"path={file!r} is not a GGUF file the gguf package reads ({error})"
        ) from None
    meta = _Metadata(reader, file, gguf.GGUFValueType.FLOAT32)
    cfg = base_config()
    cfg.model = _model_section(meta, {t.name for t in reader.tensors}, _dtype_name(dtype))
    try:
        validate_config(cfg)
    except ValueError as error:
        raise ValueError(f"{file} maps to a kvlab config that is not valid: {error}") from None
    tokenizer = _tokenizer(meta, file)
    params = _read_params(gguf, reader, file, cfg.model, allow_nonfinite)
    return cfg, params, tokenizer
