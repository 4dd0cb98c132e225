"""Snapshots of any size (kvcompassd.core.snapshots) and the sync protocol's transfers
(kvcompassd.core.sync): chunking and reassembly, bounds, resume and restart, batches held while
the chunks travel, and any mix of chunk loss, duplication and reordering."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clusters import make_cluster
from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.snapshots import SnapshotAssembly, SnapshotChunker, SnapshotRefused, SnapshotSource
from kvcompassd.core.sync import EdgeSync, SyncSettings, catch_up
from kvcompassd.wire import (
    MAX_FRAME_BYTES,
    MAX_SNAPSHOT_CHUNK_BYTES,
    ResyncRequested,
    Role,
    ShardPositionAnnounced,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotResumeRequested,
    SnapshotTransferStarted,
    UpdateBatchPublished,
    UpdatesSubscribed,
    WireError,
    WireForbidden,
    check_sender,
    decode,
    encode,
    max_bytes_of,
)

TIMEOUT = 1.0
EPOCH = 7
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layout():
    return IndexLayout.from_config(make_cluster({"a": 2, "b": 3}, shards=1))


def _shard(layout, *, epoch=EPOCH, keys=600, seed=0, **kw) -> MaintenanceShard:
    shard = MaintenanceShard(layout, 0, 1, epoch=epoch, initial_capacity=64, **kw)
    rng = np.random.default_rng(seed)
    for worker in ("a-0", "b-1"):  # both region groups hold entries
        held = np.unique(rng.integers(1, 1 << 62, keys, dtype=np.uint64))
        shard.apply_columns(worker, IndexEventColumns.from_events([PrefixCached(worker, int(k), Tier.VRAM)
                                                                   for k in held]))
    shard.flush()
    return shard


def _sync(layout, **kw) -> EdgeSync:
    return EdgeSync(EdgeIndexView(layout, 1, edge="edge-a"),
                    SyncSettings(resync_timeout_s=TIMEOUT, max_resync_timeout_s=4 * TIMEOUT, **kw))


def _publish(shard, key, worker="a-1"):
    shard.apply([PrefixCached(worker, key, Tier.VRAM)])
    return shard.flush()


def _equal(sync, shard) -> bool:
    """The edge's view is the shard's state: same position, byte-identical tables."""
    return sync.view.position(0) == (shard.epoch, shard.seq) and sync.view.digests(0) == shard.digests()


def _transfer(shard, chunk_bytes=1024, snapshot_id=11):
    chunker = SnapshotChunker(shard.snapshot(), snapshot_id=snapshot_id, chunk_bytes=chunk_bytes)
    return chunker, [chunker.header, *chunker.chunks_from(0)]


# -- chunker and assembly -----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(chunk_bytes=st.integers(1, 5000), keys=st.integers(0, 400))
def test_chunks_reassemble_to_the_exact_snapshot_for_any_chunk_size(chunk_bytes, keys):
    shard = _shard(_layout(), keys=keys)
    chunker, messages = _transfer(shard, chunk_bytes)
    header = chunker.header
    assert header.entries == shard.entries() and header.chunks == len(messages) - 1
    assembly = SnapshotAssembly(header, max_entries=1 << 30, max_bytes=1 << 30)
    for chunk in messages[1:]:
        assert 0 < len(chunk.data) <= chunk_bytes and chunk.crc32 == zlib.crc32(chunk.data)
        assert assembly.add(chunk).kind == "added"
    assert assembly.complete and assembly.snapshot() == shard.snapshot()


def test_a_snapshot_larger_than_a_frame_travels_in_chunks_within_their_bound():
    # Slots, not entries, size a snapshot: a table sized for 4 M entries exports ~18 MB.
    shard = MaintenanceShard(_layout(), 0, 1, epoch=EPOCH, initial_capacity=4_000_000)
    _publish(shard, 12345)
    whole = shard.snapshot()
    assert sum(len(b) for _, b in whole.tables) > MAX_FRAME_BYTES
    with pytest.raises(WireError, match="over its bound"):
        encode(whole)
    chunker = SnapshotChunker(whole, snapshot_id=5, chunk_bytes=MAX_SNAPSHOT_CHUNK_BYTES)
    sync = _sync(_layout())
    assert sync.on_snapshot_message(decode(encode(chunker.header)), now=0.0).applied
    for chunk in chunker.chunks_from(0):
        body = encode(chunk)
        assert len(body) <= max_bytes_of(SnapshotChunkSent)
        step = sync.on_snapshot_message(decode(body), now=0.0)
        assert step.applied, step.reason
    assert _equal(sync, shard) and sync.followers[0].snapshots_installed == 1


def test_chunk_outcomes_duplicate_gap_corrupt_foreign():
    shard = _shard(_layout())
    chunker, messages = _transfer(shard, 700)
    assembly = SnapshotAssembly(chunker.header, max_entries=1 << 30, max_bytes=1 << 30)
    first, second, third = messages[1:4]
    assert assembly.add(first).kind == "added"
    assert assembly.add(first).kind == "duplicate"
    assert assembly.add(third).kind == "gap" and assembly.next_chunk == 1
    flipped = dataclasses.replace(second, data=bytes([second.data[0] ^ 1]) + second.data[1:])
    assert assembly.add(flipped).kind == "corrupt"
    short = SnapshotChunkSent(0, second.snapshot_id, 1, zlib.crc32(second.data[:-1]), second.data[:-1])
    assert "header says" in assembly.add(short).reason
    beyond = dataclasses.replace(second, index=chunker.chunks)
    assert assembly.add(beyond).kind == "corrupt"
    assert assembly.add(dataclasses.replace(second, snapshot_id=99)).kind == "foreign"
    assert assembly.add(second).kind == "added" and assembly.received_bytes == 1400


def test_a_header_over_the_bounds_is_refused_before_anything_is_buffered():
    header = _transfer(_shard(_layout()))[0].header
    with pytest.raises(SnapshotRefused, match="max_snapshot_entries"):
        SnapshotAssembly(header, max_entries=header.entries - 1, max_bytes=1 << 30)
    with pytest.raises(SnapshotRefused, match="max_snapshot_bytes"):
        SnapshotAssembly(header, max_entries=1 << 30, max_bytes=header.total_bytes - 1)


def test_snapshot_source_takes_one_snapshot_per_position_and_keeps_the_last_two():
    shard = _shard(_layout())
    ids = iter(range(1, 100))
    source = SnapshotSource(shard, new_id=lambda: next(ids), chunk_bytes=900)
    first = source.latest()
    assert source.latest() is first and source.taken == 1
    _publish(shard, 1 << 40)
    second = source.latest()
    _publish(shard, 1 << 41)
    third = source.latest()
    assert source.taken == 3 and (third.header.epoch, third.header.seq) == (shard.epoch, shard.seq)
    assert source.get(first.snapshot_id) is None and source.get(second.snapshot_id) is second
    assert source.kept_bytes == second.header.total_bytes + third.header.total_bytes
    # A catch-up that needs a snapshot takes it through the source.
    answer = catch_up(shard, 0, 0, take_snapshot=lambda: source.latest().snapshot)
    assert answer.snapshot is third.snapshot and source.taken == 3
    source.release()  # nothing kept: a resume gets a new snapshot, taken afresh
    assert source.get(third.snapshot_id) is None and source.kept_bytes == 0
    assert source.latest() is not third and source.taken == 4


# -- the sync protocol's transfers ---------------------------------------------------------------


def test_batches_published_during_a_transfer_are_held_and_applied_after_the_last_chunk():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout)
    assert sync.subscription(0, now=0.0) == UpdatesSubscribed("edge-a", 0, 0, -1)
    chunker, messages = _transfer(shard, 600)
    assert sync.on_snapshot_message(messages[0], now=0.0).applied
    live = [_publish(shard, (1 << 50) + k) for k in range(3)]
    for i, chunk in enumerate(messages[1:]):
        if i < len(live):
            step = sync.on_batch(live[i], now=0.1)
            assert not step.applied and step.send is None and "held" in step.reason
        step = sync.on_snapshot_message(chunk, now=0.1)
        assert step.applied and step.send is None, step.reason
    assert _equal(sync, shard)
    follower = sync.followers[0]
    assert follower.batches_held == 3 and follower.deadline is None and follower.outstanding is None


def test_a_chunk_gap_asks_to_resume_once_and_the_resumed_chunks_complete_the_transfer():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout)
    sync.subscription(0, now=0.0)
    chunker, messages = _transfer(shard, 500)
    sync.on_snapshot_message(messages[0], now=0.0)
    sync.on_snapshot_message(messages[1], now=0.0)
    step = sync.on_snapshot_message(messages[3], now=0.0)  # chunk 1 lost
    assert step.send == SnapshotResumeRequested("edge-a", 0, chunker.snapshot_id, 1)
    assert sync.on_snapshot_message(messages[4], now=0.0).send is None  # asked already
    for message in [messages[0], *messages[2:]]:  # the unit's answer: the header again, then chunk 1 on
        sync.on_snapshot_message(message, now=0.1)
    assert _equal(sync, shard)


def test_a_stalled_transfer_asks_to_resume_on_its_timer_and_on_resubscription():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout)
    sync.subscription(0, now=0.0)
    chunker, messages = _transfer(shard, 500)
    for message in messages[:3]:
        sync.on_snapshot_message(message, now=0.5)
    # Progress moved the deadline on: no request before one timeout after the last chunk.
    assert sync.on_timer(now=1.2) == []
    assert sync.on_timer(now=1.6) == [SnapshotResumeRequested("edge-a", 0, chunker.snapshot_id, 2)]
    # The connection came back: the subscription is the resume request.
    assert sync.subscription(0, now=2.0) == SnapshotResumeRequested("edge-a", 0, chunker.snapshot_id, 2)


def test_a_corrupt_chunk_abandons_the_transfer_keeps_the_current_view_and_the_timer_asks_again():
    layout = _layout()
    old = _shard(layout, epoch=3, seed=9)
    shard = _shard(layout)
    sync = _sync(layout)
    assert sync.on_snapshot(old.snapshot(), now=0.0).applied
    before = sync.view.digests(0)
    # A new epoch: the edge asks for a snapshot.
    step = sync.on_batch(_publish(shard, 1 << 45), now=0.0)
    assert step.send == ResyncRequested("edge-a", 0, 3, 0)
    chunker, messages = _transfer(shard, 500)
    sync.on_snapshot_message(messages[0], now=0.1)
    bad = dataclasses.replace(messages[1], crc32=messages[1].crc32 ^ 1)
    step = sync.on_snapshot_message(bad, now=0.1)
    assert not step.applied and "CRC" in step.reason and sync.followers[0].transfer is None
    assert sync.view.position(0) == (3, old.seq) and sync.view.digests(0) == before
    # Later chunks of the abandoned transfer change nothing.
    assert "no transfer" in sync.on_snapshot_message(messages[2], now=0.1).reason
    [again] = sync.on_timer(now=5.0)
    assert again == ResyncRequested("edge-a", 0, 3, 0)
    for message in _transfer(shard, 500, snapshot_id=12)[1]:
        sync.on_snapshot_message(message, now=5.1)
    assert _equal(sync, shard)


def test_a_transfer_over_the_edges_bounds_is_refused_and_the_view_kept():
    layout = _layout()
    old = _shard(layout, epoch=3)
    shard = _shard(layout, keys=900)
    sync = _sync(layout, max_snapshot_entries=old.entries())
    sync.on_snapshot(old.snapshot(), now=0.0)
    header = _transfer(shard)[0].header
    step = sync.on_snapshot_message(header, now=0.0)
    assert not step.applied and "max_snapshot_entries" in step.reason
    assert sync.followers[0].transfer is None and sync.view.position(0) == (3, old.seq)
    # Without state the edge still needs one: the refusal keeps its request outstanding.
    fresh = _sync(layout, max_snapshot_bytes=header.total_bytes - 1)
    fresh.subscription(0, now=0.0)
    assert not fresh.on_snapshot_message(header, now=0.0).applied
    assert fresh.followers[0].outstanding is not None and fresh.on_timer(now=10.0)


def test_batches_beyond_the_hold_bound_are_replayed_after_the_snapshot():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout, max_buffered_bytes=0)
    sync.subscription(0, now=0.0)
    chunker, messages = _transfer(shard, 5000)
    sync.on_snapshot_message(messages[0], now=0.0)
    live = _publish(shard, 1 << 52)
    step = sync.on_batch(live, now=0.0)
    assert "not held" in step.reason and sync.followers[0].batches_dropped == 1
    for chunk in messages[1:]:
        sync.on_snapshot_message(chunk, now=0.0)
    assert sync.view.position(0) == (EPOCH, live.seq - 1)
    # The dropped batch raised the target: the timer asks for it from the snapshot's position.
    [request] = sync.on_timer(now=10.0)
    assert request == ResyncRequested("edge-a", 0, EPOCH, live.seq)
    for batch in catch_up(shard, request.epoch, request.from_seq).messages:
        sync.on_batch(batch, now=10.1)
    assert _equal(sync, shard)


def test_the_last_header_wins_and_a_stale_one_is_ignored():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout)
    first, first_messages = _transfer(shard, 500, snapshot_id=1)
    _publish(shard, 1 << 44)
    second, second_messages = _transfer(shard, 500, snapshot_id=2)
    sync.on_snapshot_message(second_messages[0], now=0.0)
    # The sender answered a resume with the snapshot it still has, an older one: that is the transfer now.
    assert sync.on_snapshot_message(first_messages[0], now=0.0).applied
    assert not sync.on_snapshot_message(second_messages[1], now=0.0).applied  # the replaced one's chunks
    assert sync.followers[0].transfer.snapshot_id == 1
    sync.on_snapshot_message(second_messages[0], now=0.0)
    for message in second_messages[1:]:
        sync.on_snapshot_message(message, now=0.0)
    assert _equal(sync, shard)
    assert "stale" in sync.on_snapshot_message(first_messages[0], now=0.0).reason


# -- any loss, duplication and reordering ---------------------------------------------------------


class _Unit:
    """The maintenance side as the daemon drives it: catch-ups through a SnapshotSource; a
    transfer's header goes out at once and its chunks one by one (``pump``), while live batches
    join the same channel in between; a new transfer to the edge replaces the one in progress."""

    def __init__(self, shard: MaintenanceShard, chunk_bytes: int):
        self.shard = shard
        self.chunk_bytes = chunk_bytes
        self.ids = iter(range(1, 1 << 30))
        self.source = self._source()
        self.net: list = []
        self.outbox: list = []  # the chunks of the transfer in progress, not sent yet
        self.resumed = 0

    def pump(self) -> None:
        if self.outbox:
            self.net.append(self.outbox.pop(0))

    def _source(self) -> SnapshotSource:
        return SnapshotSource(self.shard, new_id=lambda: next(self.ids), chunk_bytes=self.chunk_bytes)

    def forget(self) -> None:
        self.source = self._source()  # as if the unit had dropped every snapshot it kept

    def receive(self, request) -> None:
        if isinstance(request, SnapshotResumeRequested):
            kept = self.source.get(request.snapshot_id)
            if kept is not None:
                self.resumed += 1
                self.net.append(kept.header)
                self.outbox = list(kept.chunks_from(request.from_chunk))
                return
            epoch, from_seq = 0, 0
        elif isinstance(request, UpdatesSubscribed):
            epoch, from_seq = request.epoch, request.seq + 1
        else:
            epoch, from_seq = request.epoch, request.from_seq
        answer = catch_up(self.shard, epoch, from_seq, take_snapshot=lambda: self.source.latest().snapshot)
        if answer.published is not None:
            self.net.append(answer.published)
        if answer.snapshot is None:
            self.net += answer.replay
        else:
            chunker = self.source.latest()
            self.net.append(chunker.header)
            self.outbox = list(chunker.chunks_from(0))


@PROPERTY
@given(script=st.lists(st.sampled_from(["deliver"] * 5 + ["pump"] * 5 + ["drop", "dup", "swap", "publish", "tick",
                                                                         "forget", "resubscribe", "announce"]),
                       max_size=200),
       chunk_bytes=st.integers(200, 1500), had_view=st.booleans(), hold=st.sampled_from([0, 1 << 20]),
       heal_by_heartbeat=st.booleans())
def test_any_chunk_loss_duplication_or_reordering_ends_in_the_exact_view(script, chunk_bytes, had_view, hold,
                                                                          heal_by_heartbeat):
    """Whatever happens to the chunks, batches and position announcements, the view only ever
    holds a state the shard had (or the view it started with), and once messages get through it
    equals the shard's: after a later batch, or (``heal_by_heartbeat``) with no batch at all,
    the idle stream's announcements alone."""
    layout = _layout()
    shard = _shard(layout, keys=300)
    states = {shard.seq: shard.digests()}
    unit = _Unit(shard, chunk_bytes)
    sync = _sync(layout, max_buffered_bytes=hold)
    if had_view:  # an earlier life of the unit: the new epoch needs a snapshot
        old = _shard(layout, epoch=3, keys=50, seed=4)
        sync.on_snapshot(old.snapshot(), now=0.0)
        old_state = (sync.view.position(0), sync.view.digests(0))
    now = 0.0
    key = 1 << 55

    def deliver(message) -> None:
        if isinstance(message, UpdateBatchPublished):
            step = sync.on_batch(message, now=now)
        elif isinstance(message, ShardPositionAnnounced):
            step = sync.on_position(message, now=now)
        else:
            step = sync.on_snapshot_message(message, now=now)
        if step.send is not None:
            unit.receive(step.send)
        position = sync.view.position(0)
        if position[0] == EPOCH:
            assert sync.view.digests(0) == states[position[1]], "a view between two states of the shard"
        elif had_view:
            assert (position, sync.view.digests(0)) == old_state, "the view changed without a whole snapshot"

    def publish() -> None:
        nonlocal key
        key += 1
        unit.net.append(_publish(shard, key, worker="b-0"))
        states[shard.seq] = shard.digests()

    def announce() -> None:  # the unit's heartbeat of the idle stream, behind what it sent before
        unit.net.append(ShardPositionAnnounced(0, shard.epoch, shard.seq, ""))

    def tick() -> None:
        nonlocal now
        now += 10 * TIMEOUT
        for request in sync.on_timer(now=now):
            unit.receive(request)

    unit.receive(sync.subscription(0, now=now))
    for action in script:
        net = unit.net
        if action == "deliver" and net:
            deliver(net.pop(0))
        elif action == "pump":
            unit.pump()
        elif action == "drop" and net:
            net.pop(0)
        elif action == "dup" and net:
            net.insert(1, net[0])
        elif action == "swap" and len(net) > 1:
            net[0], net[1] = net[1], net[0]
        elif action == "publish":
            publish()
        elif action == "announce":
            announce()
        elif action == "tick":
            tick()
        elif action == "forget":
            unit.forget()
        elif action == "resubscribe":  # the connection broke: what was in flight is lost
            net.clear()
            unit.outbox = []
            unit.receive(sync.subscription(0, now=now))
    # Heal: everything gets through; a gap shows when a later batch comes (make one), or when the
    # idle stream announces its position.
    for _ in range(60):
        while unit.net or unit.outbox:
            unit.pump()
            deliver(unit.net.pop(0))
        if _equal(sync, shard):
            break
        if heal_by_heartbeat:
            announce()
        else:
            publish()
        tick()
    assert _equal(sync, shard)
    follower = sync.followers[0]
    event(f"transfers started: {min(follower.transfers_started, 3)}")  # --hypothesis-show-statistics
    event(f"resumed: {unit.resumed > 0}, batches held: {follower.batches_held > 0}, "
          f"dropped: {follower.batches_dropped > 0}")


# -- wire ---------------------------------------------------------------------------------------


def test_a_transfer_round_trips_on_the_wire():
    chunker, messages = _transfer(_shard(_layout()), 800)
    for message in messages:
        assert decode(encode(message)) == message
    request = SnapshotResumeRequested("edge-a", 0, chunker.snapshot_id, 3)
    assert decode(encode(request)) == request
    biggest = SnapshotChunkSent(0, 1, 0, zlib.crc32(bytes(MAX_SNAPSHOT_CHUNK_BYTES)), bytes(MAX_SNAPSHOT_CHUNK_BYTES))
    assert decode(encode(biggest)) == biggest


def test_malformed_transfer_messages_are_refused():
    header = _transfer(_shard(_layout()))[0].header
    with pytest.raises(WireError, match="add up to"):
        dataclasses.replace(header, total_bytes=header.total_bytes + 1)
    with pytest.raises(WireError, match="make"):
        dataclasses.replace(header, chunks=header.chunks + 1)
    with pytest.raises(WireError, match="exceeds"):
        SnapshotChunkSent(0, 1, 0, 0, bytes(MAX_SNAPSHOT_CHUNK_BYTES + 1))
    with pytest.raises(WireError, match="must not be empty"):
        SnapshotChunkSent(0, 1, 0, 0, b"")
    with pytest.raises(WireError):
        SnapshotResumeRequested("edge-a", 0, 0, 0)  # snapshot ids start at 1
    with pytest.raises(WireError, match="appears twice"):
        dataclasses.replace(header, tables=((0, 10), (0, header.total_bytes - 10)))


def test_only_units_and_edges_send_transfers_and_only_edges_ask_to_resume():
    header = _transfer(_shard(_layout()))[0].header
    chunk = SnapshotChunkSent(0, 1, 0, zlib.crc32(b"x"), b"x")
    for message in (header, chunk):
        check_sender(Role.MAINTENANCE, message)
        check_sender(Role.EDGE, message)
        with pytest.raises(WireForbidden):
            check_sender(Role.AGENT, message)
    check_sender(Role.EDGE, SnapshotResumeRequested("edge-a", 0, 1, 0))
    with pytest.raises(WireForbidden):
        check_sender(Role.MAINTENANCE, SnapshotResumeRequested("edge-a", 0, 1, 0))


def test_a_whole_snapshot_still_installs_and_overtakes_a_transfer_in_progress():
    layout = _layout()
    shard = _shard(layout)
    sync = _sync(layout)
    chunker, messages = _transfer(shard, 500)
    sync.on_snapshot_message(messages[0], now=0.0)
    _publish(shard, 1 << 43)
    whole = ShardSnapshotSent(0, shard.epoch, shard.seq, shard.snapshot().tables)
    assert sync.on_snapshot_message(whole, now=0.0).applied
    assert sync.followers[0].transfer is None and _equal(sync, shard)


@PROPERTY
@given(data=st.data())
def test_forged_headers_and_chunks_never_raise_and_never_change_the_view(data):
    """A sender that breaks the protocol (any header, chunks with any index, bytes and CRC, even
    consistent ones of a garbage image) gets refusals; the edge keeps the view it had."""
    layout = _layout()
    shard = _shard(layout, keys=100)
    sync = _sync(layout, max_snapshot_bytes=1 << 16)
    sync.on_snapshot(shard.snapshot(), now=0.0)
    before = (sync.view.position(0), sync.view.digests(0))
    genuine = _transfer(shard, 512)[0].header
    for _ in range(data.draw(st.integers(1, 30))):
        if data.draw(st.booleans()):
            total = data.draw(st.integers(1, 1 << 17))
            chunk_bytes = data.draw(st.integers(1, 4096))
            half = total // 2
            groups = ((0, half), (1, total - half)) if half and data.draw(st.booleans()) else ((0, total),)
            message = SnapshotTransferStarted(0, data.draw(st.sampled_from([EPOCH, EPOCH + 1, 2**40])),
                                              data.draw(st.integers(0, 50)), data.draw(st.integers(1, 3)),
                                              data.draw(st.integers(0, 10**6)), total, chunk_bytes,
                                              -(-total // chunk_bytes), groups)
        else:
            payload = data.draw(st.binary(min_size=1, max_size=600))
            crc = zlib.crc32(payload) if data.draw(st.booleans()) else data.draw(st.integers(0, 2**32 - 1))
            message = SnapshotChunkSent(0, data.draw(st.integers(1, 3)), data.draw(st.integers(0, 40)), crc, payload)
        step = sync.on_snapshot_message(message, now=0.0)
        assert isinstance(step.reason, str)
        if step.applied and isinstance(message, SnapshotChunkSent) and sync.followers[0].transfer is None:
            raise AssertionError(f"a forged image was installed: {step.reason}")
        assert (sync.view.position(0), sync.view.digests(0)) == before
    # The genuine transfer still installs afterwards.
    _publish(shard, 1 << 47)
    for message in _transfer(shard, 512, snapshot_id=genuine.snapshot_id + 100)[1]:
        sync.on_snapshot_message(message, now=1.0)
    assert _equal(sync, shard)
