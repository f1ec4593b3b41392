"""Generation demo: prompts through the KV cache, with the cache's size and speed.

    python scripts/generate.py --config configs/gqa.py:tiny
    python scripts/generate.py --config configs/mqa.py:tiny --sampler=top_p --p=0.9 \
        --prompt="def main(" --prompt="import "

    python scripts/generate.py --workdir runs/cache_pareto/models/mha \
        --config configs/kv_k8v4.py:tiny        # a trained model through an 8/4-bit cache

    python scripts/generate.py --config configs/gqa.py:tiny \
        --config.data.tokenizer=path/to/model --config.model.vocab_size=50304 \
        --prompt="The KV cache"                 # text in, text out through tokenizer.json

    python scripts/generate.py --hf path/to/hf_model --config configs/kv_kivi2.py:tiny \
        --prompt="The KV cache"                 # a local Hugging Face checkpoint, KIVI cache

    python scripts/generate.py --config configs/gqa.py:tiny \
        --config.mesh.data=2 --config.mesh.tensor=4   # on 8 devices (kvlab.sharding.make_mesh)

    python scripts/generate.py --config configs/kvpress.py:kvzip   # KVzip's probes after prompts

Tokens are bytes (vocab 256) and a row stops after a newline, unless the
config's data.tokenizer names a real model's tokenizer.json: then prompts are
encoded by it, the output decoded by it, and a row stops after its end token
(eos, <|endoftext|>; none if it defines none). Without --workdir the weights
are random and the text is noise: the demo shows the mechanics - ragged
prompts decoded together, per-row stop, the cache's analytic and measured
bytes, decode tokens/s. With --workdir the model, its data section (so its
tokenizer) and its weights come from that training run and only the cache
section from --config. With --hf DIR (kvlab.cli.with_hf) they come from a
Hugging Face checkpoint folder: its model, its weights and, when it holds a
tokenizer.json, its tokenizer. The config's mesh section (default: data
parallel over every device) places the weights and the prompts' rows; on one
device nothing moves. On several hosts (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID on each, or --config.mesh.distributed=True)
the mesh spans them and process 0 prints.
"""

import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import kvlab
from kvlab import cli, sharding
from kvlab.cache.evict import scorer_of
from kvlab.data import load_tokenizer
from kvlab.data.text import decode_bytes
from kvlab.sampling import place_params
from kvlab.train import initial_params, load_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py:tiny", "kvlab config file.")
_PROMPTS = flags.DEFINE_multi_string(
    "prompt", ["def fibonacci(n):", "import ", "The KV cache"], "Prompts, one row each."
)
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Tokens generated per prompt.")
_SAMPLER = flags.DEFINE_enum(
    "sampler", "greedy", ["greedy", "temperature", "top_k", "top_p"], "How tokens are picked."
)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_K = flags.DEFINE_integer("k", 40, "top_k: tokens kept.")
_P = flags.DEFINE_float("p", 0.9, "top_p: probability mass kept.")
_END = flags.DEFINE_integer(
    "end_token",
    None,
    "A row stops after this token (-1: never; default: newline for bytes, the tokenizer's "
    "end token with data.tokenizer).",
)
_SEED = flags.DEFINE_integer("seed", 0, "Parameter and sampling seed.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run to take the model from.")
_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to take the model from.")


def make_sampler():
    name, temperature = _SAMPLER.value, _TEMPERATURE.value
    if name == "greedy":
        return kvlab.Greedy()
    if name == "temperature":
        return kvlab.Temperature(temperature)
    if name == "top_k":
        return kvlab.TopK(_K.value, temperature)
    return kvlab.TopP(_P.value, temperature)


def weights_label() -> str:
    if _HF.value is not None:
        return f"weights of {_HF.value}"
    return f"trained in {_WORKDIR.value}" if _WORKDIR.value else "untrained weights"


def main(argv):
    del argv
    cfg = kvlab.validate_config(_CONFIG.value)
    # Several hosts (mesh.distributed=True or JAX_COORDINATOR_ADDRESS, ...): joined
    # before anything below touches a device.
    sharding.initialize_distributed(cfg.mesh)
    if _HF.value is not None:
        cfg = cli.with_hf(cfg, _HF.value, workdir=_WORKDIR.value)
    elif _WORKDIR.value:
        trained, params = load_params(_WORKDIR.value)
        cfg.model, cfg.data = trained.model, trained.data
        kvlab.validate_config(cfg)
    mesh, rules = sharding.make_mesh(cfg), sharding.axis_rules(cfg.mesh)  # before any compile
    if _HF.value is not None:
        params = initial_params(cfg)
    elif not _WORKDIR.value:
        params = kvlab.init_params(cfg.model, jax.random.key(_SEED.value))
    cfg.model, params, _ = cli.decode_params(cfg.model, params, mesh.size)  # + native on 1 CPU
    model = kvlab.Transformer(cfg.model)
    if cfg.data.tokenizer:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        encode, decode, default_end = tokenizer.encode, tokenizer.decode, tokenizer.end_token
    else:
        encode, decode, default_end = lambda text: list(text.encode()), decode_bytes, ord("\n")
    end = default_end if _END.value is None else _END.value
    end = None if end is None or end < 0 else end
    encoded = [encode(prompt) for prompt in _PROMPTS.value]
    lengths = np.array([len(e) for e in encoded])
    prompts = np.zeros((len(encoded), lengths.max()), np.int32)  # right-padded
    for row, tokens in enumerate(encoded):
        prompts[row, : len(tokens)] = tokens
    if mesh.size > 1:  # generate runs on the mesh its prompts are laid out on
        params = place_params(cfg.model, params, mesh, rules)
        prompts = sharding.put_global(prompts, sharding.batch_sharding(mesh, rules, len(prompts)))

    scorer = scorer_of(cfg.cache.evict.method)
    probes = None
    if scorer is not None and scorer.observes == "probes":  # KVzip: each prompt repeated after it
        probes = [scorer.probe_tokens(encode, tokens) for tokens in encoded]

    def run():
        return kvlab.generate(
            model,
            params,
            prompts,
            cache_cfg=cfg.cache,
            max_new_tokens=_NEW.value,
            sampler=make_sampler(),
            prompt_lengths=lengths,
            end_token=end,
            rng=jax.random.key(_SEED.value),
            rules=rules,
            probes=probes,
        ).block_until_ready()

    run()  # compile
    start = time.perf_counter()
    out = sharding.fetch(run())  # every row on every host
    seconds = time.perf_counter() - start
    if not sharding.is_primary():  # process 0 reports
        return

    m = cfg.model
    print(
        f"{cli.attention_label(m)}; {m.num_layers} layers, head_dim {m.head_dim}, {weights_label()}"
    )
    generated = 0
    for row, length in enumerate(lengths):
        new = out[row, length : length + _NEW.value]
        if end is not None and (new == end).any():
            new = new[: np.argmax(new == end) + 1]
        generated += len(new)
        text, tail = decode(out[row, :length].tolist()), decode(new.tolist())
        print(f"  [{row}] {text!r} -> {tail!r}")
    batch, max_len = len(encoded), prompts.shape[1] + _NEW.value
    analytic = kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len)
    measured = kvlab.tree_bytes(kvlab.init_cache(cfg.model, cfg.cache, batch, max_len))
    on_mesh = ""
    if mesh.size > 1:
        held = kvlab.cache_bytes(
            cfg.model, cfg.cache, batch, max_len, per_device=True, mesh=mesh, rules=rules
        )
        on_mesh = f", {held:,} per device of the {sharding.describe_mesh(mesh)}"
    print(
        f"cache {kvlab.cache.cache_label(cfg.model, cfg.cache)}: {cli.count(batch, 'row')} x "
        f"{cli.count(max_len, 'token')}, {analytic:,} bytes analytic, {measured:,} "
        f"measured{on_mesh}"
    )
    print(
        f"generated {cli.count(generated, 'token')} in {seconds * 1e3:.1f} ms "
        f"({generated / seconds:,.0f} tokens/s, prefill included)"
    )


if __name__ == "__main__":
    cli.run(main)
