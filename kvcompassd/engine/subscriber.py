"""Asyncio ZMQ client of an engine's KV-event stream: SUB for live batches, DEALER for replay.

An asyncio shell around the sans-IO :mod:`kvcompassd.engine.kvevents` codec and
:class:`~kvcompassd.engine.kvevents.SequenceTracker`. The callback receives, strictly in order:

- :class:`~kvcompassd.engine.kvevents.EventBatch` — the next batch, each seq exactly once;
- :class:`PublisherRestarted` — the engine process was replaced (evidence below): withdraw
  everything, the batches that follow belong to the new process;
- :class:`BatchesLost` — a range the replay buffer could not supply (state may be stale);
- :class:`BatchRejected` — a batch whose payload did not decode (its seq is consumed);
- :class:`OddSequenceRejected` — a live seq the engine cannot have sent, dropped.

**Catch-up** asks the replay socket for everything from the last applied seq on: at start-up
(an agent started after its engine, or restarted, while the engine is idle), on every idle
tick (batches lost before a quiet spell), after a reconnect and on any gap. Asking from the
last applied seq rather than the next one makes every catch-up also check the publisher: the
same process still buffers that batch with the same bytes (its buffer drops the oldest, never
the newest).

**Restarts** are concluded only from evidence, never from one odd seq: the replay socket
answers the last applied seq with other bytes (a new process's batch carries another
timestamp), or holds nothing at or after it (a new process whose counter is still below ours).
Then the new process's whole buffer is replayed from 0. Without a replay socket there is no
such evidence: a seq going back is held, and taken as a restart only if the next live batch
continues the new count.

**Odd seqs**: a seq that reads negative is rejected (engines write it unsigned and count up
from 0); a live seq ahead of everything the replay socket holds was never published and is
rejected; a live seq going back is checked as above and ignored when the publisher is the same.
Each is logged and counted in ``odd_seqs``; none withdraws anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcompassd.engine.kvevents import (
    EventBatch,
    KvEventError,
    NegativeReplaySeq,
    PayloadDecoder,
    ReplayedBatch,
    ReplayEnded,
    SequenceTracker,
    SeqVerdict,
    decode_replay_reply,
    decode_seq,
    replay_request_frames,
)

log = logging.getLogger(__name__)
DECODE_SLICE_EVENTS = 2048  # events decoded between two yields to the event loop
YIELD_EVERY_MESSAGES = 64  # live messages taken one after another between two yields to the loop
_monitor_ids = itertools.count()
# As plain ints: an int & pyzmq's IntFlag runs enum's Python __and__, a few microseconds a
# check, and the live path checks EVENTS two or three times a message (py-spy: 2.6 % of an
# agent's samples at c = 1, where half the samples are the idle loop).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """A new engine process replaced the one whose last applied batch was ``previous_seq``;
    ``new_seq`` is the newest seq the new one holds (-1: none yet)."""

    previous_seq: int
    new_seq: int


@dataclass(frozen=True, slots=True)
class BatchesLost:
    """Batches ``first_seq..last_seq`` were never received and could not be replayed."""

    first_seq: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class BatchRejected:
    """Batch ``seq`` arrived but did not decode."""

    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class OddSequenceRejected:
    """A live batch with a seq the engine cannot have sent (negative, never published, or
    going back while the replay shows the same process) was dropped; nothing was withdrawn."""

    seq: int
    reason: str


SubscriberItem = EventBatch | PublisherRestarted | BatchesLost | BatchRejected | OddSequenceRejected
Callback = Callable[[SubscriberItem], Awaitable[None] | None]


class _ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered something malformed."""


def _settle(waiter: asyncio.Future, result: bool) -> None:
    if not waiter.done():
        waiter.set_result(result)


class KvEventSubscriber:
    """Follows one engine's KV events; ``run()`` until cancelled."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        callback: Callback,
        *,
        topic: str = "",
        replay_timeout: float = 2.0,
        idle_probe: float | None = 1.0,
        idle_probe_max: float | None = None,
        context: zmq.asyncio.Context | None = None,
        drop: Callable[[int], bool] | None = None,
        coalesce: bool = False,
    ) -> None:
        """``topic`` is the engine's ``topic`` setting (the engines' default is empty).
        ``replay_timeout`` bounds the wait for each replay reply. ``drop(seq) -> bool``
        discards matching live messages on arrival: fault injection for tests and chaos runs
        (it exercises the replay path exactly as real loss does)."""
        self._ctx = context or zmq.asyncio.Context.instance()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._callback = callback
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._idle_probe = idle_probe
        # While probes find nothing new, the silence before the next one doubles up to this.
        self._idle_probe_max = idle_probe if idle_probe_max is None or idle_probe is None else max(idle_probe,
                                                                                                   idle_probe_max)
        self.probe_delay = idle_probe
        self._drop = drop
        # Deliver each batch with runs of events that continue one another as one event
        # (PayloadDecoder coalesce): what a block mirror needs, at a fraction of the objects.
        self._coalesce = coalesce
        self.tracker = SequenceTracker()
        self._sub: zmq.Socket | None = None
        self._waiter: asyncio.Future[bool] | None = None  # run() waiting for the SUB (_readable)
        self._monitor: zmq.Socket | None = None
        # The payload of tracker.last_applied, to tell the same process's batch from a new one's
        # (kept as it is: a hash of every batch was 1 % of an agent's CPU, a comparison is rare).
        self._last_payload: bytes | None = None
        self._held: tuple[int, bytes] | None = None  # a seq going back, without a replay socket
        self.catch_ups = 0
        self.replays = 0  # catch-ups that delivered something
        self.delivered = 0
        self.disconnects = 0
        self.odd_seqs = 0
        self.restarts = 0
        self.replay_failing = False
        self.ignored_messages = 0  # live messages on another topic or with another frame count
        self._ignored_kinds: set[tuple[int, bytes]] = set()
        self._odd_replayed: set[int] = set()  # negative seqs seen in replays, logged once each
        self.caught_up = asyncio.Event()  # set after the start-up catch-up

    async def _emit(self, item: SubscriberItem) -> None:
        result = self._callback(item)
        if inspect.isawaitable(result):
            await result
        if isinstance(item, EventBatch):
            self.delivered += 1

    def connect(self) -> None:
        """Connect the SUB socket (``run`` does it too); call early to shorten ZMQ's join delay."""
        if self._sub is None:
            # Plain sockets on the context (a shadow of it): run() drains the SUB without
            # awaiting and waits on its descriptor itself (_readable). pyzmq's asyncio socket
            # made a future, a timeout and a dozen enum.Flag operations per message: ~10 % of an
            # agent's CPU under the zero-delay gateway load (py-spy, c = 16).
            plain = zmq.Context.shadow(self._ctx.underlying)
            self._sub = plain.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            address = f"inproc://kvcompassd-sub-monitor-{id(self)}-{next(_monitor_ids)}"
            self._sub.monitor(address, zmq.EVENT_DISCONNECTED)
            self._monitor = plain.socket(zmq.PAIR)  # drained without awaiting, before each message
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            self._sub.connect(self._endpoint)

    def _disconnected(self) -> bool:
        seen = False
        # (EVENTS, not poll(0): no system call per live message while nothing happened)
        while self._monitor is not None and self._monitor.getsockopt(_EVENTS) & _POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                seen = True
                self.disconnects += 1
        return seen

    def _next_live(self) -> list[bytes] | None:
        """The next live message already received, or None."""
        sub = self._sub
        # EVENTS first: every message's loop ends in an empty read, and pyzmq raises zmq.Again
        # for one (4.5 us against 1.5 us for the check, measured warm; 48 us a read in place).
        if not sub.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[union-attr]
            return None
        try:
            return sub.recv_multipart(_NOBLOCK)  # type: ignore[union-attr]
        except zmq.Again:  # (EVENTS said a message was there)
            return None

    async def _readable(self, timeout: float | None) -> bool:
        """Wait until the SUB may have a message (True) or ``timeout`` passes (False).

        A ZMQ socket's descriptor signals that its state may have changed, not that a message
        is there: ``EVENTS`` says which, and reading it rearms the descriptor."""
        if self._sub.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[union-attr]
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _settle, waiter, False)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _on_descriptor(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        elif self._sub is not None:
            # Nothing waits (a message is being handled): read EVENTS so that the descriptor,
            # which the loop watches level-triggered, stops calling until the state changes.
            self._sub.getsockopt(_EVENTS)

    async def run(self) -> None:
        self.connect()
        assert self._sub is not None
        loop = asyncio.get_running_loop()
        descriptor = self._sub.getsockopt(zmq.FD)
        loop.add_reader(descriptor, self._on_descriptor)
        try:
            # The SUB is connected first, so nothing published after the replay's answer is missed.
            await self.catch_up()
            self.caught_up.set()
            in_a_row = 0
            while True:
                frames = self._next_live()
                if frames is not None and in_a_row >= YIELD_EVERY_MESSAGES:
                    # An engine that keeps the SUB full must not keep the loop from QUIC
                    # keep-alives and load reports: nothing else here waits while messages are there.
                    in_a_row = 0
                    await asyncio.sleep(0)
                if frames is None:
                    in_a_row = 0
                    if not await self._readable(self.probe_delay) and self._idle_probe is not None:
                        disconnected = self._disconnected()  # the catch-up checks the publisher anyway
                        before = self.delivered
                        await self.catch_up()
                        # An idle engine with nothing missed: probe it ever less often.
                        self.probe_delay = (self._idle_probe if disconnected or self.delivered > before
                                            or self.replay_failing else min(self._idle_probe_max, 2 * self.probe_delay))
                    continue
                self.probe_delay = self._idle_probe
                in_a_row += 1
                await self.handle_live(frames)
        finally:
            loop.remove_reader(descriptor)
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
            if self._monitor is not None:
                self._monitor.close(linger=0)
                self._monitor = None

    # -- live ---------------------------------------------------------------------------------

    async def handle_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self._topic:
            # An empty subscription receives every topic: a misconfigured topic would otherwise
            # log every batch the engine publishes. Once per (frame count, topic) is enough.
            seen = (len(frames), bytes(frames[0][:256]) if frames else b"")
            self.ignored_messages += 1
            if seen not in self._ignored_kinds and len(self._ignored_kinds) < 16:
                self._ignored_kinds.add(seen)
                log.warning("ignoring live messages of %d frames on topic %r (want %r: the worker's kv_events_topic "
                            "must be the engine's topic)", seen[0], seen[1], self._topic)
            return
        try:
            seq = decode_seq(frames[1])
        except KvEventError as exc:
            log.warning("ignoring a live message: %s", exc)
            return
        if seq < 0:
            await self._odd(seq, "negative: engines count up from 0")
            return
        if self._drop is not None and self._drop(seq):
            return
        if self._disconnected():
            await self.catch_up()  # a reconnect: same publisher? anything missed meanwhile?
        if self._held is not None and await self._confirm_held(seq, frames[2]):
            return
        previous_live = self.tracker.last_live
        check = self.tracker.check_live(seq)
        if check.verdict is SeqVerdict.NEXT:
            await self._deliver(seq, frames[2])
        elif check.verdict is SeqVerdict.GAP:
            await self._fill_gap(seq, frames[2])
        elif previous_live is not None and seq <= previous_live:
            # The live stream went back (a PUB never reorders): an odd seq or a new process.
            if seq == self.tracker.last_applied and frames[2] == self._last_payload:
                return
            await self._went_back(seq, frames[2])
        # else: a replay already delivered it (live messages queued while it ran)

    async def _fill_gap(self, seq: int, payload: bytes) -> None:
        expected = self.tracker.expected
        newest = await self.catch_up()
        if self.tracker.expected > seq:
            return  # the replay delivered it
        if newest is not None:
            # The engine buffers a batch before answering any replay, so a seq the replay socket
            # did not hold was never published: an odd seq, not a gap.
            await self._odd(seq, f"never published: the engine's replay holds only up to {newest}")
            return
        await self._emit(BatchesLost(expected, seq - 1))
        self._skip_to(seq)
        await self._deliver(seq, payload)

    async def _went_back(self, seq: int, payload: bytes) -> None:
        if self._replay_endpoint is None:
            self._held = (seq, payload)
            log.warning("live seq went back to %d (last applied %s): held until the next batch shows whether "
                        "the engine restarted", seq, self.tracker.last_applied)
            return
        restarts = self.restarts
        newest = await self.catch_up()
        if self.restarts == restarts:
            await self._odd(seq, f"below the last applied {self.tracker.last_applied}, and the replay shows the "
                                 f"same engine process (newest {newest})")

    async def _confirm_held(self, seq: int, payload: bytes) -> bool:
        """Without a replay socket: the held seq was a restart if this batch continues it."""
        held_seq, held_payload = self._held  # type: ignore[misc]
        self._held = None
        if seq != held_seq + 1:
            await self._odd(held_seq, "went back, and the stream did not continue from it")
            return False
        await self._restarted(held_seq)
        if held_seq > 0:
            await self._emit(BatchesLost(0, held_seq - 1))
            self._skip_to(held_seq)
        self.tracker.check_live(held_seq)
        await self._deliver(held_seq, held_payload)
        self.tracker.check_live(seq)
        await self._deliver(seq, payload)
        return True

    async def _odd(self, seq: int, reason: str) -> None:
        self.odd_seqs += 1
        log.warning("rejected live batch seq %d (%s); every holding kept", seq, reason)
        await self._emit(OddSequenceRejected(seq, reason))

    async def _restarted(self, new_seq: int) -> None:
        self.restarts += 1
        previous = self.tracker.last_applied
        log.warning("engine restarted (last applied seq %s, new process at %d): withdrawing its holdings",
                    previous, new_seq)
        await self._emit(PublisherRestarted(previous if previous is not None else -1, new_seq))
        self.tracker.reset()
        self._last_payload = None

    def _skip_to(self, seq: int) -> None:
        self.tracker.skip_to(seq)
        self._last_payload = None  # no longer the payload of last_applied

    async def _deliver(self, seq: int, payload: bytes) -> None:
        self.tracker.applied(seq)
        self._last_payload = payload
        try:
            decoder = PayloadDecoder(payload, seq, coalesce=self._coalesce)
            while not decoder.step(DECODE_SLICE_EVENTS):
                await asyncio.sleep(0)  # a huge batch: let QUIC keep-alives and load reports run
        except KvEventError as exc:
            await self._emit(BatchRejected(seq, str(exc)))
            return
        assert decoder.result is not None
        await self._emit(decoder.result)

    # -- replay -------------------------------------------------------------------------------

    async def catch_up(self) -> int | None:
        """Apply whatever the replay socket holds past the last applied batch, checking the
        publisher first. Returns the newest seq the replay socket holds (-1 if none), or None
        when there is no replay socket or it did not answer."""
        if self._replay_endpoint is None:
            return None
        self.catch_ups += 1
        before = self.delivered
        try:
            newest = await self._catch_up()
        except _ReplayFailed as exc:
            if not self.replay_failing:  # once per outage, not on every idle tick
                log.warning("replay from the engine failed: %s", exc)
            self.replay_failing = True
            return None
        if self.replay_failing:
            log.info("the engine's replay socket answers again")
            self.replay_failing = False
        if self.delivered > before:
            self.replays += 1
            log.info("replay delivered %d batch(es)", self.delivered - before)
        return newest

    async def _catch_up(self) -> int:
        last = self.tracker.last_applied
        verify = last is not None and self._last_payload is not None
        start = last if verify else self.tracker.expected
        newest = -1
        async with self._replay(start) as replies:
            first = True
            async for reply in replies:
                newest = reply.seq
                if first and verify:
                    first = False
                    if reply.seq == last:
                        if reply.payload == self._last_payload:
                            continue  # the same process: go on with what follows
                        await self._restarted(-1)
                        return await self._catch_up_after_restart()
                    # the buffer no longer reaches our last batch: cannot compare, take it as
                    # the same process (what was between is reported lost below)
                first = False
                await self._apply_replayed(reply)
        if verify and newest == -1:
            # nothing at or after our last seq: a new process whose counter is below ours
            await self._restarted(-1)
            return await self._catch_up_after_restart()
        return newest

    async def _catch_up_after_restart(self) -> int:
        newest = -1
        async with self._replay(0) as replies:
            async for reply in replies:
                newest = reply.seq
                await self._apply_replayed(reply)
        return newest

    async def _apply_replayed(self, reply: ReplayedBatch) -> None:
        check = self.tracker.check_replayed(reply.seq)
        if check.verdict is SeqVerdict.DUPLICATE:
            return
        if check.verdict is SeqVerdict.GAP:  # the buffer no longer reaches back
            await self._emit(BatchesLost(check.missing_from, check.missing_to))
            self._skip_to(reply.seq)
        await self._deliver(reply.seq, reply.payload)

    @contextlib.asynccontextmanager
    async def _replay(self, start: int) -> AsyncIterator[AsyncIterator[ReplayedBatch]]:
        """Ask for every buffered batch from ``start``; a fresh DEALER per request keeps late
        answers of a timed-out request from leaking into the next one."""
        assert self._replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)

        async def replies() -> AsyncIterator[ReplayedBatch]:
            while True:
                try:
                    async with asyncio.timeout(self._replay_timeout):  # see run(): never wait_for
                        frames = await dealer.recv_multipart()
                    reply = decode_replay_reply(frames, topic=self._topic)
                except TimeoutError:
                    raise _ReplayFailed(f"no answer within {self._replay_timeout}s (asked from seq {start})") from None
                except NegativeReplaySeq as exc:
                    # The engine buffered a batch under a seq no counter of its produces, and
                    # answers it to every replay (it is >= any start, read unsigned) until it
                    # leaves the buffer: skip it, or every catch-up would fail meanwhile.
                    if exc.seq not in self._odd_replayed and len(self._odd_replayed) < 64:
                        self._odd_replayed.add(exc.seq)
                        log.warning("skipping a replayed batch with seq %d (negative: engines count up from 0)",
                                    exc.seq)
                    continue
                except KvEventError as exc:
                    raise _ReplayFailed(f"bad reply: {exc}") from None
                if isinstance(reply, ReplayEnded):
                    return
                yield reply

        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart(replay_request_frames(start))
            yield replies()
        finally:
            dealer.close(linger=0)


async def run_subscriber(subscriber: KvEventSubscriber) -> None:
    """Run until cancelled, swallowing the cancellation (for ``asyncio.TaskGroup`` shells)."""
    with contextlib.suppress(asyncio.CancelledError):
        await subscriber.run()
