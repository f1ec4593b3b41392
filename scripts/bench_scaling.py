"""Scaling: training step time, decode tokens/s and cache bytes per device against devices.

    python scripts/bench_scaling.py --json
    python scripts/bench_scaling.py --devices=1,2,4,8 --config.mesh.tensor=2 \
        --config configs/gqa.py:tiny --steps=10

For each device count n in --devices, one child process runs on a mesh of n
devices built from the config's `mesh` section (default: data parallelism over
all n; sizes given with --config.mesh.* must multiply to n, or use -1). On CPU
the child sees n forced host devices (XLA_FLAGS
--xla_force_host_platform_device_count=n, which XLA reads once per process);
on a GPU or TPU it uses the first n real devices. Each child measures

- train: the compiled step's time (best of --repeats runs of --steps steps,
  after a warm-up), tokens/s, and the collectives in its optimized HLO (count
  and bytes of all-reduce, all-gather, reduce-scatter, all-to-all and
  collective-permute results): the communication XLA inserted;
- decode: greedy decode_step tokens/s of --decode_batch rows after a prompt of
  --prompt_len tokens (best of --repeats runs of --decode_steps steps), through
  the config's cache laid out on the mesh;
- cache bytes per device (kvlab.cache_bytes(per_device=True)) and in all.

On forced CPU devices every "device" shares the same cores: the times show
the cost of the partitioned program and its collectives, not a speed-up.
"""

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, sharding, train
from kvlab.config import frozen
from kvlab.eval import speed

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts to measure.")
_STEPS = flags.DEFINE_integer("steps", 5, "Training steps per timing.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 32, "Decode steps per timing.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 16, "Rows decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens before decoding.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timings per measurement; the best is kept.")
_CHILD = flags.DEFINE_integer("child", 0, "Internal: measure on this many devices and exit.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEM_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})


def collectives(hlo: str) -> dict:
    """Count and result bytes of each kind of collective in optimized HLO text
    (an async pair counts once, at its start)."""
    found = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    pattern = re.compile(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    for line in hlo.splitlines():
        match = pattern.search(line)
        if match is None:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
        size = sum(
            _ITEM_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
            for dtype, dims in shapes
        )
        found[match.group(2)]["count"] += 1
        found[match.group(2)]["bytes"] += size
    return found


def measure(cfg, num_devices: int) -> dict:
    """Train step time, decode tokens/s and cache bytes on the first `num_devices` devices."""
    mesh = sharding.make_mesh(cfg, jax.devices()[:num_devices])
    rules = sharding.axis_rules(cfg.mesh)
    model, train_cfg = kvlab.Transformer(cfg.model), frozen(cfg.train)
    rows, length = cfg.train.batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (rows, length + 1))
    batch = {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "weights": np.ones((rows, length), np.float32),
    }
    step = train.compiled_step(model, train_cfg, mesh, rules)
    state = [train.init_state(cfg, mesh=mesh, rules=rules)]
    hlo = step.lower(state[0], batch).compile().as_text()

    def train_steps():
        for _ in range(_STEPS.value):
            state[0], metrics = step(state[0], batch)
        return metrics["loss"]

    train_seconds = speed.best_time(train_steps, _REPEATS.value) / _STEPS.value

    decode_rows, prompt_len = _DECODE_BATCH.value, _PROMPT_LEN.value
    max_len = prompt_len + _DECODE_STEPS.value
    params = state[0].params
    prompt = tokens[:decode_rows, :prompt_len].astype(np.int32) % cfg.model.vocab_size
    next_tokens = np.zeros((decode_rows,), np.int32)

    def decode():
        cache = kvlab.init_cache(cfg.model, cfg.cache, decode_rows, max_len, mesh=mesh, rules=rules)
        _, cache = kvlab.prefill(model, params, cache, prompt)
        start = time.perf_counter()
        for _ in range(_DECODE_STEPS.value):
            logits, cache = kvlab.decode_step(model, params, cache, next_tokens)
        jax.block_until_ready(logits)
        cache.check()
        return time.perf_counter() - start

    decode()  # compile
    decode_seconds = min(decode() for _ in range(_REPEATS.value))
    cache_args = (cfg.model, cfg.cache, decode_rows, max_len)
    return {
        "devices": num_devices,
        "platform": jax.default_backend(),
        "mesh": dict(mesh.shape),
        "train_step_s": train_seconds,
        "train_tokens_per_s": rows * length / train_seconds,
        "train_collectives": collectives(hlo),
        "decode_tokens_per_s": decode_rows * _DECODE_STEPS.value / decode_seconds,
        "cache_bytes": kvlab.cache_bytes(*cache_args),
        "cache_bytes_per_device": kvlab.cache_bytes(
            *cache_args, per_device=True, mesh=mesh, rules=rules
        ),
    }


def run_child(num_devices: int) -> dict:
    """`measure` in a fresh process that sees `num_devices` CPU devices (or the real ones)."""
    env = dict(os.environ)
    if env.get("JAX_PLATFORMS", "cpu") == "cpu" and jax.default_backend() == "cpu":
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
        )
    argv = [arg for arg in sys.argv[1:] if not arg.startswith(("--json", "--child"))]
    result = subprocess.run(
        [sys.executable, sys.argv[0], *argv, f"--child={num_devices}", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    if result.returncode:
        sys.stderr.write(result.stderr)
        raise SystemExit(f"the {num_devices}-device run failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    if _CHILD.value:
        print(json.dumps(measure(cfg, _CHILD.value)))
        return
    runs = []
    for count in map(int, _DEVICES.value):
        try:  # a mesh that does not fit these devices is skipped, saying why
            kvlab.config.check_mesh_shape(cfg, sharding.mesh_shape(cfg.mesh, count))
        except ValueError as error:
            runs.append({"devices": count, "skipped": str(error)})
            continue
        runs.append(run_child(count))
    if _JSON.value:
        print(json.dumps({"config": cfg.to_dict(), "runs": runs}, indent=2))
        return
    print(
        f"{'devices':>7} {'mesh':>12} {'train ms':>9} {'train tok/s':>11} {'decode tok/s':>12} "
        f"{'cache B/dev':>11} {'collectives (count, KiB)':>26}"
    )
    for run in runs:
        if "skipped" in run:
            print(f"{run['devices']:>7} skipped: {run['skipped']}")
            continue
        mesh = "x".join(str(size) for size in run["mesh"].values())
        moved = run["train_collectives"]
        count = sum(kind["count"] for kind in moved.values())
        kib = sum(kind["bytes"] for kind in moved.values()) / 1024
        print(
            f"{run['devices']:>7} {mesh:>12} {run['train_step_s'] * 1e3:>9.1f} "
            f"{run['train_tokens_per_s']:>11.0f} {run['decode_tokens_per_s']:>12.0f} "
            f"{run['cache_bytes_per_device']:>11} {count:>14} {kib:>11.1f}"
        )


if __name__ == "__main__":
    cli.run(main)
