"""QUIC transport between kvcompass daemons (aioquic, mutual TLS with the cluster CA).

Public API::

    node = QuicNode(identity, tls_files, on_message=handler, on_peer_state=None, options=None)
    await node.listen(host, port)                 # -> bound (host, port); port 0 = ephemeral
    peer = node.peer((host, port), expected_role=Role.MAINTENANCE)   # persistent, reconnects
    peer = await node.connect((host, port))       # same, waiting for the first connection
    await peer.send(message)                      # ordered control channel (with backpressure)
    peer.send_encoded(wire.encode(message))       # encode once, send to many; never waits
    peer.send_encoded(EncodedMessage(m).body_for(peer))  # the same, compressed on small-datagram paths
    peer.send_datagram(message)                   # unordered, may be lost (falls back if large)
    async with peer.open_stream() as exchange:    # request/response exchange
        await exchange.send(request, end=True)
        async for reply in exchange: ...
    # accepting side: on_message(peer, message, channel); reply with channel.stream.send(...)
    # and close it (channel.stream.close() or send(..., end=True)) when done.
    await node.close()

``handler(peer, message, channel)`` may be sync or async; messages of one channel (the
peer's control stream, one exchange, the datagrams) are delivered in order, and an async
handler is awaited before the next message of *that* channel only. ``peer.identity`` is the
certified ``NodeIdentity``. ``on_peer_state(peer, connected)`` reports peers going up and
down (re-subscribe on True). Sends raise ``PeerUnavailable`` while a peer is down.

Every message passes ``wire.check_sender`` for the peer's certified role before delivery; a
malformed or forbidden frame is answered with ``ErrorReported`` (and logged) and the
connection carries on. Modules: ``node`` (QuicNode, Peer), ``connection`` (one connection's
asyncio shell: identity, dispatch; the stream budget), ``protocol`` (the sans-IO exchange
protocol: stream bytes in, events out; frames to send out), ``exchange`` (FrameStream),
``framing`` (sans-IO frame codec), ``base`` (errors, options; datagram sizes by path). See ``connection.py`` for the stream
budget and the one transmit per loop turn, ``aioquic_tweaks.py`` for the pacing fix, the acknowledgement delay
and the client-certificate handling. Run daemons under uvloop.
"""

from kvcompassd.transport.base import (
    ALPN,
    MAX_DATAGRAM_PAYLOAD,
    HandshakeFailed,
    PeerUnavailable,
    StreamClosed,
    TransportError,
    TransportOptions,
)
from kvcompassd.transport.exchange import ChannelInfo, FrameStream, OnMessage
from kvcompassd.transport.node import Address, EncodedMessage, OnPeerState, Peer, QuicNode

__all__ = [
    "ALPN",
    "MAX_DATAGRAM_PAYLOAD",
    "Address",
    "ChannelInfo",
    "EncodedMessage",
    "FrameStream",
    "HandshakeFailed",
    "OnMessage",
    "OnPeerState",
    "Peer",
    "PeerUnavailable",
    "QuicNode",
    "StreamClosed",
    "TransportError",
    "TransportOptions",
]
