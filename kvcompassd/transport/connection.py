"""One authenticated QUIC connection: identity check, framing, dispatch, exchanges.

Stream budget (DESIGN §6): aioquic walks *every open stream* for every packet it builds, so a
connection with hundreds of open streams is CPU-bound. Exchanges (request/response
conversations such as a forwarded prompt and its streamed answer) therefore do not get a QUIC
stream each: a node multiplexes all the exchanges it opens on a connection over a small pool of
long-lived streams (``TransportOptions.exchange_streams``, default 4), round-robin, with the
exchange id in every frame. Each side also keeps one ordered control stream. So a connection
never has more than ``2 * (exchange_streams + 1)`` open streams however many requests are in
flight, and long streamed responses cannot exhaust a stream budget.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from kvcompassd.certs import CertError, peer_identity
from kvcompassd.transport.aioquic_tweaks import (
    elicit_ack_for_ack_only_backlog,
    install_pacer,
    last_ack_eliciting_sent,
    peer_certificate,
    request_client_certificate,
    set_ack_delay,
    tracked_sent_packets,
    tracked_streams,
    unacknowledged_stream_bytes,
    verify_peer_chain,
)
from kvcompassd.transport.base import (
    APP_ERROR_REFUSED,
    MAX_DATAGRAM_PAYLOAD,
    STREAM_ERROR_CORRUPT,
    PeerUnavailable,
    TransportError,
)
from kvcompassd.transport.exchange import ChannelInfo, FrameStream, SerialDispatcher
from kvcompassd.transport.framing import (
    CONTROL_EXCHANGE,
    MAX_EXCHANGE_ID,
    Frame,
    FrameDecoder,
    FrameError,
    StreamCorrupt,
    encode_frame,
)
from kvcompassd.wire import ErrorReported, Message, NodeIdentity, Role, WireError, WireForbidden, check_sender, decode, encode

if TYPE_CHECKING:
    from kvcompassd.transport.node import Peer, QuicNode

log = structlog.get_logger(__name__)


class QuicConnectionTransport(QuicConnectionProtocol):
    """asyncio protocol of one kvcompass QUIC connection (client or server side)."""

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: Any = None,
        *,
        node: QuicNode,
        outbound: bool,
        expected_role: Role | None = None,
        expected_id: str | None = None,
    ) -> None:
        super().__init__(quic)
        install_pacer(quic, node.options.pacing)
        if not outbound:
            request_client_certificate(quic)
        self.node = node
        self.outbound = outbound
        self.expected_role = expected_role
        self.expected_id = expected_id
        self.identity: NodeIdentity | None = None
        self.peer: Peer = None  # type: ignore[assignment]  # set by the node once identified
        self.refusal: str | None = None
        self.close_reason = ""
        self.terminated = False
        self._decoders: dict[int, FrameDecoder] = {}
        self._control_stream: int | None = None
        self._exchange_pool: list[int] = []
        self._round_robin = 0
        self._next_exchange = 1
        self._outgoing: dict[tuple[int, int], FrameStream] = {}
        self._incoming: dict[tuple[int, int], FrameStream] = {}
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._keepalive: asyncio.TimerHandle | None = None
        self._control = SerialDispatcher(node.deliver)
        self._datagrams = SerialDispatcher(node.deliver)

    # ---- identity ---------------------------------------------------------------------------

    def _verify_peer(self) -> None:
        cert, chain = peer_certificate(self._quic)
        try:
            if cert is None:
                raise ValueError("the peer presented no certificate")
            # aioquic already checks a server's chain on the client side, but never a client's
            # chain on the server side; checking both ways costs one verification per connection.
            verify_peer_chain(cert, chain, self.node.ca_pem)
            identity = peer_identity(cert)
        except (ValueError, CertError) as exc:
            self._refuse(f"certificate refused: {exc}")
            return
        if self.expected_role is not None and identity.role != self.expected_role:
            self._refuse(f"expected a {self.expected_role.value} node, peer is {identity}")
            return
        if self.expected_id is not None and identity.node_id != self.expected_id:
            self._refuse(f"expected node {self.expected_id!r}, peer is {identity}")
            return
        self.identity = identity
        self._schedule_keepalive()
        if not self.outbound:
            self.node.accept_inbound(self)

    def _refuse(self, reason: str) -> None:
        self.refusal = reason
        log.warning("peer_refused", reason=reason, address=str(self._quic.get_peer_address()), outbound=self.outbound)
        self.close(error_code=APP_ERROR_REFUSED, reason_phrase=reason[:256])

    # ---- events -----------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic's version transmits after every datagram; the event loop reads many datagrams
        # per wake-up, so one transmit per loop turn answers them all (one packet with the
        # acknowledgements and any replies, where aioquic would build and send several).
        self._quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        self._transmit_soon()
        if self._drain_waiters:  # acknowledgements may have freed send buffer
            self._wake_drain_waiters()

    def transmit(self) -> None:
        super().transmit()
        # A side that only receives sends only ACKs, which nothing acknowledges: ask for an
        # ACK before aioquic's record of them grows without bound (aioquic_tweaks, item 4).
        if not self.terminated and elicit_ack_for_ack_only_backlog(self._quic):
            super().transmit()

    def _wake_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        # Deliberately not calling super(): its asyncio StreamReader plumbing is unused here.
        if isinstance(event, events.HandshakeCompleted):
            set_ack_delay(self._quic, self.node.options.ack_delay)
            self._verify_peer()
        elif isinstance(event, events.StreamDataReceived):
            if self.identity is not None:  # nothing is read from a peer we have not identified
                self._on_stream_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.DatagramFrameReceived):
            if self.identity is not None:
                message = self._decode_checked(event.data, reply_stream=None, reply_exchange=CONTROL_EXCHANGE)
                if message is not None:
                    self._datagrams.put(self.peer, message, ChannelInfo("datagram"))
        elif isinstance(event, events.StreamReset):
            self._abandon_stream(event.stream_id, f"peer reset the stream (code {event.error_code})")
        elif isinstance(event, events.ConnectionTerminated):
            self.close_reason = event.reason_phrase or (
                "closed without error" if event.error_code == 0 else f"error code {event.error_code:#x}"
            )
            self.on_terminated()

    def on_terminated(self) -> None:
        """Fail everything waiting on this connection (idempotent)."""
        if self.terminated:
            return
        self.terminated = True
        error = PeerUnavailable(f"connection to {self.identity or 'peer'} lost: {self.refusal or self.close_reason}")
        for stream in (*self._outgoing.values(), *self._incoming.values()):
            stream._fail(error)
            if stream.dispatcher is not None:
                stream.dispatcher.cancel()
        self._outgoing.clear()
        self._incoming.clear()
        self._control.cancel()
        self._datagrams.cancel()
        self._wake_drain_waiters()
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.outbound:
            if self._timer is not None:  # nothing more to send once our socket is gone
                self._timer.cancel()
                self._timer = None
            if self._transport is not None:
                self._transport.close()
        self._closed.set()
        self.node.connection_lost(self)

    def _on_stream_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        decoder = self._decoders.get(stream_id)
        if decoder is None:
            decoder = self._decoders[stream_id] = FrameDecoder()
        try:
            for item in decoder.feed(data):
                if isinstance(item, FrameError):
                    reply_stream = stream_id if item.exchange != CONTROL_EXCHANGE else None
                    self._reject("malformed", str(item), reply_stream, item.exchange)
                else:
                    self._on_frame(stream_id, item)
        except StreamCorrupt as exc:
            self._reject("oversize", f"stream {stream_id} abandoned: {exc}", None, CONTROL_EXCHANGE)
            try:
                self._quic.stop_stream(stream_id, STREAM_ERROR_CORRUPT)
            except ValueError:
                pass
            self._abandon_stream(stream_id, str(exc))
            self._transmit_soon()
        if end_stream:
            self._abandon_stream(stream_id, "peer ended the stream")

    def _on_frame(self, stream_id: int, frame: Frame) -> None:
        if frame.exchange == CONTROL_EXCHANGE:
            if frame.body:
                message = self._decode_checked(frame.body, reply_stream=None, reply_exchange=CONTROL_EXCHANGE)
                if message is not None:
                    self._control.put(self.peer, message, ChannelInfo("control"))
            return
        key = (stream_id, frame.exchange)
        stream = self._outgoing.get(key)
        if stream is not None:  # a reply on an exchange we opened
            if frame.abort:
                stream._mark_aborted()
                return
            if frame.body:
                message = self._decode_checked(frame.body, reply_stream=stream_id, reply_exchange=frame.exchange)
                if message is not None:
                    stream._deliver(message)
            if frame.end:
                stream._mark_remote_closed()
            return
        stream = self._incoming.get(key)
        if stream is None:
            if self._is_local_stream(stream_id):
                return  # late frame for an exchange of ours that is already finished
            if not frame.body:
                return  # a bare END for an exchange never opened: nothing to deliver or keep
            if len(self._incoming) >= self.node.options.max_incoming_exchanges:
                if frame.body:  # refuse once, on the exchange's first frame
                    self._reject("unavailable", "too many open exchanges on this connection", stream_id, frame.exchange)
                return
            stream = FrameStream(self, frame.exchange, incoming=True, stream_id=stream_id)
            stream.dispatcher = SerialDispatcher(self.node.deliver, lambda exc, s=stream: self._handler_failed(s, exc))
            self._incoming[key] = stream
        if frame.abort:
            stream._mark_aborted()
            return
        if frame.body:
            message = self._decode_checked(frame.body, reply_stream=stream_id, reply_exchange=frame.exchange)
            if message is not None:
                stream.dispatcher.put(self.peer, message, ChannelInfo("exchange", stream))
        if frame.end:
            stream._mark_remote_closed()

    def _handler_failed(self, stream: FrameStream, exc: Exception) -> None:
        if not stream.local_closed and not self.terminated:
            body = encode(ErrorReported(code="internal", detail=f"handler failed: {type(exc).__name__}"))
            try:
                stream.send_encoded(body, end=True)
            except TransportError:
                pass

    def _decode_checked(self, body: bytes, *, reply_stream: int | None, reply_exchange: int) -> Message | None:
        try:
            message = decode(body)
            check_sender(self.identity.role, message)  # type: ignore[union-attr]
        except WireForbidden as exc:
            self._reject("forbidden", str(exc), reply_stream, reply_exchange)
            return None
        except WireError as exc:
            self._reject("malformed", str(exc), reply_stream, reply_exchange)
            return None
        return message

    def _reject(self, code: str, detail: str, reply_stream: int | None, reply_exchange: int) -> None:
        log.warning("frame_rejected", peer=str(self.identity), code=code, detail=detail[:300], exchange=reply_exchange)
        body = encode(ErrorReported(code=code, detail=detail[:4000]))
        if reply_stream is None or reply_exchange == CONTROL_EXCHANGE:
            self.send_frame(self.control_stream(), CONTROL_EXCHANGE, body)
        else:
            self.send_frame(reply_stream, reply_exchange, body)

    def _abandon_stream(self, stream_id: int, reason: str) -> None:
        self._decoders.pop(stream_id, None)
        error = PeerUnavailable(f"stream {stream_id} to {self.identity}: {reason}")
        for table in (self._outgoing, self._incoming):
            for key in [k for k in table if k[0] == stream_id]:
                table.pop(key)._fail(error)
        if stream_id == self._control_stream:
            self._control_stream = None
        if stream_id in self._exchange_pool:
            self._exchange_pool.remove(stream_id)

    # ---- sending ----------------------------------------------------------------------------

    def _is_local_stream(self, stream_id: int) -> bool:
        # Bit 0 of a QUIC stream id is 0 for client-initiated streams.
        return (stream_id & 1) == (0 if self._quic.configuration.is_client else 1)

    def check_outgoing(self, message: Message) -> None:
        if self.node.options.check_outgoing_roles:
            check_sender(self.node.identity.role, message)

    @property
    def unacknowledged_bytes(self) -> int:
        """Bytes handed to QUIC on this connection and not yet acknowledged by the peer."""
        return unacknowledged_stream_bytes(self._quic)

    async def wait_send_buffer(self) -> None:
        """Wait until the unacknowledged bytes are within ``send_buffer_limit``."""
        limit = self.node.options.send_buffer_limit
        while self.unacknowledged_bytes > limit:
            if self.terminated:
                raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def control_stream(self) -> int:
        if self._control_stream is None:
            # Only reserved by the first send, which every caller does immediately.
            self._control_stream = self._quic.get_next_available_stream_id()
        return self._control_stream

    def pick_exchange_stream(self) -> int:
        if self.terminated:
            raise PeerUnavailable(f"connection to {self.identity} is closed")
        self._round_robin = (self._round_robin + 1) % self.node.options.exchange_streams
        if self._round_robin < len(self._exchange_pool):
            return self._exchange_pool[self._round_robin]
        stream_id = self._quic.get_next_available_stream_id()
        self._exchange_pool.append(stream_id)
        return stream_id

    def new_exchange_id(self) -> int:
        exchange = self._next_exchange
        self._next_exchange = exchange + 1 if exchange < MAX_EXCHANGE_ID else 1
        return exchange

    def register_outgoing(self, stream_id: int, stream: FrameStream) -> None:
        self._outgoing[(stream_id, stream.exchange)] = stream

    def forget_if_done(self, stream: FrameStream) -> None:
        if stream.local_closed and stream.remote_closed and stream._stream_id is not None:
            table = self._incoming if stream.incoming else self._outgoing
            table.pop((stream._stream_id, stream.exchange), None)

    def send_frame(self, stream_id: int, exchange: int, body: bytes, *, end: bool = False, abort: bool = False) -> None:
        if self.terminated or self.identity is None:
            raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
        self._quic.send_stream_data(stream_id, encode_frame(exchange, body, end=end, abort=abort))
        self._transmit_soon()

    def send_control(self, body: bytes) -> None:
        self.send_frame(self.control_stream(), CONTROL_EXCHANGE, body)

    def send_datagram(self, body: bytes) -> bool:
        if len(body) > MAX_DATAGRAM_PAYLOAD:
            self.send_control(body)  # too big for one packet: ordered delivery is fine too
            return False
        if self.terminated or self.identity is None:
            raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
        self._quic.send_datagram_frame(body)
        self._transmit_soon()
        return True

    def open_exchange(self) -> FrameStream:
        if self.terminated or self.identity is None:
            raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
        return FrameStream(self, self.new_exchange_id(), incoming=False, stream_id=None)

    def _schedule_keepalive(self) -> None:
        self._keepalive = self._loop.call_later(self.node.options.keepalive_interval, self._keepalive_due)

    def _keepalive_due(self) -> None:
        """PING unless something ack-eliciting went out within the interval (which already
        restarted the peer's idle timer, if it arrived); both ends do this."""
        if self.terminated:
            return
        interval = self.node.options.keepalive_interval
        if self._loop.time() - last_ack_eliciting_sent(self._quic) >= interval * 0.9:
            self._quic.send_ping(0)
            self.transmit()
        self._schedule_keepalive()

    @property
    def tracked_sent_packets(self) -> int:
        """Sent packets aioquic still holds awaiting acknowledgement (for tests and metrics)."""
        return tracked_sent_packets(self._quic)

    @property
    def open_streams(self) -> int:
        """QUIC streams aioquic currently tracks on this connection (for tests and metrics)."""
        return tracked_streams(self._quic)
