"""Deadlines and engine errors on a real deployment (daemons on loopback, emulated workers).

Region "us" has two workers, reached by edge-us over plain HTTP; region "eu" has an edge and no
worker, so every request at edge-eu crosses to a us worker's agent over QUIC. On both paths:

- an engine's client error (a 400) reaches the client with the engine's message, is not
  retried on another worker and leaves no worker suspect;
- a client that goes away mid-stream aborts the request at the engine;
- a stream whose agent dies after its first token ends promptly with an SSE error event, and
  the edge stops avoiding that worker once its agent is back;
- a frozen engine (SIGSTOP) costs a request the first-token deadline before another worker
  serves it; no request hangs; once it is resumed the edge stops avoiding it;
- a busy engine (one that runs one request at a time, here a region of one such worker) keeps
  a request whose first token comes after the deadline while it streams another's tokens;
- an edge told to copy its views from an unreachable peer starts from the maintenance units.

Times printed are for reading, not asserted; the guards only catch hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually, generate
from kvcompassd.core.config import DeadlineParams
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The emulated workers' context length (their VRAM pool): a prompt past it is refused by the
# engine, as SGLang refuses it, and the edge (whose own limit is far higher) cannot foresee that.
CONTEXT = 16384
TOO_LONG = "x" * 20000  # 20,000 byte tokens
ENGINE_REFUSAL = f"The input (20000 tokens) is longer than the model's context length ({CONTEXT} tokens)."

SPEC = DeploymentSpec(workers={"us": 2, "eu": 0}, one_way_ms={("us", "eu"): 5.0}, shards=1,
                      prefill_ms_per_token=0.02, decode_ms_per_token=5.0, vram_kv_tokens=CONTEXT)
# Suspicion outlasts every test: only news of the worker's return may end it.
DEADLINES = DeadlineParams(first_token_floor_s=1.0, first_token_factor=4.0, inter_token_s=1.0,
                           suspect_initial_s=120.0, suspect_max_s=120.0, view_copy_timeout_s=3.0)
GUARD = aiohttp.ClientTimeout(total=60)  # hang guard only
LONG = 4000  # tokens: 20 s of decoding at 5 ms each, far longer than any wait below


async def _deployed(tmp_path_factory, name: str, spec: DeploymentSpec, deadlines: DeadlineParams):
    d = LocalDeployment(spec, tmp_path_factory.mktemp(name), time_scale=1.0)
    d.cfg = dataclasses.replace(d.cfg, deadlines=deadlines)
    async with d:
        yield d


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    async for d in _deployed(tmp_path_factory, "deadlines", SPEC, DEADLINES):
        yield d


async def edge_metric(dep, region: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(dep.edge_url(region) + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def running(dep) -> int:
    total = 0
    async with aiohttp.ClientSession() as s:
        for w in dep.cfg.workers:
            async with s.get(w.http + "/v1/loads") as r:
                total += (await r.json())["aggregate"]["total_running_reqs"]
    return total


def log_records(dep, mode: str, node_id: str, event: str) -> list[dict]:
    out = []
    for line in dep.node(mode, node_id).log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


async def open_stream(session: aiohttp.ClientSession, dep, region: str, text: str):
    """A streamed /generate at ``region``'s edge, returned once its first token arrived."""
    response = await session.post(dep.edge_url(region) + "/generate", json={
        "text": text, "stream": True, "sampling_params": {"max_new_tokens": LONG}})
    assert response.status == 200, await response.text()
    async for line in response.content:
        if line.startswith(b"data: {"):
            return response
    raise AssertionError("stream ended before its first token")


# -- engine errors are the client's -------------------------------------------------------------

@pytest.mark.parametrize(("region", "route", "body"), [
    ("us", "/generate", {"text": TOO_LONG, "sampling_params": {"max_new_tokens": 4}}),
    ("eu", "/v1/completions", {"model": "kvcompass-demo", "prompt": TOO_LONG, "max_tokens": 4}),
], ids=["own-region-http", "cross-region-quic"])
async def test_an_engine_refusal_reaches_the_client_with_no_retry_and_no_suspect(dep, region, route, body):
    retries = await edge_metric(dep, region, "kvcompass_retries_total")
    async with aiohttp.ClientSession(timeout=GUARD) as s, s.post(dep.edge_url(region) + route, json=body) as r:
        status, answer = r.status, await r.json()
    assert status == 400
    assert answer["error"]["message"] == ENGINE_REFUSAL
    assert await edge_metric(dep, region, "kvcompass_retries_total") == retries
    assert not log_records(dep, "edge", f"edge-{region}", "worker failed before first token; retrying")


# -- a client that goes away ------------------------------------------------------------------

@pytest.mark.parametrize("region", ["us", "eu"], ids=["own-region-http", "cross-region-quic"])
async def test_a_client_that_goes_away_mid_stream_aborts_the_request_at_the_engine(dep, region):
    async with aiohttp.ClientSession(timeout=GUARD) as s:
        response = await open_stream(s, dep, region, doc(10, 300) + region)
        assert await running(dep) == 1
        response.close()  # the client disconnects
    # Left alone the engine would decode for another ~20 s.
    await eventually(lambda: _is_zero(running(dep)), timeout=10)


@pytest.mark.parametrize("region", ["us", "eu"], ids=["own-region-http", "cross-region-quic"])
async def test_a_client_that_goes_away_before_a_whole_response_aborts_the_request_at_the_engine(dep, region):
    async with aiohttp.ClientSession(timeout=GUARD) as s:
        waiting = asyncio.create_task(s.post(dep.edge_url(region) + "/generate", json={
            "text": doc(11, 300) + region, "sampling_params": {"max_new_tokens": LONG}}))
        await eventually(lambda: _is_one(running(dep)), timeout=10)
        waiting.cancel()  # the client disconnects while the edge gathers the whole response
    await eventually(lambda: _is_zero(running(dep)), timeout=10)


async def _is_one(count) -> bool:
    return await count == 1


async def _is_zero(count) -> bool:
    return await count == 0


# -- a frozen engine ---------------------------------------------------------------------------

async def test_a_frozen_engine_costs_a_request_the_first_token_deadline_and_is_avoided_until_back(dep):
    shared = doc(30, 2000)
    first = (await generate(dep, "us", shared + " warm"))["meta_info"]["kvcompass"]["worker"]

    async def holds():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " x"})
        return any(h["worker"] == first for h in body["holders"])

    await eventually(holds)
    engine = dep.node("emulate-worker", first).proc
    engine.send_signal(signal.SIGSTOP)
    try:
        async def timed(i: int):
            started = time.monotonic()
            async with aiohttp.ClientSession(timeout=GUARD) as s, s.post(dep.edge_url("us") + "/generate", json={
                    "text": shared + f" q{i}", "sampling_params": {"max_new_tokens": 4}}) as r:
                assert r.status == 200, await r.text()
                meta = (await r.json())["meta_info"]["kvcompass"]
            return meta, time.monotonic() - started

        results = await asyncio.gather(*(timed(i) for i in range(4)))
        later, later_s = await timed(9)  # the frozen worker is suspect now: no deadline to pay
        # Idle, its agent reads the engine once a heartbeat (1 s) and marks the first answer
        # after a reading hung over 0.3 s: the freeze outlasts both, so a reading hangs in it.
        await asyncio.sleep(1.5)
    finally:
        engine.send_signal(signal.SIGCONT)
    assert all(meta["worker"] != first for meta, _ in results) and later["worker"] != first
    assert any(meta["attempts"] == 2 for meta, _ in results) and later["attempts"] == 1
    print(f"\nengine SIGSTOPped: {len(results)} concurrent requests served elsewhere in "
          f"{', '.join(f'{s:.2f}' for _, s in results)} s (first-token deadline {DEADLINES.first_token_floor_s} s); "
          f"the next one in {later_s:.2f} s")
    # Its load reports resume once it runs again: the edge stops avoiding it (suspicion would
    # otherwise last DEADLINES.suspect_initial_s).
    await eventually(lambda: _logged_back(dep, first), timeout=30)


async def _logged_back(dep, worker: str) -> bool:
    return any(r.get("worker") == worker for r in log_records(dep, "edge", "edge-us", "worker back: no longer avoided"))


# -- a busy engine -----------------------------------------------------------------------------

# One worker running one request at a time; the first-token deadline is its floor alone (1 s).
BUSY_SPEC = dataclasses.replace(SPEC, workers={"us": 1}, one_way_ms={}, max_running=1)
BUSY_DEADLINES = dataclasses.replace(DEADLINES, first_token_factor=0.0)
BUSY_TOKENS = 500  # ~2.5 s of decoding at 5 ms a token: the second request's first token waits for it


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def busy(tmp_path_factory):
    async for d in _deployed(tmp_path_factory, "busy", BUSY_SPEC, BUSY_DEADLINES):
        yield d


async def test_a_busy_engine_keeps_a_request_whose_first_token_comes_after_the_deadline(busy):
    """The second request waits for the first's whole decode at the only worker, past its 1 s
    deadline, while the worker streams the first's tokens: a long queue, not a fault. It is
    served there, with no retry, and the worker is not avoided. (Before, it was abandoned at
    1 s, and with no other worker the client got a 503.)"""
    async with aiohttp.ClientSession(timeout=GUARD) as s:
        first = await s.post(busy.edge_url("us") + "/generate", json={
            "text": doc(50, 300), "stream": True, "sampling_params": {"max_new_tokens": BUSY_TOKENS}})
        assert first.status == 200, await first.text()
        streamed = asyncio.create_task(first.read())  # read as it comes, to its end
        started = time.monotonic()
        async with s.post(busy.edge_url("us") + "/generate", json={
                "text": doc(51, 300), "sampling_params": {"max_new_tokens": 4}}) as r:
            assert r.status == 200, await r.text()
            meta = (await r.json())["meta_info"]["kvcompass"]
        waited_s = time.monotonic() - started
        await asyncio.wait_for(streamed, GUARD.total)
    assert meta["attempts"] == 1
    assert not log_records(busy, "edge", "edge-us", "worker failed before first token; retrying")
    assert await edge_metric(busy, "us", "kvcompass_retries_total") == 0
    print(f"\nbusy engine: the second request was served after {waited_s:.2f} s "
          f"(first-token deadline {BUSY_DEADLINES.first_token_floor_s} s)")


# -- bootstrap from an unreachable peer ---------------------------------------------------------

async def test_an_edge_told_to_copy_an_unreachable_peer_starts_from_the_maintenance_units(dep):
    dep.kill("edge", "edge-us")
    node = dep.node("edge", "edge-eu")
    node.argv += ["--copy-view-from", "edge-us"]
    dep.restart("edge", "edge-eu")
    try:
        async def ready():
            try:
                async with aiohttp.ClientSession() as s, s.get(dep.edge_url("eu") + "/health") as r:
                    return r.status == 200 and (await r.json()).get("ready")
            except aiohttp.ClientError:
                return False

        await eventually(ready, timeout=60)
        assert node.alive
        assert log_records(dep, "edge", "edge-eu", "view copy from peer edge failed: bootstrapping from the "
                                                   "maintenance units")
    finally:
        node.argv = node.argv[:-2]
        dep.restart("edge", "edge-us")
        await dep.wait_ready(60)
    assert (await generate(dep, "eu", doc(40, 300)))["meta_info"]["kvcompass"]["region"] == "us"


# -- an agent that dies after the first token -------------------------------------------------

async def test_a_stream_whose_agent_dies_after_its_first_token_ends_promptly_with_an_error_event(dep):
    async with aiohttp.ClientSession(timeout=GUARD) as s:
        response = await open_stream(s, dep, "eu", doc(20, 300))
        for w in dep.cfg.workers:  # whichever serves it dies (SIGKILL: no goodbye on the wire)
            dep.kill("agent", w.id)
        killed = time.monotonic()
        rest = [line.strip() async for line in response.content if line.strip()]
        ended = time.monotonic() - killed
    errors = [json.loads(line[5:]) for line in rest if line.startswith(b"data: {") and b'"error"' in line]
    assert rest[-1] == b"data: [DONE]"
    assert len(errors) == 1 and errors[0]["error"]["code"] == "gateway_timeout", rest[-3:]
    print(f"\nagent SIGKILLed mid-stream: error event and closed stream {ended:.2f} s later "
          f"(inter-token deadline {DEADLINES.inter_token_s} s)")
    failed = log_records(dep, "edge", "edge-eu", "worker failed mid-response")[-1]["worker"]
    # (Last in the module: restarted agents rebuild their workers' registrations from their
    # engines' replay, which the tests before would otherwise have to wait for.)
    for w in dep.cfg.workers:
        dep.restart("agent", w.id)
    await dep.wait_ready(60)

    # Suspicion (DEADLINES.suspect_initial_s) ends as soon as the worker's agent is back.
    async def back():
        return any(r.get("worker") == failed and r.get("why") == "agent connected"
                   for r in log_records(dep, "edge", "edge-eu", "worker back: no longer avoided"))

    await eventually(back, timeout=30)
