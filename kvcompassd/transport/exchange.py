"""Exchanges: request/response conversations multiplexed on a connection's shared streams,
and the in-order delivery of received messages to the node's handler."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import structlog

from kvcompassd.transport.base import PeerUnavailable, StreamClosed
from kvcompassd.wire import Message, encode

if TYPE_CHECKING:
    from kvcompassd.transport.connection import QuicConnectionTransport
    from kvcompassd.transport.node import Peer

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ChannelInfo:
    """How a message arrived: on the peer's ordered control channel, on an exchange (reply with
    ``stream.send``), or as an unordered, possibly lost datagram."""

    kind: Literal["control", "exchange", "datagram"]
    stream: FrameStream | None = None


OnMessage = Callable[["Peer", Message, ChannelInfo], Awaitable[None] | None]


class SerialDispatcher:
    """Hands one channel's messages to the handler in arrival order, awaiting async handlers,
    so that a slow handler on one exchange never delays another exchange."""

    __slots__ = ("_handler", "_queue", "_task", "_on_failure")

    def __init__(self, handler: OnMessage, on_failure: Callable[[Exception], None] | None = None) -> None:
        self._handler = handler
        self._queue: deque[tuple[Any, Message, ChannelInfo]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._on_failure = on_failure

    def put(self, peer: Peer, message: Message, channel: ChannelInfo) -> None:
        self._queue.append((peer, message, channel))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queue:
                peer, message, channel = self._queue.popleft()
                try:
                    result = self._handler(peer, message, channel)
                    if inspect.isawaitable(result):
                        await result
                except Exception as exc:  # a handler bug must not take the connection down
                    log.exception("message_handler_failed", peer=str(peer.identity), message=type(message).__name__)
                    if self._on_failure is not None:
                        self._on_failure(exc)
        finally:
            self._task = None

    def cancel(self) -> None:
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()


_END = object()


class FrameStream:
    """One exchange with a peer: an ordered conversation multiplexed on a shared QUIC stream.

    The side that opened it (``peer.open_stream()``) sends and reads replies with
    ``async for message in stream``; the accepting side receives each message through the
    node's ``on_message`` callback (``channel.stream is`` this object) and answers with
    ``send``. Either side calls ``close()`` when it has nothing more to send; the exchange is
    forgotten once both have. Iteration ends when the peer closes its side, and raises
    :class:`PeerUnavailable` if the connection is lost first. ``abort()`` abandons the
    exchange (the initiator's way to cancel a request whose user went away): the other side's
    next ``send`` raises :class:`StreamClosed`, and ``wait_aborted()`` lets it stop sooner.
    """

    def __init__(self, connection: QuicConnectionTransport, exchange: int, *, incoming: bool, stream_id: int | None) -> None:
        self._connection = connection
        self.exchange = exchange
        self.incoming = incoming
        self._stream_id = stream_id
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.local_closed = False
        self.remote_closed = False
        self.aborted = False  # the peer abandoned the exchange: sending on it raises StreamClosed
        self._aborted_event = asyncio.Event()
        self.dispatcher: SerialDispatcher | None = None

    @property
    def peer(self) -> Peer:
        return self._connection.peer

    async def send(self, message: Message, *, end: bool = False) -> None:
        """Send ``message`` (and close our side if ``end``), first waiting while the
        connection's unacknowledged bytes exceed ``TransportOptions.send_buffer_limit``."""
        self._connection.check_outgoing(message)
        body = encode(message)
        await self._connection.wait_send_buffer()
        self.send_encoded(body, end=end)

    def send_encoded(self, body: bytes, *, end: bool = False) -> None:
        """Send a message already encoded with ``wire.encode`` (encode once, send to many)."""
        if self.local_closed:
            if self.aborted:
                raise StreamClosed(f"exchange {self.exchange} was abandoned by the peer")
            raise StreamClosed(f"exchange {self.exchange} already closed by this side")
        if self._stream_id is None:
            self._stream_id = self._connection.pick_exchange_stream()
            self._connection.register_outgoing(self._stream_id, self)
        self._connection.send_frame(self._stream_id, self.exchange, body, end=end)
        if end:
            self._mark_local_closed()

    async def close(self) -> None:
        """Tell the peer we will send nothing more (idempotent; a no-op once the link is gone)."""
        if self.local_closed:
            return
        if self._stream_id is None:  # never sent anything: nothing to tell the peer
            self._mark_local_closed()
            return
        try:
            self._connection.send_frame(self._stream_id, self.exchange, b"", end=True)
        except PeerUnavailable:
            pass
        self._mark_local_closed()

    def abort(self) -> None:
        """Abandon the exchange: tell the peer to stop sending (its next send on the exchange
        raises StreamClosed) and end our own iteration. Idempotent."""
        if self.local_closed and self.remote_closed:
            return
        if self._stream_id is not None and not self._connection.terminated:
            try:
                self._connection.send_frame(self._stream_id, self.exchange, b"", abort=True)
            except PeerUnavailable:
                pass
        self.local_closed = True
        self._mark_remote_closed()

    async def wait_aborted(self) -> None:
        """Return once the peer abandons the exchange or the connection is lost (for a handler
        that wants to stop work early rather than at its next send)."""
        await self._aborted_event.wait()

    async def receive(self) -> Message | None:
        """The next message, or None once the peer closed its side."""
        if self.incoming:
            raise RuntimeError("an accepted exchange delivers its messages to on_message")
        item = await self._inbox.get()
        if item is _END:
            self._inbox.put_nowait(_END)  # keep returning None
            return None
        if isinstance(item, Exception):
            self._inbox.put_nowait(item)
            raise item
        return item

    def __aiter__(self) -> FrameStream:
        return self

    async def __anext__(self) -> Message:
        message = await self.receive()
        if message is None:
            raise StopAsyncIteration
        return message

    async def __aenter__(self) -> FrameStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # Called by the connection.
    def _deliver(self, message: Message) -> None:
        self._inbox.put_nowait(message)

    def _mark_remote_closed(self) -> None:
        if not self.remote_closed:
            self.remote_closed = True
            self._inbox.put_nowait(_END)
            self._connection.forget_if_done(self)

    def _mark_aborted(self) -> None:
        self.aborted = True
        self._aborted_event.set()
        self.local_closed = True
        if not self.incoming and not self.remote_closed:
            self.remote_closed = True
            self._inbox.put_nowait(StreamClosed(f"exchange {self.exchange} was abandoned by the peer"))
        self._mark_remote_closed()
        self._connection.forget_if_done(self)

    def _mark_local_closed(self) -> None:
        self.local_closed = True
        self._connection.forget_if_done(self)

    def _fail(self, error: Exception) -> None:
        if not self.remote_closed:
            self.remote_closed = True
            self._inbox.put_nowait(error)
        self.local_closed = True
        self._aborted_event.set()  # nothing more will happen on this exchange
