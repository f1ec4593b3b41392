"""Continuous batching over one paged cache, with automatic prefix caching.

    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=8)
    engine.warm_up()                                       # optional: compile before timing
    outputs = engine.generate(list_of_token_lists, max_new_tokens=32)

The engine holds the model, one PagedCache of `max_slots` rows (slots) sharing
a pool of `cache.num_pages` pages, and a Scheduler (kvlab/serve/scheduler.py) that
decides on the host who runs where, on which pages, and hands the pages out
through a PrefixCache. `generate` loops:

    step = scheduler.plan(decode_steps)      # numpy: tokens [B, T], counts, lengths, block tables
    next_tokens = one jitted greedy call     # [n, B]: argmax after each slot's last fed token
    cache.check()                            # raise what the compiled call flagged
    scheduler.advance(next_tokens)

Requests are greedy (argmax); each gets what it would get alone. Every step
is one call of `greedy_run`, one compiled program: it feeds the step's tokens
(a [max_slots, prefill_chunk] chunk while a slot prefills, else one token per
slot) and then, in a `lax.while_loop`, up to `decode_steps - 1` decode steps
in which each running slot feeds its own last argmax, so between scheduling
events the host is out of the per-token path. The scheduler picks how many
steps (when every request feeds all it lacks: until the first request is done
while others wait, else the last one; as far as free pages go) and puts the
pages for all of them in the block tables first; a slot stops at its budget
or end_token, and while requests wait the loop ends after the first step in
which one stops, so the next can be admitted. Whether the step is a chunk and
how many steps follow are traced (one program serves every step) and the
cache is donated, so its pools are updated in place.

With an evicting cache (cache.evict, model.sliding_window;
kvlab/cache/evict/) a slot holds pages for its budget only, and a second
program (`start_rows`) clears the kept tokens of slots a request starts in
and copies cached pages a request is about to overwrite (docs/caches.md,
"Evicting caches"). A hybrid model's sliding layers (model.layer_types) keep
their rings per slot, outside the pool, which holds the full layers alone
(prefix reuse is refused for such a model). Every step attends over max_len positions per slot, so a
max_len near the longest request makes steps cheaper than the default (all
the pool holds).

On a mesh (`Engine(..., mesh=kvlab.sharding.make_mesh(cfg))`,
docs/scale-out.md) the slots are the cache's rows: split over `cache_batch`
(default data x fsdp, as far as max_slots divides), cached heads over tensor, the page
pool replicated over data (any slot may hold any page), parameters by their
logical axes. Each step's host-made inputs (tokens, counts, budgets, block
tables, lengths) are placed by those rows, so the same program runs every
step and every request gets the tokens it gets on one device. The scheduler
does not change: which slot a request takes does not matter, as all slots step
together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec

from kvlab import sharding
from kvlab.cache import PagedCache, PrefixCache, evict, init_cache, topology
from kvlab.cache.paged import pool_size
from kvlab.config import check_count, frozen, validate_cache_config
from kvlab.model import Transformer
from kvlab.sampling import place_params
from kvlab.serve.inputs import check_requests, check_token_id
from kvlab.serve.scheduler import Scheduler, Step

# max_len when cache.num_pages=0 (a pool of max_slots rows of max_len tokens).
DEFAULT_MAX_LEN = 2048


@dataclasses.dataclass
class EngineStats:
    """What the last `generate` call did (for experiments and benchmarks)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix hits are not, recomputations are)
    generated_tokens: int = 0
    steps: int = 0  # device steps (one call may run several)
    calls: int = 0  # compiled calls (greedy_run) made
    preemptions: int = 0
    seconds: float = 0.0
    time_to_first_token_s: list = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


@functools.partial(jax.jit, donate_argnums=0)
def start_rows(cache: PagedCache, starting, lengths, copies) -> PagedCache:
    """An evicting cache made ready for a step: the pages in copies[:, 0] copied
    into copies[:, 1] (-1 rows: none), and rows `starting` (bool[B]) holding
    only their first lengths[b] tokens (matched prefix pages) in slot order."""
    layers = [evict.copy_pages(layer, copies[:, 0], copies[:, 1]) for layer in cache.layers]
    layers = [evict.reset_rows(layer, starting, lengths) for layer in layers]
    return cache.replace(layers=tuple(layers))


@struct.dataclass
class _DecodeState:
    step: jax.Array  # int32 scalar: device steps run
    cache: PagedCache
    token: jax.Array  # int32[B]: each slot's last output, fed next
    running: jax.Array  # bool[B]: slots that feed in the next step
    stopped: jax.Array  # bool scalar: a slot stopped in the last step
    out: jax.Array  # int32[max_steps, B]: each step's argmax per slot


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def greedy_run(
    model: Transformer,
    max_steps: int,
    params,
    cache: PagedCache,
    tokens,
    num_tokens,
    chunk_first,
    budgets,
    steps,
    stop_on_finish,
    end_token,
):
    """Up to `steps` (<= max_steps) greedy device steps in one compiled call,
    by the rules of kvlab.serve.scheduler.Step. The first feeds tokens [B, T]
    (num_tokens[b] real per row) if chunk_first, else tokens[:, 0] (a decode
    step, num_tokens 0 or 1); each later one feeds every running slot's argmax
    of the step before, in a `lax.while_loop`. Slot b runs until it has
    emitted budgets[b] tokens or end_token (-1: none); with stop_on_finish the
    loop ends after the first step in which a slot stops. Returns
    int32[max_steps, B] (row k: each slot's argmax after step k), the steps
    run and the cache. All but the model and max_steps are traced: one
    program serves every step, a prompt chunk or not, and every loop length."""
    emits = num_tokens > 0

    def finish_step(state: _DecodeState, fed, token) -> _DecodeState:
        token = token.astype(jnp.int32)  # [B]
        still = fed & (state.step + 1 < budgets) & (token != end_token)
        return state.replace(
            step=state.step + 1,
            token=token,
            running=still,
            stopped=jnp.any(fed & ~still),
            out=state.out.at[state.step].set(token),
        )

    def chunk(state: _DecodeState) -> _DecodeState:
        # Only each row's logits after its last fed token (meaningless where it fed none).
        last = jnp.maximum(num_tokens - 1, 0)
        logits, cache = model.apply(
            {"params": params}, tokens, cache=state.cache, num_tokens=num_tokens, logits_at=last
        )  # [B, 1, V]
        return finish_step(state.replace(cache=cache), emits, logits[:, 0].argmax(-1))

    def decode(state: _DecodeState) -> _DecodeState:
        logits, cache = model.apply(
            {"params": params},
            state.token[:, None],
            cache=state.cache,
            num_tokens=state.running.astype(jnp.int32),
        )  # [B, 1, V]
        return finish_step(state.replace(cache=cache), state.running, logits[:, 0].argmax(-1))

    def going_on(state: _DecodeState):
        return (state.step < steps) & jnp.any(state.running) & ~(stop_on_finish & state.stopped)

    batch, width = tokens.shape
    out = jnp.zeros((max_steps, batch), jnp.int32)
    state = _DecodeState(jnp.int32(0), cache, tokens[:, 0], emits, jnp.bool_(False), out)
    if width > 1:  # a prompt chunk, or the loop's first decode step
        state = jax.lax.cond(chunk_first, chunk, lambda state: state, state)
    state = jax.lax.while_loop(going_on, decode, state)
    return state.out, state.step, state.cache


class Engine:
    """Greedy generation for many requests at once over a shared paged cache.

    Args:
      model_cfg, cache_cfg: the config's sections; cache.kind must be 'paged'
        (cache.num_pages pages of cache.page_size tokens; 0 = max_slots rows of max_len).
      params: the model's parameters.
      max_slots: requests decoded together (rows of the cache).
      max_len: the most tokens one request may hold (prompt + output - 1);
        default all the pool holds, num_pages * page_size (DEFAULT_MAX_LEN when
        cache.num_pages=0).
      prefill_chunk: prompt tokens fed per slot and step.
      end_token: a request stops after emitting it (kept in its output).
      decode_steps: the most device steps one compiled call runs between
        scheduling events (1: one step per call).
      mesh, rules: run on this mesh (kvlab/sharding.py), laid out by `rules`
        (default kvlab.sharding.axis_rules()); a mesh of one device runs the
        single-device program.
    """

    def __init__(
        self,
        model_cfg: Mapping,
        cache_cfg: Mapping,
        params,
        *,
        max_slots: int = 8,
        max_len: int | None = None,
        prefill_chunk: int = 32,
        end_token: int | None = None,
        decode_steps: int = 32,
        mesh: Mesh | None = None,
        rules: tuple | None = None,
    ):
        validate_cache_config(cache_cfg, model_cfg)
        if cache_cfg["kind"] != "paged":
            raise ValueError(
                f"cache.kind={cache_cfg['kind']!r}: the engine shares a page pool between "
                "requests, set cache.kind='paged'"
            )
        if cache_cfg["prefix_caching"] and cache_cfg["residual"] > 0:
            raise ValueError(
                f"cache.residual={cache_cfg['residual']} with cache.prefix_caching=True: a "
                "cached prefix's full-precision window is not in its pages; set "
                "cache.residual=0 or cache.prefix_caching=False"
            )
        self.model = Transformer(model_cfg)
        self.cache_cfg = frozen(cache_cfg)
        self.mesh = None if mesh is None or mesh.size == 1 else mesh
        if self.mesh is not None:
            self.rules = sharding.axis_rules() if rules is None else rules
        else:
            self.rules = None
        self.params = place_params(self.model.config, params, self.mesh, self.rules)
        self.max_slots = check_count("max_slots", max_slots)
        if max_len is None:
            max_len = cache_cfg["num_pages"] * cache_cfg["page_size"] or DEFAULT_MAX_LEN
        self.max_len = check_count("max_len", max_len)
        self.prefill_chunk = check_count("prefill_chunk", prefill_chunk)
        if end_token is not None:
            end_token = check_token_id("end_token", end_token, self.model.config.vocab_size)
        self.end_token = end_token
        self.decode_steps = check_count("decode_steps", decode_steps)
        # An evicting cache (cache.evict, model.sliding_window) stores at most this per row
        # in its pages (a hybrid model's sliding layers keep their rings per row instead).
        sections = topology.sections(model_cfg, cache_cfg)
        plan = evict.policies(model_cfg, cache_cfg, self.max_len) or (None,) * len(sections)
        refused = {  # protocols whose steps the engine's scheduling would change
            "after_prefill": "compresses a context once, which the engine's chunked, "
            "preempted prefills do not mark: serve with cache.evict.when='every_step', or "
            "compress through kvlab.generate / kvlab.prefill(compress=True)",
            "decoding": "compresses a row every cache.evict.interval steps after its first, "
            "and the engine's steps of a request (prefill chunks sized by what shares the "
            "step, replays after a preemption) are not the request's own: serve with "
            "cache.evict.when='every_step' and cache.evict.interval, or decode through "
            "kvlab.generate",
        }
        protocols = [p.when for p in plan if p is not None and p.when in refused]
        if protocols:
            raise ValueError(f"cache.evict.when={protocols[0]!r} {refused[protocols[0]]}")
        paged = [p for p, (_, c) in zip(plan, sections, strict=True) if c["kind"] == "paged"]
        self.evicting = paged[0] is not None  # one kind's layers: all evict or none
        self.row_slots = max(p.rows for p in paged) if self.evicting else self.max_len
        # a pool fills a row per KV head of each token
        self.token_rows = max(p.token_rows for p in paged) if self.evicting else 1
        self.evicts_after = (
            min(p.rows // p.token_rows for p in paged) if self.evicting else self.max_len
        )
        self.num_pages = pool_size(cache_cfg, self.max_slots, self.row_slots)
        self.stats = EngineStats()
        self._reset()

    def _reset(self) -> None:
        """An empty pool, prefix cache and scheduler."""
        salt = json.dumps({"model": self.model.config.to_dict(), "cache": self.cache_cfg.to_dict()})
        self.pages = PrefixCache(self.num_pages, self.cache_cfg["page_size"], salt=salt)
        self.scheduler = Scheduler(
            self.pages,
            max_slots=self.max_slots,
            max_len=self.max_len,
            prefill_chunk=self.prefill_chunk,
            prefix_caching=self.cache_cfg["prefix_caching"],
            end_token=self.end_token,
            row_slots=self.row_slots if self.evicting else None,
            token_rows=self.token_rows,
            evicts_after=self.evicts_after if self.evicting else None,
        )
        pool_cfg = dict(self.cache_cfg, num_pages=self.num_pages)
        self._cache = init_cache(
            self.model.config,
            pool_cfg,
            self.max_slots,
            self.max_len,
            own_pages=False,
            mesh=self.mesh,
            rules=self.rules,
        )

    def generate(self, requests, max_new_tokens: int) -> list[list[int]]:
        """The greedy continuation (up to max_new_tokens) of every request, in order.

        requests: a list of prompts (lists of ints or 1-D integer arrays) or a
        2-D integer array, one prompt per row. If a step fails, the engine starts
        over empty (its prefix cache too) before the error propagates.
        """
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        prompts = check_requests(requests, self.model.config.vocab_size)
        for i, prompt in enumerate(prompts):
            self.scheduler.check_fits(f"requests[{i}]", len(prompt), max_new_tokens)
        added = [self.scheduler.add(prompt, max_new_tokens) for prompt in prompts]
        stats = EngineStats(requests=len(added), prompt_tokens=sum(map(len, prompts)))
        start = time.perf_counter()
        try:
            while (step := self.scheduler.plan(self.decode_steps)) is not None:
                unanswered = [r for r in self.scheduler.running.values() if r.generated == 0]
                next_tokens = self._run(step)  # [n, B]
                self.scheduler.advance(next_tokens)
                stats.steps += len(next_tokens)
                stats.calls += 1
                now = time.perf_counter() - start
                stats.time_to_first_token_s += [now for r in unanswered if r.generated > 0]
        except BaseException:
            self._reset()  # the cache and the pages may be half-written
            raise
        stats.seconds = time.perf_counter() - start
        stats.prefill_tokens = sum(r.prefill_tokens for r in added)
        stats.preemptions = sum(r.preemptions for r in added)
        stats.generated_tokens = sum(r.generated for r in added)
        self.stats = stats
        return [r.output for r in added]

    def warm_up(self) -> None:
        """Compiles greedy_run on a step in which no slot feeds a token, so the
        cache and the prefix cache stay as they are (call before timing)."""
        step = Step.idle(self.max_slots, self.prefill_chunk, self.scheduler.pages_per_slot)
        if self.evicting:  # compiles start_rows too (clearing idle rows)
            step = dataclasses.replace(step, starting=np.ones((self.max_slots,), bool))
        self._run(step)

    def _slots(self, values: np.ndarray) -> jax.Array:
        """A host array [max_slots, ...] on the device(s): split by slots as the
        cache's rows are, on a mesh."""
        if self.mesh is None:
            return jnp.asarray(values)
        rows = PartitionSpec("cache_batch", *(None,) * (values.ndim - 1))
        return jax.device_put(
            values, sharding.named_sharding(rows, values.shape, self.mesh, self.rules)
        )

    def _run(self, step: Step) -> np.ndarray:
        """Runs the step over every slot: int32[n, max_slots], each slot's greedy
        next token after each of the n device steps it ran (n <= step.steps)."""
        if self.evicting and (step.starting.any() or (step.copies >= 0).any()):
            self._cache = start_rows(
                self._cache,
                self._slots(step.starting),
                self._slots(step.lengths),
                jnp.asarray(step.copies),
            )
        cache = self._cache.replace(
            block_tables=self._slots(step.block_tables), lengths=self._slots(step.lengths)
        )
        width = step.tokens.shape[1]
        tokens = np.zeros((self.max_slots, self.prefill_chunk), np.int32)  # one shape
        tokens[:, :width] = step.tokens
        out, steps, self._cache = greedy_run(
            self.model,
            self.decode_steps,
            self.params,
            cache,
            self._slots(tokens),
            self._slots(step.counts),
            np.bool_(width > 1),
            self._slots(step.budgets),
            np.int32(step.steps),
            np.bool_(step.stop_on_finish),
            np.int32(-1 if self.end_token is None else self.end_token),
        )
        self._cache.check()
        out, steps = jax.device_get((out, steps))
        return out[:steps]
