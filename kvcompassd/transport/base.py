"""Transport constants, errors and options (shared by the connection, exchanges and node)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcompassd.transport.aioquic_tweaks import ADVERTISED_MAX_ACK_DELAY_S, PacingMode

ALPN = "kvcompass/1"
# A DATAGRAM frame must fit in one QUIC packet (>= 1200 bytes on every path); keep headroom for
# the packet header and AEAD tag. Larger "datagram" messages fall back to the control stream.
MAX_DATAGRAM_PAYLOAD = 1000
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
    exchange_streams: int = 4  # QUIC streams shared by the exchanges this node opens per connection
    idle_timeout: float = 10.0  # a silent peer is declared dead after this; keepalive at 1/3
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

    def __post_init__(self) -> None:
        if self.pacing not in ("auto", "aioquic", "off"):
            raise ValueError(f"pacing must be 'auto', 'aioquic' or 'off', got {self.pacing!r}")
        if not 0 < self.ack_delay < ADVERTISED_MAX_ACK_DELAY_S:
            raise ValueError(f"ack_delay must be in (0, {ADVERTISED_MAX_ACK_DELAY_S}) s, got {self.ack_delay!r}")
        if not 1 <= self.exchange_streams <= 64:
            raise ValueError(f"exchange_streams must be in [1, 64], got {self.exchange_streams}")
        for name in ("idle_timeout", "handshake_timeout", "reconnect_initial", "reconnect_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
