"""Subscriber on loopback against the engines' own bytes (committed captures played from a real
PUB/ROUTER) and against the emulator's publisher: order, gaps, replay, restarts, odd seqs.

Each recovery scenario ends with the subscriber's block tree equal to the engine's: the tree
fed every batch the engine published, in order."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from engine_captures import ENGINES, RecordedEngine, load_capture

from kvcompassd.emulator.publisher import KvEventPublisher
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import (
    BlockStored,
    EventBatch,
    decode_message,
    encode_batch,
    encode_seq,
)
from kvcompassd.engine.subscriber import (
    BatchesLost,
    BatchRejected,
    KvEventSubscriber,
    OddSequenceRejected,
    PublisherRestarted,
)


def stored(i: int) -> BlockStored:
    return BlockStored((i,), None, (i,), 16, None, "GPU")


async def wait_for(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def publish_until_received(pub: KvEventPublisher, got: list, base: int = 0) -> None:
    """Publish block ``base + seq`` until the subscriber has received something (a SUB misses
    what was sent before it joined, or while it reconnects)."""
    async with asyncio.timeout(10):
        while not got:
            pub.publish([stored(base + pub.next_seq)])
            await asyncio.sleep(0.02)


async def test_in_order_delivery_gap_recovery_and_restart() -> None:
    ctx = zmq.asyncio.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, buffer_steps=100)
    await pub.start()
    got: list = []
    dropped: set[int] = set()
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, got.append, context=ctx,
                            drop=lambda seq: seq in dropped and not dropped.discard(seq))
    task = asyncio.create_task(sub.run())
    try:
        # batches published before the SUB joined are recovered by replaying the gap from 0
        sub.connect()
        await publish_until_received(pub, got)
        joined = pub.next_seq
        dropped.update({joined + 1, joined + 2, joined + 5})  # lost on the subscriber side
        for _ in range(8):
            pub.publish([stored(pub.next_seq)])
        total = pub.next_seq
        await wait_for(lambda: len([g for g in got if isinstance(g, EventBatch)]) >= total)
        await asyncio.sleep(0.05)
        batches = [g for g in got if isinstance(g, EventBatch)]
        assert [b.seq for b in batches] == list(range(total))
        assert [b.events[0].block_hashes[0] for b in batches] == list(range(total))
        assert sub.replays >= 1 and not dropped
        assert not any(isinstance(g, BatchesLost) for g in got)

        # restart: a new publisher on the same endpoints starts again at seq 0
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        await pub.close()
        pub = KvEventPublisher(endpoint, replay, context=ctx)
        await pub.start()
        got.clear()
        await publish_until_received(pub, got, base=100)
        await wait_for(lambda: len([g for g in got if isinstance(g, EventBatch)]) >= pub.next_seq)
        assert isinstance(got[0], PublisherRestarted) and got[0].previous_seq == total - 1
        assert [g.seq for g in got if isinstance(g, EventBatch)] == list(range(pub.next_seq))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        ctx.destroy(linger=0)


async def test_lost_batches_and_rejected_payloads_are_reported() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    got: list = []
    sub = KvEventSubscriber(endpoint, None, got.append, context=ctx)
    task = asyncio.create_task(sub.run())
    try:
        sub.connect()
        async with asyncio.timeout(10):
            while not got:  # join: keep sending seq 0 (duplicates are ignored)
                await pub.send_multipart(encode_batch(0, 1.0, [stored(0)]))
                await asyncio.sleep(0.02)
        await pub.send_multipart(encode_batch(5, 1.0, [stored(5)]))
        frames = encode_batch(6, 1.0, [stored(6)])
        await pub.send_multipart([frames[0], frames[1], b"\xc1garbage"])
        await pub.send_multipart(encode_batch(7, 1.0, [stored(7)]))
        await wait_for(lambda: any(isinstance(g, EventBatch) and g.seq == 7 for g in got))
        kinds = [(type(g).__name__, getattr(g, "seq", getattr(g, "first_seq", None))) for g in got]
        assert kinds == [("EventBatch", 0), ("BatchesLost", 1), ("EventBatch", 5), ("BatchRejected", 6),
                         ("EventBatch", 7)]
        lost = got[1]
        assert isinstance(lost, BatchesLost) and (lost.first_seq, lost.last_seq) == (1, 4)
        assert isinstance(got[3], BatchRejected)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_restart_is_detected_even_when_the_new_seq_overtakes_the_old() -> None:
    ctx = zmq.asyncio.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx)
    await pub.start()
    got: list = []
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, got.append, context=ctx)
    task = asyncio.create_task(sub.run())
    try:
        sub.connect()
        await publish_until_received(pub, got)
        await wait_for(lambda: sub.tracker.last_applied == pub.next_seq - 1)
        old_last = pub.next_seq - 1
        endpoints = pub.endpoint, pub.replay_endpoint
        await pub.close()
        pub = KvEventPublisher(*endpoints, context=ctx)
        await pub.start()
        for _ in range(old_last + 10):  # the new process runs ahead before ZMQ reconnects
            pub.publish([stored(1000 + pub.next_seq)])
        got.clear()
        await publish_until_received(pub, got, base=1000)
        await wait_for(lambda: sub.tracker.last_applied == pub.next_seq - 1)
        assert isinstance(got[0], PublisherRestarted)
        batches = [g for g in got if isinstance(g, EventBatch)]
        assert [b.seq for b in batches] == list(range(pub.next_seq))
        assert batches[0].events[0].block_hashes == (1000,)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        ctx.destroy(linger=0)


async def test_batches_lost_before_a_quiet_spell_are_recovered_on_an_idle_tick() -> None:
    ctx = zmq.asyncio.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, buffer_steps=100)
    await pub.start()
    got: list = []
    dropped: set[int] = set()
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, got.append, context=ctx, idle_probe=0.1,
                            drop=lambda seq: seq in dropped and not dropped.discard(seq))
    task = asyncio.create_task(sub.run())
    try:
        sub.connect()
        await publish_until_received(pub, got)
        # The last two batches are lost and nothing follows them: no later batch reveals a gap.
        dropped.update({pub.next_seq, pub.next_seq + 1})
        pub.publish([stored(pub.next_seq)])
        pub.publish([stored(pub.next_seq)])
        total = pub.next_seq
        await wait_for(lambda: len([g for g in got if isinstance(g, EventBatch)]) >= total)
        assert [g.seq for g in got if isinstance(g, EventBatch)] == list(range(total))
        assert not dropped and sub.catch_ups >= 2  # start-up, then an idle tick
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        ctx.destroy(linger=0)


async def test_a_sub_kept_full_does_not_keep_the_loop_from_other_tasks() -> None:
    # run() takes messages without awaiting while there are some: an engine publishing faster
    # than the agent applies would otherwise starve its QUIC keep-alives and load reports.
    from kvcompassd.engine import subscriber as subscriber_module

    ctx = zmq.asyncio.Context()
    got: list = []
    sub = KvEventSubscriber("tcp://127.0.0.1:9", None, got.append, context=ctx, idle_probe=5.0)
    flood = iter([encode_batch(seq, 1.0, [stored(seq)]) for seq in range(300)])
    sub._next_live = lambda: next(flood, None)  # 300 messages already there, then none
    seen: list[int] = []

    async def other_task() -> None:
        while len(got) < 300:
            seen.append(len(got))
            await asyncio.sleep(0)

    other = asyncio.create_task(other_task())
    task = asyncio.create_task(sub.run())
    try:
        async with asyncio.timeout(10):
            await other
        every = subscriber_module.YIELD_EVERY_MESSAGES
        between = [n for n in seen if 0 < n < 300]  # the other task ran amid the flood
        assert between and between == list(range(every, 300, every))
    finally:
        task.cancel()
        await asyncio.gather(task, other, return_exceptions=True)
        ctx.destroy(linger=0)


async def test_cancelling_run_ends_it_even_as_a_message_arrives() -> None:
    # Python 3.11's asyncio.wait_for returns the result of an inner future that completed as the
    # task was cancelled, swallowing the cancellation: an agent shutting down hung in run().
    # Here the wait for the SUB completes at the very moment of the cancel.
    ctx = zmq.asyncio.Context()
    sub = KvEventSubscriber("tcp://127.0.0.1:9", None, lambda item: None, context=ctx, idle_probe=5.0)
    task = asyncio.create_task(sub.run())
    try:
        for _ in range(10):
            await asyncio.sleep(0)
            if sub._waiter is not None:
                break
        assert sub._waiter is not None and not task.done()  # run() is waiting for its first message
        sub._waiter.set_result(True)
        task.cancel()
        # asyncio.wait, not a timeout around `await task`: cancelling the waiter on expiry
        # would cancel the task a second time and hide the first cancellation's loss.
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done and task.cancelled() and sub.delivered == 0
        assert sub._sub is None  # closed on the way out, its descriptor no longer watched
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=5)
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ the engines' captured bytes

SALT = b"test"


def engine_holds(engine: str, upto: int | None = None) -> dict:
    """What the engine holds after its captured batches [0, upto): the reference registrations."""
    tree = BlockTree("w", (16, 32, 48), salt=SALT, page_size=16)
    for frames in load_capture(engine)["live"][:upto]:
        tree.apply_batch(decode_message(frames))
    return tree.registered()


class Follower:
    """A subscriber feeding a block tree, as the agent does."""

    def __init__(self, engine: RecordedEngine, ctx, **options) -> None:
        self.tree = BlockTree("w", (16, 32, 48), salt=SALT, page_size=16)
        self.items: list = []
        self.sub = KvEventSubscriber(engine.endpoint, engine.replay_endpoint, self.on_item, context=ctx,
                                     topic=engine.topic, **options)
        self.task: asyncio.Task | None = None

    def on_item(self, item) -> None:
        self.items.append(item)
        if isinstance(item, EventBatch):
            self.tree.apply_batch(item)
        elif isinstance(item, PublisherRestarted):
            self.tree.withdraw_all()

    def kinds(self) -> list[tuple[str, int]]:
        return [(type(i).__name__, getattr(i, "seq", getattr(i, "first_seq", getattr(i, "previous_seq", None))))
                for i in self.items]

    async def start(self) -> None:
        self.task = asyncio.create_task(self.sub.run())
        await wait_for(self.sub.caught_up.is_set)

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def settle(follower: Follower, last_seq: int) -> None:
    await wait_for(lambda: follower.sub.tracker.last_applied == last_seq)


@pytest.mark.parametrize("engine", ENGINES)
async def test_agent_started_late_against_an_idle_engine_catches_up(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    for i in range(len(rec.live)):
        await rec.publish(i)  # nobody listens yet; then the engine stays idle
    follower = Follower(rec, ctx, idle_probe=None)  # no idle ticks: the start-up catch-up alone
    try:
        await follower.start()
        assert [seq for kind, seq in follower.kinds()] == list(range(7))
        assert follower.tree.registered() == engine_holds(engine)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_dropped_live_batches_are_replayed(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=0.05)
    try:
        await follower.start()
        for i in range(len(rec.live)):
            # 0, 2, 3 and 6 never reach the subscriber live; 6 is the last: only an idle tick finds it
            await rec.publish(i, withhold=i in (0, 2, 3, 6))
        await settle(follower, 6)
        assert follower.kinds() == [("EventBatch", i) for i in range(7)]
        assert follower.tree.registered() == engine_holds(engine)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_restarted_agent_rebuilds_from_an_idle_engine(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    first = Follower(rec, ctx)
    await first.start()
    for i in range(5):
        await rec.publish(i)
    await settle(first, 4)
    await first.stop()
    second = Follower(rec, ctx, idle_probe=None)  # the engine publishes nothing more
    try:
        await second.start()
        assert second.tree.registered() == first.tree.registered() == engine_holds(engine, 5)
    finally:
        await second.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_odd_sequence_numbers_withdraw_nothing(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=None)
    try:
        await follower.start()
        for i in range(5):
            await rec.publish(i)
        await settle(follower, 4)
        holds = engine_holds(engine, 5)
        assert follower.tree.registered() == holds
        topic, _, payload = rec.live[1]
        # an unsigned seq reading negative, an older seq, one ahead of all the engine published
        for seq in ((1 << 63) + 1, 1, 1 << 40):
            await rec.send_raw([topic, seq.to_bytes(8, "big"), payload])
        await wait_for(lambda: follower.sub.odd_seqs == 3)
        odd = [i for i in follower.items if isinstance(i, OddSequenceRejected)]
        assert [i.seq for i in odd] == [-(1 << 63) + 1, 1, 1 << 40]
        for i in (5, 6):
            await rec.publish(i)
        await settle(follower, 6)
        assert follower.sub.restarts == 0 and not any(isinstance(i, (PublisherRestarted, BatchesLost))
                                                      for i in follower.items)
        assert follower.tree.registered() == engine_holds(engine)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_negative_seq_in_the_engines_buffer_does_not_stop_replays(ctx, engine: str) -> None:
    """An engine that published a batch under a seq reading negative answers it to every later
    replay (it is above any start, read unsigned): that one reply is skipped, the rest applied."""
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=None)
    try:
        await follower.start()
        for i in range(3):
            await rec.publish(i)
        await settle(follower, 2)
        topic, _, payload = rec.live[1]
        await rec.send_raw([topic, ((1 << 63) + 5).to_bytes(8, "big"), payload], buffered=True)
        await wait_for(lambda: follower.sub.odd_seqs == 1)
        await rec.publish(3, withhold=True)  # lost live: the gap 4 reveals needs the replay
        for i in (4, 5, 6):
            await rec.publish(i)
        await settle(follower, 6)
        assert not follower.sub.replay_failing
        assert not any(isinstance(i, (BatchesLost, PublisherRestarted)) for i in follower.items)
        assert [seq for kind, seq in follower.kinds() if kind == "EventBatch"] == list(range(7))
        assert follower.tree.registered() == engine_holds(engine)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_restarted_engine_is_concluded_from_its_replay_not_from_a_seq(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=0.05)
    try:
        await follower.start()
        for i in range(7):
            await rec.publish(i)
        await settle(follower, 6)
        endpoints = rec.endpoint, rec.replay_endpoint
        await rec.close()
        # a new process on the same sockets; it has published 0..1 (withheld: the SUB had not
        # reconnected yet) and goes idle
        rec = RecordedEngine(load_capture(engine), ctx, endpoints=endpoints)
        await rec.start()
        for i in range(2):
            await rec.publish(i, withhold=True)
        await wait_for(lambda: follower.sub.restarts == 1)
        await settle(follower, 1)
        assert follower.kinds()[7:] == [("PublisherRestarted", 6), ("EventBatch", 0), ("EventBatch", 1)]
        assert follower.tree.registered() == engine_holds(engine, 2)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_replay_buffer_that_cannot_reach_back_reports_the_loss(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine, "short-buffer"), ctx)
    await rec.start()
    for i in range(7):
        await rec.publish(i)
    follower = Follower(rec, ctx, idle_probe=None)
    try:
        await follower.start()
        assert follower.kinds() == [("BatchesLost", 0), ("EventBatch", 3), ("EventBatch", 4), ("EventBatch", 5),
                                    ("EventBatch", 6)]
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_configured_topic_is_followed_and_others_ignored(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine, "topic"), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=None)
    try:
        await follower.start()
        await rec.send_raw([b"kv-events-other", encode_seq(0), rec.live[0][2]])  # a prefix match on SUB
        for i in range(7):
            await rec.publish(i)
        await settle(follower, 6)
        assert follower.tree.registered() == engine_holds(engine)
    finally:
        await follower.stop()
        await rec.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_engine_topic_the_config_does_not_name_is_logged_once(ctx, engine: str, caplog) -> None:
    """The engine publishes under "kv-events" while the worker's kv_events_topic is empty (the
    default): the empty subscription receives every batch, none is applied, one line says why."""
    rec = RecordedEngine(load_capture(engine, "topic"), ctx)
    rec.topic = ""  # what the follower is configured with
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=None, replay_timeout=0.2)
    try:
        with caplog.at_level("WARNING", logger="kvcompassd.engine.subscriber"):
            await follower.start()
            for i in range(7):
                await rec.publish(i)
            await wait_for(lambda: follower.sub.ignored_messages == 7)
        assert follower.sub.delivered == 0 and follower.tree.registered() == {}
        lines = [r.getMessage() for r in caplog.records if "ignoring live messages" in r.getMessage()]
        assert len(lines) == 1 and "b'kv-events'" in lines[0] and "kv_events_topic" in lines[0]
    finally:
        await follower.stop()
        await rec.close()


async def test_without_a_replay_socket_a_seq_going_back_is_a_restart_only_if_the_stream_continues(ctx) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    got: list = []
    sub = KvEventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT), None, got.append, context=ctx,
                            idle_probe=None)
    task = asyncio.create_task(sub.run())
    try:
        sub.connect()
        async with asyncio.timeout(10):
            while not got:  # join: keep sending seq 0 (duplicates are ignored)
                await pub.send_multipart(encode_batch(0, 1.0, [stored(0)]))
                await asyncio.sleep(0.02)
        for seq in (1, 2, 3):
            await pub.send_multipart(encode_batch(seq, 1.0, [stored(seq)]))
        await pub.send_multipart(encode_batch(1, 9.0, [stored(91)]))  # went back: held
        await pub.send_multipart(encode_batch(4, 1.0, [stored(4)]))  # the old count goes on: it was odd
        await pub.send_multipart(encode_batch(0, 9.0, [stored(100)]))  # went back: held
        await pub.send_multipart(encode_batch(1, 9.0, [stored(101)]))  # and continues: a new process
        await wait_for(lambda: sub.restarts == 1 and sub.tracker.last_applied == 1)
        kinds = [(type(g).__name__, getattr(g, "seq", getattr(g, "previous_seq", None))) for g in got]
        assert kinds == [("EventBatch", 0), ("EventBatch", 1), ("EventBatch", 2), ("EventBatch", 3),
                         ("OddSequenceRejected", 1), ("EventBatch", 4), ("PublisherRestarted", 4),
                         ("EventBatch", 0), ("EventBatch", 1)]
        assert [g.events[0].block_hashes for g in got[-2:]] == [(100,), (101,)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)


async def test_a_replay_that_no_longer_reaches_the_last_batch_reports_the_hole(ctx) -> None:
    """The same process, but the subscriber missed more than its buffer holds: the hole is lost,
    nothing is withdrawn, what the buffer holds is applied."""
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, buffer_steps=3)
    await pub.start()
    got: list = []
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, got.append, context=ctx, idle_probe=None)
    task = asyncio.create_task(sub.run())
    try:
        await wait_for(sub.caught_up.is_set)
        await publish_until_received(pub, got)
        last = pub.next_seq - 1
        await wait_for(lambda: sub.tracker.last_applied == last)
        pub.withhold_live = lambda seq: True
        for _ in range(6):
            pub.publish([stored(pub.next_seq)])
        pub.withhold_live = None
        got.clear()
        pub.publish([stored(pub.next_seq)])  # reveals the gap; the buffer holds only the last 3
        await wait_for(lambda: sub.tracker.last_applied == pub.next_seq - 1)
        newest = pub.next_seq - 1
        kinds = [(type(g).__name__, getattr(g, "seq", getattr(g, "first_seq", None))) for g in got]
        assert kinds == [("BatchesLost", last + 1)] + [("EventBatch", s) for s in range(newest - 2, newest + 1)]
        assert got[0].last_seq == newest - 3 and sub.restarts == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_idle_engine_is_probed_ever_less_often_and_a_missed_batch_still_found(ctx, engine: str) -> None:
    rec = RecordedEngine(load_capture(engine), ctx)
    await rec.start()
    follower = Follower(rec, ctx, idle_probe=0.02, idle_probe_max=0.16)
    try:
        await follower.start()
        await rec.publish(0)
        await settle(follower, 0)
        # Probes that find nothing double the silence before the next, up to the bound.
        await wait_for(lambda: follower.sub.probe_delay == 0.16)
        probes = follower.sub.catch_ups
        await rec.publish(1)  # live: the base period again
        await settle(follower, 1)
        await wait_for(lambda: follower.sub.catch_ups > probes)
        await rec.publish(2, withhold=True)  # lost live: only a probe finds it, however slow
        await settle(follower, 2)
        assert follower.kinds() == [("EventBatch", i) for i in range(3)]
        assert follower.sub.catch_ups - probes < 16  # not one every 20 ms
    finally:
        await follower.stop()
        await rec.close()
