"""End to end through real daemons: a long prompt dispatched in one region reaches the other
regions' edges' queue estimates at once (``[score] urgent_broadcast_ms``), not at the next
broadcast period. The period here is 10 s, so only the urgent broadcast can carry the charge
across before the request ends; nothing is timed."""

from __future__ import annotations

import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

PERIOD_MS = 10_000.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    spec = DeploymentSpec(workers={"us": 1, "eu": 1}, one_way_ms={("us", "eu"): 5.0}, shards=1, wan=False,
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
