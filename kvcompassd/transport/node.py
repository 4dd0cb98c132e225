"""QuicNode and Peer: the API the daemons use to talk to each other.

A :class:`QuicNode` is one daemon's endpoint: it listens, dials, authenticates every peer by
its CA-signed certificate, and hands each accepted message to one ``on_message`` callback.
A :class:`Peer` is the remote end of a connection: outbound peers (``node.peer(addr)``) are
persistent handles that reconnect by themselves; inbound peers live as long as their
connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvcompassd.certs import CertError, TlsFiles, peer_identity
from kvcompassd.transport.aioquic_tweaks import peer_certificate, verify_peer_chain
from kvcompassd.transport.base import (
    ALPN,
    LOOPBACK_DATAGRAM_SIZE,
    QUIC_MIN_DATAGRAM_SIZE,
    SOCKET_RECEIVE_BUFFER,
    HandshakeFailed,
    PeerUnavailable,
    TransportOptions,
)
from kvcompassd.transport.aioquic_tweaks import max_datagram_size
from kvcompassd.transport.connection import QuicConnectionTransport
from kvcompassd.transport.exchange import ChannelInfo, FrameStream, OnMessage
from kvcompassd.wire import Message, NodeIdentity, Role, compress_encoded, encode

log = structlog.get_logger(__name__)

Address = tuple[str, int]
OnPeerState = Callable[["Peer", bool], None]


class Peer:
    """The remote end of a connection.

    ``send`` applies backpressure: it waits while the connection has more than
    ``TransportOptions.send_buffer_limit`` unacknowledged bytes, then enqueues. Messages sent
    one after the other by one task arrive in that order on the control channel.
    ``send_encoded`` and ``send_datagram`` never wait: a broadcaster that must not be slowed
    by one slow peer uses ``send_encoded`` and watches ``unacknowledged_bytes`` itself.
    """

    def __init__(
        self,
        node: QuicNode,
        address: Address,
        *,
        outbound: bool,
        expected_role: Role | None = None,
        expected_id: str | None = None,
    ) -> None:
        self.node = node
        self.address = address
        self.outbound = outbound
        self.expected_role = expected_role
        self.expected_id = expected_id
        self.identity: NodeIdentity | None = None
        self.last_error: Exception | None = None
        self._connection: QuicConnectionTransport | None = None
        self._connected = asyncio.Event()
        self._attempt: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False

    def __repr__(self) -> str:
        direction = "to" if self.outbound else "from"
        return f"<Peer {self.identity or '?'} {direction} {self.address[0]}:{self.address[1]}>"

    @property
    def is_connected(self) -> bool:
        return self._connection is not None and not self._connection.terminated

    @property
    def certificate(self) -> x509.Certificate | None:
        """The certificate the peer presented on the current connection (None when down)."""
        connection = self._connection
        return None if connection is None else peer_certificate(connection._quic)[0]

    def _live(self) -> QuicConnectionTransport:
        connection = self._connection
        if connection is None or connection.terminated:
            raise PeerUnavailable(f"no connection to {self.identity or self.address}: {self.last_error or 'not connected'}")
        return connection

    async def send(self, message: Message) -> None:
        """Send on the ordered control channel, after waiting while more than
        ``send_buffer_limit`` bytes are unacknowledged. Raises PeerUnavailable when
        disconnected (nothing is queued for later: sequence numbers and resyncs decide)."""
        connection = self._live()
        connection.check_outgoing(message)
        body = encode(message)
        await connection.wait_send_buffer()
        self._live().send_control(body)

    @property
    def unacknowledged_bytes(self) -> int:
        """Bytes sent to this peer and not yet acknowledged (0 when disconnected)."""
        connection = self._connection
        return 0 if connection is None or connection.terminated else connection.unacknowledged_bytes

    async def wait_unacknowledged_below(self, limit: int) -> None:
        """Wait until at most ``limit`` bytes sent to this peer are unacknowledged (a bulk
        sender's own window, e.g. a snapshot's chunks, smaller than ``send_buffer_limit`` so
        the control messages sent meanwhile do not queue behind much of it). Raises
        PeerUnavailable when disconnected."""
        await self._live().wait_send_buffer(limit)

    def send_encoded(self, body: bytes) -> None:
        """Send a message already encoded with ``wire.encode`` on the control channel (encode a
        large batch once and send it to many peers). The body is not re-validated here."""
        self._live().send_control(body)

    @property
    def datagram_size(self) -> int:
        """The largest UDP payload this peer's connection sends (by path; see base.py)."""
        return max_datagram_size(self._live()._quic)

    def send_datagram(self, message: Message) -> bool:
        """Send unordered and unreliably; returns False if the message was too large for a
        datagram and went on the control channel instead."""
        connection = self._live()
        connection.check_outgoing(message)
        return connection.send_datagram(encode(message))

    def open_stream(self) -> FrameStream:
        """Open an exchange (request/response) on the current connection."""
        return self._live().open_exchange()

    async def wait_connected(self, timeout: float | None = None, *, fail_fast: bool = False) -> None:
        """Wait until connected; with ``fail_fast`` raise the next failed attempt's error."""
        async with asyncio.timeout(timeout):
            while not self.is_connected:
                if not fail_fast:
                    await self._connected.wait()
                    continue
                await asyncio.shield(self._attempt)  # raises the attempt's error

    async def close(self) -> None:
        """Close the connection; an outbound peer stops reconnecting."""
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        connection = self._connection
        if connection is not None:
            connection.close()
            connection.on_terminated()
        self.node._forget(self)

    # ---- reconnection (outbound peers) ------------------------------------------------------

    def _start(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    def _settle_attempt(self, error: Exception | None) -> None:
        if not self._attempt.done():
            if error is None:
                self._attempt.set_result(None)
            else:
                self._attempt.set_exception(error)
                self._attempt.exception()  # mark retrieved: nobody may be waiting
        self._attempt = asyncio.get_running_loop().create_future()

    async def _supervise(self) -> None:
        options = self.node.options
        failures = 0
        while not self._closing:
            try:
                connection = await self.node._dial(self)
            except Exception as exc:  # whatever went wrong, keep retrying: the peer may come back
                if not isinstance(exc, (OSError, PeerUnavailable, TimeoutError)):
                    log.exception("peer_connect_error", address=self.address)
                self.last_error = exc
                self._settle_attempt(exc if isinstance(exc, PeerUnavailable) else PeerUnavailable(f"{type(exc).__name__}: {exc}"))
                # Exponential backoff with jitter, so that many edges do not reconnect in step.
                ceiling = min(options.reconnect_max, options.reconnect_initial * 2**failures)
                failures += 1
                log.info("peer_connect_failed", address=self.address, error=str(exc), retry_in=round(ceiling, 3))
                await asyncio.sleep(random.uniform(ceiling / 2, ceiling))
                continue
            failures = 0
            self._attach(connection)
            self._settle_attempt(None)
            await connection.wait_closed()  # the connection keeps itself alive (keepalive_interval)
            connection.on_terminated()

    def _attach(self, connection: QuicConnectionTransport) -> None:
        self._connection = connection
        connection.peer = self
        self.identity = connection.identity
        self._connected.set()
        certificate = self.certificate
        log.info("peer_up", peer=str(self.identity), address=self.address, outbound=self.outbound,
                 certificate_serial=None if certificate is None else f"{certificate.serial_number:x}")
        self.node._notify(self, True)

    def _detach(self, connection: QuicConnectionTransport) -> None:
        if self._connection is not connection:
            return
        self._connection = None
        self._connected.clear()
        self.last_error = PeerUnavailable(connection.refusal or connection.close_reason or "connection lost")
        log.info("peer_down", peer=str(self.identity), address=self.address, reason=str(self.last_error))
        self.node._notify(self, False)


class EncodedMessage:
    """One message encoded once for sending to many peers (``peer.send_encoded(m.body_for(peer))``):
    compressed (once, on first need) for a peer on a network path where it spans several
    datagrams, as an update batch or a snapshot does (about a third of the packets); plain
    otherwise. On loopback paths (large datagrams) packets, not bytes, are what costs, and
    compressing there costs more CPU than it saves (the measurement: ``docs/design-history.md``)."""

    __slots__ = ("_compressed", "plain")

    def __init__(self, message: Message) -> None:
        self.plain = encode(message)
        self._compressed: bytes | None = None

    def body_for(self, peer: Peer) -> bytes:
        size = peer.datagram_size
        if len(self.plain) <= size or size >= LOOPBACK_DATAGRAM_SIZE:
            return self.plain
        if self._compressed is None:
            self._compressed = compress_encoded(self.plain)
        return self._compressed


class QuicNode:
    """One daemon's QUIC endpoint.

    ``on_message(peer, message, channel)`` receives every accepted message (sync or async;
    messages of one channel are delivered in order, an async handler is awaited before the
    next message of *that* channel). ``on_peer_state(peer, connected)`` hears about peers going
    up and down, e.g. to re-subscribe after a reconnection.
    """

    def __init__(
        self,
        identity: NodeIdentity,
        tls: TlsFiles,
        *,
        on_message: OnMessage,
        on_peer_state: OnPeerState | None = None,
        options: TransportOptions | None = None,
    ) -> None:
        self.identity = identity
        self.tls = tls
        self.options = options or TransportOptions()
        self._credentials = _load_credentials(tls, identity)
        self._on_message = on_message
        self._on_peer_state = on_peer_state
        self._server: QuicServer | None = None
        self._listen_datagram_size = 0
        self.address: Address | None = None  # where listen() bound, if it was called
        self._outbound: dict[Address, Peer] = {}
        self._inbound: set[Peer] = set()

    # ---- configuration ----------------------------------------------------------------------

    def _datagram_size(self, host: str) -> int:
        """The UDP payload size for a path to (or a listener on) ``host``; see base.py."""
        if self.options.max_datagram_size is not None:
            return self.options.max_datagram_size
        return LOOPBACK_DATAGRAM_SIZE if _is_loopback(host) else QUIC_MIN_DATAGRAM_SIZE

    def _configuration(self, *, is_client: bool, datagram_size: int, server_name: str | None = None) -> QuicConfiguration:
        options = self.options
        configuration = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            idle_timeout=options.idle_timeout,
            max_datagram_size=datagram_size,
            max_datagram_frame_size=65536,
            max_data=options.max_data,
            max_stream_data=options.max_stream_data,
            server_name=server_name,
            verify_mode=ssl.CERT_REQUIRED,
        )
        credentials = self._credentials
        configuration.cadata = credentials.ca_pem
        configuration.certificate = credentials.certificate
        configuration.certificate_chain = list(credentials.chain)
        configuration.private_key = credentials.private_key
        return configuration

    @property
    def ca_pem(self) -> bytes:
        """The CA bundle peers are verified against (as last loaded)."""
        return self._credentials.ca_pem

    @property
    def certificate(self) -> x509.Certificate:
        """This node's own certificate, as presented on new connections."""
        return self._credentials.certificate

    def reload_tls(self) -> x509.Certificate:
        """Re-read the CA bundle, certificate and key from ``self.tls`` (rotation, SIGHUP).

        Every connection made from here on, dialled or accepted, presents the new certificate
        and verifies its peer against the new CA bundle; established connections keep the
        session they negotiated. The files are checked together first (the certificate names
        this node, is signed by a CA in the bundle, matches the key): on any error this raises
        CertError and the node keeps what it had, so a half-copied rotation changes nothing.
        """
        credentials = _load_credentials(self.tls, self.identity, check_own_chain=True)
        self._credentials = credentials
        if self._server is not None:
            # aioquic's server builds each new connection from the configuration it was given;
            # replacing it is how a listener's certificate changes without closing the socket.
            self._server._configuration = self._configuration(
                is_client=False, datagram_size=self._listen_datagram_size)
        log.info("tls_reloaded", node=str(self.identity),
                 certificate_serial=f"{credentials.certificate.serial_number:x}",
                 not_after=credentials.certificate.not_valid_after_utc.isoformat())
        return credentials.certificate

    # ---- listening --------------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> Address:
        """Accept peers on ``host:port`` (port 0 = ephemeral); returns the bound address."""
        if self._server is not None:
            raise RuntimeError("this node is already listening")
        self._listen_datagram_size = self._datagram_size(host)
        self._server = await serve(
            host,
            port,
            configuration=self._configuration(is_client=False, datagram_size=self._listen_datagram_size),
            create_protocol=lambda quic, stream_handler=None: QuicConnectionTransport(quic, node=self, outbound=False),
        )
        _enlarge_receive_buffer(self._server._transport)
        sockname = self._server._transport.get_extra_info("sockname")
        self.address = (sockname[0], sockname[1])
        log.info("listening", node=str(self.identity), address=f"{sockname[0]}:{sockname[1]}")
        return self.address

    def accept_inbound(self, connection: QuicConnectionTransport) -> None:
        peer = Peer(self, connection._quic.get_peer_address()[:2], outbound=False)
        self._inbound.add(peer)
        peer._attach(connection)

    # ---- dialing ----------------------------------------------------------------------------

    def peer(self, address: Address, *, expected_role: Role | None = None, expected_id: str | None = None) -> Peer:
        """The persistent outbound peer for ``address`` (one connection per address), created
        and connecting in the background on first use; it reconnects with backoff forever."""
        address = (address[0], int(address[1]))
        peer = self._outbound.get(address)
        if peer is None:
            peer = Peer(self, address, outbound=True, expected_role=expected_role, expected_id=expected_id)
            self._outbound[address] = peer
            peer._start()
        elif (expected_role, expected_id) != (peer.expected_role, peer.expected_id) and (expected_role or expected_id):
            raise ValueError(f"{address} is already dialed expecting {peer.expected_role}/{peer.expected_id}")
        return peer

    async def connect(
        self,
        address: Address,
        *,
        expected_role: Role | None = None,
        expected_id: str | None = None,
        timeout: float | None = None,
    ) -> Peer:
        """``peer(address)``, waiting for it to be connected; raises the first failed attempt's
        error (HandshakeFailed or PeerUnavailable). The peer keeps retrying in the background."""
        peer = self.peer(address, expected_role=expected_role, expected_id=expected_id)
        await peer.wait_connected(timeout if timeout is not None else self.options.handshake_timeout * 2, fail_fast=True)
        return peer

    async def _dial(self, peer: Peer) -> QuicConnectionTransport:
        while True:
            credentials = self._credentials
            connection = await self._dial_once(peer)
            if credentials is self._credentials:
                return connection
            # reload_tls() ran during the handshake (e.g. a retransmitted Initial of an attempt
            # started before it reached a peer that came up since): this connection presents
            # what was rotated out. Redial at once, so every connection made after a reload
            # presents the new certificate.
            log.info("redial_after_tls_reload", address=peer.address)
            connection.close()
            connection._transport.close()

    async def _dial_once(self, peer: Peer) -> QuicConnectionTransport:
        loop = asyncio.get_running_loop()
        host, port = peer.address
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, remote = infos[0][0], infos[0][4]
        server_name = host if self.options.verify_hostname else None
        datagram_size = self._datagram_size(remote[0])
        quic = QuicConnection(configuration=self._configuration(is_client=True, datagram_size=datagram_size,
                                                                server_name=server_name))
        local = ("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0)
        transport, connection = await loop.create_datagram_endpoint(
            lambda: QuicConnectionTransport(
                quic, node=self, outbound=True, expected_role=peer.expected_role, expected_id=peer.expected_id
            ),
            local_addr=local,
        )
        connection.peer = peer
        _enlarge_receive_buffer(transport)
        try:
            async with asyncio.timeout(self.options.handshake_timeout):
                connection.connect(remote)
                await connection.wait_connected()
                if connection.identity is None:
                    raise HandshakeFailed(connection.refusal or "peer identity not verified")
                # A server checks our certificate only after our handshake completed; one round
                # trip more tells us whether it accepted us (a refusal closes the connection).
                await connection.ping()
        except (ConnectionError, TimeoutError) as exc:
            # aioquic's shielded waiters (ping, connected) get ConnectionError when the
            # connection closes; nobody awaits them after the timeout, so mark them retrieved
            # rather than log "Future exception was never retrieved" on every failed dial.
            for waiter in (*getattr(connection, "_ping_waiters", {}).values(),
                           getattr(connection, "_connected_waiter", None)):
                if waiter is not None:
                    waiter.add_done_callback(_retrieve)
            connection.close()
            transport.close()
            reason = connection.refusal or connection.close_reason or type(exc).__name__
            raise HandshakeFailed(f"connecting to {host}:{port} failed: {reason}") from None
        return connection

    # ---- bookkeeping ------------------------------------------------------------------------

    def deliver(self, peer: Peer, message: Message, channel: ChannelInfo) -> object:
        return self._on_message(peer, message, channel)

    def connection_lost(self, connection: QuicConnectionTransport) -> None:
        peer = connection.peer
        if peer is None:
            return
        peer._detach(connection)
        if not peer.outbound:
            self._inbound.discard(peer)

    def _notify(self, peer: Peer, connected: bool) -> None:
        if self._on_peer_state is not None:
            try:
                self._on_peer_state(peer, connected)
            except Exception:
                log.exception("peer_state_handler_failed", peer=str(peer.identity))

    def _forget(self, peer: Peer) -> None:
        if peer.outbound and self._outbound.get(peer.address) is peer:
            del self._outbound[peer.address]
        self._inbound.discard(peer)

    @property
    def peers(self) -> tuple[Peer, ...]:
        """Connected peers, inbound and outbound."""
        return tuple(p for p in (*self._outbound.values(), *self._inbound) if p.is_connected)

    async def close(self) -> None:
        """Close every connection and stop listening."""
        for peer in (*self._outbound.values(), *self._inbound):
            await peer.close()
        if self._server is not None:
            self._server.close()
            self._server = None
            self.address = None
        # Let the CONNECTION_CLOSE frames leave before the sockets go.
        await asyncio.sleep(0)


@dataclass(frozen=True, slots=True)
class _Credentials:
    """What a node presents and trusts, loaded and checked together."""

    ca_pem: bytes
    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    private_key: object


def _load_credentials(tls: TlsFiles, identity: NodeIdentity, *, check_own_chain: bool = False) -> _Credentials:
    """Load and check the node's files; ``check_own_chain`` also insists that its certificate
    verifies against its own CA bundle (as every step of a CA rotation keeps it): a reload
    must not swap a working node onto files its peers would refuse."""
    scratch = QuicConfiguration()
    try:
        ca_pem = tls.ca.read_bytes()
        scratch.load_cert_chain(tls.cert, tls.key)
    except (OSError, ValueError, TypeError) as exc:
        raise CertError(f"cannot load {tls.cert} / {tls.key} / {tls.ca}: {exc}") from exc
    certificate = scratch.certificate
    own = peer_identity(certificate)
    if own != identity:
        raise CertError(f"{tls.cert} is issued to {own}, not to {identity}")
    if _public_der(scratch.private_key.public_key()) != _public_der(certificate.public_key()):
        raise CertError(f"{tls.key} is not the key of {tls.cert}")
    try:
        if check_own_chain:
            verify_peer_chain(certificate, list(scratch.certificate_chain), ca_pem)
    except ValueError as exc:
        raise CertError(f"{tls.cert} does not verify against {tls.ca}: {exc}") from exc
    return _Credentials(ca_pem, certificate, tuple(scratch.certificate_chain), scratch.private_key)


def _public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _enlarge_receive_buffer(transport: asyncio.BaseTransport) -> None:
    # Bursts of a congestion window arrive faster than one event-loop turn reads them; a full
    # socket buffer drops datagrams, which QUIC then has to detect and resend.
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RECEIVE_BUFFER)
        except OSError:
            pass


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
