"""The KV-event decoder against the engines' own captured batches, hand-made batches and fuzz."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    ReplayedBatch,
    ReplayEnded,
    SequenceTracker,
    SeqVerdict,
    StorageTier,
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_batch,
    encode_seq,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
    tier_of_medium,
)

SAMPLES = Path("/work/shared/wire-samples")
ROOT_HASH = -8211977001010843013


def sample_frames(engine: str, n: int) -> list[bytes]:
    folder = SAMPLES / engine
    return [(folder / f"batch{n}.{part}").read_bytes() for part in ("topic", "seq", "msgpack")]


needs_samples = pytest.mark.skipif(not SAMPLES.exists(), reason="wire samples not present")


@needs_samples
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_wire_samples_decode_to_the_documented_events(engine: str) -> None:
    batches = [decode_message(sample_frames(engine, n), topic=b"kv-events") for n in range(4)]
    assert [b.seq for b in batches] == [0, 1, 2, 3]
    assert all(b.dp_rank == 0 for b in batches)

    (root,) = batches[0].events
    assert isinstance(root, BlockStored)
    assert root.block_hashes == (ROOT_HASH,)
    assert root.parent_block_hash is None
    assert root.token_ids == tuple(range(100, 116))
    assert root.block_size == 16 and root.tier is StorageTier.VRAM

    (pair,) = batches[1].events
    assert isinstance(pair, BlockStored)
    assert pair.parent_block_hash == ROOT_HASH
    assert len(pair.block_hashes) == 2 and len(pair.token_ids) == 32
    chain = list(pair.blocks())
    assert chain[0][1] == ROOT_HASH and chain[1][1] == pair.block_hashes[0]
    assert chain[1][2] == tuple(range(132, 148))
    if engine == "vllm":
        # uint64 above the int64 range is canonicalised to the int64 with the same bits
        assert pair.block_hashes[1] == 17000000000000000001 - (1 << 64)

    copied, removed = batches[2].events
    assert isinstance(copied, BlockStored) and copied.tier is StorageTier.DRAM
    assert copied.block_hashes == (pair.block_hashes[0],)
    assert isinstance(removed, BlockRemoved) and removed.tier is StorageTier.VRAM
    assert removed.block_hashes == (pair.block_hashes[0],)

    assert batches[3].events == (AllBlocksCleared(),)


@needs_samples
def test_encoder_reproduces_sglang_bytes_and_vllm_structure() -> None:
    for n in range(4):
        frames = sample_frames("sglang", n)
        batch = decode_message(frames)
        assert encode_batch(batch.seq, batch.ts, batch.events) == frames
        vllm = sample_frames("vllm", n)
        ours = decode_message(encode_batch(n, batch.ts, decode_message(vllm).events))
        assert ours == decode_message(vllm)
        # same top-level layout: [float ts, [events], rank]
        theirs = msgpack.unpackb(vllm[2])
        mine = msgpack.unpackb(encode_batch(n, batch.ts, decode_message(vllm).events)[2])
        assert len(theirs) == len(mine) == 3 and type(theirs[0]) is type(mine[0])


def test_positional_events_old_and_new_layouts() -> None:
    payload = msgpack.packb(
        [
            12.5,
            [
                ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", "lora-name", [None, None]],
                ["BlockStored", [3], 2, list(range(5)), 16, None],  # older SGLang: no medium, short page
                ["BlockStored", [4], 3, list(range(16)), 16],  # oldest: no lora_id either
                ["BlockRemoved", [1], "CPU_PINNED", 7],
                ["BlockRemoved", [2]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_payload(payload, seq=9)
    assert batch.seq == 9 and batch.ts == 12.5 and batch.dp_rank is None
    stored, short, oldest, removed_cpu, removed, cleared = batch.events
    assert stored.medium == "GPU" and stored.block_hashes == (1, 2)
    assert short.medium is None and short.tier is StorageTier.VRAM and short.token_ids == tuple(range(5))
    assert oldest.lora_id is None and oldest.parent_block_hash == 3
    assert removed_cpu.tier is StorageTier.DRAM
    assert removed.medium is None
    assert cleared == AllBlocksCleared()


def test_map_batch_map_events_bytes_hashes_and_unknown_keys() -> None:
    payload = msgpack.packb(
        {
            "ts": 3,
            "data_parallel_rank": 2,
            "future": "ignored",
            "events": [
                {
                    "type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                    "token_ids": [[5, 6], [6, 7]], "block_size": 2, "lora_id": None, "medium": "DISK",
                    "group_idx": 0, "kv_cache_spec_kind": "full",
                },
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "disk"},
            ],
        },
        use_bin_type=True,
    )
    batch = decode_payload(payload, seq=0)
    assert batch.dp_rank == 2 and batch.ts == 3.0
    stored, removed = batch.events
    assert stored.block_hashes == (b"\x01" * 32,)
    assert stored.token_ids == (5, 6)  # bigram pages: the token at each slot
    assert stored.tier is StorageTier.UNINDEXED and removed.tier is StorageTier.UNINDEXED


@pytest.mark.parametrize(
    "medium, tier",
    [(None, StorageTier.VRAM), ("GPU", StorageTier.VRAM), ("CPU", StorageTier.DRAM),
     ("CPU_PINNED", StorageTier.DRAM), ("DISK", StorageTier.UNINDEXED), ("EXTERNAL", StorageTier.UNINDEXED),
     ("FS", StorageTier.UNINDEXED), ("OBJ", StorageTier.UNINDEXED), ("TAPE", StorageTier.UNINDEXED)],
)
def test_medium_tiers(medium: str | None, tier: StorageTier) -> None:
    assert tier_of_medium(medium) is tier


@pytest.mark.parametrize(
    "events, fragment",
    [
        ([["BlockStored", [1], None, list(range(17)), 16, None, "GPU"]], "token ids"),
        ([["BlockStored", [1], None, [1, 2], 0]], "block_size"),
        ([["BlockStored", [], None, [], 16]], "no block hashes"),
        ([["BlockStored", [1.5], None, [1], 16]], "block_hashes"),
        ([["BlockStored", [b""], None, [1], 16]], "bytes"),
        ([["BlockStored", [1], None, [-1], 16]], "token id"),
        ([["BlockStored", [1], None, [1], 16, None, 5]], "medium"),
        ([["Mystery"]], "unknown event type"),
        ([{"type": "BlockStored", "block_hashes": [1]}], "lacks"),
        ([{"kind": "BlockRemoved"}], "unknown event type"),
        ([42], "array or a map"),
    ],
)
def test_one_malformed_event_rejects_the_whole_batch(events: list, fragment: str) -> None:
    good = ["BlockStored", [7], None, [1, 2], 16, None, "GPU"]
    payload = msgpack.packb([1.0, [good, *events], 0])
    with pytest.raises(KvEventError, match=fragment):
        decode_payload(payload, seq=1)


@pytest.mark.parametrize(
    "frames, fragment",
    [
        ([b"kv-events", b"\x00" * 8], "3 frames"),
        ([b"kv-events", b"\x00" * 4, b"\x90"], "8 bytes"),
        ([b"kv-events", encode_seq(-5), msgpack.packb([1.0, []])], "negative"),
        ([b"kv-events", b"\x00" * 8, b"\xc1"], "msgpack"),
        ([b"kv-events", b"\x00" * 8, msgpack.packb([1.0])], "fields"),
        ([b"kv-events", b"\x00" * 8, msgpack.packb({"ts": 1.0})], "lacks"),
        ([b"kv-events", b"\x00" * 8, msgpack.packb(["x", []])], "ts"),
        ([b"kv-events", b"\x00" * 8, msgpack.packb([1.0, {}])], "events"),
        ([b"kv-events", b"\x00" * 8, msgpack.packb("hello")], "array or a map"),
        ([b"other", b"\x00" * 8, msgpack.packb([1.0, []])], "topic"),
    ],
)
def test_malformed_messages(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(KvEventError, match=fragment):
        decode_message(frames, topic=b"kv-events")


def test_hash_range_is_checked_on_construction() -> None:
    with pytest.raises(KvEventError, match="outside"):
        BlockStored((1 << 64,), None, (1,), 16)
    with pytest.raises(KvEventError, match="bool"):
        BlockRemoved((True,))


def test_round_trip_both_styles() -> None:
    events = (
        BlockStored((5, -6, b"\xff" * 8), 4, tuple(range(40)), 16, None, "GPU"),
        BlockStored((9,), None, (1,), 16, 3, "CPU"),
        BlockRemoved((5,), "GPU"),
        BlockRemoved((9,)),
        AllBlocksCleared(),
    )
    for style in ("map", "positional"):
        frames = encode_batch(77, 1.25, events, style=style)
        assert decode_message(frames) == EventBatch(77, 1.25, events, 0)


hashes = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=1, max_size=32))


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    block_hashes = draw(st.lists(hashes, min_size=1, max_size=4))
    size = draw(st.integers(1, 8))
    fill = draw(st.integers(1, size))
    return BlockStored(
        tuple(block_hashes), draw(st.one_of(st.none(), hashes)),
        tuple(range(size * (len(block_hashes) - 1) + fill)), size,
        draw(st.one_of(st.none(), st.integers(0, 5))),
        draw(st.sampled_from([None, "GPU", "CPU", "CPU_PINNED", "DISK"])),
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(stored_events(), st.builds(BlockRemoved, st.lists(hashes).map(tuple)),
                          st.just(AllBlocksCleared())), max_size=6),
       st.sampled_from(["map", "positional"]), st.integers(0, (1 << 63) - 1))
def test_round_trip_property(events: list, style: str, seq: int) -> None:
    batch = decode_message(encode_batch(seq, 0.5, events, style=style))
    assert batch.events == tuple(events) and batch.seq == seq


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_kv_event_error(data: bytes) -> None:
    try:
        decode_payload(data, seq=0)
    except KvEventError:
        pass


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
              st.text(max_size=12), st.binary(max_size=12),
              st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"])),
    lambda children: st.one_of(st.lists(children, max_size=8),
                               st.dictionaries(st.one_of(st.text(max_size=20), st.sampled_from(
                                   ["type", "block_hashes", "token_ids", "block_size", "parent_block_hash",
                                    "medium", "ts", "events"])), children, max_size=8)),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(msgpack_values)
def test_random_msgpack_structures_only_raise_kv_event_error(value: object) -> None:
    for candidate in (value, [1.0, value], [1.0, [value], 0], {"ts": 1.0, "events": [value]}):
        try:
            decode_payload(msgpack.packb(candidate, use_bin_type=True), seq=3)
        except KvEventError:
            pass


def test_replay_framing_matches_the_engines_router() -> None:
    # DEALER request -> ROUTER sees [identity, "", start]
    request = replay_request_frames(41)
    assert request == [b"", (41).to_bytes(8, "big")]
    assert parse_replay_request([b"id", *request]) == (b"id", 41)
    # ROUTER reply -> DEALER sees ["", seq, payload]
    reply = replay_reply_frames(b"id", 41, b"payload")
    assert reply == [b"id", b"", (41).to_bytes(8, "big"), b"payload"]
    assert decode_replay_reply(reply[1:]) == ReplayedBatch(41, b"payload")
    assert decode_replay_reply(reply[2:]) == ReplayedBatch(41, b"payload")  # REQ strips the delimiter
    end = replay_end_frames(b"id")
    assert end[2] == (-1).to_bytes(8, "big", signed=True) and end[3] == b""
    assert decode_replay_reply(end[1:]) == ReplayEnded()
    with pytest.raises(KvEventError):
        parse_replay_request([b"id", b"\x00" * 8])
    with pytest.raises(KvEventError):
        decode_replay_reply([b"", b"\x00" * 3, b""])


def test_sequence_tracker() -> None:
    tracker = SequenceTracker()
    assert tracker.check_live(0).verdict is SeqVerdict.NEXT
    tracker.applied(0)
    assert tracker.check_live(1).verdict is SeqVerdict.NEXT
    tracker.applied(1)
    gap = tracker.check_live(5)
    assert (gap.verdict, gap.missing_from, gap.missing_to) == (SeqVerdict.GAP, 2, 4)
    for seq in (2, 3, 4):
        assert tracker.check_replayed(seq).verdict is SeqVerdict.NEXT
        tracker.applied(seq)
    assert tracker.check_replayed(3).verdict is SeqVerdict.DUPLICATE
    assert tracker.check_replayed(5).verdict is SeqVerdict.NEXT
    tracker.applied(5)
    # the live counter goes back: a new publisher
    assert tracker.check_live(0).verdict is SeqVerdict.RESTART
    assert tracker.check_live(0).verdict is SeqVerdict.NEXT
    tracker.applied(0)
    # a subscriber that joins late sees a gap from 0
    late = SequenceTracker()
    check = late.check_live(100)
    assert (check.verdict, check.missing_from, check.missing_to) == (SeqVerdict.GAP, 0, 99)
    late.skip_to(100)
    assert late.check_live(100).verdict is SeqVerdict.NEXT
