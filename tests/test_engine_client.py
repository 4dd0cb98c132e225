"""The SGLang HTTP client against the emulated worker on loopback: an engine's refusal of the
request (a 400 before the stream, or SGLang's error event inside it) is ``EngineRejected`` with
the engine's own message; other failures stay ``EngineError`` (a worker failure); closing the
generator mid-stream aborts the request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd.worker.workermodel import WorkerTiming
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.engine.client import (
    EngineClient,
    EngineError,
    EngineOutput,
    EngineRejected,
    _StreamedGenerate,
    error_message,
    parse_loads,
)

GUARD_S = 30.0  # hang guard only
ENGINE_LOADS = Path(__file__).parent / "data" / "engine_loads"  # SGLang's own /v1/loads answers


def settings(**overrides) -> EmulatorSettings:
    values = {"port": 0, "kv_events_endpoint": "tcp://127.0.0.1:*", "kv_replay_endpoint": "tcp://127.0.0.1:*",
              "block_size": 16, "vram_kv_tokens": 4096, "dram_kv_tokens": 4096, "time_scale": 0.0, "worker_id": "emu-c"}
    return EmulatorSettings(**{**values, **overrides})


@contextlib.asynccontextmanager
async def emulated(**overrides):
    worker = EmulatedWorker(settings(**overrides))
    await worker.start()
    try:
        async with WorkerConnections() as http:
            yield worker, EngineClient(worker.http_url, http)
    finally:
        await worker.stop()


async def collect(engine: EngineClient, params: dict, *, stream: bool) -> list:
    async with asyncio.timeout(GUARD_S):
        return [item async for item in engine.generate(list(range(1, 40)), params, stream=stream, rid="r1")]


# Error bodies exactly as SGLang's http_server.py (Apache-2.0) writes them: _create_error_response
# for a refused non-streamed request, stream_results' event for one refused inside a stream, and
# FastAPI's body for a request that fails its schema.
SGLANG_ERROR = b'{"error":{"message":"top_p must be in (0, 1], got 2.0."}}'
SGLANG_STREAM_ERROR = (b'data: {"error":{"message":"min_p must be in [0, 1], got 3.0.","type":"invalid_request_error",'
                       b'"code":400,"retryable":false}}\n\ndata: [DONE]\n\n')
# A request SGLang's scheduler refuses after admission, streamed: an ordinary chunk whose finish
# reason is FINISH_ABORT(...).to_json() (schedule_batch.py).
SGLANG_STREAM_ABORT = (b'data: {"text":"","output_ids":[],"meta_info":{"id":"r1","finish_reason":{"type":"abort",'
                       b'"message":"The input (5000 tokens) is longer than the model\'s context length (4096 tokens).",'
                       b'"status_code":400,"err_type":"BadRequestError"},"prompt_tokens":5000,"completion_tokens":0,'
                       b'"cached_tokens":0}}\n\ndata: [DONE]\n\n')
SGLANG_STREAM_ABORT_NO_STATUS = (b'data: {"text":"","output_ids":[],"meta_info":{"id":"r1","finish_reason":'
                                 b'{"type":"abort","message":"Abort in waiting queue"},"prompt_tokens":5,'
                                 b'"completion_tokens":0,"cached_tokens":0}}\n\ndata: [DONE]\n\n')
# A streamed request's last chunk as SGLang's tokenizer_manager.py closes it: meta_info's
# e2e_latency = finished_time - created_time, beside the figures it always carries.
SGLANG_STREAM_FINISHED = (b'data: {"text":"ab","output_ids":[97,98],"meta_info":{"id":"r1","finish_reason":'
                          b'{"type":"length","length":2},"prompt_tokens":3,"weight_version":"default",'
                          b'"completion_tokens":2,"cached_tokens":3,"e2e_latency":0.04531502723693848}}\n\n')
FASTAPI_422 = b'{"detail":[{"type":"missing","loc":["body","rid"],"msg":"Field required"}]}'


def test_error_messages_are_read_from_each_engine_shape():
    assert error_message(SGLANG_ERROR.decode()) == "top_p must be in (0, 1], got 2.0."
    assert error_message('{"error": "bare text"}') == "bare text"
    assert "Field required" in error_message(FASTAPI_422.decode())
    assert error_message("not json at all\n") == "not json at all"
    assert len(error_message("x" * 10_000)) == 1000


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)


@given(st.one_of(st.text(max_size=3000), json_values.map(json.dumps),
                 json_values.map(lambda v: json.dumps({"error": v})), json_values.map(lambda v: json.dumps({"detail": v}))))
def test_any_error_body_gives_a_bounded_message(body):
    message = error_message(body)
    assert isinstance(message, str) and len(message) <= 1000


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_request_is_the_clients_error_with_the_engines_message(stream):
    async with emulated() as (_, engine):
        with pytest.raises(EngineRejected) as refused:
            await collect(engine, {"max_new_tokens": 2, "top_p": 2.0}, stream=stream)
    assert refused.value.status == 400 and refused.value.message == "top_p must be in (0, 1], got 2.0."


async def serve_bytes(status: int, body: bytes, content_type: str):
    async def handler(request):
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize(("status", "body", "content_type", "rejected"), [
    (200, SGLANG_STREAM_ERROR, "text/event-stream", 400),
    (200, SGLANG_STREAM_ABORT, "text/event-stream", 400),
    (200, SGLANG_STREAM_ABORT_NO_STATUS, "text/event-stream", None),  # the engine's own doing
    (400, SGLANG_ERROR, "application/json", 400),
    (422, FASTAPI_422, "application/json", 422),
    (429, b'{"error":{"message":"too many requests"}}', "application/json", None),  # this engine's load
    (503, b'{"error":{"message":"overloaded"}}', "application/json", None),
])
async def test_which_engine_answers_blame_the_request(status, body, content_type, rejected):
    runner, url = await serve_bytes(status, body, content_type)
    try:
        async with WorkerConnections() as http:
            engine = EngineClient(url, http)
            with pytest.raises(EngineError) as failure:
                await collect(engine, {"max_new_tokens": 2}, stream=True)
    finally:
        await runner.cleanup()
    if rejected is None:
        assert not isinstance(failure.value, EngineRejected)
    else:
        assert isinstance(failure.value, EngineRejected) and failure.value.status == rejected


async def test_closing_the_stream_aborts_the_request_in_the_engine():
    # Modelled times: 4000 tokens at 10 ms each would hold a slot for 40 s.
    timing = WorkerTiming(prefill_ms_per_token=0.01, decode_ms_per_token=10.0, decode_batch_slope=0.0)
    async with emulated(timing=timing, time_scale=1.0) as (worker, engine):
        outputs = engine.generate(list(range(1, 40)), {"max_new_tokens": 4000}, stream=True, rid="long")
        async with asyncio.timeout(GUARD_S):
            assert isinstance(await anext(outputs), EngineOutput)
            assert worker.engine.load()["num_running_reqs"] == 1
            await outputs.aclose()
            while worker.engine.load()["num_running_reqs"] or worker.engine.inflight:
                await asyncio.sleep(0.01)
            # The next request is served now: the model's clock did not run on to where the
            # aborted request would have finished (40 s).
            nxt = engine.generate(list(range(1, 30)), {"max_new_tokens": 2}, stream=True, rid="next")
            assert [type(item).__name__ async for item in nxt][-1] == "EngineFinished"
            assert worker.engine.model.now < 20.0


@contextlib.asynccontextmanager
async def hostile_engine(handler):
    """A real HTTP server answering the agent's control reads with ``handler``."""
    app = web.Application()
    app.router.add_get("/v1/loads", handler)
    app.router.add_get("/server_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with WorkerConnections() as http:
            yield EngineClient(f"http://127.0.0.1:{port}", http)
    finally:
        await runner.cleanup()


async def test_control_reads_refuse_an_oversized_answer():
    from kvcompassd.engine import client as client_module

    async def huge(request):
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b" " * (256 * 1024)
        for _ in range(client_module.MAX_CONTROL_BODY // len(chunk) + 2):
            await response.write(chunk)
        return response

    async with hostile_engine(huge) as engine:
        with pytest.raises(EngineError, match="more than"):
            await engine.load(0.1)
        with pytest.raises(EngineError, match="more than"):
            await engine.server_info()


async def test_control_reads_of_a_stalled_engine_end_at_their_deadline(monkeypatch):
    from kvcompassd.engine import client as client_module

    monkeypatch.setattr(client_module, "CONTROL_TIMEOUT_S", 0.2)
    release = asyncio.Event()

    async def stalled(request):
        await release.wait()  # never answers while the test runs
        return web.json_response({})

    async with hostile_engine(stalled) as engine:
        try:
            with pytest.raises(EngineError, match="TimeoutError|timeout"):
                await engine.load(0.1)
            with pytest.raises(EngineError, match="TimeoutError|timeout"):
                await engine.server_info()
        finally:
            release.set()


async def test_control_reads_refuse_json_nested_past_the_interpreters_limit():
    async def nested(request):
        return web.Response(body=b"[" * 200_000 + b"]" * 200_000, content_type="application/json")

    async with hostile_engine(nested) as engine:
        with pytest.raises(EngineError):
            await engine.load(0.1)


@pytest.mark.parametrize("stream", [True, False])
async def test_requests_in_sequence_share_one_kept_alive_connection(stream):
    """A streamed answer ends with ``[DONE]`` and then the body's end: the client reads that end,
    so the connection goes back to the pool instead of each request paying a new one."""
    worker = EmulatedWorker(settings())
    await worker.start()
    try:
        async with WorkerConnections() as http:
            engine = EngineClient(worker.http_url, http)
            for i in range(12):
                async with asyncio.timeout(GUARD_S):
                    items = [item async for item in engine.generate(list(range(1, 60)), {"max_new_tokens": 4},
                                                                    stream=stream, rid=f"r{i}")]
                assert type(items[-1]).__name__ == "EngineFinished"
            assert http.opened == 1
    finally:
        await worker.stop()


async def test_a_stream_closed_at_its_finish_keeps_the_connection():
    """The forwarding path closes the engine's generator as soon as it has the finish (it never
    asks for the generator's end): the connection, whose response is whole, is kept all the same."""
    async with emulated() as (_, engine):
        for i in range(6):
            outputs = engine.generate(list(range(1, 60)), {"max_new_tokens": 3}, stream=True, rid=f"f{i}")
            async with asyncio.timeout(GUARD_S):
                async for item in outputs:
                    if type(item).__name__ == "EngineFinished":
                        break
            await outputs.aclose()
        assert engine._pool.opened == 1


@contextlib.asynccontextmanager
async def engine_after_done(tail: bytes, *, forever: bool, pause_s: float = 0.0,
                            chunk: bytes = b'data: {"text":"ab","output_ids":[97,98],"meta_info":{"cached_tokens":3}}\n\n'):
    """An engine that streams one chunk, ``[DONE]``, then ``tail`` (repeated ``forever``, or
    followed by a stall that never ends the body); with an empty ``tail``, it ends the body
    ``pause_s`` after ``[DONE]`` (as a separate write, the way SGLang's server ends its stream)."""
    stop = asyncio.Event()
    clients: set = set()  # the client ends of the connections the server accepted

    async def generate(request: web.Request) -> web.StreamResponse:
        clients.add(request.transport.get_extra_info("peername"))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        if not tail:
            await asyncio.sleep(pause_s)
            await resp.write_eof()
            return resp
        while not stop.is_set():
            await resp.write(tail)
            if not forever:
                await stop.wait()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with WorkerConnections() as http:
            engine = EngineClient(f"http://127.0.0.1:{port}", http)
            engine.connections_accepted = clients
            yield engine
    finally:
        stop.set()
        await runner.cleanup()


async def test_the_body_ending_after_done_keeps_the_connection():
    """The body's end comes a moment after ``[DONE]``: the client waits for it (bounded) rather
    than dropping the connection."""
    async with engine_after_done(b"", forever=False, pause_s=0.05) as engine:
        for _ in range(3):
            async with asyncio.timeout(GUARD_S):
                items = [item async for item in engine.generate([1, 2, 3], {"max_new_tokens": 2}, stream=True)]
            assert items[-1].cached_tokens == 3
        assert len(engine.connections_accepted) == 1


@pytest.mark.parametrize("tail,forever", [(b"x" * 4096, True), (b"\n", False)])
async def test_what_follows_done_costs_at_most_the_connection(monkeypatch, tail, forever):
    """An engine that keeps sending after ``[DONE]``, or never ends the body, still gives a
    finished request: the client reads a bounded amount for a bounded time, then lets the
    connection go."""
    from kvcompassd.engine import client

    monkeypatch.setattr(client, "DRAIN_TIMEOUT_S", 0.05)
    async with engine_after_done(tail, forever=forever) as engine:
        async with asyncio.timeout(GUARD_S):
            items = [item async for item in engine.generate([1, 2, 3], {"max_new_tokens": 2}, stream=True)]
    assert items[0] == EngineOutput((97, 98), "ab")
    assert type(items[-1]).__name__ == "EngineFinished" and items[-1].cached_tokens == 3


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=50),
       dtype=st.sampled_from(["uint32", "int64", "list", "tuple"]),
       fields=st.dictionaries(st.sampled_from(["sampling_params", "stream", "rid", "bootstrap_room"]),
                              st.one_of(st.booleans(), st.text(max_size=8), st.integers(-2**70, 2**70),
                                        st.floats(allow_nan=False, allow_infinity=False),
                                        st.dictionaries(st.text(max_size=4), st.integers(), max_size=3))))
def test_generate_body_is_the_json_of_ids_and_fields(ids, dtype, fields):
    from kvcompassd.engine.client import generate_body
    import numpy as np

    given_ids = {"uint32": lambda: np.asarray(ids, dtype=np.uint32), "int64": lambda: np.asarray(ids, dtype=np.int64),
                 "list": lambda: list(ids), "tuple": lambda: tuple(ids)}[dtype]()
    assert json.loads(generate_body(given_ids, fields)) == {"input_ids": ids, **fields}
    strided = np.asarray(ids + ids, dtype=np.uint32)[::2]  # a view orjson cannot write directly
    assert json.loads(generate_body(strided, {}))["input_ids"] == (ids + ids)[::2]


@pytest.mark.parametrize("steps", [
    [[0.0, 100], [5.0, 50]],  # free tokens going down
    [[5.0, 10], [1.0, 20]],  # time going back
    [[-1.0, 10]],
    [[float("nan"), 10]],
    [[0.0, -5]],
    [[float(i), i] for i in range(1025)],  # more steps than a WorkerRoomReported carries
    [[0.0]],
])
def test_room_steps_a_worker_cannot_send_on_are_an_engine_error_not_a_crash(steps):
    # The agent turns these into a WorkerRoomReported, whose checks raise on construction: read
    # off the engine unchecked, one bad answer would end its load loop.
    with pytest.raises(EngineError, match="room_steps"):
        parse_loads({"num_running_reqs": 1, "room_steps": steps}, 1.0)
    good = parse_loads({"num_running_reqs": 1, "room_steps": [[0.0, 10], [5.0, 20]]}, 1.0)
    assert good.room_steps == ((0.0, 10), (5.0, 20))


@pytest.mark.parametrize("stream", [True, False])
async def test_the_engines_own_time_for_a_request_is_read_from_its_meta_info(stream):
    """SGLang's tokenizer manager closes every response's meta_info with ``e2e_latency``, its
    own seconds from the request's arrival to its end (as the emulated worker does): the edge
    takes what it saw beyond that out of its prefill samples (core/rates.py)."""
    async with emulated(time_scale=1.0) as (_, engine):
        loop = asyncio.get_running_loop()
        started = loop.time()
        items = await collect(engine, {"max_new_tokens": 3}, stream=stream)
        seen_s = loop.time() - started
    done = items[-1]
    assert type(done).__name__ == "EngineFinished"
    assert done.worker_latency_s is not None and 0.0 < done.worker_latency_s <= seen_s


@pytest.mark.parametrize("value,expected", [
    (0.25, 0.25), (3, 3.0), (0, 0.0),
    (True, None), ("0.1", None), (float("nan"), None), (float("inf"), None), (-0.5, None), (None, None),
])
def test_an_engine_time_that_is_not_a_duration_is_not_taken(value, expected):
    from kvcompassd.engine.client import finished_from_meta

    meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 5,
            "completion_tokens": 2, "cached_tokens": 0}
    if value is not None:
        meta["e2e_latency"] = value
    assert finished_from_meta(meta, 5, 2).worker_latency_s == expected
    assert finished_from_meta({k: v for k, v in meta.items() if k != "e2e_latency"}, 5, 2).worker_latency_s is None


@pytest.mark.parametrize("field,value", [("cached_tokens", -3), ("prompt_tokens", -1),
                                         ("completion_tokens", 1 << 63), ("cached_tokens", "many"),
                                         ("cached_tokens", [1])])
async def test_an_engine_count_that_is_not_one_is_the_engines_malformed_answer(field, value):
    """A closing count below 0 or past 64 bits fails the attempt as the engine's error (another
    worker is tried) rather than reaching the belief and the counters."""
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 5,
            "completion_tokens": 2, "cached_tokens": 0, field: value}
    body = orjson.dumps({"text": "ab", "output_ids": [5, 6], "meta_info": meta})
    runner, url = await serve_bytes(200, body, "application/json")
    try:
        async with WorkerConnections() as http:
            with pytest.raises(EngineError, match=field) as failure:
                await collect(EngineClient(url, http), {"max_new_tokens": 2}, stream=False)
    finally:
        await runner.cleanup()
    assert not isinstance(failure.value, EngineRejected)


async def test_sglangs_closing_chunk_gives_the_engines_own_time():
    """The figure as SGLang's HTTP server streams it, read by the client over real HTTP."""
    async with engine_after_done(b"", forever=False, chunk=SGLANG_STREAM_FINISHED) as engine:
        async with asyncio.timeout(GUARD_S):
            items = [item async for item in engine.generate([1, 2, 3], {"max_new_tokens": 2}, stream=True)]
    assert items[-1].worker_latency_s == 0.04531502723693848 and items[-1].completion_tokens == 2


def test_the_share_of_its_kv_pool_sglang_says_its_requests_hold_is_read_from_its_loads():
    # What SGLang 0.5.23's own /v1/loads handler answered (tests/data/engine_loads): per
    # data-parallel rank, num_used_tokens (the KV its requests hold, not the evictable cache) and
    # max_total_num_tokens (the pool); summed over the ranks.
    body = json.loads((ENGINE_LOADS / "sglang-two-ranks.json").read_bytes())
    load = parse_loads(body, 0.1)
    assert load.pinned_share == pytest.approx(0.4) and load.room_steps is None and load.running == 4
    idle = parse_loads(json.loads((ENGINE_LOADS / "sglang-idle.json").read_bytes()), 0.1)
    assert idle.pinned_share == 0.0 and idle.running == 0
    # A rank that does not say, or says something that is not a count: no share at all.
    for bad in ({}, {"num_used_tokens": 5}, {"num_used_tokens": True, "max_total_num_tokens": 10},
                {"num_used_tokens": -1, "max_total_num_tokens": 10}, {"num_used_tokens": 1.5, "max_total_num_tokens": 10}):
        assert parse_loads({"loads": [body["loads"][0], {"num_running_reqs": 1, **bad}]}, 0.1).pinned_share is None
    assert parse_loads({"num_used_tokens": 0, "max_total_num_tokens": 0}, 0.1).pinned_share is None
    assert parse_loads({"num_used_tokens": 12, "max_total_num_tokens": 10}, 0.1).pinned_share == 1.0


@pytest.mark.parametrize("bad", [
    {"num_running_reqs": -1}, {"num_running_reqs": "3"}, {"num_running_reqs": True}, {"num_running_reqs": 2.5},
    {"num_waiting_reqs": 1 << 32}, {"num_queue_reqs": [1]}, {"num_waiting_uncached_tokens": -5},
    {"num_pending_tokens": {"a": 1}}, {"estimated_queue_ms": 2e9}, {"estimated_queue_ms": -1.0},
    {"estimated_queue_ms": float("nan")}, {"estimated_queue_ms": float("inf")}, {"estimated_queue_ms": "5"},
    {"estimated_queue_ms": False}])
def test_a_load_figure_no_load_report_can_carry_is_the_engines_unusable_answer(bad):
    """Every figure of /v1/loads either fits what the agent's load report carries (counts below
    2^32, a queue of at most 1e9 ms) or is an EngineError: a reading that failed, never a report
    the wire refuses, which used to end the agent's load loop for good."""
    with pytest.raises(EngineError, match="unexpected /v1/loads"):
        parse_loads({"loads": [{"num_running_reqs": 1}, bad]}, 0.1)
    with pytest.raises(EngineError, match="unexpected /v1/loads"):
        parse_loads({"loads": [{"num_running_reqs": (1 << 32) - 1}] * 2}, 0.1)  # fine alone, not summed


def test_load_figures_within_what_a_report_carries_are_read_as_given():
    load = parse_loads({"num_running_reqs": 3.0, "num_waiting_reqs": None, "num_queue_reqs": 7,
                        "num_pending_tokens": (1 << 32) - 1}, 1.0)
    assert (load.running, load.waiting, load.queue_ms) == (3, 0, 1e9)  # a backlog past the bound: the bound
    load = parse_loads({"num_queue_reqs": 7, "estimated_queue_ms": 12}, 1.0)
    assert (load.waiting, load.queue_ms) == (7, 12.0) and isinstance(load.queue_ms, float)


def _sse(output_ids, text, completion_tokens=None) -> bytes:
    meta = {"prompt_tokens": 4, "cached_tokens": 0}
    if completion_tokens is not None:
        meta["completion_tokens"] = completion_tokens
    return b"data: " + json.dumps({"text": text, "output_ids": output_ids, "meta_info": meta}).encode() + b"\n"


def _deltas(lines: list[bytes]) -> list[tuple[tuple[int, ...], str]]:
    streamed = _StreamedGenerate(4)
    out = [streamed.line(raw) for raw in lines]
    return [(o.token_ids, o.text) for o in out if o is not None]


def test_a_cumulative_stream_gives_each_event_its_new_ids_and_text():
    # SGLang's default stream: every event holds the whole output so far, its count beside it
    lines = [_sse([5], "a", 1), _sse([5, 5, 6], "aab", 3), _sse([5, 5, 6, 7], "aabc", 4)]
    assert _deltas(lines) == [((5,), "a"), ((5, 6), "ab"), ((7,), "c")]


def test_an_incremental_piece_that_begins_with_what_was_sent_is_still_new():
    # --incremental-streaming-output: each event only what is new. Its first ids equal all that
    # was sent before ([5], "a"): the count (3 = 1 sent + 2 here) says it is new, not a repeat.
    lines = [_sse([5], "a", 1), _sse([5, 6], "ab", 3), _sse([7], "c", 4)]
    assert _deltas(lines) == [((5,), "a"), ((5, 6), "ab"), ((7,), "c")]
    # the same token twice at the start (two newlines, say): the second is not dropped
    assert _deltas([_sse([9], "\n", 1), _sse([9], "\n", 2)]) == [((9,), "\n"), ((9,), "\n")]


def test_streamed_ids_that_are_not_a_list_are_the_engines_error():
    for odd in (5, {"5": 1}, "56"):
        with pytest.raises(EngineError, match="not a list"):
            _StreamedGenerate(4).line(_sse(odd, "a", 1))


def test_without_a_count_the_ids_themselves_tell_a_cumulative_stream_from_an_incremental_one():
    assert _deltas([_sse([5], "a"), _sse([5, 6], "ab"), _sse([5, 6, 7], "abc")]) == [
        ((5,), "a"), ((6,), "b"), ((7,), "c")]
    assert _deltas([_sse([5], "a"), _sse([6], "b"), _sse([7, 8], "cd")]) == [((5,), "a"), ((6,), "b"), ((7, 8), "cd")]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=40),
       st.booleans())
def test_any_output_in_any_pieces_comes_out_whole_from_either_stream(ids, sizes, incremental):
    # few distinct ids, so pieces often begin with what was sent before
    pieces, at = [], 0
    for size in sizes:
        if at >= len(ids):
            break
        pieces.append(ids[at:at + size])
        at += size
    if at < len(ids):
        pieces.append(ids[at:])
    lines, done = [], 0
    for piece in pieces:
        done += len(piece)
        text = "".join(map(str, piece)) if incremental else "".join(map(str, ids[:done]))
        lines.append(_sse(piece if incremental else ids[:done], text, done))
    deltas = _deltas(lines)
    assert [t for d in deltas for t in d[0]] == ids
    assert "".join(d[1] for d in deltas) == "".join(map(str, ids))
