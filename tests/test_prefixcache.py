"""Paged two-tier prefix cache: engine-compatible hashes, tiers, eviction, pins, events."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from kvcompassd.worker.prefixcache import (CacheMatch, EvictionPolicy, PrefixCache, PrefixCacheError, page_digest,
                                           page_digests)
from kvcompassd.engine.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, decode_message, encode_batch

BS = 4


def sglang_hash_chain(tokens: list[int], page: int) -> list[int]:
    """SGLang's get_hash_str + hash_str_to_int64, written from its documented behaviour."""
    out, prior = [], None
    for start in range(0, len(tokens) - page + 1, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start : start + page]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


def seq(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_page_ids_match_sglang_block_hashes_and_events_chain() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=64)
    tokens = seq(100, 10)  # two full pages, the partial third is not cached
    events = cache.insert(tokens, now=1.0)
    ids = sglang_hash_chain(tokens, BS)
    assert cache.page_ids(tokens) == ids
    assert events == [
        BlockStored((ids[0],), None, tuple(tokens[0:4]), BS, None, "GPU"),
        BlockStored((ids[1],), ids[0], tuple(tokens[4:8]), BS, None, "GPU"),
    ]
    assert cache.match(tokens) == CacheMatch(8, 0)
    assert cache.match(tokens[:7]) == CacheMatch(4, 0)
    assert cache.match(seq(0, 8)) == CacheMatch(0, 0)
    assert cache.insert(tokens, now=2.0) == []  # already cached: nothing to publish


def test_vram_overflow_demotes_lru_leaf_to_dram_like_sglang() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=8, dram_tokens=8)
    a, b = seq(0, 8), seq(50, 4)
    cache.insert(a, now=1.0)
    ids_a = cache.page_ids(a)
    events = cache.insert(b, now=2.0)
    # the LRU VRAM *leaf* is a's second page: copied to host, then removed from the GPU
    assert events[:2] == [
        BlockStored((ids_a[1],), ids_a[0], tuple(a[4:8]), BS, None, "CPU_PINNED"),
        BlockRemoved((ids_a[1],), "GPU"),
    ]
    assert isinstance(events[2], BlockStored) and events[2].medium == "GPU"
    assert cache.match(a) == CacheMatch(4, 4)
    assert (cache.vram_used_tokens, cache.dram_used_tokens) == (8, 4)
    # reusing a reloads its DRAM page to VRAM (and demotes something else)
    lease, found, events = cache.lock(a, now=3.0)
    assert found == CacheMatch(4, 4)
    assert BlockStored((ids_a[1],), ids_a[0], tuple(a[4:8]), BS, None, "GPU") in events
    assert cache.match(a) == CacheMatch(8, 0)
    cache.unlock(lease)
    with pytest.raises(PrefixCacheError):
        cache.unlock(lease)


def test_dram_overflow_evicts_and_zero_dram_evicts_directly() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=4, dram_tokens=4)
    cache.insert(seq(0, 4), now=1.0)
    cache.insert(seq(10, 4), now=2.0)  # page 0 -> DRAM
    events = cache.insert(seq(20, 4), now=3.0)  # page 10 -> DRAM evicts page 0 from DRAM
    removed_cpu = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU_PINNED"]
    assert removed_cpu == [BlockRemoved((cache_id(seq(0, 4)),), "CPU_PINNED")]
    assert cache.match(seq(0, 4)) == CacheMatch(0, 0)
    assert cache.evictions == 1

    no_dram = PrefixCache(block_size=BS, vram_tokens=4)
    no_dram.insert(seq(0, 4), now=1.0)
    events = no_dram.insert(seq(10, 4), now=2.0)
    assert events[0] == BlockRemoved((cache_id(seq(0, 4)),), "GPU")
    assert len(no_dram) == 1


def cache_id(tokens: list[int]) -> int:
    return sglang_hash_chain(tokens, BS)[-1]


def test_pinned_pages_are_never_demoted() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=8, dram_tokens=0)
    lease, _, _ = cache.lock(seq(0, 8), now=0.0)
    cache.insert(seq(0, 8), now=0.0, lease=lease)
    assert len(lease.pages) == 2
    events = cache.insert(seq(100, 8), now=1.0)
    assert events == []  # no room: nothing cached, nothing pinned touched
    assert cache.match(seq(0, 8)) == CacheMatch(8, 0)
    cache.unlock(lease)
    events = cache.insert(seq(100, 8), now=2.0)
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockRemoved, BlockStored]
    assert cache.match(seq(100, 8)) == CacheMatch(8, 0)


@pytest.mark.parametrize("policy, survivor", [(EvictionPolicy.LRU, 0), (EvictionPolicy.LFU, 0)])
def test_lru_and_lfu_choose_different_victims(policy: EvictionPolicy, survivor: int) -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=8, policy=policy)
    hot, cold = seq(0, 4), seq(10, 4)
    for t in range(5):
        cache.insert(hot, now=float(t))
    cache.insert(cold, now=10.0)
    cache.insert(seq(20, 4), now=11.0)
    # LRU evicts hot (older access); LFU evicts cold (fewer hits)
    if policy is EvictionPolicy.LRU:
        assert cache.match(hot).total_tokens == 0 and cache.match(cold).total_tokens == 4
    else:
        assert cache.match(hot).total_tokens == 4 and cache.match(cold).total_tokens == 0


def test_flush_emits_all_blocks_cleared() -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=64)
    cache.insert(seq(0, 16), now=0.0)
    assert cache.flush() == [AllBlocksCleared()]
    assert len(cache) == 0 and cache.match(seq(0, 16)) == CacheMatch(0, 0)


def test_bad_parameters() -> None:
    with pytest.raises(PrefixCacheError):
        PrefixCache(block_size=0, vram_tokens=10)
    with pytest.raises(PrefixCacheError):
        PrefixCache(block_size=4, vram_tokens=-1)
    with pytest.raises(ValueError):
        PrefixCache(block_size=4, vram_tokens=8, policy="random")


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "lock", "lock_if_room", "unlock", "flush"]), st.integers(0, 5),
              st.integers(1, 5)),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(ops, st.sampled_from(list(EvictionPolicy)), st.integers(1, 6), st.integers(0, 6))
def test_event_stream_mirrors_cache_state_and_invariants_hold(actions, policy, vram_pages, dram_pages) -> None:
    cache = PrefixCache(block_size=BS, vram_tokens=vram_pages * BS, dram_tokens=dram_pages * BS, policy=policy)
    mirror: dict[int, set[str]] = {}
    parents: dict[int, int | None] = {}
    leases = []
    now = 0.0

    def apply(events) -> None:
        # through the real wire codec, as the agent would see them
        if events:
            for event in decode_message(encode_batch(0, now, events)).events:
                if isinstance(event, BlockStored):
                    for h, parent, _ in event.blocks():
                        assert parent is None or parent in mirror, "stored before its parent"
                        mirror.setdefault(h, set()).add(event.medium)
                        parents[h] = parent
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        assert event.medium in mirror[h]
                        mirror[h].discard(event.medium)
                        if not mirror[h]:
                            del mirror[h]
                else:
                    mirror.clear()

    for kind, family, pages in actions:
        now += 1.0
        tokens = [family * 1000 + i for i in range(pages * BS)]
        if kind == "insert":
            apply(cache.insert(tokens, now=now))
        elif kind in ("lock", "lock_if_room"):
            pinned_before = cache.pinned_vram_pages
            locked = cache.lock(tokens, now=now, only_if_room=kind == "lock_if_room")
            if locked is None:  # refused only while something is pinned, and for want of room
                assert pinned_before and pages > cache.vram_pages_max - pinned_before
                continue
            lease, _, events = locked
            apply(events)
            apply(cache.insert(tokens, now=now, lease=lease))
            leases.append(lease)
        elif kind == "unlock" and leases:
            cache.unlock(leases.pop(0))
        elif kind == "flush":
            apply(cache.flush())
            leases.clear()
        truth = {
            p.id: ({"GPU"} if p.in_vram else set()) | ({"CPU_PINNED"} if p.in_dram else set())
            for p in cache._pages.values()
        }
        assert mirror == truth
        assert cache.vram_pages <= max(cache.vram_pages_max, 0)
        assert cache.dram_pages <= cache.dram_pages_max
        assert cache.vram_pages == sum(p.in_vram for p in cache._pages.values())
        assert cache.pinned_vram_pages == sum(bool(p.in_vram and p.pins) for p in cache._pages.values())
        for p in cache._pages.values():  # closure: VRAM and present pages are rooted subtrees
            if p.parent is not None:
                assert p.parent.id in truth
                if p.in_vram:
                    assert p.parent.in_vram


def test_a_lock_only_if_room_waits_for_the_pins_of_running_requests() -> None:
    # 4 pages of VRAM. A running request pins 3; another 2-page prompt does not fit beside
    # them, a prompt sharing their first 2 pages does (those are counted once), and once the
    # running request is done the 2-page prompt fits.
    cache = PrefixCache(block_size=BS, vram_tokens=4 * BS, dram_tokens=8 * BS)
    running = list(range(3 * BS))
    lease, _, _ = cache.lock(running, now=1.0)
    cache.insert(running, now=1.0, lease=lease)
    assert cache.pinned_vram_pages == 3
    other = [10_000 + i for i in range(2 * BS)]
    assert cache.lock(other, now=2.0, only_if_room=True) is None
    assert cache.pinned_vram_pages == 3  # a refusal changes nothing
    sharing = running[: 2 * BS] + [20_000 + i for i in range(BS)]
    shared_lease, match, _ = cache.lock(sharing, now=2.0, only_if_room=True)
    assert match.vram_tokens == 2 * BS and cache.pinned_vram_pages == 3
    cache.unlock(lease)
    cache.unlock(shared_lease)
    assert cache.pinned_vram_pages == 0
    assert cache.lock(other, now=3.0, only_if_room=True) is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 20), st.integers(0, 6),
       st.sampled_from([b"", bytes(range(32))]))
def test_a_prompts_page_digests_in_one_c_call_equal_one_hash_per_page(tokens, page, known_pages, parent) -> None:
    """``page_digests`` (one C call) gives ``page_digest`` applied page after page, under any
    parent; the cache's chain gives SGLang's ids, continuing from digests it already holds."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    n = len(tokens) // page
    expected, digest = [], parent
    for i in range(n):
        digest = page_digest(digest, tokens[i * page:(i + 1) * page])
        expected.append(digest)
    chain = page_digests(data, 4 * page, n, parent)
    assert [chain[i:i + 32] for i in range(0, len(chain), 32)] == expected
    cache = PrefixCache(block_size=page, vram_tokens=1 << 16)
    assert cache.path_ids(tokens) == sglang_hash_chain(tokens, page)
    own = list(cache._chain(tokens))
    known = [d for _, d in own[:known_pages]]
    assert list(cache._chain(tokens, data, known)) == own
    with pytest.raises(ValueError):
        page_digests(data, 4 * page, n + 1)
