"""The QUIC transport over real sockets on 127.0.0.1, under asyncio and uvloop.

No test asserts an upper bound on time; ``asyncio.timeout`` only guards against hangs.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st
from aioquic.asyncio.client import connect as aioquic_connect
from aioquic.quic.configuration import QuicConfiguration

from kvcompassd.certs import CertError, TlsFiles, init_ca, issue
from kvcompassd.transport import (
    ALPN,
    ChannelInfo,
    EncodedMessage,
    HandshakeFailed,
    Peer,
    PeerUnavailable,
    QuicNode,
    StreamClosed,
    TransportOptions,
)
from kvcompassd.transport.base import LOOPBACK_DATAGRAM_SIZE, QUIC_MIN_DATAGRAM_SIZE
from kvcompassd.transport.aioquic_tweaks import ACK_ONLY_BACKLOG, last_ack_eliciting_sent, peer_max_ack_delay
from kvcompassd.transport.framing import HEADER, Frame, FrameDecoder, FrameError, StreamCorrupt, encode_frame
from kvcompassd.wanemu import WanRelay
from kvcompassd.core.events import EventOp, IndexEventColumns
from kvcompassd.wire import (
    ErrorReported,
    Message,
    NodeIdentity,
    PrefixEventsReported,
    QueueVectorBroadcast,
    RequestForwarded,
    ResponseChunked,
    ResponseCompleted,
    Role,
    UpdateBatchPublished,
    UpdatesSubscribed,
    WireForbidden,
    WorkerLoadReported,
)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
GUARD_S = 30.0  # hang guard only


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    def runner(coroutine):
        async def guarded():
            async with asyncio.timeout(GUARD_S):
                return await coroutine

        with asyncio.Runner(loop_factory=LOOPS[request.param]) as loop_runner:
            return loop_runner.run(guarded())

    return runner


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, TlsFiles]:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root / "ca", cluster_name="test")
    files = {
        node_id: issue(root / "ca", root / "nodes", role=role, node_id=node_id)
        for node_id, role in [("mnt-0", "maintenance"), ("edge-us", "edge"), ("edge-eu", "edge"), ("us-0", "agent")]
    }
    init_ca(root / "rogue-ca", cluster_name="rogue")
    rogue = issue(root / "rogue-ca", root / "rogue", role="edge", node_id="edge-rogue")
    # The rogue node trusts the real CA (so it can verify the server) but its own certificate
    # is signed by another CA: the server must refuse it.
    files["edge-rogue"] = TlsFiles(ca=root / "ca" / "ca.pem", cert=rogue.cert, key=rogue.key)
    files["edge-selfsigned"] = self_signed(root / "self", "edge-selfsigned", ca=root / "ca" / "ca.pem")
    rogue_server = issue(root / "rogue-ca", root / "rogue", role="maintenance", node_id="mnt-rogue")
    files["mnt-rogue"] = TlsFiles(ca=root / "rogue-ca" / "ca.pem", cert=rogue_server.cert, key=rogue_server.key)
    return files


ROLES = {"mnt-0": Role.MAINTENANCE, "edge-us": Role.EDGE, "edge-eu": Role.EDGE, "us-0": Role.AGENT,
         "edge-rogue": Role.EDGE, "mnt-rogue": Role.MAINTENANCE, "edge-selfsigned": Role.EDGE}


def self_signed(directory, node_id: str, *, ca) -> TlsFiles:
    """A leaf certificate that names a valid identity but signs itself."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from kvcompassd.certs import identity_uri

    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity_uri("edge", node_id))]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    files = TlsFiles(ca=ca, cert=directory / f"{node_id}.pem", key=directory / f"{node_id}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


class Recorder:
    """An on_message handler that queues what arrives and optionally answers exchanges."""

    def __init__(self, reply=None) -> None:
        self.messages: asyncio.Queue[tuple[Peer, Message, ChannelInfo]] = asyncio.Queue()
        self.reply = reply

    async def __call__(self, peer: Peer, message: Message, channel: ChannelInfo) -> None:
        await self.messages.put((peer, message, channel))
        if self.reply is not None and channel.stream is not None:
            await self.reply(message, channel.stream)

    async def next(self) -> tuple[Peer, Message, ChannelInfo]:
        return await self.messages.get()


@asynccontextmanager
async def node(pki, node_id: str, handler=None, *, listen: bool = False, port: int = 0, **options) -> AsyncIterator[QuicNode]:
    quic_node = QuicNode(
        NodeIdentity(ROLES[node_id], node_id),
        pki[node_id],
        on_message=handler or Recorder(),
        options=TransportOptions(**options),
    )
    if listen:
        await quic_node.listen("127.0.0.1", port)
    try:
        yield quic_node
    finally:
        await quic_node.close()


async def answer_with_chunks(message: Message, stream) -> None:
    if isinstance(message, RequestForwarded):
        for token in message.input_ids:
            await stream.send(ResponseChunked(message.request_id, (token,), str(token), False))
        await stream.send(
            ResponseCompleted(message.request_id, "us-0", 0, len(message.input_ids), len(message.input_ids), "stop", ()),
            end=True,
        )


# ---- framing (sans-IO) -------------------------------------------------------------------


frames = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=300), st.booleans(), st.booleans()).map(
        lambda f: (f[0], f[1], f[2] or f[3] or not f[1], f[3])  # empty bodies only on END / ABORT
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(frames, st.lists(st.integers(1, 97), min_size=1, max_size=30))
def test_frames_survive_any_chunking(items, cuts):
    data = b"".join(encode_frame(x, body, end=end, abort=abort) for x, body, end, abort in items)
    decoder, out, position, i = FrameDecoder(), [], 0, 0
    while position < len(data):
        step = cuts[i % len(cuts)]
        out.extend(decoder.feed(data[position : position + step]))
        position, i = position + step, i + 1
    assert out == [Frame(x, end, body, abort) for x, body, end, abort in items] and decoder.buffered == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzzed_stream_bytes_yield_frames_errors_or_corruption(data):
    decoder = FrameDecoder()
    try:
        for item in decoder.feed(data):
            assert isinstance(item, (Frame, FrameError))
    except StreamCorrupt:
        assert decoder.corrupt and list(decoder.feed(b"more")) == []


def test_bare_end_frame_and_bad_frames():
    decoder = FrameDecoder()
    assert list(decoder.feed(encode_frame(3, b"", end=True))) == [Frame(3, True, b"")]
    [error] = decoder.feed(HEADER.pack(5, 9, 0))
    assert isinstance(error, FrameError) and error.exchange == 9 and "empty frame" in str(error)
    [error] = decoder.feed(HEADER.pack(6, 4, 0x02) + b"\x90")
    assert isinstance(error, FrameError) and "ABORT without END" in str(error)
    with pytest.raises(ValueError):
        encode_frame(1, b"")


# ---- pacing (sans-IO, on a virtual clock) -------------------------------------------------


def packets_sent_with_millisecond_timers(pacer, *, duration: float) -> int:
    """Packets ``pacer`` lets out when, as under uvloop, a pacing timer fires >= 1 ms later.

    Each wake-up is one ``transmit()``: the connection sends while the pacer allows, at one
    ``now``, then arms the timer the pacer asks for.
    """
    now, sent = 0.0, 0
    while now < duration:
        at = pacer.next_send_time(now)
        while at is None:
            pacer.update_after_send(now)
            sent += 1
            at = pacer.next_send_time(now)
        now = max(at, now + 0.001)
    return sent


def stock_and_coarse(cwnd_packets: int, srtt: float):
    from aioquic.quic.recovery import QuicPacketPacer

    from kvcompassd.transport.aioquic_tweaks import CoarsePacer

    stock = QuicPacketPacer(max_datagram_size=1200)
    coarse = CoarsePacer(max_datagram_size=1200, granularity=0.001)
    for pacer in (stock, coarse):
        pacer.update_rate(cwnd_packets * 1200, srtt)
    return stock, coarse


@pytest.mark.parametrize("cwnd_packets, srtt", [(24, 0.002), (100, 0.002), (10, 0.001), (50, 0.0005)])
def test_coarse_pacer_keeps_the_rate_that_millisecond_timers_cut(cwnd_packets, srtt):
    stock, coarse = stock_and_coarse(cwnd_packets, srtt)
    assert stock.packet_time < 0.001  # a fast path: aioquic asks for sub-millisecond waits
    expected = cwnd_packets / srtt * 0.5  # packets in 0.5 s at the congestion controller's rate
    assert packets_sent_with_millisecond_timers(stock, duration=0.5) < 0.6 * expected  # the trap
    assert 0.95 * expected <= packets_sent_with_millisecond_timers(coarse, duration=0.5) <= 1.15 * expected


def test_coarse_pacer_paces_slow_paths_like_aioquic():
    stock, coarse = stock_and_coarse(12, 0.160)  # a small window over a 160 ms RTT
    assert coarse.packet_time == stock.packet_time > 0.001 and coarse.bucket_max == stock.bucket_max
    assert packets_sent_with_millisecond_timers(coarse, duration=2.0) == packets_sent_with_millisecond_timers(
        stock, duration=2.0
    )


# ---- round trips ---------------------------------------------------------------------------


def test_control_exchange_and_datagram_round_trips(run, pki):
    async def scenario():
        agent_inbox = Recorder(reply=answer_with_chunks)
        async with node(pki, "us-0", agent_inbox, listen=True) as agent, node(pki, "edge-us") as edge:
            peer = await edge.connect(agent.address, expected_role=Role.AGENT)
            assert peer.identity == NodeIdentity(Role.AGENT, "us-0")

            await peer.send(QueueVectorBroadcast("us", "us", 1.5, (("us-0", 3.0),)))
            got_peer, message, channel = await agent_inbox.next()
            assert got_peer.identity == NodeIdentity(Role.EDGE, "edge-us")
            assert message == QueueVectorBroadcast("us", "us", 1.5, (("us-0", 3.0),)) and channel.kind == "control"

            request = RequestForwarded("r1", "edge-us", "us", (5, 6, 7), {"max_new_tokens": 3}, True, 0)
            async with peer.open_stream() as exchange:
                await exchange.send(request, end=True)
                replies = [reply async for reply in exchange]
            assert [r.token_ids for r in replies[:-1]] == [(5,), (6,), (7,)]
            assert isinstance(replies[-1], ResponseCompleted) and replies[-1].prompt_tokens == 3
            _, delivered, channel = await agent_inbox.next()
            assert delivered == request and channel.kind == "exchange"

            vector = QueueVectorBroadcast("us", "eu", 2.0, (("us-0", 1.0),))
            assert peer.send_datagram(vector) is True
            _, message, channel = await agent_inbox.next()
            assert message == vector and channel.kind == "datagram"

    run(scenario())


def test_large_datagram_falls_back_to_control_stream(run, pki):
    async def scenario():
        inbox = Recorder()
        async with node(pki, "edge-eu", inbox, listen=True) as far, node(pki, "edge-us") as edge:
            peer = await edge.connect(far.address)
            vector = QueueVectorBroadcast("us", "eu", 2.0, tuple((f"us-{i}", float(i)) for i in range(200)))
            assert peer.send_datagram(vector) is False
            _, message, channel = await inbox.next()
            assert message == vector and channel.kind == "control"

    run(scenario())


def test_datagrams_are_sized_by_path_and_sizes_may_differ_per_direction(run, pki):
    """Loopback paths use large datagrams, other listeners QUIC's 1200 bytes (a listener on the
    wildcard address cannot know its peers are local); a connection works either way, and the
    acknowledgement delay is the configured one once connected."""
    async def scenario():
        blob = bytes(range(256)) * 48  # 12 KiB: one datagram on loopback, ten at 1200 bytes
        batch = UpdateBatchPublished(0, 1, 1, ((0, blob),))
        for listen_host, server_size in (("127.0.0.1", LOOPBACK_DATAGRAM_SIZE), ("0.0.0.0", QUIC_MIN_DATAGRAM_SIZE)):
            inbox = Recorder()
            async with node(pki, "edge-us", inbox) as edge, \
                    node(pki, "mnt-0", ack_delay=0.04, max_ack_delay=0.05) as mnt:
                await edge.listen(listen_host, 0)
                peer = await mnt.connect(("127.0.0.1", edge.address[1]))
                await peer.send(batch)
                inbound, message, _ = await inbox.next()
                assert message == batch
                assert peer._connection._quic._max_datagram_size == LOOPBACK_DATAGRAM_SIZE
                assert inbound._connection._quic._max_datagram_size == server_size
                assert peer._connection._quic._ack_delay == 0.04
                # Each end's loss timers allow for the delay the other advertised.
                assert peer_max_ack_delay(inbound._connection._quic) == 0.05
                assert peer_max_ack_delay(peer._connection._quic) == TransportOptions().max_ack_delay
        async with node(pki, "edge-us", listen=True) as edge, node(pki, "mnt-0", max_datagram_size=1200) as mnt:
            peer = await mnt.connect(edge.address)
            assert peer._connection._quic._max_datagram_size == 1200

    run(scenario())


def test_encoded_message_is_compressed_only_where_it_spans_several_datagrams(run, pki):
    async def scenario():
        batch = UpdateBatchPublished(0, 1, 1, ((0, bytes(12 * 1024) + b"records"),))
        small = UpdateBatchPublished(0, 1, 2, ((0, b"records"),))
        inbox = Recorder()
        async with node(pki, "edge-us", inbox, listen=True) as edge, \
                node(pki, "mnt-0") as near, node(pki, "mnt-0", max_datagram_size=1200) as far:
            near_peer, far_peer = await near.connect(edge.address), await far.connect(edge.address)
            encoded = EncodedMessage(batch)
            big = EncodedMessage(UpdateBatchPublished(0, 1, 1, ((0, bytes(40_000)),)))
            assert encoded.body_for(near_peer) == encoded.plain and big.body_for(near_peer) == big.plain  # loopback
            packed = encoded.body_for(far_peer)
            assert len(packed) < 200 and encoded.body_for(far_peer) is packed  # compressed once
            assert EncodedMessage(small).body_for(far_peer) == EncodedMessage(small).plain
            far_peer.send_encoded(packed)
            _, message, _ = await inbox.next()
            assert message == batch

    run(scenario())


def test_transport_options_refuse_sizes_and_delays_out_of_range():
    for bad in ({"max_datagram_size": 1000}, {"max_datagram_size": 70000}, {"ack_delay": 0.0}, {"ack_delay": 0.1},
                {"ack_delay": 0.03, "max_ack_delay": 0.02}, {"max_ack_delay": 1.5}, {"ack_after_packets": 0},
                {"idle_timeout": 0.5}):  # (a keepalive interval of 62.5 ms, below max_ack_delay)
        with pytest.raises(ValueError):
            TransportOptions(**bad)


def test_agent_can_push_to_connected_edge_over_inbound_peer(run, pki):
    async def scenario():
        edge_inbox, agent_inbox = Recorder(), Recorder()
        async with node(pki, "us-0", agent_inbox, listen=True) as agent, node(pki, "edge-us", edge_inbox) as edge:
            peer = await edge.connect(agent.address)
            await peer.send(UpdatesSubscribed("edge-us", 0, 0, -1))  # any traffic: the agent learns the peer
            inbound, _, _ = await agent_inbox.next()
            await inbound.send(WorkerLoadReported("us-0", 12.5, 3, 1))
            _, message, _ = await edge_inbox.next()
            assert message == WorkerLoadReported("us-0", 12.5, 3, 1)
            assert [p.identity for p in agent.peers] == [NodeIdentity(Role.EDGE, "edge-us")]

    run(scenario())


def test_a_side_that_only_receives_keeps_a_bounded_record_of_its_ack_only_packets(run, pki):
    # The edge listens and only receives (load reports as datagrams): it sends nothing but
    # ACKs, which the peer never acknowledges. aioquic keeps each sent packet until it is
    # acknowledged, so without an occasional ack-eliciting PING this record grew by one
    # QuicSentPacket per ACK for as long as the connection lived (the soak's RSS growth).
    async def scenario():
        edge_inbox = Recorder()
        async with node(pki, "edge-us", edge_inbox, listen=True) as edge, node(pki, "us-0") as agent:
            peer = await agent.connect(edge.address)
            await peer.send(WorkerLoadReported("us-0", 0.0, 0, 0))
            inbound, _, _ = await edge_inbox.next()
            connection = inbound._connection
            peak = 0
            for i in range(1, 301):
                sent_before = connection._quic._packet_number
                peer.send_datagram(WorkerLoadReported("us-0", float(i), 1, 0))
                _, message, _ = await edge_inbox.next()
                assert message.queue_ms == float(i)
                while connection._quic._packet_number == sent_before:  # its ACK went out
                    await asyncio.sleep(0.001)
                peak = max(peak, connection.tracked_sent_packets)
            assert connection._quic._packet_number > 300  # at least one ACK-only packet per report
            assert peak <= 2 * ACK_ONLY_BACKLOG, peak

    run(scenario())


def test_concurrent_exchanges_share_a_bounded_set_of_streams(run, pki):
    async def scenario():
        async with node(pki, "us-0", Recorder(reply=answer_with_chunks), listen=True) as agent, node(
            pki, "edge-us", exchange_streams=3
        ) as edge:
            peer = await edge.connect(agent.address)

            async def one(i: int) -> list[Message]:
                async with peer.open_stream() as exchange:
                    await exchange.send(RequestForwarded(f"r{i}", "edge-us", "us", (i, i + 1), {}, True, 0), end=True)
                    return [m async for m in exchange]

            results = await asyncio.gather(*(one(i) for i in range(60)))
            for i, replies in enumerate(results):
                assert [r.token_ids for r in replies[:-1]] == [(i,), (i + 1,)]
            # 3 exchange streams + 1 control stream per side, however many exchanges ran.
            assert peer._connection.open_streams <= 2 * (3 + 1)

    run(scenario())


# ---- identity and refusal ------------------------------------------------------------------


def test_client_certificate_from_another_ca_is_refused(run, pki):
    async def scenario():
        inbox = Recorder()
        async with node(pki, "mnt-0", inbox, listen=True) as server, node(pki, "edge-rogue") as rogue:
            with pytest.raises(HandshakeFailed, match="certificate refused"):
                await rogue.connect(server.address)
            assert server.peers == () and inbox.messages.empty()

    run(scenario())


def test_self_signed_client_certificate_is_refused(run, pki):
    async def scenario():
        inbox = Recorder()
        async with node(pki, "mnt-0", inbox, listen=True) as server, node(pki, "edge-selfsigned") as rogue:
            with pytest.raises(HandshakeFailed, match="certificate refused"):
                await rogue.connect(server.address)
            assert server.peers == () and inbox.messages.empty()

    run(scenario())


def test_client_without_certificate_is_refused(run, pki):
    async def scenario():
        inbox = Recorder()
        async with node(pki, "mnt-0", inbox, listen=True) as server:
            configuration = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_REQUIRED)
            configuration.cadata = pki["mnt-0"].ca.read_bytes()
            async with aioquic_connect(*server.address, configuration=configuration) as client:
                with pytest.raises(ConnectionError):
                    await client.ping()
            assert server.peers == () and inbox.messages.empty()

    run(scenario())


def test_server_certificate_from_another_ca_is_refused(run, pki):
    async def scenario():
        async with node(pki, "mnt-rogue", listen=True) as rogue, node(pki, "edge-us") as edge:
            with pytest.raises(HandshakeFailed):
                await edge.connect(rogue.address)

    run(scenario())


def test_unexpected_peer_role_is_refused(run, pki):
    async def scenario():
        async with node(pki, "us-0", listen=True) as agent, node(pki, "edge-us") as edge:
            with pytest.raises(HandshakeFailed, match="expected a maintenance node"):
                await edge.connect(agent.address, expected_role=Role.MAINTENANCE)

    run(scenario())


def test_node_refuses_certificate_of_another_identity(pki):
    with pytest.raises(CertError, match="issued to"):
        QuicNode(NodeIdentity(Role.MAINTENANCE, "edge-us"), pki["edge-us"], on_message=Recorder())


# ---- rejected frames keep the connection -----------------------------------------------------


_EVIL_EVENTS = IndexEventColumns(bytes([EventOp.CACHED_VRAM]), (1).to_bytes(8, "little"))


def test_forbidden_message_gets_error_and_connection_carries_on(run, pki):
    async def scenario():
        server_inbox, edge_inbox = Recorder(reply=answer_with_chunks), Recorder()
        async with node(pki, "us-0", server_inbox, listen=True) as agent, node(
            pki, "edge-us", edge_inbox, check_outgoing_roles=False
        ) as edge:
            peer = await edge.connect(agent.address)
            # An edge may not report a worker's cache (only that worker's agent may): refused on
            # the control channel...
            await peer.send(PrefixEventsReported("us-0", 1, _EVIL_EVENTS))
            _, error, channel = await edge_inbox.next()
            assert isinstance(error, ErrorReported) and error.code == "forbidden" and channel.kind == "control"
            assert "PrefixEventsReported" in error.detail
            # ...and on an exchange, which stays usable.
            async with peer.open_stream() as exchange:
                await exchange.send(PrefixEventsReported("us-0", 2, _EVIL_EVENTS))
                reply = await exchange.receive()
                assert isinstance(reply, ErrorReported) and reply.code == "forbidden"
                await exchange.send(RequestForwarded("r1", "edge-us", "us", (1,), {}, True, 0), end=True)
                assert [type(m).__name__ async for m in exchange] == ["ResponseChunked", "ResponseCompleted"]
            # Only the allowed message reached the agent.
            _, message, _ = await server_inbox.next()
            assert isinstance(message, RequestForwarded) and server_inbox.messages.empty()

    run(scenario())


def test_sending_a_forbidden_message_fails_locally(run, pki):
    async def scenario():
        async with node(pki, "us-0", listen=True) as agent, node(pki, "edge-us") as edge:
            peer = await edge.connect(agent.address)
            with pytest.raises(WireForbidden):
                await peer.send(PrefixEventsReported("us-0", 1, _EVIL_EVENTS))

    run(scenario())


def test_malformed_frames_get_errors_and_connection_carries_on(run, pki):
    async def scenario():
        server_inbox, edge_inbox = Recorder(), Recorder()
        async with node(pki, "mnt-0", server_inbox, listen=True) as server, node(pki, "edge-us", edge_inbox) as edge:
            peer = await edge.connect(server.address)
            connection = peer._connection
            good = UpdatesSubscribed("edge-us", 0, 0, -1)

            peer.send_encoded(b"\xc1 not msgpack")  # bad body on the control stream
            _, error, _ = await edge_inbox.next()
            assert error.code == "malformed" and "msgpack" in error.detail

            control = connection.control_stream()  # unknown flag bits: one frame refused
            connection._quic.send_stream_data(control, HEADER.pack(5 + 1, 0, 0x80) + b"\x00")
            connection.transmit()
            _, error, _ = await edge_inbox.next()
            assert error.code == "malformed" and "flags" in error.detail

            await peer.send(good)
            _, message, _ = await server_inbox.next()
            assert message == good

            # A length beyond every bound on another stream: that stream is abandoned, not the link.
            stray = connection._quic.get_next_available_stream_id()
            connection._quic.send_stream_data(stray, (2**31).to_bytes(4, "big") + b"\x00" * 16)
            connection.transmit()
            _, error, _ = await edge_inbox.next()
            assert error.code == "oversize"

            await peer.send(good)
            _, message, _ = await server_inbox.next()
            assert message == good and peer.is_connected

    run(scenario())


def test_too_many_open_exchanges_are_refused_and_others_carry_on(run, pki):
    async def scenario():
        inbox = Recorder()
        async with node(pki, "mnt-0", inbox, listen=True, max_incoming_exchanges=2) as server, node(pki, "edge-us") as edge:
            peer = await edge.connect(server.address)
            exchanges = [peer.open_stream() for _ in range(3)]
            for shard, exchange in enumerate(exchanges):
                await exchange.send(UpdatesSubscribed("edge-us", shard, 0, -1))
            refused = await exchanges[2].receive()
            assert isinstance(refused, ErrorReported) and refused.code == "unavailable"
            delivered = sorted([(await inbox.next())[1].shard for _ in range(2)])
            assert delivered == [0, 1]
            for exchange in exchanges:
                await exchange.close()

    run(scenario())


def test_aborted_exchange_stops_the_senders_work_and_the_connection_carries_on(run, pki):
    async def scenario():
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def endless(message, stream):
            if not isinstance(message, RequestForwarded):
                return
            aborted = asyncio.ensure_future(stream.wait_aborted())
            try:
                for token in range(10**6):
                    await stream.send(ResponseChunked(message.request_id, (token,), "", False))
                    await asyncio.sleep(0.002)
            except StreamClosed:
                await aborted
                outcome.set_result("stopped")
            else:
                outcome.set_result("ran to the end")

        async with node(pki, "us-0", Recorder(reply=endless), listen=True) as agent, node(pki, "edge-us") as edge:
            peer = await edge.connect(agent.address)
            exchange = peer.open_stream()
            await exchange.send(RequestForwarded("r1", "edge-us", "us", (1,), {}, True, 0), end=True)
            assert (await exchange.receive()).token_ids == (0,)
            assert (await exchange.receive()).token_ids == (1,)
            exchange.abort()  # the user went away
            assert await exchange.receive() is None
            assert await outcome == "stopped"
            async with peer.open_stream() as again:  # the connection is fine
                await again.send(RequestForwarded("r2", "edge-us", "us", (1,), {}, True, 0), end=True)
                reply = await again.receive()
                assert reply.request_id == "r2"
                again.abort()

    run(scenario())


def test_handler_failure_is_reported_on_the_exchange(run, pki):
    async def scenario():
        async def broken(message, stream):
            raise RuntimeError("boom")

        async with node(pki, "us-0", Recorder(reply=broken), listen=True) as agent, node(pki, "edge-us") as edge:
            peer = await edge.connect(agent.address)
            async with peer.open_stream() as exchange:
                await exchange.send(RequestForwarded("r1", "edge-us", "us", (1,), {}, True, 0))
                replies = [m async for m in exchange]
            assert len(replies) == 1 and replies[0].code == "internal"

    run(scenario())


# ---- connection loss and reconnection --------------------------------------------------------


def test_reconnects_after_server_restart(run, pki):
    async def scenario():
        states: list[bool] = []
        edge = QuicNode(
            NodeIdentity(Role.EDGE, "edge-us"),
            pki["edge-us"],
            on_message=Recorder(),
            on_peer_state=lambda peer, up: states.append(up),
            options=TransportOptions(reconnect_initial=0.02, reconnect_max=0.2),
        )
        try:
            async with node(pki, "mnt-0", listen=True) as first:
                address = first.address
                assert address is not None
                peer = await edge.connect(address, expected_role=Role.MAINTENANCE)
                async with peer.open_stream() as exchange:  # stays open across the restart
                    await exchange.send(UpdatesSubscribed("edge-us", 0, 0, -1))
                    await first.close()
                    with pytest.raises(PeerUnavailable):
                        await exchange.receive()
            while peer.is_connected:
                await asyncio.sleep(0.01)
            with pytest.raises(PeerUnavailable):
                await peer.send(UpdatesSubscribed("edge-us", 0, 0, -1))

            inbox = Recorder()
            async with node(pki, "mnt-0", inbox, listen=True, port=address[1]):
                await peer.wait_connected()
                await peer.send(UpdatesSubscribed("edge-us", 1, 0, -1))
                _, message, _ = await inbox.next()
                assert message.shard == 1
            assert states[:3] == [True, False, True]
        finally:
            await edge.close()

    run(scenario())


def test_silent_server_is_detected_by_idle_timeout(run, pki):
    async def scenario():
        async with node(pki, "mnt-0", listen=True) as server, \
                node(pki, "edge-us", idle_timeout=0.5, ack_delay=0.04, max_ack_delay=0.05) as edge:
            relay = WanRelay(("127.0.0.1", 0), server.address, 0.0)
            address = await relay.start()
            for attempt in range(5):  # at load 40 a handshake can outlast the 0.5 s idle timeout
                try:
                    peer = await edge.connect(address)
                    break
                except HandshakeFailed:
                    if attempt == 4:
                        raise
            await relay.stop()  # the path goes silent without a CONNECTION_CLOSE (like SIGKILL)
            while peer.is_connected:
                await asyncio.sleep(0.02)
            assert isinstance(peer.last_error, PeerUnavailable)

    run(scenario())


def test_an_idle_connection_is_kept_alive_by_one_end_pinging_and_the_other_acknowledging(run, pki):
    # Either end pings only when the connection was quiet for a while (nothing ack-eliciting
    # sent or received: the dialling end keepalive_quiet_intervals intervals, the accepting end
    # one more): the dialling end pings, the accepting end hears it and only acknowledges (half
    # the packets of both pinging), one PING per quiet spell rather than one per interval, and
    # the connection outlives several idle timeouts.
    async def scenario():
        async with node(pki, "edge-us", listen=True, idle_timeout=1.6) as server, \
                node(pki, "mnt-0", idle_timeout=1.6) as client:
            peer = await client.connect(server.address)
            while not server.peers:
                await asyncio.sleep(0.01)
            ends = (server.peers[0]._connection, peer._connection)
            sent = [{last_ack_eliciting_sent(c._quic)} for c in ends]
            backlog = 0
            # 8 PINGs of the dialling end, 0.6-0.8 s apart: three idle timeouts.
            while max(len(s) for s in sent) < 8:
                for seen, connection in zip(sent, ends):
                    seen.add(last_ack_eliciting_sent(connection._quic))
                    backlog = max(backlog, connection.tracked_sent_packets)
                await asyncio.sleep(0.02)
            assert peer.is_connected and server.peers[0].is_connected
            # The other end sent a few at most (while the two settled, and the PING a backlog
            # of its ACK-only packets calls for), not one per quiet spell.
            assert len(sent[0]) <= 4 and len(sent[1]) >= 8, [len(s) for s in sent]
            assert backlog < ACK_ONLY_BACKLOG + 4, backlog
            # Quiet spells, not intervals (0.2 s): the PINGs' median spacing is about three.
            times = sorted(sent[1])[-7:]
            gaps = sorted(b - a for a, b in zip(times, times[1:]))
            assert gaps[len(gaps) // 2] >= 2.5 * 0.2, gaps

    run(scenario())


def _count_pings(connection) -> list[float]:
    """The times at which ``connection``'s keepalive queues a PING (aioquic's probes not included)."""
    pings: list[float] = []
    send_ping = connection._quic.send_ping

    def counted(uid: int) -> None:
        pings.append(time.monotonic())
        send_ping(uid)

    connection._quic.send_ping = counted
    return pings


def test_a_connection_carrying_a_heartbeat_more_often_than_its_quiet_spell_sends_no_ping(run, pki):
    # A datagram every 0.4 s (an agent's load report, once a second at the daemons' 4 s idle
    # timeout) is below the 0.58 s quiet spell (three 0.2 s intervals): neither end pings.
    async def scenario():
        async with node(pki, "edge-us", listen=True, idle_timeout=1.6) as server, \
                node(pki, "us-0", idle_timeout=1.6) as agent:
            peer = await agent.connect(server.address)
            while not server.peers:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the handshake's own traffic settles
            pings = [_count_pings(server.peers[0]._connection), _count_pings(peer._connection)]
            for i in range(8):
                peer.send_datagram(WorkerLoadReported("us-0", float(i), 0, 0))
                await asyncio.sleep(0.4)
            assert peer.is_connected
            assert pings == [[], []], pings

    run(scenario())


def test_a_ping_that_draws_no_answer_is_tried_again_every_interval(run, pki):
    # The path goes silent (no CONNECTION_CLOSE): after its quiet spell the dialling end pings,
    # hears nothing back, and pings again at each 0.2 s check until its idle timer runs out,
    # not once per quiet spell.
    async def scenario():
        async with node(pki, "mnt-0", listen=True, idle_timeout=1.6) as server, \
                node(pki, "edge-us", idle_timeout=1.6) as edge:
            relay = WanRelay(("127.0.0.1", 0), server.address, 0.0)
            address = await relay.start()
            peer = await edge.connect(address)
            pings = _count_pings(peer._connection)
            await relay.stop()
            while peer.is_connected:
                await asyncio.sleep(0.02)
            # At most 0.8 s to the first PING, then one per 0.2 s check up to 1.6 s after the
            # last packet heard: three or more (at a quiet spell each, one or two).
            assert len(pings) >= 3, pings

    run(scenario())


def test_send_waits_for_acknowledgements_beyond_the_send_buffer_limit(run, pki):
    async def scenario():
        inbox = Recorder()
        limit = 64 * 1024
        async with node(pki, "edge-us", inbox, listen=True) as far, node(pki, "mnt-0", send_buffer_limit=limit) as mnt:
            relay = WanRelay(("127.0.0.1", 0), far.address, 20.0)  # acknowledgements take >= 40 ms
            try:
                peer = await mnt.connect(await relay.start())
                batches = [UpdateBatchPublished(0, 1, seq, ((0, bytes(30_000)),)) for seq in range(1, 13)]
                for batch in batches:
                    await peer.send(batch)
                    # send() enqueued only once the backlog was within the limit.
                    assert peer.unacknowledged_bytes <= limit + 31_000
                assert [(await inbox.next())[1].seq for _ in batches] == list(range(1, 13))
            finally:
                await relay.stop()

    run(scenario())


# ---- WAN delay ---------------------------------------------------------------------------------


def test_wan_relay_adds_its_delay_to_round_trips(run, pki):
    async def scenario():
        delay_ms = 40.0
        async with node(pki, "us-0", Recorder(reply=answer_with_chunks), listen=True) as agent, node(pki, "edge-eu") as edge:
            relay = WanRelay(("127.0.0.1", 0), agent.address, delay_ms)
            relay_address = await relay.start()
            try:
                peer = await edge.connect(relay_address)
                for i in range(3):
                    started = time.monotonic()
                    async with peer.open_stream() as exchange:
                        await exchange.send(RequestForwarded(f"r{i}", "edge-eu", "eu", (1,), {}, True, 0), end=True)
                        replies = [m async for m in exchange]
                    assert time.monotonic() - started >= 2 * delay_ms / 1000.0
                    assert isinstance(replies[-1], ResponseCompleted)
                assert relay.forward_stats.sent > 0 and relay.backward_stats.sent > 0
            finally:
                await relay.stop()

    run(scenario())


# ---- certificate rotation (reload_tls) -------------------------------------------------------


def rotating_pki(root) -> dict[str, TlsFiles]:
    """A PKI of its own in ``root`` (these tests rewrite the files)."""
    init_ca(root / "ca", cluster_name="rotation")
    return {node_id: issue(root / "ca", root / "nodes", role=ROLES[node_id], node_id=node_id)
            for node_id in ("mnt-0", "edge-us", "edge-eu", "us-0")}


def serial(files: TlsFiles) -> int:
    from kvcompassd.certs import load_certificate

    return load_certificate(files.cert).serial_number


def inbound_from(server: QuicNode, node_id: str) -> Peer:
    (peer,) = [p for p in server.peers if not p.outbound and p.identity.node_id == node_id]
    return peer


def test_reload_rotates_listening_and_dialling_certificates_while_connections_carry_on(run, tmp_path):
    files = rotating_pki(tmp_path)

    async def scenario():
        inbox = Recorder()
        async with node(files, "mnt-0", inbox, listen=True) as mnt, node(files, "edge-us") as edge:
            established = await edge.connect(mnt.address, expected_role=Role.MAINTENANCE)
            old_mnt, old_edge = serial(files["mnt-0"]), serial(files["edge-us"])
            assert established.certificate.serial_number == old_mnt
            assert inbound_from(mnt, "edge-us").certificate.serial_number == old_edge

            issue(tmp_path / "ca", tmp_path / "nodes", role="maintenance", node_id="mnt-0")
            issue(tmp_path / "ca", tmp_path / "nodes", role="edge", node_id="edge-us")
            new_mnt, new_edge = serial(files["mnt-0"]), serial(files["edge-us"])
            assert {new_mnt, new_edge}.isdisjoint({old_mnt, old_edge})
            assert mnt.reload_tls().serial_number == new_mnt and mnt.certificate.serial_number == new_mnt
            assert edge.reload_tls().serial_number == new_edge

            # The established connection carries on, with the session it negotiated.
            await established.send(UpdatesSubscribed("edge-us", 0, 0, -1))
            _, message, _ = await inbox.next()
            assert message.shard == 0 and established.certificate.serial_number == old_mnt

            # A new inbound connection is answered with the new certificate ...
            async with node(files, "edge-eu") as other_edge:
                fresh = await other_edge.connect(mnt.address, expected_role=Role.MAINTENANCE)
                assert fresh.certificate.serial_number == new_mnt
            # ... and a new outbound one presents it.
            async with node(files, "us-0", listen=True) as agent:
                await edge.connect(agent.address, expected_role=Role.AGENT)
                assert inbound_from(agent, "edge-us").certificate.serial_number == new_edge

    run(scenario())


def test_reload_reads_a_new_ca_bundle_for_accepting_and_dialling(run, tmp_path):
    files = rotating_pki(tmp_path)
    init_ca(tmp_path / "ca2", cluster_name="rotation-2")
    # edge-eu and us-0 already moved to the new CA; mnt-0 still trusts only the old one.
    bundle = (tmp_path / "ca" / "ca.pem").read_bytes() + (tmp_path / "ca2" / "ca.pem").read_bytes()
    (tmp_path / "bundle.pem").write_bytes(bundle)
    for node_id, role in (("edge-eu", "edge"), ("us-0", "agent")):
        moved = issue(tmp_path / "ca2", tmp_path / "nodes2", role=role, node_id=node_id)
        files[node_id] = TlsFiles(ca=tmp_path / "bundle.pem", cert=moved.cert, key=moved.key)

    async def scenario():
        async with node(files, "mnt-0", listen=True) as mnt, node(files, "us-0", listen=True) as agent:
            async with node(files, "edge-eu") as new_ca_edge:
                with pytest.raises(HandshakeFailed, match="certificate refused"):
                    await new_ca_edge.connect(mnt.address)
            with pytest.raises(HandshakeFailed):  # the agent's certificate is from the new CA
                await mnt.connect(agent.address, expected_role=Role.AGENT)

            files["mnt-0"].ca.write_bytes(bundle)
            mnt.reload_tls()
            async with node(files, "edge-eu") as new_ca_edge:
                peer = await new_ca_edge.connect(mnt.address)
                assert peer.identity == NodeIdentity(Role.MAINTENANCE, "mnt-0")
            peer = await mnt.connect(agent.address, expected_role=Role.AGENT)
            assert peer.certificate.serial_number == serial(files["us-0"])

    run(scenario())


def test_reload_refuses_files_that_do_not_fit_together_and_keeps_the_old_ones(run, tmp_path):
    files = rotating_pki(tmp_path)

    async def scenario():
        async with node(files, "mnt-0", listen=True) as mnt:
            before = serial(files["mnt-0"])
            # A rotation copied half-way: the new key, the old certificate.
            spare = issue(tmp_path / "ca", tmp_path / "spare", role="maintenance", node_id="mnt-0")
            good_key = files["mnt-0"].key.read_bytes()
            files["mnt-0"].key.write_bytes(spare.key.read_bytes())
            with pytest.raises(CertError, match="is not the key of"):
                mnt.reload_tls()
            files["mnt-0"].key.write_bytes(good_key)
            # Another node's certificate, and one from a CA the bundle does not hold.
            files["mnt-0"].cert.write_bytes(files["edge-us"].cert.read_bytes())
            with pytest.raises(CertError, match="issued to"):
                mnt.reload_tls()
            init_ca(tmp_path / "other-ca", cluster_name="other")
            foreign = issue(tmp_path / "other-ca", tmp_path / "foreign", role="maintenance", node_id="mnt-0")
            files["mnt-0"].cert.write_bytes(foreign.cert.read_bytes())
            files["mnt-0"].key.write_bytes(foreign.key.read_bytes())
            with pytest.raises(CertError, match="does not verify"):
                mnt.reload_tls()
            async with node(files, "edge-us") as edge:
                peer = await edge.connect(mnt.address)
                assert peer.certificate.serial_number == before == mnt.certificate.serial_number

    run(scenario())
