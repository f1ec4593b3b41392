"""Decode speed: with the cache against recomputing the prefix, and against the roofline.

    python scripts/bench_decode.py --config configs/gqa.py:tiny --json
    python scripts/bench_decode.py --config configs/mha.py:small \
        --config.model.dtype=float32 --config.cache.dtype=float32 --lengths=1024

(a) For each context length L: tokens/s of greedy decode with the cache (a
compiled loop of --steps decode steps after a prefill of L tokens) against
recomputing: one full causal forward over the L-token prefix per new token.
(b) The memory roofline: a decode step reads every weight and the whole cache
buffer once, so it cannot beat (weight bytes + cache bytes) / bandwidth. The
bandwidth is measured in this process the way decode reads memory (a jitted
reduction over 512 MiB and a 256 MiB matrix-vector product, best of a few;
docs/references.md explains why an elementwise copy would understate it). The
script reports the step time's fraction of that bound.
(c) For latent-attention configs (model.attention='mla'): decode tokens/s of
the absorbed path against the expanded one at --mla_lengths, same weights.
(d) With --bits=16,8,4,2: decode tokens/s with every cached tensor stored at
each width (the config's axes, groups and residual), against the first; an
entry "bf16" is the 16-bit cache in bfloat16 (cache.dtype).
(e) With --evict=snapkv:0.5,window:0.25,snapkv:0.5:32: decode tokens/s with
each eviction policy keeping that share of the context (cache.evict,
kvlab/cache/evict/; a third field is cache.evict.interval, the method's own
without it; a method under
wrappers keeps its colons, chunkkv:knorm:0.5), against the config's own cache.
A calibrated method (qfilter, duo_attention, kvzip_head, fast_kvzip: kvlab.eval.calibrate's
SCORER_ARTEFACTS) is calibrated first on the benchmark's own random weights over
random tokens, into a temporary folder: its speed follows from what it keeps,
not from what it learned.
"""

import json
import tempfile

import jax
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import backends, cli
from kvlab.cache.evict.scorers import base_scorers
from kvlab.config import cached_prefixes
from kvlab.eval import speed
from kvlab.eval.calibrate import SCORER_ARTEFACTS, calibrate_scorers, with_artefacts

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_LENGTHS = flags.DEFINE_list("lengths", ["128", "256", "512", "1024", "2048"], "Context lengths.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Rows decoded together.")
_STEPS = flags.DEFINE_integer("steps", 64, "Decode steps timed per length.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timings per measurement; the best is kept.")
_MLA_LENGTHS = flags.DEFINE_list(
    "mla_lengths",
    ["512", "1024", "2048", "4096", "8192"],
    "Context lengths for absorbed vs expanded decode (latent-attention configs only).",
)
_MLA_STEPS = flags.DEFINE_integer("mla_steps", 8, "Decode steps timed per length and path.")
_BITS = flags.DEFINE_list(
    "bits",
    [],
    "Also time decode with every cached tensor at these bit-widths (e.g. 16,bf16,8,4,2; "
    "bf16: 16 bits in bfloat16).",
)
_EVICT = flags.DEFINE_list(
    "evict",
    [],
    "Also time decode through these eviction policies, method:ratio[:interval] "
    "(e.g. snapkv:0.5, snapkv:0.5:32; without an interval, the method's own).",
)
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 512, "Prompt tokens per prefill call.")
_PROBE_MIB = flags.DEFINE_integer(
    "probe_mib", 512, "Size of the bandwidth probes (the reduction; the matrix is half)."
)
_FUSE = flags.DEFINE_bool(
    "fuse_projections",
    True,
    "Decode from kvlab.fuse_projections(params) (one q/k/v and one gate/up product per layer).",
)
_NATIVE = flags.DEFINE_bool(
    "native_kernels",
    True,
    "With --fuse_projections, float32 on one CPU: weights in 32-column panels "
    "(kvlab.kernels.native.panel_projections) and model.attention_impl='native'.",
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")


def random_prompt(cfg, batch: int, length: int):
    return speed.random_prompt(cfg.model.vocab_size, batch, length)


def decode_step_time(cfg, model, params, tokens, steps: int, repeats: int) -> float:
    """Seconds per greedy decode step after a prefill of `tokens` (not timed)."""
    return speed.decode_step_time(
        cfg, model, params, tokens, steps, repeats, prefill_chunk=_PREFILL_CHUNK.value
    )


def decode_step_times(variants, params, tokens, steps: int, repeats: int) -> dict:
    """Seconds per decode step of each of `variants` ({name: (cfg, model)}), timed in turn."""
    return speed.decode_step_times(
        variants, params, tokens, steps, repeats, prefill_chunk=_PREFILL_CHUNK.value
    )


def bench_length(cfg, model, params, length: int, batch: int, steps: int, repeats: int) -> dict:
    """(a) and (b) at one context length."""
    tokens = random_prompt(cfg, batch, length)
    decode_step = decode_step_time(cfg, model, params, tokens, steps, repeats)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t)[0][:, -1].argmax(-1))
    recompute_step = speed.best_time(lambda: forward(params, tokens), repeats)
    return dict(
        seq_len=length,
        cached_tokens_per_s=batch / decode_step,
        recompute_tokens_per_s=batch / recompute_step,
        speedup=recompute_step / decode_step,
        decode_step_s=decode_step,
        cache_bytes=kvlab.cache_bytes(cfg.model, cfg.cache, batch, length + steps),
    )


def bench_mla_paths(cfg, params, lengths, batch: int, steps: int, repeats: int) -> list[dict]:
    """(c) Latent attention: absorbed against expanded decode at each context length."""
    variants = {}
    for absorb in (True, False):
        variant = cfg.copy_and_resolve_references()
        variant.model.mla.absorb = absorb
        variants[absorb] = (variant, kvlab.Transformer(variant.model))
    rows = []
    for length in lengths:
        tokens = random_prompt(cfg, batch, length)
        seconds = decode_step_times(variants, params, tokens, steps, repeats)
        rows.append(
            dict(
                seq_len=length,
                absorbed_tokens_per_s=batch / seconds[True],
                expanded_tokens_per_s=batch / seconds[False],
                absorbed_speedup=seconds[False] / seconds[True],
            )
        )
    return rows


def bench_caches(cfg, model, params, lengths, caches, key, batch, steps, repeats) -> list[dict]:
    """Decode tokens/s through each of `caches` ({name: cache fields changed}) at
    each length, against the first (timed in turn, speed.decode_step_times); each
    row names its cache under `key`."""
    variants = {}
    for name, fields in caches.items():
        variant = cfg.copy_and_resolve_references()
        with variant.cache.evict.options.unlocked():  # a method's options are its own
            variant.cache.update(fields)
        variants[name] = (kvlab.validate_config(variant), model)
    rows = []
    first = next(iter(caches))
    for length in lengths:
        tokens = random_prompt(cfg, batch, length)
        seconds = decode_step_times(variants, params, tokens, steps, repeats)
        sizes = {
            name: kvlab.cache_bytes(variant.model, variant.cache, batch, length + steps)
            for name, (variant, _) in variants.items()
        }
        for name in variants:
            rows.append(
                {
                    key: name,
                    "seq_len": length,
                    "tokens_per_s": batch / seconds[name],
                    "cache_bytes": sizes[name],
                    "speed_vs_first": seconds[first] / seconds[name],
                    "bytes_vs_first": sizes[name] / sizes[first],
                }
            )
    return rows


def parse_bits(entry: str) -> int | str:
    """A --bits entry: 16, 8, 4, 2 or 'bf16'."""
    if entry == "bf16":
        return entry
    if entry not in ("16", "8", "4", "2"):
        raise ValueError(
            f"--bits entry {entry!r} is not one of 16, bf16, 8, 4, 2: pass e.g. 16,8,4"
        )
    return int(entry)


def bench_bit_widths(cfg, model, params, lengths, bit_widths, batch, steps, repeats) -> list[dict]:
    """(d) Decode tokens/s with every cached tensor stored at each bit-width."""
    prefixes = cached_prefixes(cfg.model)
    caches = {}
    for bits in bit_widths:
        width = 16 if bits == "bf16" else bits
        caches[bits] = {f"{prefix}_bits": width for prefix in prefixes}
        if bits == "bf16":
            caches[bits]["dtype"] = "bfloat16"
    return bench_caches(cfg, model, params, lengths, caches, "bits", batch, steps, repeats)


def bench_evictions(
    cfg, model, params, lengths, policies, batch, steps, repeats, calibration
) -> list[dict]:
    """(e) Decode tokens/s through eviction policies ('method:ratio', or
    'method:ratio:interval' for cache.evict.interval, 0 without), against the full cache;
    `calibration`: the (model config, params) a calibrated method's artefact is
    computed from (the weights before decode_params' layout)."""
    caches = {"full": {}}
    for policy in policies:
        # The method may hold wrappers ('chunkkv:knorm'): the numbers are the last fields.
        fields = policy.split(":")
        numbers = 2 if len(fields) > 2 and fields[-1].isdigit() else 1
        method, (ratio, *rest) = ":".join(fields[:-numbers]), fields[-numbers:]
        try:
            share, interval = float(ratio), int(rest[0]) if rest else 0
        except ValueError:
            share = float("nan")
        if share != share or not method:
            raise ValueError(
                f"--evict={policy!r}: give method:ratio or method:ratio:interval, "
                "e.g. snapkv:0.5, snapkv:0.5:32 or chunkkv:knorm:0.5"
            )
        caches[policy] = {"evict": {"method": method, "ratio": share, "interval": interval}}
    scorers = [s for p in policies for s in base_scorers(caches[p]["evict"]["method"])]
    with tempfile.TemporaryDirectory(prefix="kvlab-bench-") as folder:
        if set(scorers) & set(SCORER_ARTEFACTS):
            model_cfg, weights = calibration
            vocab = model_cfg.vocab_size
            encode = lambda text: [b % vocab for b in text.encode()]  # noqa: E731
            tokens = speed.random_prompt(vocab, 8, 512)
            calibrate_scorers(scorers, folder, model_cfg, weights, encode, tokens)
            for fields in list(caches.values())[1:]:
                evict = fields["evict"]
                evict["options"] = {}
                with_artefacts(evict["options"], base_scorers(evict["method"]), folder)
        return bench_caches(cfg, model, params, lengths, caches, "evict", batch, steps, repeats)


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    calibration = (cfg.model, params)
    layout = "separate"
    if _FUSE.value:
        cfg.model, params, layout = cli.decode_params(
            cfg.model, params, native_kernels=_NATIVE.value
        )
    model = kvlab.Transformer(cfg.model)
    weight_bytes = kvlab.tree_bytes(params)
    bandwidth = speed.memory_bandwidth(_PROBE_MIB.value, _REPEATS.value)
    best_bandwidth = max(bandwidth.values())
    rows = []
    for length in [int(n) for n in _LENGTHS.value]:
        row = bench_length(cfg, model, params, length, _BATCH.value, _STEPS.value, _REPEATS.value)
        row["bytes_per_step"] = weight_bytes + row["cache_bytes"]
        row["roofline_step_s"] = row["bytes_per_step"] / best_bandwidth
        row["roofline_fraction"] = row["roofline_step_s"] / row["decode_step_s"]
        rows.append(row)
    result = dict(
        config=cfg.model.to_dict() | {"cache": cfg.cache.to_dict()},
        backend=jax.default_backend(),
        batch_size=_BATCH.value,
        weight_layout=layout,
        native_kernels=backends.get("native").unavailable_reason() or "available",
        weight_bytes=weight_bytes,
        bandwidth_bytes_per_s=bandwidth,
        rows=rows,
    )
    if cfg.model.attention == "mla":
        result["mla_paths"] = bench_mla_paths(
            cfg,
            params,
            [int(n) for n in _MLA_LENGTHS.value],
            _BATCH.value,
            _MLA_STEPS.value,
            _REPEATS.value,
        )
    if _BITS.value:
        result["bit_widths"] = bench_bit_widths(
            cfg,
            model,
            params,
            [int(n) for n in _LENGTHS.value],
            [parse_bits(b) for b in _BITS.value],
            _BATCH.value,
            _STEPS.value,
            _REPEATS.value,
        )
    if _EVICT.value:
        result["evictions"] = bench_evictions(
            cfg,
            model,
            params,
            [int(n) for n in _LENGTHS.value],
            _EVICT.value,
            _BATCH.value,
            _STEPS.value,
            _REPEATS.value,
            calibration,
        )
    if _JSON.value:
        print(json.dumps(result, indent=2))
        return
    print(
        f"weights {weight_bytes / 2**20:.1f} MiB; bandwidth "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items())
    )
    print(
        f"{'seq_len':>8} {'cached tok/s':>13} {'recompute tok/s':>16} {'speedup':>8} "
        f"{'step ms':>8} {'roofline ms':>12} {'fraction':>9}"
    )
    for r in rows:
        print(
            f"{r['seq_len']:>8} {r['cached_tokens_per_s']:>13.1f} "
            f"{r['recompute_tokens_per_s']:>16.1f} {r['speedup']:>8.1f} "
            f"{r['decode_step_s'] * 1e3:>8.3f} {r['roofline_step_s'] * 1e3:>12.3f} "
            f"{r['roofline_fraction']:>9.2f}"
        )
    if "bit_widths" in result:
        print("decode by cache bit-width:")
        print(
            f"{'bits':>5} {'seq_len':>8} {'tok/s':>10} {'vs first':>9} {'cache bytes':>12} "
            f"{'vs first':>9}"
        )
        for r in result["bit_widths"]:
            print(
                f"{r['bits']:>5} {r['seq_len']:>8} {r['tokens_per_s']:>10.1f} "
                f"{r['speed_vs_first']:>9.2f} {r['cache_bytes']:>12,} {r['bytes_vs_first']:>9.2f}"
            )
    if "evictions" in result:
        print("decode by eviction policy:")
        print(
            f"{'policy':>12} {'seq_len':>8} {'tok/s':>10} {'vs full':>8} {'cache bytes':>12} "
            f"{'vs full':>8}"
        )
        for r in result["evictions"]:
            print(
                f"{r['evict']:>12} {r['seq_len']:>8} {r['tokens_per_s']:>10.1f} "
                f"{r['speed_vs_first']:>8.2f} {r['cache_bytes']:>12,} {r['bytes_vs_first']:>8.2f}"
            )
    if "mla_paths" in result:
        print("latent attention decode, tokens/s:")
        print(f"{'seq_len':>8} {'absorbed':>10} {'expanded':>10} {'absorbed/expanded':>18}")
        for r in result["mla_paths"]:
            print(
                f"{r['seq_len']:>8} {r['absorbed_tokens_per_s']:>10.1f} "
                f"{r['expanded_tokens_per_s']:>10.1f} {r['absorbed_speedup']:>18.1f}"
            )


if __name__ == "__main__":
    cli.run(main)
