"""The salted BlockTree (incremental SHA-256 states) against the generic key_fn path with
``prefix_keys``: equal index events after every operation, on random forests that detach,
re-attach, change tiers and clear."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PayloadDecoder,
    ScannedEvents,
    encode_payload,
)

SALT = namespace_salt("meta-llama/Llama-3.1-8B-Instruct", "tenant-a")
MEDIA = ["GPU", "CPU", "DISK"]


def reference(lengths) -> BlockTree:
    return BlockTree("w", lengths, lambda toks, wanted: prefix_keys(toks, wanted, SALT))


def random_ops(rnd, n: int) -> list[tuple[str, int, str]]:
    """Mostly stores (so long attached chains form), some removals, rare clears."""
    ops = []
    for _ in range(n):
        r = rnd.random()
        kind = "store" if r < 0.7 else "remove" if r < 0.97 else "clear"
        ops.append((kind, rnd.randrange(16), rnd.choice(MEDIA)))
    return ops


def random_forest(rnd, block: int) -> tuple[dict[int, int | None], dict[int, tuple[int, ...]]]:
    """16 blocks' parents (mostly deep chains, so keys start from states several blocks up) and
    tokens (``block`` each; the last block of a chain may be short)."""
    parents: dict[int, int | None] = {0: None}
    for h in range(1, 16):
        parents[h] = h - 1 if rnd.random() < 0.6 else rnd.choice([None, *range(h)])
    tokens = {h: tuple(rnd.randrange(0, 1 << 32) for _ in range(rnd.choice([block, block, max(1, block - 1)])))
              for h in range(16)}
    return parents, tokens


@settings(max_examples=150, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.integers(1, 6),
    st.lists(st.integers(1, 60), min_size=1, max_size=6, unique=True),
    st.integers(10, 80),
)
def test_salted_keys_equal_prefix_keys(rnd, block: int, lengths: list[int], n_ops: int) -> None:
    lengths.sort()
    parents, tokens = random_forest(rnd, block)
    salted, ref = BlockTree("w", lengths, salt=SALT), reference(lengths)
    for kind, h, medium in random_ops(rnd, n_ops):
        if kind == "store":
            event = BlockStored((h,), parents[h], tokens[h], block, None, medium)
        elif kind == "remove":
            event = BlockRemoved((h,), medium)
        else:
            event = AllBlocksCleared()
        assert salted.apply(event) == ref.apply(event)
        assert salted.registered() == ref.registered()


def test_long_chain_in_one_event_matches_prefix_keys() -> None:
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 1 << 32, size=16 * 300, dtype=np.uint64).astype(np.uint32)
    lengths = [16, 64, 100, 128, 1000, 2048, 4096, 4800]
    event = BlockStored(tuple(range(1, 301)), None, tuple(toks.tolist()), 16)
    events = BlockTree("w", lengths, salt=SALT).apply(event)
    assert sorted(e.key for e in events) == sorted(int(k) for k in prefix_keys(toks, lengths, SALT))
    assert events == reference(lengths).apply(event)


def test_exactly_one_key_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        BlockTree("w", [16])
    with pytest.raises(ValueError, match="exactly one"):
        BlockTree("w", [16], lambda t, n: [0] * len(n), salt=SALT)
    with pytest.raises(ValueError, match="salt must be bytes"):
        BlockTree("w", [16], salt="text")  # type: ignore[arg-type]


def test_salted_events_are_built_unvalidated_only_for_a_valid_worker_id() -> None:
    store = BlockStored((1,), None, (7, 8, 9, 10), 4, None, "GPU")
    (event,) = BlockTree("w", [4], salt=SALT).apply(store)
    assert event == reference([4]).apply(store)[0] and type(event.tier).__name__ == "Tier"
    with pytest.raises(ValueError, match="worker id"):  # the event constructor's own check, as before
        BlockTree("", [4], salt=SALT).apply(store)


@settings(max_examples=150, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.integers(1, 6),
    st.lists(st.integers(1, 60), min_size=1, max_size=6, unique=True),
    st.integers(10, 80),
    st.sampled_from([None, 4]),
)
def test_apply_each_equals_apply_on_each_event(rnd, block: int, lengths: list[int], n_ops: int,
                                               page_size: int | None) -> None:
    """apply_each (the inlined one-new-block path and the rest) gives the index events, in
    order, and the state of apply called on each event, on random forests with gaps, re-stores,
    several media, LoRA blocks, chains in one event, removals and clears; fed in random runs."""
    lengths.sort()
    events = random_events(rnd, block, n_ops)
    each, one = BlockTree("w", lengths, salt=SALT, page_size=page_size), BlockTree("w", lengths, salt=SALT,
                                                                                     page_size=page_size)
    i = 0
    while i < len(events):
        run = events[i : i + rnd.randrange(1, 8)]
        i += len(run)
        expected = [out for event in run for out in one.apply(event)]
        assert each.apply_each(run) == expected
        assert each.registered_with_lengths() == one.registered_with_lengths()
        assert each.detached_count == one.detached_count and len(each) == len(one)


def random_events(rnd, block: int, n_ops: int, *, groups: bool = False) -> list:
    """Engine events over a random forest: stores (some of two blocks, some partial, some LoRA),
    removals and clears; with ``groups`` also LoRA names and other KV-cache groups."""
    parents, tokens = random_forest(rnd, block)
    events = []
    for kind, h, medium in random_ops(rnd, n_ops):
        if kind == "store":
            r = rnd.random()
            if r < 0.1 and h + 1 < 16 and parents[h + 1] == h and len(tokens[h]) == block:  # two blocks in one event
                events.append(BlockStored((h, h + 1), parents[h], tokens[h] + tokens[h + 1], block, None, medium))
            else:
                lora = 3 if r > 0.95 else None
                size = block if r > 0.05 else block + 1
                if groups:
                    events.append(BlockStored((h,), parents[h], tokens[h], size, lora, medium,
                                              "adapter" if 0.93 < r <= 0.95 else None, 1 if 0.9 < r <= 0.93 else None))
                else:
                    events.append(BlockStored((h,), parents[h], tokens[h], size, lora, medium))
        elif kind == "remove":
            events.append(BlockRemoved((h,), medium, 1 if rnd.random() < 0.05 else None) if groups
                          else BlockRemoved((h,), medium))
        else:
            events.append(AllBlocksCleared())
    return events


@settings(max_examples=150, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.integers(1, 6),
    st.lists(st.integers(1, 60), min_size=1, max_size=6, unique=True),
    st.integers(10, 80),
    st.sampled_from([None, 4]),
    st.integers(1, 4),
)
def test_scanned_columns_apply_as_the_events_they_hold(rnd, block: int, lengths: list[int], n_ops: int,
                                                       page_size: int | None, max_detached: int) -> None:
    """A payload the agent's decoder scans (ScannedEvents: the C scan's columns, no event
    objects) is mirrored exactly as its events are: the same index events and lengths as
    apply_events_with_lengths over the built events, and the registrations, blocks and
    detached blocks of apply called on each engine event, on random forests with gaps,
    re-stores, several media, LoRA blocks, other KV groups, partial blocks, chains in one event,
    removals and clears (the usual pages take the inline path, the rest the general one)."""
    lengths.sort()
    events = random_events(rnd, block, n_ops, groups=True)
    scanned_tree, built_tree, each_tree = (BlockTree("w", lengths, salt=SALT, page_size=page_size,
                                                     max_detached_blocks=max_detached) for _ in range(3))
    i = 0
    while i < len(events):
        batch = events[i : i + rnd.randrange(1, 8)]
        i += len(batch)
        decoder = PayloadDecoder(encode_payload(1.0, batch), 0, coalesce=True)
        decoder.step(1 << 20)
        scanned = decoder.result.events
        assert type(scanned) is ScannedEvents  # the C scan took it: its columns are applied
        built = tuple(ScannedEvents(*scanned_parts(scanned)))  # the same runs as event objects
        assert scanned_tree.apply_events_with_lengths(scanned) == built_tree.apply_events_with_lengths(built)
        for event in batch:
            each_tree.apply(event)
        for other in (built_tree, each_tree):
            assert scanned_tree.registered_with_lengths() == other.registered_with_lengths()
            assert set(scanned_tree._blocks) == set(other._blocks)
            assert list(scanned_tree._detached) == list(other._detached)
        assert scanned_tree.refused_events == built_tree.refused_events


def scanned_parts(events: ScannedEvents) -> tuple:
    """A fresh ScannedEvents' arguments (its events not built yet)."""
    return events._data, events.runs, events.hashes, events.tokens
