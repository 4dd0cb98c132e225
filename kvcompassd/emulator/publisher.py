"""ZMQ KV-event publisher of the emulated worker: the engines' ``ZmqEventPublisher``, in asyncio.

PUB socket: each batch is ``[topic, seq (8-byte big-endian), msgpack payload]``, seq counting
from 0 per process (a restarted engine starts again at 0, without an ``AllBlocksCleared``: its
cache is simply empty). ROUTER replay socket: ``[identity, "", start_seq]`` is answered with
every buffered batch ``seq >= start_seq`` as ``[identity, "", topic, seq, payload]`` and then
the end marker ``[identity, "", "", -1, ""]``; the buffer keeps the last ``buffer_steps``
batches. These are the bytes SGLang's and vLLM's publishers send (``tests/test_publisher.py``
compares them with the committed captures); the topic defaults to theirs, empty.

``withhold_live(seq) -> bool`` keeps matching batches off the PUB socket (they are still
buffered for replay): what a PUB at its high-water mark or a lossy link does to a subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

import zmq
import zmq.asyncio

from kvcompassd.engine.kvevents import (
    KvEvent,
    KvEventError,
    encode_payload,
    encode_seq,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)

log = logging.getLogger(__name__)


class KvEventPublisher:
    """Publishes KV-event batches and answers replay requests."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        style: Literal["map", "positional"] = "map",
        dp_rank: int | None = 0,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
        withhold_live: Callable[[int], bool] | None = None,
    ) -> None:
        self._ctx = context or zmq.asyncio.Context.instance()
        self.withhold_live = withhold_live  # settable while running (fault injection)
        self._topic = topic.encode()
        self._style = style
        self._dp_rank = dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._requested = (endpoint, replay_endpoint)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = ""
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self, *, bind_timeout: float = 5.0) -> None:
        """Bind both sockets (``*`` as the port picks a free one) and serve replays. ZMQ
        releases a closed socket's port in its I/O thread, so a bind right after a restart in
        the same process may briefly find the port busy: retry until ``bind_timeout``."""
        endpoint, replay_endpoint = self._requested
        self.endpoint = await _bind(self._pub, endpoint, bind_timeout)
        if self._replay is not None and replay_endpoint:
            self.replay_endpoint = await _bind(self._replay, replay_endpoint, bind_timeout)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Iterable[KvEvent], *, ts: float | None = None) -> int | None:
        """Publish one batch (nothing for an empty one); returns its seq. Never blocks: a PUB
        socket drops at its high-water mark, and the replay buffer covers that."""
        events = list(events)
        if not events:
            return None
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_payload(time.time() if ts is None else ts, events, dp_rank=self._dp_rank, style=self._style)
        self._buffer.append((seq, payload))
        if self.withhold_live is not None and self.withhold_live(seq):
            self.published += 1
            return seq
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("PUB high-water mark reached; batch %d only in the replay buffer", seq)
        self.published += 1
        return seq

    def buffered(self) -> list[tuple[int, bytes]]:
        """The replay buffer: (seq, payload) of the last ``buffer_steps`` batches, oldest first."""
        return list(self._buffer)

    def send_frames(self, frames: list[bytes]) -> None:
        """Put arbitrary frames on the PUB socket: fault injection (odd sequence numbers)."""
        self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            try:
                identity, start = parse_replay_request(frames)
            except KvEventError as exc:
                log.warning("bad replay request: %s", exc)
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(replay_reply_frames(identity, self._topic, seq, payload))
            await self._replay.send_multipart(replay_end_frames(identity))

    async def close(self) -> None:
        """Stop serving and close both sockets, unbinding first so the ports free up soon."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for socket, bound in ((self._pub, self.endpoint), (self._replay, self.replay_endpoint)):
            if socket is not None:
                if bound:
                    with contextlib.suppress(zmq.ZMQError):
                        socket.unbind(bound)
                socket.close(linger=0)


async def _bind(socket: zmq.asyncio.Socket, endpoint: str, timeout: float) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            socket.bind(endpoint)
            return socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or loop.time() >= deadline:
                raise
            await asyncio.sleep(0.02)
