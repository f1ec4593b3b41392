"""The first run on a GPU or a TPU: every Pallas kernel against the XLA path, then decode timed.

    python scripts/device_check.py --json            # on the accelerator: about 10 minutes
    python scripts/device_check.py --json --lengths=1024,4096

(a) Kernels. For each storage kvlab's kernels read (bfloat16 rows, int8 and
int4 codes per token, KIVI's 2-bit per-channel keys with a residual, fp8, page
pools at 16 and 4 bits, a latent-attention cache at 16 and 4 bits), a prompt
and three decode steps with model.attention_impl='pallas' against 'xla': the
largest logit difference, and whether the compiled program holds the
platform's kernel (Triton on CUDA, Mosaic on TPU; on the CPU the interpreter
runs it, so there is no kernel call to find: null). 16-bit dense rows are
read by the XLA path (the kernels take stored data: codes and pools), so their
difference is 0; bfloat16 probabilities are rounded against each block's peak,
so a bfloat16 pool differs by bfloat16's rounding.
(b) Decode. Seconds per greedy decode step after a prefill, at each context
length, for bf16, K8V8, K4V4, KIVI-2, paged and MLA caches, with the XLA path
and with the kernels; with the bytes a step reads (weights and the cache) over
the step time against the bandwidth measured here (kvlab.eval.speed): the
roofline fraction.

On an accelerator the defaults are the small configs and 1k-32k tokens; on the
CPU the tiny configs, one short length and the kernels in interpret mode, so
that the script itself is known to work (tests/test_scripts.py runs it so).
docs/accelerators.md says what to expect and what has been verified without
the hardware.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import kvlab
from kvlab import cli
from kvlab.eval import speed

_LENGTHS = flags.DEFINE_list("lengths", None, "Context lengths (default 1024..32768; CPU: 96).")
_STEPS = flags.DEFINE_integer("steps", None, "Decode steps timed per length (default 32; CPU: 2).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timings per measurement (default 3; CPU: 1).")
_SIZE = flags.DEFINE_string("size", None, "Config size (default small; CPU: tiny).")
_PROBE_MIB = flags.DEFINE_integer("probe_mib", None, "Bandwidth probe MiB (default 1024; CPU: 16).")
_CHECK_TOKENS = flags.DEFINE_integer("check_tokens", 100, "Prompt tokens of the kernel check.")
_CHECKED = flags.DEFINE_list("checked", None, "Storages the kernels are checked on (default all).")
_TIMED = flags.DEFINE_list("timed", None, "Caches decode is timed with (default all).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# Cache fields of a GQA config (a latent config names them latent_ and rope_).
KIVI = dict(k_bits=2, v_bits=2, k_axis="channel", group_size=16, residual=64)
CHECKED = {
    "bf16": ("gqa", dict(dtype="bfloat16")),
    "K8V8": ("gqa", dict(k_bits=8, v_bits=8, k_axis="token")),
    "K4V4": ("gqa", dict(k_bits=4, v_bits=4, k_axis="token")),
    "KIVI-2": ("gqa", KIVI),
    "fp8": ("gqa", dict(k_bits=8, v_bits=8, k_format="fp8", v_format="fp8", k_axis="token")),
    "paged": ("gqa", dict(kind="paged", dtype="bfloat16")),
    "paged K4V4": ("gqa", dict(kind="paged", k_bits=4, v_bits=4, k_axis="token")),
    "MLA": ("mla", dict(dtype="bfloat16")),
    "MLA 4-bit": ("mla", dict(latent_bits=4, rope_bits=8)),
}
TIMED = ("bf16", "K8V8", "K4V4", "KIVI-2", "paged", "MLA")
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
ACCELERATOR = dict(lengths=[1024, 4096, 16384, 32768], steps=32, repeats=3, size="small")
CPU = dict(lengths=[96], steps=2, repeats=1, size="tiny")


def setting(flag, name: str, on_cpu: bool):
    value = flag.value
    if value is None:
        value = (CPU if on_cpu else ACCELERATOR).get(name)
    return value


def config(case: str, size: str, impl: str):
    attention, fields = CHECKED[case]
    cfg = kvlab.load_config(f"{CONFIGS}/{attention}.py:{size}")
    cfg.model.attention_impl = impl
    cfg.cache.update(fields)
    return kvlab.validate_config(cfg)


def check_kernel(case: str, size: str, tokens: int, platform: str) -> dict:
    """(a) for one storage: logits of a prompt and three decode steps, both paths."""
    logits, holds_kernel = {}, None
    for impl in ("xla", "pallas"):
        cfg = config(case, size, impl)
        model = kvlab.Transformer(cfg.model)
        params = kvlab.init_params(cfg.model, jax.random.key(0))
        prompt = speed.random_prompt(cfg.model.vocab_size, 2, tokens + 3)
        cache = kvlab.init_cache(cfg.model, cfg.cache, 2, tokens + 3)
        step = jax.jit(lambda c, t, m=model, p=params: kvlab.prefill(m, p, c, t))
        out, cache = step(cache, prompt[:, :tokens])
        rows = [out[:, -1]]
        for t in range(tokens, tokens + 3):
            if impl == "pallas" and t == tokens:
                text = step.lower(cache, prompt[:, t : t + 1]).as_text()
                holds_kernel = KERNEL_CALL[platform] in text if platform in KERNEL_CALL else None
            out, cache = step(cache, prompt[:, t : t + 1])
            rows.append(out[:, -1])
        cache.check()
        logits[impl] = np.asarray(jnp.stack(rows), np.float32)
    diff = float(np.abs(logits["pallas"] - logits["xla"]).max())
    return dict(cache=case, max_abs_diff=diff, kernel_in_program=holds_kernel)


def time_decode(case: str, size: str, lengths, steps: int, repeats: int, bandwidth) -> list:
    """(b) for one cache: both paths at every length, against the roofline."""
    rows = []
    for impl in ("xla", "pallas"):
        cfg = config(case, size, impl)
        model = kvlab.Transformer(cfg.model)
        params = kvlab.init_params(cfg.model, jax.random.key(0))
        weight_bytes = kvlab.tree_bytes(params)
        for length in lengths:
            prompt = speed.random_prompt(cfg.model.vocab_size, 1, length)
            seconds = speed.decode_step_time(cfg, model, params, prompt, steps, repeats)
            read = weight_bytes + kvlab.cache_bytes(cfg.model, cfg.cache, 1, length + steps)
            rows.append(
                dict(
                    cache=case,
                    attention_impl=impl,
                    seq_len=length,
                    decode_step_s=seconds,
                    bytes_per_step=read,
                    roofline_fraction=read / bandwidth / seconds,
                )
            )
    return rows


def main(argv):
    del argv
    platform = jax.default_backend()  # an entry point: the platform this run is on
    on_cpu = platform == "cpu"
    lengths = [int(n) for n in setting(_LENGTHS, "lengths", on_cpu)]
    steps, repeats = setting(_STEPS, "steps", on_cpu), setting(_REPEATS, "repeats", on_cpu)
    size = setting(_SIZE, "size", on_cpu)
    probe = _PROBE_MIB.value or (16 if on_cpu else 1024)
    checked, timed = _CHECKED.value or list(CHECKED), _TIMED.value or list(TIMED)
    for flag, names in (("checked", checked), ("timed", timed)):
        unknown = sorted(set(names) - set(CHECKED))
        if unknown:
            raise ValueError(f"--{flag}={','.join(unknown)}: not one of {list(CHECKED)}")
    bandwidth = speed.memory_bandwidth(probe, repeats)
    best = max(bandwidth.values())
    result = dict(
        platform=platform,
        device_kind=jax.devices()[0].device_kind,
        jax=jax.__version__,
        interpreted=on_cpu,
        bandwidth_bytes_per_s=bandwidth,
        kernels=[check_kernel(c, size, _CHECK_TOKENS.value, platform) for c in checked],
        decode=[r for c in timed for r in time_decode(c, size, lengths, steps, repeats, best)],
    )
    if _JSON.value:
        print(json.dumps(result, indent=2))
        return
    kind = result["device_kind"]
    print(f"{platform} ({kind}), jax {jax.__version__}; best {best / 1e9:.1f} GB/s")
    for row in result["kernels"]:
        print(
            f"{row['cache']:>11}: kernel vs XLA max |diff| {row['max_abs_diff']:.2e}"
            f"{' (no kernel call in the program)' if row['kernel_in_program'] is False else ''}"
        )
    print(f"{'cache':>11} {'impl':>6} {'seq_len':>8} {'step ms':>9} {'roofline':>9}")
    for r in result["decode"]:
        print(
            f"{r['cache']:>11} {r['attention_impl']:>6} {r['seq_len']:>8} "
            f"{r['decode_step_s'] * 1e3:>9.3f} {r['roofline_fraction']:>9.2f}"
        )


if __name__ == "__main__":
    cli.run(main)
