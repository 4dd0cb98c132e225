"""The few places where kvcompass reaches into aioquic (checked against aioquic 1.7.2, the one
version ``pyproject.toml`` allows: ``CHECKED_AIOQUIC``). Nothing else in the project touches
aioquic's private fields (tests/test_aioquic_tweaks.py checks both).

1. **Pacing under uvloop.** aioquic's ``QuicPacketPacer`` spaces packets ``packet_time =
   max_datagram_size * srtt / cwnd`` apart, with a token bucket of at most 16 packets. On
   loopback or in-region links ``packet_time`` is a few microseconds, but the connection arms
   an event-loop timer for it and uvloop's timers have 1 ms resolution: each emptied bucket
   costs >= 1 ms, capping a connection near 16 packets per millisecond however fast the path
   (DESIGN §6; ``tools/bench_transport.py`` counts these sub-millisecond holds).
   :class:`CoarsePacer` paces at the granularity the loop can time: when ``packet_time`` is
   below ``granularity`` (1 ms) its bucket holds ``2 * granularity`` of sending credit, so each
   timer wake-up releases the packets of the elapsed interval in one burst and the average rate
   stays the congestion controller's. Slower (WAN) peers with longer intervals are paced
   exactly as aioquic would. ``pacing="off"`` removes pacing altogether (for comparison).

2. **Acknowledgement delay.** aioquic acknowledges every ack-eliciting packet within
   ``K_GRANULARITY`` (1 ms), and advertises a ``max_ack_delay`` of 25 ms whatever it does. The
   plane's streams are one-way (reports, update batches, load readings), so each acknowledgement
   is a packet of its own that both ends must build, encrypt, send, receive and process, and the
   streams' senders pace themselves (a report per ``report_delay_ms``, a batch per
   ``batch_delay_ms``, a reading per load period): an acknowledgement shorter than that spacing
   answers one packet. :func:`advertise_max_ack_delay` sets the transport parameter (the peer's
   loss timers allow for it), :func:`set_ack_delay` the delay within it on an established
   connection, and :class:`EarlyAcks` keeps what RFC 9000 section 13.2 asks of a receiver that
   delays: an acknowledgement at once after a few packets (a bulk transfer's congestion window
   grows on acknowledgements) and at once for a packet that arrives after a gap (the sender
   learns of a loss without waiting for the delay). The price is the peer's probe timeout,
   which adds the advertised delay: a lost last packet of a burst is sent again up to that
   much later (100 ms at the daemons' defaults, against aioquic's 25 ms).

3. **Client certificates.** aioquic's TLS server only sends a CertificateRequest when the
   private flag ``tls.Context._request_client_certificate`` is set ("for test purposes only"),
   and, even then, it does not verify the client's chain (only its proof of key possession).
   :func:`request_client_certificate` sets the flag as soon as the connection creates its TLS
   context; the transport then verifies the chain against the cluster CA itself
   (:func:`verify_peer_chain`) before it accepts a single frame from the peer.

4. **Acknowledging ACK-only packets.** aioquic keeps every packet it sends, ACK-only ones
   included, in its packet space's ``sent_packets`` (with a delivery handler per ACK frame)
   until the peer acknowledges it. A peer only sends an ACK when it receives an ack-eliciting
   packet, so on a connection where one side only receives (an edge's inbound connections from
   its agents' load reports and from peer edges' queue-vector broadcasts) that side's ACK-only
   packets pile up forever (a leak of ``QuicSentPacket`` objects that grows with the peer's
   traffic; the rate measured is in ``docs/design-history.md``), and one ``list(sent_packets)``
   per received ACK once anything is acknowledged.
   RFC 9000 section 13.2.4 has the remedy: a receiver that only sends ACKs adds an
   ack-eliciting frame now and then. :func:`elicit_ack_for_ack_only_backlog` sends a PING once
   ``ACK_ONLY_BACKLOG`` unacknowledged packets have accumulated with nothing ack-eliciting in
   flight; the peer's ACK of it releases them all, so the backlog stays bounded.

5. **No packet to build after a datagram.** aioquic's protocol transmits after every datagram it
   receives, and a transmit builds a packet however little there is to send. A datagram of
   stream data needs only an acknowledgement, which is not due for ``set_ack_delay``'s delay:
   on the one-way update and report streams about half of all transmits built nothing (over a
   zero-delay gateway run, README "Coalescing windows": a maintenance unit 4,319 transmits for
   2,231 packets, an edge 2,824 for 1,466, an agent 1,253 for 639). :func:`nothing_to_send` says,
   from every source ``QuicConnection._write_application`` writes frames from, that a transmit
   now would send nothing; :func:`transmit_after_datagram` then only re-arms the connection's
   timer, which sends the acknowledgement when it is due. It errs towards transmitting:
   anything it does not know to be idle counts as something to send.

6. **An acknowledgement timer that fires early.** uvloop times callbacks in whole milliseconds
   of a clock it reads once per loop turn, so a timer armed for ``ack_at`` runs up to a
   millisecond before ``loop.time()`` reaches it (90 of 200 in a scratch check, up to 0.4 ms
   early). aioquic's ``_handle_timer`` then transmits at ``loop.time()``, finds the
   acknowledgement not yet due, builds nothing and arms the timer for ``ack_at`` again, which
   runs at once: the loop spins through whole transmits until its clock passes ``ack_at``.
   Counted over a zero-delay gateway run at c = 1 (a scratch ``sitecustomize`` wrapping
   ``_handle_timer``): a maintenance unit's timer ran 1,436 times for the 431 datagrams
   it sent from it, an edge's 856 for 217, each agent's 212-292 for 93-94; all of the empty runs were
   acknowledgement timers that came early. :func:`acknowledge_when_timer_fires` makes an
   acknowledgement whose timer has fired due at once (``ack_at`` moved to ``now``, a fraction
   of a millisecond early within a delay of tens of them); every packet is still stamped with
   the loop's own time.
"""

from __future__ import annotations

import math
from typing import Literal

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.tls import Alert, Epoch, verify_certificate
from cryptography import x509

PacingMode = Literal["auto", "aioquic", "off"]
DEFAULT_PACING_GRANULARITY_S = 0.001
AIOQUIC_MAX_ACK_DELAY_S = 0.025  # the transport parameter max_ack_delay aioquic advertises itself
# Unacknowledged ACK-only packets after which a PING asks the peer to acknowledge them (a few
# milliseconds of a busy one-way connection; small next to a congestion window).
ACK_ONLY_BACKLOG = 32


class CoarsePacer(QuicPacketPacer):
    """aioquic's pacer with a token bucket sized for the event loop's timer granularity."""

    def __init__(self, *, max_datagram_size: int, granularity: float) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.granularity = granularity

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        super().update_rate(congestion_window, smoothed_rtt)
        if self.packet_time is not None and self.packet_time < self.granularity:
            # Two timer ticks of credit: a wake-up that comes up to a tick late still finds
            # enough credit to catch up, so the average rate is not cut by timer lateness.
            self.bucket_max = max(self.bucket_max, 2 * self.granularity)

    def next_send_time(self, now: float) -> float | None:
        at = super().next_send_time(now)
        if at is not None and at - now < self.granularity:
            # Ask for what the loop can deliver: one tick, whose credit the bucket then holds.
            return now + self.granularity
        return at


class UnpacedPacer(QuicPacketPacer):
    """Never holds a packet back: the congestion window alone limits bursts."""

    def next_send_time(self, now: float) -> float | None:
        return None


def install_pacer(quic: QuicConnection, mode: PacingMode) -> None:
    """Replace the connection's pacer per ``mode``: "auto" (:class:`CoarsePacer`), "off"
    (:class:`UnpacedPacer`) or "aioquic" (the stock pacer). Must run before anything is sent."""
    if mode == "auto":
        quic._loss._pacer = CoarsePacer(
            max_datagram_size=quic._max_datagram_size, granularity=DEFAULT_PACING_GRANULARITY_S
        )
    elif mode == "off":
        quic._loss._pacer = UnpacedPacer(max_datagram_size=quic._max_datagram_size)


def advertise_max_ack_delay(quic: QuicConnection, seconds: float) -> None:
    """Advertise ``seconds`` as the connection's ``max_ack_delay`` transport parameter instead of
    aioquic's fixed 25 ms (see module docs), in whole milliseconds rounded up: a delay below
    ``seconds`` stays below what is advertised. Call before the handshake starts: the
    parameters go out in the first flight."""
    ms = math.ceil(round(seconds * 1000, 6))  # (round first: 0.1 s is 100 ms, not 101)
    if not 0 < ms < 2 ** 14:  # (RFC 9000 section 18.2: values of 2^14 ms or more are invalid)
        raise ValueError(f"max_ack_delay must be in (0, 16383] ms, got {seconds!r} s")
    serialize = quic._serialize_transport_parameters

    def serialize_with_max_ack_delay() -> bytes:
        data = serialize()
        params = pull_quic_transport_parameters(Buffer(data=data))
        params.max_ack_delay = ms
        buf = Buffer(capacity=len(data) + 16)  # (the parameter grows by at most 7 bytes)
        push_quic_transport_parameters(buf, params)
        return buf.data

    quic._serialize_transport_parameters = serialize_with_max_ack_delay  # type: ignore[method-assign]
    quic.kvc_advertised_max_ack_delay = ms / 1000.0  # (what set_ack_delay checks against)


def advertised_max_ack_delay(quic: QuicConnection) -> float:
    """The ``max_ack_delay`` (s) this end advertises: ``advertise_max_ack_delay``'s, else aioquic's."""
    return getattr(quic, "kvc_advertised_max_ack_delay", AIOQUIC_MAX_ACK_DELAY_S)


def peer_max_ack_delay(quic: QuicConnection) -> float:
    """The ``max_ack_delay`` (s) the peer advertised, as this end's loss timers allow for it."""
    return quic._loss.max_ack_delay


def set_ack_delay(quic: QuicConnection, seconds: float) -> None:
    """Acknowledge received packets within ``seconds`` instead of aioquic's 1 ms (see module docs),
    which must be below what this end advertises. Call once the handshake is complete:
    handshake packets keep the prompt acknowledgements."""
    advertised = advertised_max_ack_delay(quic)
    if not 0 < seconds < advertised:
        raise ValueError(f"ack delay must be in (0, {advertised * 1000:g} ms), got {seconds!r}")
    quic._ack_delay = seconds


class EarlyAcks:
    """When a connection that delays its acknowledgements acknowledges at once (RFC 9000 sections
    13.2.1-13.2.2; module docs, item 2): once ``after_packets`` packets have come since the
    acknowledgement became owed, and for a packet that arrives after a gap in the packet
    numbers. The transport calls :meth:`before_datagram` and :meth:`after_datagram` around
    each received datagram, and :meth:`after_transmit` after each transmit."""

    __slots__ = ("_quic", "after_packets", "_owed_from", "_largest_before")

    def __init__(self, quic: QuicConnection, after_packets: int) -> None:
        if after_packets < 1:
            raise ValueError(f"after_packets must be >= 1, got {after_packets!r}")
        self._quic = quic
        self.after_packets = after_packets
        self._owed_from: int | None = None  # the largest packet number when an ACK became owed
        self._largest_before = -1

    def before_datagram(self) -> None:
        space = self._quic._spaces.get(Epoch.ONE_RTT)
        self._largest_before = -1 if space is None else space.largest_received_packet

    def after_datagram(self, now: float) -> None:
        """Make the owed acknowledgement due now if the datagram crossed the count or a gap."""
        space = self._quic._spaces.get(Epoch.ONE_RTT)
        if space is None or space.ack_at is None:
            return
        largest = space.largest_received_packet
        if self._owed_from is None:
            self._owed_from = largest
        gap = self._largest_before >= 0 and largest > self._largest_before + 1
        if (gap or largest - self._owed_from + 1 >= self.after_packets) and space.ack_at > now:
            space.ack_at = now

    def after_transmit(self) -> None:
        """An acknowledgement sent (nothing owed any more) starts the count again."""
        space = self._quic._spaces.get(Epoch.ONE_RTT)
        if space is None or space.ack_at is None:
            self._owed_from = None


def request_client_certificate(quic: QuicConnection) -> None:
    """Make a server-side connection ask its client for a certificate (see module docs)."""
    initialize = quic._initialize

    def initialize_and_request_certificate(peer_cid: bytes) -> None:
        initialize(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize_and_request_certificate  # type: ignore[method-assign]


def peer_certificate(quic: QuicConnection) -> tuple[x509.Certificate | None, list[x509.Certificate]]:
    """The certificate (and chain) the peer presented during the handshake, if any."""
    tls = getattr(quic, "tls", None)
    if tls is None:
        return None, []
    return tls._peer_certificate, list(tls._peer_certificate_chain)


def verify_peer_chain(cert: x509.Certificate, chain: list[x509.Certificate], ca_pem: bytes) -> None:
    """Raise ValueError unless ``cert`` is currently valid and signed by a CA in ``ca_pem``."""
    try:
        verify_certificate(certificate=cert, chain=chain, cadata=ca_pem)
    except Alert as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def elicit_ack_for_ack_only_backlog(quic: QuicConnection, limit: int = ACK_ONLY_BACKLOG) -> bool:
    """Queue a PING if the 1-RTT space holds ``limit`` or more sent packets and none of them is
    ack-eliciting (so no ACK from the peer would ever release them); returns True if it did.
    The caller transmits."""
    space = quic._spaces.get(Epoch.ONE_RTT)
    if (space is None or not quic._handshake_complete or quic._ping_pending
            or space.ack_eliciting_in_flight or len(space.sent_packets) < limit):
        return False
    quic.send_ping(0)
    return True


CHECKED_AIOQUIC = ("1.7.2",)


def unacknowledged_stream_bytes(quic: QuicConnection) -> int:
    """Bytes written to the connection's streams and not yet acknowledged by the peer."""
    return sum(s.sender._buffer_stop - s.sender._buffer_start for s in quic._streams.values())


def tracked_streams(quic: QuicConnection) -> int:
    """Streams aioquic still tracks on the connection."""
    return len(quic._streams)


def max_datagram_size(quic: QuicConnection) -> int:
    """The largest UDP payload the connection sends."""
    return quic._max_datagram_size


def packet_pacer(quic: QuicConnection) -> QuicPacketPacer:
    """The connection's pacer (the one ``install_pacer`` set), for tools that time it."""
    return quic._loss._pacer


def tracked_sent_packets(quic: QuicConnection) -> int:
    """Packets aioquic still tracks as sent and unacknowledged, over all packet spaces."""
    return sum(len(space.sent_packets) for space in quic._spaces.values())


def last_ack_eliciting_sent(quic: QuicConnection) -> float:
    """When (loop time) the connection last sent an ack-eliciting packet after the handshake."""
    return quic._loss._time_of_last_sent_ack_eliciting_packet


def acknowledgement_due(quic: QuicConnection) -> bool:
    """Whether the connection owes the peer an ACK in the 1-RTT space: checked right after a
    datagram was received, it says the datagram held an ack-eliciting packet (data or PING)."""
    space = quic._spaces.get(Epoch.ONE_RTT)
    return space is not None and space.ack_at is not None


def nothing_to_send(quic: QuicConnection, now: float) -> bool:
    """Whether ``quic.datagrams_to_send(now)`` would return no datagram: the handshake done, the
    connection open, no acknowledgement due by ``now``, and none of the frames
    ``_write_application`` writes pending (path validation, connection ids, flow-control and
    stream-count updates, pings, crypto data, datagrams, stream data, resets, stop-sendings,
    finished streams to discard). Conservative: True only when all of them are known to be
    idle (item 5 of the module's docstring)."""
    if (quic._state is not QuicConnectionState.CONNECTED or quic._close_pending or not quic._handshake_confirmed
            or quic._handshake_done_pending or quic._ping_pending or quic._probe_pending
            or quic._datagrams_pending or quic._retire_connection_ids or quic._streams_blocked_pending):
        return False
    for space in quic._loss.spaces:
        if space.ack_at is not None and space.ack_at <= now:
            return False
    paths = quic._network_paths
    if len(paths) != 1 or not paths[0].is_validated or paths[0].remote_challenges:
        return False
    if not all(cid.was_sent for cid in quic._host_cids):
        return False
    if not quic._crypto_streams[Epoch.ONE_RTT].sender.buffer_is_empty:
        return False
    max_data = quic._local_max_data
    if max_data.used * 2 > max_data.value or max_data.value != max_data.sent:
        return False
    for limit in (quic._local_max_streams_bidi, quic._local_max_streams_uni):
        if limit.value != limit.sent and limit.sent - limit.used < limit.value - limit.sent:
            return False
    for stream in quic._streams.values():
        local = stream.max_stream_data_local
        if (local and stream.receiver.highest_offset * 2 > local) or stream.max_stream_data_local_sent != local:
            return False
    for stream in quic._streams_queue:
        if (stream.is_finished or stream.receiver.stop_pending or stream.sender.reset_pending
                or not stream.sender.buffer_is_empty):
            return False
    return True


def acknowledge_when_timer_fires(quic: QuicConnection, timer_at: float, now: float) -> bool:
    """Item 6: the connection's timer, armed for ``timer_at``, runs at ``now``; an
    acknowledgement due by ``timer_at`` is made due now (``now`` may read up to a millisecond
    earlier under uvloop). True when one was."""
    moved = False
    for space in quic._loss.spaces:
        if space.ack_at is not None and now < space.ack_at <= timer_at:
            space.ack_at = now
            moved = True
    return moved


def transmit_after_datagram(protocol: QuicConnectionProtocol, now: float) -> None:
    """What follows a datagram ``protocol`` received (and its events were handled): a transmit
    soon (one per event-loop turn), unless none is pending and there is nothing to send (item 5),
    when the connection's timer is only re-armed for the acknowledgement now owed."""
    if protocol._transmit_task is None and nothing_to_send(protocol._quic, now):
        _rearm_timer(protocol)
    else:
        protocol._transmit_soon()


def _rearm_timer(protocol: QuicConnectionProtocol) -> None:
    """What ``QuicConnectionProtocol.transmit`` does after sending: arm the connection's timer
    for ``get_timer()`` (an acknowledgement now owed, loss detection), moving it if it changed."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at
