"""The edge's forwarding path on a prefill-decode fleet of its own region, over HTTP to real
emulated workers in both roles: the score's prefill worker and a decode worker of its region
serve the request together (bootstrap room and all), the decode worker is reported, and a
decode worker that fails before the first token is avoided on the retry while the prefill
worker, not to blame, serves it again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import zmq.asyncio

from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.core.config import parse_config
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings, output_tokens
from kvcompassd.forwarding import ForwardError, ForwardRequest, Forwarder, GenerationFinished, TokensGenerated
from kvcompassd.launcher import free_loopback_port
from kvcompassd.metrics import EdgeMetrics

GUARD_S = 30.0  # hang guard only
DEAD = f"http://127.0.0.1:{free_loopback_port()}"  # nothing listens there


def config(workers: dict[str, tuple[str, str, int | None]]):
    """``workers``: id -> (role, http, bootstrap port), all in region a."""
    entries = []
    for wid, (role, http, port) in workers.items():
        entry = {"id": wid, "region": "a", "role": role, "http": http, "prefill_ms_per_token": 0.1,
                 "decode_ms_per_token": 10.0, "vram_kv_tokens": 100000, "dram_kv_tokens": 0, "max_running": 8}
        if port is not None:
            entry["bootstrap_port"] = port
        entries.append(entry)
    return parse_config({"cluster": {"name": "t", "model": "m", "shards": 1},
                         "index": {"block_size": 16, "levels": 4, "same_region_min_tokens": 32,
                                   "initial_capacity": 64},
                         "regions": [{"name": "a"}], "workers": entries}, "<test>")


@pytest_asyncio.fixture
async def fleet():
    ctx = zmq.asyncio.Context()
    common = dict(port=0, kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*",
                  block_size=16, vram_kv_tokens=4096, dram_kv_tokens=0, time_scale=0.0, bootstrap_port=0)
    workers = {"a-p0": EmulatedWorker(EmulatorSettings(worker_id="a-p0", role="prefill", **common), context=ctx),
               "a-d1": EmulatedWorker(EmulatorSettings(worker_id="a-d1", role="decode", **common), context=ctx)}
    for w in workers.values():
        await w.start()
    cfg = config({"a-p0": ("prefill", workers["a-p0"].http_url, workers["a-p0"].bootstrap_port),
                  "a-d0": ("decode", DEAD, None),
                  "a-d1": ("decode", workers["a-d1"].http_url, None)})
    layout = IndexLayout.from_config(cfg)
    view = EdgeIndexView(layout, 1, edge="edge-a")
    view.install_snapshot(MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=64).snapshot())
    async with WorkerConnections() as session:
        forwarder = Forwarder("edge-a", Router(cfg, "a", view, now=0.0), lambda w: None, session, clock=lambda: 0.0,
                              metrics=EdgeMetrics(), first_token_floor_s=10.0)
        forwarder.workers = workers
        try:
            yield forwarder
        finally:
            for w in workers.values():
                await w.stop()
            ctx.term()


async def run(forwarder, tokens, request_id: str = "r1"):
    request = ForwardRequest(request_id, np.asarray(tokens, dtype=np.uint32), {"max_new_tokens": 4}, True)
    async with asyncio.timeout(GUARD_S):
        items = [item async for item in forwarder.generate(request)]
    assert all(isinstance(i, TokensGenerated) for i in items[:-1]) and isinstance(items[-1], GenerationFinished)
    return [t for i in items[:-1] for t in i.token_ids], items[-1]


async def test_the_prefill_and_a_decode_worker_of_its_region_serve_the_request_together(fleet):
    fleet.decode_chooser.load_reported("a-d0", running=3, waiting=0)  # least loaded: a-d1
    prompt = list(range(1, 100))
    tokens, done = await run(fleet, prompt)
    assert tokens == output_tokens(prompt, 4, 0)
    assert (done.worker, done.decode_worker, done.cached_tokens, done.attempts) == ("a-p0", "a-d1", 0, 1)
    assert fleet.workers["a-p0"].kv_sender.transfers == 1 and fleet.workers["a-d1"].engine.kv_received == 1
    _, done = await run(fleet, prompt + [5], "r2")
    assert done.cached_tokens == 96  # the prefill worker's cache, reported through the decode
    assert fleet.metrics.decode_choices.labels("a-d1")._value.get() == 2
    assert fleet.decode_chooser.describe()["workers"]["a-d1"]["inflight"] == 0


async def test_a_decode_failure_before_the_first_token_moves_to_another_decode_worker_not_another_prefill(fleet):
    fleet.decode_chooser.load_reported("a-d1", running=3, waiting=0)  # least loaded: a-d0, which is dead
    prompt = list(range(1, 60))
    tokens, done = await run(fleet, prompt)
    assert tokens == output_tokens(prompt, 4, 0)
    assert (done.worker, done.decode_worker, done.attempts) == ("a-p0", "a-d1", 2)
    assert len(fleet.suspects) == 0  # the prefill worker is not suspected
    assert fleet.metrics.retries._value.get() == 1
    # a-d0 is avoided by the next request although it is still the least loaded
    _, done = await run(fleet, prompt + [1], "r2")
    assert (done.decode_worker, done.attempts) == ("a-d1", 1)


async def test_a_pairs_first_token_deadline_allows_for_the_kv_transfer(fleet):
    tokens = np.arange(1, 4001, dtype=np.uint32)
    decision = fleet.router.decide(tokens, now=0.0)
    request = ForwardRequest("r", tokens, {}, True)
    score_ms = decision.score.scores.item(decision.worker_index)
    # 4000 tokens x 128 KiB at 12.5 GB/s: the config's defaults
    assert fleet._expected_ms(decision, request) == pytest.approx(score_ms + 4000 * 131072 / 12.5e9 * 1e3)


async def test_with_no_decode_worker_of_its_region_left_the_request_fails_without_suspecting_the_prefill(fleet):
    await fleet.workers["a-d1"].stop()  # both decode workers are gone now
    request = ForwardRequest("r", np.arange(1, 50, dtype=np.uint32), {"max_new_tokens": 2}, True)
    with pytest.raises(ForwardError, match="no decode worker left") as info:
        async with asyncio.timeout(GUARD_S):
            async for _ in fleet.generate(request):
                pass
    assert info.value.status == 503
    assert "a-p0+a-d0" in str(info.value) and "a-p0+a-d1" in str(info.value)  # each decode worker tried once
    assert len(fleet.suspects) == 0
