"""The edge's HTTP/1.1 server: httptools' C parser under an asyncio ``Protocol``, nothing between
the bytes and the front door's handler.

aiohttp's web server (its request objects, stream readers, middlewares, router and per-response
writers) was the largest share of the edge's CPU per request; uvicorn's httptools protocol is
leaner but refuses in plain text and cannot bound a request's head in bytes or in time (see the
README's front-door section for the measurement). This server does what the front door needs:

- one handler, ``async def handler(request) -> Response | ResponseStream``, run as a task per
  request; a client that disconnects cancels it (so a forwarding generator it awaits is closed and
  the worker aborts the request);
- keep-alive, HTTP/1.0 and 1.1, pipelined requests answered in order (reading pauses while one
  waits), ``HEAD`` answered without a body;
- request bodies as they arrive (``Request.body``), reading paused while more than
  ``BODY_HIGH_WATER`` bytes wait unread; ``Expect: 100-continue`` answered when the handler starts
  reading (curl sends it before a large prompt; a refusal before then spares the upload); a
  response sent before its request's body was read closes the connection after it;
- responses whole (``Content-Length``) or streamed (chunked; HTTP/1.0: until the connection ends),
  a streamed write waiting while the client does not read, for at most the keep-alive timeout
  (then the connection is aborted and the write raises ``ConnectionResetError``).

The connection's own limits (the ``[frontdoor]`` table, held by a ``FrontDoorGuard``): a cap on
open connections, a deadline and a byte cap on each request's head (from its first byte to its
last header; a client that connects and sends nothing is slow too), a cap on header fields, and
the idle keep-alive timeout. Every refusal made here is an OpenAI-style JSON error
(``openai_errors.raw_error_response``) counted by reason, with a log line (at most
``REFUSAL_LOGS_PER_S`` a second; the next line says how many were left out). A connection closed
after a refusal first reads and drops what the client still sends for ``LINGER_S``, so the
client reads the refusal instead of a reset. The body's limits are the handler's
(``httplimits.read_body``).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
import structlog

from kvcompassd import openai_errors  # which imports this module: its functions are looked up when called

log = structlog.get_logger(__name__)

BODY_HIGH_WATER = 256 * 1024  # unread body bytes past which a connection stops reading
LINGER_S = 1.0  # after a refusal that closes, what the client still sends is read and dropped
REFUSAL_LOGS_PER_S = 10  # a flood of hostile connections must not become a flood of log lines

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


class _HeadRefused(Exception):
    """Raised by a parser callback: the head breaks a limit."""

    def __init__(self, status: int, message: str, code: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.code, self.reason = status, code, reason


class Response:
    """A whole response: ``body`` bytes sent with a ``Content-Length``."""

    __slots__ = ("body", "close", "content_type", "headers", "status")

    def __init__(self, body: bytes = b"", *, status: int = 200, content_type: str = "application/json",
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        self.body = body
        self.status = status
        self.content_type = content_type
        self.headers = headers
        self.close = close  # close the connection after it (a refusal whose body may be unread)


class ResponseStream:
    """A response whose body the handler writes piece by piece (``Request.start_stream``)."""

    __slots__ = ("_chunked", "_connection", "ended")

    def __init__(self, connection: _Connection, chunked: bool) -> None:
        self._connection = connection
        self._chunked = chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        """Send ``data`` now; waits while the client is not reading. Raises ``ConnectionResetError``
        once the client has gone."""
        if not data:
            return
        connection = self._connection
        if connection.lost:
            raise ConnectionResetError("the client closed the connection")
        if self._chunked:
            connection.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            connection.transport.write(data)
        if connection.write_paused:
            await connection.drain()

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        connection = self._connection
        if self._chunked and not connection.lost:
            connection.transport.write(b"0\r\n\r\n")
            if connection.write_paused:
                await connection.drain()


class Request:
    """One request's head, and its body as it arrives."""

    __slots__ = ("_chunks", "_complete", "_connection", "_continue", "_failure", "_queued", "_waiter", "body_read",
                 "headers", "keep_alive", "method", "path", "query", "version")

    def __init__(self, connection: _Connection, method: str, target: bytes, version: str,
                 headers: dict[str, str], keep_alive: bool) -> None:
        self._connection = connection
        self.method = method
        if target[:1] != b"/" and b"://" in target[:10]:  # absolute form (what a proxy sends): its path
            target = b"/" + target.split(b"/", 3)[3] if target.count(b"/") >= 3 else b"/"
        path, _, query = target.partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.version = version
        self.headers = headers  # names in lower case; repeated fields joined with ", "
        self.keep_alive = keep_alive
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._complete = False
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self.body_read = False  # the handler took the body's last byte
        # The client waits for "100 Continue" before it sends the body.
        self._continue = version == "1.1" and headers.get("expect", "").lower() == "100-continue"

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        try:
            return int(value) if value is not None else None  # the parser checked it already
        except ValueError:
            return None

    @property
    def arrived(self) -> bool:
        """Whether the whole body is here already (reading it waits for nothing)."""
        return self._complete

    @property
    def remote(self) -> str | None:
        peer = self._connection.transport.get_extra_info("peername") if self._connection.transport else None
        return peer[0] if peer else None

    async def body(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive. Raises ``ConnectionResetError`` if the client goes."""
        if self._continue:
            self._continue = False
            if not self._complete and not self._connection.lost:
                self._connection.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self._chunks:
                piece = self._chunks.popleft()
                self._queued -= len(piece)
                if self._queued <= BODY_HIGH_WATER // 2:
                    self._connection.update_reading()
                yield piece
                continue
            if self._complete:
                self.body_read = True
                return
            if self._failure is not None:
                raise self._failure
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def start_stream(self, headers: dict[str, str], *, status: int = 200) -> ResponseStream:
        """Send the head of a streamed response; the handler then writes its body and returns the
        stream."""
        return self._connection.start_stream(self, status, headers)

    # -- the connection's side ------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._queued += len(data)
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._complete:
            self._failure = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


Handler = Callable[[Request], Awaitable[Response | ResponseStream]]


class _DateHeader:
    """``Date:`` as RFC 9110 wants it, formatted once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


_DATE = _DateHeader()


class _Connection(asyncio.Protocol):
    """One client connection: its parser, its requests in order, its timers."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.guard = server.guard
        self.limits = server.guard.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.counted = False
        self.lost = False
        self.closing = False  # no more requests: lingering or flushing before the close
        self.upgraded = False
        self.write_paused = False
        self.waiting_for_drain = False  # the next request waits until the client reads
        self._drain_waiter: asyncio.Future | None = None
        self.read_paused = False
        # The head being parsed.
        self.awaiting_head = True  # between a head's first byte (or the last message's end) and its last header
        self.head_read_bytes = 0  # bytes read while the head was incomplete
        self.heads = 0  # heads parsed on this connection
        self.head_field_bytes = 0  # url and fields the parser has handed over
        self._target = b""
        self._fields: dict[str, str] = {}
        self._field_count = 0
        self.receiving: Request | None = None  # whose body the parser is reading
        self.pending: collections.deque[Request] = collections.deque()  # heads waiting for the handler
        self.active: Request | None = None
        self.task: asyncio.Task | None = None
        self.started: ResponseStream | None = None  # the active request's streamed response
        self.served = 0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_is_head = False

    # -- asyncio --------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        guard = self.guard
        if guard.connections >= self.limits.max_connections:
            guard.refused("connection_limit")
            self.server.log_refusal(503, "connection_limit", f"{self.limits.max_connections} connections open")
            self.closing = True
            transport.write(openai_errors.raw_error_response(503, f"the edge has its limit of {self.limits.max_connections} "
                                               "connections open", code="too_many_connections", retry_after=1))
            transport.close()
            return
        guard.connections += 1
        self.counted = True
        self.server.connections.add(self)
        self._arm_head_deadline()  # a client that connects and sends nothing is slow too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if self.counted:
            self.counted = False
            self.guard.connections -= 1
        self.server.connections.discard(self)
        self._disarm()
        gone = ConnectionResetError("the client closed the connection")
        for request in (self.receiving, self.active, *self.pending):
            if request is not None:
                request._fail(gone)
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the handler's forwarding ends with it
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(gone)
            waiter.exception()  # retrieved here: a handler may already have gone

    def eof_received(self) -> bool:
        # The client sends no more: taken as gone (as aiohttp and uvicorn take it), so that a
        # streaming client that hangs up stops its generation at once. The transport closes.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        self.update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.waiting_for_drain and not self.lost and not self.closing:
            self._next()
        else:
            self.update_reading()

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            self._drain_waiter = self.loop.create_future()
            try:
                async with asyncio.timeout(self.limits.keepalive_timeout_s):
                    await self._drain_waiter
            except TimeoutError:
                # A client that stops reading a stream is closed as one that leaves answers unread
                # (_next): its handler, and the worker's generation, must not wait for it forever.
                self.guard.refused("write_stalled")
                self.server.log_refusal(None, "write_stalled", "the client read nothing of the response for "
                                        f"{self.limits.keepalive_timeout_s:g} s")
                self.transport.abort()
                raise ConnectionResetError("the client stopped reading the response") from None
            finally:
                self._drain_waiter = None

    def data_received(self, data: bytes) -> None:
        if self.closing or self.upgraded:
            return  # lingering after a refusal: dropped
        in_head = self.awaiting_head
        heads = self.heads
        if in_head and not self.timer_is_head and self.active is None:
            self._arm_head_deadline()  # the next head started on an idle keep-alive connection
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol switch here: the request is answered, then the connection closes.
            self.upgraded = True
            if self.receiving is not None:
                self.receiving.keep_alive = False
                self.receiving._finish()
                self.receiving = None
            return
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _HeadRefused):
                self._refuse(refusal.status, str(refusal), refusal.code, refusal.reason)
                return
            raise
        except _HeadRefused as refusal:
            self._refuse(refusal.status, str(refusal), refusal.code, refusal.reason)
            return
        except httptools.HttpParserError as exc:
            message = str(exc) or "malformed request"
            self._refuse(400, f"malformed HTTP request: {message[:200]}", "invalid_request", "malformed_request")
            return
        if in_head and self.heads == heads:
            # Every byte of this read belonged to a head that is still incomplete.
            self.head_read_bytes += len(data)
            if self.head_read_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes",
                             "headers_too_large", "header_too_large")

    # -- the parser's callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.awaiting_head = True
        self._target = b""
        self._fields = {}
        self._field_count = 0
        self.head_field_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_count += 1
        if self._field_count > self.limits.max_headers:
            raise _HeadRefused(400, f"too many headers (more than {self.limits.max_headers})", "invalid_request",
                               "malformed_request")
        self._count_head(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        fields = self._fields
        fields[key] = f"{fields[key]}, {text}" if key in fields else text

    def _count_head(self, n: int) -> None:
        self.head_field_bytes += n
        if self.head_field_bytes > self.limits.max_header_bytes:
            raise _HeadRefused(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes",
                               "headers_too_large", "header_too_large")

    def on_headers_complete(self) -> None:
        parser = self.parser
        request = Request(self, parser.get_method().decode("latin-1"), self._target, parser.get_http_version(),
                          self._fields, parser.should_keep_alive())
        self.awaiting_head = False
        self.heads += 1
        self.head_read_bytes = 0
        self._target = b""
        self._fields = {}
        self.receiving = request
        if self.timer_is_head:
            self._disarm()
        if self.active is None:
            self._start(request)
        else:
            self.pending.append(request)  # pipelined: answered in order
            self.update_reading()

    def on_body(self, body: bytes) -> None:
        request = self.receiving
        request._feed(body)
        if request._queued > BODY_HIGH_WATER:
            self.update_reading()

    def on_message_complete(self) -> None:
        request = self.receiving
        if request is not None:
            request._finish()
            self.receiving = None
        self.awaiting_head = True
        self.head_read_bytes = 0

    # -- requests -------------------------------------------------------------------------------

    def update_reading(self) -> None:
        """Read while nothing waits: no pipelined head, no more than the high water of body, and
        the client reading our answers."""
        if self.lost or self.closing:
            return
        request = self.receiving
        pause = (bool(self.pending) or self.write_paused
                 or (request is not None and request._queued > BODY_HIGH_WATER))
        if pause != self.read_paused:
            self.read_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _start(self, request: Request) -> None:
        self.active = request
        self.started = None
        self.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            response = await self.server.handler(request)
        except asyncio.CancelledError:
            return  # the client went away, or a refusal answered instead
        except Exception as exc:
            if self.lost:
                return
            if self.started is not None:
                log.warning("streamed response failed", error=str(exc)[:200])
                self.transport.abort()
                return
            log.exception("request failed outside its handler", path=request.path[:200])
            response = Response(openai_errors.error_json(500, "internal error at the edge", code="internal_error"),
                                status=500, close=True)
        if self.lost or self.active is not request:
            return
        try:
            if isinstance(response, ResponseStream):
                try:
                    await response.end()
                except ConnectionError:
                    return
                keep = response._chunked and request.keep_alive and request._complete and not self.upgraded
            else:
                keep = self._send(request, response)
        except Exception:  # a response that cannot be written (a header not in latin-1): a bug, not the client's
            log.exception("response could not be written", path=request.path[:200])
            self.transport.abort()
            return
        self._done(request, keep)

    def _send(self, request: Request, response: Response) -> bool:
        body = response.body
        # A body not read to its end leaves the next head nowhere to be found: close after it.
        keep = (request.keep_alive and request._complete and not response.close and not self.closing
                and not self.upgraded)
        reason = _REASONS.get(response.status, b"Unknown")
        head = [b"HTTP/1.1 %d %b\r\nContent-Type: %b\r\nContent-Length: %d\r\n"
                % (response.status, reason, response.content_type.encode("latin-1"), len(body)), _DATE.line()]
        if response.headers:
            head.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in response.headers.items())
        if not keep:
            head.append(b"Connection: close\r\n")
        elif request.version == "1.0":
            head.append(b"Connection: keep-alive\r\n")
        head.append(b"\r\n")
        if request.method != "HEAD":
            head.append(body)
        self.transport.write(b"".join(head))
        return keep

    def start_stream(self, request: Request, status: int, headers: dict[str, str]) -> ResponseStream:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        chunked = request.version != "1.0"
        head = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown")), _DATE.line()]
        head.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
        head.append(b"Transfer-Encoding: chunked\r\n" if chunked else b"Connection: close\r\n")
        if chunked and (not request.keep_alive or not request._complete or self.closing or self.upgraded):
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head))
        self.started = ResponseStream(self, chunked)
        return self.started

    def _done(self, request: Request, keep: bool) -> None:
        """The active request is answered: the next one, an idle wait, or the close."""
        self.active = None
        self.task = None
        self.started = None
        self.served += 1
        if keep and not request._complete:
            keep = False  # its body was not read to the end: the next head cannot be found
        if not keep or self.upgraded:
            self._close_after_response(linger=not request._complete)
            return
        self._next()

    def _next(self) -> None:
        """Ready for the next request: a pipelined one, else the next head or an idle wait. Not
        while the client leaves our answers unread (a client pipelining requests it never reads
        the answers to would otherwise grow the write buffer without end)."""
        if self.write_paused:
            self.waiting_for_drain = True
            self.update_reading()
            self._arm_idle()  # a client that never reads is closed like an idle one
            return
        self.waiting_for_drain = False
        if self.pending:
            self._start(self.pending.popleft())
            self.update_reading()
            return
        self.update_reading()
        if self.awaiting_head and self.head_read_bytes:
            self._arm_head_deadline()
        else:
            self._arm_idle()

    # -- closing --------------------------------------------------------------------------------

    def _refuse(self, status: int, message: str, code: str, reason: str) -> None:
        """A refusal below the handler (a head over a limit or malformed): JSON, counted, closed."""
        self.guard.refused(reason)
        self.server.log_refusal(status, reason, message)
        receiving = self.receiving
        if receiving is not None:
            receiving._fail(ConnectionResetError(message))
        active = self.active
        if active is not None and active is receiving and self.started is None:
            # The body its handler is reading is malformed: the refusal is the answer.
            self.task.cancel()
            self.active = self.task = None
        if self.active is None:
            self.transport.write(openai_errors.raw_error_response(status, message, code=code))
            self._close_after_response(linger=True)
        else:
            self.transport.abort()  # a response in progress: nowhere to answer it

    def _close_after_response(self, *, linger: bool) -> None:
        self._disarm()
        self.closing = True
        for request in self.pending:
            request._fail(ConnectionResetError("the connection is closing"))
        self.pending.clear()
        if not linger:
            self._close_transport()
            return
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.timer = self.loop.call_later(LINGER_S, self._linger_over)
        self.timer_is_head = False

    def _linger_over(self) -> None:
        self.timer = None
        self._close_transport()

    def _close_transport(self) -> None:
        """Close once what was written is flushed; abort if the client does not read it within
        the keep-alive timeout."""
        self._disarm()
        self.timer = self.loop.call_later(self.limits.keepalive_timeout_s, self.transport.abort)
        self.transport.close()

    def close(self) -> None:
        """The server stops: end the request in progress and the connection."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if not self.lost:
            self.closing = True
            self.transport.close()

    # -- timers ---------------------------------------------------------------------------------

    def _arm_head_deadline(self) -> None:
        self._disarm()
        # Drawn from the last quarter below the limit: a crowd of slow clients that connected
        # together is then not refused (and reconnected) in one burst that stalls the loop.
        timeout = self.limits.header_timeout_s * (0.75 + 0.25 * random.random())
        self.timer = self.loop.call_later(timeout, self._head_timed_out)
        self.timer_is_head = True

    def _arm_idle(self) -> None:
        self._disarm()
        self.timer = self.loop.call_later(self.limits.keepalive_timeout_s, self._idle_timed_out)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.timer_is_head = False

    def _head_timed_out(self) -> None:
        self.timer = None
        self.timer_is_head = False
        if self.active is not None or not self.awaiting_head or self.closing:
            return  # a response in progress: the next head's deadline starts after it
        self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s",
                     "header_timeout", "header_timeout")

    def _idle_timed_out(self) -> None:
        """Idle, or left with answers it does not read, for the keep-alive timeout."""
        self.timer = None
        if self.active is None and not self.closing:
            self.closing = True
            self._close_transport()


class HttpServer:
    """Serves ``handler`` on a listening socket under ``guard``'s limits (duck-typed: ``limits``,
    ``connections``, ``refused(reason)``; a ``FrontDoorGuard``)."""

    def __init__(self, handler: Handler, guard: Any) -> None:
        self.handler = handler
        self.guard = guard
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._log_second = 0
        self._logged = 0
        self._unlogged = 0

    def log_refusal(self, status: int | None, reason: str, message: str) -> None:
        """``status`` is the refusal's HTTP status, or None when none could be sent."""
        second = int(time.monotonic())
        if second != self._log_second:
            self._log_second, self._logged = second, 0
        if self._logged >= REFUSAL_LOGS_PER_S:
            self._unlogged += 1
            return
        self._logged += 1
        unlogged, self._unlogged = self._unlogged, 0
        log.info("request refused", status=status, reason=reason, error=message[:200],
                 **({"refusals_not_logged": unlogged} if unlogged else {}))

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> tuple[str, int]:
        """Listen on ``host:port``; returns the address bound (port 0: the one the kernel chose)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port,
                                                     reuse_port=reuse_port or None, backlog=1024)
        return self._server.sockets[0].getsockname()[:2]

    async def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        """Stop listening and end every connection, its request in progress with it."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for connection in list(self.connections):
            connection.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
