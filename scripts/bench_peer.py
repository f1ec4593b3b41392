"""kvlab against Hugging Face transformers: greedy decode on the same weights, side by side.

    pip install -e '.[peer]'    # torch and transformers, for this script only
    python scripts/bench_peer.py --json
    python scripts/bench_peer.py --shapes=4M --batch_sizes=1 --new_tokens=32
    OMP_WAIT_POLICY=PASSIVE python scripts/bench_peer.py --json    # on shared cores

For each shape (--shapes, the table SHAPES below) the weights are drawn by
kvlab.init_params, written by kvlab.save_hf as a transformers checkpoint
(grouped-query shapes as Llama, latent attention as DeepSeek-V2 with every
layer dense) and read back by transformers' AutoModelForCausalLM in float32,
so both sides compute the same model. For each batch size (--batch_sizes)
both decode greedily --new_tokens tokens after the same random
--prompt_len-token prompts: `kvlab.generate` (one compiled loop, float32
cache, weights as kvlab.cli.decode_params lays them out: projections fused,
in 32-column panels for kvlab/kernels/native, model.attention_impl='native') and
`model.generate(do_sample=False)` (its default dynamic cache and attention),
on torch.set_num_threads(--threads) threads.

Runs alternate, kvlab then transformers, after one warm-up run of each (kvlab
compiles there): --repeats rounds, each timing both sides generating all
--new_tokens and then only the first token; the best time of each is kept.
Generating one token is the prefill; the decode step is
(t(new_tokens) - t(1)) / (new_tokens - 1). Per cell the script reports
tokens/s of each side (batch x new_tokens / t(new_tokens)) and kvlab's
speed over transformers' (`ratio`, also for the decode step alone), whether
the greedy tokens agree (`tokens_equal`; else the first generated position
where a row differs: with random weights a near-tie can flip a late token),
and the largest difference between the two sides' first-step logits.

Timings on a shared machine are noisy: compare the ratios, measured in one
run with the sides interleaved, rather than tokens/s across runs. There, run
with OMP_WAIT_POLICY=PASSIVE (recorded in the JSON): torch's OpenMP threads
otherwise spin while they wait for each other, and once other processes hold
the cores a spinning thread waits out their time slices, so one generate call
can take 10-100x its usual time (seen on two shared cores) and the ratio
says nothing about either library.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time

import jax
import ml_collections
import numpy as np
from absl import flags

import kvlab
from kvlab import cli
from kvlab.config import check_count

# name -> model fields over base_config('tiny').model; every shape also gets COMMON.
SHAPES = {
    # configs/gqa.py:tiny with a 32k vocabulary: the embedding is most of it.
    "4M": dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=176),
    # A GPT-2-small-sized Llama: 12 layers, d 768, 12 query heads over 4 KV heads
    # (125M parameters with the untied output layer, 100M tied).
    "110M": dict(
        num_layers=12, embed_dim=768, num_heads=12, num_kv_heads=4, head_dim=64, mlp_dim=2048
    ),
    # The same widths with DeepSeek-V2's latent attention (configs/mla.py:small's
    # proportions: low-rank queries, a 256-wide latent and one 32-wide RoPE key).
    "mla": dict(
        num_layers=12,
        embed_dim=768,
        num_heads=12,
        num_kv_heads=12,
        head_dim=96,
        mlp_dim=2048,
        attention="mla",
        mla=dict(kv_rank=256, q_rank=384, rope_dim=32, nope_dim=64, v_head_dim=64),
    ),
}
# Llama's vocabulary, untied, float32 weights and compute.
COMMON = dict(vocab_size=32_000, tie_embeddings=False, dtype="float32", param_dtype="float32")
INSTALL = "pip install -e '.[peer]'"

_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), f"Model shapes: {', '.join(SHAPES)}.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Rows decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per cell; the best time is kept.")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads (0: the cores this process may use).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the prompts.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def shape_config(name: str) -> ml_collections.ConfigDict:
    """The validated config of shape `name`: float32 model and cache."""
    if name not in SHAPES:
        raise ValueError(
            f"--shapes={','.join(_SHAPES.value)}: {name!r} is not a shape: pick from "
            f"{', '.join(SHAPES)}"
        )
    cfg = kvlab.base_config("tiny")  # float32 model and cache
    fields = {**SHAPES[name], **COMMON}
    cfg.model.mla.update(fields.pop("mla", {}))
    cfg.model.update(fields)
    return kvlab.validate_config(cfg)


def batch_sizes(values: list[str]) -> list[int]:
    try:
        numbers = [int(value) for value in values]
    except ValueError:
        raise ValueError(
            f"--batch_sizes={','.join(values)} is not a list of integers: give e.g. 1,8"
        ) from None
    return [check_count("--batch_sizes", number) for number in numbers]


def check_flags() -> tuple[dict, list[int]]:
    """({shape: config}, batch sizes) from the flags, each refused with its fix."""
    if not _SHAPES.value:
        raise ValueError(f"--shapes is empty: pick from {', '.join(SHAPES)}")
    configs = {name: shape_config(name) for name in dict.fromkeys(_SHAPES.value)}
    sizes = batch_sizes(_BATCH_SIZES.value)
    check_count("--prompt_len", _PROMPT_LEN.value)
    # The decode step is the difference between generating all and generating one.
    check_count("--new_tokens", _NEW_TOKENS.value, minimum=2)
    check_count("--repeats", _REPEATS.value)
    check_count("--threads", _THREADS.value, minimum=0)
    return configs, sizes


def import_peer():
    """(torch, transformers), or a ValueError saying how to install them."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise ValueError(
            f"scripts/bench_peer.py needs torch and transformers ({error}): install the "
            f"peer extra, {INSTALL}"
        ) from None
    return torch, transformers


def parameter_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def first_difference(kvlab_tokens: np.ndarray, hf_tokens: np.ndarray) -> int | None:
    """The first generated position where any row differs; None if none does."""
    differs = np.any(kvlab_tokens != hf_tokens, axis=0)  # [M]
    return int(np.argmax(differs)) if differs.any() else None


def bench_cell(cfg, params, hf_model, torch, batch: int) -> dict:
    """One shape at one batch size: both sides timed alternately, then compared."""
    prompt_len, new_tokens, repeats = _PROMPT_LEN.value, _NEW_TOKENS.value, _REPEATS.value
    model = kvlab.Transformer(cfg.model)
    rng = np.random.default_rng(_SEED.value)
    prompts = rng.integers(0, cfg.model.vocab_size, (batch, prompt_len), dtype=np.int32)
    input_ids = torch.as_tensor(prompts, dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    max_len = prompt_len + new_tokens  # one compiled loop for 1 and new_tokens tokens

    def run_kvlab(count: int) -> np.ndarray:
        out = kvlab.generate(
            model,
            params,
            prompts,
            cache_cfg=cfg.cache,
            max_new_tokens=count,
            max_len=max_len,
        )
        return np.asarray(jax.block_until_ready(out))

    def run_hf(count: int) -> np.ndarray:
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=count,
            )
        return out.numpy()

    runs = {"kvlab": run_kvlab, "hf": run_hf}
    # Warm-up (kvlab compiles): the full runs' tokens are compared below.
    outputs = {side: run(new_tokens) for side, run in runs.items()}
    for run in runs.values():
        run(1)
    times = {(side, count): [] for side in runs for count in (new_tokens, 1)}
    for _ in range(repeats):
        for count in (new_tokens, 1):
            for side, run in runs.items():  # alternating: kvlab, transformers, kvlab, ...
                start = time.perf_counter()
                run(count)
                times[side, count].append(time.perf_counter() - start)
    best = {key: min(values) for key, values in times.items()}

    row = dict(batch_size=batch)
    for side in runs:
        full, first = best[side, new_tokens], best[side, 1]
        row[f"{side}_tokens_per_s"] = batch * new_tokens / full
        row[f"{side}_generate_s"] = full
        row[f"{side}_prefill_s"] = first
        row[f"{side}_decode_step_s"] = (full - first) / (new_tokens - 1)
    row["ratio"] = row["kvlab_tokens_per_s"] / row["hf_tokens_per_s"]
    row["decode_step_ratio"] = row["hf_decode_step_s"] / row["kvlab_decode_step_s"]

    kvlab_tokens = outputs["kvlab"][:, prompt_len:]
    hf_tokens = outputs["hf"][:, prompt_len:]
    if hf_tokens.shape != kvlab_tokens.shape:
        raise RuntimeError(f"transformers generated {hf_tokens.shape}, kvlab {kvlab_tokens.shape}")
    difference = first_difference(kvlab_tokens, hf_tokens)
    row["tokens_equal"] = difference is None
    row["first_differing_position"] = difference
    row["rows_equal"] = int(np.all(kvlab_tokens == hf_tokens, axis=1).sum())

    forward = jax.jit(lambda p, t: model.apply({"params": p}, t)[0][:, -1])
    kvlab_logits = np.asarray(forward(params, prompts))  # [B, V]: the first generated token's
    with torch.inference_mode():
        hf_logits = hf_model(input_ids, attention_mask=attention_mask).logits[:, -1].numpy()
    top_two = np.sort(kvlab_logits, axis=-1)[:, -2:]
    row["first_step_logits_max_abs_diff"] = float(np.abs(kvlab_logits - hf_logits).max())
    row["first_step_logits_max_abs"] = float(np.abs(kvlab_logits).max())
    # How far greedy's choice is from a tie: below the logits' difference it may flip.
    row["first_step_top2_gap_min"] = float((top_two[:, 1] - top_two[:, 0]).min())
    return row


def bench_shape(name, cfg, sizes, torch, transformers) -> dict:
    """Every batch size of one shape, on weights both sides share."""
    params = kvlab.init_params(cfg.model, jax.random.key(_SEED.value))
    with tempfile.TemporaryDirectory() as folder:
        kvlab.save_hf(cfg, params, folder)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32
        ).eval()
    # Random weights may pick the config's default end token: generate every token.
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    cfg.model, params, layout = cli.decode_params(cfg.model, params)  # as kvlab decodes
    rows = [bench_cell(cfg, params, hf_model, torch, batch) for batch in sizes]
    return dict(
        shape=name,
        hf_family=hf_model.config.model_type,
        hf_attention=hf_model.config._attn_implementation,
        weight_layout=layout,
        parameters=parameter_count(params),
        weight_bytes=kvlab.tree_bytes(params),
        model=cfg.model.to_dict(),
        rows=rows,
    )


def print_table(result: dict) -> None:
    load = result["load_average_1min"]
    print(
        f"prompt {result['prompt_len']} tokens, {result['new_tokens']} new, greedy, float32; "
        f"best of {result['repeats']}; torch {result['versions']['torch']} on "
        f"{result['torch_threads']} threads, transformers {result['versions']['transformers']}, "
        f"jax {result['versions']['jax']}; load average {load['before']:.1f} before, "
        f"{load['after']:.1f} after; OMP_WAIT_POLICY={result['omp_wait_policy']}"
    )
    print(
        f"{'shape':>6} {'batch':>5} {'kvlab tok/s':>12} {'HF tok/s':>10} {'ratio':>6} "
        f"{'kvlab step ms':>14} {'HF step ms':>11} {'step ratio':>11} {'kvlab prefill ms':>17} "
        f"{'HF prefill ms':>14} {'tokens equal':>13} {'max |dlogit|':>13}"
    )
    for shape in result["shapes"]:
        for r in shape["rows"]:
            equal = "yes" if r["tokens_equal"] else f"from {r['first_differing_position']}"
            print(
                f"{shape['shape']:>6} {r['batch_size']:>5} {r['kvlab_tokens_per_s']:>12.1f} "
                f"{r['hf_tokens_per_s']:>10.1f} {r['ratio']:>6.2f} "
                f"{r['kvlab_decode_step_s'] * 1e3:>14.2f} {r['hf_decode_step_s'] * 1e3:>11.2f} "
                f"{r['decode_step_ratio']:>11.2f} {r['kvlab_prefill_s'] * 1e3:>17.1f} "
                f"{r['hf_prefill_s'] * 1e3:>14.1f} {equal:>13} "
                f"{r['first_step_logits_max_abs_diff']:>13.2e}"
            )


def main(argv):
    del argv
    configs, sizes = check_flags()
    torch, transformers = import_peer()
    threads = _THREADS.value or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    shapes = [bench_shape(name, cfg, sizes, torch, transformers) for name, cfg in configs.items()]
    result = dict(
        prompt_len=_PROMPT_LEN.value,
        new_tokens=_NEW_TOKENS.value,
        repeats=_REPEATS.value,
        seed=_SEED.value,
        torch_threads=threads,
        cpu_count=os.cpu_count(),
        backend=jax.default_backend(),
        machine=platform.processor() or platform.machine(),
        # Other processes on the cores slow both sides, torch's threads most.
        load_average_1min=dict(before=load_before[0], after=os.getloadavg()[0]),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            jax=jax.__version__,
            python=platform.python_version(),
        ),
        shapes=shapes,
    )
    if _JSON.value:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    cli.run(main)
