"""Transport constants, errors and options (shared by the connection, exchanges and node)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcompassd.transport.aioquic_tweaks import PacingMode

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
    # Acknowledgements (aioquic_tweaks, item 2): within ack_delay once connected, below the
    # max_ack_delay this end advertises (the peer's loss timers wait that much longer for them),
    # and at once after ack_after_packets packets or a gap. Longer than the plane's streams
    # space their packets (20 ms reports, 10 ms batches), so one acknowledgement answers several.
    ack_delay: float = 0.08
    max_ack_delay: float = 0.1
    ack_after_packets: int = 8
    # Largest UDP payload sent; None = by path: LOOPBACK_DATAGRAM_SIZE when the peer (dialing)
    # or the listening address is a loopback address, else QUIC_MIN_DATAGRAM_SIZE.
    max_datagram_size: int | None = None
    exchange_streams: int = 4  # QUIC streams shared by the exchanges this node opens per connection
    idle_timeout: float = 10.0  # a silent peer is declared dead after this
    # Keepalives (issue 30 item 4). An end checks every keepalive interval (idle_timeout /
    # keepalives_per_idle_timeout). The dialling end PINGs once the connection has been quiet
    # for keepalive_quiet_intervals intervals (it neither sent nor received anything
    # ack-eliciting), the accepting end only after one interval more without hearing anything
    # ack-eliciting. So an idle connection has the dialling end pinging and the accepting end
    # acknowledging, and a connection that carries a heartbeat more often than that (an
    # agent's load report, an edge's queue vector, each once a second; the daemons' quiet
    # threshold is 1.5 s) carries no PING at all. Either end PINGs again at each check while
    # what it last sent ack-eliciting (a PING or data) has drawn no packet at all back for 0.9
    # of an interval: a lost PING or a lost answer is retried every interval until something
    # is heard (besides aioquic's probe timeout, which resends a lost PING itself). An idle
    # timer restarts on every packet its end *receives*. At the daemons' 4 s timeout (0.5 s
    # intervals), after the last exchange that got through, the dialling end tries at
    # 1.5-2 s and then every 0.5 s (~5 tries before the timeout), the accepting end, hearing
    # none of them, from 2-2.5 s (~4 tries): on a path losing 30 % of the packets each way the
    # dialling end hears nothing for a whole timeout only if each of its tries fails (~0.51:
    # the PING or its ACK lost) and each of the peer's PINGs is lost (0.3), ~0.51^5 * 0.3^4 ~
    # 3e-4 (the accepting end likewise), before the probe timeout's retransmissions.
    keepalives_per_idle_timeout: int = 8
    keepalive_quiet_intervals: int = 3
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
        if not 0.001 <= self.max_ack_delay <= 1.0:
            raise ValueError(f"max_ack_delay must be in [0.001, 1] s, got {self.max_ack_delay!r}")
        if not 0 < self.ack_delay < self.max_ack_delay:
            raise ValueError(f"ack_delay must be in (0, max_ack_delay = {self.max_ack_delay}) s, got {self.ack_delay!r}")
        if self.max_ack_delay >= self.keepalive_interval:
            # (a keepalive check that cannot hear its PING's acknowledgement pings again)
            raise ValueError(f"max_ack_delay ({self.max_ack_delay} s) must be below the keepalive interval "
                             f"(idle_timeout / keepalives_per_idle_timeout = {self.keepalive_interval} s)")
        if not 1 <= self.ack_after_packets <= 1000:
            raise ValueError(f"ack_after_packets must be in [1, 1000], got {self.ack_after_packets!r}")
        if self.max_datagram_size is not None and not QUIC_MIN_DATAGRAM_SIZE <= self.max_datagram_size <= MAX_UDP_PAYLOAD:
            raise ValueError(f"max_datagram_size must be None or in [{QUIC_MIN_DATAGRAM_SIZE}, {MAX_UDP_PAYLOAD}], "
                             f"got {self.max_datagram_size!r}")
        if not 1 <= self.keepalives_per_idle_timeout <= 100:
            raise ValueError(f"keepalives_per_idle_timeout must be in [1, 100], got {self.keepalives_per_idle_timeout}")
        if not 1 <= self.keepalive_quiet_intervals < self.keepalives_per_idle_timeout:
            raise ValueError(f"keepalive_quiet_intervals must be in [1, keepalives_per_idle_timeout), "
                             f"got {self.keepalive_quiet_intervals}")
        if not 1 <= self.exchange_streams <= 64:
            raise ValueError(f"exchange_streams must be in [1, 64], got {self.exchange_streams}")
        for name in ("idle_timeout", "handshake_timeout", "reconnect_initial", "reconnect_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
