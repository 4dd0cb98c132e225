"""The exchange protocol without sockets: bytes in, events out; frames to send, bytes out."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.transport.framing import HEADER, MAX_FRAME_LENGTH, FrameDecoder, encode_frame
from kvcompassd.transport.protocol import (
    ControlReceived,
    DatagramReceived,
    ExchangeAborted,
    ExchangeEnded,
    ExchangeMessageReceived,
    ExchangeProtocol,
    FrameRejected,
    StreamAbandoned,
    StreamCorrupted,
)
from kvcompassd.wire import ErrorReported, RequestForwarded, ResponseChunked, Role, WorkerLoadReported, decode, encode

LOAD = WorkerLoadReported(worker="w1", queue_ms=3.5, running=2, waiting=1)
FORBIDDEN = RequestForwarded(request_id="r1", edge="e1", origin_region="us", input_ids=(1, 2, 3), sampling_params={},
                             stream=True, claimed_tokens=0)

# A client's own bidirectional streams are 0, 4, 8, ...; the peer's (a server) 1, 5, 9, ...
PEER_STREAM, OTHER_PEER_STREAM = 1, 5


def chunk(i: int) -> ResponseChunked:
    return ResponseChunked(request_id=f"r{i}", token_ids=(i,), text=f"t{i}", finished=False)


def client(*, max_incoming: int = 16, exchange_streams: int = 4, identified: bool = True) -> ExchangeProtocol:
    ids = itertools.count(0, 4)
    protocol = ExchangeProtocol(is_client=True, next_stream_id=lambda: next(ids),
                                open_incoming=lambda stream_id, exchange: ("in", stream_id, exchange),
                                max_incoming_exchanges=max_incoming, exchange_streams=exchange_streams)
    if identified:
        protocol.identify(Role.AGENT)
    return protocol


def feed(protocol: ExchangeProtocol, stream_id: int, data: bytes, end: bool = False) -> list:
    return list(protocol.receive_stream_data(stream_id, data, end))


def replies(frame_bytes: bytes) -> list:
    return [decode(frame.body) for frame in FrameDecoder().feed(frame_bytes)]


def test_control_messages_arrive_in_order_whatever_the_chunking() -> None:
    protocol = client()
    data = encode_frame(0, encode(LOAD)) + encode_frame(0, encode(chunk(1)))
    events = [e for i in range(len(data)) for e in feed(protocol, PEER_STREAM, data[i:i + 1])]
    assert events == [ControlReceived(LOAD), ControlReceived(chunk(1))]


def test_nothing_is_read_before_the_peer_is_identified() -> None:
    protocol = client(identified=False)
    assert feed(protocol, PEER_STREAM, encode_frame(0, encode(LOAD))) == []
    assert list(protocol.receive_datagram(encode(LOAD))) == []
    assert protocol.incoming == {}


def test_datagram_is_decoded_and_checked() -> None:
    protocol = client()
    assert list(protocol.receive_datagram(encode(LOAD))) == [DatagramReceived(LOAD)]
    [rejected] = protocol.receive_datagram(encode(FORBIDDEN))
    assert isinstance(rejected, FrameRejected) and rejected.code == "forbidden"
    assert rejected.stream_id == protocol.control_stream() and rejected.exchange_id == 0


def test_interleaved_exchanges_on_two_streams_reach_their_own_handles() -> None:
    protocol = client()
    a, b = ("out", 1), ("out", 2)
    protocol.register_outgoing(0, 1, a)  # our exchange 1 on our stream 0
    protocol.register_outgoing(4, 2, b)  # our exchange 2 on our stream 4
    on_0 = encode_frame(1, encode(chunk(1))) + encode_frame(1, encode(chunk(3)), end=True)
    on_4 = encode_frame(2, encode(chunk(2))) + encode_frame(2, encode(chunk(4)))
    events = []
    for i in range(0, max(len(on_0), len(on_4)), 7):  # alternate 7-byte pieces of both streams
        events += feed(protocol, 0, on_0[i:i + 7]) + feed(protocol, 4, on_4[i:i + 7])
    assert [e for e in events if getattr(e, "exchange", None) == a] == [
        ExchangeMessageReceived(a, False, chunk(1)), ExchangeMessageReceived(a, False, chunk(3)), ExchangeEnded(a)]
    assert [e for e in events if getattr(e, "exchange", None) == b] == [
        ExchangeMessageReceived(b, False, chunk(2)), ExchangeMessageReceived(b, False, chunk(4))]


def test_an_exchange_the_peer_opens_is_accepted_on_its_first_frame() -> None:
    protocol = client()
    events = feed(protocol, PEER_STREAM, encode_frame(7, encode(chunk(1))) + encode_frame(7, b"", end=True))
    handle = ("in", PEER_STREAM, 7)
    assert events == [ExchangeMessageReceived(handle, True, chunk(1)), ExchangeEnded(handle)]
    assert protocol.incoming == {(PEER_STREAM, 7): handle}
    protocol.forget(PEER_STREAM, 7, incoming=True)
    assert protocol.incoming == {}


def test_a_bare_end_for_an_exchange_never_opened_is_dropped() -> None:
    protocol = client()
    assert feed(protocol, PEER_STREAM, encode_frame(9, b"", end=True)) == []
    assert protocol.incoming == {}


def test_late_frames_for_a_finished_exchange_of_ours_are_ignored() -> None:
    protocol = client()
    protocol.register_outgoing(0, 1, "mine")
    protocol.forget(0, 1, incoming=False)
    assert feed(protocol, 0, encode_frame(1, encode(chunk(1)))) == []


def test_abort_reaches_the_exchange_and_nothing_else_of_the_frame_does() -> None:
    protocol = client()
    protocol.register_outgoing(0, 1, "mine")
    assert feed(protocol, 0, encode_frame(1, b"", abort=True)) == [ExchangeAborted("mine")]


def test_malformed_body_is_answered_on_its_exchange_and_the_stream_carries_on() -> None:
    protocol = client()
    protocol.register_outgoing(0, 1, "mine")
    events = feed(protocol, 0, encode_frame(1, b"\xc1 not msgpack") + encode_frame(1, encode(chunk(2))))
    rejected, delivered = events
    assert isinstance(rejected, FrameRejected) and rejected.code == "malformed"
    assert (rejected.stream_id, rejected.exchange_id) == (0, 1)
    [error] = replies(rejected.frame)
    assert isinstance(error, ErrorReported) and error.code == "malformed"
    assert delivered == ExchangeMessageReceived("mine", False, chunk(2))


def test_forbidden_message_is_refused_for_the_peers_role() -> None:
    protocol = client()
    [rejected] = feed(protocol, PEER_STREAM, encode_frame(0, encode(FORBIDDEN)))
    assert rejected.code == "forbidden" and "agent node may not send RequestForwarded" in rejected.detail
    assert isinstance(replies(rejected.frame)[0], ErrorReported)


def test_unknown_flags_reject_one_frame_only() -> None:
    protocol = client()
    body = encode(LOAD)
    bad = HEADER.pack(5 + len(body), 0, 0x80) + body
    rejected, delivered = feed(protocol, PEER_STREAM, bad + encode_frame(0, body))
    assert rejected.code == "malformed" and "flags" in rejected.detail
    assert delivered == ControlReceived(LOAD)


def test_oversized_length_abandons_that_stream_alone() -> None:
    protocol = client()
    protocol.register_outgoing(0, 1, "on-0")
    protocol.register_outgoing(4, 2, "on-4")
    events = feed(protocol, 0, HEADER.pack(MAX_FRAME_LENGTH + 1, 1, 0) + b"x" * 64)
    rejected, corrupted, abandoned = events
    assert rejected.code == "oversize" and rejected.exchange_id == 0
    assert isinstance(replies(rejected.frame)[0], ErrorReported)
    assert corrupted == StreamCorrupted(0, corrupted.detail)
    assert abandoned == StreamAbandoned(0, corrupted.detail, ("on-0",))
    assert protocol.outgoing == {(4, 2): "on-4"}
    assert feed(protocol, 4, encode_frame(2, encode(chunk(1)))) == [ExchangeMessageReceived("on-4", False, chunk(1))]


def test_reset_loses_every_exchange_of_that_stream() -> None:
    protocol = client()
    protocol.register_outgoing(0, 1, "ours")
    feed(protocol, 0, encode_frame(5, encode(chunk(1))[:3]))  # half a frame buffered, then reset
    feed(protocol, PEER_STREAM, encode_frame(3, encode(chunk(1))))
    feed(protocol, OTHER_PEER_STREAM, encode_frame(3, encode(chunk(1))))
    assert protocol.abandon_stream(PEER_STREAM, "reset") == StreamAbandoned(PEER_STREAM, "reset",
                                                                            (("in", PEER_STREAM, 3),))
    assert set(protocol.incoming) == {(OTHER_PEER_STREAM, 3)}
    assert protocol.abandon_stream(0, "reset").exchanges == ("ours",)


def test_peer_ending_a_stream_abandons_it_after_its_last_frames() -> None:
    protocol = client()
    events = feed(protocol, PEER_STREAM, encode_frame(3, encode(chunk(1))), end=True)
    handle = ("in", PEER_STREAM, 3)
    assert events == [ExchangeMessageReceived(handle, True, chunk(1)),
                      StreamAbandoned(PEER_STREAM, "peer ended the stream", (handle,))]


def test_incoming_exchanges_beyond_the_limit_are_refused_once_each() -> None:
    protocol = client(max_incoming=2)
    feed(protocol, PEER_STREAM, encode_frame(1, encode(chunk(1))) + encode_frame(2, encode(chunk(2))))
    [refused] = feed(protocol, PEER_STREAM, encode_frame(3, encode(chunk(3))))
    assert refused.code == "unavailable" and (refused.stream_id, refused.exchange_id) == (PEER_STREAM, 3)
    assert len(protocol.incoming) == 2


def test_sending_round_robins_a_bounded_pool_of_streams() -> None:
    protocol = client(exchange_streams=3)
    control = protocol.control_stream()
    picks = [protocol.pick_exchange_stream() for _ in range(9)]
    assert control == 0 and protocol.control_stream() == 0
    assert len(set(picks)) == 3 and control not in picks
    assert picks[3:6] == picks[6:9]  # once the pool is full, every exchange reuses it in turn


def test_exchange_ids_skip_the_control_channel_when_they_wrap() -> None:
    protocol = client()
    protocol._next_exchange = (1 << 32) - 1
    assert [protocol.new_exchange_id() for _ in range(2)] == [(1 << 32) - 1, 1]


def test_frames_to_send_read_back_as_sent() -> None:
    data = ExchangeProtocol.frame(4, encode(chunk(1))) + ExchangeProtocol.frame(4, b"", abort=True)
    first, last = FrameDecoder().feed(data)
    assert (first.exchange, first.end, decode(first.body)) == (4, False, chunk(1))
    assert (last.end, last.abort, last.body) == (True, True, b"")
    assert data[HEADER.size - 1] == 0  # no flags on a frame that neither ends nor aborts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8), st.booleans())
def test_any_bytes_give_events_never_exceptions(chunks: list[bytes], end: bool) -> None:
    protocol = client(max_incoming=4)
    protocol.register_outgoing(0, 1, "ours")
    for i, data in enumerate(chunks):
        for event in protocol.receive_stream_data(i % 2, data, end and i == len(chunks) - 1):
            if isinstance(event, FrameRejected):
                assert isinstance(replies(event.frame)[0], ErrorReported)
    assert len(protocol.incoming) <= 4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 4, 8]), st.integers(1, 3)), min_size=1, max_size=30),
       st.data())
def test_each_exchange_gets_its_own_messages_in_order_however_streams_interleave_and_split(sends, data) -> None:
    protocol = client()
    for stream_id in (0, 4, 8):
        for exchange in (1, 2, 3):
            protocol.register_outgoing(stream_id, exchange, (stream_id, exchange))
    pending = {0: bytearray(), 4: bytearray(), 8: bytearray()}
    expected: dict[tuple[int, int], list] = {}
    for i, (stream_id, exchange) in enumerate(sends):
        pending[stream_id] += encode_frame(exchange, encode(chunk(i)))
        expected.setdefault((stream_id, exchange), []).append(chunk(i))
    got: dict[tuple[int, int], list] = {}
    while any(pending.values()):
        stream_id = data.draw(st.sampled_from([s for s, b in pending.items() if b]))
        size = data.draw(st.integers(1, len(pending[stream_id])))
        piece, pending[stream_id] = bytes(pending[stream_id][:size]), pending[stream_id][size:]
        for event in feed(protocol, stream_id, piece):
            assert isinstance(event, ExchangeMessageReceived) and not event.incoming
            got.setdefault(event.exchange, []).append(event.message)
    assert got == expected
