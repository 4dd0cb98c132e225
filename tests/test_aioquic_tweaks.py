"""aioquic's private fields are read in one module only, and only with the aioquic version that
module was checked against."""

from __future__ import annotations

import contextlib
import re
import ssl
import tomllib
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.certs import init_ca, issue
from kvcompassd.transport import TransportOptions, aioquic_tweaks
from kvcompassd.transport.connection import QuicConnectionTransport
from kvcompassd.transport.aioquic_tweaks import (
    EarlyAcks,
    acknowledge_when_timer_fires,
    acknowledgement_due,
    advertise_max_ack_delay,
    nothing_to_send,
    peer_max_ack_delay,
    set_ack_delay,
)

ROOT = Path(__file__).resolve().parents[1]
# aioquic's private QuicConnection/stream/recovery attributes kvcompass has ever read (on
# anything but ``self``: the project's own classes have private fields of the same names).
PRIVATE = re.compile(r"_quic\._\w|(?<!self)\.(_streams|_loss|_spaces|_max_datagram_size|_buffer_start|_buffer_stop|"
                     r"_handshake_complete|_ping_pending|_pacer|_request_client_certificate)\b")


def test_the_installed_and_the_required_aioquic_are_the_checked_one():
    assert version("aioquic") in aioquic_tweaks.CHECKED_AIOQUIC
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [d for d in deps if d.startswith("aioquic")]
    assert pin.replace(" ", "") in {f"aioquic=={v}" for v in aioquic_tweaks.CHECKED_AIOQUIC}


def test_no_module_but_aioquic_tweaks_reads_aioquic_private_fields():
    tweaks = Path(aioquic_tweaks.__file__).resolve()
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for folder in ("kvcompassd", "tools")
                 for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() != tweaks
                 for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert offenders == []
    assert PRIVATE.search(tweaks.read_text())  # the pattern does see the accesses where they are


# -- nothing_to_send: whenever it says a transmit would build nothing, aioquic agrees -------------

SERVER_ADDR = ("127.0.0.1", 4433)
CLIENT_ADDR = ("127.0.0.1", 1234)


@pytest.fixture(scope="module")
def server_tls(tmp_path_factory):
    root = tmp_path_factory.mktemp("quic-pair")
    init_ca(root / "ca", cluster_name="test")
    return issue(root / "ca", root / "nodes", role="maintenance", node_id="mnt-0")


class Pair:
    """A client and a server QuicConnection exchanging datagrams by hand on a virtual clock, the
    way the transport drives them; after every datagram a side receives, ``nothing_to_send`` is
    checked against what ``datagrams_to_send`` then really builds. With ``max_ack_delay`` both
    ends advertise it, and with ``early_after`` each side's ``EarlyAcks`` sees its datagrams and
    transmits as the transport shows them."""

    def __init__(self, tls, *, max_stream_data: int = 64 * 1024, max_data: int = 256 * 1024,
                 ack_delay: float = 0.005, max_ack_delay: float | None = None, early_after: int | None = None) -> None:
        self.now = 1000.0
        limits = {"max_datagram_frame_size": 65536, "max_stream_data": max_stream_data, "max_data": max_data}
        client_config = QuicConfiguration(is_client=True, alpn_protocols=["kvc-test"], verify_mode=ssl.CERT_NONE,
                                          **limits)
        server_config = QuicConfiguration(is_client=False, alpn_protocols=["kvc-test"], **limits)
        server_config.load_cert_chain(tls.cert, tls.key)
        self.client = QuicConnection(configuration=client_config)
        self.server = QuicConnection(configuration=server_config,
                                     original_destination_connection_id=self.client.original_destination_connection_id)
        self.sides = {"client": self.client, "server": self.server}
        if max_ack_delay is not None:
            for side in (self.client, self.server):
                advertise_max_ack_delay(side, max_ack_delay)
        self.early = {name: EarlyAcks(quic, early_after) for name, quic in self.sides.items()} if early_after else {}
        self.streams: list[int] = []
        self.closed: set[tuple[str, int]] = set()  # (side, stream) whose sending side ended or was reset
        self.idle_claims = 0  # datagrams after which nothing_to_send said True (and was right)
        self.client.connect(SERVER_ADDR, now=self.now)
        for _ in range(10):
            self.flush("client")
            self.flush("server")
            self.advance(0.001)
        assert self.client._handshake_confirmed and self.server._handshake_confirmed
        for side in (self.client, self.server):
            set_ack_delay(side, ack_delay)

    def other(self, name: str) -> str:
        return "server" if name == "client" else "client"

    def flush(self, name: str, drop: int = 0) -> None:
        """Send what ``name`` has to send; each datagram whose bit is set in ``drop`` is lost."""
        sender, receiver = self.sides[name], self.sides[self.other(name)]
        early = self.early.get(self.other(name))
        datagrams = sender.datagrams_to_send(now=self.now)
        self.transmitted(name)
        for i, (data, _) in enumerate(datagrams):
            if drop >> (i % 16) & 1:
                continue
            if early:
                early.before_datagram()
            receiver.receive_datagram(data, CLIENT_ADDR if name == "client" else SERVER_ADDR, now=self.now)
            self._drain_events(receiver)
            if early:
                early.after_datagram(self.now)
            if nothing_to_send(receiver, self.now):
                assert receiver.datagrams_to_send(now=self.now) == []
                self.idle_claims += 1

    def transmitted(self, name: str) -> None:
        if name in self.early:
            self.early[name].after_transmit()

    def _drain_events(self, quic: QuicConnection) -> None:
        while quic.next_event() is not None:
            pass

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for quic in (self.client, self.server):
            timer = quic.get_timer()
            if timer is not None and timer <= self.now:
                quic.handle_timer(now=self.now)
                self._drain_events(quic)

    def apply(self, op) -> None:
        kind, side, n, size = op
        quic = self.sides[side]
        if kind == "open":
            stream_id = self.client.get_next_available_stream_id()
            self.client.send_stream_data(stream_id, b"o" * size)
            self.streams.append(stream_id)
        elif kind == "send" and self.streams:
            stream_id = self.streams[n % len(self.streams)]
            if (side, stream_id) not in self.closed and stream_id in quic._streams:
                end = size % 7 == 0
                try:
                    quic.send_stream_data(stream_id, b"s" * size, end_stream=end)
                except RuntimeError:  # the peer's STOP_SENDING reset it: aioquic refuses, rightly
                    end = True
                if end:
                    self.closed.add((side, stream_id))
        elif kind == "reset" and self.streams:
            stream_id = self.streams[n % len(self.streams)]
            if (side, stream_id) not in self.closed and stream_id in quic._streams:
                with contextlib.suppress(RuntimeError):  # (already reset at the peer's STOP_SENDING)
                    quic.reset_stream(stream_id, 1)
                self.closed.add((side, stream_id))
        elif kind == "stop" and self.streams:
            stream_id = self.streams[n % len(self.streams)]
            if stream_id in quic._streams:
                quic.stop_stream(stream_id, 2)
        elif kind == "datagram":
            quic.send_datagram_frame(b"d" * min(size, 1000))
        elif kind == "ping":
            quic.send_ping(n)
        elif kind == "flush":
            self.flush(side, drop=n)
        elif kind == "wait":
            self.advance(size / 1000.0)


OPS = st.tuples(st.sampled_from(["open", "send", "send", "reset", "stop", "datagram", "ping", "flush", "flush",
                                 "flush", "wait", "wait"]),
                st.sampled_from(["client", "server"]), st.integers(0, 1 << 16), st.integers(0, 40_000))


# aioquic's own acknowledgement timing, and the daemons' (TransportOptions' defaults).
ACK_TIMINGS = {"prompt": {}, "delayed": {"ack_delay": 0.08, "max_ack_delay": 0.1, "early_after": 8}}


@pytest.mark.parametrize("timing", sorted(ACK_TIMINGS))
@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=st.lists(OPS, max_size=60))
def test_nothing_to_send_is_never_wrong(server_tls, timing, ops):
    pair = Pair(server_tls, **ACK_TIMINGS[timing])
    for op in ops:
        pair.apply(op)
    for _ in range(30):  # and as everything settles: acknowledgements, retransmissions, limits
        pair.advance(0.01)
        pair.flush("client")
        pair.flush("server")


def test_a_one_way_stream_leaves_the_receiver_nothing_to_send_until_its_acknowledgement_is_due(server_tls):
    pair = Pair(server_tls)
    stream_id = pair.client.get_next_available_stream_id()
    for _ in range(20):
        pair.client.send_stream_data(stream_id, b"report" * 50)
        pair.flush("client")  # the server receives: only an ACK owed, not yet due
        pair.advance(0.002)
        pair.flush("server")  # (its ACK goes when due, as the timer sends it)
        pair.flush("client")
    assert pair.idle_claims >= 20
    pair.client.send_stream_data(stream_id, b"report" * 50)
    pair.flush("client")
    pair.advance(0.006)
    assert not nothing_to_send(pair.server, pair.now)  # the acknowledgement is due now
    assert pair.server.datagrams_to_send(now=pair.now)


def test_a_side_with_stream_data_queued_has_something_to_send(server_tls):
    pair = Pair(server_tls)
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(stream_id, b"question")
    pair.flush("client")
    pair.server.send_stream_data(stream_id, b"answer")  # queued, not sent yet
    pair.client.send_stream_data(stream_id, b"more")
    pair.flush("client")  # the server receives with its answer still queued
    assert not nothing_to_send(pair.server, pair.now)
    assert pair.server.datagrams_to_send(now=pair.now)


def test_a_connection_past_half_its_flow_control_window_has_a_limit_to_raise(server_tls):
    pair = Pair(server_tls, max_stream_data=1 << 20, max_data=16 * 1024)
    for _ in range(2):
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"x" * 5000)
    window = pair.server._local_max_data
    for _ in range(50):  # (the client's pacer lets a few packets go at a time)
        pair.flush("client")
        if window.used * 2 > window.value:
            break
        pair.advance(0.001)
    # Over half of the server's 16 KiB window used: MAX_DATA is owed now.
    assert window.used * 2 > window.value and not nothing_to_send(pair.server, pair.now)
    assert pair.server.datagrams_to_send(now=pair.now)


# -- a long acknowledgement delay: advertised, and cut short by packets piling up or a gap --------

def one_packet(pair: Pair, stream_id: int, *, drop: int = 0) -> None:
    pair.client.send_stream_data(stream_id, b"report" * 50)
    pair.flush("client", drop=drop)


def test_each_end_allows_for_the_delay_the_other_advertised(server_tls):
    pair = Pair(server_tls, ack_delay=0.08, max_ack_delay=0.1, early_after=8)
    assert peer_max_ack_delay(pair.client) == peer_max_ack_delay(pair.server) == 0.1
    assert peer_max_ack_delay(Pair(server_tls).client) == 0.025  # aioquic's own
    with pytest.raises(ValueError):
        set_ack_delay(pair.client, 0.1)  # not below what it advertised
    with pytest.raises(ValueError):
        advertise_max_ack_delay(pair.client, 16.384)


def test_the_advertised_delay_is_rounded_up_to_whole_milliseconds(server_tls):
    quic = Pair(server_tls).client
    advertise_max_ack_delay(quic, 0.1004)  # advertised as 101 ms, so a delay of 100.2 ms fits
    set_ack_delay(quic, 0.1002)
    advertise_max_ack_delay(quic, 0.1)
    with pytest.raises(ValueError):
        set_ack_delay(quic, 0.1)


def test_an_acknowledgement_waits_its_delay_unless_packets_pile_up(server_tls):
    pair = Pair(server_tls, ack_delay=0.08, max_ack_delay=0.1, early_after=8)
    stream_id = pair.client.get_next_available_stream_id()
    one_packet(pair, stream_id)
    pair.advance(0.079)
    assert nothing_to_send(pair.server, pair.now)  # owed, not due
    pair.advance(0.002)
    assert not nothing_to_send(pair.server, pair.now)  # due after the delay
    pair.flush("server")
    for _ in range(7):
        one_packet(pair, stream_id)
        pair.advance(0.001)
        assert nothing_to_send(pair.server, pair.now)
    one_packet(pair, stream_id)  # the eighth since the acknowledgement became owed: at once
    assert not nothing_to_send(pair.server, pair.now)
    pair.flush("server")
    one_packet(pair, stream_id)  # an acknowledgement sent starts the count again
    assert nothing_to_send(pair.server, pair.now)


def test_a_packet_after_a_gap_is_acknowledged_at_once(server_tls):
    pair = Pair(server_tls, ack_delay=0.08, max_ack_delay=0.1, early_after=8)
    stream_id = pair.client.get_next_available_stream_id()
    one_packet(pair, stream_id)
    one_packet(pair, stream_id, drop=1)  # lost
    assert nothing_to_send(pair.server, pair.now)
    one_packet(pair, stream_id)
    assert not nothing_to_send(pair.server, pair.now)  # the sender hears of the loss now
    pair.flush("server")
    for _ in range(20):  # and the lost data is sent again and delivered
        pair.advance(0.01)
        pair.flush("client")
        pair.flush("server")
    assert pair.server._streams[stream_id].receiver.highest_offset == 3 * 300


def test_early_acks_refuse_a_count_below_one(server_tls):
    with pytest.raises(ValueError):
        EarlyAcks(Pair(server_tls).client, 0)


# -- an acknowledgement timer that fires early (item 6) -------------------------------------------


def test_an_acknowledgement_whose_timer_fired_is_due_at_once(server_tls):
    pair = Pair(server_tls, ack_delay=0.08, max_ack_delay=0.1, early_after=8)
    one_packet(pair, pair.client.get_next_available_stream_id())
    ack_at = pair.server.get_timer()
    assert acknowledgement_due(pair.server) and ack_at == pytest.approx(pair.now + 0.08)
    early = ack_at - 0.0004  # where uvloop's millisecond timer may run it
    assert pair.server.datagrams_to_send(now=early) == []  # aioquic's own reading: not yet due
    assert not acknowledge_when_timer_fires(pair.server, ack_at - 0.001, early)  # a timer for before it
    assert acknowledge_when_timer_fires(pair.server, ack_at, early)
    assert len(pair.server.datagrams_to_send(now=early)) == 1
    assert not acknowledgement_due(pair.server)
    assert not acknowledge_when_timer_fires(pair.server, ack_at, early)  # nothing owed any more


class _Loop:
    """What a connection's timer path asks of its event loop, on a clock set by hand."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.armed: list[float] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback):
        self.armed.append(when)
        return SimpleNamespace(cancel=lambda: None)


class _Datagrams:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr) -> None:
        self.sent.append(data)


@pytest.mark.parametrize("transport_class", [QuicConnectionTransport, QuicConnectionProtocol])
async def test_the_transport_sends_an_acknowledgement_when_its_timer_runs_early(server_tls, transport_class):
    """The daemons' transport sends the acknowledgement its timer was armed for, however early
    uvloop runs it; aioquic's own protocol sends nothing then and arms the timer for the same
    moment again (which the loop runs at once, over and over, until its clock gets there)."""
    pair = Pair(server_tls, ack_delay=0.08, max_ack_delay=0.1, early_after=8)
    one_packet(pair, pair.client.get_next_available_stream_id())
    ack_at = pair.server.get_timer()
    node = SimpleNamespace(options=TransportOptions(), deliver=lambda *args: None)
    if transport_class is QuicConnectionTransport:
        protocol = QuicConnectionTransport(pair.server, node=node, outbound=True)
    else:
        protocol = transport_class(pair.server)
    protocol._loop = loop = _Loop(ack_at - 0.0004)
    protocol._transport = datagrams = _Datagrams()
    protocol._timer_at = ack_at
    protocol._handle_timer()
    if transport_class is QuicConnectionTransport:
        assert len(datagrams.sent) == 1 and not acknowledgement_due(pair.server)
    else:
        assert datagrams.sent == [] and loop.armed == [ack_at]
