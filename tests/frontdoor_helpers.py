"""A front door under its guard on a real loopback socket, forwarding to one emulated worker
(shared by test_httplimits and test_openai_api)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest_asyncio
from clusters import make_cluster

from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.core.config import FrontDoorLimits
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import ByteTokenizer

MODEL = "test-model"


class Served:
    """A front door under its guard on 127.0.0.1, forwarding to one emulated worker."""

    def __init__(self, limits: FrontDoorLimits, worker_url: str, api_keys=frozenset()):
        cfg = make_cluster({"a": 1}, shards=1)
        cfg = replace(cfg, workers=(replace(cfg.workers[0], http=worker_url),))
        layout = IndexLayout.from_config(cfg)
        view = EdgeIndexView(layout, 1, edge="edge-a")
        view.install_snapshot(MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=64).snapshot())
        self.metrics = EdgeMetrics()
        self.guard = FrontDoorGuard(limits, self.metrics)
        self.router = Router(cfg, "a", view, now=0.0)
        self.limits, self.api_keys = limits, api_keys

    async def __aenter__(self):
        self.session = aiohttp.ClientSession()  # the test's client: aiohttp's own
        self.workers_http = WorkerConnections()  # the edge's, toward its worker
        forwarder = Forwarder("edge-a", self.router, lambda w: None, self.workers_http, clock=lambda: 0.0,
                              metrics=self.metrics)
        settings = FrontDoorSettings(model=MODEL, max_prompt_tokens=4096, api_keys=self.api_keys)
        self.frontdoor = FrontDoor(forwarder, ByteTokenizer(), settings, self.metrics, guard=self.guard)
        _, self.port = await self.frontdoor.serve("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc):
        await self.frontdoor.close()
        await self.session.close()
        await self.workers_http.close()

    async def connect(self):
        return await asyncio.open_connection("127.0.0.1", self.port)

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest_asyncio.fixture(name="worker")
async def worker_fixture():
    w = EmulatedWorker(EmulatorSettings(port=0, kv_events_endpoint="tcp://127.0.0.1:*",
                                        kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0, worker_id="a-0"))
    await w.start()
    yield w
    await w.stop()
