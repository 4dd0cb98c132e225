"""The front door's HTTP/1.1 server on a loopback socket, driven from outside (raw sockets as
hostile or old clients would, aiohttp's client as a well-behaved one): framing, keep-alive and
pipelining, HEAD, HTTP/1.0, streaming with back-pressure and disconnects, bodies held within
their high water, refusals as JSON. No timing is asserted: tests wait for the server's answer."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompassd.core.config import FrontDoorLimits
from kvcompassd.http_server import BODY_HIGH_WATER, REFUSAL_LOGS_PER_S, HttpServer, Request, Response
from kvcompassd.httplimits import FrontDoorGuard

LIMITS = FrontDoorLimits(header_timeout_s=30.0, keepalive_timeout_s=30.0, max_header_bytes=4096)


class Echo:
    """A handler that answers each request with what it saw (its body read whole), plus routes
    that stream, wait, fail or leave the body unread."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.waiting: Request | None = None
        self.arrived = asyncio.Event()
        self.streamed = 0

    async def __call__(self, request: Request):
        if request.path == "/fail":
            raise RuntimeError("a bug in a handler")
        if request.path == "/unread":
            return Response(b'{"unread":true}', status=404)
        if request.path == "/wait":
            self.waiting = request
            self.arrived.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/stream":
            stream = request.start_stream({"Content-Type": "text/event-stream"})
            try:
                await stream.write(b"data: first\n\n")
                await self.release.wait()
                await stream.write(b"data: second\n\n")
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return stream
        if request.path == "/flood":
            stream = request.start_stream({"Content-Type": "application/octet-stream"})
            while self.streamed < 256 << 20:  # never reached while the client does not read
                await stream.write(b"x" * 65536)
                self.streamed += 65536
            return stream
        body = bytearray()
        async for piece in request.body():
            body += piece
        return Response(json.dumps({"method": request.method, "path": request.path, "query": request.query,
                                    "body": body.decode("latin-1"),
                                    "header": request.headers.get("x-test")}).encode())


@contextlib.asynccontextmanager
async def serving(limits: FrontDoorLimits = LIMITS, handler=None):
    guard = FrontDoorGuard(limits)
    server = HttpServer(handler or Echo(), guard)
    _, port = await server.start("127.0.0.1", 0)
    server.port = port
    try:
        yield server
    finally:
        await server.close()


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if head_only:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        body += await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, bytes(body[:-2])
        del body[-2:]


async def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /a?x=1 HTTP/1.1\r\nHost: h\r\n\r\n"
                     b"POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
                     b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        seen = [json.loads((await read_response(reader))[2]) for _ in range(3)]
        assert [(s["path"], s["body"]) for s in seen] == [("/a", ""), ("/b", "hello"), ("/c", "abcde")]
        assert seen[0]["query"] == "x=1"
        writer.close()


async def test_head_is_answered_without_a_body_and_the_connection_kept():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\nGET /y HTTP/1.1\r\nHost: h\r\n\r\n")
        status, headers, _ = await read_response(reader, head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        status, _, body = await read_response(reader)  # the next response follows at once
        assert status == 200 and json.loads(body)["path"] == "/y"
        writer.close()


async def test_http_1_0_closes_unless_asked_to_keep_alive():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers["connection"] == "keep-alive"
        writer.write(b"GET /old HTTP/1.0\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await reader.read() == b""
        writer.close()


async def test_a_handler_that_fails_is_a_json_500_and_the_server_keeps_serving():
    async with serving() as server, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.port}"
        async with session.get(url + "/fail") as r:
            assert r.status == 500 and (await r.json())["error"]["code"] == "internal_error"
        async with session.get(url + "/ok") as r:
            assert r.status == 200


async def test_a_response_sent_before_its_body_was_read_closes_and_the_client_still_reads_it():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /unread HTTP/1.1\r\nHost: h\r\nContent-Length: 4194304\r\n\r\n")
        writer.write(b"a" * (1 << 20))  # the client goes on sending while the server answers
        status, headers, body = await read_response(reader)
        assert status == 404 and headers["connection"] == "close" and json.loads(body) == {"unread": True}
        with contextlib.suppress(ConnectionError):
            writer.write(b"a" * (1 << 20))
            assert await reader.read() == b""  # closed after the linger, never a second answer
        writer.close()


async def test_an_unread_body_stops_reading_at_its_high_water():
    echo = Echo()
    async with serving(handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /wait HTTP/1.1\r\nHost: h\r\nContent-Length: 16777216\r\n\r\n")
        writer.write(b"b" * (16 << 20))
        await echo.arrived.wait()
        connection = echo.waiting._connection
        while not connection.read_paused:
            await asyncio.sleep(0.01)
        held = echo.waiting._queued
        assert BODY_HIGH_WATER < held <= BODY_HIGH_WATER + (1 << 20)  # one read past it at most
        echo.release.set()  # the handler reads it now: reading resumes, the whole body arrives
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "b" * (16 << 20)
        writer.close()


async def test_a_stream_waits_for_a_client_that_does_not_read():
    echo = Echo()
    async with serving(handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /flood HTTP/1.1\r\nHost: h\r\n\r\n")
        while not any(c.write_paused for c in server.connections):
            await asyncio.sleep(0.01)
        streamed = echo.streamed
        await asyncio.sleep(0)  # the handler had its turn: still waiting
        assert echo.streamed == streamed < 256 << 20
        writer.close()
        while server.connections:
            await asyncio.sleep(0.01)


async def test_a_stream_whose_client_stops_reading_ends_at_the_keepalive_timeout():
    # The client neither reads nor hangs up: the handler's write gives up after the keep-alive
    # timeout instead of holding the handler (and the worker's generation) for ever.
    echo = Echo()
    limits = FrontDoorLimits(header_timeout_s=30.0, keepalive_timeout_s=0.2, max_header_bytes=4096)
    async with serving(limits, handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /flood HTTP/1.1\r\nHost: h\r\n\r\n")
        while server.guard.refusals["write_stalled"] == 0:
            await asyncio.sleep(0.01)
        while server.connections:
            await asyncio.sleep(0.01)
        assert echo.streamed < 256 << 20
        writer.close()


async def test_a_client_gone_mid_stream_cancels_its_handler():
    echo = Echo()
    async with serving(handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\n")
        status, headers, _ = await read_response(reader, head_only=True)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert b"data: first" in await reader.readuntil(b"\n\n")
        writer.close()
        await echo.cancelled.wait()


async def test_a_stream_ends_with_its_last_chunk_and_keeps_the_connection():
    echo = Echo()
    echo.release.set()
    async with serving(handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\nGET /after HTTP/1.1\r\nHost: h\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and body == b"data: first\n\ndata: second\n\n"
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["path"] == "/after"
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed():
    async with serving(FrontDoorLimits(keepalive_timeout_s=0.05)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert await reader.read() == b""
        assert server.guard.connections == 0 and sum(server.guard.refusals.values()) == 0


@pytest.mark.parametrize("raw,status,code,reason", [
    (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"v" * 100000 + b"\r\n\r\n", 431, "headers_too_large",
     "header_too_large"),  # one read, one field: counted as the parser hands it over
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_request", "malformed_request"),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabc", 400, "invalid_request",
     "malformed_request"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "invalid_request", "malformed_request"),
])
async def test_refusals_below_the_handler_are_json_counted_and_closed(raw, status, code, reason):
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        got, headers, body = await read_response(reader)
        assert got == status and json.loads(body)["error"]["code"] == code, body
        assert headers["connection"] == "close" and await reader.read() == b""
        assert server.guard.refusals[reason] == 1
        writer.close()


async def test_an_upgrade_is_answered_then_the_connection_closes():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x00")
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["connection"] == "close" and json.loads(body)["path"] == "/ws"
        assert await reader.read() == b""
        writer.close()


async def test_a_pipelined_head_behind_a_long_request_waits_for_it():
    echo = Echo()
    async with serving(FrontDoorLimits(header_timeout_s=0.05), handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: h\r\n\r\nGET /next HTTP/1.1\r\nHost: h\r\n\r\n")
        await echo.arrived.wait()
        await asyncio.sleep(0.2)  # past the head deadline: the queued head is not refused for it
        echo.release.set()
        assert json.loads((await read_response(reader))[2])["path"] == "/wait"
        assert json.loads((await read_response(reader))[2])["path"] == "/next"
        assert sum(server.guard.refusals.values()) == 0
        writer.close()


async def test_closing_the_server_cancels_the_request_in_progress():
    echo = Echo()
    async with serving(handler=echo) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: h\r\n\r\n")
        await echo.arrived.wait()
    assert echo.cancelled.is_set()
    assert await reader.read() == b""
    writer.close()


REQUESTS = st.lists(st.tuples(st.sampled_from(["GET", "POST"]), st.binary(max_size=300), st.booleans()),
                    min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=REQUESTS, cuts=st.lists(st.integers(min_value=1, max_value=4000), max_size=8))
async def test_any_split_of_pipelined_requests_gives_the_same_answers(requests, cuts):
    """However the bytes of several requests (whole or chunked bodies) are cut into reads, each is
    answered once, in order, with its own body."""
    wire = bytearray()
    for i, (method, body, chunked) in enumerate(requests):
        wire += f"{method} /r{i} HTTP/1.1\r\nHost: h\r\nX-Test: {i}\r\n".encode()
        if chunked:
            wire += b"Transfer-Encoding: chunked\r\n\r\n"
            for start in range(0, len(body), 97):
                piece = body[start:start + 97]
                wire += b"%x\r\n%b\r\n" % (len(piece), piece)
            wire += b"0\r\n\r\n"
        else:
            wire += b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        at = 0
        for cut in sorted(cuts):
            writer.write(bytes(wire[at:cut]))
            await writer.drain()
            at = max(at, cut)
        writer.write(bytes(wire[at:]))
        for i, (method, body, _) in enumerate(requests):
            status, _, answer = await read_response(reader)
            seen = json.loads(answer)
            assert status == 200 and seen == {"method": method, "path": f"/r{i}", "query": "",
                                              "body": body.decode("latin-1"), "header": str(i)}
        writer.close()


async def test_expect_100_continue_is_answered_when_the_handler_reads_the_body():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # before any body byte
        writer.write(b"hello")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "hello"
        writer.close()


async def test_a_flood_of_refusals_logs_a_bounded_number_of_lines():
    async with serving() as server:
        with structlog.testing.capture_logs() as logs:
            for _ in range(50):  # microseconds apart: one second boundary at most
                server.log_refusal(400, "malformed_request", "garbage")
        refused = [e for e in logs if e["event"] == "request refused"]
        assert len(refused) <= 2 * REFUSAL_LOGS_PER_S


async def test_a_client_pipelining_without_reading_the_answers_holds_a_bounded_buffer():
    async with serving(FrontDoorLimits(keepalive_timeout_s=0.5)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n" * 100000)  # ~3 MB of requests, answers never read
        while not server.connections or not all(c.write_paused and c.read_paused for c in server.connections):
            await asyncio.sleep(0.01)
        (connection,) = server.connections
        held = connection.transport.get_write_buffer_size()
        for _ in range(100):
            await asyncio.sleep(0)  # the server stays where it is
        assert connection.transport.get_write_buffer_size() == held < 1 << 20
        assert len(connection.pending) <= 1 + (256 << 10) // 30  # at most one read of heads
        while server.connections:  # then dropped like an idle connection, though it never reads
            await asyncio.sleep(0.01)
        assert server.guard.connections == 0
        writer.transport.abort()


async def test_an_absolute_form_target_is_served_by_its_path():
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET http://edge.example:8080/v1/models?x=1 HTTP/1.1\r\nHost: edge.example\r\n\r\n"
                     b"GET http://edge.example HTTP/1.1\r\nHost: edge.example\r\n\r\n")
        seen = json.loads((await read_response(reader))[2])
        assert (seen["path"], seen["query"]) == ("/v1/models", "x=1")
        assert json.loads((await read_response(reader))[2])["path"] == "/"
        writer.close()


async def test_a_response_that_cannot_be_written_aborts_its_connection_only():
    async def handler(request: Request):
        if request.path == "/bad":
            return Response(b"{}", headers={"X-Bad": "\u20ac"})  # not latin-1: a bug in a handler
        return Response(b"{}")

    async with serving(handler=handler) as server, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.port}"
        with pytest.raises(aiohttp.ClientError):
            async with session.get(url + "/bad") as r:
                await r.read()
        async with session.get(url + "/good") as r:
            assert r.status == 200
