"""What one HTTP client may cost the edge: the front door's limits (``[frontdoor]`` in the config,
:class:`~kvcompassd.core.config.FrontDoorLimits`) and the code that enforces what aiohttp does not.

aiohttp's own knobs bound a header line, the header count, idle keep-alive and lingering. Added
here: a connection cap; a deadline and a byte cap on a request's head (slowloris, endless
headers), enforced by a ``RequestHandler`` subclass before any handler runs; and, for bodies,
:func:`read_json`: a body deadline, a per-request limit that also applies after inflating a
``gzip``/``deflate`` body incrementally (a compression bomb costs at most the limit), a global
:class:`BodyBudget` for the bodies all requests hold at once, and JSON parsed with a depth limit
and no non-finite numbers. Every refusal is an OpenAI-style JSON error and is counted by reason.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import math
import random
import re
import time
import zlib
from http import HTTPStatus
from typing import Any

import numpy as np
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvcompassd.core.config import ConfigError, FrontDoorLimits
from kvcompassd.openai_errors import error_body, raw_error_response

log = structlog.get_logger(__name__)

# Labels of the refusal counter: a fixed set, whatever the clients send.
REFUSAL_REASONS = ("connection_limit", "header_timeout", "header_too_large", "malformed_request", "body_timeout",
                   "body_too_large", "body_budget", "content_encoding", "bad_json", "json_too_deep",
                   "non_finite_number")

# The first bytes of every request may use the budget's last eighth (see BodyBudget).
SMALL_BODY_BYTES = 64 << 10


def with_overrides(limits: FrontDoorLimits, pairs: list[str]) -> FrontDoorLimits:
    """``limits`` with ``NAME=VALUE`` overrides (the edge's ``--frontdoor-limit``), validated
    like the config file's ``[frontdoor]`` table."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or name not in FrontDoorLimits.__dataclass_fields__:
            raise ConfigError(f"expected NAME=VALUE with NAME one of {', '.join(FrontDoorLimits.__dataclass_fields__)}",
                              table="--frontdoor-limit", field=name)
        kind = int if isinstance(getattr(limits, name), int) else float
        try:
            changes[name] = kind(text.strip())
        except ValueError:
            raise ConfigError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}",
                              table="--frontdoor-limit", field=name) from None
    try:
        return dataclasses.replace(limits, **changes)
    except ConfigError as exc:
        raise exc.located(table="--frontdoor-limit") from None


class Refused(Exception):
    """A request the front door will not take; rendered as an OpenAI-style error."""

    def __init__(self, status: int, message: str, *, code: str, reason: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.reason, self.headers, self.close = status, code, reason, headers or {}, close


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


class BodyBudget:
    """Bytes of request bodies held at once, by all requests. The last eighth is kept for each
    request's first ``SMALL_BODY_BYTES``, so large uploads stalled at the budget cannot starve the
    ordinary small requests.

    glibc keeps freed body buffers in its heap, which the small reads around them fragment, so
    an edge that had a budget's worth of bodies would keep that RSS for good (the measurement:
    ``docs/design-history.md``); after every ``TRIM_AFTER_BYTES`` released, at
    most once a second or when no body is left, the free heap is handed back with ``malloc_trim``."""

    TRIM_AFTER_BYTES = 8 << 20

    def __init__(self, total: int) -> None:
        self.total = total
        self.large_limit = total - total // 8
        self.held = 0
        self._released = 0
        self._trimmed_at = 0.0
        self._trim = _malloc_trim()

    def reserve(self, n: int, already: int) -> bool:
        limit = self.total if already + n <= SMALL_BODY_BYTES else self.large_limit
        if self.held + n > limit:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        self.held -= n
        self._released += n
        if self._released >= self.TRIM_AFTER_BYTES and self._trim is not None:
            now = time.monotonic()
            if self.held == 0 or now - self._trimmed_at >= 1.0:  # at once when the last body goes
                self._released, self._trimmed_at = 0, now
                self._trim(0)


class FrontDoorGuard:
    """The limits, the body budget, the connection count and the refusal counts of one front door."""

    def __init__(self, limits: FrontDoorLimits | None = None, metrics: Any = None) -> None:
        self.limits = limits or FrontDoorLimits()
        self.budget = BodyBudget(self.limits.body_budget_bytes)
        self.connections = 0
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._counter = getattr(metrics, "refusals", None)
        if metrics is not None and hasattr(metrics, "watch_front_door"):
            metrics.watch_front_door(lambda: self.budget.held, lambda: self.connections)

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1
        if self._counter is not None:
            self._counter.labels(reason).inc()

    def runner(self, app: web.Application) -> web.AppRunner:
        """An ``AppRunner`` whose connections are guarded, with aiohttp's own limits set."""
        lim = self.limits
        line = min(8190, lim.max_header_bytes)
        return _GuardedAppRunner(app, self, access_log=None, keepalive_timeout=lim.keepalive_timeout_s,
                                 max_line_size=line, max_field_size=line, max_headers=lim.max_headers,
                                 lingering_time=1.0, auto_decompress=False,
                                 handler_cancellation=True)


class _GuardedAppRunner(web.AppRunner):
    def __init__(self, app: web.Application, guard: FrontDoorGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp makes its Server in private code; only the protocol it builds differs here.
        server.__class__ = _GuardedServer
        server.guard = self._guard
        return server


class _GuardedServer(web.Server):
    guard: FrontDoorGuard

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol plus a connection cap and a deadline and byte cap on each
    request's head (from its first byte to its last header).

    It reads aiohttp's protocol state (``_messages``, ``_request_in_progress``, ``_request_count``,
    ``_force_close``/``_close``) and wraps ``_handle_request`` and ``handle_error``: written
    against aiohttp 3.14; tests/test_httplimits.py fails if a release changes them."""

    __slots__ = ("_counted", "_guard", "_head_bytes", "_head_deadline", "_reading_head")

    def __init__(self, manager: web.Server, *, guard: FrontDoorGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._counted = False
        self._reading_head = True
        self._head_bytes = 0
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        guard = self._guard
        if guard.connections >= guard.limits.max_connections:
            self._refuse(503, f"the edge has its limit of {guard.limits.max_connections} connections open",
                         "too_many_connections", "connection_limit", retry_after=1)
            return
        guard.connections += 1
        self._counted = True
        self._arm_head_deadline()  # a client that connects and sends nothing is slow too

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._guard.connections -= 1
            self._counted = False
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close:
            return
        if self._reading_head and self._head_deadline is None:
            self._arm_head_deadline()
        super().data_received(data)
        if self._messages or self._request_in_progress:
            # A whole head arrived (any body bytes in this read belong to it, not to a head).
            self._reading_head = False
            self._head_bytes = 0
            self._disarm_head_deadline()
        elif self._reading_head:
            self._head_bytes += len(data)
            limit = self._guard.limits.max_header_bytes
            if self._head_bytes > limit:
                self._refuse(431, f"request line and headers exceed {limit} bytes", "headers_too_large",
                             "header_too_large")

    async def _handle_request(self, request, start_time, request_handler):
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            # The next bytes start a new head, unless they are this request's unread body
            # (aiohttp drains that for ``lingering_time``, then closes) or one is queued.
            if not self._messages and request.content.is_eof():
                self._reading_head = True
                self._head_bytes = 0

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own refusals (a malformed request line, too many headers, ...) and failures
        outside any handler, as OpenAI-style JSON instead of its plain text; logged briefly."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        if isinstance(exc, ConnectionError):  # the client went away mid-request: not the edge's fault
            log.debug("client disconnected mid-request", error=str(exc))
            text = "connection lost"
        elif status < 500:
            self._guard.refused("malformed_request")
            log.info("malformed request refused", status=status, error=str(exc or message)[:200])
            text = getattr(exc, "message", None) or message or HTTPStatus(status).phrase
        else:
            log.error("request failed outside its handler", status=status, exc_info=exc)
            text = "internal error at the edge"
        response = web.json_response(error_body(status, str(text)), status=status)
        response.force_close()
        return response

    def _arm_head_deadline(self) -> None:
        # Drawn from the last quarter below the limit: a crowd of slow clients that connected
        # together is then not refused (and reconnected) in one burst that stalls the loop.
        timeout = self._guard.limits.header_timeout_s * (0.75 + 0.25 * random.random())
        self._head_deadline = self._loop.call_later(timeout, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self._reading_head or self._messages or self._request_in_progress:
            return
        if self._head_bytes == 0 and self._request_count > 0:
            return  # an idle keep-alive connection: keepalive_timeout closes it
        timeout = self._guard.limits.header_timeout_s
        self._refuse(408, f"request headers not received within {timeout:g} s", "header_timeout", "header_timeout")

    def _refuse(self, status: int, message: str, code: str, reason: str, retry_after: int | None = None) -> None:
        self._guard.refused(reason)
        self._disarm_head_deadline()
        if self.transport is not None:
            self.transport.write(raw_error_response(status, message, code=code, retry_after=retry_after))
        self.force_close()  # the transport flushes the refusal, then closes


# -- bodies ---------------------------------------------------------------------------------------

_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _inflater(request: web.Request) -> Any:
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity") or not isinstance(request.protocol, GuardedRequestHandler):
        return None  # outside guard.runner (an in-process test server) aiohttp inflates it itself
    if encoding not in _ENCODINGS:
        raise Refused(415, f"Content-Encoding {encoding[:40]!r} is not supported (gzip, deflate or none)",
                      code="unsupported_content_encoding", reason="content_encoding", close=True)
    return zlib.decompressobj(_ENCODINGS[encoding])


async def read_body(request: web.Request, guard: FrontDoorGuard) -> tuple[bytearray, int]:
    """The request body, inflated, within the body deadline, the per-request limit and the budget.
    Returns the bytes and how many the caller must ``guard.budget.release`` when done with them
    (on a refusal they are released here)."""
    limits, budget = guard.limits, guard.budget
    limit = limits.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        guard.refused("body_too_large")
        raise Refused(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                      code="request_too_large", close=True)
    inflater = _inflater(request)
    body = bytearray()

    def take(piece: bytes) -> None:
        if len(body) + len(piece) > limit:
            guard.refused("body_too_large")
            raise Refused(413, f"request body exceeds the limit of {limit} bytes"
                          + (" once inflated" if inflater is not None else ""), code="request_too_large", close=True)
        if not budget.reserve(len(piece), len(body)):
            guard.refused("body_budget")
            raise Refused(503, "the edge is holding as many request bodies as it may; retry shortly",
                          code="server_busy", headers={"Retry-After": "1"}, close=True)
        body.extend(piece)

    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.content.iter_any():
                if inflater is None:
                    take(chunk)
                    continue
                data = chunk
                while data:
                    # Never inflate more than the limit allows: a bomb stops at limit + 1 bytes.
                    take(inflater.decompress(data, limit - len(body) + 1))
                    data = inflater.unconsumed_tail
            if inflater is not None:
                take(inflater.flush())
    except TimeoutError:
        _drop(body, budget)
        guard.refused("body_timeout")
        raise Refused(408, f"request body not received within {limits.body_timeout_s:g} s",
                      code="body_timeout", close=True) from None
    except zlib.error as exc:
        _drop(body, budget)
        guard.refused("content_encoding")
        raise Refused(400, f"request body could not be inflated: {exc}", code="bad_content_encoding",
                      close=True) from None
    except BaseException:
        _drop(body, budget)
        raise
    return body, len(body)


def _drop(body: bytearray, budget: BodyBudget) -> None:
    """Give back a body's bytes now: a refusal's traceback keeps its frames (and so ``body``)
    alive until the cycle collector runs, which may be long after the budget has moved on."""
    budget.release(len(body))
    body.clear()


_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_CHUNK = 1 << 20


def json_depth(data: bytes | bytearray) -> int:
    """Deepest nesting of arrays and objects in a JSON text, strings skipped, without building
    anything: a regex and ``translate`` in C, then a running sum over the brackets in numpy."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        part = brackets[start:start + _DEPTH_CHUNK]
        running = np.cumsum(np.where((part == 0x5B) | (part == 0x7B), 1, -1)) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"{text[:32]} overflows a double")
    return value


def parse_json(data: bytes | bytearray, guard: FrontDoorGuard) -> Any:
    """JSON with at most ``max_json_depth`` levels and only finite numbers."""
    max_depth = guard.limits.max_json_depth
    # No deeper than its count of opening brackets (strings' included): a request's few objects
    # never pay for the exact walk.
    if data.count(b"[") + data.count(b"{") > max_depth and json_depth(data) > max_depth:
        guard.refused("json_too_deep")
        raise Refused(400, f"request body is nested deeper than {max_depth} levels", code="json_too_deep")
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:  # cannot happen past the depth check; kept a 400, never a 500
        guard.refused("json_too_deep")
        raise Refused(400, "request body is nested too deeply", code="json_too_deep") from None
    except _NonFinite as exc:
        guard.refused("non_finite_number")
        raise Refused(400, f"request body holds a non-finite number: {exc}", code="invalid_number") from None
    except ValueError:  # includes UnicodeDecodeError
        guard.refused("bad_json")
        raise Refused(400, "request body is not valid JSON", code="invalid_json") from None


async def read_json(request: web.Request, guard: FrontDoorGuard) -> Any:
    body, held = await read_body(request, guard)
    try:
        return parse_json(body, guard)
    finally:
        guard.budget.release(held)
        body.clear()  # see _drop
