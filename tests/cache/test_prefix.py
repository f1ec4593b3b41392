from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.cache.allocator import OutOfPages
from kvlab.cache.prefix import PrefixCache


def prefill(cache, tokens):
    """What an engine does with a new prompt: reuse cached pages, compute the rest, register."""
    matched = cache.match(tokens)
    fresh = cache.allocate(-(-len(tokens) // cache.page_size) - len(matched))
    pages = matched + fresh
    cache.register(tokens, pages)
    return pages


@pytest.mark.parametrize("page_size", [0, -1, 1.5, None])
def test_bad_page_size_names_the_field(page_size):
    with pytest.raises(ValueError, match="cache.page_size"):
        PrefixCache(4, page_size)


def test_bad_num_pages_names_the_field():
    with pytest.raises(ValueError, match="cache.num_pages"):
        PrefixCache(0, 16)


def test_match_returns_the_pages_registered_for_the_same_full_pages():
    cache = PrefixCache(num_pages=8, page_size=2)
    pages = prefill(cache, [1, 2, 3, 4, 5])
    assert cache.num_cached == 2  # the third page holds one token: not cached
    assert cache.match([1, 2, 3, 4, 9]) == pages[:2]
    assert cache.match([1, 2, 3, 9, 9]) == pages[:1]
    assert cache.match([9, 2, 3, 4, 5]) == []
    assert [cache.refcount(page) for page in pages] == [3, 2, 1]


def test_hash_is_chained_over_earlier_pages():
    cache = PrefixCache(num_pages=8, page_size=2)
    prefill(cache, [1, 2, 3, 4])
    assert cache.match([5, 6, 3, 4, 0]) == []  # same second page, different first page


def test_partial_pages_are_never_matched():
    cache = PrefixCache(num_pages=8, page_size=4)
    pages = prefill(cache, [1, 2, 3, 4, 5, 6])
    assert cache.num_cached == 1
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == pages[:1]


def test_at_least_one_token_is_left_unmatched():
    cache = PrefixCache(num_pages=8, page_size=2)
    pages = prefill(cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4]) == pages[:1]  # the last prompt token needs its logits
    assert cache.match([1, 2]) == []
    assert cache.match([]) == []
    assert cache.match([1, 2, 3, 4, 5]) == pages


def test_page_hash_depends_on_salt_parent_and_tokens():
    root = PrefixCache.page_hash(None, [1, 2], "model-a")
    assert len(root) == 32
    assert root == PrefixCache.page_hash(None, [1, 2], "model-a")
    assert root != PrefixCache.page_hash(None, [1, 2], "model-b")
    assert root != PrefixCache.page_hash(None, [2, 1], "model-a")
    assert root != PrefixCache.page_hash(
        PrefixCache.page_hash(None, [0], "model-a"), [1, 2], "model-a"
    )
    assert PrefixCache.page_hash(None, [1], "a") != PrefixCache.page_hash(None, [1], "a\x01")


def test_eviction_takes_the_least_recently_released_page_first():
    cache = PrefixCache(num_pages=3, page_size=2)
    pages = {
        name: prefill(cache, tokens)
        for name, tokens in [("a", [1, 1]), ("b", [2, 2]), ("c", [3, 3])]
    }
    for name in "abc":
        cache.release(pages[name])  # queue: a, b, c
    assert cache.num_free == 3 and cache.num_cached == 3
    cache.release(cache.match([1, 1, 9]))  # a is used again: queue b, c, a
    assert cache.allocate(1) == pages["b"]
    assert cache.stats.evicted_pages == 1
    assert cache.match([2, 2, 9]) == []
    assert cache.match([3, 3, 9]) == pages["c"]
    assert cache.match([1, 1, 9]) == pages["a"]


def test_a_sequence_tail_is_evicted_before_its_head():
    cache = PrefixCache(num_pages=3, page_size=1)
    pages = prefill(cache, [1, 2, 3])
    cache.release(pages)
    assert cache.allocate(1) == [pages[2]]
    assert cache.match([1, 2, 3, 4]) == pages[:2]


def test_free_pages_are_used_before_cached_ones_are_evicted():
    cache = PrefixCache(num_pages=4, page_size=2)
    cached, partial = prefill(cache, [1, 2, 3])
    cache.release([cached, partial])
    assert cache.num_free == 4 and cache.num_cached == 1
    fresh = cache.allocate(3)
    assert cached not in fresh and partial in fresh
    assert cache.match([1, 2, 3]) == [cached]
    assert cache.stats.evicted_pages == 0


def test_out_of_pages_changes_nothing():
    cache = PrefixCache(num_pages=2, page_size=1)
    pages = prefill(cache, [7])
    with pytest.raises(OutOfPages, match="cache.num_pages=2"):
        cache.allocate(2)
    cache.release(pages)
    with pytest.raises(OutOfPages):
        cache.allocate(3)
    assert cache.num_free == 2 and cache.num_cached == 1  # nothing was evicted


def test_copy_on_write_gives_a_fresh_page_and_drops_one_reference():
    cache = PrefixCache(num_pages=3, page_size=2)
    (page,) = cache.allocate(1)
    cache.retain(page)  # a forked sequence shares it
    assert cache.is_shared(page)
    fresh = cache.copy_on_write(page)
    assert fresh != page
    assert cache.refcount(page) == 1 and cache.refcount(fresh) == 1
    assert not cache.is_shared(page) and not cache.is_shared(fresh)


def test_copy_on_write_out_of_pages_keeps_the_reference():
    cache = PrefixCache(num_pages=1, page_size=2)
    (page,) = cache.allocate(1)
    cache.retain(page)
    with pytest.raises(OutOfPages):
        cache.copy_on_write(page)
    assert cache.refcount(page) == 2


def test_a_second_page_with_the_same_tokens_stays_private():
    cache = PrefixCache(num_pages=4, page_size=2)
    tokens = [1, 2, 3]
    first, second = cache.allocate(2), cache.allocate(2)  # both computed before either registered
    cache.register(tokens, first)
    cache.register(tokens, second)
    cache.register(tokens, first)  # registering again changes nothing
    assert cache.num_cached == 1
    assert cache.match(tokens) == first[:1]
    cache.release(second)
    assert cache.num_free == 2  # back on the free list, nothing left to match


def test_register_rejects_a_cached_page_written_under_other_tokens():
    cache = PrefixCache(num_pages=4, page_size=2)
    pages = prefill(cache, [1, 2, 3])
    with pytest.raises(ValueError, match="copy_on_write"):
        cache.register([5, 6, 7], pages)
    with pytest.raises(ValueError, match="block table"):
        cache.register([1, 2, 3, 4], pages[:1])
    assert cache.num_cached == 1


def test_release_rejects_a_double_free_and_changes_nothing():
    cache = PrefixCache(num_pages=4, page_size=2)
    pages = cache.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        cache.release([pages[1], pages[0], pages[0]])
    assert [cache.refcount(page) for page in pages] == [1, 1]


def test_hit_statistics_count_tokens():
    cache = PrefixCache(num_pages=8, page_size=2)
    prefill(cache, [1, 2, 3, 4, 5])
    prefill(cache, [1, 2, 3, 4, 6])
    assert (cache.stats.query_tokens, cache.stats.hit_tokens) == (10, 4)
    assert cache.stats.hit_rate == pytest.approx(0.4)


@dataclass
class Request:
    tokens: list
    pages: list  # the block table: page i holds tokens[i * L : (i + 1) * L]


class PrefixMachine(RuleBasedStateMachine):
    """Requests arrive (match + allocate + write), register, fork, extend and finish at
    random, against a model of what each page holds. Every page a live request holds
    keeps its references and its tokens; allocate never returns one of them."""

    @initialize(num_pages=st.integers(1, 10), page_size=st.integers(1, 3))
    def start(self, num_pages, page_size):
        self.cache = PrefixCache(num_pages, page_size, salt="test")
        self.requests: list[Request] = []
        self.written: dict[int, list] = {}  # page -> tokens written to it

    def held(self) -> Counter:
        return Counter(page for request in self.requests for page in request.pages)

    def check_fresh(self, pages):
        assert not set(pages) & set(self.held())

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=8))
    def add_request(self, tokens):
        size = self.cache.page_size
        matched = self.cache.match(tokens)
        assert len(matched) * size < len(tokens)
        for i, page in enumerate(matched):
            assert self.written[page] == tokens[i * size : (i + 1) * size]
        need = -(-len(tokens) // size) - len(matched)
        try:
            fresh = self.cache.allocate(need)
        except OutOfPages:
            assert need > self.cache.num_free
            self.cache.release(matched)
            return
        self.check_fresh(fresh)
        for i, page in enumerate(fresh, start=len(matched)):
            self.written[page] = tokens[i * size : (i + 1) * size]
        self.requests.append(Request(list(tokens), matched + fresh))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def register(self, data):
        request = data.draw(st.sampled_from(self.requests))
        self.cache.register(request.tokens, request.pages)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data):
        request = data.draw(st.sampled_from(self.requests))
        for page in request.pages:
            self.cache.retain(page)
        self.requests.append(Request(list(request.tokens), list(request.pages)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def extend(self, data, new_tokens):
        """Decode: append tokens, copying a shared last page before writing to it."""
        request = data.draw(st.sampled_from(self.requests))
        size = self.cache.page_size
        for token in new_tokens:
            i = len(request.tokens) // size
            try:
                if i == len(request.pages):
                    (page,) = self.cache.allocate(1)
                    self.check_fresh([page])
                    self.written[page] = []
                    request.pages.append(page)
                elif self.cache.is_shared(request.pages[i]):
                    page = self.cache.copy_on_write(request.pages[i])
                    self.check_fresh([page])
                    self.written[page] = list(self.written[request.pages[i]])
                    request.pages[i] = page
            except OutOfPages:
                return
            page = request.pages[i]
            assert self.cache.refcount(page) == 1
            assert self.written[page] == request.tokens[i * size :]  # a partial page
            self.written[page].append(token)
            request.tokens.append(token)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.cache.release(request.pages)

    @rule()
    def finish_all(self):
        for request in self.requests:
            self.cache.release(request.pages)
        self.requests = []
        assert self.cache.num_free == self.cache.num_pages

    @invariant()
    def references_and_tokens_are_intact(self):
        held = self.held()
        for page in range(self.cache.num_pages):
            assert self.cache.refcount(page) == held[page]
        assert self.cache.num_free == self.cache.num_pages - len(held)
        assert self.cache.num_cached <= self.cache.num_pages
        size = self.cache.page_size
        for request in self.requests:
            for i, page in enumerate(request.pages):
                assert self.written[page] == request.tokens[i * size : (i + 1) * size]


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=150, stateful_step_count=40)
