"""What one HTTP client may cost the edge: the front door's limits (``[frontdoor]`` in the config,
:class:`~kvcompassd.core.config.FrontDoorLimits`), held by a :class:`FrontDoorGuard`.

The connection's limits (a connection cap, a deadline and a byte cap on a request's head, the
header count, idle keep-alive) are enforced by ``http_server`` before any handler runs, from the
guard's limits. The body's are here, in :func:`read_json`: a body deadline, a per-request limit
that also applies after inflating a ``gzip``/``deflate`` body incrementally (a compression bomb
costs at most the limit), a global :class:`BodyBudget` for the bodies all requests hold at once,
and JSON parsed with a depth limit and no non-finite numbers. Every refusal is an OpenAI-style
JSON error and is counted by reason.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import math
import re
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from kvcompassd.core.config import ConfigError, FrontDoorLimits

if TYPE_CHECKING:
    from kvcompassd.http_server import Request


# Labels of the refusal counter: a fixed set, whatever the clients send.
REFUSAL_REASONS = ("connection_limit", "header_timeout", "header_too_large", "malformed_request", "body_timeout",
                   "body_too_large", "body_budget", "content_encoding", "bad_json", "json_too_deep",
                   "non_finite_number", "write_stalled")

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


# -- bodies ---------------------------------------------------------------------------------------

_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _inflater(request: Request) -> Any:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding not in _ENCODINGS:
        raise Refused(415, f"Content-Encoding {encoding[:40]!r} is not supported (gzip, deflate or none)",
                      code="unsupported_content_encoding", reason="content_encoding", close=True)
    return zlib.decompressobj(_ENCODINGS[encoding])


async def read_body(request: Request, guard: FrontDoorGuard) -> tuple[bytearray, int]:
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

    async def pull() -> None:
        async for chunk in request.body():
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

    try:
        if request.arrived:  # came with its head (most do): nothing to wait for, no deadline to arm
            await pull()
        else:
            async with asyncio.timeout(limits.body_timeout_s):
                await pull()
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


# A run of digits as long as the shortest integer orjson would read as a float (past 64 bits;
# -2**63 has 19 digits): such a body goes to ``json``, which keeps it an integer. Found by mapping
# every digit to "0" and every other byte to " " (``bytes.translate``, a table lookup a byte) and
# looking for 19 zeros; a regex ``[0-9]{19}`` tries every position in turn, 15x as long.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_DIGITS = b"0" * 19


def parse_json(data: bytes | bytearray, guard: FrontDoorGuard) -> Any:
    """JSON with at most ``max_json_depth`` levels and only finite numbers."""
    max_depth = guard.limits.max_json_depth
    # No deeper than its count of opening brackets (strings' included): a request's few objects
    # never pay for the exact walk.
    if data.count(b"[") + data.count(b"{") > max_depth and json_depth(data) > max_depth:
        guard.refused("json_too_deep")
        raise Refused(400, f"request body is nested deeper than {max_depth} levels", code="json_too_deep")
    # orjson first (a tenth of json's time on a prompt's body): what it reads, json reads the same,
    # and what it refuses (NaN and Infinity, a number past a double, a BOM, UTF-16 or -32, a
    # lone surrogate, anything malformed or too deep) goes to json below, which accepts or
    # refuses it exactly as before.
    if _LONG_DIGITS not in data.translate(_DIGITS_AS_ZEROS):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
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


async def read_json(request: Request, guard: FrontDoorGuard) -> Any:
    body, held = await read_body(request, guard)
    try:
        return parse_json(body, guard)
    finally:
        guard.budget.release(held)
        body.clear()  # see _drop
