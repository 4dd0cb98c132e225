"""Block-tree mirror: registrations at indexed lengths, worst-tier paths, orphans, and a
brute-force property check."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
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

SAMPLES = Path("/work/shared/wire-samples")


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


@pytest.mark.skipif(not SAMPLES.exists(), reason="wire samples not present")
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_wire_sample_sequence(engine: str) -> None:
    t = tree()
    events = []
    for n in range(4):
        frames = [(SAMPLES / engine / f"batch{n}.{p}").read_bytes() for p in ("topic", "seq", "msgpack")]
        events.append(t.apply_batch(decode_message(frames)))
    tokens = list(range(100, 148))
    assert events[0] == [PrefixCached("w0", key_of(tokens[:16]), Tier.VRAM)]
    assert sorted(e.key for e in events[1]) == sorted([key_of(tokens[:32]), key_of(tokens[:48])])
    assert events[2] == [TierChanged("w0", k, Tier.DRAM) for k in sorted([key_of(tokens[:32]), key_of(tokens[:48])])]
    assert sorted(e.key for e in events[3]) == sorted(key_of(tokens[:n]) for n in (16, 32, 48))
    assert all(isinstance(e, PrefixEvicted) for e in events[3])


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
