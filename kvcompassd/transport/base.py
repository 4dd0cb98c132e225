"""Transport constants, errors and options (shared by the connection, exchanges and node)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcompassd.transport.aioquic_tweaks import ADVERTISED_MAX_ACK_DELAY_S, PacingMode

ALPN = "kvcompass/1"
# A DATAGRAM frame must fit in one QUIC packet (>= 1200 bytes on every path); keep headroom for
# the packet header and AEAD tag. Larger "datagram" messages fall back to the control stream.
MAX_DATAGRAM_PAYLOAD = 1000
# QUIC datagram sizes. 1200 bytes fits every path (RFC 9000 §14), and aioquic has no path-MTU
# discovery, so that is the size for peers elsewhere unless configured (e.g. 8952 on a jumbo-
# frame LAN). A loopback path's MTU is the kernel's (65536 on Linux): there a datagram carries
# a whole update batch instead of a dozen 1200-byte packets, each of which costs both ends
# aioquic's per-packet CPU and a system call. 16 KiB keeps a full initial congestion window
# (10 datagrams) inside the socket receive buffer.
QUIC_MIN_DATAGRAM_SIZE = 1200
LOOPBACK_DATAGRAM_SIZE = 16 * 1024
MAX_UDP_PAYLOAD = 65527
SOCKET_RECEIVE_BUFFER = 4 * 1024 * 1024  # asked for; the kernel caps it at net.core.rmem_max
APP_ERROR_REFUSED = 0x10  # QUIC application error code when a peer's identity is refused
STREAM_ERROR_CORRUPT = 0x11


class TransportError(ConnectionError):
    """Base of transport failures (not bad input: those are WireError)."""


class PeerUnavailable(TransportError):
    """There is no live connection to the peer (not yet, or it was lost)."""


class HandshakeFailed(PeerUnavailable):
    """TLS failed, or the peer's certificate / identity was refused (by us or by the peer)."""


class StreamClosed(TransportError):
    """The exchange is closed for sending: this side ended it, or the peer abandoned it."""


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """Knobs of a QuicNode; the defaults suit production."""

    pacing: PacingMode = "auto"  # see aioquic_tweaks.CoarsePacer
    ack_delay: float = 0.005  # acknowledge within this once connected (aioquic_tweaks.set_ack_delay)
    # Largest UDP payload sent; None = by path: LOOPBACK_DATAGRAM_SIZE when the peer (dialing)
    # or the listening address is a loopback address, else QUIC_MIN_DATAGRAM_SIZE.
    max_datagram_size: int | None = None
    exchange_streams: int = 4  # QUIC streams shared by the exchanges this node opens per connection
    idle_timeout: float = 10.0  # a silent peer is declared dead after this
    # The dialling end of a connection PINGs when for this share of idle_timeout it neither
    # sent nor received anything ack-eliciting, the accepting end when it also heard nothing
    # ack-eliciting for one and a half of it: an idle connection has the dialling end pinging
    # and the accepting end acknowledging (half the packets of both pinging; issue 30 item 4),
    # and an accepting end whose peer's pings stop arriving pings itself. An idle timer
    # restarts on every packet its end *receives*, so under loss what counts is how many
    # tries fit in one idle timeout: with 8,
    # on a path losing 30 % of its packets each way an end hears nothing in one interval with
    # probability ~0.3 (its ping or the ACK lost, and no ping of the peer's came), so it goes
    # silent for a whole timeout with probability 0.3^8 < 1e-4 (aioquic also resends a lost
    # PING). With one end pinging every third it was 0.51^3 = 13 %.
    keepalives_per_idle_timeout: int = 8
    handshake_timeout: float = 5.0
    reconnect_initial: float = 0.05
    reconnect_max: float = 5.0
    verify_hostname: bool = False  # identity comes from the CA-signed kvc:// URI, not the host name
    max_stream_data: int = 16 * 1024 * 1024
    max_data: int = 64 * 1024 * 1024
    check_outgoing_roles: bool = True  # refuse locally to send what our role may not (tests disable)
    max_incoming_exchanges: int = 4096  # per connection; more are refused with ErrorReported
    # send() waits while more than this many bytes sent on the connection are unacknowledged
    # (larger than the biggest frame, a 16 MiB snapshot, so one frame always fits).
    send_buffer_limit: int = 32 * 1024 * 1024

    @property
    def keepalive_interval(self) -> float:
        return self.idle_timeout / self.keepalives_per_idle_timeout

    def __post_init__(self) -> None:
        if self.pacing not in ("auto", "aioquic", "off"):
            raise ValueError(f"pacing must be 'auto', 'aioquic' or 'off', got {self.pacing!r}")
        if not 0 < self.ack_delay < ADVERTISED_MAX_ACK_DELAY_S:
            raise ValueError(f"ack_delay must be in (0, {ADVERTISED_MAX_ACK_DELAY_S}) s, got {self.ack_delay!r}")
        if self.max_datagram_size is not None and not QUIC_MIN_DATAGRAM_SIZE <= self.max_datagram_size <= MAX_UDP_PAYLOAD:
            raise ValueError(f"max_datagram_size must be None or in [{QUIC_MIN_DATAGRAM_SIZE}, {MAX_UDP_PAYLOAD}], "
                             f"got {self.max_datagram_size!r}")
        if not 1 <= self.keepalives_per_idle_timeout <= 100:
            raise ValueError(f"keepalives_per_idle_timeout must be in [1, 100], got {self.keepalives_per_idle_timeout}")
        if not 1 <= self.exchange_streams <= 64:
            raise ValueError(f"exchange_streams must be in [1, 64], got {self.exchange_streams}")
        for name in ("idle_timeout", "handshake_timeout", "reconnect_initial", "reconnect_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
