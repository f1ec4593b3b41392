"""Which pages of a paged KV cache are in use: a reference-counted free list.

    PageAllocator(num_pages)
      .allocate(n) -> list[int]          n fresh page ids, one reference each
      .retain(page) / .release(page)     one more / one fewer reference
      .refcount(page) -> int
      .num_free, .num_in_use -> int

A paged cache (PagedAttention, arXiv:2309.06180) holds a pool of P pages of L
tokens each; a sequence's block table lists the page ids holding its tokens. This
file is the host side of that pool: plain Python, no arrays. A page is in use
while at least one holder (a sequence, or the prefix cache in prefix.py) holds a
reference to it, and free once the last one lets go.

Free pages are handed out first in, first out: ids 0, 1, ..., P-1 at first, then
in the order they were released. Every call is O(1) per page it touches, and
`allocate` is all-or-nothing.
"""

from __future__ import annotations

from collections import deque

from kvlab.config import check_count


class OutOfPages(RuntimeError):
    """The page pool cannot hold what was asked; nothing was allocated."""

    def __init__(self, asked: int, free: int, num_pages: int):
        self.asked = asked  # pages requested
        self.free = free  # pages that could have been handed out
        self.num_pages = num_pages  # size of the pool
        super().__init__(
            f"asked for {asked} pages but only {free} of cache.num_pages={num_pages} are free; "
            "raise cache.num_pages, or run fewer or shorter sequences at once "
            "(release finished sequences' pages first)"
        )


def page_id(page: int, num_pages: int) -> int:
    """`page` as a Python int, or a ValueError if it is not an id in 0..num_pages-1.

    Accepts numpy integers (block tables are arrays); a negative id would silently
    index from the end of a list, so the range is checked.
    """
    page = check_count("page", page, minimum=0)
    if page >= num_pages:
        raise ValueError(f"page={page} is not a page id in 0..{num_pages - 1}")
    return page


def check_size(n: int) -> int:
    """`n` as a Python int if it is a count of pages (>= 0), else a ValueError."""
    return check_count("n (pages to allocate)", n, minimum=0)


class PageAllocator:
    """Reference counts for `num_pages` pages and the queue of free ones.

    refcount[page] == 0 exactly when the page sits in the free queue, so a page
    is never handed out twice while in use and never lost:
    num_free + num_in_use == num_pages at all times.
    """

    def __init__(self, num_pages: int):
        self.num_pages = check_count("cache.num_pages", num_pages)
        self._refcounts = [0] * num_pages
        self._free = deque(range(num_pages))  # FIFO: allocate from the left, release to the right

    @property
    def num_free(self) -> int:
        """Pages nobody holds."""
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        """Pages with at least one reference."""
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, each with one reference; OutOfPages (and no change) if fewer are free."""
        n = check_size(n)
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), self.num_pages)
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def retain(self, page: int) -> None:
        """One more reference to a page in use (a second sequence shares it)."""
        self._refcounts[self._in_use(page, "retain")] += 1

    def release(self, page: int) -> None:
        """One fewer reference; the page is free again when none is left."""
        page = self._in_use(page, "release")
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            self._free.append(page)

    def refcount(self, page: int) -> int:
        """How many holders reference `page` (0: free)."""
        return self._refcounts[page_id(page, self.num_pages)]

    def _in_use(self, page: int, action: str) -> int:
        page = page_id(page, self.num_pages)
        if self._refcounts[page] == 0:
            why = (
                "double free: it was released already"
                if action == "release"
                else "allocate it first"
            )
            raise ValueError(f"cannot {action} page {page}: it is free ({why})")
        return page
