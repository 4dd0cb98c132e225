"""The index-sync protocol (kvcompassd.core.sync): one shard's stream from its maintenance unit
to an edge, with a real MaintenanceShard and EdgeIndexView, under loss, duplication, delay,
reordering, restarts and reconnections."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusters import make_cluster
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.sync import EdgeSync, PositionHeartbeats, SyncSettings, catch_up
from kvcompassd.wire import (
    ResyncRequested,
    ShardPositionAnnounced,
    ShardSnapshotSent,
    UpdateBatchPublished,
    UpdatesSubscribed,
)

SHARDS = 2
TIMEOUT = 1.0


def _layout():
    return IndexLayout.from_config(make_cluster({"a": 2, "b": 3}, shards=SHARDS))


def _shard(layout, epoch=7, shard=0, **kw):
    return MaintenanceShard(layout, shard, SHARDS, epoch=epoch, initial_capacity=64, **kw)


def _edge(layout, shards, *, repair=True):
    sync = EdgeSync(EdgeIndexView(layout, SHARDS, edge="edge-a"),
                    SyncSettings(resync_timeout_s=TIMEOUT, max_resync_timeout_s=4 * TIMEOUT, repair=repair))
    for s in shards:
        assert sync.on_snapshot(s.snapshot(), now=0.0).applied
    return sync


def _publish(shard, key, worker="a-1"):
    shard.apply([PrefixCached(worker, key * SHARDS + shard.shard, Tier.VRAM)])
    return shard.flush()


def _converged(sync, shard) -> bool:
    if sync.view.position(shard.shard) != (shard.epoch, shard.seq):
        return False
    for group, (keys, values) in shard.group_items().items():
        if len(keys) and not np.array_equal(sync.view.view(shard.shard, group).lookup_many(keys), values):
            return False
    return True


def test_one_lost_batch_asks_once_however_many_batches_follow():
    """The daemon used to ask again on every batch after a gap (issue 25): three batches after one
    lost batch now send one request, and the replay of it repairs the view."""
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    batches = [_publish(s, k) for k in range(6)]
    assert sync.on_batch(batches[0], now=0.0).applied
    steps = [sync.on_batch(b, now=0.1) for b in batches[2:]]  # batches[1] lost
    sent = [step.send for step in steps if step.send is not None]
    assert sent == [ResyncRequested("edge-a", 0, 7, 2)]
    assert "already asked" in steps[1].reason and sync.gaps == 4 and sync.requests == 1
    answer = catch_up(s, 7, 2)
    assert answer.published is None and answer.snapshot is None and [b.seq for b in answer.messages] == [2, 3, 4, 5, 6]
    for message in answer.messages:
        assert sync.on_batch(message, now=0.2).applied
    assert _converged(sync, s) and sync.followers[0].outstanding is None and sync.next_deadline() is None


def test_stale_and_duplicate_batches_and_snapshots_ask_nothing():
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    old_snapshot = s.snapshot()
    b1, b2 = _publish(s, 1), _publish(s, 2)
    assert sync.on_batch(b1, now=0.0).applied and sync.on_batch(b2, now=0.0).applied
    for step in (sync.on_batch(b1, now=0.0), sync.on_batch(b2, now=0.0), sync.on_snapshot(old_snapshot, now=0.0)):
        assert not step.applied and step.send is None and "stale" in step.reason
    older_epoch = UpdateBatchPublished(0, 6, 99, ())
    assert sync.on_batch(older_epoch, now=0.0).send is None
    assert sync.requests == 0 and sync.gaps == 0


def test_a_new_epoch_or_a_view_without_state_asks_for_a_snapshot():
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    restarted = _shard(layout, epoch=8)
    step = sync.on_batch(_publish(restarted, 3), now=0.0)
    assert step.send == ResyncRequested("edge-a", 0, 7, 0) and "new epoch" in step.reason
    answer = catch_up(restarted, step.send.epoch, step.send.from_seq)
    assert answer.snapshot is not None and answer.messages == (answer.snapshot,)
    assert sync.on_snapshot(answer.snapshot, now=0.1).applied and _converged(sync, restarted)

    fresh = EdgeSync(EdgeIndexView(layout, SHARDS, edge="edge-new"))
    assert fresh.subscription(0, now=0.0) == UpdatesSubscribed("edge-new", 0, 0, -1)
    step = fresh.on_batch(_publish(restarted, 4), now=0.0)
    assert step.send is None and "already asked" in step.reason  # the subscription is the request
    assert fresh.on_snapshot(catch_up(restarted, 0, 0).snapshot, now=0.1).applied
    assert fresh.followers[0].outstanding is None


def test_a_batch_the_view_rejects_asks_for_a_snapshot_and_keeps_the_position():
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    good = _publish(s, 5)
    group, blob = good.tables[0]
    bad = UpdateBatchPublished(good.shard, good.epoch, good.seq, ((group, blob[:-3] + b"xyz"),))
    step = sync.on_batch(bad, now=0.0)
    assert not step.applied and step.send.from_seq == 0 and "rejected" in step.reason
    assert sync.view.position(0) == (7, 0)
    assert sync.on_snapshot(catch_up(s, 7, 0).snapshot, now=0.1).applied and _converged(sync, s)


def test_an_unanswered_request_is_sent_again_with_a_doubling_capped_timeout():
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    _publish(s, 1)
    step = sync.on_batch(_publish(s, 2), now=10.0)
    assert step.send.from_seq == 1 and sync.next_deadline() == 10.0 + TIMEOUT
    assert sync.on_timer(now=10.5) == []
    times, now = [], 10.0 + TIMEOUT
    for _ in range(5):
        [again] = sync.on_timer(now=now)
        assert again == step.send
        times.append(sync.next_deadline() - now)
        now = sync.next_deadline()
    assert times == [2 * TIMEOUT, 4 * TIMEOUT, 4 * TIMEOUT, 4 * TIMEOUT, 4 * TIMEOUT]
    for message in catch_up(s, 7, 1).messages:
        sync.on_batch(message, now=now)
    assert sync.next_deadline() is None and _converged(sync, s)
    # The next gap starts from the base timeout again.
    _publish(s, 3)
    sync.on_batch(_publish(s, 4), now=100.0)
    assert sync.next_deadline() == 100.0 + TIMEOUT


def test_catch_up_publishes_pending_edits_first_and_replays_or_snapshots():
    layout = _layout()
    s = _shard(layout, replay_batches=3)
    for k in range(5):
        _publish(s, k)
    s.apply([PrefixCached("b-2", 100 * SHARDS, Tier.DRAM)])  # applied, not yet published
    answer = catch_up(s, 7, 4)
    assert answer.published is not None and answer.published.seq == 6
    assert [b.seq for b in answer.replay] == [4, 5, 6]  # the published batch is in the replay too
    assert catch_up(s, 7, 7).messages == ()  # nothing after the last batch
    for epoch, from_seq in ((7, 3), (7, 0), (6, 4)):  # trimmed from the log, from nothing, another epoch
        answer = catch_up(s, epoch, from_seq)
        assert answer.published is None and answer.snapshot is not None and answer.snapshot.seq == 6


def test_without_repair_a_gap_is_applied_over_and_never_asked_for():
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)], repair=False)
    b1, b2, b3 = _publish(s, 1), _publish(s, 2), _publish(s, 3)
    assert sync.on_batch(b1, now=0.0).applied
    step = sync.on_batch(b3, now=0.0)
    assert step.applied and step.send is None and sync.followers[0].gaps_skipped == 1
    assert sync.view.position(0) == (7, 3)
    assert not sync.on_batch(b2, now=0.0).applied  # now stale
    # A new epoch still loads a snapshot.
    assert sync.on_batch(_publish(_shard(layout, epoch=9), 1), now=0.0).send.from_seq == 0


def test_unknown_shards_are_refused_with_a_reason():
    layout = _layout()
    sync = _edge(layout, [_shard(layout), _shard(layout, shard=1)])
    assert "unknown shard" in sync.on_batch(UpdateBatchPublished(5, 7, 1, ()), now=0.0).reason
    assert "unknown shard" in sync.on_snapshot(ShardSnapshotSent(5, 7, 1, ()), now=0.0).reason


# ---- any interleaving converges, with a bounded number of requests ----------------------------

ACTIONS = st.lists(
    st.tuples(st.sampled_from(["write", "evict", "deliver", "deliver_any", "drop", "duplicate", "answer",
                               "answer_any", "drop_request", "tick", "restart", "reconnect", "announce"]),
              st.integers(0, 1000)),
    max_size=80,
)


class Network:
    """One unit and one edge. Either direction may lose, duplicate, delay and reorder messages;
    a restart or reconnection kills the connection (both directions' messages in flight) and
    the edge subscribes again, as the daemons do: the unit pushes batches to it again only from
    the subscription on (what it missed meanwhile comes in the subscription's catch-up)."""

    def __init__(self):
        self.layout = _layout()
        self.shard = _shard(self.layout)
        self.sync = _edge(self.layout, [self.shard, _shard(self.layout, shard=1)])
        self.follower = self.sync.followers[0]
        self.to_edge: list = []
        self.to_unit: list = []
        self.subscribed = True
        self.now = 0.0
        self.keys: set[int] = set()
        self.disorder = 0  # losses, reorderings and restarts: what can open a gap
        self.resent = 0  # requests sent again on a timeout, and subscriptions

    def _edge_gets(self, message) -> None:
        if isinstance(message, ShardSnapshotSent):
            step = self.sync.on_snapshot(message, now=self.now)
        elif isinstance(message, ShardPositionAnnounced):
            step = self.sync.on_position(message, now=self.now)
        else:
            step = self.sync.on_batch(message, now=self.now)
        if step.send is not None:
            self.to_unit.append(step.send)

    def _unit_gets(self, request) -> None:
        if isinstance(request, UpdatesSubscribed):
            answer = catch_up(self.shard, request.epoch, request.seq + 1)
            self.subscribed = True
        else:
            answer = catch_up(self.shard, request.epoch, request.from_seq)
        if answer.published is not None and self.subscribed:
            self.to_edge.append(answer.published)
        self.to_edge.extend(answer.messages)

    def _subscribe(self) -> None:
        self.to_edge.clear()
        self.to_unit.clear()
        self.subscribed = False
        self.resent += 1
        self.to_unit.append(self.sync.subscription(0, now=self.now))

    def step(self, action: str, n: int) -> None:
        if action in ("write", "evict"):
            key = (n % 40) * SHARDS
            if action == "evict" and key in self.keys:
                self.shard.apply([PrefixEvicted("b-1", key)])
                self.keys.discard(key)
            else:
                self.shard.apply([PrefixCached("b-1", key, Tier.VRAM if n % 2 else Tier.DRAM)])
                self.keys.add(key)
            batch = self.shard.flush()
            if batch is not None and self.subscribed:
                self.to_edge.append(batch)
        elif action in ("deliver", "deliver_any") and self.to_edge:
            i = 0 if action == "deliver" else n % len(self.to_edge)
            self.disorder += i > 0
            self._edge_gets(self.to_edge.pop(i))
        elif action == "drop" and self.to_edge:
            self.disorder += 1
            self.to_edge.pop(n % len(self.to_edge))
        elif action == "duplicate" and self.to_edge:
            self.disorder += 1  # a copy delivered ahead of its turn is a reordering
            self.to_edge.insert(n % len(self.to_edge), self.to_edge[n % len(self.to_edge)])
        elif action in ("answer", "answer_any") and self.to_unit:
            self._unit_gets(self.to_unit.pop(0 if action == "answer" else n % len(self.to_unit)))
        elif action == "drop_request" and self.to_unit:
            i = n % len(self.to_unit)
            # A lost subscription is a dead connection: the daemon reconnects and subscribes again.
            if isinstance(self.to_unit.pop(i), UpdatesSubscribed):
                self._subscribe()
        elif action == "tick":
            self.now += (n % 40) / 10.0
            again = self.sync.on_timer(now=self.now)
            self.resent += len(again)
            self.to_unit.extend(again)
        elif action == "restart":
            # A new life of the unit: empty, a larger epoch; agents register again.
            self.disorder += 1
            self.shard = _shard(self.layout, epoch=self.shard.epoch + 1)
            self.keys = set()
            self._subscribe()
        elif action == "reconnect":
            self._subscribe()
        elif action == "announce" and self.subscribed:
            # The unit's idle-stream heartbeat, in order behind the batches it sent before.
            self.to_edge.append(self._announcement())

    def _announcement(self) -> ShardPositionAnnounced:
        return ShardPositionAnnounced(self.shard.shard, self.shard.epoch, self.shard.seq, "")

    def heal(self, *, by_heartbeat: bool = False) -> None:
        """The network turns reliable and in order; one more write shows any trailing gap, as
        live traffic would (``by_heartbeat``: no write, the idle stream's position announcement
        shows it); timers fire when nothing else moves."""
        if not by_heartbeat:
            probe = 999 * SHARDS
            self.shard.apply([PrefixCached("a-0", probe, Tier.VRAM)])
            self.keys.add(probe)
            batch = self.shard.flush()
            if self.subscribed:
                self.to_edge.append(batch)
        announced = False
        for _ in range(100):
            if by_heartbeat and not announced and not self.to_edge and not self.to_unit and self.subscribed:
                announced = True  # the stream is idle: one heartbeat
                self.to_edge.append(self._announcement())
            if self.to_edge:
                self._edge_gets(self.to_edge.pop(0))
            elif self.to_unit:
                self._unit_gets(self.to_unit.pop(0))
            elif self.sync.next_deadline() is not None:
                self.now = self.sync.next_deadline()
                again = self.sync.on_timer(now=self.now)
                self.resent += len(again)
                self.to_unit.extend(again)
            else:
                return


@pytest.mark.parametrize("by_heartbeat", [False, True], ids=["by-a-write", "by-heartbeat-alone"])
@settings(max_examples=300, deadline=None)
@given(actions=ACTIONS)
def test_any_interleaving_converges_with_a_bounded_number_of_requests(by_heartbeat, actions):
    """After any disorder, a write (or, with none, one position announcement of the idle stream
    and the timers) brings the view to the shard's state, a lost last batch included."""
    net = Network()
    for action, n in actions:
        net.step(action, n)
    net.heal(by_heartbeat=by_heartbeat)
    assert _converged(net.sync, net.shard)
    assert net.follower.outstanding is None and net.sync.next_deadline() is None
    # A request opens only on a gap, at most one per gap episode: without disorder there is
    # none, and each loss, reordering or restart opens at most one (+1 for the heal's write).
    gap_requests = net.follower.requests - net.resent
    assert gap_requests <= net.disorder + 1
    if net.disorder == 0:
        assert gap_requests == 0


def test_a_lost_last_batch_is_repaired_by_one_heartbeat_and_one_request():
    """Before the heartbeat only a later batch showed the gap: a quiet stream's lost last batch
    left the view behind until the stream's next batch, however long that took."""
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    b1, _b2 = _publish(s, 1), _publish(s, 2)  # b2, the last batch, is lost
    assert sync.on_batch(b1, now=0.0).applied
    beats = PositionHeartbeats(1.0, [None], now=0.0)
    beats.published(None, now=0.0)
    assert beats.due(now=0.5) == [] and beats.next_deadline() == 1.0
    assert beats.due(now=1.0) == [None]  # idle for a period: announce
    step = sync.on_position(ShardPositionAnnounced(0, s.epoch, s.seq, ""), now=1.0)
    assert step.send == ResyncRequested("edge-a", 0, 7, 2) and "lost" in step.reason
    assert sync.position_gaps == 1 and sync.requests == 1
    for message in catch_up(s, 7, 2).messages:
        assert sync.on_batch(message, now=1.1).applied
    assert _converged(sync, s) and sync.next_deadline() is None
    # Announcements at or below the view's position are ignored and ask nothing.
    for announced in ((7, 2), (7, 1), (6, 50)):
        step = sync.on_position(ShardPositionAnnounced(0, *announced, ""), now=1.2)
        assert not step.applied and step.send is None and "nothing missing" in step.reason
    assert sync.requests == 1 and sync.position_gaps == 1


def test_a_position_follows_the_gap_rules_of_a_batch():
    """Same epoch: a replay; one outstanding request (later positions raise the target) and its
    timeout doubling; a newer epoch or no state: a snapshot; repair off: nothing asked."""
    layout = _layout()
    s = _shard(layout)
    sync = _edge(layout, [s, _shard(layout, shard=1)])
    for k in range(3):
        _publish(s, k)
    first = sync.on_position(ShardPositionAnnounced(0, 7, 2, ""), now=0.0)
    again = sync.on_position(ShardPositionAnnounced(0, 7, 3, ""), now=0.5)
    assert first.send == ResyncRequested("edge-a", 0, 7, 1) and again.send is None
    assert "already asked" in again.reason and sync.followers[0].outstanding == (7, 3)
    assert sync.position_gaps == 1  # one catch-up opened; the second position only raised its target
    assert sync.on_timer(now=TIMEOUT) == [ResyncRequested("edge-a", 0, 7, 1)]
    assert sync.next_deadline() == 3 * TIMEOUT  # the timeout doubled
    # A replay reaching only seq 2 does not satisfy the target (7, 3) the later position set.
    for message in catch_up(s, 7, 1).messages[:2]:
        assert sync.on_batch(message, now=1.5).applied
    assert sync.followers[0].outstanding == (7, 3)
    newer = sync.on_position(ShardPositionAnnounced(1, 9, 0, ""), now=2.0)
    assert newer.send == ResyncRequested("edge-a", 1, 7, 0)  # from seq 0: a snapshot
    blank = EdgeSync(EdgeIndexView(layout, SHARDS, edge="edge-a"))
    assert blank.on_position(ShardPositionAnnounced(0, 7, 0, ""), now=0.0).send == ResyncRequested("edge-a", 0, 0, 0)
    prototype = _edge(layout, [_shard(layout), _shard(layout, shard=1)], repair=False)
    step = prototype.on_position(ShardPositionAnnounced(0, 7, 5, ""), now=0.0)
    assert step.send is None and "repair is off" in step.reason and prototype.requests == 0
    assert "unknown shard" in sync.on_position(ShardPositionAnnounced(5, 7, 1, ""), now=0.0).reason


def test_a_position_during_a_snapshot_transfer_waits_for_it():
    """At or below the transfer's header: the transfer brings it; beyond: the target rises and
    the catch-up ends only once the view holds those batches too."""
    from kvcompassd.core.snapshots import SnapshotChunker

    layout = _layout()
    s = _shard(layout)
    _publish(s, 1)
    sync = EdgeSync(EdgeIndexView(layout, SHARDS, edge="edge-a"))
    assert isinstance(sync.subscription(0, now=0.0), UpdatesSubscribed)
    chunker = SnapshotChunker(s.snapshot(), snapshot_id=5, chunk_bytes=4096)
    assert sync.on_snapshot_message(chunker.header, now=0.0).applied
    step = sync.on_position(ShardPositionAnnounced(0, 7, 1, ""), now=0.1)
    assert step.send is None and "transfer reaches it" in step.reason
    b2 = _publish(s, 2)
    step = sync.on_position(ShardPositionAnnounced(0, 7, 2, ""), now=0.2)
    assert step.send is None and "beyond the snapshot" in step.reason and sync.followers[0].outstanding == (7, 2)
    for chunk in chunker.chunks_from(0):
        sync.on_snapshot_message(chunk, now=0.3)
    assert sync.view.position(0) == (7, 1) and sync.followers[0].outstanding == (7, 2)
    assert sync.on_batch(b2, now=0.4).applied
    assert _converged(sync, s) and sync.followers[0].outstanding is None


def test_heartbeats_are_due_only_on_an_idle_stream():
    beats = PositionHeartbeats(1.0, ["eu", None], now=0.0)
    announced = []
    for t in (0.4, 0.8, 1.2, 1.6):  # "eu" publishes every 0.4 s: never idle for a period
        beats.published("eu", now=t)
        announced += [(t, stream) for stream in beats.due(now=t)]
    assert announced == [(1.2, None)]  # the full stream, idle since the start
    assert beats.next_deadline() == 2.2  # again a period after its announcement
    assert beats.due(now=2.2) == [None] and beats.due(now=2.6) == ["eu"]  # eu a period after its last batch
    beats.stop("eu")
    assert beats.due(now=10.0) == [None]
    with pytest.raises(ValueError):
        PositionHeartbeats(0.0, [None], now=0.0)


def test_the_property_model_does_lose_and_repair():
    """The model is not vacuous: a lossy run needs requests and still converges."""
    net = Network()
    for k in range(30):
        net.step("write", k)
        if k % 4 == 0:
            net.step("drop", 0)
        net.step("deliver", 0)
    assert not _converged(net.sync, net.shard)
    net.heal()
    assert _converged(net.sync, net.shard) and net.follower.requests >= 1
    # And by heartbeat alone: the last batch lost, no write after it.
    net = Network()
    for k in range(5):
        net.step("write", k)
        net.step("deliver", 0)
    net.step("write", 5)
    net.step("drop", 0)
    assert not _converged(net.sync, net.shard)
    net.heal(by_heartbeat=True)
    assert _converged(net.sync, net.shard) and net.follower.position_gaps == 1 and net.follower.requests == 1


@pytest.mark.parametrize("repair", [True, False])
def test_the_edge_view_and_settings_validate(repair):
    with pytest.raises(ValueError):
        SyncSettings(resync_timeout_s=0.0)
    with pytest.raises(ValueError):
        SyncSettings(resync_timeout_s=5.0, max_resync_timeout_s=1.0)
    assert SyncSettings(repair=repair).repair is repair
