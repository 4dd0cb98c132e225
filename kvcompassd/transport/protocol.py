"""The exchange protocol of one connection, without I/O (as aioquic's ``QuicConnection`` is).

Stream data and datagrams go in; events come out: messages for the control channel, the
datagram channel or an exchange, an exchange's remote END or ABORT, rejections (with the
``ErrorReported`` frame to send back), corrupt and abandoned streams. Messages and exchanges to
send go in; frame bytes for a QUIC stream come out. No asyncio, no sockets, no aioquic: the
asyncio protocol (``connection.py``) moves the bytes and turns the events into deliveries.

Rules:
- nothing is read from a peer before its identity is known (:meth:`identify`); every message
  passes ``wire.check_sender`` for the peer's certified role;
- a malformed or forbidden frame is answered with ``ErrorReported`` on its own exchange (or on
  the control channel) and the connection carries on; a frame length out of bounds loses the
  stream's framing, so that QUIC stream alone is abandoned;
- an exchange is keyed by (QUIC stream, exchange id); one the peer opens is accepted on its first
  frame with a body, up to ``max_incoming_exchanges`` at once (more are refused once each);
- late frames for an exchange of ours that is already finished are ignored.

Exchanges are opaque handles of the caller's (``open_incoming`` makes one for each exchange the
peer opens; :meth:`register_outgoing` records the caller's own), so events name them directly.
Events come out of a generator: the caller handles each before the next frame is read, so a
handle it forgets while handling an event is no longer found by the frames after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvcompassd.transport.framing import (
    CONTROL_EXCHANGE,
    MAX_EXCHANGE_ID,
    Frame,
    FrameDecoder,
    FrameError,
    StreamCorrupt,
    encode_frame,
)
from kvcompassd.wire import ErrorReported, Message, Role, WireError, WireForbidden, check_sender, decode, encode

Handle = TypeVar("Handle")
ExchangeKey = tuple[int, int]  # (QUIC stream id, exchange id)


@dataclass(frozen=True, slots=True)
class ControlReceived:
    """A message on the peer's ordered control channel."""

    message: Message


@dataclass(frozen=True, slots=True)
class DatagramReceived:
    """A message in a QUIC datagram."""

    message: Message


@dataclass(frozen=True, slots=True)
class ExchangeMessageReceived:
    """A message on an exchange: a reply (``incoming`` False) or a request on one the peer opened."""

    exchange: Any
    incoming: bool
    message: Message


@dataclass(frozen=True, slots=True)
class ExchangeEnded:
    """The peer will send nothing more on the exchange."""

    exchange: Any


@dataclass(frozen=True, slots=True)
class ExchangeAborted:
    """The peer abandoned the exchange."""

    exchange: Any


@dataclass(frozen=True, slots=True)
class FrameRejected:
    """A frame was refused: ``frame`` (an ``ErrorReported``) goes back on ``stream_id``."""

    code: str
    detail: str
    exchange_id: int
    stream_id: int
    frame: bytes


@dataclass(frozen=True, slots=True)
class StreamCorrupted:
    """The QUIC stream's framing is lost: stop reading it (its exchanges follow as abandoned)."""

    stream_id: int
    detail: str


@dataclass(frozen=True, slots=True)
class StreamAbandoned:
    """A QUIC stream is gone (ended, reset, corrupt): its exchanges are lost."""

    stream_id: int
    reason: str
    exchanges: tuple[Any, ...]


ProtocolEvent = (ControlReceived | DatagramReceived | ExchangeMessageReceived | ExchangeEnded | ExchangeAborted
                 | FrameRejected | StreamCorrupted | StreamAbandoned)


class ExchangeProtocol(Generic[Handle]):
    """Framing and exchange routing of one connection (see the module's rules)."""

    def __init__(
        self,
        *,
        is_client: bool,
        next_stream_id: Callable[[], int],
        open_incoming: Callable[[int, int], Handle],
        max_incoming_exchanges: int,
        exchange_streams: int,
    ) -> None:
        self.is_client = is_client
        self._next_stream_id = next_stream_id  # the QUIC connection's next unused stream id
        self._open_incoming = open_incoming
        self.max_incoming_exchanges = max_incoming_exchanges
        self.exchange_streams = exchange_streams
        self.peer_role: Role | None = None
        self.outgoing: dict[ExchangeKey, Handle] = {}
        self.incoming: dict[ExchangeKey, Handle] = {}
        self._decoders: dict[int, FrameDecoder] = {}
        self._control_stream: int | None = None
        self._exchange_pool: list[int] = []
        self._round_robin = 0
        self._next_exchange = 1

    def identify(self, role: Role) -> None:
        """The peer's certified role: from now on its frames are read."""
        self.peer_role = role

    # ---- receiving ----------------------------------------------------------------------------

    def receive_stream_data(self, stream_id: int, data: bytes, end_stream: bool) -> Iterator[ProtocolEvent]:
        if self.peer_role is None:
            return  # nothing is read from a peer we have not identified
        decoder = self._decoders.get(stream_id)
        if decoder is None:
            decoder = self._decoders[stream_id] = FrameDecoder()
        try:
            for item in decoder.feed(data):
                if isinstance(item, FrameError):
                    reply_stream = stream_id if item.exchange != CONTROL_EXCHANGE else None
                    yield self._reject("malformed", str(item), reply_stream, item.exchange)
                else:
                    yield from self._on_frame(stream_id, item)
        except StreamCorrupt as exc:
            yield self._reject("oversize", f"stream {stream_id} abandoned: {exc}", None, CONTROL_EXCHANGE)
            yield StreamCorrupted(stream_id, str(exc))
            yield self.abandon_stream(stream_id, str(exc))
        if end_stream:
            yield self.abandon_stream(stream_id, "peer ended the stream")

    def receive_datagram(self, data: bytes) -> Iterator[ProtocolEvent]:
        if self.peer_role is None:
            return
        message = yield from self._decode_checked(data, None, CONTROL_EXCHANGE)
        if message is not None:
            yield DatagramReceived(message)

    def _on_frame(self, stream_id: int, frame: Frame) -> Iterator[ProtocolEvent]:
        if frame.exchange == CONTROL_EXCHANGE:
            if frame.body:
                message = yield from self._decode_checked(frame.body, None, CONTROL_EXCHANGE)
                if message is not None:
                    yield ControlReceived(message)
            return
        key = (stream_id, frame.exchange)
        handle = self.outgoing.get(key)
        incoming = handle is None
        if incoming:
            handle = self.incoming.get(key)
            if handle is None:
                if self.is_local_stream(stream_id):
                    return  # late frame for an exchange of ours that is already finished
                if not frame.body:
                    return  # a bare END for an exchange never opened: nothing to deliver or keep
                if len(self.incoming) >= self.max_incoming_exchanges:
                    # refused once, on the exchange's first frame (the next ones have no place)
                    yield self._reject("unavailable", "too many open exchanges on this connection", stream_id,
                                       frame.exchange)
                    return
                handle = self.incoming[key] = self._open_incoming(stream_id, frame.exchange)
        if frame.abort:
            yield ExchangeAborted(handle)
            return
        if frame.body:
            message = yield from self._decode_checked(frame.body, stream_id, frame.exchange)
            if message is not None:
                yield ExchangeMessageReceived(handle, incoming, message)
        if frame.end:
            yield ExchangeEnded(handle)

    def _decode_checked(self, body: bytes, reply_stream: int | None, reply_exchange: int):
        try:
            message = decode(body)
            check_sender(self.peer_role, message)  # type: ignore[arg-type]
        except WireForbidden as exc:
            yield self._reject("forbidden", str(exc), reply_stream, reply_exchange)
            return None
        except WireError as exc:
            yield self._reject("malformed", str(exc), reply_stream, reply_exchange)
            return None
        return message

    def _reject(self, code: str, detail: str, reply_stream: int | None, reply_exchange: int) -> FrameRejected:
        body = encode(ErrorReported(code=code, detail=detail[:4000]))
        if reply_stream is None or reply_exchange == CONTROL_EXCHANGE:
            reply_stream, reply_exchange = self.control_stream(), CONTROL_EXCHANGE
        return FrameRejected(code, detail, reply_exchange, reply_stream, encode_frame(reply_exchange, body))

    def abandon_stream(self, stream_id: int, reason: str) -> StreamAbandoned:
        """The QUIC stream is gone (the peer reset or ended it, or its framing is lost)."""
        self._decoders.pop(stream_id, None)
        lost = []
        for table in (self.outgoing, self.incoming):
            for key in [k for k in table if k[0] == stream_id]:
                lost.append(table.pop(key))
        if stream_id == self._control_stream:
            self._control_stream = None
        if stream_id in self._exchange_pool:
            self._exchange_pool.remove(stream_id)
        return StreamAbandoned(stream_id, reason, tuple(lost))

    def close(self) -> tuple[Handle, ...]:
        """The connection is gone: every exchange still open, now forgotten."""
        lost = (*self.outgoing.values(), *self.incoming.values())
        self.outgoing.clear()
        self.incoming.clear()
        return lost

    # ---- sending ------------------------------------------------------------------------------

    def is_local_stream(self, stream_id: int) -> bool:
        # Bit 0 of a QUIC stream id is 0 for client-initiated streams.
        return (stream_id & 1) == (0 if self.is_client else 1)

    def control_stream(self) -> int:
        if self._control_stream is None:
            # Only reserved by the first send, which every caller does immediately.
            self._control_stream = self._next_stream_id()
        return self._control_stream

    def pick_exchange_stream(self) -> int:
        """The pooled QUIC stream the next exchange of ours goes on (round-robin)."""
        self._round_robin = (self._round_robin + 1) % self.exchange_streams
        if self._round_robin < len(self._exchange_pool):
            return self._exchange_pool[self._round_robin]
        stream_id = self._next_stream_id()
        self._exchange_pool.append(stream_id)
        return stream_id

    def new_exchange_id(self) -> int:
        exchange = self._next_exchange
        self._next_exchange = exchange + 1 if exchange < MAX_EXCHANGE_ID else 1
        return exchange

    def register_outgoing(self, stream_id: int, exchange_id: int, handle: Handle) -> None:
        self.outgoing[(stream_id, exchange_id)] = handle

    def forget(self, stream_id: int, exchange_id: int, *, incoming: bool) -> None:
        """Both sides have closed the exchange."""
        (self.incoming if incoming else self.outgoing).pop((stream_id, exchange_id), None)

    @staticmethod
    def frame(exchange_id: int, body: bytes, *, end: bool = False, abort: bool = False) -> bytes:
        """The bytes of one frame to send on the exchange's QUIC stream."""
        return encode_frame(exchange_id, body, end=end, abort=abort)
