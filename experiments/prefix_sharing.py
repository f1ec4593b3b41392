"""Prefix caching on a shared-system-prompt workload: prefill computed, time to first token.

    python experiments/prefix_sharing.py --workdir runs/prefix_sharing
    python experiments/prefix_sharing.py --config configs/mla.py:tiny --system_len=256

Every request is one long system prompt followed by a short user turn of its
own. The same requests go through kvlab.Engine twice, with
cache.prefix_caching off and on; the outputs must agree. Reports the prompt
tokens the engine computed, the mean and median time to first token and the
wall time of each, and writes results.json and prefix.png under --workdir.
Random weights: the work done does not depend on what the model learned.
"""

import json
import os

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "Model and cache.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/prefix_sharing", "Where results go.")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests in the workload.")
_SYSTEM = flags.DEFINE_integer("system_len", 192, "Tokens of the shared system prompt.")
_USER = flags.DEFINE_integer("user_len", 24, "Mean tokens of each request's own turn.")
_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per request.")
_SLOTS = flags.DEFINE_integer("max_slots", 8, "Engine slots.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per slot and step.")


def workload(count, system_len, user_len, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, system_len).tolist()
    return [
        system + rng.integers(0, 256, int(rng.integers(1, 2 * user_len))).tolist()
        for _ in range(count)
    ]


def run(cfg, params, requests, prefix_caching):
    cache = kvlab.validate_config(cfg.copy_and_resolve_references()).cache
    cache.update(kind="paged", prefix_caching=prefix_caching)
    max_len = max(map(len, requests)) + _NEW.value

    engine = kvlab.Engine(
        cfg.model,
        cache,
        params,
        max_slots=_SLOTS.value,
        max_len=max_len,
        prefill_chunk=_CHUNK.value,
    )
    engine.warm_up()  # compiles the step program; caches no prefix
    outputs = engine.generate(requests, max_new_tokens=_NEW.value)
    stats = engine.stats
    ttft = np.array(stats.time_to_first_token_s)
    return outputs, {
        "prefix_caching": prefix_caching,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens_computed": stats.prefill_tokens,
        "hit_rate": engine.pages.stats.hit_rate,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_median_s": float(np.median(ttft)),
        "seconds": stats.seconds,
        "steps": stats.steps,
        "preemptions": stats.preemptions,
    }


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    requests = workload(_REQUESTS.value, _SYSTEM.value, _USER.value)
    off_out, off = run(cfg, params, requests, False)
    on_out, on = run(cfg, params, requests, True)
    report = {
        "config": config_flags.get_config_filename(flags.FLAGS["config"]),
        "requests": len(requests),
        "system_len": _SYSTEM.value,
        "outputs_equal": off_out == on_out,
        "off": off,
        "on": on,
        "prefill_saved": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
        "ttft_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
    }
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(_WORKDIR.value, "prefix.png"))
    print(json.dumps(report, indent=2))
    if not report["outputs_equal"]:
        raise SystemExit("prefix caching changed the outputs")


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["prefix caching off", "on"]
    runs = [report["off"], report["on"]]
    fig, (tokens, ttft) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=120)
    tokens.bar(labels, [r["prefill_tokens_computed"] for r in runs], color="tab:blue")
    tokens.set_ylabel("prompt tokens computed")
    ttft.bar(labels, [1e3 * r["ttft_mean_s"] for r in runs], color="tab:orange")
    ttft.set_ylabel("mean time to first token (ms)")
    fig.suptitle(f"{report['requests']} requests sharing a {report['system_len']}-token prompt")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
