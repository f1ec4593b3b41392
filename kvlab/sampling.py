"""Jitted prefill and decode steps, samplers, and generation.

    prefill(model, params, cache, tokens [B, T], num_tokens [B] | None)
        -> (logits [B, T, V], cache)
    decode_step(model, params, cache, tokens [B], num_tokens [B] | None)
        -> (logits [B, V], cache)
    generate(model, params, prompts [B, T], cache_cfg=..., max_new_tokens=M,
             sampler=Greedy(), prompt_lengths=None, end_token=None)
        -> int32[B, T + M]
    place_params(model_cfg, params, mesh, rules) -> params laid out on the mesh

Both steps donate the cache they are given (its buffers are reused for the
result; do not read the old cache afterwards) and compile once per shape:
lengths are arrays, never Python ints. Inside them nothing can raise: a row
given invalid values (or more tokens than the cache holds) is flagged in
`cache.errors`; call `cache.check()` on the host (kvlab/model.py).
`generate` checks its inputs and capacity before it starts instead, then runs
the whole decode loop inside one compiled `lax.while_loop`.

Samplers are small frozen dataclasses called as `sampler(logits [B, V], rng)
-> int32[B]`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvlab import sharding
from kvlab.cache import evict
from kvlab.cache.dense import Cache, check_errors
from kvlab.cache.factory import compiled_builder
from kvlab.cache.placement import write_tokens
from kvlab.config import check_count, validate_cache_config
from kvlab.model import Transformer, check_inputs, fuse_projections, param_axes

# ---------------------------------------------------------------------------
# Samplers


@dataclasses.dataclass(frozen=True)
class Greedy:
    """The most likely token."""

    def __call__(self, logits: jax.Array, rng: jax.Array) -> jax.Array:
        del rng
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _check_temperature(sampler) -> None:
    if not sampler.temperature > 0:
        raise ValueError(
            f"{type(sampler).__name__}.temperature={sampler.temperature!r} must be > 0: "
            f"use Greedy() for temperature 0"
        )


@dataclasses.dataclass(frozen=True)
class Temperature:
    """A sample from softmax(logits / temperature)."""

    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self)

    def __call__(self, logits, rng):
        return jax.random.categorical(rng, logits / self.temperature).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopK:
    """A sample among the k most likely tokens (ties with the k-th are kept)."""

    k: int
    temperature: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "k", check_count("TopK.k", self.k))
        _check_temperature(self)

    def __call__(self, logits, rng):
        k = min(self.k, logits.shape[-1])
        kth_largest = jax.lax.top_k(logits, k)[0][..., -1:]  # [B, 1]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
        return jax.random.categorical(rng, logits / self.temperature).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP:
    """Nucleus sampling (arXiv:1904.09751): a sample among the most likely tokens
    whose probabilities (at this temperature) first reach p together."""

    p: float
    temperature: float = 1.0

    def __post_init__(self):
        if not 0 < self.p <= 1:
            raise ValueError(f"TopP.p={self.p!r} must lie in (0, 1]: 1 keeps every token")
        _check_temperature(self)

    def __call__(self, logits, rng):
        logits = logits / self.temperature
        descending = -jnp.sort(-logits, axis=-1)  # [B, V]
        probs = jax.nn.softmax(descending, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(mass_before < self.p, axis=-1, keepdims=True)  # [B, 1], >= 1
        threshold = jnp.take_along_axis(descending, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
        return jax.random.categorical(rng, logits).astype(jnp.int32)


# ---------------------------------------------------------------------------
# Steps


def place_params(model_cfg: Mapping, params, mesh: Mesh | None, rules: tuple | None = None):
    """`params` (fused or not, kvlab.model.fuse_projections) laid out on `mesh` by
    their logical axes (kvlab/sharding.py; `rules` default
    kvlab.sharding.axis_rules()); as they are without a mesh."""
    if mesh is None:
        return params
    if mesh.size == 1:  # whatever the layout (a plug-in's decode layout too): whole
        return jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    rules = sharding.axis_rules() if rules is None else rules
    axes = param_axes(model_cfg)

    def structure(tree):
        return jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))

    if structure(axes) != structure(params):
        axes = fuse_projections(axes)  # a fused tree
    if structure(axes) != structure(params):
        raise ValueError(
            f"place_params on a mesh of {mesh.size} devices takes the parameter tree of "
            "kvlab.init_params for this model (fused or not), not another: a plug-in's decode "
            "layout (e.g. kvlab.kernels.native.panel_projections) is for one device"
        )
    return sharding.put_global(params, sharding.shardings(axes, params, mesh, rules))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(model: Transformer, params, cache: Cache, tokens, num_tokens=None, compress=None):
    """Appends tokens [B, T] (num_tokens[b] real per row) and returns all logits;
    `compress` (bool or bool[B]): the rows' context ends here; int32[B]: each row's
    whole context length, compressed block by block (Transformer)."""
    return model.apply(
        {"params": params}, tokens, cache=cache, num_tokens=num_tokens, compress=compress
    )


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_step(model: Transformer, params, cache: Cache, tokens, num_tokens=None):
    """Appends one token per row (rows with num_tokens 0 stay as they are)."""
    logits, cache = model.apply(
        {"params": params}, tokens[:, None], cache=cache, num_tokens=num_tokens
    )
    return logits[:, 0], cache


# ---------------------------------------------------------------------------
# Generation


@struct.dataclass
class _LoopState:
    step: jax.Array  # int32 scalar: tokens generated by each row still running
    cache: Cache
    out: jax.Array  # int32[B, max_len]: prompts, then generated tokens, then padding
    token: jax.Array  # int32[B]: the last token emitted, fed in next
    done: jax.Array  # bool[B]: row emitted end_token
    rng: jax.Array


def _emit(state: _LoopState, token) -> _LoopState:
    """Writes each live row's token right after the tokens its cache holds."""
    slots = jnp.where(state.done, state.out.shape[1], state.cache.lengths)[:, None]
    out = write_tokens(state.out, token[:, None], slots)
    return state.replace(out=out, token=token)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def generate_loop(
    model,
    sampler,
    end_token,
    params,
    cache,
    prompts,
    prompt_lengths,
    max_new_tokens,
    pad_token,
    rng,
    probes=None,
    probe_lengths=None,
):
    """generate's one compiled program (its arguments checked by `generate`): the
    prompts' prefill, then sampled decode steps in a `lax.while_loop` until every
    row has max_new_tokens or end_token. Returns (tokens int32[B, capacity], the
    cache's error flags). `probes` int32[B, P] (`probe_lengths` of each row): fed
    right after each row's prompt in its prefill, which compresses the prompt by
    them (a cache whose scorer observes probes, KVzip); they are never stored."""
    # The cache comes in as an argument: built inside, its zeros are constants
    # XLA folds reductions over (seconds of compile per layer at batch 8).
    batch, prompt_len = prompts.shape
    fed, counts, compress = prompts, prompt_lengths, True  # the prompt is the context
    if probes is not None:
        fed, counts = _after_prompts(prompts, prompt_lengths, probes, probe_lengths)
        compress = prompt_lengths  # the context each row's probes follow
    logits, cache = model.apply(
        {"params": params},
        fed,
        cache=cache,
        num_tokens=counts,
        logits_at=prompt_lengths - 1,
        compress=compress,  # (cache.evict.when='after_prefill')
    )
    rng, key = jax.random.split(rng)
    token = sampler(logits[:, 0], key)
    in_prompt = jnp.arange(prompt_len)[None, :] < prompt_lengths[:, None]
    out = jnp.full((batch, cache.capacity), pad_token, jnp.int32)
    out = out.at[:, :prompt_len].set(jnp.where(in_prompt, prompts, pad_token))
    done = jnp.zeros((batch,), bool)
    state = _emit(_LoopState(jnp.int32(1), cache, out, token, done, rng), token)
    if end_token is not None:
        state = state.replace(done=token == end_token)

    def running(state):
        return (state.step < max_new_tokens) & ~jnp.all(state.done)

    def step(state):
        logits, cache = model.apply(
            {"params": params},
            state.token[:, None],
            cache=state.cache,
            num_tokens=(~state.done).astype(jnp.int32),
        )
        rng, key = jax.random.split(state.rng)
        token = sampler(logits[:, 0], key)
        state = _emit(state.replace(cache=cache, rng=rng, step=state.step + 1), token)
        if end_token is not None:
            state = state.replace(done=state.done | (token == end_token))
        return state

    state = jax.lax.while_loop(running, step, state)
    return state.out, state.cache.errors


def _after_prompts(prompts, prompt_lengths, probes, probe_lengths):
    """int32[B, T + P]: each row's probes right after its prompt, padded with 0; and
    the tokens fed per row."""
    width = prompts.shape[1] + probes.shape[1]
    index = jnp.arange(width)[None, :]
    start, end = prompt_lengths[:, None], (prompt_lengths + probe_lengths)[:, None]
    take = lambda x, i: jnp.take_along_axis(x, jnp.clip(i, 0, x.shape[1] - 1), axis=1)  # noqa: E731
    tokens = jnp.where(index < start, take(prompts, index), take(probes, index - start))
    return jnp.where(index < end, tokens, 0), prompt_lengths + probe_lengths


def _checked_probes(model: Transformer, cache_cfg: Mapping, probes, batch: int):
    """generate's `probes` checked against the cache (ValueError naming the fix):
    int32[B, P] and each row's count, or (None, None) without them."""
    scorer = evict.scorer_of(cache_cfg["evict"]["method"])
    probing = scorer is not None and scorer.observes == "probes"
    if probes is None:
        if probing:
            raise ValueError(
                f"cache.evict.method={cache_cfg['evict']['method']!r} compresses each prompt "
                "by probes fed after it: pass probes=, per row the token ids of "
                "kvlab.cache.evict.scorer_of(method).probe_tokens(encode, prompt)"
            )
        return None, None
    if not probing:
        raise ValueError(
            f"probes= given, but cache.evict.method={cache_cfg['evict']['method']!r} reads "
            "no probes: leave probes out, or compress by a scorer that observes them (kvzip)"
        )
    rows = [np.asarray(row, np.int64).reshape(-1) for row in probes]
    if len(rows) != batch:
        raise ValueError(f"probes has {len(rows)} rows for {batch} prompts: give one per prompt")
    vocab = model.config.vocab_size
    for b, row in enumerate(rows):
        if not len(row) or row.min() < 0 or row.max() >= vocab:
            raise ValueError(
                f"probes[{b}] is empty or leaves the vocabulary 0..{vocab - 1}: give each "
                "row its probe token ids"
            )
    out = np.zeros((batch, max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out, np.array([len(row) for row in rows], np.int32)


def _checked_arguments(
    model: Transformer, prompts, prompt_lengths, max_new_tokens, end_token, pad_token, max_len
) -> tuple:
    """generate's arguments checked (ValueError naming the fix) and completed:
    (prompt_lengths int[B] on the host, max_new_tokens, end_token, pad_token, max_len)."""
    if prompts.ndim != 2:
        raise ValueError(f"prompts has shape {prompts.shape}: pass int32[batch, length]")
    batch, prompt_len = prompts.shape
    if prompt_lengths is None:
        prompt_lengths = np.full((batch,), prompt_len)
    prompt_lengths = np.asarray(prompt_lengths)
    check_inputs(model.config, prompts, None, prompt_lengths)
    if (prompt_lengths < 1).any():
        row = int(np.argmin(prompt_lengths))
        raise ValueError(f"prompt_lengths[{row}]=0: every prompt needs at least one token")
    max_new_tokens = check_count("max_new_tokens", max_new_tokens)
    vocab = model.config.vocab_size
    if end_token is not None:
        end_token = check_count("end_token", end_token, minimum=0)
    pad_token = check_count("pad_token", pad_token, minimum=0)
    for name, token in (("end_token", end_token), ("pad_token", pad_token)):
        if token is not None and not token < vocab:
            raise ValueError(f"{name}={token} is outside the vocabulary 0..{vocab - 1}")
    needed = prompt_len + max_new_tokens
    max_len = needed if max_len is None else check_count("max_len", max_len)
    if needed > max_len:
        raise ValueError(
            f"prompts of length {prompt_len} plus max_new_tokens={max_new_tokens} need "
            f"{needed} cache slots but max_len={max_len}: raise max_len or shorten the prompts"
        )
    return prompt_lengths, max_new_tokens, end_token, pad_token, max_len


def _returned(out, needed: int, placed: NamedSharding | None) -> jax.Array:
    """The loop's output cut to `needed` tokens on the host (a device slice would
    compile once per max_new_tokens), split by rows as the prompts were when they
    came on a mesh (`placed`)."""
    out = sharding.fetch(out)[:, :needed]  # every row, from whichever host holds it
    if placed is None:
        return jnp.asarray(out)
    rows = placed.spec[0] if len(placed.spec) else None
    return sharding.put_global(out, NamedSharding(placed.mesh, PartitionSpec(rows, None)))


def generate(
    model: Transformer,
    params,
    prompts,
    *,
    cache_cfg: Mapping,
    max_new_tokens: int,
    sampler=Greedy(),
    prompt_lengths=None,
    end_token: int | None = None,
    pad_token: int = 0,
    max_len: int | None = None,
    rng: jax.Array | None = None,
    rules: tuple | None = None,
    probes=None,
) -> jax.Array:
    """Samples up to `max_new_tokens` after each prompt.

    prompts int32[B, T] are right-padded; `prompt_lengths int32[B]` (default T)
    gives each row's real length (at least 1). Row b's tokens come back as
    out[b, :prompt_lengths[b] + generated_b], then `pad_token` up to width
    T + max_new_tokens. A row stops after emitting `end_token` (kept in the
    output). The cache holds `max_len` tokens (default T + max_new_tokens):
    one compiled loop serves every call with the same batch size, prompt width,
    max_len and sampler.

    Over a cache that compresses each prompt by probes fed after it (a scorer
    that observes "probes", KVzip: cache.evict.when='after_prefill'), `probes`
    gives each row's token ids (`Scorer.probe_tokens(encode, prompt)`): they
    follow the row's prompt in its prefill and are never stored or returned.

    Prompts laid out on a mesh (a NamedSharding, kvlab/sharding.py) run there:
    the cache is laid out by `rules` (default kvlab.sharding.axis_rules()) and
    the output comes back split by rows as the prompts are.
    """
    placed = getattr(prompts, "sharding", None)
    mesh = placed.mesh if isinstance(placed, NamedSharding) else None
    rules = (sharding.axis_rules() if rules is None else rules) if mesh is not None else None
    prompts = jnp.asarray(prompts)
    prompt_lengths, max_new_tokens, end_token, pad_token, max_len = _checked_arguments(
        model, prompts, prompt_lengths, max_new_tokens, end_token, pad_token, max_len
    )
    batch, prompt_len = prompts.shape
    needed = prompt_len + max_new_tokens
    validate_cache_config(cache_cfg, model.config)
    probes, probe_lengths = _checked_probes(model, cache_cfg, probes, batch)
    rng = jax.random.key(0) if rng is None else rng
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if probes is not None:
        probes, probe_lengths = jnp.asarray(probes), jnp.asarray(probe_lengths)
    if mesh is not None and jax.process_count() > 1:  # host values given to every host's devices
        lengths, rng, probes, probe_lengths = sharding.put_global(
            (prompt_lengths.astype(np.int32), rng, probes, probe_lengths),
            sharding.replicated(mesh),
        )
    # Laid out on the prompts' mesh when they have one (kvlab/cache/factory.py).
    build = compiled_builder(model.config, cache_cfg, batch, max_len, mesh=mesh, rules=rules)
    cache = build()
    out, errors = generate_loop(
        model,
        sampler,
        end_token,
        params,
        cache,
        prompts.astype(jnp.int32),
        lengths,
        jnp.int32(max_new_tokens),
        jnp.int32(pad_token),
        rng,
        probes,
        probe_lengths,
    )
    check_errors(errors)  # the inputs were checked above: a flag here is a bug in the loop
    return _returned(out, needed, placed if mesh is not None else None)
