"""Reading a transformers checkpoint folder: load_hf.

    cfg, params = kvlab.load_hf("path/to/model", dtype=None)   # a local save_pretrained folder

Nothing is downloaded (fetch a hub model first, e.g. `hf download NAME --local-dir
DIR`). `load_hf` returns a validated kvlab config (the model section mapped from
config.json by config.py, every other section at its defaults) and the parameter
pytree of `kvlab.Transformer(cfg.model)`, each tensor placed by layouts.py. Text
for an imported model goes through the folder's tokenizer.json
(data.tokenizer); a model whose vocabulary is not the 256 byte values never
reads bytes: without a tokenizer.json it is refused.

Nothing is dropped silently: every tensor kvlab needs must be there with the
shape config.json implies, and a tensor left over is refused. Weights holding
NaN or infinity are refused naming the tensor (`allow_nonfinite=True` loads
them), and so is a cast to `dtype` that overflows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from kvlab.checkpoints.hf.config import HFConfig, mapped_config
from kvlab.checkpoints.hf.layouts import INDEX_FILE, SINGLE_FILE, check_params, tensor_links
from kvlab.config import base_config, dtype_of
from kvlab.files import read_json

# safetensors dtype codes kvlab reads, and the config dtype each becomes.
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def load_hf(
    path: str | os.PathLike, dtype: Any = None, *, allow_nonfinite: bool = False
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of the transformers checkpoint in the local folder `path`.

    The config is base_config()'s with the model section mapped from
    config.json and data.tokenizer the folder when it holds a tokenizer.json,
    then validated; model.dtype and model.param_dtype are `dtype`
    ('float32', 'bfloat16', 'float16' or a JAX/numpy dtype), by default the
    checkpoint's dtype (float32 when it names none). The params are jax arrays
    in that dtype, laid out as kvlab.init_params(cfg.model, key) lays them out.

    Refused, naming the folder or tensor: a model whose vocabulary is not the
    256 byte values in a folder without tokenizer.json (kvlab would read text
    as bytes), and NaN or infinite weights (in the file, or from the cast to
    `dtype`) unless allow_nonfinite.
    """
    folder = os.fspath(path)
    hf, cfg = mapped_config(folder, dtype, base_config())
    with _Checkpoint(folder) as checkpoint:
        params = _read_params(checkpoint, hf, cfg.model, allow_nonfinite)
    return cfg, params


class _Checkpoint(contextlib.ExitStack):
    """The tensors of a folder's safetensors file(s), read lazily by name."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        index = os.path.join(folder, INDEX_FILE)
        single = os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index):
            stored = read_json(index)
            weight_map = stored.get("weight_map") if isinstance(stored, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map: the sharded checkpoint is damaged")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = [SINGLE_FILE]
        else:
            others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
            hint = f" (it has {others[:3]}: re-save with safe_serialization=True)" if others else ""
            raise ValueError(
                f"{folder!r} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}: kvlab reads "
                "safetensors checkpoints"
            )
        self.files: dict[str, Any] = {}  # tensor name -> open file
        for name in files:
            file = os.path.join(folder, name)
            if not os.path.isfile(file):
                raise ValueError(f"{INDEX_FILE} names {name}, which {folder!r} does not hold")
            try:
                handle = self.enter_context(safe_open(file, framework="numpy"))
            except SafetensorError as error:
                raise ValueError(
                    f"{file} is not a safetensors file the safetensors library reads ({error}): "
                    "it is damaged or was cut short; write or download it again"
                ) from None
            for tensor in handle.keys():
                if tensor in self.files:
                    raise ValueError(f"tensor {tensor!r} is stored twice in {folder!r}")
                self.files[tensor] = handle

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        stored = self.files[name].get_slice(name).get_dtype()
        if stored not in STORED_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {self.folder!r} is stored as {stored}: kvlab reads "
                f"{', '.join(STORED_DTYPES)} tensors; dequantize the checkpoint first"
            )
        return self.files[name].get_tensor(name)


def _read_params(checkpoint: _Checkpoint, hf: HFConfig, model, allow_nonfinite: bool):
    folder, family = checkpoint.folder, hf.family
    interleaved = family == "deepseek_v2" or bool(hf.get("rope_interleave", True))
    links = tensor_links(model, interleaved)
    values: dict[tuple[str, ...], np.ndarray] = {}
    used = set()
    for link in links:
        arrays = []
        for name, shape in link.tensors:
            where = " and ".join("/".join(path) for path in link.params)
            if name not in checkpoint:
                raise ValueError(
                    f"{folder!r} has no tensor {name!r}, which a {family} model as its "
                    f"config.json describes needs (kvlab's {where}): the weights and "
                    "config.json do not belong together, or the files are incomplete"
                )
            if checkpoint.shape(name) != shape:
                raise ValueError(
                    f"tensor {name!r} in {folder!r} has shape {checkpoint.shape(name)} but "
                    f"config.json makes it {shape} (kvlab's {where}): the weights and "
                    "config.json do not belong together"
                )
            array = checkpoint.read(name)
            if not allow_nonfinite:
                refuse_nonfinite(array, f"tensor {name!r} in {folder!r}")
            arrays.append(array)
            used.add(name)
        values.update(zip(link.params, link.to_kvlab(*arrays), strict=True))
    if model.tie_embeddings and "lm_head.weight" in checkpoint:
        # Some tied checkpoints store the shared matrix twice; only an equal copy is accepted.
        if not np.array_equal(checkpoint.read("lm_head.weight"), values[("embed", "embedding")]):
            raise ValueError(
                f"tensor 'lm_head.weight' in {folder!r} differs from model.embed_tokens.weight "
                "but config.json has tie_word_embeddings=true: set it to false to use both"
            )
        used.add("lm_head.weight")
    left = sorted(set(checkpoint.files) - used)
    if left:
        shown = ", ".join(map(repr, left[:5])) + (f" and {len(left) - 5} more" if left[5:] else "")
        raise ValueError(
            f"{folder!r} holds tensors a {family} model as its config.json describes has no "
            f"place for: {shown}; kvlab refuses rather than drop weights: check config.json "
            "(num_hidden_layers, tie_word_embeddings, attention_bias, ...) or remove them"
        )
    return imported_params(values, model, allow_nonfinite)


def refuse_nonfinite(array: np.ndarray, what: str, fix: str = "") -> None:
    """ValueError naming `what` when `array` holds NaN or infinite values."""
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = finite.size - int(finite.sum())
    first = np.unravel_index(int(np.argmin(finite)), array.shape)
    raise ValueError(
        f"{what} holds {bad} non-finite value(s) of {finite.size} ({array[first]} at index "
        f"{tuple(map(int, first))} first): "
        + (fix or "the weights are damaged; load them with allow_nonfinite=True to study them")
    )


def imported_params(values: Mapping[tuple, np.ndarray], model, allow_nonfinite: bool) -> dict:
    """The params tree of Transformer(model) from imported arrays by parameter path:
    shapes checked (check_params), cast to model.param_dtype; a finite value that
    the cast overflows is refused naming the parameter, unless allow_nonfinite."""
    check_params({path: v.shape for path, v in values.items()}, model, "the import")
    param_dtype = dtype_of(model.param_dtype)
    params = {}
    for path, value in values.items():
        with np.errstate(over="ignore"):  # an overflow is refused below, naming the parameter
            params[path] = jnp.asarray(value, param_dtype)
        cast = np.dtype(value.dtype) != param_dtype
        if cast and not allow_nonfinite and not bool(jnp.isfinite(params[path]).all()):
            refuse_nonfinite(
                np.asarray(params[path]),
                f"parameter {'/'.join(path)} in {model.param_dtype}",
                f"values beyond {model.param_dtype}'s range overflowed: load it in a wider "
                "dtype (dtype='float32' or 'bfloat16')",
            )
    return traverse_util.unflatten_dict(params)
