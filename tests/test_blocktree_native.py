"""The C block tree (a salted BlockTree, ludo_c/kvc_blocktree.c) against the Python one
(``native=False``, the implementation it replaced, kept for key_fn trees): random event
sequences over small forests, fed through every entry point, must give identical index events,
lengths, registrations, blocks, detached blocks in their order, counters and log lines."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.events import Tier
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PayloadDecoder,
    ScannedEvents,
    _RUN_DTYPE,
    encode_payload,
)

SALT = namespace_salt("meta-llama/Llama-3.1-8B-Instruct", "tenant-n")
MEDIA = [None, "GPU", "cpu", "CPU_PINNED", "DISK", "CPU"]
REMOVED_FROM = [None, "GPU", "GPU", "cpu", "DISK"]  # mostly the usual medium: subtrees get detached
N_HASHES = 14


def forest(rnd, block: int) -> tuple[dict[int, int | None], dict[int, tuple[int, ...]]]:
    """Parents (mostly chains, some roots, some parents that are never stored: 90+) and tokens
    (``block`` per block, some short, some other content for a re-store)."""
    parents: dict[int, int | None] = {0: None}
    for h in range(1, N_HASHES):
        r = rnd.random()
        parents[h] = h - 1 if r < 0.45 else None if r < 0.55 else 90 + h if r < 0.6 else rnd.randrange(h)
    tokens = {h: tuple(rnd.randrange(0, 1 << 32) for _ in range(block if rnd.random() < 0.85 else max(1, block - 1)))
              for h in range(N_HASHES)}
    return parents, tokens


def random_events(rnd, block: int, n: int) -> list:
    """Stores (single pages, chains of two, LoRA by id or name, other KV groups, partial pages,
    re-stores with other content or another parent, on several media), removals (some of a
    medium the block is not on, some of other groups), clears."""
    parents, tokens = forest(rnd, block)
    events: list = []
    for _ in range(n):
        r = rnd.random()
        h = rnd.randrange(N_HASHES)
        medium = rnd.choice(MEDIA) if rnd.random() < 0.5 else None
        if r < 0.62:
            q = rnd.random()
            if q < 0.12 and h + 1 < N_HASHES and parents[h + 1] == h and len(tokens[h]) == block:
                events.append(BlockStored((h, h + 1), parents[h], tokens[h] + tokens[h + 1], block, None, medium))
                continue
            own = tokens[h] if q < 0.95 else tuple(t ^ 1 for t in tokens[h])  # another content
            parent = parents[h] if q < 0.97 else rnd.choice([None, 0, 5])
            lora_id = 7 if 0.85 < q <= 0.88 else None
            lora_name = "adapter" if 0.88 < q <= 0.9 else None
            group = rnd.choice([1, 2]) if 0.9 < q <= 0.92 else rnd.choice([None, 0])
            size = block + 1 if 0.8 < q <= 0.82 else block  # a partial block (refused with page_size)
            events.append(BlockStored((h,), parent, own, size, lora_id, medium, lora_name, group))
        elif r < 0.96:
            group = 1 if rnd.random() < 0.04 else None
            hashes = (h,) if rnd.random() < 0.85 else (h, rnd.randrange(N_HASHES))
            events.append(BlockRemoved(hashes, rnd.choice(REMOVED_FROM), group))
        else:
            events.append(AllBlocksCleared())
    return events


def trees(lengths, page_size, max_detached) -> tuple[BlockTree, BlockTree]:
    native = BlockTree("w", lengths, salt=SALT, page_size=page_size, max_detached_blocks=max_detached)
    python = BlockTree("w", lengths, salt=SALT, page_size=page_size, max_detached_blocks=max_detached, native=False)
    assert native.is_native and not python.is_native
    return native, python


def assert_same_state(native: BlockTree, python: BlockTree) -> None:
    assert native.registered_with_lengths() == python.registered_with_lengths()
    assert list(native.registered()) == list(python.registered())  # announced in the same order
    assert sorted(native._blocks, key=repr) == sorted(python._blocks, key=repr)
    assert list(native._detached) == list(python._detached)  # oldest first: the same ones go at the bound
    assert len(native) == len(python) and native.detached_count == python.detached_count
    assert native.dropped_blocks == python.dropped_blocks
    assert native.ignored_removals == python.ignored_removals
    assert native.refused_events == python.refused_events
    for h in range(N_HASHES):
        assert (h in native) == (h in python) and native.is_attached(h) == python.is_attached(h)


def scanned(batch: list) -> ScannedEvents:
    decoder = PayloadDecoder(encode_payload(1.0, batch), 0, coalesce=True)
    decoder.step(1 << 20)
    events = decoder.result.events
    assert type(events) is ScannedEvents
    return events


@settings(max_examples=250, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.sampled_from([1, 3, 4, 16, 20]),  # 20: tokens past the inline 16 of a C block
    st.lists(st.integers(1, 80), min_size=1, max_size=7, unique=True),
    st.integers(5, 90),
    st.sampled_from([None, 4, 16]),
    st.sampled_from([1, 2, 3, 100_000]),
)
def test_the_c_tree_emits_what_the_python_tree_emits(rnd, block: int, lengths: list[int], n_events: int,
                                                      page_size: int | None, max_detached: int) -> None:
    lengths.sort()
    caplog = _Records()
    logger = logging.getLogger("kvcompassd.engine.blocktree")
    logger.addHandler(caplog)
    try:
        _run(rnd, block, lengths, n_events, page_size, max_detached, caplog)
    finally:
        logger.removeHandler(caplog)


class _Records(logging.Handler):
    """The tree's log lines (hypothesis and pytest's caplog fixture do not mix)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records = []


def _run(rnd, block: int, lengths: list[int], n_events: int, page_size: int | None, max_detached: int,
         caplog: _Records) -> None:
    events = random_events(rnd, block, n_events)
    native, python = trees(lengths, page_size, max_detached)
    i = 0
    while i < len(events):
        batch = events[i : i + rnd.randrange(1, 9)]
        i += len(batch)
        how = rnd.randrange(5)
        caplog.clear()
        if how == 0:
            got = [out for event in batch for out in native.apply(event)]
            native_logs = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = [out for event in batch for out in python.apply(event)]
        elif how == 1:
            got = native.apply_each(batch)
            native_logs = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = python.apply_each(batch)
        elif how == 2:
            got = native.apply_events_with_lengths(batch)
            native_logs = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = python.apply_events_with_lengths(batch)
        else:  # the agent's path: a scanned payload's columns (each diff in turn, or one net diff)
            columns = scanned(batch)
            apply = "apply_each" if how == 3 else "apply_events_with_lengths"
            got = getattr(native, apply)(columns)
            native_logs = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = getattr(python, apply)(scanned(batch))
        python_logs = [r.getMessage() for r in caplog.records]
        assert got == want
        assert sorted(native_logs) == sorted(python_logs)
        assert_same_state(native, python)
    assert native.withdraw_all_with_lengths() == python.withdraw_all_with_lengths()
    assert_same_state(native, python)


def test_keys_are_prefix_keys_of_the_path_across_blocks() -> None:
    """Lengths inside, at the end of and across blocks of 20 tokens (heap-held in C), keys
    resumed from an anchored ancestor's SHA state several blocks up."""
    lengths = [5, 20, 21, 59, 60, 100]
    tree = BlockTree("w", lengths, salt=SALT)
    tokens = [list(range(i * 20, i * 20 + 20)) for i in range(5)]
    out = []
    for i in range(5):
        out += tree.apply(BlockStored((i,), i - 1 if i else None, tuple(tokens[i]), 20))
    path = np.array([t for block in tokens for t in block], dtype=np.uint32)
    assert len(out) == len(lengths)  # (each apply's events come in key order, not length order)
    assert tree.registered_with_lengths() == {int(key): (Tier.VRAM, n)
                                             for key, n in zip(prefix_keys(path, lengths, SALT), lengths, strict=True)}


def test_a_bytes_hash_moves_the_whole_state_to_python_and_it_goes_on_the_same() -> None:
    """A block hash the C tree cannot hold (bytes; vLLM can send them) moves the state, all of
    it, to the Python implementation; from then on the tree is the reference's twin."""
    native, python = trees([4, 8, 12], 4, 2)
    events = [BlockStored((1,), None, (1, 2, 3, 4), 4), BlockStored((2,), 1, (5, 6, 7, 8), 4, None, "CPU"),
              BlockStored((3,), 2, (9, 10, 11, 12), 4), BlockStored((5,), 40, (1, 1, 1, 1), 4),
              BlockStored((6,), 41, (1, 1, 1, 1), 4), BlockStored((2,), 1, (5, 6, 7, 8), 4),
              BlockStored((7,), 3, (1, 2, 1, 2), 4, 9)]
    assert native.apply_each(events) == python.apply_each(events)
    assert native.is_native
    assert_same_state(native, python)
    more = [BlockStored((b"\x01" * 32,), 3, (3, 3, 3, 3), 4), BlockRemoved((2,), "CPU"), BlockRemoved((1,)),
            BlockStored((1,), None, (1, 2, 3, 4), 4), BlockStored((40,), None, (0, 0, 0, 0), 4)]
    kept = native.apply_each  # a reference taken before the move still reaches the one state
    assert native.apply_each(more) == python.apply_each(more)
    assert not native.is_native
    assert kept([BlockRemoved((40,))]) == python.apply_each([BlockRemoved((40,))])
    assert_same_state(native, python)
    assert native.withdraw_all_with_lengths() == python.withdraw_all_with_lengths()


def test_a_hash_past_int64_moves_to_python_too() -> None:
    native, python = trees([4], None, 10)
    events = [BlockStored((3,), None, (1, 2, 3, 4), 4), BlockStored(((1 << 63) - 1,), 3, (1, 2, 3, 4), 4)]
    assert native.apply_events_with_lengths(events) == python.apply_events_with_lengths(events)
    assert native.is_native  # int64 still fits
    huge = [BlockRemoved((3,))]
    huge_event = BlockStored.__new__(BlockStored)  # an int outside int64 that skipped validation
    object.__setattr__(huge_event, "block_hashes", (1 << 64,))
    for name, value in (("parent_block_hash", None), ("token_ids", (1,)), ("block_size", 4), ("lora_id", None),
                        ("medium", None), ("lora_name", None), ("group_idx", None)):
        object.__setattr__(huge_event, name, value)
    assert native.apply_each([*huge, huge_event]) == python.apply_each([*huge, huge_event])
    assert not native.is_native
    assert_same_state(native, python)


def test_a_non_event_raises_after_the_events_before_it_are_applied() -> None:
    native, python = trees([4], None, 10)
    batch = [BlockStored((1,), None, (1, 2, 3, 4), 4), "not an event"]
    for tree in (native, python):
        with pytest.raises(TypeError, match="not a KV event"):
            tree.apply_each(batch)
    assert_same_state(native, python)
    assert len(native.registered()) == 1


def test_an_invalid_worker_id_is_refused_as_before() -> None:
    with pytest.raises(ValueError):
        BlockTree("", [4], salt=SALT).apply(BlockStored((1,), None, (1, 2, 3, 4), 4))


def test_a_removed_blocks_children_are_detached_in_the_order_they_were_stored() -> None:
    """The detached blocks' order (which ones the bound drops) follows the children's order of
    storing, in both implementations."""
    native, python = trees([16], 16, 2)
    events = [BlockStored((1,), None, tuple(range(16)), 16)] + [
        BlockStored((child,), 1, tuple(range(16 * child, 16 * child + 16)), 16) for child in (5, 3, 4)]
    for tree in (native, python):
        tree.apply_each(events)
        tree.apply(BlockRemoved((1,)))
    assert list(native._detached) == list(python._detached) == [3, 4]  # 5, the oldest, dropped
    assert native.dropped_blocks == python.dropped_blocks == 1


def test_a_tree_is_freed_by_reference_counting() -> None:
    """The simulator runs without the cyclic collector: a tree, native, Python or moved from one
    to the other, leaves no cycle behind."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for native, block_hash in ((True, 1), (False, 1), (True, b"x")):
            tree = BlockTree("w", [4], salt=SALT, native=native)
            tree.apply_each([BlockStored((block_hash,), None, (1, 2, 3, 4), 4)] * 2)
            del tree
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def tampered(events: ScannedEvents, run: int, **fields: int) -> ScannedEvents:
    """The same payload and columns with run ``run``'s fields replaced (what a bug between the
    scan and the tree would hand it)."""
    runs, hashes, tokens = events.columns()
    records = np.frombuffer(runs, dtype=_RUN_DTYPE).copy()
    for name, value in fields.items():
        records[run][name] = value
    return ScannedEvents(events.data, None, None, None, columns=(records.tobytes(), hashes, tokens))


@pytest.mark.parametrize(("run", "fields"), [
    (0, {"hash_end": 9}),  # past the hash column (2 hashes)
    (0, {"hash_start": 2, "hash_end": 1}),  # out of order
    (1, {"token_end": 1 << 20}),  # past the token column
    (1, {"token_start": 5, "token_end": 4}),
    (1, {"block_size": 0}),
    (0, {"kind": 7}),
    (1, {"medium_off": 1 << 20, "medium_len": 3}),  # a medium name past the payload
])
def test_runs_that_disagree_with_their_columns_are_refused_whole(run: int, fields: dict) -> None:
    """The C tree checks every run against the columns it was given before applying any:
    a malformed one raises and the tree is as it was (no read past a column)."""
    tree = BlockTree("w", [4, 8], salt=SALT)
    tree.apply(BlockStored((1,), None, (1, 2, 3, 4), 4))
    before = tree.registered_with_lengths()
    events = scanned([BlockRemoved((1,)), BlockStored((2, 3), None, (5, 6, 7, 8, 9, 10, 11, 12), 4)])
    assert tree.is_native
    with pytest.raises(ValueError, match="malformed"):
        tree.apply_events(tampered(events, run, **fields))
    assert tree.registered_with_lengths() == before and 1 in tree and 2 not in tree
    assert len(tree.apply_events(events)) == 3  # the untampered batch applies: 1 evicted, 2 keys cached


@pytest.mark.parametrize("op", [
    (lib.KVC_BT_OP_STORE, 0, 4, 3, 4),  # three hashes, the column holds one
    (lib.KVC_BT_OP_STORE, 0, 4, 1, 9),  # nine tokens, the column holds four
    (lib.KVC_BT_OP_STORE, 0, -4, 1, 4),  # a negative block size
    (lib.KVC_BT_OP_STORE, 0, 1 << 40, 1, 4),  # past uint32
    (lib.KVC_BT_OP_REMOVE, 0, 0, -1, 0),
    (lib.KVC_BT_OP_STORE | 40 << lib.KVC_BT_OP_MEDIUM_SHIFT, 0, 4, 1, 4),  # medium 40 of 32
    (0, 0, 0, 0, 0),  # no kind
])
def test_ops_past_their_columns_are_refused_by_the_c_entry_point(op: tuple) -> None:
    tree = lib.kvc_btree_new(ffi.new("uint32_t[]", [4]), 1, SALT, len(SALT), 16)
    lib.kvc_btree_set_medium_tier(tree, 0, 1)
    try:
        ops = ffi.new("kvc_btree_op[]", [op])
        hashes, tokens = ffi.new("int64_t[]", [1]), ffi.new("uint32_t[]", [1, 2, 3, 4])
        assert lib.kvc_btree_apply_ops(tree, ops, 1, hashes, 1, tokens, 4, 0) == lib.KVC_BT_BAD_INPUT
        stats = ffi.new("kvc_btree_stats *")
        lib.kvc_btree_get_stats(tree, stats)
        assert stats.blocks == 0 and stats.registered == 0
        good = ffi.new("kvc_btree_op[]", [(lib.KVC_BT_OP_STORE, 0, 4, 1, 4)])
        assert lib.kvc_btree_apply_ops(tree, good, 1, hashes, 1, tokens, 4, 0) == 1
    finally:
        lib.kvc_btree_free(tree)
