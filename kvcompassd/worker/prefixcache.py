"""A paged prefix cache with a VRAM and a DRAM tier, as an engine keeps it (sans-IO).

Pages hold ``block_size`` tokens; only full pages are cached (SGLang with a page size > 1 and
vLLM cache page-aligned prefixes only). A page's id is SGLang's block hash: SHA-256 over the
parent page's digest followed by the page's tokens as 4-byte little-endian integers; the event
id is the digest's first 8 bytes as a signed big-endian int64 (``hash_str_to_int64``).

Invariants, as in SGLang's HiCache: the VRAM pages form a rooted subtree (a prefix is loaded
whole), and so do the present pages (VRAM or DRAM). VRAM overflow demotes the least valuable
VRAM leaf to DRAM (``BlockStored`` medium ``CPU_PINNED`` then ``BlockRemoved`` medium ``GPU``,
the order SGLang's publisher was captured sending); DRAM overflow drops a DRAM copy. Pages
pinned by running requests are never demoted. Every change is returned as the engine's own
:mod:`kvcompassd.engine.kvevents` events, so the emulator can publish them and the simulator
can feed them straight to the block tree.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.engine.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

GPU = "GPU"
CPU = "CPU_PINNED"
_ROOT_DIGEST = b""
_MAX_TOKEN_ID = (1 << 32) - 1
_UINT32 = np.dtype(np.uint32)
_unpack_int64_be = struct.Struct(">q").unpack_from  # reads the first 8 bytes without a slice


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"


def page_digest(parent_digest: bytes, tokens: Sequence[int]) -> bytes:
    """SGLang's ``get_hash_str``: SHA-256 of the parent's digest then uint32-LE tokens."""
    hasher = hashlib.sha256(parent_digest)
    hasher.update(np.asarray(tokens, dtype="<u4").tobytes())
    return hasher.digest()


_from_buffer = ffi.from_buffer
_page_chain = lib.kvc_sha256_page_chain
_AUTO_SHA256 = int(lib.KVC_SHA256_AUTO)


def page_digests(data: bytes | memoryview, page_bytes: int, n_pages: int, parent_digest: bytes = _ROOT_DIGEST) -> bytes:
    """The ``page_digest`` chain of ``n_pages`` pages of ``data`` (``page_bytes`` each) under
    ``parent_digest``, as one buffer of 32-byte digests: one C call (``kvc_sha256_page_chain``)
    instead of a hash object per page."""
    if n_pages <= 0:
        return b""
    if len(data) < page_bytes * n_pages:
        raise ValueError(f"{len(data)} bytes hold fewer than {n_pages} pages of {page_bytes}")
    out = bytearray(32 * n_pages)
    _page_chain(_from_buffer("uint8_t[]", parent_digest), len(parent_digest), _from_buffer("uint8_t[]", data),
                page_bytes, n_pages, _AUTO_SHA256, _from_buffer("uint8_t[]", out))
    return bytes(out)


def _checked_token_list(tokens: Sequence[int]) -> list[int] | None:
    """``tokens`` as a list of plain ints when every one is an int in [0, 2^32), else None.
    One C-level pass (a uint32 array, as the simulator passes, needs no check at all)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            return None
        if tokens.dtype.itemsize > 4 or tokens.dtype.kind == "i":
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > _MAX_TOKEN_ID):
                return None
        return tokens.tolist()
    values = list(tokens)
    if values and not (set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= _MAX_TOKEN_ID):
        return None
    return values


def _token_data(tokens: Sequence[int]) -> bytes:
    """Tokens as the uint32 little-endian bytes the page digests hash."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def digest_to_int64(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the first 64 bits, big-endian, as a signed int."""
    return _unpack_int64_be(digest)[0]


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """A cached prefix: ``vram_tokens`` usable at once, then ``dram_tokens`` to reload."""

    vram_tokens: int
    dram_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.vram_tokens + self.dram_tokens


@dataclass(slots=True)
class CacheLease:
    """Pages pinned for one running request; give it back with :meth:`PrefixCache.unlock`."""

    pages: list[int] = field(default_factory=list)
    released: bool = False
    # The page digests ``lock`` computed and the token bytes they cover: ``insert`` with this
    # lease skips hashing them again when its tokens start with the same bytes.
    digests: list[bytes] = field(default_factory=list)
    hashed: bytes = b""


class _Page:
    __slots__ = ("id", "digest", "parent", "tokens", "in_vram", "in_dram", "children", "vram_children",
                 "pins", "last_access", "hits", "stamp", "checked")

    def __init__(self, page_id: int, digest: bytes, parent: _Page | None, tokens: tuple[int, ...],
                 checked: bool) -> None:
        self.id = page_id
        self.digest = digest
        self.parent = parent
        self.tokens = tokens
        self.in_vram = False
        self.in_dram = False
        self.children = 0       # present children
        self.vram_children = 0  # children in VRAM
        self.pins = 0
        self.last_access = 0.0
        self.hits = 0
        self.stamp = 0
        self.checked = checked  # tokens are plain ints in [0, 2^32) and the block size an int


class PrefixCacheError(ValueError):
    """Misuse of the prefix cache (bad capacities, releasing a lease twice)."""


class PrefixCache:
    """Paged two-tier prefix cache emitting the engine's KV events."""

    def __init__(
        self,
        *,
        block_size: int,
        vram_tokens: int,
        dram_tokens: int = 0,
        policy: EvictionPolicy | str = EvictionPolicy.LRU,
        emit_events: bool = True,
    ) -> None:
        """``emit_events=False``: for a caller nobody listens to (a simulated engine whose
        policy reads no cache events), build no event objects and only count them in
        ``events_unsent``; the cache itself behaves exactly the same."""
        if block_size <= 0:
            raise PrefixCacheError(f"block_size must be positive, got {block_size}")
        if vram_tokens < 0 or dram_tokens < 0:
            raise PrefixCacheError("capacities must be >= 0 tokens")
        self.block_size = block_size
        self.vram_pages_max = vram_tokens // block_size
        self.dram_pages_max = dram_tokens // block_size
        self.policy = EvictionPolicy(policy)
        self._pages: dict[int, _Page] = {}
        self._by_digest: dict[bytes, _Page] = {}
        self.vram_pages = 0
        self.dram_pages = 0
        self._vram_heap: list[tuple[tuple[float, ...], int, int, int]] = []
        self._dram_heap: list[tuple[tuple[float, ...], int, int, int]] = []
        self._order = itertools.count()
        self._pushes = 0
        self.demotions = 0
        self.evictions = 0
        # VRAM pages pinned by running requests (a page pinned by several counted once): what
        # a new request cannot take for its prompt (``lock(..., only_if_room=True)``).
        self.pinned_vram_pages = 0
        self._int_block_size = type(block_size) is int  # events of checked pages skip validation
        self.emit_events = emit_events
        self.events_unsent = 0

    # ------------------------------------------------------------------------------ queries

    @property
    def vram_used_tokens(self) -> int:
        return self.vram_pages * self.block_size

    @property
    def dram_used_tokens(self) -> int:
        return self.dram_pages * self.block_size

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, tokens: Sequence[int]) -> CacheMatch:
        """Longest cached prefix of ``tokens`` in full pages, split by tier. No side effects."""
        vram = dram = 0
        for page in self._walk(tokens):
            if page.in_vram and dram == 0:
                vram += self.block_size
            else:
                dram += self.block_size
        return CacheMatch(vram, dram)

    def page_ids(self, tokens: Sequence[int]) -> list[int]:
        """The event ids of the cached pages prefixing ``tokens``."""
        return [page.id for page in self._walk(tokens)]

    def path_ids(self, tokens: Sequence[int]) -> list[int]:
        """The event ids of every full page of ``tokens``, cached or not, root first: the pages
        a request for ``tokens`` pins once its prompt is cached (``lock`` then ``insert``)."""
        return [digest_to_int64(digest) for _, digest in self._chain(tokens)]

    # ------------------------------------------------------------------------------ updates

    def lock(self, tokens: Sequence[int], *, now: float, only_if_room: bool = False,
             prompt_tokens: int | None = None) -> tuple[CacheLease, CacheMatch, list[KvEvent]] | None:
        """Start a request: pin its cached prefix, reload the DRAM part into VRAM. The match
        returned is what the request really reuses (a reload that finds no room ends it).

        ``only_if_room``: as SGLang's ``PrefillAdder`` admits a request only when its prompt's
        KV fits in the free and evictable pool, return None (and change nothing) unless every
        full page of ``tokens`` fits in VRAM beside the pages running requests pin (the
        prompt's own pinned prefix counted once). With nothing pinned it always goes ahead: a
        prompt longer than VRAM runs alone. ``prompt_tokens``: the prompt's length when
        ``tokens`` is only the part to match (SGLang matches all but the last token); its full
        pages are what must fit."""
        data = _token_data(tokens)
        digests: list[bytes] = []
        pages = list(self._walk(tokens, data, digests))
        if only_if_room and self.pinned_vram_pages:
            shared = sum(1 for page in pages if page.in_vram and page.pins)
            length = len(tokens) if prompt_tokens is None else max(prompt_tokens, len(tokens))
            if length // self.block_size - shared > self.vram_pages_max - self.pinned_vram_pages:
                return None
        for page in pages:  # pin the whole path first: making room must not evict its tail
            if not page.pins and page.in_vram:
                self.pinned_vram_pages += 1
            page.pins += 1
        lease = CacheLease(digests=digests, hashed=data[:4 * self.block_size * len(digests)])
        events: list[KvEvent] = []
        vram = dram = 0
        for i, page in enumerate(pages):
            if page.in_vram:
                vram += self.block_size
            elif self._load_into_vram(page, events):
                dram += self.block_size
            else:
                for rest in pages[i:]:
                    rest.pins -= 1
                    if not rest.pins and rest.in_vram:
                        self.pinned_vram_pages -= 1
                    self._changed(rest)
                break
            self._touch(page, now)
            lease.pages.append(page.id)
            self._changed(page)
        return lease, CacheMatch(vram, dram), events

    def insert(self, tokens: Sequence[int], *, now: float, lease: CacheLease | None = None) -> list[KvEvent]:
        """Cache every full page of ``tokens`` in VRAM (making room by demotion/eviction)."""
        events: list[KvEvent] = []
        pinned = set(lease.pages) if lease is not None else set()
        parent: _Page | None = None
        size = self.block_size
        # Pages of checked tokens get their events built unvalidated (the fields are canonical
        # by construction); anything else takes the validating path and fails as it always did.
        # A uint32 array (what the simulator passes) needs no check, and only its new pages are
        # turned into ints: most of a prompt's pages are usually cached already.
        as_array = isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype == _UINT32
        token_list = None if as_array else _checked_token_list(tokens)
        checked = (as_array or token_list is not None) and self._int_block_size
        if token_list is None:
            token_list = tokens
        by_digest = self._by_digest
        changed = self._changed
        pages = self._pages
        data = _token_data(tokens)
        known = lease.digests if lease is not None and lease.digests and data.startswith(lease.hashed) else None
        tail_from, tail = -1, None  # an array's tokens from its first new page on, as ints (made once)
        for start, digest in self._chain(tokens, data, known):
            page = by_digest.get(digest)
            if page is None:
                if as_array:
                    if tail is None:  # (the pages after a new one are nearly always new too)
                        tail_from, tail = start, tokens[start:].tolist()  # type: ignore[index]
                    page_tokens = tuple(tail[start - tail_from : start - tail_from + size])
                elif checked:
                    page_tokens = tuple(token_list[start : start + size])
                else:
                    page_tokens = tuple(map(int, token_list[start : start + size]))
                if lease is not None and self.vram_pages < self.vram_pages_max and (parent is None or parent.pins):
                    # The engine's common case, inlined: VRAM has room and the parent is pinned
                    # (by this lease), so none of the general path's re-queues can push a heap
                    # entry; each only bumps a stamp (3 on the parent, 2 on the page), and a
                    # stamp is only ever compared for equality with the entries it stamped.
                    page = _Page(digest_to_int64(digest), digest, parent, page_tokens, checked)
                    by_digest[digest] = page
                    pages[page.id] = page
                    if parent is not None:
                        parent.children += 1
                        parent.vram_children += 1
                        parent.stamp += 3
                    page.in_vram = True
                    self.vram_pages += 1
                    self._emit(events, self._stored, page, GPU)
                    page.last_access = now
                    page.hits += 1
                    if page.id not in pinned:
                        page.pins += 1
                        self.pinned_vram_pages += 1  # (a new page: it had no pins)
                        lease.pages.append(page.id)
                        pinned.add(page.id)
                        page.stamp += 2
                    else:
                        page.stamp += 1
                        changed(page)
                    parent = page
                    continue
                page = self._new_page(digest, parent, page_tokens, checked)
                if not self._add_vram(page, events, new=True):
                    self._discard_new(page)
                    break
            elif not page.in_vram and not self._load_into_vram(page, events):
                break
            page.last_access = now  # _touch, inlined: this loop runs once per page of every prompt
            page.hits += 1
            if lease is not None and page.id not in pinned:
                if not page.pins:  # (in VRAM: it was loaded above or already there)
                    self.pinned_vram_pages += 1
                page.pins += 1
                lease.pages.append(page.id)
                pinned.add(page.id)
            if page.pins:
                page.stamp += 1  # what changed() does to a pinned page
            else:
                changed(page)
            parent = page
        return events

    def unlock(self, lease: CacheLease) -> None:
        if lease.released:
            raise PrefixCacheError("lease released twice")
        lease.released = True
        for page_id in lease.pages:
            page = self._pages.get(page_id)
            if page is not None and page.pins > 0:
                page.pins -= 1
                if page.pins == 0:  # only then can it become an eviction candidate
                    if page.in_vram:
                        self.pinned_vram_pages -= 1
                    self._changed(page)

    def flush(self) -> list[KvEvent]:
        """Drop everything (SGLang's /flush_cache). Pins survive nothing: callers flush idle."""
        self._pages.clear()
        self._by_digest.clear()
        self.vram_pages = self.dram_pages = 0
        self.pinned_vram_pages = 0
        self._vram_heap.clear()
        self._dram_heap.clear()
        return [AllBlocksCleared()]

    # ------------------------------------------------------------------------------ internals

    def _chain(self, tokens: Sequence[int], data: bytes | None = None,
               known: list[bytes] | None = None) -> Iterable[tuple[int, bytes]]:
        """(start, digest) of every full page, hashing the token bytes in one conversion.
        ``data`` is ``_token_data(tokens)`` when the caller has it; ``known`` the digests of the
        first pages when already computed over the same bytes (a lease's)."""
        if data is None:
            data = _token_data(tokens)
        size = self.block_size
        digests = list(known) if known else []
        first = size * len(digests)
        fresh = (len(tokens) - first) // size if len(tokens) >= first else 0
        if fresh > 0:  # all of them in one C call (a walk that stops early wasted little: ~0.1 us a page)
            chain = page_digests(memoryview(data)[4 * first:], int(4 * size), int(fresh),
                                 digests[-1] if digests else _ROOT_DIGEST)
            digests += [chain[i:i + 32] for i in range(0, len(chain), 32)]
        return zip(range(0, size * len(digests), size), digests)

    def _walk(self, tokens: Sequence[int], data: bytes | None = None,
              digests: list[bytes] | None = None) -> Iterator[_Page]:
        """The cached pages prefixing ``tokens``; their digests go to ``digests`` if given."""
        for _, digest in self._chain(tokens, data):
            page = self._by_digest.get(digest)
            if page is None:
                return
            if digests is not None:
                digests.append(digest)
            yield page

    def _new_page(self, digest: bytes, parent: _Page | None, tokens: tuple[int, ...], checked: bool) -> _Page:
        page = _Page(digest_to_int64(digest), digest, parent, tokens, checked)
        self._by_digest[digest] = page
        self._pages[page.id] = page
        if parent is not None:
            parent.children += 1
            self._changed(parent)
        return page

    def _discard_new(self, page: _Page) -> None:
        del self._by_digest[page.digest]
        del self._pages[page.id]
        if page.parent is not None:
            page.parent.children -= 1
            self._changed(page.parent)

    def _stored(self, page: _Page, medium: str) -> BlockStored:
        parent = page.parent.id if page.parent is not None else None
        if page.checked:
            return BlockStored.trusted((page.id,), parent, page.tokens, self.block_size, None, medium)
        return BlockStored((page.id,), parent, page.tokens, self.block_size, None, medium)

    def _emit(self, events: list, make, *args) -> None:
        """Append ``make(*args)`` to ``events``, or only count it when nobody reads events."""
        if self.emit_events:
            events.append(make(*args))
        else:
            self.events_unsent += 1

    def _add_vram(self, page: _Page, events: list[KvEvent], *, new: bool = False) -> bool:
        if self.vram_pages < self.vram_pages_max:
            # Room already (the common case): the guard pins below would change nothing, but
            # their re-queues still happen, page then parent, as on the general path.
            self._changed(page)
            if page.parent is not None:
                self._changed(page.parent)
        else:
            # Pin the page (it may be a DRAM leaf) and its parent (a VRAM leaf until the page
            # lands) so that making room cannot take either away.
            guarded = [page] if page.parent is None else [page, page.parent]
            for p in guarded:
                p.pins += 1
            try:
                if not self._make_vram_room(events):
                    return False
            finally:
                for p in guarded:
                    p.pins -= 1
                    self._changed(p)  # re-queue: a heap entry popped while pinned was dropped
        page.in_vram = True
        self.vram_pages += 1
        if page.pins:  # a pinned page reloaded (its guard pin is released by now)
            self.pinned_vram_pages += 1
        if page.parent is not None:
            page.parent.vram_children += 1
            self._changed(page.parent)
        self._emit(events, self._stored, page, GPU)
        return True

    def _load_into_vram(self, page: _Page, events: list[KvEvent]) -> bool:
        # reloading keeps the DRAM copy (HiCache write-back keeps host pages)
        return self._add_vram(page, events)

    def _make_vram_room(self, events: list[KvEvent]) -> bool:
        while self.vram_pages >= self.vram_pages_max:
            victim = self._pop(self._vram_heap, self._vram_candidate)
            if victim is None:
                return False
            self._demote(victim, events)
        return True

    def _demote(self, page: _Page, events: list[KvEvent]) -> None:
        if not page.in_dram and self.dram_pages_max > 0:
            page.pins += 1
            try:
                has_room = self._make_dram_room(events)
            finally:
                page.pins -= 1
            if has_room:
                page.in_dram = True
                self.dram_pages += 1
                self._emit(events, self._stored, page, CPU)
        if not page.in_dram and page.children:
            # nowhere to put it and it has DRAM-only children: drop them first (leaf-first)
            self._drop_dram_subtree(page, events)
        page.in_vram = False
        self.vram_pages -= 1
        if page.parent is not None:
            page.parent.vram_children -= 1
            self._changed(page.parent)
        self._emit(events, BlockRemoved.trusted, (page.id,), GPU)
        self.demotions += 1
        if not page.in_dram:
            self._forget(page)
        else:
            self._changed(page)

    def _drop_dram_subtree(self, page: _Page, events: list[KvEvent]) -> None:
        children = [p for p in self._pages.values() if p.parent is page]
        for child in children:
            self._drop_dram_subtree(child, events)
            if child.in_dram:
                child.in_dram = False
                self.dram_pages -= 1
                self._emit(events, BlockRemoved.trusted, (child.id,), CPU)
                self.evictions += 1
            self._forget(child)

    def _make_dram_room(self, events: list[KvEvent]) -> bool:
        while self.dram_pages >= self.dram_pages_max:
            victim = self._pop(self._dram_heap, self._dram_candidate)
            if victim is None:
                return False
            victim.in_dram = False
            self.dram_pages -= 1
            self._emit(events, BlockRemoved.trusted, (victim.id,), CPU)
            self.evictions += 1
            if not victim.in_vram:
                self._forget(victim)
            else:
                self._changed(victim)
        return True

    def _forget(self, page: _Page) -> None:
        del self._pages[page.id]
        del self._by_digest[page.digest]
        if page.parent is not None:
            page.parent.children -= 1
            self._changed(page.parent)

    def _touch(self, page: _Page, now: float) -> None:
        page.last_access = now
        page.hits += 1

    def _vram_candidate(self, page: _Page) -> bool:
        return page.in_vram and page.pins == 0 and page.vram_children == 0

    def _dram_candidate(self, page: _Page) -> bool:
        return page.in_dram and page.pins == 0 and (page.in_vram or page.children == 0)

    def _priority(self, page: _Page) -> tuple[float, ...]:
        if self.policy is EvictionPolicy.LFU:
            return (page.hits, page.last_access)
        return (page.last_access,)

    def _changed(self, page: _Page) -> None:
        """Re-queue ``page`` in the eviction heaps it now qualifies for (old entries go stale)."""
        page.stamp += 1
        if page.pins or page.id not in self._pages:
            return
        vram = page.in_vram and page.vram_children == 0
        dram = page.in_dram and (page.in_vram or page.children == 0)
        if not (vram or dram):
            return
        priority = (page.hits, page.last_access) if self.policy is EvictionPolicy.LFU else (page.last_access,)
        if vram:
            heapq.heappush(self._vram_heap, (priority, next(self._order), page.id, page.stamp))
        if dram:
            heapq.heappush(self._dram_heap, (priority, next(self._order), page.id, page.stamp))
        self._pushes += 1
        if self._pushes >= 4096:  # stale entries pile up: rebuild both heaps now and then
            self._pushes = 0
            if len(self._vram_heap) > 4 * (len(self._pages) + 64):
                self._vram_heap = self._rebuild(self._vram_candidate)
            if len(self._dram_heap) > 4 * (len(self._pages) + 64):
                self._dram_heap = self._rebuild(self._dram_candidate)

    def _rebuild(self, candidate) -> list[tuple[tuple[float, ...], int, int, int]]:
        heap = [(self._priority(p), next(self._order), p.id, p.stamp) for p in self._pages.values() if candidate(p)]
        heapq.heapify(heap)
        return heap

    def _pop(self, heap: list, candidate) -> _Page | None:
        while heap:
            _, _, page_id, stamp = heapq.heappop(heap)
            page = self._pages.get(page_id)
            if page is not None and page.stamp == stamp and candidate(page):
                return page
        return None
