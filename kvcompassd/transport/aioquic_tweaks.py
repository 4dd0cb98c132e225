"""The few places where kvcompass reaches into aioquic (checked against aioquic 1.7.2).

1. **Pacing under uvloop.** aioquic's ``QuicPacketPacer`` spaces packets ``packet_time =
   max_datagram_size * srtt / cwnd`` apart. On loopback or in-region links that is a few
   microseconds, but the connection arms an event-loop timer for it and uvloop's timers have
   1 ms resolution, so every paced packet waits ~1 ms and throughput collapses (measured, see
   DESIGN §6 and ``tools/bench_transport.py``). :class:`CoarsePacer` keeps aioquic's token
   bucket but does not pace when the interval is below what the loop can time (``granularity``,
   1 ms): such a peer is close and fast, the congestion window alone bounds the burst. WAN peers
   with long intervals are still paced exactly as aioquic would.

2. **Client certificates.** aioquic's TLS server only sends a CertificateRequest when the
   private flag ``tls.Context._request_client_certificate`` is set ("for test purposes only"),
   and, even then, it does not verify the client's chain (only its proof of key possession).
   :func:`request_client_certificate` sets the flag as soon as the connection creates its TLS
   context; the transport then verifies the chain against the cluster CA itself
   (:func:`verify_peer_chain`) before it accepts a single frame from the peer.
"""

from __future__ import annotations

from typing import Literal

from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.tls import Alert, verify_certificate
from cryptography import x509

PacingMode = Literal["auto", "aioquic", "off"]
DEFAULT_PACING_GRANULARITY_S = 0.001


class CoarsePacer(QuicPacketPacer):
    """aioquic's pacer, minus waits shorter than the event loop's timer granularity."""

    def __init__(self, *, max_datagram_size: int, granularity: float) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.granularity = granularity

    def next_send_time(self, now: float) -> float | None:
        if self.packet_time is not None and self.packet_time < self.granularity:
            return None
        return super().next_send_time(now)


def install_pacer(quic: QuicConnection, mode: PacingMode) -> None:
    """Replace the connection's pacer per ``mode``: "auto" (coarse), "off" (never pace) or
    "aioquic" (leave the stock pacer). Must run before the connection sends anything."""
    if mode == "aioquic":
        return
    granularity = DEFAULT_PACING_GRANULARITY_S if mode == "auto" else float("inf")
    quic._loss._pacer = CoarsePacer(max_datagram_size=quic._max_datagram_size, granularity=granularity)


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
