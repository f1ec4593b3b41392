from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.cache.allocator import OutOfPages, PageAllocator


@pytest.mark.parametrize("num_pages", [0, -3, 2.0, "4", True, None])
def test_bad_num_pages_names_the_field(num_pages):
    with pytest.raises(ValueError, match="cache.num_pages"):
        PageAllocator(num_pages)


def test_free_pages_are_handed_out_first_in_first_out():
    allocator = PageAllocator(4)
    assert allocator.allocate(2) == [0, 1]
    allocator.release(0)
    assert allocator.allocate(3) == [2, 3, 0]
    assert allocator.num_free == 0


def test_out_of_pages_is_all_or_nothing_and_says_how_to_fix_it():
    allocator = PageAllocator(3)
    allocator.allocate(2)
    with pytest.raises(OutOfPages, match=r"asked for 2 .* only 1 of cache.num_pages=3") as error:
        allocator.allocate(2)
    assert "raise cache.num_pages" in str(error.value)
    assert allocator.num_free == 1
    assert allocator.allocate(1) == [2]


def test_double_free_and_retaining_a_free_page_raise():
    allocator = PageAllocator(2)
    (page,) = allocator.allocate(1)
    allocator.retain(page)
    allocator.release(page)
    allocator.release(page)
    with pytest.raises(ValueError, match="double free"):
        allocator.release(page)
    with pytest.raises(ValueError, match="free"):
        allocator.retain(page)


@pytest.mark.parametrize("page", [-1, 2, 1.0, True])
def test_page_ids_out_of_range_raise(page):
    allocator = PageAllocator(2)
    allocator.allocate(2)
    with pytest.raises(ValueError, match="page"):
        allocator.release(page)


def test_numpy_page_ids_are_accepted():
    allocator = PageAllocator(2)
    allocator.allocate(np.int32(2))
    allocator.release(np.int64(1))
    assert allocator.refcount(np.int32(1)) == 0


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/retain/release against a model: a multiset of held references."""

    @initialize(num_pages=st.integers(1, 8))
    def start(self, num_pages):
        self.allocator = PageAllocator(num_pages)
        self.held = Counter()  # page -> references the test holds

    @rule(n=st.integers(0, 9))
    def allocate(self, n):
        free_before = self.allocator.num_free
        if n > free_before:
            with pytest.raises(OutOfPages):
                self.allocator.allocate(n)
            assert self.allocator.num_free == free_before
            return
        pages = self.allocator.allocate(n)
        assert len(set(pages)) == n
        assert not set(pages) & set(self.held)  # never a page in use
        self.held.update(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def retain(self, data):
        page = data.draw(st.sampled_from(sorted(self.held)))
        self.allocator.retain(page)
        self.held[page] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        page = data.draw(st.sampled_from(sorted(self.held)))
        self.allocator.release(page)
        self.held[page] -= 1
        if not self.held[page]:
            del self.held[page]

    @rule(data=st.data())
    def double_free_raises(self, data):
        page = data.draw(st.integers(0, self.allocator.num_pages - 1))
        if page not in self.held:
            with pytest.raises(ValueError, match="double free"):
                self.allocator.release(page)

    @rule()
    def release_everything(self):
        for page, count in self.held.items():
            for _ in range(count):
                self.allocator.release(page)
        self.held.clear()
        assert self.allocator.num_free == self.allocator.num_pages

    @invariant()
    def counts_match_the_model(self):
        for page in range(self.allocator.num_pages):
            assert self.allocator.refcount(page) == self.held[page]
        assert self.allocator.num_in_use == len(self.held)
        assert self.allocator.num_free + self.allocator.num_in_use == self.allocator.num_pages


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30)
