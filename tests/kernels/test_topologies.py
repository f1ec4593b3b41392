"""The kernels under cross-layer caches (model.topology): a layer CLA shares is read
by the kernels as any cache layer; a joint layer (xKV's coded run, MiniCache's
merged pair) is declined and read by the reference, never read wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab import backends
from kvlab.kernels import native
from tests.cache.test_xkv import coded
from tests.helpers import VARIANTS, build, last_logits, random_tokens

# Layers of the 4 whose stored tokens a kernel reads: every one a shared layer's
# reader; of minicache:2 the two before the merged pair; of xkv:2 none.
READ_BY_KERNELS = {"cla:2": 4, "minicache:2": 2, "xkv:2": 0}


def topology_config(tmp_path, topology: str):
    if topology.startswith("xkv"):  # 8-bit codes in 24 of a run's 32 directions
        cfg, _ = coded(tmp_path, rank=24)
        cfg.cache.update(k_bits=8, v_bits=8, k_axis="token", v_axis="token", group_size=8)
        return cfg
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers, cfg.model.topology = 4, topology
    cfg.cache.update(k_bits=4, v_bits=4, k_axis="token", v_axis="token", group_size=4)
    return cfg


def kernel_reads(cfg, monkeypatch) -> int:
    """Blocks of stored tokens the backend's kernel takes in a decode step's trace."""
    backend = backends.get(cfg.model.attention_impl)
    taken = []
    partial = backend.partial
    monkeypatch.setattr(backend, "partial", lambda *a: taken.append(partial(*a)) or taken[-1])
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 32)
    step = lambda c, t: kvlab.prefill(model, params, c, t)  # noqa: E731
    jax.make_jaxpr(step)(cache, jnp.zeros((2, 1), jnp.int32))
    return sum(t is not None for t in taken)


@pytest.mark.parametrize("topology", READ_BY_KERNELS)
@pytest.mark.parametrize("impl", ["native", "pallas"])
def test_the_kernels_give_the_reference_logits_under_every_topology(
    tmp_path, topology, impl, monkeypatch
):
    """A prefill and three decode steps: the XLA path's logits, the bytes counted
    the tree's (last_logits), the kernel reading the layers it can."""
    if impl == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    cfg = topology_config(tmp_path, topology)
    tokens = random_tokens(cfg, (2, 15), seed=4)
    want = last_logits(cfg, cfg.cache, tokens, 12)
    cfg.model.attention_impl = impl
    np.testing.assert_allclose(last_logits(cfg, cfg.cache, tokens, 12), want, atol=2e-5, rtol=0)
    assert kernel_reads(cfg, monkeypatch) == READ_BY_KERNELS[topology]
