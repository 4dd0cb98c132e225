"""One authenticated QUIC connection: identity check, and the asyncio shell of the sans-IO exchange
protocol (``protocol.py``: framing, routing, checks) that delivers its events.

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
    EarlyAcks,
    acknowledgement_due,
    acknowledge_when_timer_fires,
    advertise_max_ack_delay,
    elicit_ack_for_ack_only_backlog,
    install_pacer,
    last_ack_eliciting_sent,
    peer_certificate,
    request_client_certificate,
    set_ack_delay,
    tracked_sent_packets,
    tracked_streams,
    transmit_after_datagram,
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
from kvcompassd.transport.framing import CONTROL_EXCHANGE
from kvcompassd.transport.protocol import (
    ControlReceived,
    DatagramReceived,
    ExchangeAborted,
    ExchangeEnded,
    ExchangeMessageReceived,
    ExchangeProtocol,
    FrameRejected,
    ProtocolEvent,
    StreamAbandoned,
    StreamCorrupted,
)
from kvcompassd.wire import ErrorReported, Message, NodeIdentity, Role, check_sender, encode

if TYPE_CHECKING:
    from kvcompassd.transport.node import Peer, QuicNode

log = structlog.get_logger(__name__)


class QuicConnectionTransport(QuicConnectionProtocol):
    """asyncio protocol of one kvcompass QUIC connection (client or server side): checks the
    peer's identity, moves bytes between aioquic and the sans-IO :class:`ExchangeProtocol`, and
    turns its events into deliveries."""

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
        advertise_max_ack_delay(quic, node.options.max_ack_delay)
        self._early_acks = EarlyAcks(quic, node.options.ack_after_packets)
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
        self.protocol: ExchangeProtocol[FrameStream] = ExchangeProtocol(
            is_client=quic.configuration.is_client,
            next_stream_id=quic.get_next_available_stream_id,
            open_incoming=self._open_incoming,
            max_incoming_exchanges=node.options.max_incoming_exchanges,
            exchange_streams=node.options.exchange_streams,
        )
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._keepalive: asyncio.TimerHandle | None = None
        self._heard_at = float("-inf")  # when the peer last sent us an ack-eliciting packet
        self._received_at = float("-inf")  # when the peer last sent us any packet (an ACK too)
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
        self.protocol.identify(identity.role)
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
        now = self._loop.time()
        self._early_acks.before_datagram()
        self._quic.receive_datagram(data, addr, now=now)
        self._received_at = now
        if acknowledgement_due(self._quic):
            # An ack-eliciting packet: our ACK answers it, no PING needed. (Or any packet while
            # that ACK is still owed: the mark is then at most ack_delay after the real one.)
            self._heard_at = now
        self._early_acks.after_datagram(now)
        self._process_events()
        transmit_after_datagram(self, now)  # (none when nothing is to send: aioquic_tweaks, item 5)
        if self._drain_waiters:  # acknowledgements may have freed send buffer
            self._wake_drain_waiters()

    def _handle_timer(self) -> None:
        # uvloop runs a timer up to a millisecond early: aioquic would find the acknowledgement
        # it was armed for not yet due, send nothing and run again at once (aioquic_tweaks, item 6).
        if self._timer_at is not None:
            acknowledge_when_timer_fires(self._quic, self._timer_at, self._loop.time())
        super()._handle_timer()

    def transmit(self) -> None:
        super().transmit()
        self._early_acks.after_transmit()
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
            for item in self.protocol.receive_stream_data(event.stream_id, event.data, event.end_stream):
                self._on_protocol_event(item)
        elif isinstance(event, events.DatagramFrameReceived):
            for item in self.protocol.receive_datagram(event.data):
                self._on_protocol_event(item)
        elif isinstance(event, events.StreamReset):
            self._on_protocol_event(
                self.protocol.abandon_stream(event.stream_id, f"peer reset the stream (code {event.error_code})"))
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
        for stream in self.protocol.close():
            stream._fail(error)
            if stream.dispatcher is not None:
                stream.dispatcher.cancel()
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

    def _on_protocol_event(self, item: ProtocolEvent) -> None:
        if isinstance(item, ExchangeMessageReceived):
            stream = item.exchange
            if item.incoming:
                stream.dispatcher.put(self.peer, item.message, ChannelInfo("exchange", stream))
            else:
                stream._deliver(item.message)
        elif isinstance(item, ControlReceived):
            self._control.put(self.peer, item.message, ChannelInfo("control"))
        elif isinstance(item, DatagramReceived):
            self._datagrams.put(self.peer, item.message, ChannelInfo("datagram"))
        elif isinstance(item, ExchangeEnded):
            item.exchange._mark_remote_closed()
        elif isinstance(item, ExchangeAborted):
            item.exchange._mark_aborted()
        elif isinstance(item, FrameRejected):
            log.warning("frame_rejected", peer=str(self.identity), code=item.code, detail=item.detail[:300],
                        exchange=item.exchange_id)
            self._send_bytes(item.stream_id, item.frame)
        elif isinstance(item, StreamCorrupted):
            try:
                self._quic.stop_stream(item.stream_id, STREAM_ERROR_CORRUPT)
            except ValueError:
                pass
            self._transmit_soon()
        elif isinstance(item, StreamAbandoned):
            error = PeerUnavailable(f"stream {item.stream_id} to {self.identity}: {item.reason}")
            for stream in item.exchanges:
                stream._fail(error)

    def _open_incoming(self, stream_id: int, exchange: int) -> FrameStream:
        stream = FrameStream(self, exchange, incoming=True, stream_id=stream_id)
        stream.dispatcher = SerialDispatcher(self.node.deliver, lambda exc, s=stream: self._handler_failed(s, exc))
        return stream

    def _handler_failed(self, stream: FrameStream, exc: Exception) -> None:
        if not stream.local_closed and not self.terminated:
            body = encode(ErrorReported(code="internal", detail=f"handler failed: {type(exc).__name__}"))
            try:
                stream.send_encoded(body, end=True)
            except TransportError:
                pass

    # ---- sending ----------------------------------------------------------------------------

    def check_outgoing(self, message: Message) -> None:
        if self.node.options.check_outgoing_roles:
            check_sender(self.node.identity.role, message)

    @property
    def unacknowledged_bytes(self) -> int:
        """Bytes handed to QUIC on this connection and not yet acknowledged by the peer."""
        return unacknowledged_stream_bytes(self._quic)

    async def wait_send_buffer(self, limit: int | None = None) -> None:
        """Wait until the unacknowledged bytes are within ``limit`` (default ``send_buffer_limit``)."""
        limit = self.node.options.send_buffer_limit if limit is None else limit
        while self.unacknowledged_bytes > limit:
            if self.terminated:
                raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def control_stream(self) -> int:
        return self.protocol.control_stream()

    def pick_exchange_stream(self) -> int:
        if self.terminated:
            raise PeerUnavailable(f"connection to {self.identity} is closed")
        return self.protocol.pick_exchange_stream()

    def register_outgoing(self, stream_id: int, stream: FrameStream) -> None:
        self.protocol.register_outgoing(stream_id, stream.exchange, stream)

    def forget_if_done(self, stream: FrameStream) -> None:
        if stream.local_closed and stream.remote_closed and stream._stream_id is not None:
            self.protocol.forget(stream._stream_id, stream.exchange, incoming=stream.incoming)

    def send_frame(self, stream_id: int, exchange: int, body: bytes, *, end: bool = False, abort: bool = False) -> None:
        self._send_bytes(stream_id, self.protocol.frame(exchange, body, end=end, abort=abort))

    def _send_bytes(self, stream_id: int, data: bytes) -> None:
        if self.terminated or self.identity is None:
            raise PeerUnavailable(f"connection to {self.identity or 'peer'} is not open")
        self._quic.send_stream_data(stream_id, data)
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
        return FrameStream(self, self.protocol.new_exchange_id(), incoming=False, stream_id=None)

    def _schedule_keepalive(self) -> None:
        self._keepalive = self._loop.call_later(self.node.options.keepalive_interval, self._keepalive_due)

    def _keepalive_due(self) -> None:
        """PING when the connection has been quiet for a while, or when what this end last
        sent drew no answer (``TransportOptions``, keepalives). Quiet: nothing ack-eliciting
        went out for ``keepalive_quiet_intervals`` intervals (which would have restarted the
        peer's idle timer, had it arrived) nor came in (our ACK of it restarts the peer's timer,
        its arrival restarted ours); the accepting end also waits one interval more for the
        peer's PINGs, so an idle connection has the dialling end ping and the accepting end
        acknowledge (with equal thresholds two ends whose timers fire in step each ping just
        before hearing the other's, and both go on pinging), and an accepting end whose peer's
        pings stop arriving pings itself. Unanswered: no packet at all has come back since the
        last ack-eliciting one went out 0.9 of an interval ago (a lost PING, or its lost ACK),
        so this end tries again every interval until it hears something."""
        if self.terminated:
            return
        options = self.node.options
        interval = options.keepalive_interval
        now = self._loop.time()
        sent_at = last_ack_eliciting_sent(self._quic)
        quiet = interval * (options.keepalive_quiet_intervals - 0.1)
        unheard = quiet if self.outbound else quiet + interval
        unanswered = self._received_at < sent_at <= now - interval * 0.9
        if unanswered or (now - sent_at >= quiet and now - self._heard_at >= unheard):
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
