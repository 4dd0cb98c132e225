"""The front door's limits on a real listening socket (``FrontDoor.serve``), driven by raw
asyncio sockets as slow and hostile clients would: every refusal is a JSON error, is counted,
and the memory held is what the budget accounts for, never more. No timing is asserted: the
tests wait for the edge's answer (tight deadlines only make them quick)."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import zlib
from dataclasses import replace

import pytest
import pytest_asyncio
from frontdoor_helpers import Served, worker_fixture  # noqa: F401 (the worker fixture)
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd.core.config import ConfigError, FrontDoorLimits
from kvcompassd.frontdoor import ROUTES
from kvcompassd.httplimits import (
    SMALL_BODY_BYTES,
    BodyBudget,
    FrontDoorGuard,
    Refused,
    json_depth,
    parse_json,
)

QUICK = FrontDoorLimits(header_timeout_s=0.3, body_timeout_s=0.5, max_body_bytes=256 << 10,
                        body_budget_bytes=1 << 20, max_connections=64, keepalive_timeout_s=5.0, max_header_bytes=4096)


@pytest_asyncio.fixture
async def edge(worker):
    async with Served(QUICK, worker.http_url) as served:
        yield served


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of one HTTP/1.1 response with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, json.loads(body)


def assert_openai_error(body: dict, code: str) -> None:
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == code, body


# -- heads ------------------------------------------------------------------------------------------


async def test_slowloris_head_is_refused_with_408_and_counted(edge):
    reader, writer = await edge.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never finishes
    status, _, body = await read_response(reader)
    assert status == 408
    assert_openai_error(body, "header_timeout")
    assert await reader.read() == b""  # and the connection is closed
    assert edge.metric("kvcompass_frontdoor_refusals_total", {"reason": "header_timeout"}) == 1
    writer.close()


async def test_a_client_that_sends_nothing_is_closed(edge):
    reader, writer = await edge.connect()
    status, _, body = await read_response(reader)
    assert status == 408 and edge.guard.refusals["header_timeout"] == 1
    assert_openai_error(body, "header_timeout")
    writer.close()


async def test_endless_headers_are_refused_with_431_before_the_cap_is_passed_by_much(edge):
    reader, writer = await edge.connect()
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    for i in range(10):  # 10 lines of 1000 bytes: each allowed, together over the 4096-byte head limit
        writer.write(f"X-Filler-{i:03}: {'a' * 984}\r\n".encode())
    status, _, body = await read_response(reader)
    assert status == 431
    assert_openai_error(body, "headers_too_large")
    assert edge.guard.refusals["header_too_large"] == 1
    writer.close()


async def test_the_http_layers_own_refusals_are_json_too(edge):
    reader, writer = await edge.connect()
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(100)) + b"\r\n")
    status, _, body = await read_response(reader)  # more than max_headers (64) header lines
    assert status == 400 and "headers" in body["error"]["message"].lower()
    assert_openai_error(body, "invalid_request")
    assert edge.guard.refusals["malformed_request"] == 1
    writer.close()


async def test_connections_over_the_cap_get_a_json_503_with_retry_after(worker):
    async with Served(replace(QUICK, max_connections=3, header_timeout_s=30.0), worker.http_url) as edge:
        held = [await edge.connect() for _ in range(3)]
        reader, writer = await edge.connect()
        status, headers, body = await read_response(reader)
        assert status == 503 and headers["retry-after"] == "1"
        assert_openai_error(body, "too_many_connections")
        assert edge.guard.connections == 3 and edge.guard.refusals["connection_limit"] == 1
        writer.close()
        # One held connection still works; closing the others frees their places.
        r, w = held[0]
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await read_response(r)
        assert status == 200
        for _, w in held:
            w.close()
        while edge.guard.connections:
            await asyncio.sleep(0.01)
        async with edge.session.get(edge.url + "/health") as resp:
            assert resp.status == 200


async def test_keep_alive_serves_several_requests_on_one_connection(edge):
    reader, writer = await edge.connect()
    for _ in range(3):
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and body["data"][0]["id"] == "test-model"
    assert sum(edge.guard.refusals.values()) == 0
    writer.close()


# -- bodies -----------------------------------------------------------------------------------------


async def test_declared_oversized_body_is_refused_before_it_is_read(edge):
    reader, writer = await edge.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 25165824\r\n\r\n{\"prompt\": \"")
    status, _, body = await read_response(reader)
    assert status == 413
    assert_openai_error(body, "request_too_large")
    assert edge.guard.budget.held == 0 and edge.guard.refusals["body_too_large"] == 1
    writer.close()


async def test_a_client_expecting_100_continue_gets_the_refusal_instead_and_sends_nothing(edge):
    reader, writer = await edge.connect()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: 25165824\r\n\r\n")
    status, _, body = await read_response(reader)  # the first answer: no 100 before it
    assert status == 413
    assert_openai_error(body, "request_too_large")
    writer.close()


async def chunked_upload(edge, size: int, path: bytes = b"/v1/completions"):
    reader, writer = await edge.connect()
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"[" * 1024
    for _ in range(size // len(piece)):
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    await writer.drain()
    return reader, writer


async def test_undeclared_oversized_body_stops_at_the_limit(edge):
    reader, writer = await chunked_upload(edge, 2 * QUICK.max_body_bytes)
    status, _, body = await read_response(reader)
    assert status == 413 and edge.guard.refusals["body_too_large"] == 1
    assert_openai_error(body, "request_too_large")
    assert edge.guard.budget.held == 0
    writer.close()


async def test_stalled_body_is_refused_with_408_and_its_bytes_released(edge):
    reader, writer = await edge.connect()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"text\": \"aaaa")
    status, _, body = await read_response(reader)
    assert status == 408
    assert_openai_error(body, "body_timeout")
    assert edge.guard.budget.held == 0 and edge.guard.refusals["body_timeout"] == 1
    writer.close()


async def test_stalled_uploads_hold_no_more_than_the_budget_and_small_requests_still_pass(worker):
    limits = replace(QUICK, body_timeout_s=60.0)
    async with Served(limits, worker.http_url) as edge:
        uploads = []
        # Each stalled upload sends 192 KiB (under the 256 KiB limit) and waits: together far
        # more than the 1 MiB budget.
        for _ in range(12):
            uploads.append(await chunked_upload(edge, 192 << 10))
        # Wait until the budget has refused some: then it is as full as large bodies may make it.
        while edge.guard.refusals["body_budget"] == 0:
            await asyncio.sleep(0.01)
        assert edge.guard.budget.held <= edge.guard.budget.large_limit
        refused = 0
        for reader, _ in uploads:
            try:
                status, headers, body = await asyncio.wait_for(read_response(reader), 0.05)
            except TimeoutError:
                continue
            assert status == 503 and headers["retry-after"] == "1"
            assert_openai_error(body, "server_busy")
            refused += 1
        assert refused == edge.guard.refusals["body_budget"] >= 12 - (1 << 20) // (192 << 10)
        # An ordinary request still fits in the budget's reserve for small bodies.
        async with edge.session.post(edge.url + "/generate", json={"text": "hello",
                                     "sampling_params": {"max_new_tokens": 2}}) as resp:
            assert resp.status == 200, await resp.text()
        held = edge.guard.budget.held
        assert held == edge.metric("kvcompass_frontdoor_buffered_body_bytes") and held > 0
        for _, writer in uploads:
            writer.close()
        while edge.guard.budget.held:
            await asyncio.sleep(0.01)  # every byte goes back as the uploads are dropped


async def test_compression_bomb_inflates_no_further_than_the_limit(edge):
    bomb = gzip.compress(b"{\"text\": \"" + b"a" * (16 << 20) + b"\"}", 9)  # ~16 KiB -> 16 MiB
    async with edge.session.post(edge.url + "/generate", data=bomb,
                                 headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as resp:
        body = await resp.json()
        assert resp.status == 413 and "once inflated" in body["error"]["message"]
    assert edge.guard.budget.held == 0 and edge.guard.refusals["body_too_large"] == 1


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_bodies_within_the_limit_are_served(edge, encoding, compress):
    data = compress(json.dumps({"text": "hello there", "sampling_params": {"max_new_tokens": 2}}).encode())
    async with edge.session.post(edge.url + "/generate", data=data,
                                 headers={"Content-Encoding": encoding, "Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["output_ids"]) == 2


async def test_other_encodings_are_refused_with_415(edge):
    async with edge.session.post(edge.url + "/generate", data=b"\x00\x01",
                                 headers={"Content-Encoding": "br", "Content-Type": "application/json"}) as resp:
        assert resp.status == 415
        assert_openai_error(await resp.json(), "unsupported_content_encoding")


# -- JSON -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,code", [
    (b"[" * 100000 + b"]" * 100000, "json_too_deep"),  # was a RecursionError and a 500
    (b'{"text": "a", "sampling_params": {"temperature": NaN}}', "invalid_number"),
    (b'{"text": "a", "sampling_params": {"temperature": 1e999}}', "invalid_number"),
    (b'{"text": "a", "sampling_params": {"temperature": -Infinity}}', "invalid_number"),
    (b'{"text": "a"', "invalid_json"),
    (b'\xff\xfe{}', "invalid_json"),
])
async def test_bad_json_is_a_400_never_a_500(edge, raw, code):
    async with edge.session.post(edge.url + "/generate", data=raw, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert_openai_error(await r.json(), code)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=4),
                                                                                 inner, max_size=3), max_leaves=30))
def test_json_depth_matches_the_document(value):
    def depth(v):
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    assert json_depth(json.dumps(value).encode()) == depth(value)


def _read_by_json(data: bytes) -> tuple:
    """What parse_json made of ``data`` before its orjson path: json's reading, or its refusal."""
    guard = FrontDoorGuard()
    try:
        value = json.loads(data, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)),
                           parse_float=lambda text: float(text) if math.isfinite(float(text)) else
                           (_ for _ in ()).throw(ValueError(text)))
    except (ValueError, RecursionError):
        value = Refused
    return _typed(value) if value is not Refused else ("refused",), guard


def _typed(value):
    """``value`` with every scalar's type beside it (1 == 1.0 == True in Python)."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    return (type(value).__name__, repr(value))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=20)


@given(json_values, st.sampled_from(["plain", "spaced", "utf-8", "utf-16", "bom", "nan", "big float", "cut",
                                     "surrogate", "duplicate"]))
def test_parse_json_reads_what_json_reads(value, form):
    """The orjson path changes nothing: every body reads as json reads it (types included: a
    20-digit integer stays an int), and what json refuses is still refused."""
    data = {"plain": lambda: json.dumps(value).encode(),
            "spaced": lambda: json.dumps(value, indent=1).encode(),
            "utf-8": lambda: json.dumps(value, ensure_ascii=False).encode(),
            "utf-16": lambda: json.dumps(value).encode("utf-16"),
            "bom": lambda: b"\xef\xbb\xbf" + json.dumps(value).encode(),
            "nan": lambda: b'{"v": ' + json.dumps(value).encode() + b', "x": NaN}',
            "big float": lambda: b'[' + json.dumps(value).encode() + b', 1e400]',
            "cut": lambda: json.dumps(value).encode()[:-1],
            "surrogate": lambda: b'["\\ud800", ' + json.dumps(value).encode() + b']',
            "duplicate": lambda: b'{"a": 1, "a": ' + json.dumps(value).encode() + b'}'}[form]()
    expected, guard = _read_by_json(data)
    try:
        got = _typed(parse_json(data, guard))
    except Refused:
        got = ("refused",)
    assert got == expected


# -- metrics, routes and errors ---------------------------------------------------------------------


async def test_random_paths_do_not_grow_the_metrics(worker):
    async with Served(QUICK, worker.http_url, api_keys=frozenset({"sk-good"})) as edge:
        for i in range(300):
            async with edge.session.post(f"{edge.url}/probe/{i}/x") as resp:
                assert resp.status == 401
            async with edge.session.get(f"{edge.url}/nope-{i}", headers={"Authorization": "Bearer sk-good"}) as resp:
                assert resp.status == 404
                assert_openai_error(await resp.json(), "not_found")
        routes = {s.labels["route"] for m in edge.metrics.registry.collect() if m.name == "kvcompass_requests"
                  for s in m.samples}
        assert routes <= set(ROUTES) and routes == {"other"}
        assert edge.metric("kvcompass_requests_total", {"route": "other", "status": "401"}) == 300


async def test_wrong_method_and_unknown_path_are_json_errors(edge):
    async with edge.session.get(edge.url + "/v1/completions") as resp:
        assert resp.status == 405 and "POST" in resp.headers["Allow"]
        assert_openai_error(await resp.json(), "method_not_allowed")
    async with edge.session.post(edge.url + "/v1/nothing", json={}) as resp:
        assert resp.status == 404
        assert_openai_error(await resp.json(), "not_found")


# -- the pieces -------------------------------------------------------------------------------------


def test_budget_keeps_its_last_eighth_for_the_first_bytes_of_each_request():
    budget = BodyBudget(8 << 20)
    assert budget.reserve(7 << 20, SMALL_BODY_BYTES)  # a large body up to 7/8
    assert not budget.reserve(1, (7 << 20) + SMALL_BODY_BYTES)  # no further
    assert budget.reserve(SMALL_BODY_BYTES, 0)  # a new request's first bytes still fit
    budget.release((7 << 20) + SMALL_BODY_BYTES)
    assert budget.held == 0


@pytest.mark.parametrize("field,value", [
    ("max_body_bytes", 10), ("header_timeout_s", 0), ("body_timeout_s", float("nan")), ("max_connections", 0),
    ("max_json_depth", 2), ("body_budget_bytes", 4096), ("keepalive_timeout_s", -1.0), ("max_headers", True),
])
def test_limits_are_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        FrontDoorLimits(**{field: value})
