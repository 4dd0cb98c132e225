"""End to end through real daemons: a long prompt dispatched in one region reaches the other
regions' edges' queue estimates at once (``[score] urgent_broadcast_ms``), not at the next
broadcast period; an agent is sent its region's queue vector only while it serves another
region, and piggybacks it on the response. The period here is 10 s, so only the urgent
broadcast, or the vector a response carries, can reach the other edge before the request
ends; nothing is timed."""

from __future__ import annotations

import time

import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

PERIOD_MS = 10_000.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    spec = DeploymentSpec(workers={"us": 1, "eu": 2}, one_way_ms={("us", "eu"): 5.0}, shards=1, wan=False,
                          score={"broadcast_period_ms": PERIOD_MS, "urgent_broadcast_ms": 100.0},
                          idle={"heartbeat_ms": PERIOD_MS})
    d = LocalDeployment(spec, tmp_path_factory.mktemp("queues"))
    async with d:
        yield d


async def eu_sees_us0(dep) -> dict:
    body = await admin(dep, "edge-eu", "queues")
    return next(w for w in body["workers"] if w["worker"] == "us-0")


async def test_a_long_prompt_at_home_is_broadcast_to_the_other_region_at_once(dep):
    async def heard():  # the us edge's first vector (sent when it starts), 0 ms
        w = await eu_sees_us0(dep)
        return w["age_s"] is not None and w["reported_ms"] == 0.0

    await eventually(heard)
    # 4,000 byte tokens at 0.085 ms each: 340 ms of prefill charged to us-0 (>= 100 ms: urgent).
    reply = await generate(dep, "us", doc(5, 4000), max_new_tokens=2)
    assert reply["meta_info"]["kvcompass"]["worker"] == "us-0"

    async def charged():
        return (await eu_sees_us0(dep))["reported_ms"] > 0.0

    seen = await eventually(charged, timeout=PERIOD_MS / 2000.0)  # well inside one period
    assert seen


async def _seen_from(dep, edge: str, worker: str) -> dict:
    return next(w for w in (await admin(dep, edge, "queues"))["workers"] if w["worker"] == worker)


async def test_an_agent_is_sent_its_regions_vector_only_while_it_serves_another_region(dep):
    async def none_wanted():  # each agent told its edge so when it connected
        workers = (await admin(dep, "edge-eu", "queues"))["workers"]
        return all(w["vector_wanted"] is False for w in workers if w["region"] == "eu")

    await eventually(none_wanted)
    assert (await _seen_from(dep, "edge-eu", "us-0"))["vector_wanted"] is None  # (not its agent)
    # A long prefix cached in eu, then the same prefix asked for in us: us's edge forwards it
    # over the WAN to the holder, whose agent serves a request from another region.
    shared = doc(31, 4000)
    holder = (await generate(dep, "eu", shared + " one"))["meta_info"]["kvcompass"]["worker"]
    other = next(w for w in ("eu-0", "eu-1") if w != holder)

    async def visible_and_idle_from_us():
        holders = (await admin(dep, "edge-us", "holders", {"text": shared + " two"}))["holders"]
        return (any(h["worker"] == holder for h in holders)
                and (await _seen_from(dep, "edge-us", holder))["queue_ms"] == 0.0)

    await eventually(visible_and_idle_from_us)
    before = (await admin(dep, holder, "status"))["piggybacked"]
    asked = time.monotonic()
    meta = (await generate(dep, "us", shared + " two"))["meta_info"]
    took = time.monotonic() - asked
    assert meta["kvcompass"]["worker"] == holder and meta["cached_tokens"] >= 3900
    # The holder's agent asked for the vector when the request came, and holds one that came
    # since; the other eu agent still does not want it.
    status = await admin(dep, holder, "status")
    assert status["vector_wanted"] is True and status["vector_age_s"] is not None
    # ... which the response carried: the region's (not the worker's own reading alone)
    assert status["piggybacked"] == {"region": before["region"] + 1, "own": before["own"]}
    assert set(status["region_vector"]) == {"eu-0", "eu-1"}
    assert (await _seen_from(dep, "edge-eu", holder))["vector_wanted"] is True
    assert (await _seen_from(dep, "edge-eu", other))["vector_wanted"] is False
    # The response carried the whole region's vector: us's edge heard of the other eu worker
    # with it, within the request (eu's broadcasts come every 10 s).
    assert (await _seen_from(dep, "edge-us", other))["age_s"] <= took + 1.0
