"""The edge's HTTP front door and forwarding path in-process on a loopback socket, driven by
aiohttp's client, against a real emulated worker: OpenAI and SGLang shapes, streaming, API keys,
failover, and fuzzed bodies that never crash it."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings, strategies as st

from clusters import make_cluster
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import ByteTokenizer


class Edge:
    """A front door over a router whose region has one live emulated worker and one dead one."""

    def __init__(self, worker_url: str, dead_url: str, api_keys=frozenset()):
        cfg = make_cluster({"a": 2}, shards=1)
        # Point the config's workers at the live emulator (a-0) and a closed port (a-1).
        workers = (cfg.workers[0].__class__(**{**_fields(cfg.workers[0]), "http": dead_url}),
                   cfg.workers[1].__class__(**{**_fields(cfg.workers[1]), "http": worker_url}))
        from dataclasses import replace

        self.cfg = replace(cfg, workers=workers)
        layout = IndexLayout.from_config(self.cfg)
        view = EdgeIndexView(layout, 1, edge="edge-a")
        view.install_snapshot(MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=64).snapshot())
        self.router = Router(self.cfg, "a", view, now=0.0)
        self.metrics = EdgeMetrics()
        self.api_keys = api_keys

    def front_door(self, http: WorkerConnections) -> FrontDoor:
        forwarder = Forwarder("edge-a", self.router, lambda w: None, http, clock=lambda: 0.0,
                              metrics=self.metrics)
        return FrontDoor(forwarder, ByteTokenizer(), FrontDoorSettings(model="m", max_prompt_tokens=4096,
                                                                        api_keys=self.api_keys), self.metrics)


class Client:
    """aiohttp's client toward a front door listening on 127.0.0.1: ``post``/``get`` by path."""

    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def post(self, path: str, **kwargs) -> aiohttp.ClientResponse:
        async with self.session.post(self.url + path, **kwargs) as r:
            await r.read()  # kept by the response: json() and text() read it again
            return r

    async def get(self, path: str, **kwargs) -> aiohttp.ClientResponse:
        async with self.session.get(self.url + path, **kwargs) as r:
            await r.read()
            return r


@contextlib.asynccontextmanager
async def serving(edge: Edge, http: WorkerConnections):
    frontdoor = edge.front_door(http)
    _, port = await frontdoor.serve("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            client = Client(session, f"http://127.0.0.1:{port}")
            client.edge = edge
            yield client
    finally:
        await frontdoor.close()


def _fields(obj):
    return {name: getattr(obj, name) for name in obj.__slots__}


@pytest_asyncio.fixture
async def worker():
    w = EmulatedWorker(EmulatorSettings(port=0, kv_events_endpoint="tcp://127.0.0.1:*",
                                        kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0, worker_id="a-1"))
    await w.start()
    yield w
    await w.stop()


@pytest_asyncio.fixture
async def client(worker):
    async with WorkerConnections() as http:
        async with serving(Edge(worker.http_url, "http://127.0.0.1:9"), http) as c:
            yield c


async def test_completions_fail_over_from_a_dead_worker_and_report_the_server(client):
    # Both workers idle and empty: the score ties and picks a-0 first, which is down.
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 3})
    body = await r.json()
    assert r.status == 200, body
    assert body["kvcompass"]["worker"] == "a-1" and body["kvcompass"]["attempts"] == 2
    assert body["usage"]["completion_tokens"] == 3 and r.headers["X-Request-Id"] == body["id"]


async def test_second_request_reports_reused_tokens_and_streams(client):
    prompt = "x" * 200
    await client.post("/generate", json={"text": prompt + "1", "sampling_params": {"max_new_tokens": 1}})
    r = await client.post("/generate", json={"text": prompt + "2", "sampling_params": {"max_new_tokens": 4}, "stream": True})
    assert r.status == 200
    chunks = [json.loads(line[5:]) for line in (await r.text()).splitlines() if line.startswith("data:") and "[DONE]" not in line]
    final = chunks[-1]["meta_info"]
    assert final["cached_tokens"] == 192 and len(chunks[-1]["output_ids"]) == 4
    r = await client.post("/v1/chat/completions", json={"model": "m", "stream": True, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    text = await r.text()
    assert r.status == 200 and text.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in text


async def test_api_keys_are_required_when_configured(worker):
    async with WorkerConnections() as http:
        async with serving(Edge(worker.http_url, "http://127.0.0.1:9", api_keys=frozenset({"sk-good"})), http) as c:
            assert (await c.post("/generate", json={"text": "a"})).status == 401
            bad = await c.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer sk-bad"})
            assert bad.status == 401 and "API key" in (await bad.json())["error"]["message"]
            ok = await c.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer sk-good"})
            assert ok.status == 200
            assert (await c.get("/health")).status == 200  # health stays open for probes


@pytest.mark.parametrize("body,status,fragment", [
    (b"not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"input_ids": list(range(5000))}).encode(), 413, "limit is 4096"),
    (json.dumps({"input_ids": [-1]}).encode(), 400, "token ids"),
    (json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -3}}).encode(), 400, "max_new_tokens"),
    (json.dumps({"text": ""}).encode(), 400, "prompt"),
])
async def test_bad_requests_get_clear_errors(client, body, status, fragment):
    r = await client.post("/generate", data=body, headers={"Content-Type": "application/json"})
    assert r.status == status and fragment in (await r.json())["error"]["message"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
bodies = st.dictionaries(st.sampled_from(["prompt", "messages", "text", "input_ids", "max_tokens", "stream",
                                          "sampling_params", "temperature", "stop", "n", "model"]), json_values, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]))
async def test_fuzzed_bodies_never_crash_the_front_door(client, body, route):
    r = await client.post(route, json=body)
    assert r.status in (200, 400, 404, 413, 503), await r.text()
    if r.status != 200:
        assert "error" in await r.json()


async def test_get_routes_answer_head_and_other_methods_are_405_with_allow(client):
    async with client.session.head(client.url + "/v1/models") as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) > 0 and await r.read() == b""
    r = await client.post("/health")
    assert r.status == 405 and r.headers["Allow"] == "GET,HEAD"
    assert (await r.json())["error"]["code"] == "method_not_allowed"
