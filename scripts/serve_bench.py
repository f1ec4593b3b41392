"""Engine throughput against generating the same requests one at a time.

    python scripts/serve_bench.py --config configs/gqa.py:tiny --json
    python scripts/serve_bench.py --config configs/gqa.py:small --requests=16 --json \
        --config.model.dtype=float32 --config.cache.dtype=float32
    python scripts/serve_bench.py --config configs/kv_k8v4.py:tiny --requests=64 --max_slots=16

Requests with log-normal prompt lengths go (a) through kvlab.Engine, decoded
together over one paged cache (continuous batching), and (b) one by one
through kvlab.generate with a dense cache. Both are compiled before timing and
must give the same greedy tokens in float32 (the script fails otherwise). In
bfloat16 (the `small` and `base` sizes' default) logits tie often, and batched
and single arithmetic may break a tie differently, which changes that
request's tokens from there on: `requests_equal` counts the requests that
still agree. The engine runs on the config's mesh
(--config.mesh.*, kvlab.sharding.make_mesh: slots over data x fsdp), the
one-at-a-time reference on one device. Each is timed --repeats times, in turn
(a shared machine's load then weighs on both alike), and the best run of each
counts. Reports generated tokens/s for each, their ratio, and the engine's
device steps and compiled calls (a decode loop runs up to --decode_steps steps
in one call). Random weights, laid out by kvlab.cli.decode_params for both
(fused; 32-column panels for float32 on one CPU): speed does not depend on
what the model learned.
"""

import json
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, sharding

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "Model and cache.")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests in the workload.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated per request.")
_SLOTS = flags.DEFINE_integer("max_slots", 8, "Engine slots.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per slot and step.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_DECODE = flags.DEFINE_integer("decode_steps", 32, "Engine decode steps per compiled loop.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each, alternating; the best counts.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")


def workload(count, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(48), 0.7, count).round(), 1, 256).astype(int)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def one_at_a_time(model, params, cache_cfg, requests, max_len):
    outputs = []
    for prompt in requests:
        out = kvlab.generate(
            model,
            params,
            np.array([prompt], np.int32),
            cache_cfg=cache_cfg,
            max_new_tokens=_NEW.value,
            max_len=max_len,
        )
        outputs.append(np.asarray(out)[0, len(prompt) :].tolist())
    return outputs


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)  # before any compile
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    cfg.model, params, layout = cli.decode_params(cfg.model, params, mesh.size)
    model = kvlab.Transformer(cfg.model)
    requests = workload(_REQUESTS.value)
    max_len = max(map(len, requests)) + _NEW.value
    paged = kvlab.validate_config(cfg.copy_and_resolve_references()).cache
    paged.update(kind="paged", page_size=_PAGE.value, num_pages=0)
    dense = kvlab.validate_config(cfg.copy_and_resolve_references()).cache
    dense.kind = "dense"

    def new_engine():  # empty (no cached prefixes); its programs compile once
        return kvlab.Engine(
            cfg.model,
            paged,
            params,
            max_slots=_SLOTS.value,
            max_len=max_len,
            prefill_chunk=_CHUNK.value,
            decode_steps=_DECODE.value,
            mesh=mesh,
            rules=rules,
        )

    new_engine().warm_up()
    # Every prompt width compiles its own loop: compile them all first.
    one_at_a_time(model, params, dense, requests, max_len)
    engine_s, alone_s = [], []
    for _ in range(_REPEATS.value):  # alternating, so both meet the same load
        engine = new_engine()
        start = time.perf_counter()
        batched = engine.generate(requests, max_new_tokens=_NEW.value)
        engine_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        alone = one_at_a_time(model, params, dense, requests, max_len)
        alone_s.append(time.perf_counter() - start)
    engine_s, alone_s = min(engine_s), min(alone_s)

    generated = _REQUESTS.value * _NEW.value
    report = {
        "config": config_flags.get_config_filename(flags.FLAGS["config"]),
        "requests": _REQUESTS.value,
        "max_new_tokens": _NEW.value,
        "max_slots": _SLOTS.value,
        "decode_steps": _DECODE.value,
        "repeats": _REPEATS.value,
        "mean_prompt": float(np.mean([len(r) for r in requests])),
        "engine_tokens_per_s": generated / engine_s,
        "one_at_a_time_tokens_per_s": generated / alone_s,
        "speedup": alone_s / engine_s,
        "engine_steps": engine.stats.steps,
        "engine_calls": engine.stats.calls,
        "outputs_equal": batched == alone,
        "requests_equal": sum(a == b for a, b in zip(batched, alone, strict=True)),
        "dtype": cfg.model.dtype,
        "weight_layout": layout,
    }
    if _JSON.value:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
    if not report["outputs_equal"] and cfg.model.dtype == "float32":
        raise SystemExit("the engine's outputs differ from one-at-a-time generation")


if __name__ == "__main__":
    cli.run(main)
