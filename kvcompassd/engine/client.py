"""HTTP client of an SGLang engine (or the emulated worker): ``/generate`` and load readings.

Shared by the agent (which runs forwarded prompts) and the edge (which reaches own-region
workers over plain HTTP). Prompts always go as ``input_ids``: the engine must cache exactly the
tokens whose prefix keys the index holds.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from urllib.parse import urlsplit

import numpy as np
import orjson

from kvcompassd.core.messages import COUNT, MILLIS, MessageError, check_room_steps
from kvcompassd.engine.http1 import HttpClientError, Response, ResponseTooLarge, WorkerConnections


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """The next piece of generated output."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class EngineFinished:
    """The engine's closing figures (``meta_info``)."""

    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    # The engine's own time from the request's arrival to its end, in seconds (SGLang's
    # ``e2e_latency``: its tokenizer manager's clock), None if it did not say.
    worker_latency_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    pending_prefill_tokens: int
    queue_ms: float
    # When VRAM frees up, (ms from the reading, free KV tokens from then on), where the engine
    # says (the emulator's ``room_steps``); None where it does not (a real SGLang).
    room_steps: tuple[tuple[float, int], ...] | None = None
    # The share of its KV pool the engine's requests hold, where it says so (SGLang's
    # ``num_used_tokens`` over ``max_total_num_tokens``, summed over its data-parallel ranks);
    # None where it does not.
    pinned_share: float | None = None


class EngineError(Exception):
    """The engine failed or answered something unusable."""


class EngineRejected(EngineError):
    """The engine refused the request itself (bad sampling parameters, a prompt over its
    context): the client's error, which every other worker would repeat. ``status`` is the
    engine's HTTP status, ``message`` its own words."""

    def __init__(self, status: int, message: str):
        super().__init__(f"engine rejected the request (HTTP {status}): {message}")
        self.status = status
        self.message = message


# The statuses that blame the request, not the worker. Others of the 4xx range say something
# about this engine (401/403 its credentials, 404 its URL, 408 its time, 429 its load): the
# next worker may well serve the same request.
CLIENT_ERROR_STATUSES = frozenset({400, 413, 422})
MAX_ERROR_MESSAGE = 1000  # characters of an engine's error message passed on


class EngineStatusError(EngineError):
    """The engine answered, with an HTTP status other than 200 (``status``)."""

    def __init__(self, what: str, status: int):
        super().__init__(f"{what} answered HTTP {status}")
        self.status = status


def error_message(body: str) -> str:
    """The message of an engine's error body: SGLang's ``{"error": {"message": ...}}`` (or a
    bare string under ``error``), FastAPI's ``{"detail": ...}``, else the text itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:MAX_ERROR_MESSAGE]
    message = data
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message", data)))
        message = error.get("message", error) if isinstance(error, dict) else error
    if not isinstance(message, str):
        message = json.dumps(message, separators=(",", ":"))
    return message[:MAX_ERROR_MESSAGE]


def _failure(status: int, body: str) -> EngineError:
    if status in CLIENT_ERROR_STATUSES:
        return EngineRejected(status, error_message(body))
    return EngineError(f"engine answered HTTP {status}: {body[:300]}")


_JSON_HEADERS = b"Content-Type: application/json\r\nAccept: */*\r\n"


def generate_body(input_ids, fields: dict) -> bytes:
    """``/generate``'s JSON body: ``input_ids`` (a uint32 array or a sequence of ints) written
    straight from the array by orjson, the other ``fields`` by ``json`` as ever. A prompt's
    thousands of ids through a Python list and ``json.dumps`` were a tenth of the edge's CPU
    per request."""
    if isinstance(input_ids, np.ndarray):
        ids = input_ids if input_ids.dtype == np.uint32 else input_ids.tolist()
    else:
        ids = [int(t) for t in input_ids] if not isinstance(input_ids, list) else input_ids
    try:
        encoded = orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # orjson.JSONEncodeError: a non-contiguous view, an int past 64 bits
        encoded = json.dumps(ids.tolist() if isinstance(ids, np.ndarray) else [int(t) for t in ids]).encode()
    try:
        # orjson writes the same JSON values as json.dumps (compact) for every value the sampling
        # checks let through (a non-finite float, which they refuse, it would write as null).
        rest = orjson.dumps(fields)
    except TypeError:  # orjson.JSONEncodeError: an int past 64 bits, a key that is not a string
        rest = json.dumps(fields).encode()
    return b'{"input_ids":' + encoded + (b"," + rest[1:] if len(rest) > 2 else b"}")


def _meta_count(meta: dict, name: str, default: int) -> int:
    """A token count of the engine's ``meta_info``: an integer in [0, 2^63) (a ValueError,
    the engine's malformed answer, for anything else). A negative one reached the cache belief, which
    refused it mid-request, and the reuse counters, which take no decrement."""
    value = meta.get(name)
    try:
        count = int(value or default)
    except (TypeError, ValueError):  # (a list's TypeError escaped the client's error handling)
        count = -1
    if not 0 <= count < 1 << 63:
        raise ValueError(f"meta_info {name} is not a token count: {str(value)[:64]!r}")
    return count


def finished_from_meta(meta: dict, prompt_tokens: int, completion_tokens: int) -> EngineFinished:
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):  # SGLang reports {"type": "length", "length": n}
        finish = finish.get("type", "")
    return EngineFinished(
        cached_tokens=_meta_count(meta, "cached_tokens", 0),
        prompt_tokens=_meta_count(meta, "prompt_tokens", prompt_tokens),
        completion_tokens=_meta_count(meta, "completion_tokens", completion_tokens),
        finish_reason=str(finish or ""),
        worker_latency_s=_seconds(meta.get("e2e_latency")),
    )


def _seconds(value) -> float | None:
    """A duration the engine reported: a finite number >= 0, else None (not reported, or not one)."""
    if type(value) is int or type(value) is float:
        seconds = float(value)
        if 0.0 <= seconds < math.inf:
            return seconds
    return None


class EngineClient:
    """One engine's HTTP API over ``http``'s keep-alive pool toward its address."""

    def __init__(self, base_url: str, http: WorkerConnections):
        self.base = base_url.rstrip("/")
        url = urlsplit(self.base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"an engine's address must be http(s)://host[:port][/path], not {base_url!r}")
        tls = url.scheme == "https"
        self._pool = http.pool(url.hostname, url.port or (443 if tls else 80), tls=tls)
        prefix = url.path.rstrip("/").encode()
        self._generate_path = prefix + b"/generate"  # made once, not per request
        self._loads_path = prefix + b"/v1/loads"
        self._server_info_path = prefix + b"/server_info"

    async def generate(
        self, input_ids: Sequence[int], sampling_params: dict, *, stream: bool, rid: str | None = None,
        extra: dict | None = None,
    ) -> AsyncIterator[EngineOutput | EngineFinished]:
        """Run a prompt; yields outputs then one ``EngineFinished``. Raises ``EngineError``.
        ``extra``: further top-level fields of SGLang's ``GenerateReqInput`` (the bootstrap
        fields of a prefill-decode pair)."""
        fields = {"sampling_params": sampling_params, "stream": stream}
        if rid:
            fields["rid"] = rid
        if extra:
            fields.update(extra)
        try:
            # Leaving this block before the end (the caller closed this generator: its client
            # went away, or a deadline passed) closes the connection, which SGLang and the
            # emulated worker take as an abort of the request.
            async with self._pool.request(b"POST", self._generate_path, generate_body(input_ids, fields),
                                          _JSON_HEADERS) as resp:
                if resp.status != 200:
                    raise _failure(resp.status, (await _read_some(resp, MAX_ERROR_BODY)).decode("utf-8", "replace"))
                if not stream:
                    data = orjson.loads(await resp.read(MAX_WHOLE_BODY))
                    if not isinstance(data, dict):
                        raise EngineError("engine answered a JSON value that is not an object")
                    ids = tuple(int(t) for t in data.get("output_ids") or ())
                    yield EngineOutput(ids, str(data.get("text", "")))
                    yield finished_from_meta(data.get("meta_info") or {}, len(input_ids), len(ids))
                    return
                streamed = _StreamedGenerate(len(input_ids))
                while raw := await resp.readline(MAX_STREAM_LINE):
                    item = streamed.line(raw)
                    if streamed.done:
                        # The body's end (the chunked terminator) follows: read it, so that the
                        # connection is kept (bounded: see DRAIN_*).
                        await resp.drain(DRAIN_MAX_BYTES, DRAIN_TIMEOUT_S)
                        break
                    if item is not None:
                        yield item
                yield streamed.finished()
        except OSError as exc:
            raise EngineError(f"engine unreachable: {str(exc) or type(exc).__name__}") from exc
        except HttpClientError as exc:
            raise EngineError(f"engine's HTTP exchange failed: {exc}") from exc
        except TimeoutError as exc:  # connecting took longer than the pool allows
            raise EngineError("engine unreachable: connecting timed out") from exc
        except ValueError as exc:
            raise EngineError(f"engine sent malformed JSON: {exc}") from exc

    async def load(self, prefill_ms_per_token: float) -> EngineLoad:
        """Read ``/v1/loads``; the queueing delay is the prefill work queued ahead of a new prompt."""
        try:
            data = await self._control_json(self._loads_path, "/v1/loads")
        except (HttpClientError, OSError, TimeoutError, ValueError, RecursionError) as exc:
            raise EngineError(f"load reading failed: {str(exc) or type(exc).__name__}") from exc
        return parse_loads(data, prefill_ms_per_token)

    async def server_info(self) -> dict:
        try:
            return await self._control_json(self._server_info_path, "/server_info")
        except (HttpClientError, OSError, TimeoutError, ValueError, RecursionError) as exc:
            raise EngineError(f"server info failed: {str(exc) or type(exc).__name__}") from exc

    async def _control_json(self, path: bytes, what: str):
        async with asyncio.timeout(CONTROL_TIMEOUT_S), self._pool.request(b"GET", path, b"", b"") as resp:
            if resp.status != 200:
                raise EngineStatusError(what, resp.status)
            try:
                body = await resp.read(MAX_CONTROL_BODY)
            except ResponseTooLarge:
                raise ValueError(f"{what} answered more than {MAX_CONTROL_BODY} bytes") from None
        return json.loads(body)


# The engine's small control answers (/v1/loads, /server_info) are read within a deadline and a
# size bound: an engine that stalls or streams garbage must not hang or bloat its agent.
CONTROL_TIMEOUT_S = 5.0
MAX_CONTROL_BODY = 1 << 20
MAX_ERROR_BODY = 64 * 1024  # of an engine's refusal, read for its message
MAX_WHOLE_BODY = 64 << 20  # a non-streamed answer: a long generation's ids and text
# A streamed chunk: SGLang's non-incremental streaming repeats every output id so far in each.
MAX_STREAM_LINE = 16 << 20


async def _read_some(resp: Response, limit: int) -> bytes:
    """Up to ``limit`` bytes of the body (an error's: its message is all the client needs)."""
    body = bytearray()
    while len(body) < limit:
        piece = await resp.readany()
        if not piece:
            break
        body += piece
    return bytes(body[:limit])


def parse_loads(data, prefill_ms_per_token: float) -> EngineLoad:
    """Accept SGLang's ``/v1/loads`` shapes: a flat object, or per data-parallel rank entries
    under ``loads`` (summed). The queued prefill work (uncached tokens waiting) at the worker's
    prefill rate is the delay a new prompt waits; the emulator's exact ``estimated_queue_ms``
    extension wins when present, and its ``room_steps`` (when the VRAM the running requests pin
    frees up) is passed on for one rank.

    The wait for VRAM room is in the emulator's figure (``WorkerQueueModel.queue_ms``), not in
    the one read off a real SGLang: its report says that the head waits for memory
    (``num_total_tokens``, the running requests' KV plus every waiting prompt, exceeds
    ``max_total_num_tokens``) but not for how long, which hangs on the running requests'
    remaining outputs, which it does not report. The queue estimate read off it is low by that
    wait; the edge's rate learner times a request from the last end it saw at the worker
    (``core/rates.py``), exact when that end freed the room, and otherwise may take the wait
    for prefill."""
    entries = data.get("loads") if isinstance(data, dict) and isinstance(data.get("loads"), list) else [data]
    if len(entries) > MAX_LOAD_ENTRIES:
        raise EngineError(f"unexpected /v1/loads: {len(entries)} entries")
    running = waiting = pending = used = pool = 0
    explicit = None
    sized = True  # every entry says how much of its pool is in use
    for e in entries:
        if not isinstance(e, dict):
            raise EngineError("unexpected /v1/loads entry")
        running += _reported_count(e, "num_running_reqs")
        waiting += _reported_count(e, "num_waiting_reqs", "num_queue_reqs")
        pending += _reported_count(e, "num_waiting_uncached_tokens", "num_pending_tokens")
        in_use, size = e.get("num_used_tokens"), e.get("max_total_num_tokens")
        if _count(in_use) and _count(size):
            used += in_use
            pool += size
        else:
            sized = False
        ms = e.get("estimated_queue_ms")
        if ms is not None:
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0.0 <= ms <= MAX_QUEUE_MS:
                raise EngineError(f"unexpected /v1/loads estimated_queue_ms {str(ms)[:40]!r}: "
                                  f"not a number of ms in [0, {MAX_QUEUE_MS:g}]")
            explicit = max(explicit or 0.0, float(ms))
    if max(running, waiting) > MAX_REPORTED_COUNT:
        raise EngineError(f"unexpected /v1/loads: {max(running, waiting)} requests")
    # (a backlog past the bound is as good as endless; the wire carries at most that)
    queue_ms = explicit if explicit is not None else min(MAX_QUEUE_MS, pending * prefill_ms_per_token)
    room = None
    if len(entries) == 1 and isinstance(entries[0].get("room_steps"), list):  # one rank's memory
        try:  # what the agent sends on (WorkerRoomReported): bounded and ordered, or not at all
            room = check_room_steps(entries[0]["room_steps"], "/v1/loads room_steps")
        except MessageError as exc:
            raise EngineError(f"unexpected {exc}") from None
    share = min(1.0, used / pool) if sized and pool > 0 else None
    return EngineLoad(running, waiting, pending, max(0.0, queue_ms), room, share)


# What a load report can carry (WorkerLoadReported's bounds), and the data-parallel ranks one
# /v1/loads may list.
MAX_QUEUE_MS = MILLIS.hi
MAX_REPORTED_COUNT = COUNT.hi
MAX_LOAD_ENTRIES = 4096


def _reported_count(entry: dict, name: str, alias: str | None = None) -> int:
    """A request or token count of a /v1/loads entry (absent or null: 0): an integer (an
    integral float too) in [0, 2^32), else EngineError: the engine answered something unusable,
    not something for the agent's load loop to trip over."""
    value = entry.get(name, entry.get(alias) if alias else None)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_REPORTED_COUNT:
        raise EngineError(f"unexpected /v1/loads {name} {str(value)[:40]!r}: not a count in [0, 2^32)")
    return value


def _count(value) -> bool:
    """A token count as an engine reports it: a non-negative int (not a bool), within a
    sane bound."""
    return type(value) is int and 0 <= value < 1 << 48


def _raise_if_aborted(meta) -> None:
    """SGLang ends a streamed request it refuses after admission (a prompt over the context
    length, say) with an ``abort`` finish reason in an ordinary chunk: with a 4xx
    ``status_code`` that is the client's error; without one, or a 5xx, the engine's."""
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if not isinstance(finish, dict) or finish.get("type") != "abort":
        return
    status = finish.get("status_code")
    message = str(finish.get("message") or "aborted")[:MAX_ERROR_MESSAGE]
    if isinstance(status, int) and not isinstance(status, bool) and status in CLIENT_ERROR_STATUSES:
        raise EngineRejected(status, message)
    raise EngineError(f"engine aborted the request (status {status}): {message}")


# After ``[DONE]`` the end of the body (the chunked terminator) is on its way: read it, so that the
# connection goes back to the keep-alive pool instead of each request paying a new connection to
# its worker. Bounded: an engine that sends more, or stalls, costs its connection, never the request.
DRAIN_MAX_BYTES = 64 * 1024
DRAIN_TIMEOUT_S = 1.0


class _StreamedGenerate:
    """SGLang's streamed ``/generate``, line by line: SSE ``data:`` lines with cumulative ``text``
    and ``output_ids`` (incremental in builds with incremental streaming), ending with
    ``[DONE]``. Sans-IO, so that the client reads the lines in its own loop (a generator layer
    less per request and per line)."""

    __slots__ = ("done", "ids_sent", "meta", "prompt_tokens", "text_sent")

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.text_sent = ""
        self.ids_sent: list[int] = []
        self.meta: dict = {}
        self.done = False  # ``[DONE]`` arrived

    def line(self, raw: bytes) -> EngineOutput | None:
        """The output a line brings, if any; raises ``EngineError`` for an engine's error event."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return None
        chunk = orjson.loads(payload)
        if not isinstance(chunk, dict):
            raise EngineError("engine sent a streamed chunk that is not a JSON object")
        if "error" in chunk:
            # SGLang reports a request it refuses after the 200 headers as an error event.
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) and not isinstance(code, bool) else 400
            raise _failure(status, json.dumps(chunk))
        meta = chunk.get("meta_info")
        _raise_if_aborted(meta)
        text = str(chunk.get("text", ""))
        raw = chunk.get("output_ids") or ()
        if not isinstance(raw, (list, tuple)):
            raise EngineError("engine sent streamed output_ids that are not a list")
        text_sent, ids_sent = self.text_sent, self.ids_sent
        sent = len(ids_sent)
        # Which stream this is, from the engine's count of its output so far (SGLang's
        # completion_tokens): all of it in each event (the default), or only what is new
        # (--incremental-streaming-output). Read off the ids alone, an incremental piece that
        # begins with all that was sent (a second newline after the first) was taken for a
        # repeat and dropped; the ids decide only where the count fits neither (a trimmed stop).
        # Only the new ids of a cumulative event are converted.
        total = meta.get("completion_tokens") if isinstance(meta, dict) else None
        counted = type(total) is int
        incremental = counted and total != len(raw) and total == sent + len(raw)
        if incremental:
            cumulative = False
        elif counted and total == len(raw):
            cumulative = True  # (an incremental stream's first event too: the same reading)
        else:
            cumulative = len(raw) >= sent and [int(t) for t in raw[:sent]] == ids_sent
        delta_ids = [int(t) for t in (raw[sent:] if cumulative else raw)]
        ids_sent.extend(delta_ids)
        if not incremental and text.startswith(text_sent):
            delta_text, self.text_sent = text[len(text_sent):], text
        else:
            delta_text, self.text_sent = text, text_sent + text
        self.meta = meta or self.meta
        if delta_ids or delta_text:
            return EngineOutput(tuple(delta_ids), delta_text)
        return None

    def finished(self) -> EngineFinished:
        return finished_from_meta(self.meta, self.prompt_tokens, len(self.ids_sent))
