"""The prefix cache's fast path (checked tokens, events built with BlockStored.trusted) against
its validating path: the same operations on plain-int lists, uint32 arrays and lists of numpy
scalars (which take the validating path) give equal events, matches and state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.engine.kvevents import BlockStored, KvEventError

BS = 4


def prompts(rnd, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (so pages are reused, reloaded, demoted and evicted)."""
    bases = [[rnd.randrange(0, 1 << 32) for _ in range(rnd.randrange(0, 24))] for _ in range(4)]
    out = []
    for _ in range(n):
        tail = [rnd.choice([rnd.randrange(0, 50), rnd.randrange(0, 1 << 32)]) for _ in range(rnd.randrange(0, 20))]
        out.append(rnd.choice(bases) + tail)
    return out


@settings(max_examples=100, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["lru", "lfu"]), st.integers(2, 12), st.integers(0, 12))
def test_fast_and_validating_paths_agree(rnd, policy: str, vram_pages: int, dram_pages: int) -> None:
    forms = [
        lambda t: list(t),                             # plain ints: checked fast path
        lambda t: np.asarray(t, dtype=np.uint32),      # the simulator's form: fast path
        lambda t: [np.int64(x) for x in t],            # numpy scalars: validating path
    ]
    caches = [PrefixCache(block_size=BS, vram_tokens=BS * vram_pages, dram_tokens=BS * dram_pages, policy=policy)
              for _ in forms]
    leases: list[list] = [[] for _ in forms]
    for step, tokens in enumerate(prompts(rnd, 30)):
        now = float(step)
        action = rnd.random()
        results = []
        for cache, form, held in zip(caches, forms, leases):
            if action < 0.4:
                lease, match, events = cache.lock(form(tokens), now=now)
                held.append(lease)
                events += cache.insert(form(tokens), now=now, lease=lease)
                results.append((match, events))
            elif action < 0.8:
                results.append(cache.insert(form(tokens), now=now))
            else:
                if held:
                    cache.unlock(held.pop(0))
                results.append(cache.match(form(tokens)))
        assert results[0] == results[1] == results[2]
        states = [(len(c), c.vram_pages, c.dram_pages, c.demotions, c.evictions, c.page_ids(tokens)) for c in caches]
        assert states[0] == states[1] == states[2]


def test_fast_path_events_equal_validated_events() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=BS * 2, dram_tokens=BS * 2)
    events = cache.insert(list(range(10, 30)), now=1.0)
    assert events
    for event in events:
        if isinstance(event, BlockStored):
            again = BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                event.lora_id, event.medium)
            assert event == again and hash(event) == hash(again)


@pytest.mark.parametrize("bad", [[1, 2, -1, 4], [1, 2, 3, 1 << 32]])
def test_bad_tokens_still_fail_clearly(bad: list[int]) -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=64)
    with pytest.raises((KvEventError, OverflowError)):
        cache.insert(bad, now=0.0)


@settings(max_examples=100, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["lru", "lfu"]), st.integers(2, 12), st.integers(0, 12))
def test_a_silent_cache_behaves_like_an_emitting_one(rnd, policy: str, vram_pages: int, dram_pages: int) -> None:
    """emit_events=False builds no events but counts them; matches, leases and state agree."""
    loud = PrefixCache(block_size=BS, vram_tokens=BS * vram_pages, dram_tokens=BS * dram_pages, policy=policy)
    silent = PrefixCache(block_size=BS, vram_tokens=BS * vram_pages, dram_tokens=BS * dram_pages, policy=policy,
                         emit_events=False)
    held: list[tuple] = []
    emitted = 0
    for step, tokens in enumerate(prompts(rnd, 30)):
        now = float(step)
        action = rnd.random()
        arr = np.asarray(tokens, dtype=np.uint32)
        if action < 0.4:
            (la, ma, ea), (lb, mb, eb) = loud.lock(arr, now=now), silent.lock(arr, now=now)
            assert ma == mb and la.pages == lb.pages and eb == []
            ea += loud.insert(arr, now=now, lease=la)
            assert silent.insert(arr, now=now, lease=lb) == []
            assert la.pages == lb.pages
            held.append((la, lb))
            emitted += len(ea)
        elif action < 0.8:
            emitted += len(loud.insert(arr, now=now))
            assert silent.insert(arr, now=now) == []
        elif held:
            la, lb = held.pop(0)
            loud.unlock(la)
            silent.unlock(lb)
        assert loud.match(arr) == silent.match(arr)
        assert silent.events_unsent == emitted and loud.events_unsent == 0
        state = [(len(c), c.vram_pages, c.dram_pages, c.demotions, c.evictions, c.page_ids(tokens)) for c in (loud, silent)]
        assert state[0] == state[1]


@settings(max_examples=100, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["lru", "lfu"]), st.integers(2, 12), st.integers(0, 12))
def test_a_leases_digests_give_what_hashing_afresh_gives(rnd, policy: str, vram_pages: int, dram_pages: int) -> None:
    """``insert`` with a lease reuses the digests ``lock`` computed when its tokens start with
    the same bytes (the simulator inserts the locked prompt, the emulator the prompt plus its
    answer); a lease whose digests are dropped must give the same events and state, and a lease
    taken for other tokens must not lend them its digests."""
    reuse, fresh = (PrefixCache(block_size=BS, vram_tokens=BS * vram_pages, dram_tokens=BS * dram_pages,
                                policy=policy) for _ in range(2))
    held: list[tuple] = []
    for step, tokens in enumerate(prompts(rnd, 30)):
        now = float(step)
        (la, ma, ea), (lb, mb, eb) = reuse.lock(tokens, now=now), fresh.lock(tokens, now=now)
        lb.digests, lb.hashed = [], b""
        assert (ma, ea) == (mb, eb)
        choice = rnd.random()
        inserted = tokens if choice < 0.4 else tokens + [rnd.randrange(0, 50) for _ in range(rnd.randrange(0, 9))] \
            if choice < 0.8 else [rnd.randrange(0, 50)] + tokens
        assert reuse.insert(inserted, now=now, lease=la) == fresh.insert(inserted, now=now, lease=lb)
        assert la.pages == lb.pages
        held.append((la, lb))
        if rnd.random() < 0.5:
            a, b = held.pop(0)
            reuse.unlock(a)
            fresh.unlock(b)
        assert (len(reuse), reuse.vram_pages, reuse.dram_pages, reuse.page_ids(inserted)) == \
            (len(fresh), fresh.vram_pages, fresh.dram_pages, fresh.page_ids(inserted))
