"""End to end through real daemons: emulated workers five times faster or slower than the cluster
config says keep their prefix groups, because the edge retires each dispatch's charge when its
first token comes back and scores with the rates it learns (core/rates.py; issue 30.5).

One region of three workers, no WAN. The workers run the config's timing at ``--time-scale``
0.2 (five times faster than configured: the configured beta is 5x too high) or 5 (5x slower:
5x too low), each with its own ``--seed`` so its output tokens say who served. Who served is
read off those tokens and must agree with the edge's own answer; nothing is timed: the tests
wait for the edge to have learned (its gauge) and for the conditions they need (a queue the
edge sees), then assert where the requests of one shared prefix went.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually
from kvcompassd.ctl import AdminSession
from kvcompassd.emulator.server import output_tokens
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

# ms per token the workers really take (the config's beta times the time scale): slow enough that
# a queue lasts long enough for the test to see it on a busy machine
TRUE_BETA = 0.5
MAX_NEW = 4
WORKERS = 3
SEEDS = {f"us-{i}": i + 1 for i in range(WORKERS)}
# time scale -> the configured beta that makes the workers' true beta TRUE_BETA
CASES = {0.2: TRUE_BETA / 0.2, 5.0: TRUE_BETA / 5.0}


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=sorted(CASES), ids=["beta-5x-high", "beta-5x-low"])
async def dep(request, tmp_path_factory):
    scale = request.param
    spec = DeploymentSpec(workers={"us": WORKERS}, one_way_ms={}, shards=1, wan=False,
                          prefill_ms_per_token=CASES[scale], decode_ms_per_token=1.0 / scale, fingerprint_bits=16)
    node_args = {f"emulate-worker:{w}": ("--time-scale", str(scale), "--seed", str(seed)) for w, seed in SEEDS.items()}
    d = LocalDeployment(spec, tmp_path_factory.mktemp(f"costmodel-{scale}"), node_args=node_args)
    async with d:
        yield d


def who_served(text: str, output_ids: list[int]) -> str | None:
    prompt = list(text.encode())  # the emulator's byte tokenizer
    return next((w for w, seed in SEEDS.items() if output_tokens(prompt, MAX_NEW, seed) == output_ids), None)


async def served(session: aiohttp.ClientSession, dep, text: str) -> str:
    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW}}
    async with session.post(dep.edge_url("us") + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    worker = who_served(text, data["output_ids"])
    assert worker is not None and worker == data["meta_info"]["kvcompass"]["worker"]
    return worker


async def learned_beta(session: aiohttp.ClientSession, dep, worker: str) -> float:
    async with session.get(dep.edge_url("us") + "/metrics") as r:
        text = await r.text()
    found = re.search(rf'^kvcompass_learned_prefill_ms_per_token\{{worker="{worker}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else float("nan")


async def warm_holder(session, dep, shared: str, suffix_chars: int) -> str:
    """Send the prefix's first request and wait until the edge's view lists its holder."""
    holder = await served(session, dep, shared + " first question " + doc(41, suffix_chars))

    async def registered():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " next"})
        return any(h["worker"] == holder for h in body["holders"])

    await eventually(registered)
    return holder


async def learn(session, dep, shared: str, holder: str, suffix_chars: int) -> None:
    """One at a time, the holder is idle at every decision and serves them all; the edge times
    each prefill until the rate it scores the holder with has moved off the configured one
    toward the truth (more than half the way, in log terms)."""
    configured = dep.cfg.workers[0].prefill_ms_per_token
    asked = 0

    async def learned():
        nonlocal asked
        asked += 1
        text = shared + f" warm {asked} " + doc(100 + asked, suffix_chars)
        assert await served(session, dep, text) == holder
        beta = await learned_beta(session, dep, holder)
        return beta < configured / 2.2 if configured > TRUE_BETA else beta > configured * 2.2

    await eventually(learned, timeout=120.0, interval=0.0)


async def test_follow_ups_of_a_shared_prefix_two_at_a_time_stay_on_its_holder(dep):
    shared = doc(40, 1024)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        holder = await warm_holder(session, dep, shared, 500)
        await learn(session, dep, shared, holder, 500)

        async def client(k: int) -> list[str]:
            return [await served(session, dep, shared + f" client {k} turn {n} " + doc(1000 * k + n, 500))
                    for n in range(10)]

        got = await asyncio.gather(client(1), client(2))
    assert [w for ws in got for w in ws] == [holder] * 20


async def test_a_holder_whose_true_queue_is_shorter_than_the_prefill_it_saves_keeps_the_request(dep):
    # A 2,048-token prefix (the longest level: all of it is credited) and 128-byte suffixes. A
    # burst of 12 queues ~12 x 70 ms of true prefill on the holder (at 0.5 ms/token), which the
    # agent reports in wall ms. A request that comes while the edge sees over 300 ms of it still
    # belongs on the holder: recomputing its 2,048 shared tokens elsewhere takes ~1,024 ms. Priced
    # at a configured beta 5x too low that saving looked like 205 ms and the request went elsewhere.
    shared = doc(50, 2048)
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)))
        holder = await warm_holder(session, dep, shared, 128)
        await learn(session, dep, shared, holder, 128)

        # Polled over one open admin connection: a handshake per poll can outlast the burst on a
        # busy machine, and the edge's queue for the holder would drain unseen.
        edge = await stack.enter_async_context(AdminSession(dep.cfg, dep.tls_dir, "admin", "edge-us"))

        async def holder_queue_ms() -> float:
            workers = (await edge.ask("queues"))["workers"]
            return next(q["queue_ms"] for q in workers if q["worker"] == holder)

        for attempt in range(10):
            burst = [asyncio.create_task(served(session, dep, shared + f" burst {attempt} {n} " + doc(2000 + n, 128)))
                     for n in range(12)]
            try:
                async def queued():
                    return await holder_queue_ms() >= 300.0 or all(t.done() for t in burst)

                await eventually(queued, timeout=30.0, interval=0.0)
                if not all(t.done() for t in burst):  # caught while the holder has a queue
                    probe = await served(session, dep, shared + f" probe {attempt} " + doc(3000, 128))
                    assert probe == holder
                    return
            finally:
                await asyncio.gather(*burst)
        pytest.fail("the edge never saw 300 ms of queue on the holder during a burst")
