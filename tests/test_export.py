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

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvlab
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
    "sliding window": dict(window=16),
    "rotated 4-bit": dict(k_bits=4, v_bits=4, k_axis="token", k_transform="hadamard"),
    "cross-layer 4-bit": dict(topology="cla:2", k_bits=4, v_bits=4, k_axis="token"),
    "normal-float 4-bit": dict(k_bits=4, v_bits=4, k_format="nf", v_format="nf", k_axis="token"),
}
# Stored data Pallas reads (not normal-float codes: the kernels decline them)
STORED = (
    "8-bit per token",
    "KIVI 2-bit",
    "paged",
    "paged 4-bit",
    "rotated 4-bit",
    "cross-layer 4-bit",
)
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
KERNEL = {"cuda": TRITON, "tpu": MOSAIC}
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")


def config(attention: str, cache: str, impl: str):
    cfg = kvlab.load_config(f"{ROOT}/configs/{attention}.py:tiny")
    fields = dict(CACHES[cache])
    cfg.model.sliding_window = fields.pop("window", 0)
    cfg.model.topology = fields.pop("topology", "layerwise")
    cfg.cache.evict.update(fields.pop("evict", {}))
    if attention == "mla":
        fields = {re.sub("^k_", "latent_", re.sub("^v_", "rope_", k)): v for k, v in fields.items()}
    cfg.cache.update(fields)
    cfg.model.attention_impl = impl
    return kvlab.validate_config(cfg)


def prompt_then_step(cfg):
    """(the program, its abstract arguments): a 16-token chunk, then one token."""
    model = kvlab.Transformer(cfg.model)

    def steps(params, cache, prompt, token):
        logits, cache = model.apply({"params": params}, prompt, cache=cache)
        last, cache = model.apply({"params": params}, token, cache=cache)
        return logits, last, cache

    params = jax.eval_shape(lambda: kvlab.init_params(cfg.model, jax.random.key(0)))
    cache = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, 2, 64))
    tokens = (jax.ShapeDtypeStruct((2, 16), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32))
    return jax.jit(steps), (params, cache, *tokens)


@pytest.mark.parametrize("impl", ["xla", "pallas", "native"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_program_exports_for_tpu_and_cuda(attention, cache, impl):
    program, arguments = prompt_then_step(config(attention, cache, impl))
    for platform in ("tpu", "cuda"):
        checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
        with kvlab.backends.lowering_for(platform):
            exported = export.export(program, platforms=(platform,), disabled_checks=checks)
            calls = set(CUSTOM_CALL.findall(exported(*arguments).mlir_module()))
        assert not {c for c in calls if c.startswith("kvlab_")}, (platform, calls)
        kernel = impl == "pallas" and cache in STORED
        assert {c for c in calls if c in KERNEL.values()} == (
            {KERNEL[platform]} if kernel else set()
        ), (platform, calls)


@pytest.mark.parametrize("cache", ["KIVI 2-bit", "paged 4-bit", "snapkv"])
def test_an_exported_step_round_trips_with_its_cache(cache):
    """Serialized and read back, the step (lowered for this CPU and for TPU) runs
    to the logits and cache the model computes, the cache a pytree of its kind."""
    cfg = config("gqa", cache, "xla")
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
