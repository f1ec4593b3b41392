"""Automatic prefix caching: requests that start with the same tokens share pages.

    PrefixCache(num_pages, page_size, salt)
      .match(tokens) -> list[int]       cached pages covering the start of `tokens`, retained
      .allocate(n) -> list[int]         fresh pages, evicting unused cached ones if need be
      .register(tokens, pages)          make a written sequence's full pages matchable
      .retain(page), .release(pages)    share a page (fork) / let go of pages
      .is_shared(page), .is_cached(page), .copy_on_write(page) -> int
      .refcount(page), .num_free, .num_cached, .stats
    PrefixCache.page_hash(parent, tokens, salt) -> bytes   (32-byte sha256)

The host side of vLLM's automatic prefix caching (PagedAttention, arXiv:2309.06180).
Page i of a sequence holds tokens[i*L:(i+1)*L] (L = page_size). Once full, it is
named by a hash chained over its parent page's hash, its own tokens and a salt,
so one hash stands for the whole prefix up to the end of that page, and equal
hashes mean equal K/V (for the same model and cache config, which the salt
names). A new request looks its prompt up page by page (`match`), reuses the
pages found, and computes only the rest.

A page is in one of four states:

    free          nobody holds it, nothing reusable in it
    private       held by requests, not (yet) hashed
    cached        hashed and held by requests
    evictable     hashed, held by no request: still matchable, reused last

Requests' references are counted by one PageAllocator. The cache itself holds
one more reference on every hashed page, so the allocator never frees one behind
its back; evicting a page drops that reference. `refcount(page)` reports the
requests' references only.

Evictable pages queue in least-recently-released order and are evicted only when
no free page is left. `release(pages)` queues a sequence's pages last page first,
so its tail is evicted before its head: a later page is unreachable once an
earlier one is gone (the hashes chain).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence

from kvlab.cache.allocator import OutOfPages, PageAllocator, check_size, page_id
from kvlab.config import check_count

HASH_BYTES = 32  # sha256


@dataclasses.dataclass
class PrefixStats:
    """Counters for experiments, in tokens (hit rate = hit_tokens / query_tokens)."""

    query_tokens: int = 0  # prompt tokens passed to match
    hit_tokens: int = 0  # of those, tokens covered by the pages match returned
    evicted_pages: int = 0  # cached pages dropped to make room for fresh ones

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """Page ids for a paged KV cache of `num_pages` pages of `page_size` tokens,
    with full pages shared between requests that start with the same tokens.

    `salt` names the model and cache config (and anything else that changes what a
    page holds, e.g. an adapter or a tenant): pages cached under one salt never
    match under another.
    """

    def __init__(self, num_pages: int, page_size: int, salt: str = ""):
        self.page_size = check_count("cache.page_size", page_size)
        if not isinstance(salt, str):
            raise ValueError(f"salt={salt!r} must be a str naming the model and cache config")
        self.salt = salt
        self.stats = PrefixStats()
        self._pages = PageAllocator(num_pages)  # requests' references + one for each hashed page
        self.num_pages = self._pages.num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> hash of the full page it holds
        self._page_of: dict[bytes, int] = {}  # hash -> the one page registered under it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones plus evictable cached ones."""
        return self._pages.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a hashed full page, held by requests or not."""
        return len(self._hash_of)

    def refcount(self, page: int) -> int:
        """How many references requests hold on `page` (the cache's own is not counted)."""
        page = page_id(page, self.num_pages)
        return self._pages.refcount(page) - (page in self._hash_of)

    def is_cached(self, page: int) -> bool:
        """Whether `page` is registered (matchable): writing to it would change what
        a later match reads, so copy it first (copy_on_write)."""
        return page_id(page, self.num_pages) in self._hash_of

    def is_shared(self, page: int) -> bool:
        """Whether more than one reference is held: copy the page before writing to it."""
        return self.refcount(page) > 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages with one reference each: free pages first, then evictable
        cached ones, least recently released first (their hashes are forgotten).
        OutOfPages, and no change, when even eviction leaves too few."""
        n = check_size(n)
        if n > self.num_free:
            raise OutOfPages(n, self.num_free, self.num_pages)
        for _ in range(n - self._pages.num_free):
            self._evict_one()
        return self._pages.allocate(n)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages holding the longest run of full pages that starts `tokens`,
        each retained for the caller.

        At least one token is left unmatched (so at most (len(tokens) - 1) // L
        pages): the model must still compute the last prompt token's logits.
        """
        limit = (len(tokens) - 1) // self.page_size
        pages = []
        for page_hash in self._hashes(tokens, limit):
            page = self._page_of.get(page_hash)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._pages.retain(page)
            self._evictable.pop(page, None)  # re-queued as most recent when released
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += len(pages) * self.page_size
        return pages

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Make the full pages of a written sequence matchable.

        `pages` is the sequence's block table (it may end with a partial page,
        which is skipped). A page already registered under its hash is left
        alone; a page whose tokens another page already holds stays private (the
        existing entry is kept). All-or-nothing: a ValueError changes nothing.
        """
        num_full = len(tokens) // self.page_size
        if len(pages) < num_full:
            raise ValueError(
                f"register got {len(pages)} pages for {len(tokens)} tokens, which fill "
                f"{num_full} pages of cache.page_size={self.page_size}; pass the sequence's "
                "whole block table"
            )
        new_hash_of: dict[int, bytes] = {}
        new_page_of: dict[bytes, int] = {}
        for page, page_hash in zip(pages[:num_full], self._hashes(tokens, num_full), strict=True):
            page = page_id(page, self.num_pages)
            if self.refcount(page) < 1:
                raise ValueError(
                    f"cannot register page {page}: no sequence holds it; register a "
                    "sequence's pages before releasing them"
                )
            known = self._hash_of.get(page, new_hash_of.get(page))
            if known is not None:
                if known != page_hash:
                    raise ValueError(
                        f"page {page} is registered under other tokens: it was written to "
                        "while cached; call copy_on_write before writing to a cached page"
                    )
                continue
            if page_hash not in self._page_of and page_hash not in new_page_of:
                new_hash_of[page] = page_hash
                new_page_of[page_hash] = page
        for page, page_hash in new_hash_of.items():
            self._hash_of[page] = page_hash
            self._page_of[page_hash] = page
            self._pages.retain(page)  # the cache's own reference

    def retain(self, page: int) -> None:
        """One more reference to a page a request holds (e.g. a forked sequence)."""
        page = page_id(page, self.num_pages)
        if self.refcount(page) < 1:
            raise ValueError(
                f"cannot retain page {page}: no sequence holds it; get pages from allocate or match"
            )
        self._pages.retain(page)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page. A cached page nobody holds any more
        stays matchable and becomes evictable; any other goes back to the free
        list. The pages are queued last first, so a sequence's tail is evicted
        before its head. A ValueError (double free) changes nothing."""
        pages = [page_id(page, self.num_pages) for page in pages]
        for page, count in Counter(pages).items():
            if self.refcount(page) < count:
                raise ValueError(
                    f"cannot release page {page} {count} time(s): requests hold "
                    f"{self.refcount(page)} reference(s) to it (double free)"
                )
        for page in reversed(pages):
            self._pages.release(page)
            if page in self._hash_of and self._pages.refcount(page) == 1:  # only the cache's
                self._evictable[page] = None

    def copy_on_write(self, page: int) -> int:
        """A fresh private page for the caller to copy `page` into before writing;
        the caller's reference to `page` is dropped. OutOfPages changes nothing."""
        page = page_id(page, self.num_pages)
        if self.refcount(page) < 1:
            raise ValueError(f"cannot copy page {page}: no sequence holds it")
        (fresh,) = self.allocate(1)  # cannot evict `page`: it is held
        self.release([page])
        return fresh

    @staticmethod
    def page_hash(parent: bytes | None, tokens: Sequence[int], salt: str) -> bytes:
        """sha256 over the salt, the parent page's hash (None for the first page)
        and the page's tokens as int32 little-endian: equal hashes mean equal
        prefixes up to the end of this page, for the same salt."""
        if parent is not None and len(parent) != HASH_BYTES:
            raise ValueError(f"parent must be a {HASH_BYTES}-byte page hash or None")
        salt_bytes = salt.encode()
        digest = hashlib.sha256()
        digest.update(len(salt_bytes).to_bytes(8, "little"))  # length-prefixed: no ambiguity
        digest.update(salt_bytes)
        digest.update(b"\x00" if parent is None else b"\x01" + parent)
        try:
            digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
        except struct.error as error:
            raise ValueError(f"token ids must fit in int32: {error}") from None
        return digest.digest()

    def _hashes(self, tokens: Sequence[int], num_full: int) -> Iterator[bytes]:
        """Chained hashes of the first `num_full` pages of `tokens`, computed lazily."""
        size = self.page_size
        parent = None
        for i in range(num_full):
            parent = self.page_hash(parent, tokens[i * size : (i + 1) * size], self.salt)
            yield parent

    def _evict_one(self) -> None:
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self._pages.release(page)  # the cache's reference: the page is free
        self.stats.evicted_pages += 1
