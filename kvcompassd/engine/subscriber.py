"""Asyncio ZMQ client of an engine's KV-event stream: SUB for live batches, DEALER for replay.

An asyncio shell around the sans-IO :mod:`kvcompassd.engine.kvevents` codec and
:class:`~kvcompassd.engine.kvevents.SequenceTracker`. The callback receives, strictly in order:

- :class:`~kvcompassd.engine.kvevents.EventBatch` — the next batch, each seq exactly once;
- :class:`PublisherRestarted` — the live seq went back (a new engine process): withdraw
  everything, the batches that follow belong to the new process;
- :class:`BatchesLost` — a range the replay buffer could not supply (state may be stale);
- :class:`BatchRejected` — a batch whose payload did not decode (its seq is consumed).

On a gap the subscriber asks the replay socket for everything from the first missing seq,
applies what it gets in order and drops duplicates; live messages wait in the SUB queue
meanwhile. A fresh DEALER per replay keeps late answers of a timed-out replay from leaking
into the next one.

Restarts: a live seq below the last one is a new publisher. But a restarted engine may have
published past the old seq before ZMQ reconnects, so the seq alone cannot tell. The SUB
socket's monitor reports TCP disconnects; after one, the next live message is checked by asking
the replay socket for the last applied seq: the same process answers with the same bytes, a new
one with other bytes (its batches carry other timestamps) or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcompassd.engine.kvevents import (
    EventBatch,
    KvEventError,
    ReplayedBatch,
    ReplayEnded,
    SeqVerdict,
    SequenceTracker,
    decode_payload,
    decode_replay_reply,
    decode_seq,
    replay_request_frames,
)

log = logging.getLogger(__name__)
_monitor_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """The live sequence went back from ``previous_seq`` to ``new_seq``."""

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


SubscriberItem = EventBatch | PublisherRestarted | BatchesLost | BatchRejected
Callback = Callable[[SubscriberItem], Awaitable[None] | None]


class KvEventSubscriber:
    """Follows one engine's KV events; ``run()`` until cancelled."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        callback: Callback,
        *,
        topic: str = "kv-events",
        replay_timeout: float = 2.0,
        idle_probe: float | None = 1.0,
        context: zmq.asyncio.Context | None = None,
        drop: Callable[[int], bool] | None = None,
    ) -> None:
        """``drop(seq) -> bool`` discards matching live messages on arrival: fault injection
        for tests and chaos runs (it exercises the replay path exactly as real loss does)."""
        self._ctx = context or zmq.asyncio.Context.instance()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._callback = callback
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        # A gap shows only when a later batch arrives: if the last batches before a quiet spell
        # were lost, nothing would ever reveal them. After this long without a live batch, ask
        # the replay socket for anything past the last applied one.
        self._idle_probe = idle_probe
        self.tail_probes = 0
        self._drop = drop
        self.tracker = SequenceTracker()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._last_digest: bytes | None = None
        self.replays = 0
        self.delivered = 0
        self.disconnects = 0

    async def _emit(self, item: SubscriberItem) -> None:
        result = self._callback(item)
        if inspect.isawaitable(result):
            await result
        if isinstance(item, EventBatch):
            self.delivered += 1

    def connect(self) -> None:
        """Connect the SUB socket (``run`` does it too); call early to shorten ZMQ's join delay."""
        if self._sub is None:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            address = f"inproc://kvcompassd-sub-monitor-{id(self)}-{next(_monitor_ids)}"
            self._sub.monitor(address, zmq.EVENT_DISCONNECTED)
            # a plain socket on the same context: drained without awaiting, before each message
            self._monitor = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            self._sub.connect(self._endpoint)

    def _disconnected(self) -> bool:
        seen = False
        while self._monitor is not None and self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                seen = True
                self.disconnects += 1
        return seen

    async def run(self) -> None:
        self.connect()
        assert self._sub is not None
        try:
            while True:
                if self._idle_probe is None:
                    frames = await self._sub.recv_multipart()
                else:
                    # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the result
                    # of an inner future that completed as the task was cancelled, swallowing
                    # the cancellation, and this loop would then run forever.
                    try:
                        async with asyncio.timeout(self._idle_probe):
                            frames = await self._sub.recv_multipart()
                    except TimeoutError:
                        await self._probe_tail()
                        continue
                await self.handle_live(frames)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
            if self._monitor is not None:
                self._monitor.close(linger=0)
                self._monitor = None

    async def handle_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self._topic:
            log.warning("ignoring a live message of %d frames on topic %r", len(frames), frames[0] if frames else b"")
            return
        try:
            seq = decode_seq(frames[1])
        except KvEventError as exc:
            log.warning("ignoring a live message: %s", exc)
            return
        if self._drop is not None and self._drop(seq):
            return
        previous = self.tracker.last_live
        if self._disconnected() and await self._publisher_changed():
            await self._emit(PublisherRestarted(previous if previous is not None else -1, seq))
            self.tracker.reset()
            self._last_digest = None
        check = self.tracker.check_live(seq)
        if check.verdict is SeqVerdict.RESTART:
            await self._emit(PublisherRestarted(previous if previous is not None else -1, seq))
            self._last_digest = None
            check = self.tracker.check_live(seq)
        if check.verdict is SeqVerdict.DUPLICATE:
            return
        if check.verdict is SeqVerdict.GAP:
            await self._recover(check.missing_from, seq)
            if self.tracker.check_replayed(seq).verdict is not SeqVerdict.NEXT:
                return  # the replay already delivered it
        await self._deliver(seq, frames[2])

    async def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_payload(payload, seq)
        except KvEventError as exc:
            self.tracker.applied(seq)
            await self._emit(BatchRejected(seq, str(exc)))
            return
        self.tracker.applied(seq)
        self._last_digest = hashlib.blake2b(payload, digest_size=16).digest()
        await self._emit(batch)

    async def _publisher_changed(self) -> bool:
        """After a reconnect: does the replay socket still hold our last batch, byte for byte?"""
        last = self.tracker.last_applied
        if self._replay_endpoint is None or last is None or self._last_digest is None:
            return False  # nothing to compare: only a seq going back reveals a restart
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart(replay_request_frames(last))
            async with asyncio.timeout(self._replay_timeout):  # see run(): never wait_for
                frames = await dealer.recv_multipart()
            reply = decode_replay_reply(frames)
        except (TimeoutError, KvEventError) as exc:
            log.warning("could not check the publisher after a reconnect: %r", exc)
            return False
        finally:
            dealer.close(linger=0)
        if isinstance(reply, ReplayedBatch) and reply.seq == last:
            return hashlib.blake2b(reply.payload, digest_size=16).digest() != self._last_digest
        # the same process would still buffer the batch it sent last (buffers drop the oldest)
        return True

    async def _probe_tail(self) -> None:
        """Deliver batches the replay socket holds past the last applied one (lost tail)."""
        last = self.tracker.last_applied
        if self._replay_endpoint is None or last is None:
            return
        self.tail_probes += 1
        before = self.delivered
        try:
            async with asyncio.timeout(self._replay_timeout):
                await self._replay_from(last + 1)
        except TimeoutError:
            log.warning("tail probe from seq %d timed out", last + 1)
        if self.delivered > before:
            self.replays += 1
            log.warning("recovered %d batch(es) lost before a quiet spell", self.delivered - before)

    async def _recover(self, first_missing: int, live_seq: int) -> None:
        """Replay ``first_missing..live_seq-1`` (and whatever follows) or report it lost."""
        if self._replay_endpoint is not None:
            self.replays += 1
            try:
                async with asyncio.timeout(self._replay_timeout):
                    await self._replay_from(first_missing)
            except TimeoutError:
                log.warning("replay from seq %d timed out", first_missing)
        expected = 0 if self.tracker.last_applied is None else self.tracker.last_applied + 1
        if expected < live_seq:
            await self._emit(BatchesLost(expected, live_seq - 1))
            self.tracker.skip_to(live_seq)

    async def _replay_from(self, start: int) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart(replay_request_frames(start))
            while True:
                reply = decode_replay_reply(await dealer.recv_multipart())
                if isinstance(reply, ReplayEnded):
                    return
                check = self.tracker.check_replayed(reply.seq)
                if check.verdict is SeqVerdict.DUPLICATE:
                    continue
                if check.verdict is SeqVerdict.GAP:  # the buffer no longer reaches back
                    await self._emit(BatchesLost(check.missing_from, check.missing_to))
                    self.tracker.skip_to(reply.seq)
                await self._deliver(reply.seq, reply.payload)
        except KvEventError as exc:
            log.warning("bad replay reply: %s", exc)
        finally:
            dealer.close(linger=0)


async def run_subscriber(subscriber: KvEventSubscriber) -> None:
    """Run until cancelled, swallowing the cancellation (for ``asyncio.TaskGroup`` shells)."""
    with contextlib.suppress(asyncio.CancelledError):
        await subscriber.run()
