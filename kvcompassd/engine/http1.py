"""A lean HTTP/1.1 client toward workers: keep-alive connection pools, httptools' C parser.

The edge forwards every request to a worker over plain HTTP; aiohttp's client (its request and
response objects, stream reader, timers and trace hooks) was about a quarter of the edge's CPU per
request. This client does what forwarding needs and no more: one request at a time per
connection (no pipelining), a pool of idle connections per worker, request bodies sent whole
with a ``Content-Length``, responses framed by ``Content-Length``, chunked encoding or the
connection's end, read as they arrive (SSE lines for streamed generation).

Bounded: a response head over ``max_head_bytes`` or ``max_headers`` fields, a line over its
caller's limit and a body over its caller's limit are errors, and a connection stops reading
while more than ``READ_HIGH_WATER`` bytes wait unconsumed and nobody asks for more (the worker
is paced by TCP instead of the edge buffering). Connecting has a deadline; the rest is the
caller's (the forwarding deadlines). Every failure is an :class:`HttpClientError` (or
``OSError`` from connecting, TLS included), which the engine client maps to its own errors.

A kept-alive connection may have been closed by its server just as a request goes out on it (the
server's idle timeout): when a reused connection ends before a single byte of the response, the
request is sent once more on a new connection, as the worker never answered it (closing the
connection aborts it in SGLang and the emulated worker alike). Idle connections older than
``idle_timeout_s`` (below uvicorn's 5 s default, which SGLang serves with) are not reused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import AsyncIterator

import httptools

READ_HIGH_WATER = 256 * 1024  # unconsumed response bytes past which a connection stops reading


class HttpClientError(Exception):
    """The exchange failed: the connection broke, or the server's answer was not HTTP/1.1 the
    client accepts (malformed, over a limit)."""


class ConnectionClosed(HttpClientError):
    """The connection ended before the response did."""

    def __init__(self, message: str, *, before_response: bool = False):
        super().__init__(message)
        self.before_response = before_response  # not one byte of a response had arrived


class ResponseTooLarge(HttpClientError):
    """A response head, line or body over its limit."""


class _Connection(asyncio.Protocol):
    """One TCP connection and its response parser; at most one exchange at a time."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.response: Response | None = None  # the exchange in progress

    # -- asyncio ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None:
            response._connection_lost(exc)

    def eof_received(self) -> bool:
        # Nothing more comes from the server: a response framed by the connection's end ends here.
        self.closed = True
        response = self.response
        if response is not None:
            response._connection_lost(None)
        return False  # close the transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: this connection cannot be trusted
            self.close()
            return
        response.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response._fail(HttpClientError("the server switched protocols"))
            self.abort()
            return
        except HttpClientError as exc:  # raised by a callback below (a limit, a second answer)
            response._fail(exc)
            self.abort()
            return
        except httptools.HttpParserError as exc:
            failure = exc.__context__ if isinstance(exc.__context__, HttpClientError) else None
            response._fail(failure or HttpClientError(f"malformed HTTP response: {exc}"))
            self.abort()
            return
        if not response.head_done:
            # The parser holds a head's pieces until each field ends: bounded by counting what it
            # was fed (one read past the limit at most).
            response.head_bytes += len(data)
            if response.head_bytes > self.pool.max_head_bytes:
                response._fail(ResponseTooLarge(f"response head over {self.pool.max_head_bytes} bytes"))
                self.abort()

    def pause_writing(self) -> None:  # bodies are sent whole; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        response = self.response
        if response.complete:  # a second answer to one request: the exchange is out of step
            raise HttpClientError("the server sent more than one response to a request")
        response.headers.clear()
        response.fields_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if len(response.headers) >= self.pool.max_headers:
            raise ResponseTooLarge(f"response has more than {self.pool.max_headers} header fields")
        response.fields_bytes += len(name) + len(value) + 4
        if response.fields_bytes > self.pool.max_head_bytes:
            raise ResponseTooLarge(f"response head over {self.pool.max_head_bytes} bytes")
        response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): skip it
            response.informational = True
            return
        response._head(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response._body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response.informational:
            response.informational = False
            return
        response._complete()

    # -- the pool's side ----------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """A response being read. ``status`` and ``headers`` (lower-case names, bytes) once the head
    arrived; the body through :meth:`read`, :meth:`readline` or :meth:`readany`."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.head_done = False
        self.head_bytes = 0  # fed to the parser before the head was complete
        self.fields_bytes = 0  # of the head's fields
        self.received = 0
        self.informational = False
        self.complete = False  # the whole body arrived
        self._framed = True  # the body has a length or is chunked (else it ends with the connection)
        self._buffer = bytearray()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # -- fed by the connection ----------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _head(self, status: int, keep_alive: bool) -> None:
        self.status, self.keep_alive, self.head_done = status, keep_alive, True
        self._framed = (self.header(b"content-length") is not None
                        or b"chunked" in (self.header(b"transfer-encoding") or b"").lower()
                        or status in (204, 304))
        self._wake()

    def _body(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > READ_HIGH_WATER and not self._paused and self._connection.transport is not None:
            self._paused = True
            self._connection.transport.pause_reading()
        self._wake()

    def _complete(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.complete:  # this response is whole; what came after it costs the connection only
            self.keep_alive = False
            return
        if self._error is None:
            self._error = exc
        self._wake()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self.complete:
            return
        if self.head_done and not self._framed:
            self.keep_alive = False
            self.complete = True  # a body framed by the connection's end ends here
        else:
            self._fail(ConnectionClosed(f"connection closed before the response ended{f': {exc}' if exc else ''}",
                                        before_response=self.received == 0))
        self._wake()

    # -- read by the caller -------------------------------------------------------------------

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        if self._paused:  # the caller needs more than is buffered (a line's end, the body's): read on
            self._paused = False
            if not self._connection.closed and self._connection.transport is not None:
                self._connection.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def wait_head(self) -> None:
        while not self.head_done:
            await self._wait()

    async def readany(self) -> bytes:
        """The body bytes that arrived (waiting for some); ``b""`` at its end."""
        while not self._buffer and not self.complete:
            await self._wait()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def readline(self, max_bytes: int) -> bytes:
        """The next line with its ``\\n`` (the last one may lack it); ``b""`` at the body's end."""
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                return line
            if len(self._buffer) > max_bytes:
                raise ResponseTooLarge(f"a line of the response is over {max_bytes} bytes")
            if self.complete:
                line = bytes(self._buffer)
                self._buffer.clear()
                return line
            start = len(self._buffer)
            await self._wait()

    async def read(self, max_bytes: int) -> bytes:
        """The whole body; :class:`ResponseTooLarge` past ``max_bytes``."""
        while not self.complete:
            if len(self._buffer) > max_bytes:
                raise ResponseTooLarge(f"response body over {max_bytes} bytes")
            await self._wait()
        if len(self._buffer) > max_bytes:
            raise ResponseTooLarge(f"response body over {max_bytes} bytes")
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def lines(self, max_bytes: int) -> AsyncIterator[bytes]:
        while line := await self.readline(max_bytes):
            yield line

    async def drain(self, max_bytes: int, timeout_s: float) -> None:
        """Read the rest of the body, within ``max_bytes`` and ``timeout_s``, so that the
        connection can be kept; a server that sends more, or stalls, costs the connection only."""
        read = len(self._buffer)
        self._buffer.clear()
        if self.complete:  # the usual case: no timer for it
            return
        with contextlib.suppress(TimeoutError, HttpClientError):
            async with asyncio.timeout(timeout_s):
                while not self.complete and read <= max_bytes:
                    read += len(await self.readany())


class ConnectionPool:
    """Keep-alive connections to one ``host:port``."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None = None, connect_timeout_s: float = 5.0,
                 idle_timeout_s: float = 4.0, max_idle: int = 256, max_head_bytes: int = 64 * 1024,
                 max_headers: int = 100) -> None:
        self.host, self.port = host, port
        self.tls = tls  # None: plain TCP
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self._host_header = (f"Host: {host}:{port}\r\n" if ":" not in host else f"Host: [{host}]:{port}\r\n").encode()
        self._idle: collections.deque[_Connection] = collections.deque()
        self._closed = False
        self.opened = 0  # connections opened over the pool's life

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, connection = await loop.create_connection(lambda: _Connection(self), self.host, self.port,
                                                         ssl=self.tls)
        self.opened += 1
        return connection

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used: the least likely to be timed out
            if not connection.closed and now - connection.idle_since < self.idle_timeout_s:
                connection.reused = True
                return connection
            connection.close()
        return None

    def _give_back(self, connection: _Connection) -> None:
        connection.response = None
        if self._closed or connection.closed or len(self._idle) >= self.max_idle:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.append(connection)

    def _head(self, method: bytes, path: bytes, body: bytes, headers: bytes) -> bytes:
        return b"".join((method, b" ", path, b" HTTP/1.1\r\n", self._host_header, headers,
                         b"Content-Length: %d\r\n\r\n" % len(body), body))

    def request(self, method: bytes, path: bytes, body: bytes = b"", headers: bytes = b"") -> _Exchange:
        """Send a request (``headers``: extra raw header lines, each ending ``\r\n``); ``async
        with`` gives the :class:`Response` once its head arrived. Leaving the block once the whole
        body has arrived keeps the connection for the next request; leaving it before (an error,
        the caller closing a stream) closes it, which aborts the request in the server."""
        return _Exchange(self, method, path, body, headers)

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class _Exchange:
    """One request on a pool, as an ``async with`` block (``ConnectionPool.request``): a class
    rather than a generator-based context manager, whose machinery cost a few µs per request."""

    __slots__ = ("_pool", "_request", "_connection", "_response")

    def __init__(self, pool: ConnectionPool, method: bytes, path: bytes, body: bytes, headers: bytes) -> None:
        self._pool = pool
        self._request = (method, path, body, headers)
        self._connection: _Connection | None = None
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        pool = self._pool
        if pool._closed:
            raise HttpClientError("the connection pool is closed")
        message = pool._head(*self._request)
        connection = pool._take_idle()
        while True:
            if connection is None:
                connection = await pool._connect()
            response = connection.response = Response(connection)
            connection.transport.write(message)
            try:
                await response.wait_head()
            except ConnectionClosed as exc:
                if connection.reused and exc.before_response:
                    # The server closed this idle connection as the request went out: it never
                    # saw it. Once more on a new connection.
                    connection.abort()
                    connection = None
                    continue
                connection.abort()
                raise
            except BaseException:
                connection.abort()
                raise
            break
        self._connection, self._response = connection, response
        return response

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # However the block was left (the caller's generator closed after its last item, say), a
        # complete response leaves the connection at a message boundary, whatever of its body the
        # caller left unread: it is kept.
        connection, response = self._connection, self._response
        if response.complete and response.keep_alive and response._error is None:
            self._pool._give_back(connection)
        else:
            connection.response = None
            connection.abort()


class WorkerConnections:
    """One :class:`ConnectionPool` per worker address, made on first use; closed together.
    ``tls_context``: what ``https://`` workers are verified with (default: the system's CAs)."""

    def __init__(self, *, tls_context: ssl.SSLContext | None = None, **pool_options) -> None:
        self._options = pool_options
        self._tls_context = tls_context
        self._pools: dict[tuple[str, int, bool], ConnectionPool] = {}

    def pool(self, host: str, port: int, *, tls: bool = False) -> ConnectionPool:
        key = (host, port, tls)
        pool = self._pools.get(key)
        if pool is None:
            context = None
            if tls:
                context = self._tls_context = self._tls_context or ssl.create_default_context()
            pool = self._pools[key] = ConnectionPool(host, port, tls=context, **self._options)
        return pool

    @property
    def opened(self) -> int:
        return sum(pool.opened for pool in self._pools.values())

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
        self._pools.clear()

    async def __aenter__(self) -> WorkerConnections:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
