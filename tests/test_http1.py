"""The lean HTTP/1.1 client toward workers, against aiohttp's own server (the other side) and
against raw sockets for what a well-behaved server never sends: framing by length, chunks and the
connection's end; keep-alive reuse and the retry of a request an idle connection's close cut
off; bounded heads, lines and bodies; interim answers; leaving early closing the connection."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.engine import http1
from kvcompassd.engine.http1 import (
    ConnectionClosed,
    ConnectionPool,
    HttpClientError,
    ResponseTooLarge,
    WorkerConnections,
)

GUARD_S = 30.0  # hang guard only


@contextlib.asynccontextmanager
async def aiohttp_server(routes):
    """aiohttp's server with ``routes``; yields (pool, the client ends of accepted connections)."""
    clients: set = set()

    @web.middleware
    async def note_client(request, handler):
        clients.add(request.transport.get_extra_info("peername"))
        return await handler(request)

    app = web.Application(middlewares=[note_client])
    app.add_routes(routes)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with WorkerConnections() as http, asyncio.timeout(GUARD_S):
            yield http.pool("127.0.0.1", port), clients
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(answer):
    """A TCP server running ``answer(reader, writer, index)`` for each connection (index from 0)."""
    count = 0

    async def serve(reader, writer):
        nonlocal count
        index, count = count, count + 1
        try:
            await answer(reader, writer, index)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with WorkerConnections() as http, asyncio.timeout(GUARD_S):
            yield http.pool("127.0.0.1", port)
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


async def test_bodies_by_length_and_by_chunks_over_one_kept_connection():
    async def whole(request):
        return web.Response(body=await request.read() + b"!")

    async def chunked(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async with aiohttp_server([web.post("/whole", whole), web.post("/chunked", chunked)]) as (pool, clients):
        for _ in range(3):
            async with pool.request(b"POST", b"/whole", b"hello") as resp:
                assert resp.status == 200 and await resp.read(1000) == b"hello!"
            async with pool.request(b"POST", b"/chunked", b"{}") as resp:
                assert resp.header(b"transfer-encoding") == b"chunked"
                assert [line async for line in resp.lines(100)] == [b"data: 0\n", b"\n", b"data: 1\n", b"\n",
                                                                    b"data: 2\n", b"\n"]
        assert pool.opened == 1 and len(clients) == 1


async def test_a_block_left_by_an_error_after_the_whole_response_keeps_the_connection():
    async def whole(request):
        return web.Response(body=b"all of it")

    async with aiohttp_server([web.get("/", whole)]) as (pool, clients):
        for _ in range(3):
            with pytest.raises(LookupError):
                async with pool.request(b"GET", b"/") as resp:
                    assert await resp.read(100) == b"all of it"
                    raise LookupError("the caller's own error, after the response")
        assert pool.opened == 1 and len(clients) == 1


async def test_a_body_framed_by_the_connections_end_is_read_and_the_connection_not_kept():
    async def answer(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with raw_server(answer) as pool:
        for _ in range(2):
            async with pool.request(b"GET", b"/") as resp:
                assert await resp.read(1000) == b"until the end"
        assert pool.opened == 2


async def test_a_request_an_idle_connections_close_cut_off_goes_once_more_on_a_new_one():
    async def answer(reader, writer, index):
        await read_request(reader)
        if index == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await read_request(reader)  # the second request: closed without a byte, as an idle timeout does
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nagain")
        await writer.drain()

    async with raw_server(answer) as pool:
        async with pool.request(b"POST", b"/", b"1") as resp:
            assert await resp.read(10) == b"ok"
        async with pool.request(b"POST", b"/", b"2") as resp:
            assert await resp.read(10) == b"again"
        assert pool.opened == 2


async def test_a_new_connection_closed_before_the_response_fails_without_retrying():
    async def answer(reader, writer, index):
        await read_request(reader)

    async with raw_server(answer) as pool:
        with pytest.raises(ConnectionClosed):
            async with pool.request(b"POST", b"/", b"x"):
                pass
        assert pool.opened == 1


async def test_a_response_cut_off_mid_body_fails():
    async def answer(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with raw_server(answer) as pool:
        async with pool.request(b"GET", b"/") as resp:
            with pytest.raises(ConnectionClosed):
                await resp.read(1000)


@pytest.mark.parametrize(("head", "error"), [
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", ResponseTooLarge),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 200 + b"\r\n", ResponseTooLarge),
    (b"NOT HTTP AT ALL\r\n\r\n", HttpClientError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", HttpClientError),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", HttpClientError),
])
async def test_a_bad_or_oversized_head_is_an_error(head, error):
    async def answer(reader, writer, index):
        await read_request(reader)
        writer.write(head)
        await writer.drain()
        await reader.read()  # until the client gives up

    async with raw_server(answer) as pool:
        with pytest.raises(error):
            async with pool.request(b"GET", b"/") as resp:
                await resp.read(10)


async def test_an_endless_head_stops_at_the_limit():
    async def answer(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"a" * 65536)
                await writer.drain()

    async with raw_server(answer) as pool:
        with pytest.raises(ResponseTooLarge):
            async with pool.request(b"GET", b"/"):
                pass


async def test_interim_answers_are_skipped():
    async def answer(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                     b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone")
        await writer.drain()
        await reader.read()

    async with raw_server(answer) as pool:
        async with pool.request(b"POST", b"/", b"{}") as resp:
            assert resp.status == 201 and resp.header(b"link") is None and await resp.read(10) == b"done"


async def test_bytes_nobody_asked_for_close_an_idle_connection():
    async def answer(reader, writer, index):
        await read_request(reader)
        if index == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await reader.read()  # until the client closes this connection
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext")
        await writer.drain()

    async with raw_server(answer) as pool:
        async with pool.request(b"GET", b"/") as resp:
            await resp.read(10)
        async with pool.request(b"GET", b"/") as resp:
            assert await resp.read(10) == b"next"
        assert pool.opened == 2  # the connection that sent a second answer unasked was not reused


async def test_bodies_and_lines_over_their_limit_are_errors_and_large_ones_within_it_arrive():
    big = b"0123456789abcdef" * 262144  # 4 MiB without a line's end: past the read high-water mark

    async def large(request):
        return web.Response(body=big)

    async with aiohttp_server([web.get("/large", large)]) as (pool, _):
        async with pool.request(b"GET", b"/large") as resp:
            with pytest.raises(ResponseTooLarge):
                await resp.read(1 << 20)
        async with pool.request(b"GET", b"/large") as resp:
            with pytest.raises(ResponseTooLarge):
                await resp.readline(1000)
        async with pool.request(b"GET", b"/large") as resp:
            await asyncio.sleep(0.05)  # let it fill the buffer past the high-water mark
            assert await resp.read(len(big)) == big
        assert pool.opened == 3  # each left mid-body closed its connection; the last is kept


async def test_leaving_before_the_end_closes_the_connection_at_the_server():
    closed = asyncio.Event()

    async def endless(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: x\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            closed.set()
            raise

    async with aiohttp_server([web.post("/endless", endless)]) as (pool, _):
        async with pool.request(b"POST", b"/endless", b"{}") as resp:
            assert await resp.readline(100) == b"data: x\n"
        await closed.wait()


async def test_connecting_nowhere_is_an_os_error_and_a_closed_pool_refuses():
    pool = ConnectionPool("127.0.0.1", 9, connect_timeout_s=5.0)  # discard: nothing listens there
    with pytest.raises(OSError):
        async with pool.request(b"GET", b"/"):
            pass
    await pool.close()
    with pytest.raises(HttpClientError):
        async with pool.request(b"GET", b"/"):
            pass


class _Transport:
    def __init__(self) -> None:
        self.paused = self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    abort = close


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = bytearray(), 0
    for size in sizes:
        piece = body[at:at + size]
        if piece:
            out += b"%x\r\n" % len(piece) + piece + b"\r\n"
        at += size
    if at < len(body):
        out += b"%x\r\n" % (len(body) - at) + body[at:] + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=2000), sizes=st.lists(st.integers(1, 300), max_size=10),
       cuts=st.lists(st.integers(1, 4000), max_size=12), by_length=st.booleans())
def test_a_response_split_anywhere_gives_the_same_body(body, sizes, cuts, by_length):
    framing = (b"Content-Length: %d\r\n\r\n" % len(body) + body if by_length
               else b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes))
    wire = b"HTTP/1.1 200 OK\r\n" + framing

    async def run() -> bytes:
        pool = ConnectionPool("127.0.0.1", 1)
        connection = http1._Connection(pool)
        connection.connection_made(_Transport())
        response = connection.response = http1.Response(connection)
        at = 0
        for cut in sorted(set(cuts)):
            connection.data_received(wire[at:cut])
            at = max(at, cut)
        connection.data_received(wire[at:])
        assert response.head_done and response.complete and response.keep_alive
        return await response.read(len(body))

    assert asyncio.run(run()) == body


async def test_a_connection_idle_past_the_idle_timeout_is_not_reused():
    async def whole(request):
        return web.Response(body=b"ok")

    async with aiohttp_server([web.get("/", whole)]) as (pool, clients):
        pool.idle_timeout_s = 0.0  # every idle connection is too old: below any server's own timeout
        for _ in range(3):
            async with pool.request(b"GET", b"/") as resp:
                assert await resp.read(10) == b"ok"
        assert pool.opened == 3 and len(clients) == 3


async def test_an_https_worker_is_reached_over_verified_tls(tmp_path):
    import ssl

    from kvcompassd.certs import init_ca, issue

    ca = init_ca(tmp_path / "ca", cluster_name="test")
    files = issue(tmp_path / "ca", tmp_path / "worker", role="agent", node_id="worker-0", sans=("127.0.0.1",))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(files.cert, files.key)

    async def whole(request):
        return web.Response(body=b"over tls")

    app = web.Application()
    app.add_routes([web.get("/", whole)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(GUARD_S):
            async with WorkerConnections(tls_context=ssl.create_default_context(cafile=str(ca.cert))) as http:
                pool = http.pool("127.0.0.1", port, tls=True)
                for _ in range(2):
                    async with pool.request(b"GET", b"/") as resp:
                        assert await resp.read(100) == b"over tls"
                assert pool.opened == 1
            async with WorkerConnections() as http:  # the system's CAs do not vouch for this one
                with pytest.raises(ssl.SSLCertVerificationError):
                    async with http.pool("127.0.0.1", port, tls=True).request(b"GET", b"/"):
                        pass
    finally:
        await runner.cleanup()
