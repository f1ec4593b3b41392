"""Every cache kind, attention kind and backend exports for TPU and CUDA from this host.

`jax.export` lowers a program for a platform without its hardware (abstract
arguments from jax.eval_shape: nothing allocated, nothing compiled): it checks
that every operation has a lowering there and that the module verifies, not
that it runs or how fast. The program here is a prompt's chunk and a decode
step through the cache, so both of attention's paths are lowered. A program
lowered for TPU or CUDA must hold no CPU-only call (kvlab/kernels/native's
targets are `kvlab_*`): backends choose their kernels by the platform a
program is lowered for, never by the host it is traced on. With
attention_impl='pallas' a program lowered for CUDA holds the Triton kernel
where it reads stored data, and one lowered for TPU the Mosaic kernel (jax's
Mosaic lowering asks for the chip: the export runs in
`kvlab.backends.lowering_for`, an abstract mesh of one TPU v5e core). An
exported step serializes with the cache as a pytree
(kvlab/cache/serialization.py) and runs to the same numbers.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvlab
from kvlab.cache.evict import scorer_of
from kvlab.config import evict_methods, frozen
from kvlab.eval import perplexity
from kvlab.eval.calibrate import init_gates, save_filters, save_gates, save_patterns
from kvlab.serve import engine
from kvlab.train import init_state, train_step
from tests.helpers import ROOT

# cache fields of the tiny configs (k_/v_ name a latent model's latent_/rope_; window and
# topology are model fields)
CACHES = {
    "bfloat16": dict(dtype="bfloat16"),
    "8-bit per token": dict(k_bits=8, v_bits=8, k_axis="token"),
    "KIVI 2-bit": dict(k_bits=2, v_bits=2, k_axis="channel", residual=32, group_size=8),
    "paged": dict(kind="paged", dtype="bfloat16"),
    "paged 4-bit": dict(kind="paged", k_bits=4, v_bits=4),
    "snapkv": dict(dtype="bfloat16", evict=dict(method="snapkv", ratio=0.5)),
    "KIVI snapkv": dict(  # eviction over settling groups
        k_bits=2,
        v_bits=2,
        k_axis="channel",
        residual=16,  # a budget of 32 holds the ring (up to 23 tokens) and one group
        group_size=8,
        evict=dict(method="snapkv", ratio=0.5),
    ),
    "sliding window": dict(window=16),
    "rotated 4-bit": dict(  # keys (a latent) by Hadamard, values (RoPE keys) at random
        k_bits=4, v_bits=4, k_axis="token", k_transform="hadamard", v_transform="orthogonal"
    ),
    "cross-layer 4-bit": dict(topology="cla:2", k_bits=4, v_bits=4, k_axis="token"),
    "normal-float 4-bit": dict(k_bits=4, v_bits=4, k_format="nf", v_format="nf", k_axis="token"),
    "hybrid 4-bit": dict(  # a sliding layer's plain ring beside a full layer's 4-bit codes
        window=16, layer_types=("sliding", "full"), k_bits=4, v_bits=4, k_axis="token"
    ),
    "hybrid paged": dict(kind="paged", window=16, layer_types=("sliding", "full")),
}
PAGED_SNAPKV = dict(kind="paged", evict=dict(method="snapkv", ratio=0.5))
# The engine's caches: page pools, evicting or not (the engine owns the pages).
ENGINE_CACHES = ("paged", "paged 4-bit", "paged snapkv", "hybrid paged")
# Stored data Pallas reads (not normal-float codes: the kernels decline them)
STORED = (
    "8-bit per token",
    "KIVI 2-bit",
    "paged",
    "paged 4-bit",
    "rotated 4-bit",
    "cross-layer 4-bit",
    "hybrid 4-bit",
    "hybrid paged",
)
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
KERNEL = {"cuda": TRITON, "tpu": MOSAIC}
IMPLS = ["xla", "pallas", "native"]
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")


def config(attention: str, cache: str, impl: str):
    cfg = kvlab.load_config(f"{ROOT}/configs/{attention}.py:tiny")
    fields = dict({**CACHES, "paged snapkv": PAGED_SNAPKV}[cache])
    cfg.model.sliding_window = fields.pop("window", 0)
    cfg.model.topology = fields.pop("topology", "layerwise")
    cfg.model.layer_types = fields.pop("layer_types", ())
    # One layer (lowering a program costs about its layers) unless layers share a cache
    # or differ in kind.
    layerwise = cfg.model.topology == "layerwise" and not cfg.model.layer_types
    cfg.model.num_layers = 1 if layerwise else 2
    cfg.cache.evict.update(fields.pop("evict", {}))
    if attention == "mla":
        fields = {re.sub("^k_", "latent_", re.sub("^v_", "rope_", k)): v for k, v in fields.items()}
    cfg.cache.update(fields)
    cfg.model.attention_impl = impl
    return kvlab.validate_config(cfg)


def inference(cfg, loops: bool = True):
    """(the program, its abstract arguments): what runs with a cache, as one program:
    a 16-token prompt's prefill (kvlab.prefill's and evaluation's chunk_logits, one
    model.apply) then kvlab.decode_step; generate's loop (its own prefill with row
    lengths, then sampled decode steps); evaluation's comparison of logits. Without
    `loops`, the prefill and the decode step alone."""
    model = kvlab.Transformer(cfg.model)

    def programs(params, cache, prompt, token, rng):
        # evaluation's step over a chunk is kvlab.prefill's model.apply: traced once
        logits, stepped = perplexity.chunk_logits(model, params, cache, prompt)
        last, stepped = kvlab.decode_step(model, params, stepped, token)
        if not loops:
            return last, stepped
        lengths = jnp.full(prompt.shape[:1], prompt.shape[1], jnp.int32)
        out, errors = kvlab.sampling.generate_loop(
            model, kvlab.TopP(0.9), None, params, cache, prompt, lengths, 4, 0, rng
        )
        sums, kl = perplexity.compare_logits(logits, logits, prompt, jnp.ones(prompt.shape))
        return last, stepped, out, errors, sums, kl

    arguments = (
        abstract_params(cfg),
        jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, 2, 64)),
        jax.ShapeDtypeStruct((2, 16), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )
    return jax.jit(programs), arguments


def abstract_params(cfg):
    return jax.eval_shape(lambda: kvlab.init_params(cfg.model, jax.random.key(0)))


def assert_exports(program, arguments, kernel: bool):
    """`program` exports for TPU and for CUDA, holding no CPU-only call, and each
    platform's Pallas kernel exactly where `kernel`. A program without a kernel is
    lowered for both in one module (each platform's branches in it); one with a
    kernel for each alone (jax lowers every branch of a platform_dependent for
    every platform of a module, and a kernel lowers for its own only)."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    together = [("tpu", "cuda")] if not kernel else [("tpu",), ("cuda",)]
    # One trace serves both: the abstract TPU device only tells Mosaic which chip.
    with kvlab.backends.lowering_for("tpu"):
        modules = {
            platforms: export.export(program, platforms=platforms, disabled_checks=checks)(
                *arguments
            ).mlir_module()
            for platforms in together
        }
    for platforms, module in modules.items():
        calls = set(CUSTOM_CALL.findall(module))
        assert not {c for c in calls if c.startswith("kvlab_")}, (platforms, calls)
        wanted = {KERNEL[p] for p in platforms} if kernel else set()
        assert {c for c in calls if c in KERNEL.values()} == wanted, (platforms, calls)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_program_exports_for_tpu_and_cuda(attention, cache, impl):
    """The native kernels act only inside model.apply (attention over stored blocks,
    cache writes), where the prefill and the decode step reach every call they make
    for this cache; generate's loop and evaluation add no other (and exported
    for TPU or CUDA their programs are xla's): `native` exports those two."""
    program, arguments = inference(config(attention, cache, impl), loops=impl != "native")
    assert_exports(program, arguments, kernel=impl == "pallas" and cache in STORED)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_pool_and_an_observed_step_export_for_tpu_and_cuda(impl):
    """AdaKV's pool over float32 caches: a prefill and a decode step at interval 4,
    whose unobserved steps read the pool through Backend.pooled and whose observed
    ones through Backend.readers (the native kernels on the CPU), hold none of
    them lowered for TPU or CUDA."""
    cfg = config("gqa", "snapkv", impl)
    cfg.cache.dtype = "float32"
    cfg.cache.evict.update(method="adakv", interval=4)
    program, arguments = inference(kvlab.validate_config(cfg), loops=False)
    assert_exports(program, arguments, kernel=False)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_compressing_prefill_exports_for_tpu_and_cuda(attention):
    """cache.evict.when='after_prefill': generate's prompt compresses (compress=True),
    a compression sized per row at run time."""
    cfg = config(attention, "snapkv", "xla")
    cfg.cache.evict.update(when="after_prefill", headroom=8)
    program, arguments = inference(cfg)
    assert_exports(program, arguments, kernel=False)


@pytest.mark.parametrize(
    "method",
    # kvzip_head is duo_attention's code over other calibrated heads
    [m for m in evict_methods() if m not in ("none", "window", "sinks", "snapkv", "kvzip_head")]
    + ["chunkkv:lagkv", "think:knorm"],
)
def test_every_scorer_compresses_a_prefill_that_exports_for_tpu_and_cuda(method, tmp_path):
    """Each registered scorer, and wrappers over one (think: keys stored pruned of
    channels, read by their own reader), in the program that compresses
    a prompt (compress= each row's context length: kvzip's, half of it, the rest its
    probes) and decodes after it."""
    cfg = config("gqa", "snapkv", "xla")
    cfg.cache.evict.update(method=method, when="after_prefill", headroom=8)
    if method == "qfilter":  # its calibrated filters, [layers, KV heads, head_dim]
        shape = (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim)
        save_filters(tmp_path / "filters.npz", np.ones(shape))
        cfg.cache.evict.options = {"filters": str(tmp_path / "filters.npz")}
    if method == "duo_attention":  # its calibrated head scores, [layers, KV heads]
        save_patterns(tmp_path / "patterns.npz", np.ones((cfg.model.num_layers, 2)))
        cfg.cache.evict.options = {"patterns": str(tmp_path / "patterns.npz"), "recent_size": 4}
    if method == "fast_kvzip":  # its gates, fitted offline (untrained here)
        m = cfg.model
        gates = init_gates(m.num_layers, m.embed_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads)
        save_gates(tmp_path / "gates.npz", gates)
        cfg.cache.evict.options = {"gates": str(tmp_path / "gates.npz")}
    if method == "pyramidkv":  # per-layer budgets are fixed: a budget, not a share
        cfg.cache.evict.update(budget=12, ratio=1.0)
    cfg = kvlab.validate_config(cfg)
    model = kvlab.Transformer(cfg.model)
    share = 2 if scorer_of(method).observes == "probes" else 1

    def program(params, cache, prompt, token, rng):
        context = jnp.full(prompt.shape[:1], prompt.shape[1] // share, jnp.int32)
        _, cache = model.apply({"params": params}, prompt, cache=cache, compress=context)
        return kvlab.decode_step(model, params, cache, token)

    assert_exports(jax.jit(program), inference(cfg, loops=False)[1], kernel=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache", ENGINE_CACHES)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_the_engine_step_exports_for_tpu_and_cuda(attention, cache, impl):
    """kvlab.serve.engine's step: start_rows (an evicting cache's rows made ready),
    then greedy_run (a prompt chunk and decode steps in one loop over the slots)."""
    cfg = config(attention, cache, impl)
    model = kvlab.Transformer(cfg.model)
    evicting = cfg.cache.evict.method != "none"
    pool = dict(cfg.cache, num_pages=17)
    cache_shape = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, pool, 2, 64, own_pages=False))

    def step(params, cache, tokens, counts, budgets, starting, lengths, copies):
        if evicting:
            cache = engine.start_rows(cache, starting, lengths, copies)
        return engine.greedy_run(
            model, 4, params, cache, tokens, counts, True, budgets, 4, False, -1
        )

    rows = jax.ShapeDtypeStruct((2,), jnp.int32)
    arguments = (
        abstract_params(cfg),
        cache_shape,
        jax.ShapeDtypeStruct((2, 8), jnp.int32),
        rows,
        rows,
        jax.ShapeDtypeStruct((2,), jnp.bool_),
        rows,
        jax.ShapeDtypeStruct((3, 2), jnp.int32),
    )
    assert_exports(jax.jit(step), arguments, kernel=impl == "pallas" and not evicting)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_training_step_exports_for_tpu_and_cuda(attention, impl):
    """train_step (forward, gradients, AdamW; no cache) on a batch of 2 x 16 tokens."""
    cfg = config(attention, "bfloat16", impl)
    model = kvlab.Transformer(cfg.model)
    state = jax.eval_shape(lambda: init_state(cfg))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    batch = dict(inputs=tokens, targets=tokens, weights=jax.ShapeDtypeStruct((2, 16), jnp.float32))
    program = jax.jit(functools.partial(train_step, model, frozen(cfg.train)))
    assert_exports(program, (state, batch), kernel=False)


@pytest.mark.parametrize("cache", ["KIVI 2-bit", "paged 4-bit", "snapkv"])
def test_an_exported_step_round_trips_with_its_cache(cache):
    """Serialized and read back, the step (lowered for this CPU and for TPU) runs
    to the logits and cache the model computes, the cache a pytree of its kind."""
    assert_round_trips(config("gqa", cache, "xla"))


def assert_round_trips(cfg):
    """A step over cfg's cache, exported for this CPU and TPU, serialized and read
    back, gives the logits and the cache (of the same tree) the model computes."""
    model = kvlab.Transformer(cfg.model)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    tokens = jnp.array([[3, 4, 5], [6, 7, 8]], jnp.int32)

    def step(params, cache, tokens):
        return model.apply({"params": params}, tokens, cache=cache)

    abstract = jax.eval_shape(lambda: cache)
    exported = export.export(jax.jit(step), platforms=("cpu", "tpu"))(params, abstract, tokens)
    again = export.deserialize(exported.serialize())
    logits, stepped = again.call(params, cache, tokens)
    want_logits, want = jax.jit(step)(params, cache, tokens)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
    assert jax.tree.structure(stepped) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(stepped), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
