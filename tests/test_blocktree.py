"""Block-tree mirror: registrations at indexed lengths, worst-tier paths, orphans, and a
brute-force property check."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest
from engine_captures import ENGINES, HASH_D, HASH_E, HASH_F, load_capture, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageTier,
    decode_message,
    tier_of_medium,
)


def prefix_key(tokens: np.ndarray, lengths: Sequence[int]) -> list[int]:
    """Test key function: low 63 bits of SHA-256 of the first L tokens (like the index's keys)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return [int.from_bytes(hashlib.sha256(data[: 4 * n]).digest()[:8], "little") >> 1 for n in lengths]


def key_of(tokens: Sequence[int]) -> int:
    return prefix_key(np.asarray(tokens, dtype=np.uint32), [len(tokens)])[0]


def tree(lengths: Sequence[int] = (16, 32, 48)) -> BlockTree:
    return BlockTree("w0", lengths, prefix_key)


T = list(range(1000, 1064))  # 4 blocks of 16


def test_chain_registers_every_covered_length_once() -> None:
    t = tree()
    out = t.apply(BlockStored((1, 2, 3), None, tuple(T[:48]), 16, None, "GPU"))
    assert out == [PrefixCached("w0", k, Tier.VRAM) for k in sorted(key_of(T[:n]) for n in (16, 32, 48))]
    # storing the same blocks again changes nothing
    assert t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "GPU")) == []


def test_demotion_to_dram_then_removal_from_gpu_changes_tier_of_paths_below() -> None:
    t = tree()
    t.apply(BlockStored((1, 2, 3), None, tuple(T[:48]), 16, None, "GPU"))
    # copy block 2 to host: still on the GPU, so still VRAM everywhere
    assert t.apply(BlockStored((2,), 1, tuple(T[16:32]), 16, None, "CPU_PINNED")) == []
    out = t.apply(BlockRemoved((2,), "GPU"))
    assert out == [TierChanged("w0", k, Tier.DRAM) for k in sorted([key_of(T[:32]), key_of(T[:48])])]
    assert t.registered()[key_of(T[:16])] is Tier.VRAM
    # back to GPU: VRAM again
    out = t.apply(BlockStored((2,), 1, tuple(T[16:32]), 16, None, "GPU"))
    assert {type(e) for e in out} == {TierChanged} and all(e.tier is Tier.VRAM for e in out)


def test_removing_a_block_with_children_orphans_them_until_it_returns() -> None:
    t = tree()
    t.apply(BlockStored((1, 2, 3), None, tuple(T[:48]), 16, None, "GPU"))
    out = t.apply(BlockRemoved((2,), "GPU"))
    assert sorted(e.key for e in out) == sorted([key_of(T[:32]), key_of(T[:48])])
    assert all(isinstance(e, PrefixEvicted) for e in out)
    assert t.detached_count == 1 and not t.is_attached(3)
    out = t.apply(BlockStored((2,), 1, tuple(T[16:32]), 16, None, "GPU"))
    assert sorted(e.key for e in out) == sorted([key_of(T[:32]), key_of(T[:48])])
    assert t.is_attached(3)


def test_out_of_order_store_waits_for_the_parent() -> None:
    t = tree()
    assert t.apply(BlockStored((2,), 1, tuple(T[16:32]), 16, None, "GPU")) == []
    assert t.detached_count == 1
    out = t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "GPU"))
    assert sorted(e.key for e in out) == sorted([key_of(T[:16]), key_of(T[:32])])


def test_detached_blocks_are_bounded() -> None:
    t = BlockTree("w0", [16], prefix_key, max_detached_blocks=2)
    for h in range(10, 15):
        t.apply(BlockStored((h,), 999, tuple(T[:16]), 16, None, "GPU"))
    assert t.detached_count == 2 and t.dropped_blocks == 3 and len(t) == 2


def test_unindexed_media_and_lora_are_never_registered() -> None:
    t = tree()
    assert t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "DISK")) == []
    assert t.apply(BlockStored((9,), None, tuple(T[:16]), 16, 4, "GPU")) == []
    # the same tokens as a base-model block do register
    out = t.apply(BlockStored((5,), None, tuple(T[:16]), 16, None, "GPU"))
    assert out == [PrefixCached("w0", key_of(T[:16]), Tier.VRAM)]
    # disk block back in host memory: DRAM, but the VRAM holder of the same key wins
    assert t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "CPU")) == []
    out = t.apply(BlockRemoved((5,), "GPU"))
    assert out == [TierChanged("w0", key_of(T[:16]), Tier.DRAM)]


def test_page_size_one_and_lengths_inside_blocks() -> None:
    # SGLang's default page size is 1: one block per token
    t = BlockTree("w0", [3, 5], prefix_key)
    parent = None
    out = []
    for i, token in enumerate(T[:6]):
        out += t.apply(BlockStored((100 + i,), parent, (token,), 1, None, "GPU"))
        parent = 100 + i
    assert [e.key for e in out] == [key_of(T[:3]), key_of(T[:5])]
    # a length that ends inside a block is realised by that block
    t2 = BlockTree("w0", [20], prefix_key)
    out = t2.apply(BlockStored((1, 2), None, tuple(T[:32]), 16, None, "GPU"))
    assert out == [PrefixCached("w0", key_of(T[:20]), Tier.VRAM)]


def test_withdraw_all_and_all_blocks_cleared() -> None:
    t = tree()
    t.apply(BlockStored((1, 2, 3), None, tuple(T[:48]), 16, None, "GPU"))
    out = t.apply(AllBlocksCleared())
    assert sorted(e.key for e in out) == sorted(key_of(T[:n]) for n in (16, 32, 48))
    assert len(t) == 0 and t.registered() == {} and t.withdraw_all() == []


def test_unknown_removals_are_counted_not_fatal() -> None:
    t = tree()
    assert t.apply(BlockRemoved((42,), "GPU")) == []
    t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "GPU"))
    assert t.apply(BlockRemoved((1,), "CPU")) == []
    assert t.ignored_removals == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_captured_engine_sequence(engine: str) -> None:
    """The engines' own batches: store, copy to host, remove, LoRA / other KV group / partial
    block (refused or mirrored unregistered), clear, store again."""
    t = BlockTree("w0", (16, 32, 48), prefix_key, page_size=16)
    out, mirrored = [], []
    for frames in load_capture(engine)["live"]:
        out.append(t.apply_batch(decode_message(frames)))
        mirrored.append({h for h in (HASH_D, HASH_E, HASH_F) if h in t})
    toks = list(tokens(0, 3))
    k16, k32, k48 = (key_of(toks[:n]) for n in (16, 32, 48))
    assert out[0] == [PrefixCached("w0", k16, Tier.VRAM)]
    assert out[1] == [PrefixCached("w0", k, Tier.VRAM) for k in sorted([k32, k48])]
    # A copied to host and dropped from the GPU: every path through it is now a DRAM hit
    assert out[2] == [TierChanged("w0", k, Tier.DRAM) for k in sorted([k16, k32, k48])]
    assert out[3] == [PrefixEvicted("w0", k48)]
    # the LoRA block is mirrored, never registered; vLLM's group-1 and partial blocks refused
    assert out[4] == [] and mirrored[4] == {HASH_E}
    if engine == "vllm":
        assert t.refused_events == {"KV-cache group 1": 1, "block_size 8 (pages are 16)": 1}
    assert sorted(e.key for e in out[5]) == sorted([k16, k32]) and all(isinstance(e, PrefixEvicted) for e in out[5])
    assert out[6] == [PrefixCached("w0", key_of(tokens(9)), Tier.VRAM)]
    assert t.registered() == {key_of(tokens(9)): Tier.VRAM}


def test_other_groups_removals_leave_group_0_alone() -> None:
    t = tree()
    t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "GPU", group_idx=0))
    assert t.apply(BlockRemoved((1,), "GPU", group_idx=1)) == []
    assert t.registered() == {key_of(T[:16]): Tier.VRAM}
    assert t.apply(BlockRemoved((1,), "GPU", group_idx=0)) == [PrefixEvicted("w0", key_of(T[:16]))]


def test_lora_name_alone_marks_a_lora_block() -> None:
    t = tree()
    assert t.apply(BlockStored((1,), None, tuple(T[:16]), 16, None, "GPU", lora_name="a")) == []
    assert 1 in t and t.registered() == {}


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(1, 4))
def test_a_sliced_store_registers_what_the_whole_store_does(blocks: int, max_blocks: int, last_fill: int) -> None:
    toks = tuple(range(500, 500 + 4 * (blocks - 1) + last_fill))
    whole = BlockStored(tuple(range(1, blocks + 1)), None, toks, 4, None, "GPU")
    parts = list(whole.slices(max_blocks))
    assert all(len(p.block_hashes) <= max_blocks for p in parts)
    assert [b for p in parts for b in p.blocks()] == list(whole.blocks())
    a, b = BlockTree("w0", (4, 8, 16), prefix_key), BlockTree("w0", (4, 8, 16), prefix_key)
    a.apply(whole)
    for p in parts:
        b.apply(p)
    assert a.registered() == b.registered()


# ------------------------------------------------------------------------- property test

BLOCK = 4
LENGTHS = (4, 8, 12, 16)
MEDIA = ["GPU", "CPU", "DISK"]


def brute_force(blocks: dict[int, tuple[int | None, tuple[int, ...], set[str]]]) -> dict[int, Tier]:
    """Recompute registrations from the tree alone: walk every root-reachable path."""
    result: dict[int, StorageTier] = {}
    children: dict[int | None, list[int]] = {}
    for h, (parent, _, _) in blocks.items():
        children.setdefault(parent, []).append(h)
    stack: list[tuple[int, list[int], StorageTier]] = [(h, [], StorageTier.VRAM) for h in children.get(None, [])]
    while stack:
        h, prefix, worst = stack.pop()
        _, tokens, media = blocks[h]
        path = prefix + list(tokens)
        tier = max(worst, min(tier_of_medium(m) for m in media))
        for n in LENGTHS:
            if len(prefix) < n <= len(path):
                key = key_of(path[:n])
                result[key] = min(result.get(key, StorageTier.UNINDEXED), tier)
        stack.extend((c, path, tier) for c in children.get(h, []))
    return {k: t.index_tier() for k, t in result.items() if t.index_tier() is not None}


operation = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 11), st.sampled_from(MEDIA)),
    st.tuples(st.just("remove"), st.integers(0, 11), st.sampled_from(MEDIA)),
    st.tuples(st.just("clear"), st.just(0), st.just("GPU")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40), st.randoms(use_true_random=False))
def test_registrations_match_brute_force(ops: list, rnd) -> None:
    # a fixed forest of 12 possible blocks: parents chosen per example, tokens from the path
    parents: dict[int, int | None] = {0: None}
    for h in range(1, 12):
        parents[h] = rnd.choice([None, *range(h)])
    tokens = {h: tuple(range(h * 10, h * 10 + BLOCK)) for h in range(12)}
    t = BlockTree("w", LENGTHS, prefix_key)
    truth: dict[int, tuple[int | None, tuple[int, ...], set[str]]] = {}
    registered: dict[int, Tier] = {}
    for kind, h, medium in ops:
        if kind == "store":
            events = t.apply(BlockStored((h,), parents[h], tokens[h], BLOCK, None, medium))
            truth.setdefault(h, (parents[h], tokens[h], set()))[2].add(medium)
        elif kind == "remove":
            events = t.apply(BlockRemoved((h,), medium))
            if h in truth:
                truth[h][2].discard(medium)
                if not truth[h][2]:
                    del truth[h]
        else:
            events = t.apply(AllBlocksCleared())
            truth.clear()
        for e in events:  # the emitted stream alone must reproduce the registrations
            if isinstance(e, PrefixCached):
                assert e.key not in registered
                registered[e.key] = e.tier
            elif isinstance(e, TierChanged):
                assert registered[e.key] != e.tier
                registered[e.key] = e.tier
            else:
                del registered[e.key]
        expected = brute_force(truth)
        assert t.registered() == expected
        assert registered == expected


def test_removing_a_block_whose_children_overflow_the_detached_limit():
    """Detaching a removed block's children trims the oldest detached blocks, which may be those
    very children: the removal goes on (it raised "Set changed size during iteration", which
    ended the agent's event follower for good)."""
    tree = BlockTree("w", (16, 32), salt=b"s", page_size=16, max_detached_blocks=1)
    tree.apply(BlockStored((1,), None, tuple(range(16)), 16))
    for child in (2, 3, 4):
        tree.apply(BlockStored((child,), 1, tuple(range(16 * child, 16 * child + 16)), 16))
    assert len(tree.registered()) == 4
    tree.apply(BlockRemoved((1,)))
    assert tree.registered() == {}
    assert len(tree) == 1 and tree.dropped_blocks == 2  # one detached child kept, the others dropped
    tree.apply(BlockStored((1,), None, tuple(range(16)), 16))  # the kept child is attached again
    assert len(tree.registered()) == 2


HASHES = st.sampled_from([1, 2, 3, -5, b"x"])
MEDIA = st.sampled_from([None, None, None, "CPU", "DISK"])


@st.composite
def any_event(draw):
    """Events an engine's batch may carry, with few hashes (repeats, cycles, unknown parents)."""
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 3 + ["cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    hashes = tuple(draw(st.lists(HASHES, min_size=1, max_size=2))) if draw(st.booleans()) else (draw(HASHES),)
    if kind == "removed":
        return BlockRemoved(hashes, draw(MEDIA), draw(st.sampled_from([None, None, 1])))
    size = draw(st.sampled_from([16, 16, 8]))
    count = (len(hashes) - 1) * size + draw(st.sampled_from([size, size, size // 2]))  # mostly whole blocks
    return BlockStored(hashes, draw(st.one_of(st.none(), HASHES, HASHES)), tuple(range(start := draw(st.sampled_from([0, 100, 200])), start + count)), size,
                       draw(st.sampled_from([None, None, 1])), draw(MEDIA), None, draw(st.sampled_from([None, None, 1])))


@settings(max_examples=300)
@given(st.lists(any_event(), max_size=40), st.integers(1, 3))
def test_any_event_sequence_applies_and_clears_without_error(events: list, max_detached: int) -> None:
    """Whatever the engine sends (hash repeats, cycles, unknown parents, other groups, a small
    detached limit), applying never raises, and a clear leaves nothing registered or mirrored."""
    tree = BlockTree("w", (16, 32, 48), salt=b"s", page_size=16, max_detached_blocks=max_detached)
    for event in events:
        tree.apply(event)
    assert len(tree._detached) <= max_detached
    tree.apply(AllBlocksCleared())
    assert tree.registered() == {} and len(tree) == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40), st.randoms(use_true_random=False), st.integers(1, 8))
def test_events_applied_in_one_pass_leave_the_state_and_net_registrations_of_one_by_one(ops: list, rnd,
                                                                                      chunk: int) -> None:
    # The agent applies a batch's events in one pass (apply_events): one diff per batch. The
    # tree must end as event-by-event application leaves it, and the emitted stream alone must
    # take the registrations from where they were to where they are.
    parents: dict[int, int | None] = {0: None}
    for h in range(1, 12):
        parents[h] = rnd.choice([None, *range(h)])
    tokens = {h: tuple(range(h * 10, h * 10 + BLOCK)) for h in range(12)}
    events = [BlockStored((h,), parents[h], tokens[h], BLOCK, None, medium) if kind == "store"
              else BlockRemoved((h,), medium) if kind == "remove" else AllBlocksCleared()
              for kind, h, medium in ops]
    one_pass, one_by_one = BlockTree("w", LENGTHS, prefix_key), BlockTree("w", LENGTHS, prefix_key)
    registered: dict[int, Tier] = {}
    for start in range(0, len(events), chunk):
        batch = events[start:start + chunk]
        emitted = one_pass.apply_events(batch)
        for event in batch:
            one_by_one.apply(event)
        keys = [e.key for e in emitted]
        after_clear = [i for i, e in enumerate(batch) if isinstance(e, AllBlocksCleared)]
        if not after_clear:
            assert len(keys) == len(set(keys))  # one net change per key
        for e in emitted:
            if isinstance(e, PrefixCached):
                assert e.key not in registered
                registered[e.key] = e.tier
            elif isinstance(e, TierChanged):
                assert registered[e.key] != e.tier
                registered[e.key] = e.tier
            else:
                del registered[e.key]
        assert one_pass.registered() == one_by_one.registered() == registered
        assert len(one_pass) == len(one_by_one) and one_pass.detached_count == one_by_one.detached_count


@pytest.mark.parametrize("engine", ENGINES)
def test_captured_engine_batches_coalesced_as_the_agent_decodes_them_mirror_the_same(engine: str) -> None:
    from kvcompassd.engine.kvevents import PayloadDecoder

    plain, coalesced = BlockTree("w0", (16, 32, 48), prefix_key, page_size=16), BlockTree(
        "w0", (16, 32, 48), prefix_key, page_size=16)
    for frames in load_capture(engine)["live"]:
        plain.apply_batch(decode_message(frames))
        decoder = PayloadDecoder(frames[2], 0, coalesce=True)
        decoder.step(1 << 20)
        coalesced.apply_events(decoder.result.events)
        assert coalesced.registered() == plain.registered() and len(coalesced) == len(plain)


@settings(max_examples=100, deadline=None)
@given(st.lists(operation, max_size=40), st.randoms(use_true_random=False), st.integers(1, 8))
def test_every_emitted_event_carries_the_length_its_key_hashes(ops: list, rnd, chunk: int) -> None:
    # What a maintenance unit filters the edge regions' streams by: an event's length must be
    # the one its key was computed at (evictions and tier changes included), and a
    # re-registration's lengths those of the keys it sends.
    parents: dict[int, int | None] = {0: None}
    for h in range(1, 12):
        parents[h] = rnd.choice([None, *range(h)])
    tokens = {h: tuple(range(h * 10, h * 10 + BLOCK)) for h in range(12)}

    def path(h: int) -> tuple[int, ...]:
        return (path(parents[h]) if parents[h] is not None else ()) + tokens[h]

    length_of = {key_of(path(h)[:n]): n for h in range(12) for n in LENGTHS if n <= len(path(h))}
    events = [BlockStored((h,), parents[h], tokens[h], BLOCK, None, medium) if kind == "store"
              else BlockRemoved((h,), medium) if kind == "remove" else AllBlocksCleared()
              for kind, h, medium in ops]
    t, plain = BlockTree("w", LENGTHS, prefix_key), BlockTree("w", LENGTHS, prefix_key)
    for start in range(0, len(events), chunk):
        emitted, lengths = t.apply_events_with_lengths(events[start:start + chunk])
        assert emitted == plain.apply_events(events[start:start + chunk])  # the same events as without lengths
        assert lengths == [length_of[e.key] for e in emitted]
        with_lengths = t.registered_with_lengths()
        assert {k: tier for k, (tier, _) in with_lengths.items()} == t.registered()
        assert all(n == length_of[k] for k, (_, n) in with_lengths.items())
    withdrawn, lengths = t.withdraw_all_with_lengths()
    assert all(isinstance(e, PrefixEvicted) for e in withdrawn)
    assert lengths == [length_of[e.key] for e in withdrawn]
