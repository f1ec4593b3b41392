"""The scheduler without a model: a token-level stand-in for the device stores
each step's tokens in the pages its block tables name and answers with a
deterministic function of the context it reads back, so a request's output
equals its solo generation only if the pages really held its tokens."""

import ast
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlab.cache import PrefixCache
from kvlab.serve.scheduler import Scheduler, pages_for
from tests.helpers import ROOT

VOCAB = 6  # ids the stand-in model emits
END = 5
UNUSED = 99  # answered for idle slots: an output containing it read a token it should not have


def next_token(context) -> int:
    """The stand-in model: a token that depends on every token of the context, in order."""
    mixed = 0
    for token in context:
        mixed = (mixed * 31 + int(token) + 7) % 1_000_003
    return mixed % VOCAB


def solo(prompt, max_new_tokens, end_token=None):
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_new_tokens:
        tokens.append(next_token(tokens))
        if tokens[-1] == end_token:
            break
    return tokens[len(prompt) :]


class TokenPool:
    """The device side in tokens: a page pool [num_pages, page_size] of token ids.
    A decode step of several device steps runs as the engine's loop does (Step):
    each running slot feeds its last output until its budget, end_token or (with
    stop_on_finish) any slot's stop ends it."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.pages = scheduler.pages
        self.pool = np.full((self.pages.num_pages, self.pages.page_size), -1)

    def write(self, table, position: int, token: int) -> None:
        size = self.pages.page_size
        page = table[position // size]
        assert page >= 0, "a fed token has no page"
        assert self.pages.refcount(page) == 1, "a step writes a page another request holds"
        self.pool[page, position % size] = token

    def read(self, table, end: int) -> tuple[int, list[int]]:
        """The first position the slot's cache holds and its tokens up to `end`."""
        size = self.pages.page_size
        return 0, [self.pool[table[p // size], p % size] for p in range(end)]

    def run(self, step) -> np.ndarray:
        """Writes each slot's tokens, reads its context back, answers next_token:
        int[B], or int[n, B] for the n device steps of a decode loop."""
        for source, target in step.copies[step.copies[:, 0] >= 0]:
            self.pool[target] = self.pool[source]
        expected = {slot: list(r.tokens) for slot, r in self.scheduler.running.items()}
        end_token = -1 if self.scheduler.end_token is None else self.scheduler.end_token
        tokens, counts, lengths = step.tokens.copy(), step.counts.copy(), step.lengths.copy()
        outputs = []
        for k in range(step.steps):
            next_tokens = np.full(self.scheduler.max_slots, UNUSED)
            for slot, table in enumerate(step.block_tables):
                for j in range(counts[slot]):
                    self.write(table, lengths[slot] + j, tokens[slot, j])
                if counts[slot]:
                    end = lengths[slot] + counts[slot]
                    start, context = self.read(table, end)
                    assert context == expected[slot][start:end]
                    next_tokens[slot] = next_token(context)
            outputs.append(next_tokens)
            running = counts > 0
            stopped = running & ((k + 1 >= step.budgets) | (next_tokens == end_token))
            if k + 1 == step.steps or not (running & ~stopped).any():
                break
            if step.stop_on_finish and stopped.any():
                break
            lengths += counts
            counts = (running & ~stopped).astype(np.int32)
            tokens[:, 0] = next_tokens
            for slot in np.flatnonzero(counts):
                expected[slot].append(next_tokens[slot])
        return outputs[0] if step.steps == 1 else np.array(outputs)

    def drain(self, limit: int = 10_000, max_steps: int = 1) -> int:
        """Steps until every request has finished; the number of steps."""
        for steps in range(limit):
            step = self.scheduler.plan(max_steps)
            if step is None:
                return steps
            self.scheduler.advance(self.run(step))
        raise AssertionError(f"still running after {limit} steps")


def make(num_pages=8, page_size=4, **kwargs):
    kwargs = dict(dict(max_slots=2, max_len=num_pages * page_size, prefill_chunk=4), **kwargs)
    scheduler = Scheduler(PrefixCache(num_pages, page_size, salt="test"), **kwargs)
    return scheduler, TokenPool(scheduler)


def test_each_step_feeds_every_slot_what_its_cache_lacks():
    scheduler, _ = make(num_pages=8, page_size=4, max_len=12)
    first = scheduler.add([1, 2, 3, 4, 5, 6], max_new_tokens=2)
    second = scheduler.add([7, 8], max_new_tokens=3)

    step = scheduler.plan()  # prompts: a chunk of 4 each; pages for whole prompts
    np.testing.assert_array_equal(step.tokens, [[1, 2, 3, 4], [7, 8, 0, 0]])
    np.testing.assert_array_equal(step.counts, [4, 2])
    np.testing.assert_array_equal(step.lengths, [0, 0])
    np.testing.assert_array_equal(step.block_tables, [[0, 1, -1], [2, -1, -1]])
    assert scheduler.advance([10, 11]) == [second]  # the first still has prompt to feed

    step = scheduler.plan()
    np.testing.assert_array_equal(step.tokens, [[5, 6, 0, 0], [11, 0, 0, 0]])
    np.testing.assert_array_equal(step.counts, [2, 1])
    np.testing.assert_array_equal(step.lengths, [4, 2])
    assert scheduler.advance([12, 13]) == [first, second]

    step = scheduler.plan()  # every prompt fed: one decode token per slot
    np.testing.assert_array_equal(step.tokens, [[12], [13]])
    np.testing.assert_array_equal(step.lengths, [6, 3])
    np.testing.assert_array_equal(step.block_tables, [[0, 1, -1], [2, -1, -1]])
    scheduler.advance([14, 15])

    assert first.finished and second.finished and scheduler.idle
    assert scheduler.plan() is None
    assert (first.output, second.output) == ([12, 14], [11, 13, 15])
    assert (first.prefill_tokens, second.prefill_tokens) == (6, 2)
    assert scheduler.pages.num_free == 8


def test_a_cached_prefix_is_reused_and_not_recomputed():
    scheduler, device = make(num_pages=8, page_size=2, prefix_caching=True)
    first = scheduler.add([1, 2, 3, 4, 5], max_new_tokens=1)
    device.drain()
    second = scheduler.add([1, 2, 3, 4, 9], max_new_tokens=2)
    step = scheduler.plan()
    slot = second.slot
    assert step.lengths[slot] == 4 and step.counts[slot] == 1 and step.tokens[slot, 0] == 9
    scheduler.advance(device.run(step))
    device.drain()
    assert second.prefill_tokens == 1 and first.prefill_tokens == 5
    assert second.output == solo([1, 2, 3, 4, 9], 2)
    assert scheduler.pages.stats.hit_tokens == 4


def test_the_youngest_is_preempted_and_recomputed_from_its_tokens():
    # Two requests that each grow to 3 pages share a pool of 3.
    scheduler, device = make(num_pages=3, page_size=2, max_len=6, prefill_chunk=2)
    old = scheduler.add([1, 2], max_new_tokens=5)
    young = scheduler.add([3, 4], max_new_tokens=5)
    scheduler.advance(device.run(scheduler.plan()))  # both prompts fed, one token each
    step = scheduler.plan()  # both need a second page; one is left
    assert young.slot == -1 and young.preemptions == 1 and young.pages == []
    assert list(scheduler.waiting) == [young] and step.counts[1] == 0
    assert list(scheduler.running.values()) == [old]
    scheduler.advance(device.run(step))
    device.drain()
    assert old.output == solo([1, 2], 5) and young.output == solo([3, 4], 5)
    assert young.prefill_tokens == 4  # its prompt, computed twice
    assert scheduler.pages.num_free == 3


def test_a_request_that_does_not_fit_holds_back_later_ones():
    scheduler, device = make(num_pages=4, page_size=1, max_slots=3, max_len=4)
    scheduler.add([1, 2], max_new_tokens=1)  # 2 pages
    blocked = scheduler.add([1, 2, 3], max_new_tokens=1)  # 3 pages: 2 are left
    small = scheduler.add([4], max_new_tokens=1)  # 1 page would fit, but must wait its turn
    scheduler.plan()
    assert list(scheduler.waiting) == [blocked, small]
    scheduler.advance(np.zeros(3, np.int64))
    device.drain()
    assert blocked.finished and small.finished


def test_decode_steps_run_until_the_next_scheduling_event():
    """A step in which every request feeds all it lacks goes on decoding: while a
    request waits, until the first running one is done; then, with none waiting,
    until the last one is. Pages for all of it are in the block tables first."""
    scheduler, device = make(num_pages=8, page_size=2, max_slots=2, max_len=16)
    first = scheduler.add([1, 2], max_new_tokens=5)
    second = scheduler.add([3], max_new_tokens=3)
    third = scheduler.add([4], max_new_tokens=4)  # waits for a slot

    step = scheduler.plan(max_steps=8)  # both prompts, then decode until the second is done
    assert (step.steps, step.stop_on_finish, step.tokens.shape) == (3, True, (2, 4))
    np.testing.assert_array_equal(step.counts, [2, 1])
    np.testing.assert_array_equal(step.budgets, [3, 3])
    assert [len(first.pages), len(second.pages)] == [2, 2]  # tokens up to 4 and 3
    next_tokens = device.run(step)
    assert next_tokens.shape == (3, 2)
    assert scheduler.advance(next_tokens) == [first, second]
    assert second.finished and first.generated == 3

    step = scheduler.plan(max_steps=8)  # the third's one prompt token, then decode
    assert third.slot == 1 and (step.steps, step.stop_on_finish) == (4, False)
    np.testing.assert_array_equal(step.budgets, [2, 4])  # the first stops after 2
    assert device.run(step).shape == (4, 2)
    scheduler.advance(device.run(step))
    assert scheduler.idle and scheduler.pages.num_free == 8
    assert [r.output for r in (first, second, third)] == [
        solo([1, 2], 5),
        solo([3], 3),
        solo([4], 4),
    ]


def test_a_decode_step_takes_only_the_pages_the_pool_has_left():
    # Two prompts of 2 tokens hold a page of 2 each, 3 are free: 3 device steps
    # (up to 4 tokens) take 1 more page each, a fourth would need 2 more each, so
    # the loop stops at 3 without preempting anyone.
    scheduler, device = make(num_pages=5, page_size=2, max_slots=2, max_len=10)
    scheduler.add([1, 2], max_new_tokens=8)
    scheduler.add([3, 4], max_new_tokens=8)
    step = scheduler.plan(max_steps=8)
    assert step.steps == 3 and scheduler.pages.num_free == 1
    scheduler.advance(device.run(step))
    device.drain(max_steps=8)
    assert scheduler.pages.num_free == 5


def test_a_decode_loop_of_the_wrong_length_is_refused():
    scheduler, _ = make(num_pages=8, page_size=2, max_slots=1, max_len=16)
    scheduler.add([1, 2], max_new_tokens=5)
    scheduler.add([3], max_new_tokens=5)  # waits
    step = scheduler.plan(max_steps=8)
    assert (step.steps, step.stop_on_finish) == (5, True)
    with pytest.raises(ValueError, match=r"next_tokens has shape \(6, 1\).*n <= 5"):
        scheduler.advance(np.zeros((6, 1), np.int32))
    with pytest.raises(ValueError, match="the device goes on after step 2"):
        scheduler.advance(np.zeros((2, 1), np.int32))


def test_end_token_finishes_a_request_early():
    prompt = next(p for p in ([a, b] for a in range(6) for b in range(6)) if END in solo(p, 8))
    scheduler, device = make(end_token=END)
    request = scheduler.add(prompt, max_new_tokens=8)
    device.drain()
    assert request.output == solo(prompt, 8, END) and request.output[-1] == END
    assert len(request.output) < 8


def test_out_of_order_calls_are_refused():
    scheduler, _ = make()
    with pytest.raises(RuntimeError, match="call plan"):
        scheduler.advance(np.zeros(2, np.int32))
    scheduler.add([1, 2], max_new_tokens=1)
    scheduler.plan()
    with pytest.raises(RuntimeError, match="plan\\(\\) was called twice"):
        scheduler.plan()
    with pytest.raises(ValueError, match="next_tokens has shape \\(3,\\)"):
        scheduler.advance(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="dtype float32"):
        scheduler.advance(np.zeros(2, np.float32))


def test_a_request_longer_than_max_len_is_refused():
    scheduler, _ = make(num_pages=4, page_size=4, max_len=10)
    with pytest.raises(ValueError, match=r"needs 11 cached tokens .* max_len=10"):
        scheduler.add(list(range(8)), max_new_tokens=4)
    assert scheduler.idle


def test_a_pool_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cache.num_pages=2 is too few for one sequence"):
        make(num_pages=2, page_size=4, max_len=9)


@pytest.mark.parametrize("name", ["max_slots", "max_len", "prefill_chunk"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True])
def test_bad_counts_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        make(**{name: value})


@pytest.mark.parametrize("module", ["scheduler.py", "inputs.py"])
def test_the_scheduler_does_not_import_jax(module):
    tree = ast.parse((ROOT / "kvlab" / "serve" / module).read_text())
    modules = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [m for m in modules if m.split(".")[0] in ("jax", "flax", "jaxtyping")]


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive between steps of a random pool, slot count and chunk."""

    @initialize(
        page_size=st.integers(1, 4),
        num_pages=st.integers(1, 10),
        max_slots=st.integers(1, 4),
        prefill_chunk=st.integers(1, 5),
        prefix_caching=st.booleans(),
        end_token=st.sampled_from([None, END]),
        max_steps=st.sampled_from([1, 2, 5]),
        data=st.data(),
    )
    def setup(
        self,
        page_size,
        num_pages,
        max_slots,
        prefill_chunk,
        prefix_caching,
        end_token,
        max_steps,
        data,
    ):
        max_len = data.draw(st.integers(1, num_pages * page_size), label="max_len")
        self.scheduler, self.device = make(
            num_pages,
            page_size,
            max_slots=max_slots,
            max_len=max_len,
            prefill_chunk=prefill_chunk,
            prefix_caching=prefix_caching,
            end_token=end_token,
        )
        self.max_steps = max_steps  # device steps a decode step may run
        self.requests = []
        self.first_admissions = []  # ids in the order they were first admitted

    @rule(data=st.data())
    def add(self, data):
        max_len = self.scheduler.max_len
        prompt_len = data.draw(st.integers(1, max_len), label="prompt_len")
        max_new_tokens = data.draw(st.integers(1, max_len - prompt_len + 1), label="max_new")
        # Two token values: prompts often share prefixes.
        prompt = data.draw(st.lists(st.integers(0, 1), min_size=prompt_len, max_size=prompt_len))
        self.requests.append(self.scheduler.add(prompt, max_new_tokens))

    @rule()
    def step(self):
        scheduler = self.scheduler
        before = {r.id: (r.admitted, r.preemptions) for r in self.requests}
        step = scheduler.plan(self.max_steps)
        if step is None:
            assert scheduler.idle
            return
        admitted = [r for r in self.requests if r.admitted != before[r.id][0]]
        for request in sorted(admitted, key=lambda r: r.admitted):
            if request.id not in self.first_admissions:
                self.first_admissions.append(request.id)
        preempted = [r for r in self.requests if r.preemptions > before[r.id][1]]
        survivors = list(scheduler.running.values())
        assert all(p.admitted > s.admitted for p in preempted for s in survivors)
        # Every running request feeds, so the oldest always progresses.
        assert all(step.counts[r.slot] >= 1 for r in survivors)
        assert (step.tokens.shape[1] > 1) == (step.counts.max() > 1)
        assert 1 <= step.steps <= self.max_steps
        if step.steps > 1:  # every request feeds all it lacks, so each emits every step
            assert all(step.counts[r.slot] == len(r.tokens) - r.cached for r in survivors)
        for request in survivors:
            table = step.block_tables[request.slot]
            assert step.lengths[request.slot] == request.cached
            assert table[: len(request.pages)].tolist() == request.pages
            assert (table[len(request.pages) :] == -1).all()
            budget = step.budgets[request.slot]
            assert 1 <= budget <= min(step.steps, request.max_new_tokens - request.generated)
        # A loop of several steps runs until the first request is done if others wait.
        if step.steps > 1 and scheduler.waiting:
            assert step.stop_on_finish and step.budgets.max() == step.steps
            assert min(step.budgets[r.slot] for r in survivors) == step.steps
        scheduler.advance(self.device.run(step))

    @invariant()
    def pages_are_held_exactly_once(self):
        scheduler, pages = self.scheduler, self.scheduler.pages
        held = Counter(page for r in scheduler.running.values() for page in r.pages)
        assert all(pages.refcount(page) == held[page] for page in range(pages.num_pages))
        assert pages.num_free == pages.num_pages - len(held)
        for slot, request in scheduler.running.items():
            assert request.slot == slot and not request.finished
            assert request.cached < len(request.tokens)
            assert pages_for(request.cached, pages.page_size) <= len(request.pages)
            assert len(request.pages) <= scheduler.pages_per_slot
        for request in self.requests:
            if request.slot < 0:
                assert request.pages == []

    @invariant()
    def requests_are_served_in_order(self):
        waiting = [r.id for r in self.scheduler.waiting]
        running = [r.id for r in self.scheduler.running.values()]
        assert waiting == sorted(waiting)
        assert not waiting or not running or max(running) < min(waiting)
        assert self.first_admissions == sorted(self.first_admissions)

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(10_000):
            if self.scheduler.idle:
                break
            self.step()
            self.pages_are_held_exactly_once()
            self.requests_are_served_in_order()
        assert self.scheduler.pages.num_free == self.scheduler.pages.num_pages
        for request in self.requests:
            assert request.finished
            prompt = request.tokens[: request.prompt_len]
            expected = solo(prompt, request.max_new_tokens, self.scheduler.end_token)
            assert request.output == expected


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class RingPool(TokenPool):
    """An evicting device in tokens: each slot keeps its last `window` tokens in a
    ring (slot = position mod window) and answers from them alone."""

    def __init__(self, scheduler: Scheduler, window: int):
        super().__init__(scheduler)
        self.window = window

    def write(self, table, position: int, token: int) -> None:
        page = table[position % self.window // self.pages.page_size]
        assert not self.pages.is_cached(page), "a step writes a cached page"
        super().write(table, position % self.window, token)

    def read(self, table, end: int) -> tuple[int, list[int]]:
        size, window = self.pages.page_size, self.window
        kept = range(max(0, end - window), end)
        return kept.start, [self.pool[table[p % window // size], p % size] for p in kept]


def windowed_solo(prompt, max_new_tokens, window):
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_new_tokens:
        tokens.append(next_token(tokens[-window:]))
    return tokens[len(prompt) :]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    num_pages=st.integers(3, 12),
    prefix_caching=st.booleans(),
    max_steps=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 1000),
)
def test_an_evicting_slot_holds_its_window_and_never_writes_a_cached_page(
    lengths, num_pages, prefix_caching, max_steps, seed
):
    """row_slots=8 of max_len 32 (2 pages of 4 per slot): prompts sharing a start
    get exactly their windowed solo outputs; cached pages are copied, never
    written; every page comes back."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 6).tolist()
    prompts = [shared[: n // 2] + rng.integers(0, VOCAB, n - n // 2).tolist() for n in lengths]
    scheduler = Scheduler(
        PrefixCache(num_pages, 4, salt="test"),
        max_slots=3,
        max_len=32,
        prefill_chunk=4,
        prefix_caching=prefix_caching,
        row_slots=8,
    )
    assert scheduler.pages_per_slot == 2
    device = RingPool(scheduler, window=8)
    for _round in range(2):  # the second round meets the first one's cached pages
        added = [scheduler.add(p, 6) for p in prompts]
        device.drain(max_steps=max_steps)
        assert [r.output for r in added] == [windowed_solo(p, 6, 8) for p in prompts]
    assert scheduler.pages.num_free == num_pages
