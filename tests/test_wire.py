"""The wire codec: every message round-trips; malformed input raises WireError and only that."""

from __future__ import annotations

import math
import os
import re
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompassd import wire
from kvcompassd.core.events import MAX_KEY, EventOp, IndexEventColumns, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.wire import (
    MESSAGE_SPECS,
    SENDER_ROLES,
    ErrorReported,
    PrefixEventsReported,
    RequestForwarded,
    Role,
    UpdateBatchPublished,
    WireError,
    WireForbidden,
    WorkerRegistered,
    check_sender,
    decode,
    encode,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A dedicated fuzz run sets KVC_FUZZ_EXAMPLES=100000 (issue 8); CI keeps the default.
FUZZ = settings(
    max_examples=int(os.environ.get("KVC_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---- strategies derived from each field's declared type ------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


def strategy_for(field_type: wire.FieldType) -> st.SearchStrategy:
    if isinstance(field_type, wire.Choice):
        return st.sampled_from(sorted(field_type.choices))
    if isinstance(field_type, wire.Text):
        return st.text(min_size=0 if field_type.allow_empty else 1, max_size=min(field_type.max_chars, 20))
    if isinstance(field_type, wire.Int):
        return st.integers(field_type.lo, field_type.hi)
    if isinstance(field_type, wire.Float):
        return st.floats(max(field_type.lo, -1e12), min(field_type.hi, 1e12), allow_nan=False)
    if isinstance(field_type, wire.Bool):
        return st.booleans()
    if isinstance(field_type, wire.Blob):
        return st.binary(max_size=64)
    if isinstance(field_type, wire.TokenIds):
        return st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple)
    if isinstance(field_type, wire.Pairs):
        pair = st.tuples(strategy_for(field_type.first), strategy_for(field_type.second))
        return st.lists(pair, max_size=5, unique_by=(lambda p: p[0]) if field_type.unique_first else None).map(tuple)
    if isinstance(field_type, wire.Params):
        return st.dictionaries(st.text(max_size=8), json_values, max_size=4)
    raise AssertionError(f"no strategy for {field_type!r}")


def index_events_for(worker: str) -> st.SearchStrategy:
    keys = st.integers(0, MAX_KEY)
    tiers = st.sampled_from([Tier.VRAM, Tier.DRAM])
    event = (
        st.builds(PrefixCached, st.just(worker), keys, tiers)
        | st.builds(TierChanged, st.just(worker), keys, tiers)
        | st.builds(PrefixEvicted, st.just(worker), keys)
    )
    return st.lists(event, max_size=20).map(tuple)


def message_strategy(spec: wire.MessageSpec) -> st.SearchStrategy:
    if spec.cls is PrefixEventsReported:
        worker = strategy_for(wire.ID)
        return worker.flatmap(
            lambda w: st.builds(PrefixEventsReported, st.just(w), st.integers(0, 2**63 - 1), index_events_for(w))
        )
    if spec.cls is wire.SnapshotTransferStarted:
        return snapshot_headers()
    if spec.cls is wire.WorkerRoomReported:  # steps non-decreasing in both
        return st.builds(wire.WorkerRoomReported, strategy_for(wire.ID), room_steps())
    if spec.cls is wire.RoomVectorBroadcast:
        rooms = st.lists(st.tuples(strategy_for(wire.ID), room_steps()), max_size=4, unique_by=lambda p: p[0])
        return st.builds(wire.RoomVectorBroadcast, strategy_for(wire.REGION), strategy_for(wire.REGION),
                         st.floats(0.0, 1e12, allow_nan=False), rooms.map(tuple))
    if spec.cls is wire.SnapshotChunkSent:  # a chunk is never empty
        return st.builds(wire.SnapshotChunkSent, **{name: strategy_for(ft) for name, ft in spec.fields
                                                     if name != "data"}, data=st.binary(min_size=1, max_size=64))
    return st.builds(spec.cls, **{name: strategy_for(ft) for name, ft in spec.fields})


def room_steps() -> st.SearchStrategy:
    """(ms, free tokens) steps, non-decreasing in both, as the room messages require."""
    steps = st.lists(st.tuples(st.floats(0.0, 1e9, allow_nan=False), st.integers(0, 2**63 - 1)), max_size=5)
    return steps.map(lambda p: tuple(zip(sorted(m for m, _ in p), sorted(f for _, f in p))))


@st.composite
def snapshot_headers(draw) -> wire.SnapshotTransferStarted:
    """Headers whose byte and chunk counts agree with their tables (the message checks it)."""
    tables = draw(st.lists(st.tuples(st.integers(0, 65535), st.integers(1, 1 << 34)), min_size=1, max_size=5,
                           unique_by=lambda p: p[0]))
    total = sum(n for _, n in tables)
    chunk_bytes = draw(st.integers(1, wire.MAX_SNAPSHOT_CHUNK_BYTES))
    chunks = -(-total // chunk_bytes)
    if chunks > 2**32 - 1:
        chunk_bytes = wire.MAX_SNAPSHOT_CHUNK_BYTES
        chunks = -(-total // chunk_bytes)
    return wire.SnapshotTransferStarted(draw(st.integers(0, 65535)), draw(st.integers(0, 2**64 - 1)),
                                        draw(st.integers(0, 2**63 - 1)), draw(st.integers(1, 2**64 - 1)),
                                        draw(st.integers(0, 2**64 - 1)), total, chunk_bytes, chunks, tuple(tables))


any_message = st.one_of([message_strategy(spec) for spec in MESSAGE_SPECS.values()])


@pytest.mark.parametrize("tag", sorted(MESSAGE_SPECS), ids=lambda t: MESSAGE_SPECS[t].cls.__name__)
def test_every_message_type_round_trips(tag):
    @SETTINGS
    @given(message_strategy(MESSAGE_SPECS[tag]))
    def round_trip(message):
        data = encode(message)
        assert decode(data) == message
        assert len(data) <= MESSAGE_SPECS[tag].max_bytes

    round_trip()


@SETTINGS
@given(any_message)
def test_compressed_encodings_round_trip_and_are_never_larger(message):
    plain = encode(message)
    packed = encode(message, compress=True)
    assert decode(packed) == message
    assert len(packed) <= len(plain)


def test_large_batches_are_compressed_and_small_ones_are_not():
    batch = UpdateBatchPublished(0, 1, 2, ((0, bytes(3000) + b"records"),))
    packed = encode(batch, compress=True)
    assert msgpack.unpackb(packed)[1] == wire.COMPRESSED_TAG and len(packed) < 200
    tiny = ErrorReported("malformed", "x")
    assert encode(tiny, compress=True) == encode(tiny)


def test_every_message_class_has_sender_rule_and_past_tense_name():
    classes = {spec.cls for spec in MESSAGE_SPECS.values()}
    assert classes == set(SENDER_ROLES)
    for cls in classes:
        assert cls.__name__.endswith(("ed", "Sent", "Withdrawn", "Broadcast")), cls.__name__


def test_index_events_travel_as_packed_columns():
    events = (PrefixCached("us-0", 5, Tier.DRAM), PrefixEvicted("us-0", 9), TierChanged("us-0", MAX_KEY, Tier.VRAM))
    report = PrefixEventsReported("us-0", 7, events)
    raw = msgpack.unpackb(encode(report))
    keys = (5).to_bytes(8, "little") + (9).to_bytes(8, "little") + MAX_KEY.to_bytes(8, "little")
    assert raw == [wire.PROTOCOL_VERSION, 1, "us-0", 7, [bytes([EventOp.CACHED_DRAM, EventOp.EVICTED,
                                                                  EventOp.MOVED_TO_VRAM]), keys]]
    assert decode(encode(report)).events.as_events("us-0") == events


@SETTINGS
@given(st.data())
def test_event_columns_round_trip_through_objects(data):
    events = data.draw(index_events_for("w"))
    columns = IndexEventColumns.from_events(events)
    assert len(columns) == len(events)
    assert columns.as_events("w") == events
    assert IndexEventColumns(columns.ops, columns.keys) == columns
    assert PrefixEventsReported("w", 1, columns) == PrefixEventsReported("w", 1, events)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_event_lengths_travel_with_the_events_and_a_report_without_them_still_decodes(data):
    """The lengths column (what a unit filters the edge regions' streams by) round-trips, and
    follows the events through selection, slicing and joining; an older agent's two-column
    report decodes as events of unknown length (0)."""
    events = data.draw(index_events_for("w"))
    lengths = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(events), max_size=len(events)))
    columns = IndexEventColumns.from_events(events, lengths)
    report = PrefixEventsReported("w", 3, columns)
    back = decode(encode(report))
    assert back == report and back.events.length_array().tolist() == lengths
    old = msgpack.packb([wire.PROTOCOL_VERSION, 1, "w", 3, [columns.ops, columns.keys]], use_bin_type=True)
    assert decode(old).events.length_array().tolist() == [0] * len(events)
    assert decode(old).events == IndexEventColumns(columns.ops, columns.keys)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(events), max_size=len(events))), dtype=bool)
    picked = columns.select(mask)
    assert picked.as_events("w") == tuple(e for e, m in zip(events, mask) if m)
    assert picked.length_array().tolist() == [n for n, m in zip(lengths, mask) if m]
    cut = data.draw(st.integers(0, len(events)))
    head, tail = columns.slice(0, cut), columns.slice(cut, len(events))
    assert IndexEventColumns.concat([head, tail]) == columns
    # A part without lengths makes the whole unknown (never a wrong length).
    unknown = IndexEventColumns.concat([head, IndexEventColumns(tail.ops, tail.keys)])
    assert unknown.as_events("w") == columns.as_events("w")
    assert unknown.lengths == b"" or len(tail) == 0
    with pytest.raises(ValueError):
        IndexEventColumns.from_events(events, [*lengths, 1])


def test_event_columns_from_events_check_what_the_constructor_checks():
    """from_events packs without numpy and without the constructor's second pass: it builds what
    the validating constructor builds, and refuses a key or a length out of range as it does."""
    events = (PrefixCached.trusted("w", 5, Tier.VRAM), PrefixEvicted("w", (1 << 63) - 1))
    columns = IndexEventColumns.from_events(events, [64, 2**32 - 1])
    assert columns == IndexEventColumns(columns.ops, columns.keys, columns.lengths)
    assert columns.key_array().tolist() == [5, (1 << 63) - 1] and columns.length_array().tolist() == [64, 2**32 - 1]
    with pytest.raises(ValueError, match="prefix key"):
        IndexEventColumns.from_events([PrefixCached.trusted("w", 1 << 63, Tier.VRAM)])
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="lengths"):
            IndexEventColumns.from_events(events, [64, bad])
    assert len(IndexEventColumns.from_events([], [])) == 0


def test_tokens_are_packed_as_uint32_le():
    message = RequestForwarded("r", "edge-us", "us", (1, 2**32 - 1), {}, False, 0)
    raw = msgpack.unpackb(encode(message))
    assert raw[5] == b"\x01\x00\x00\x00\xff\xff\xff\xff"


# ---- validation on construction ------------------------------------------------------------


def test_events_of_another_worker_are_refused():
    with pytest.raises(WireError, match="not the report's worker"):
        PrefixEventsReported("us-0", 0, (PrefixCached("us-1", 5, Tier.VRAM),))
    with pytest.raises(WireError, match=r"events\[0\]: expected PrefixCached"):
        PrefixEventsReported("us-0", 0, ((0, 5, 1),))


def test_a_bad_pair_is_named_by_its_place_in_the_sequence():
    with pytest.raises(WireError, match=r"UpdateBatchPublished\.tables\[1\]\[1\]: expected bytes"):
        UpdateBatchPublished(0, 0, 0, ((0, b"ok"), (1, "not bytes")))
    with pytest.raises(WireError, match=r"QueueVectorBroadcast\.vector\[0\]\[0\]: must not be empty"):
        wire.QueueVectorBroadcast("us", "eu", 1.0, (("", 1.0),))
    with pytest.raises(WireError, match=r"QueueVectorBroadcast\.vector\[1\]\[1\]: .* not a finite number"):
        wire.QueueVectorBroadcast("us", "eu", 1.0, (("us-0", 1.0), ("us-1", math.inf)))


def test_one_vector_to_each_region_equals_one_broadcast_built_per_region():
    vector = (("us-0", 3.0), ("us-1", 0))
    fanned = wire.QueueVectorBroadcast.to_each("us", ["eu", "ap"], 2.5, vector)
    assert fanned == tuple(wire.QueueVectorBroadcast("us", r, 2.5, vector) for r in ("eu", "ap"))
    assert fanned[1].vector == (("us-0", 3.0), ("us-1", 0.0)) and type(fanned[1].vector[1][1]) is float
    assert wire.QueueVectorBroadcast.to_each("us", [], 2.5, vector) == ()
    with pytest.raises(WireError, match=r"to_region: must not be empty"):
        wire.QueueVectorBroadcast.to_each("us", ["eu", ""], 2.5, vector)
    with pytest.raises(WireError, match=r"vector\[0\]\[1\]"):
        wire.QueueVectorBroadcast.to_each("us", ["eu", "ap"], 2.5, (("us-0", -1.0),))


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: WorkerRegistered("", 0), "must not be empty"),
        (lambda: WorkerRegistered("w", -1), "outside"),
        (lambda: WorkerRegistered("w", True), "an integer"),
        (lambda: RequestForwarded("r", "e", "us", (2**32,), {}, False, 0), "token id"),
        (lambda: RequestForwarded("r", "e", "us", (), {1: 2}, False, 0), "string"),
        (lambda: RequestForwarded("r", "e", "us", (), {"a": object()}, False, 0), "null, bool"),
        (lambda: UpdateBatchPublished(0, 0, 0, ((0, "not bytes"),)), "bytes"),
        (lambda: wire.QueueVectorBroadcast("us", "eu", math.nan, ()), "finite"),
        (lambda: wire.MigrationRequested("r", (), "a", "b", "teleport"), "one of"),
        (lambda: wire.PrefillDecodeForwarded("r", "e", "us", (1,), {}, True, 0, "us-d", 2**63), "outside"),
        (lambda: wire.PrefillDecodeForwarded("r", "e", "us", (1,), {}, True, 0, "", 1), "must not be empty"),
        (lambda: wire.ShardPositionAnnounced(0, 1, -1, ""), "seq: -1 outside"),
        (lambda: wire.ShardPositionAnnounced(65536, 1, 0, ""), "shard: 65536 outside"),
        (lambda: wire.ShardPositionAnnounced(0, 2**64, 0, ""), "epoch"),
        (lambda: wire.ShardPositionAnnounced(0, 1, 0, "r" * 129), "longer than"),
        (lambda: wire.ShardPositionAnnounced(0, 1, 0, None), "a string"),
    ],
)
def test_invalid_messages_are_refused_on_construction(build, fragment):
    with pytest.raises(WireError, match=fragment):
        build()


# ---- malformed input -----------------------------------------------------------------------


V = wire.PROTOCOL_VERSION


def packed(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"", "empty"),
        (b"\xc1", "not valid msgpack"),
        (packed(1), "expected \\[version"),
        (msgpack.packb({"a": 1}), "expected \\[version"),
        (packed(V + 1, 3, "w", 0), "unsupported protocol version"),
        (packed(1, 3, "w", 0), "unsupported protocol version"),  # version 1 sent events as triples
        (packed(V, 999), "unknown message tag"),
        (packed(V, 3, "w"), "expected 2 fields"),
        (packed(V, 3, "w", 0, "extra"), "expected 2 fields"),
        (packed(V, 3, 5, 0), "WorkerRegistered.worker: expected a string"),
        (packed(V, 3, "w", 0) + b"\x00", "trailing bytes"),
        (packed(V, 1, "w", 0, [[0, 1, 1]]), "as byte strings"),
        (packed(V, 1, "w", 0, [b"\x00", b"\x00" * 8, b"", b""]), "as byte strings"),
        (packed(V, 1, "w", 0, [b"\x00", b"\x00" * 8, b"\x01\x00"]), "length bytes"),
        (packed(V, 1, "w", 0, [b"\x05", b"\x00" * 8]), "unknown op 5"),
        (packed(V, 1, "w", 0, [b"\x00\x04", b"\x00" * 8]), "need 16 key bytes"),
        (packed(V, 1, "w", 0, [b"\x00\x04", b"\x00" * 8 + b"\xff" * 8]), "event 1: prefix key"),
        (packed(V, 30, "r", "e", "us", b"\x00\x00\x00", {}, False, 0), "multiple of 4"),
        (packed(V, 2, "w" * 600), "exceeds its bound|longer than"),
        (packed(V, 3, "w", 0)[:-1], "not valid msgpack"),
        (packed(V, 0, b"not zlib"), "not valid zlib"),
        (packed(V, 0, "text"), "zlib bytes"),
        (packed(V, 0, zlib.compress(packed(V, 3, "w", 0)), b"extra"), "zlib bytes"),
        (packed(V, 0, zlib.compress(packed(V, 3, "w", 0))[:-3]), "truncated"),
        (packed(V, 0, zlib.compress(packed(V, 3, "w", 0)) + b"x"), "trailing"),
        (packed(V, 0, zlib.compress(packed(V, 0, zlib.compress(packed(V, 3, "w", 0))))), "another compressed"),
        (packed(V, 0, zlib.compress(bytes(wire.MAX_FRAME_BYTES + 1))), "inflates beyond"),
        (packed(V, 0, zlib.compress(packed(V, 2, "w" * 600))), "exceeds its bound|longer than"),
    ],
)
def test_malformed_input_raises_wire_error(data, fragment):
    with pytest.raises(WireError, match=fragment):
        decode(data)


def test_a_node_older_than_position_announcements_refuses_one_as_an_unknown_tag(monkeypatch):
    """What an edge built before ShardPositionAnnounced does with one: a WireError for an unknown
    tag, which its transport answers with ErrorReported("malformed") while the connection carries
    on (tests/test_transport.py, malformed frames): log lines, no dropped connection. Hence
    README's upgrade note (edges before units, or position_heartbeat_ms = 0 meanwhile)."""
    data = encode(wire.ShardPositionAnnounced(3, 7, 42, "eu"))
    assert decode(data) == wire.ShardPositionAnnounced(3, 7, 42, "eu")
    older = {tag: spec for tag, spec in MESSAGE_SPECS.items() if spec.cls is not wire.ShardPositionAnnounced}
    monkeypatch.setattr(wire, "MESSAGE_SPECS", older)
    with pytest.raises(WireError, match="unknown message tag 17"):
        decode(data)


def test_oversize_input_is_refused_before_parsing():
    with pytest.raises(WireError, match="exceeds"):
        decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))


def test_encode_refuses_oversize_message():
    huge = ErrorReported("malformed", "x" * 4000)
    assert decode(encode(huge)) == huge
    big = wire.ResponseChunked("r", (), "\u20ac" * (3 * wire.MiB), False)  # 9 MiB of UTF-8
    with pytest.raises(WireError, match="over its bound"):
        encode(big)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzzed_bytes_raise_only_wire_error(data):
    try:
        decode(data)
    except WireError:
        pass


@FUZZ
@given(any_message, st.data())
def test_mutated_encodings_raise_only_wire_error(message, data):
    encoded = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    try:
        decoded = decode(bytes(encoded[:cut]))
    except WireError:
        return
    assert type(decoded) in SENDER_ROLES


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6) | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_SPECS)), st.lists(msgpack_values, max_size=9))
def test_well_framed_garbage_fields_raise_only_wire_error(tag, fields):
    try:
        decode(packed(wire.PROTOCOL_VERSION, tag, *fields))
    except WireError:
        pass


# ---- sender roles --------------------------------------------------------------------------


def test_check_sender_enforces_roles():
    batch = UpdateBatchPublished(0, 1, 1, ())
    check_sender(Role.MAINTENANCE, batch)
    check_sender("edge", batch)  # relayed inside a region (the edge checks who may)
    with pytest.raises(WireForbidden, match="agent node may not send UpdateBatchPublished"):
        check_sender("agent", batch)
    with pytest.raises(WireForbidden):
        check_sender(Role.EDGE, WorkerRegistered("us-0", 1))
    for role in Role:
        check_sender(role, ErrorReported("malformed", ""))


def test_a_pinned_share_is_a_number_within_zero_and_one_that_only_an_agent_sends():
    assert decode(encode(wire.WorkerPinnedReported("us-0", 0.25))).share == 0.25
    for share in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(wire.MessageError):
            wire.WorkerPinnedReported("us-0", share)
    check_sender(Role.AGENT, wire.WorkerPinnedReported("us-0", 0.25))
    for role in (Role.EDGE, Role.MAINTENANCE):
        with pytest.raises(WireForbidden):
            check_sender(role, wire.WorkerPinnedReported("us-0", 0.25))


def test_room_steps_that_go_back_are_refused():
    assert decode(encode(wire.WorkerRoomReported("us-0", ((0.0, 10), (5.0, 90))))).steps == ((0.0, 10), (5.0, 90))
    for steps in (((0.0, 90), (5.0, 10)), ((5.0, 10), (1.0, 90))):
        with pytest.raises(wire.MessageError, match="non-decreasing"):
            wire.WorkerRoomReported("us-0", steps)
        with pytest.raises(wire.MessageError, match="non-decreasing"):
            wire.RoomVectorBroadcast("us", "eu", 1.0, (("us-0", steps),))


def test_one_rooms_table_to_each_region_equals_one_room_broadcast_built_per_region():
    rooms = (("us-0", ((0.0, 4_000), (700, 98_304))), ("us-1", ()))
    fanned = wire.RoomVectorBroadcast.to_each("us", ["eu", "ap"], 2.5, rooms)
    assert fanned == tuple(wire.RoomVectorBroadcast("us", r, 2.5, rooms) for r in ("eu", "ap"))
    assert fanned[1].rooms[0][1][1] == (700.0, 98_304) and type(fanned[1].rooms[0][1][1][0]) is float
    assert wire.RoomVectorBroadcast.to_each("us", [], 2.5, rooms) == ()
    with pytest.raises(WireError, match=r"to_region: must not be empty"):
        wire.RoomVectorBroadcast.to_each("us", ["eu", ""], 2.5, rooms)
    with pytest.raises(WireError, match=r"non-decreasing"):
        wire.RoomVectorBroadcast.to_each("us", ["eu", "ap"], 2.5, (("us-0", ((5.0, 1), (1.0, 2))),))


_ODD_VALUES = (-2, -1, 65536, 2**63, 2**64, 2**64 + 1, True, False, 1.0, None, "1", b"1", bytearray(b"1"),
               memoryview(b"1"), [1, b"x"], (1,), (1, b"x", 2), [])
_GOOD_BATCH = (7, 2**64 - 1, 2**63 - 1, ((0, b""), (65535, b"\x00\x01")))


def _spoiled_batches():
    """A batch's fields as a shard builds them, then with each field, each pair, and each half
    of a pair replaced in turn by each of ``_ODD_VALUES``."""
    yield _GOOD_BATCH
    shard, epoch, seq, tables = _GOOD_BATCH
    yield shard, epoch, seq, list(tables)
    yield 0, 0, 0, ()
    for odd in _ODD_VALUES:
        yield odd, epoch, seq, tables
        yield shard, odd, seq, tables
        yield shard, epoch, odd, tables
        yield shard, epoch, seq, odd
        yield shard, epoch, seq, (odd, *tables[1:])
        yield shard, epoch, seq, ((odd, b"x"),)
        yield shard, epoch, seq, ((1, odd),)


def _same_outcome(fields: tuple) -> None:
    try:
        expected = UpdateBatchPublished(*fields)
    except wire.MessageError as exc:
        with pytest.raises(wire.MessageError, match=re.escape(str(exc))):
            UpdateBatchPublished.of_shard(*fields)
        return
    built = UpdateBatchPublished.of_shard(*fields)
    assert built == expected and type(built.tables) is tuple
    assert all(type(pair) is tuple and type(pair[1]) is bytes for pair in built.tables)
    assert decode(encode(built)) == expected


def test_a_shard_built_batch_equals_the_validated_one() -> None:
    """``UpdateBatchPublished.of_shard`` (the maintenance shard's fast path) builds exactly what
    the validating constructor builds, and refuses exactly what it refuses, with its message:
    a good batch, and each of its fields, pairs and halves of a pair spoiled in turn."""
    for fields in _spoiled_batches():
        _same_outcome(fields)


@SETTINGS
@given(st.integers(0, 65535), st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1),
       st.lists(st.tuples(st.integers(0, 65535), st.binary(max_size=8)), max_size=5).map(tuple))
def test_any_shard_built_batch_equals_the_validated_one(shard, epoch, seq, tables) -> None:
    _same_outcome((shard, epoch, seq, tables))


def test_a_shard_batch_past_a_frame_is_refused_as_before() -> None:
    """A blob over the frame bound (a table's snapshot after a rebuild can be) is refused by the
    fast path too, naming the field, as the constructor does."""
    big = bytes(wire.MAX_FRAME_BYTES + 1)
    with pytest.raises(wire.MessageError, match=r"tables\[0\]\[1\]: .* bytes exceeds"):
        UpdateBatchPublished.of_shard(1, 1, 1, ((0, big),))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 255), st.sampled_from([0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1])
                          | st.integers(0, (1 << 64) - 1)), min_size=1, max_size=20))
def test_index_event_columns_refuse_exactly_the_unknown_ops_and_keys_past_2_63(events):
    """The columns' checks read the bytes (an op's byte, a key's little-endian top byte); they
    refuse exactly what the numpy comparisons they replaced refused."""
    ops = bytes(op for op, _ in events)
    keys = np.array([key for _, key in events], dtype="<u8").tobytes()
    bad_ops = [i for i, (op, _) in enumerate(events) if op > EventOp.EVICTED]
    bad_keys = [i for i, (_, key) in enumerate(events) if key > MAX_KEY]
    try:
        IndexEventColumns(ops, keys, b"")
    except ValueError as exc:
        if bad_ops:  # the ops are checked first
            assert str(exc).startswith(f"event {bad_ops[0]}: unknown op"), exc
        else:
            assert bad_keys and str(exc).startswith(f"event {bad_keys[0]}: prefix key"), exc
    else:
        assert not bad_ops and not bad_keys


def _slow(pairs: wire.Pairs) -> wire.Pairs:
    """The same field checked item by item (no one-pass test of the usual value)."""
    from kvcompassd.core import messages

    slow = messages.Pairs(pairs.first, pairs.second, pairs.max_items, unique_first=pairs.unique_first)
    slow._exact = None
    return slow



def _pairs_fields():
    from kvcompassd.core import messages

    return (messages.QUEUE_VECTOR, messages.ROOM_STEPS, messages.Pairs(messages.Int(0, 65535), messages.Int(1, 9), 4,
                                                                        unique_first=True),
            messages.Pairs(messages.Float(), messages.Text(3, allow_empty=True), 5),
            messages.Pairs(messages.Choice("a", "b"), messages.MILLIS, 5))


_ATOMS = st.one_of(st.integers(-3, 70_000), st.sampled_from([2**63, -(2**63), 1e9, 1e9 + 1, True, False, None, "", "a",
                                                               "b", "abcd", "x" * 300, b"x", 0.0, -0.0, 3.5]),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4))
_ITEMS = st.one_of(st.lists(_ATOMS, min_size=2, max_size=2), st.tuples(_ATOMS, _ATOMS), st.lists(_ATOMS, max_size=3), _ATOMS)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(5)), st.one_of(st.lists(_ITEMS, max_size=7), st.tuples(_ITEMS, _ITEMS), _ATOMS))
def test_a_pairs_fields_one_pass_test_answers_as_the_item_by_item_check(which, value):
    """Pairs take decoded values valid as they are in one pass: every answer (value, type of each
    part, or the error's message) is the item-by-item check's."""
    pairs = _pairs_fields()[which]

    def answer(field):
        try:
            out = field.check(value, "f")
        except wire.MessageError as exc:
            return "error", str(exc)
        return "ok", repr(out), [(type(a), type(b)) for a, b in out]

    assert answer(pairs) == answer(_slow(pairs))


@pytest.mark.parametrize("tag", sorted(MESSAGE_SPECS), ids=lambda t: MESSAGE_SPECS[t].cls.__name__)
def test_a_decoded_message_is_what_its_class_makes_of_the_decoded_fields(tag):
    """decode fills a message in with what each field's from_wire returned and runs only the
    cross-field checks: the class's own field checks, run on those values, change nothing."""
    spec = MESSAGE_SPECS[tag]

    @SETTINGS
    @given(message_strategy(spec))
    def same(message):
        decoded = decode(encode(message))
        assert type(decoded) is spec.cls
        built = spec.cls(**{name: getattr(decoded, name) for name, _ in spec.fields})
        assert built == decoded and repr(built) == repr(decoded)

    same()


def test_cross_field_checks_still_refuse_what_arrives_on_the_wire():
    steps = msgpack.packb([V, 46, "w", [[5.0, 10], [1.0, 20]]], use_bin_type=True)  # ms decreasing
    with pytest.raises(WireError, match="non-decreasing"):
        decode(steps)
    chunk = next(s for s in MESSAGE_SPECS.values() if s.cls is wire.SnapshotChunkSent)
    fields = {"snapshot_id": 1, "data": b""}
    empty = msgpack.packb([V, chunk.tag, *[fields.get(name, 0) for name, _ in chunk.fields]], use_bin_type=True)
    with pytest.raises(WireError, match="SnapshotChunkSent.data: must not be empty"):
        decode(empty)
