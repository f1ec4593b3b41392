"""Continuous batching over one paged cache, with automatic prefix caching.

    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=8)
    outputs = engine.generate(list_of_token_lists, max_new_tokens=32)

The engine holds one PagedCache of `max_slots` rows (slots) sharing a pool of
`cache.num_pages` pages, and a host-side PrefixCache that hands the pages out.
Each scheduling step, on the host:

  1. finished requests release their pages at once (their full pages stay
     matchable when `cache.prefix_caching` is on);
  2. waiting requests are admitted, oldest first, while a slot is free and
     the pool has pages for the prompt; a prompt that starts with cached full
     pages reuses them and skips their prefill;
  3. one jitted step runs over all slots: prompt chunks of `prefill_chunk`
     tokens while any slot is still prefilling, else one decode token per slot;
     idle slots take no tokens (num_tokens 0), so the cache never changes for them;
  4. a decoding slot that needs a new page and finds none preempts the most
     recently admitted request, whose pages are released; it is recomputed
     later from its prompt and the tokens it had generated.

Requests are greedy (argmax). Shared pages are always full pages that no
request writes again (a request writes from the first token after its
matched prefix, which starts a fresh page), so no page is copied on write.
Two step shapes compile: [max_slots, prefill_chunk] and [max_slots, 1].
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from kvlab.cache.allocator import OutOfPages
from kvlab.cache.paged import PagedCache, init_paged_cache, pages_per_row
from kvlab.cache.prefix import PrefixCache
from kvlab.config import frozen, validate_cache_config
from kvlab.model import Transformer
from kvlab.sampling import prefill


@dataclasses.dataclass
class _Request:
    index: int
    tokens: list[int]  # prompt, then the tokens generated so far
    prompt_len: int
    max_new_tokens: int
    arrival: int  # admission order, for preemption (latest first)
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens the slot's cache holds
    first_token_s: float | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens


@dataclasses.dataclass
class EngineStats:
    """What the last `generate` call did (for experiments and benchmarks)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix hits are not)
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    time_to_first_token_s: list = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class Engine:
    """Greedy generation for many requests at once over a shared paged cache.

    Args:
      model_cfg, cache_cfg: the config's sections; cache.kind must be 'paged'
        (cache.num_pages pages of cache.page_size tokens; 0 = max_slots full rows).
      params: the model's parameters.
      max_slots: requests decoded together (rows of the cache).
      max_len: the most tokens one request may hold (prompt + output - 1).
      prefill_chunk: prompt tokens fed per slot and step.
      end_token: a request stops after emitting it (kept in its output).
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
    ):
        validate_cache_config(cache_cfg, model_cfg)
        for name, value in (("max_slots", max_slots), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
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
        self.params = params
        self.max_slots = max_slots
        self.max_len = max_len or 2048
        self.page_size = cache_cfg["page_size"]
        self.prefill_chunk = prefill_chunk
        self.end_token = end_token
        self.pages_per_slot = pages_per_row(cache_cfg, self.max_len)
        self.num_pages = cache_cfg["num_pages"] or max_slots * self.pages_per_slot
        if self.num_pages < self.pages_per_slot:
            raise ValueError(
                f"cache.num_pages={self.num_pages} is too few for one sequence of "
                f"max_len={self.max_len} ({self.pages_per_slot} pages of cache.page_size="
                f"{self.page_size}): raise cache.num_pages or lower max_len"
            )
        salt = json.dumps({"model": self.model.config.to_dict(), "cache": dict(self.cache_cfg)})
        self.pages = PrefixCache(self.num_pages, self.page_size, salt=salt)
        self.stats = EngineStats()
        self._cache = self._empty_cache()

    def _empty_cache(self) -> PagedCache:
        pool_cfg = dict(self.cache_cfg, num_pages=self.num_pages)
        return init_paged_cache(
            self.model.config, pool_cfg, self.max_slots, self.max_len, own_pages=False
        )

    # ------------------------------------------------------------------
    def generate(self, requests: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """The greedy continuation (up to max_new_tokens) of every request, in order."""
        if not isinstance(requests, Sequence) or len(requests) == 0:
            raise ValueError("requests is empty: pass a list of token lists")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        vocab = self.model.config.vocab_size
        for i, tokens in enumerate(requests):
            tokens = list(tokens)
            if not tokens:
                raise ValueError(f"requests[{i}] is empty: every request needs a prompt token")
            if any(not 0 <= int(t) < vocab for t in tokens):
                raise ValueError(f"requests[{i}] has a token outside 0..{vocab - 1}")
            needed = len(tokens) + max_new_tokens - 1  # the last token is never cached
            if needed > self.max_len or -(-needed // self.page_size) > self.num_pages:
                raise ValueError(
                    f"requests[{i}] needs {needed} cached tokens but a sequence holds at most "
                    f"{min(self.max_len, self.num_pages * self.page_size)} (max_len="
                    f"{self.max_len}, cache.num_pages={self.num_pages} of {self.page_size} tokens)"
                )
        self.stats = EngineStats(requests=len(requests))
        waiting = deque(
            _Request(i, [int(t) for t in r], len(r), max_new_tokens, arrival=-1)
            for i, r in enumerate(requests)
        )
        self.stats.prompt_tokens = sum(r.prompt_len for r in waiting)
        running: dict[int, _Request] = {}
        finished: dict[int, list[int]] = {}
        start = time.perf_counter()
        arrivals = 0
        while waiting or running:
            for slot, request in list(running.items()):
                if request.done or (
                    self.end_token is not None
                    and request.generated
                    and request.tokens[-1] == self.end_token
                ):
                    self._finish(request)
                    finished[request.index] = request.tokens[request.prompt_len :]
                    del running[slot]
            while waiting and len(running) < self.max_slots:
                request = waiting[0]
                if not self._admit(request, running):
                    break
                waiting.popleft()
                request.arrival = arrivals
                arrivals += 1
                running[request.slot] = request
            if not running:
                if waiting:  # cannot happen: a lone request always fits (checked above)
                    raise OutOfPages(1, self.pages.num_free, self.num_pages)
                break
            self._step(running, waiting, start)
        self.stats.seconds = time.perf_counter() - start
        self.stats.generated_tokens = sum(len(t) for t in finished.values())
        return [finished[i] for i in range(len(requests))]

    # ------------------------------------------------------------------
    def _admit(self, request: _Request, running: Mapping[int, _Request]) -> bool:
        """Gives the request a slot and pages for its tokens, reusing cached prefixes."""
        slot = next(s for s in range(self.max_slots) if s not in running)
        context = request.tokens  # prompt (and, after preemption, what it had generated)
        matched = self.pages.match(context) if self.cache_cfg["prefix_caching"] else []
        needed = -(-len(context) // self.page_size) - len(matched)
        try:
            fresh = self.pages.allocate(needed)
        except OutOfPages:
            self.pages.release(matched)
            return False
        request.slot, request.pages = slot, matched + fresh
        request.cached = len(matched) * self.page_size
        return True

    def _register(self, request: _Request, length: int) -> None:
        """Makes the request's full pages up to `length` tokens matchable."""
        if self.cache_cfg["prefix_caching"]:
            self.pages.register(request.tokens[:length], request.pages)

    def _finish(self, request: _Request) -> None:
        self._register(request, request.cached)
        self.pages.release(request.pages)
        request.pages = []

    def _preempt(self, running: dict, waiting: deque) -> None:
        """Frees the most recently admitted request's pages; it is recomputed later."""
        victim = max(running.values(), key=lambda r: r.arrival)
        self.pages.release(victim.pages)
        victim.pages, victim.cached = [], 0
        del running[victim.slot]
        waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _step(self, running: dict, waiting: deque, start: float) -> None:
        """One jitted step over every slot: each request feeds what its cache lacks."""
        width = 1
        if any(len(r.tokens) - r.cached > 1 for r in running.values()):
            width = self.prefill_chunk
        # Pages for this step's tokens, oldest request first; the youngest is
        # preempted (maybe the request itself) when the pool runs dry.
        for request in sorted(running.values(), key=lambda r: r.arrival):
            if request.slot not in running:
                continue
            end = request.cached + min(width, len(request.tokens) - request.cached)
            while -(-end // self.page_size) > len(request.pages) and request.slot in running:
                try:
                    request.pages += self.pages.allocate(1)
                except OutOfPages:
                    self._preempt(running, waiting)
        if not running:
            return
        tokens = np.zeros((self.max_slots, width), np.int32)
        counts = np.zeros((self.max_slots,), np.int32)
        lengths = np.zeros((self.max_slots,), np.int32)
        tables = np.full((self.max_slots, self.pages_per_slot), -1, np.int32)
        for request in running.values():
            take = request.tokens[request.cached : request.cached + width]
            tokens[request.slot, : len(take)] = take
            counts[request.slot] = len(take)
            lengths[request.slot] = request.cached
            tables[request.slot, : len(request.pages)] = request.pages
        cache = self._cache.replace(block_tables=jnp.asarray(tables), lengths=jnp.asarray(lengths))
        logits, self._cache = prefill(self.model, self.params, cache, tokens, jnp.asarray(counts))
        rows = np.arange(self.max_slots)
        choice = np.asarray(jnp.argmax(logits[rows, np.maximum(counts - 1, 0)], axis=-1))
        self.stats.steps += 1
        for request in running.values():
            fed = int(counts[request.slot])
            self.stats.prefill_tokens += max(
                0, min(request.cached + fed, request.prompt_len) - request.cached
            )
            if request.cached < request.prompt_len <= request.cached + fed:
                self._register(request, request.prompt_len)  # its prompt pages are full now
            request.cached += fed
            if request.cached == len(request.tokens):  # all fed: the next token is known
                request.tokens.append(int(choice[request.slot]))
                if request.first_token_s is None:
                    request.first_token_s = time.perf_counter() - start
                    self.stats.time_to_first_token_s.append(request.first_token_s)
