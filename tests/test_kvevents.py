"""The KV-event decoder against the engines' own captured batches, hand-made batches and fuzz."""

from __future__ import annotations

import msgpack
import pytest
from engine_captures import (
    ENGINES,
    HASH_A,
    HASH_B,
    HASH_C,
    HASH_D,
    HASH_G,
    load_capture,
    tokens,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.engine import kvevents
from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    PayloadDecoder,
    ReplayedBatch,
    ReplayEnded,
    SequenceTracker,
    SeqVerdict,
    StorageTier,
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_batch,
    encode_payload,
    encode_seq,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
    tier_of_medium,
)


@pytest.mark.parametrize("engine", ENGINES)
def test_captured_live_batches_decode_to_the_scripted_events(engine: str) -> None:
    record = load_capture(engine)
    assert record["topic"] == "" and all(frames[0] == b"" for frames in record["live"])
    batches = [decode_message(frames, topic=b"") for frames in record["live"]]
    assert [b.seq for b in batches] == list(range(7))
    assert all(b.dp_rank == 0 for b in batches)

    (root,) = batches[0].events
    assert root == BlockStored((HASH_A,), None, tokens(0), 16, None, "GPU")
    assert root.tier is StorageTier.VRAM

    (pair,) = batches[1].events
    assert pair.block_hashes == (HASH_B, HASH_C[engine]) and pair.parent_block_hash == HASH_A
    chain = list(pair.blocks())
    assert chain[1] == (HASH_C[engine], HASH_B, tokens(2))

    copied, removed = batches[2].events
    assert copied.block_hashes == (HASH_A,) and copied.tier is StorageTier.DRAM
    assert copied.medium == ("CPU_PINNED" if engine == "sglang" else "CPU")
    assert removed == BlockRemoved((HASH_A,), "GPU")
    assert batches[3].events == (BlockRemoved((HASH_C[engine],), "GPU"),)

    if engine == "sglang":
        (lora,) = batches[4].events
    else:
        other_group, lora, partial = batches[4].events
        assert other_group.group_idx == 1 and other_group.block_hashes == (HASH_D,)
        assert partial.block_size == 8 and partial.token_ids == tokens(3, size=8) and partial.group_idx == 0
    assert lora.lora_id == 3 and lora.lora_name == "adapter-a" and lora.is_lora
    assert batches[5].events == (AllBlocksCleared(),)
    assert batches[6].events == (BlockStored((HASH_G,), None, tokens(9), 16, None, "GPU"),)


def test_encoder_reproduces_sglangs_bytes() -> None:
    """The emulated worker publishes exactly what SGLang's publisher does, byte for byte."""
    for frames in load_capture("sglang")["live"]:
        batch = decode_message(frames)
        assert encode_batch(batch.seq, batch.ts, batch.events) == frames
    for frames in load_capture("sglang", "topic")["live"]:
        batch = decode_message(frames, topic=b"kv-events")
        assert encode_batch(batch.seq, batch.ts, batch.events, topic=b"kv-events") == frames


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("capture", ["default", "topic", "short-buffer"])
def test_captured_replay_exchanges(engine: str, capture: str) -> None:
    record = load_capture(engine, capture)
    topic = record["topic"].encode()
    live = {decode_message(frames).seq: frames for frames in record["live"]}
    oldest_buffered = len(live) - record["buffer_steps"] if len(live) > record["buffer_steps"] else 0
    for exchange in record["replays"]:
        *batches, end = exchange["replies"]
        assert all(len(frames) == 4 for frames in exchange["replies"])
        assert decode_replay_reply(end) == ReplayEnded()
        assert end == [b"", b"", b"\xff" * 8, b""]  # the marker's topic is empty whatever the topic
        replayed = [decode_replay_reply(frames, topic=topic) for frames in batches]
        first = max(exchange["start_seq"], oldest_buffered)
        assert [r.seq for r in replayed] == list(range(first, len(live)))
        for reply, frames in zip(replayed, batches, strict=True):
            assert frames[1:] == live[reply.seq]  # the same topic, seq and payload as live
            assert reply.payload == live[reply.seq][2]
            # the emulator's ROUTER answers with the same frames
            assert replay_reply_frames(b"id", topic, reply.seq, reply.payload)[1:] == frames
        assert replay_end_frames(b"id")[1:] == end
    if capture == "short-buffer":
        assert oldest_buffered == 3  # a replay from 0 cannot reach back


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


@settings(max_examples=60, deadline=None)
@given(st.lists(stored_events(), max_size=12), st.integers(1, 5), st.sampled_from(["array", "map", "positional"]),
       st.lists(st.integers(0, 9), max_size=2))
def test_payload_decoder_in_slices_equals_decode_payload(events: list, step: int, form: str, extra: list) -> None:
    if form == "map":
        payload = msgpack.packb({"ts": 2.5, "events": [msgpack.unpackb(encode_payload(0, [e]))[1][0] for e in events],
                                 "data_parallel_rank": 1}, use_bin_type=True)
    else:
        ts, wire, rank = msgpack.unpackb(encode_payload(2.5, events, dp_rank=1, style="map" if form == "array"
                                                         else "positional"), strict_map_key=False)
        payload = msgpack.packb([ts, wire, rank, *extra], use_bin_type=True)  # fields a newer engine appends
    results = []
    for stream in (True, False):
        decoder = PayloadDecoder(payload, 7, stream=stream)
        steps = 1
        while not decoder.step(step):
            steps += 1
        assert steps == max(1, -(-len(events) // step))
        results.append(decoder.result)
    assert results[0] == results[1] == decode_payload(payload, 7) == EventBatch(7, 2.5, tuple(events), 1)


def test_payload_decoder_rejects_truncated_and_trailing_bytes() -> None:
    payload = encode_payload(1.0, [BlockStored((1,), None, (1,), 16)] * 3)
    for stream in (True, False):
        for data, fragment in ((payload[:-3], "msgpack"), (payload + b"\x01", "extra data|ExtraData")):
            with pytest.raises(KvEventError, match=fragment):
                decoder = PayloadDecoder(data, 0, stream=stream)
                while not decoder.step(1):
                    pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 4))
def test_random_bytes_in_slices_only_raise_kv_event_error(data: bytes, step: int) -> None:
    outcomes = []
    for stream in (True, False):
        try:
            decoder = PayloadDecoder(data, 0, stream=stream)
            while not decoder.step(step):
                pass
            outcomes.append(decoder.result)
        except KvEventError:
            outcomes.append("rejected")
    assert outcomes[0] == outcomes[1]  # both readings accept and reject the same payloads


def test_replay_framing() -> None:
    # DEALER request -> ROUTER sees [identity, "", start]; the engines read start unsigned
    request = replay_request_frames(41)
    assert request == [b"", (41).to_bytes(8, "big")]
    assert parse_replay_request([b"id", *request]) == (b"id", 41)
    reply = replay_reply_frames(b"id", b"t", 41, b"payload")
    assert reply == [b"id", b"", b"t", (41).to_bytes(8, "big"), b"payload"]
    assert decode_replay_reply(reply[1:], topic=b"t") == ReplayedBatch(41, b"payload")
    with pytest.raises(KvEventError, match="topic"):
        decode_replay_reply(reply[1:], topic=b"other")
    with pytest.raises(KvEventError, match="4 frames|got 3"):
        decode_replay_reply([b"", (41).to_bytes(8, "big"), b"payload"])  # the old 3-frame guess
    with pytest.raises(KvEventError, match="negative"):
        decode_replay_reply([b"", b"t", encode_seq(-2), b"x"])
    with pytest.raises(KvEventError):
        parse_replay_request([b"id", b"\x00" * 8])
    # the engines read the start unsigned: a start past every seq is answered with the marker only
    assert parse_replay_request([b"id", b"", b"\xff" * 8]) == (b"id", (1 << 64) - 1)
    with pytest.raises(KvEventError):
        decode_replay_reply([b"", b"", b"\x00" * 3, b""])


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
    # the live counter going back is not taken as a restart here (the subscriber asks the
    # replay socket for evidence): it is simply not the next batch
    assert tracker.check_live(0).verdict is SeqVerdict.DUPLICATE
    assert tracker.last_applied == 5
    # a subscriber that joins late sees a gap from 0
    late = SequenceTracker()
    check = late.check_live(100)
    assert (check.verdict, check.missing_from, check.missing_to) == (SeqVerdict.GAP, 0, 99)
    late.skip_to(100)
    assert late.check_live(100).verdict is SeqVerdict.NEXT


# The decoder builds the events the engines send (int64 hashes, plain token ids) without the
# constructor's second validation pass: it must build exactly what the constructor builds, for
# every field shape, and leave anything else to the constructor's checks.
wire_hashes = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=0, max_size=70), st.booleans(),
                        st.floats(allow_nan=False), st.none())
wire_tokens = st.one_of(st.integers(-2, (1 << 32) + 2), st.booleans(), st.lists(st.integers(0, 9), max_size=2),
                        st.text(max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.lists(wire_hashes, min_size=0, max_size=3), st.one_of(st.none(), wire_hashes),
       st.lists(st.one_of(st.integers(0, 1000), wire_tokens), min_size=0, max_size=10),
       st.one_of(st.integers(-1, 4), st.booleans(), st.just(2.0)),
       st.one_of(st.none(), st.integers(0, 3), st.just("x")), st.one_of(st.none(), st.sampled_from(["GPU", "CPU"]), st.just(3)),
       st.one_of(st.none(), st.just("adapter"), st.just(7)), st.one_of(st.none(), st.integers(-1, 2), st.just(1 << 32)),
       st.sampled_from(["stored", "removed"]))
def test_decoded_events_equal_the_validating_constructors(hashes, parent, tokens, size, lora, medium, lora_name, group,
                                                         kind) -> None:
    if kind == "stored":
        raw = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
               "block_size": size, "lora_id": lora, "medium": medium, "lora_name": lora_name, "group_idx": group}
    else:
        raw = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": group}
    payload = msgpack.packb([1.0, [raw], 0], use_bin_type=True)
    try:
        if kind == "stored":
            expected = BlockStored(tuple(hashes), parent, tuple(tokens), size, lora, medium, lora_name, group)
        else:
            expected = BlockRemoved(tuple(hashes), medium, group)
    except KvEventError:
        with pytest.raises(KvEventError):
            decode_payload(payload, seq=0)
        return
    except TypeError:  # unhashable odd values the constructor cannot even compare
        return
    decoded = decode_payload(payload, seq=0).events[0]
    assert decoded == expected and type(decoded) is type(expected)
    assert [type(h) for h in decoded.block_hashes] == [type(h) for h in expected.block_hashes]


# The agent decodes with coalesce=True: runs of events that continue one another become one
# event. Applied to a block mirror, the batch must leave exactly what the engine's own events
# leave, and a batch must be rejected exactly when it is rejected without coalescing.
chain_hashes = st.integers(-3, 12)


@st.composite
def engine_like_events(draw: st.DrawFn) -> list:
    events, last = [], None
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["stored"] * 5 + ["removed"] * 2 + ["cleared", "odd"]))
        if kind == "stored":
            h = draw(chain_hashes)
            parent = last if draw(st.integers(0, 4)) else draw(st.one_of(st.none(), chain_hashes))
            size = draw(st.sampled_from([4, 4, 4, 2]))
            fill = draw(st.sampled_from([size, size, size, 1]))
            events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                           "token_ids": list(range(h * 10 % 50, h * 10 % 50 + fill)), "block_size": size,
                           "lora_id": draw(st.sampled_from([None, None, 1])),
                           "medium": draw(st.sampled_from([None, None, "CPU"]))})
            last = h
        elif kind == "removed":
            events.append({"type": "BlockRemoved", "block_hashes": draw(st.lists(chain_hashes, min_size=1, max_size=2)),
                           "medium": draw(st.sampled_from([None, None, "CPU"]))})
        elif kind == "cleared":
            events.append({"type": "AllBlocksCleared"})
        else:  # shapes the fast path leaves to the validating constructors, good or bad
            events.append(draw(st.sampled_from([
                {"type": "BlockStored", "block_hashes": [b"\x01" * 8], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 4},
                {"type": "BlockStored", "block_hashes": [(1 << 64) - 1], "parent_block_hash": None,
                 "token_ids": [1, 2, 3, 4], "block_size": 4},
                {"type": "BlockRemoved", "block_hashes": [1.5]},
                {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": [-1],
                 "block_size": 4},
                ["BlockStored", [4], None, [1, 2, 3, 4], 4, None, None],
            ])))
    return events


@settings(max_examples=300, deadline=None)
@given(engine_like_events(), st.integers(1, 16), st.booleans())
def test_coalesced_decoding_leaves_a_mirror_as_the_engines_events_do(raw_events: list, step: int,
                                                                    stream: bool) -> None:
    from kvcompassd.engine.blocktree import BlockTree

    payload = msgpack.packb([1.0, raw_events, 0], use_bin_type=True)

    def decoded(coalesce: bool):
        decoder = PayloadDecoder(payload, 3, stream=stream, coalesce=coalesce)
        while not decoder.step(step):
            pass
        return decoder.result

    try:
        plain = decoded(False)
    except KvEventError as exc:
        with pytest.raises(KvEventError) as caught:
            decoded(True)
        assert str(caught.value) == str(exc)
        return
    merged = decoded(True)
    assert len(merged.events) <= len(plain.events) and (merged.seq, merged.ts) == (plain.seq, plain.ts)
    key = lambda tokens, lengths: [hash((tuple(tokens[:n]), n)) & ((1 << 63) - 1) for n in lengths]  # noqa: E731
    one, other = BlockTree("w", (4, 8, 12), key, page_size=4), BlockTree("w", (4, 8, 12), key, page_size=4)
    for event in plain.events:
        one.apply(event)
    for event in merged.events:
        other.apply(event)
    assert one.registered() == other.registered()
    assert len(one) == len(other) and one.detached_count == other.detached_count
    assert one.ignored_removals == other.ignored_removals


def test_a_chain_of_single_block_stores_and_a_run_of_removals_become_one_event_each() -> None:
    stores = [BlockStored((h,), h - 1 if h else None, tuple(range(4 * h, 4 * h + 4)), 4, None, "GPU") for h in range(5)]
    events = [*stores, BlockRemoved((4,), "GPU"), BlockRemoved((3,), "GPU"), AllBlocksCleared(),
              BlockStored((9,), None, (1, 2), 4)]
    payload = encode_payload(1.0, events)
    decoder = PayloadDecoder(payload, 0, coalesce=True)
    decoder.step(100)
    assert decoder.result.events == (
        BlockStored(tuple(range(5)), None, tuple(range(20)), 4, None, "GPU"),
        BlockRemoved((4, 3), "GPU"), AllBlocksCleared(), BlockStored((9,), None, (1, 2), 4))
    assert decode_payload(payload, 0).events == tuple(events)  # without coalescing: the engine's events


# The agent's usual payloads skip msgpack objects altogether: one C pass (kvc_kvevents_scan)
# builds the coalesced events. It must build exactly what the Python decoder builds, and must
# never accept a payload the Python decoder rejects (it leaves anything unusual to it).
def python_coalesced(payload: bytes) -> EventBatch:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kvevents, "_scan_coalesced", lambda data: None)
        decoder = PayloadDecoder(payload, 5, coalesce=True)
        decoder.step(1 << 20)
        return decoder.result


def check_scan_against_python(payload: bytes) -> bool:
    """Whether the C scan took the payload; asserts it agrees with the Python decoder."""
    scanned = kvevents._scan_coalesced(payload)
    try:
        expected = python_coalesced(payload)
    except KvEventError:
        assert scanned is None, "the C scan accepted a payload the decoder rejects"
        return False
    if scanned is None:
        return False
    ts, dp_rank, events = scanned
    assert (ts, dp_rank) == (expected.ts, expected.dp_rank)
    assert tuple(events) == expected.events
    assert [type(e) for e in events] == [type(e) for e in expected.events]
    # the count the scan makes is the events' blocks (the agent slices batches by it)
    assert events.block_count() == sum(len(e.block_hashes) for e in expected.events
                                       if not isinstance(e, AllBlocksCleared))
    decoder = PayloadDecoder(payload, 5, coalesce=True)  # and the decoder's own result is the scan's
    assert decoder.step(1) and decoder.result == expected
    return True


@pytest.mark.parametrize("engine", ENGINES)
def test_c_scan_decodes_the_engines_captures_as_the_python_decoder(engine: str) -> None:
    taken = 0
    for name in ("default", "short-buffer", "topic"):
        for frames in load_capture(engine, name)["live"]:
            taken += check_scan_against_python(bytes(frames[2]))
    assert taken  # SGLang's batches all take the C path; vLLM's with uint64 hashes above 2^63 do not


scan_fields = st.fixed_dictionaries({}, optional={
    "lora_id": st.one_of(st.none(), st.integers(-5, 5), st.just(True)),
    "medium": st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "cpu_pinned", "DISK", "é"])),
    "lora_name": st.one_of(st.none(), st.sampled_from(["a", "bé"]), st.just(3)),
    "group_idx": st.one_of(st.none(), st.integers(0, 2), st.just(1 << 32), st.just(-1)),
    "cache_salt": st.one_of(st.none(), st.text(max_size=3), st.binary(max_size=3), st.lists(st.integers(-(1 << 63), (1 << 64) - 1), max_size=2)),
    "extra_keys": st.one_of(st.none(), st.dictionaries(st.text(max_size=2), st.integers(-9, 9), max_size=2)),
})


@st.composite
def scan_events(draw: st.DrawFn) -> list:
    """engine_like_events, with the optional and unknown fields the engines may send."""
    events = draw(engine_like_events())
    return [({**event, **draw(scan_fields)} if isinstance(event, dict) and event.get("type") != "AllBlocksCleared"
             else event) for event in events]


@settings(max_examples=400, deadline=None)
@given(raw_events=scan_events(), dp_rank=st.sampled_from([None, 0, 3, "x"]),
       ts=st.sampled_from([1.5, 7, float("nan"), True]), extra=st.lists(st.integers(-(1 << 63), (1 << 64) - 1), max_size=2), data=st.data())
def test_c_scan_builds_what_the_python_decoder_builds(raw_events, dp_rank, ts, extra, data) -> None:
    payload = msgpack.packb([ts, raw_events, dp_rank, *extra], use_bin_type=True)
    check_scan_against_python(payload)
    # the same bytes damaged: flipped, cut short, or with a byte more
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    check_scan_against_python(bytes(raw))
    check_scan_against_python(payload[:data.draw(st.integers(0, len(payload) - 1))])
    check_scan_against_python(payload + b"\x00")


def test_c_scan_takes_the_usual_batch_and_leaves_the_rest_to_python() -> None:
    stores = [BlockStored((h,), h - 1 if h else None, tuple(range(4 * h, 4 * h + 4)), 4, None, "GPU") for h in range(5)]
    usual = encode_payload(1.0, [*stores, BlockRemoved((4,), "GPU"), BlockRemoved((3,), "GPU"), AllBlocksCleared()])
    assert check_scan_against_python(usual)
    assert len(kvevents._scan_coalesced(usual)[2]) == 3
    for unusual in (
        msgpack.packb({"ts": 1.0, "events": []}),  # the map form
        msgpack.packb([1.0, [["BlockStored", [4], None, [1, 2, 3, 4], 4, None, None]], 0]),  # positional
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [(1 << 64) - 1], "token_ids": [1], "block_size": 4}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2]], "block_size": 4}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 8], "token_ids": [1], "block_size": 4}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "x": msgpack.ExtType(1, b"")}]]),
        msgpack.packb([1.0, [1]])[:-2] + b"\x91\x83" + b"".join(  # a field twice (msgpack keeps the last)
            map(msgpack.packb, ["type", "BlockRemoved", "block_hashes", [1], "block_hashes", [2]])),
        b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa3\xff\xfe\xfd",  # invalid UTF-8
    ):
        assert kvevents._scan_coalesced(unusual) is None
        try:  # the Python decoder takes it, or names what is wrong
            PayloadDecoder(unusual, 0, coalesce=True).step(100)
        except KvEventError:
            pass
