"""End to end through real daemons: with ``score.decode_stall_weight`` the edge prices a worker's
prefill for the requests that worker's agent reports it is decoding (``LoadReported.running``
-> ``QueueEstimates.set_local`` -> the Router's scored rates), as ``kvcompassctl queues`` shows.

One region of two emulated workers at their modelled timing; two long answers are started and
held open, so the workers they landed on report running requests; nothing is timed: the test
waits for the edge to show what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import NotYet, admin, doc, eventually
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEIGHT = 0.5


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    # 50 ms a token: a 400-token answer decodes for 20 s, far longer than the test waits.
    spec = DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=1, wan=False, decode_ms_per_token=50.0,
                          score={"decode_stall_weight": WEIGHT})
    d = LocalDeployment(spec, tmp_path_factory.mktemp("decode-stall"))
    async with d:
        yield d


async def _hold_open(session: aiohttp.ClientSession, url: str, text: str, started: asyncio.Event) -> None:
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 400}}
    async with session.post(url + "/generate", json=body) as response:
        assert response.status == 200
        async for _ in response.content:  # its first token: the request is running
            started.set()


async def test_the_edge_prices_a_prefill_for_the_decodes_its_worker_reports(dep):
    url = dep.edge_url("us")
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)))
        started = [asyncio.Event(), asyncio.Event()]
        holders = [asyncio.create_task(_hold_open(session, url, doc(60 + i, 300), started[i])) for i in range(2)]
        stack.callback(lambda: [task.cancel() for task in holders])  # closing the stream aborts it at the worker
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

        async def priced():
            # A short request makes a decision: the scored prices are remade from the readings.
            async with session.post(url + "/generate", json={"text": doc(70, 50),
                                                             "sampling_params": {"max_new_tokens": 1}}) as r:
                assert r.status == 200
            workers = (await admin(dep, "edge-us", "queues"))["workers"]
            seen = {w["worker"]: (w["running"], w["prefill_price"]) for w in workers}
            busy = [price for running, price in seen.values() if running >= 1]
            # Each busy worker priced at 1 + min(1, 0.5 x running): 1.5 or 2 (a reading may land
            # between the decision and the query, so the price is checked, not the count).
            if busy and all(price in (1.5, 2.0) for price in busy):
                return seen
            return NotYet(f"queues: {seen}")

        seen = await eventually(priced, timeout=60.0, interval=0.2)
        assert sum(running for running, _ in seen.values()) >= 1
