"""Continuous batching on the host: which request runs in which slot, on which pages.

    scheduler = Scheduler(pages, max_slots=8, max_len=512, prefill_chunk=32)
    request = scheduler.add(prompt, max_new_tokens=32)  # queued behind earlier requests
    while (step := scheduler.plan(max_steps=16)) is not None:  # numpy arrays, row per slot
        next_tokens = ...               # int[n, B]: after each of n device steps (n <= step.steps)
        scheduler.advance(next_tokens)  # int[B] for one step
    request.output                      # the tokens it generated

The host half of kvlab.Engine (vLLM's scheduler over PagedAttention,
arXiv:2309.06180): plain Python and numpy, no JAX, so every decision is tested
without a model (tests/serve/test_scheduler.py). The device half runs the model over
each Step and returns the next tokens. Pages come from a PrefixCache
(kvlab/cache/prefix.py) that the caller owns: its cached prefixes outlive a
scheduler's requests.

Each `plan()`:

  1. admits waiting requests, oldest first, while a slot is free and the pool
     has pages for the request's whole context; a context that starts with
     cached full pages reuses them (cache.prefix_caching) and skips their
     prefill. Admission stops at the first request that does not fit: no later
     request overtakes it;
  2. gives every running request, oldest admitted first, pages for the tokens
     it feeds this step; when the pool runs dry it preempts the most recently
     admitted request, which releases its pages and goes back to the front of
     the queue, to be recomputed later from its prompt and generated tokens;
  3. returns the Step: width prefill_chunk while any slot has more than one
     token to feed, else 1 (decode); per slot the tokens to feed, how many,
     the tokens its cache holds and its block table. Idle slots feed nothing.

A step in which every running request feeds all it lacks (its last token, or
the rest of its prompt) may cover several device steps, up to `max_steps`, so
the device runs them in one call without the host (kvlab/serve/engine.py): every
request emits a token in the first, and in each later one each slot still
running feeds the token it emitted last. `Step.steps` (K) is how many: until
the first running request reaches max_new_tokens while requests wait
(admitting them is the next scheduling event), until the last one does
otherwise, and only as far as free pages allow: pages for each request's
next K tokens are taken before the step, never by preempting (a pool too
short for two steps gives one, which may preempt as any step does). A slot
stops after emitting `Step.budgets[slot]` tokens or end_token, and with
`Step.stop_on_finish` (requests wait) the loop ends after the first step in
which any slot stops: the device may return fewer than K steps.

`advance(next_tokens)` counts the fed tokens as cached; a slot that fed all its
tokens appends next_tokens[slot] (next_tokens[k, slot] after device step k).
A request that has max_new_tokens tokens, or has just emitted end_token,
finishes and releases its pages (with prefix caching, its full pages stay
matchable, and so do a prompt's once it is prefilled).

Invariants (property-tested in tests/serve/test_scheduler.py):

  - a slot holds at most one request; waiting and finished requests hold no page;
  - the references requests hold on a page are exactly its occurrences in the
    running requests' page lists: no page is leaked or owned twice, and once
    every request has finished, pages.num_free == pages.num_pages;
  - a running request's pages hold its cached tokens and at most max_len tokens
    (ceil(max_len / page_size) pages, the block table's width n); a page a step
    writes is held by that request alone and is never a cached prefix page (a
    request writes from the first token after its matched pages, which starts a
    fresh page), so no page is copied on write;
  - requests are served in the order they were added: they are first admitted
    in that order, the queue keeps it, and every running request was added
    before every waiting one (the preempted request is the youngest running
    one, and it returns to the front of the queue). A younger request may
    still finish first: it may need fewer tokens, or fewer pages;
  - every running request feeds at least one token per step, and the oldest
    is never preempted (only a request running alone could be, and a lone
    request always fits: `add` checks it), so every request finishes, with
    exactly max_new_tokens tokens, or fewer that end with end_token.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvlab.cache import OutOfPages, PrefixCache
from kvlab.config import check_count
from kvlab.serve.inputs import check_token_id, check_tokens


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


@dataclasses.dataclass(eq=False)
class Request:
    """One request's tokens and where it stands. Read it; the Scheduler writes it."""

    id: int  # order of `add`
    tokens: list[int]  # the prompt, then the tokens generated so far
    prompt_len: int
    max_new_tokens: int
    slot: int = -1  # its row of the cache while running, else -1
    pages: list[int] = dataclasses.field(default_factory=list)  # its block table while running
    cached: int = 0  # tokens its slot's cache holds
    admitted: int = -1  # admission order, counted over admissions (preemption: latest first)
    prefill_tokens: int = 0  # prompt tokens computed for it (recomputations count, hits do not)
    preemptions: int = 0
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclasses.dataclass(frozen=True)
class Step:
    """One device step's inputs, a row per slot (B = max_slots, T = width,
    n = pages per slot). The model appends tokens[b, :counts[b]] to row b after
    its lengths[b] cached tokens, in the pages block_tables[b]. With steps > 1
    (module docstring) more device steps follow in which slot b feeds its own
    last output while it runs (it emits at most budgets[b] tokens in all), and
    its block table already holds the pages for all of them."""

    tokens: np.ndarray  # int32[B, T]  tokens to feed, zeros past counts
    counts: np.ndarray  # int32[B]     tokens fed per slot (0: idle)
    lengths: np.ndarray  # int32[B]     tokens each slot's cache holds before the step
    block_tables: np.ndarray  # int32[B, n]  each slot's pages, -1 past them
    starting: np.ndarray  # bool[B]  slots a request (re)starts in: clear what they kept
    copies: (
        np.ndarray
    )  # int32[B * n, 2]  (page, its private copy) to copy before the step; -1 rows unused
    budgets: np.ndarray  # int32[B]  tokens each slot emits at most over the steps
    steps: int = 1  # K: device steps at most, the first feeding `tokens`
    stop_on_finish: bool = False  # end the loop after the first step in which a slot stops

    @classmethod
    def idle(cls, max_slots: int, width: int, pages_per_slot: int, steps: int = 1) -> Step:
        """A step of the given width in which no slot feeds a token."""
        return cls(
            tokens=np.zeros((max_slots, width), np.int32),
            counts=np.zeros((max_slots,), np.int32),
            lengths=np.zeros((max_slots,), np.int32),
            block_tables=np.full((max_slots, pages_per_slot), -1, np.int32),
            starting=np.zeros((max_slots,), bool),
            copies=np.full((max_slots * pages_per_slot, 2), -1, np.int32),
            budgets=np.zeros((max_slots,), np.int32),
            steps=steps,
        )


class Scheduler:
    """Requests, slots and pages for continuous batching (module docstring).

    Args:
      pages: hands out the pool's pages (its num_pages and page_size are the pool's).
      max_slots: requests running at once (rows of the cache).
      max_len: the most tokens one request's cache holds (prompt + output - 1).
      prefill_chunk: prompt tokens a slot feeds per step.
      prefix_caching: reuse and register cached full pages.
      end_token: a request finishes after emitting it (kept in its output).
      row_slots: the most token rows a slot's cache stores (an evicting cache's
        budget, kvlab/cache/evict/); default max_len. A request then holds
        pages for min(its tokens x token_rows, row_slots), and a preempted request replays
        its generated tokens one per step, as it first fed them, so it keeps
        the tokens it kept before.
      evicts_after: tokens a slot holds before its cache first overwrites a
        slot (the smallest layer budget; default row_slots). With prefix
        caching, a request registers its pages only while it holds no more,
        and before a step that may overwrite slots it trades every cached or
        shared page for a private copy (Step.copies): cached pages are never
        written, and the prefix chain keeps holding what it names.
      token_rows: the rows each token fills (an evicting pool's: one per KV head).
    """

    def __init__(
        self,
        pages: PrefixCache,
        *,
        max_slots: int,
        max_len: int,
        prefill_chunk: int,
        prefix_caching: bool = False,
        end_token: int | None = None,
        row_slots: int | None = None,
        evicts_after: int | None = None,
        token_rows: int = 1,
    ):
        self.pages = pages
        self.page_size = pages.page_size
        self.max_slots = check_count("max_slots", max_slots)
        self.max_len = check_count("max_len", max_len)
        self.prefill_chunk = check_count("prefill_chunk", prefill_chunk)
        self.prefix_caching = bool(prefix_caching)
        self.end_token = None if end_token is None else check_token_id("end_token", end_token)
        self.evicting = row_slots is not None
        self.row_slots = self.max_len if row_slots is None else check_count("row_slots", row_slots)
        self.evicts_after = self.row_slots if evicts_after is None else evicts_after
        self.token_rows = check_count("token_rows", token_rows)
        self.pages_per_slot = pages_for(self.row_slots, self.page_size)
        if self.pages_per_slot > pages.num_pages:
            held = (
                f"max_len={self.max_len}" if row_slots is None else f"{self.row_slots} kept tokens"
            )
            raise ValueError(
                f"cache.num_pages={pages.num_pages} is too few for one sequence of "
                f"{held} ({self.pages_per_slot} pages of cache.page_size="
                f"{self.page_size}): raise cache.num_pages or lower max_len"
            )
        self.waiting: deque[Request] = deque()  # in order of `add`, preempted ones in front
        self.running: dict[int, Request] = {}  # slot -> request
        self._added = 0
        self._admissions = 0
        self._planned: Step | None = None  # the step `advance` completes

    @property
    def idle(self) -> bool:
        """No request is waiting or running."""
        return not self.waiting and not self.running

    def check_fits(self, name: str, prompt_len: int, max_new_tokens: int) -> None:
        """A ValueError if a request of this size could never run (its last token
        is never cached, so it needs prompt_len + max_new_tokens - 1 tokens)."""
        needed = prompt_len + max_new_tokens - 1
        if needed > self.max_len:
            raise ValueError(
                f"{name} needs {needed} cached tokens (a prompt of {prompt_len} + "
                f"max_new_tokens={max_new_tokens} - 1) but a sequence holds at most "
                f"max_len={self.max_len} ({self.pages.num_pages} pages of "
                f"cache.page_size={self.page_size} in the pool): shorten the request or raise "
                "max_len (and cache.num_pages)"
            )

    def add(self, tokens: Sequence[int], max_new_tokens: int, name: str = "request") -> Request:
        """Queues a request behind every earlier one; returns it (its `output` fills in)."""
        tokens = check_tokens(name, tokens)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        self.check_fits(name, len(tokens), max_new_tokens)
        request = Request(self._added, tokens, len(tokens), max_new_tokens)
        self._added += 1
        self.waiting.append(request)
        return request

    # ------------------------------------------------------------------
    def plan(self, max_steps: int = 1) -> Step | None:
        """Admits, hands out pages, preempts; the next step (of up to `max_steps`
        device steps), or None once idle."""
        if self._planned is not None:
            raise RuntimeError(
                "plan() was called twice: pass the last step's next tokens to advance() first"
            )
        max_steps = check_count("max_steps", max_steps)
        admitted = self._admit()
        copies = []
        for request in sorted(self.running.values(), key=lambda r: r.admitted):
            if request.slot >= 0:  # not preempted by an older request's pages
                feed = self._feed(request, self.prefill_chunk)
                self._give_pages(request, feed)
                copies += self._copy_before_overwriting(request, feed)
        if not self.running:
            if self.waiting:  # a lone request always fits (check_fits): the invariants broke
                raise RuntimeError(f"{len(self.waiting)} requests wait but none can run")
            return None
        width = self._width()
        steps = self._reserve_decode_steps(max_steps, width)
        step = Step.idle(self.max_slots, width, self.pages_per_slot, steps)
        step = dataclasses.replace(step, stop_on_finish=steps > 1 and bool(self.waiting))
        for slot, request in self.running.items():
            feed = self._feed(request, width)
            take = request.tokens[request.cached : request.cached + feed]
            step.tokens[slot, : len(take)] = take
            step.counts[slot] = len(take)
            step.budgets[slot] = min(steps, self._tokens_left(request))
            step.lengths[slot] = request.cached
            step.block_tables[slot, : len(request.pages)] = request.pages
            step.starting[slot] = request in admitted
        if copies:
            step.copies[: len(copies)] = copies
        self._planned = step
        return step

    def advance(self, next_tokens) -> list[Request]:
        """Completes the planned step with each slot's next token: int[max_slots],
        or int[n, max_slots] for the n device steps the device ran (1 <= n <=
        step.steps); a slot's entry is used only if it fed all its tokens. Returns
        the requests that emitted a token, in slot order; finished ones have
        released their pages."""
        step = self._planned
        if step is None:
            raise RuntimeError("advance() without a planned step: call plan() first")
        next_tokens = np.asarray(next_tokens)
        shape = next_tokens.shape
        if next_tokens.ndim == 1:
            next_tokens = next_tokens[None]
        if (
            next_tokens.ndim != 2
            or next_tokens.shape[1] != self.max_slots
            or not 1 <= len(next_tokens) <= step.steps
            or next_tokens.dtype.kind not in "iu"
        ):
            raise ValueError(
                f"next_tokens has shape {shape} and dtype {next_tokens.dtype}: pass one "
                f"integer token per slot, shape ({self.max_slots},), or per slot and device "
                f"step, shape (n, {self.max_slots}) with n <= {step.steps}"
            )
        self._planned = None
        emitted = {}
        for k, tokens in enumerate(next_tokens):
            stopped = False
            for slot in sorted(self.running):
                request = self.running[slot]
                # Past the first device step a running slot feeds its last output.
                start, fed = request.cached, int(step.counts[slot]) if k == 0 else 1
                request.prefill_tokens += max(0, min(start + fed, request.prompt_len) - start)
                request.cached += fed
                if start < request.prompt_len <= request.cached:  # its prompt pages are full now
                    self._register(request, request.prompt_len)
                if request.cached == len(request.tokens):  # all fed: the next token is known
                    token = check_token_id(f"next_tokens[{k}, {slot}]", tokens[slot])
                    request.tokens.append(token)
                    emitted[slot] = request
                    if self._done(request):
                        self._finish(request)
                        stopped = True
            # The device loop goes on while steps remain, a slot runs and (with
            # stop_on_finish) none has stopped.
            goes_on = k + 1 < step.steps and bool(self.running)
            goes_on = goes_on and not (step.stop_on_finish and stopped)
            if goes_on != (k + 1 < len(next_tokens)):
                raise ValueError(
                    f"next_tokens has {len(next_tokens)} device steps, but by the loop's rules "
                    f"(Step) the device {'goes on' if goes_on else 'stops'} after step {k + 1}: "
                    "the device broke them, and this scheduler is not usable now"
                )
        return [emitted[slot] for slot in sorted(emitted)]

    def _reserve_decode_steps(self, max_steps: int, width: int) -> int:
        """Device steps (at most max_steps) this step runs: until the first request
        is done while others wait, else until the last is, and only as far as free
        pages go; takes those pages for every running request now (never by
        preempting). 1 unless every running request feeds all it lacks in the
        first, so that each emits a token in every step (an evicting cache's
        replayed tokens are fed one per step and emit nothing)."""
        running = list(self.running.values())
        lacking = [len(r.tokens) - r.cached for r in running]
        if max_steps == 1 or lacking != [self._feed(r, width) for r in running]:
            return 1
        left = [self._tokens_left(r) for r in running]
        steps = min(max_steps, min(left) if self.waiting else max(left))
        if self.evicting and self.prefix_caching:
            # The step that first overwrites a slot copies cached pages first (plan).
            steps = min(
                [steps]
                + [
                    self.evicts_after - len(r.tokens) + 1
                    for r in running
                    if len(r.tokens) <= self.evicts_after
                ]
            )
        while steps > 1 and self._pages_ahead(running, steps) > self.pages.num_free:
            steps -= 1
        for request in running:
            request.pages += self.pages.allocate(self._pages_ahead([request], steps))
        return steps

    def _pages_ahead(self, requests: list[Request], steps: int) -> int:
        """Pages these requests lack for `steps` device steps that each emit a token
        (so the last one feeds the token emitted before it)."""
        lacking = 0
        for request in requests:
            fed = len(request.tokens) - 1 + min(steps, self._tokens_left(request))
            lacking += max(0, pages_for(self._rows(fed), self.page_size) - len(request.pages))
        return lacking

    def _rows(self, tokens: int) -> int:
        """The rows a slot's cache fills holding `tokens`."""
        return min(tokens * self.token_rows, self.row_slots)

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request may still emit (it may end sooner, with end_token)."""
        return request.max_new_tokens - request.generated

    # ------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        """Slots and pages for waiting requests, oldest first, until one does not fit;
        returns the requests admitted."""
        admitted = []
        while self.waiting and len(self.running) < self.max_slots:
            request = self.waiting[0]
            context = request.tokens  # the prompt and, after preemption, what it generated
            matched = self.pages.match(context) if self.prefix_caching else []
            needed = pages_for(self._rows(len(context)), self.page_size)
            try:
                fresh = self.pages.allocate(needed - len(matched))
            except OutOfPages:
                self.pages.release(matched)
                return admitted
            self.waiting.popleft()
            request.slot = min(set(range(self.max_slots)) - set(self.running))
            request.pages, request.cached = matched + fresh, len(matched) * self.page_size
            request.admitted = self._admissions
            self._admissions += 1
            self.running[request.slot] = request
            admitted.append(request)
        return admitted

    def _feed(self, request: Request, width: int) -> int:
        """Tokens the request feeds in a step of `width` (an evicting cache's
        generated tokens one at a time, as they were first fed)."""
        if self.evicting:
            # The prompt in chunks that start at multiples of the width (also after a
            # matched prefix), then what it generated token by token: which tokens an
            # evicting cache keeps depends on how they were fed.
            prompt_left = request.prompt_len - request.cached
            aligned = width - request.cached % width
            width = min(width, prompt_left, aligned) if prompt_left > 0 else 1
        return min(width, len(request.tokens) - request.cached)

    def _width(self) -> int:
        """prefill_chunk while a slot has more than one token to feed, else 1."""
        if any(self._feed(r, self.prefill_chunk) > 1 for r in self.running.values()):
            return self.prefill_chunk
        return 1

    def _give_pages(self, request: Request, feed: int) -> None:
        """Pages for the request's next `feed` tokens, preempting the youngest
        running request (maybe this one) while the pool has none."""
        end = self._rows(request.cached + feed)
        while request.slot >= 0 and pages_for(end, self.page_size) > len(request.pages):
            try:
                request.pages += self.pages.allocate(1)
            except OutOfPages:
                self._preempt(max(self.running.values(), key=lambda r: r.admitted))

    def _copy_before_overwriting(self, request: Request, feed: int) -> list[tuple[int, int]]:
        """An evicting request about to overwrite slots trades its cached and shared
        pages for private copies; returns the (page, copy) pairs to copy on device."""
        if not (self.evicting and self.prefix_caching):
            return []
        if request.cached + feed <= self.evicts_after:
            return []
        copies = []
        for i, page in enumerate(request.pages):
            if request.slot < 0:
                break  # preempted while making room: its copies are moot
            if not (self.pages.is_cached(page) or self.pages.is_shared(page)):
                continue
            while request.slot >= 0:
                try:
                    request.pages[i] = self.pages.copy_on_write(page)
                    copies.append((page, request.pages[i]))
                    break
                except OutOfPages:
                    self._preempt(max(self.running.values(), key=lambda r: r.admitted))
        return copies if request.slot >= 0 else []

    def _preempt(self, request: Request) -> None:
        """Releases the request's pages and queues it first, to be recomputed."""
        self.pages.release(request.pages)
        del self.running[request.slot]
        request.slot, request.pages, request.cached = -1, [], 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    def _done(self, request: Request) -> bool:
        ended = self.end_token is not None and request.tokens[-1] == self.end_token
        return request.generated >= request.max_new_tokens or ended

    def _finish(self, request: Request) -> None:
        self._register(request, request.cached)
        self.pages.release(request.pages)
        del self.running[request.slot]
        request.slot, request.pages, request.finished = -1, [], True

    def _register(self, request: Request, length: int) -> None:
        """Makes the request's full pages up to `length` tokens matchable (an
        evicting request's only while it has overwritten no slot)."""
        if self.prefix_caching and request.cached <= self.evicts_after:
            self.pages.register(request.tokens[:length], request.pages)
