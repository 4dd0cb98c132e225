"""Hot-prefix migration end to end through real daemons: a long document held only abroad turns
hot at an edge, the edge asks an idle worker of its own region to recompute it, the replica's
registration reaches the index, and the next request stays home.

Its own deployment: the triggers are configured so that the test waits on events, never on
clocks (a 60 s hot window, a 0.3 s idle period that idle workers pass long before).
"""

from __future__ import annotations

import pytest
import pytest_asyncio

from e2e_helpers import NotYet, admin, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(workers={"us": 2, "eu": 1}, one_way_ms={("us", "eu"): 10.0}, shards=2,
                      prefill_ms_per_token=0.05, decode_ms_per_token=1.0, fingerprint_bits=16,
                      score={"hot_prefix_misses": 3, "hot_prefix_window_ms": 60_000.0, "idle_period_ms": 300.0})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    async with LocalDeployment(SPEC, tmp_path_factory.mktemp("e2e-migration"), time_scale=1.0) as d:
        yield d


async def test_a_document_hot_abroad_is_replicated_to_an_idle_worker_and_then_served_at_home(dep):
    shared = doc(70, 4000)
    assert (await generate(dep, "eu", shared + " asked in europe"))["meta_info"]["kvcompass"]["worker"] == "eu-0"

    def edge_us_would_choose(worker: str, prompt: str):
        # The event the next assertion depends on: edge-us sees the worker's registration and,
        # with the queue estimates it holds now, scores it best for this prompt. (Not "eu-0's
        # estimate is exactly 0": after a busy moment the estimate carries a selection
        # correction and a trend that fade exponentially, so on a loaded machine that value
        # could stay a few microseconds above 0 for minutes.)
        async def check():
            body = await admin(dep, "edge-us", "holders", {"text": prompt})
            if any(h["worker"] == worker for h in body["holders"]) and body["chosen"] == worker:
                return True
            return NotYet(f"edge-us would choose {body['chosen']}; holders {body['holders']}; "
                          f"best candidates {body['candidates'][:3]}")
        return check

    # Three requests from the US: no US worker holds the document and eu-0's match is worth the
    # round trip, so each goes abroad and is a local miss of the same family.
    for question in (" one", " two", " three"):
        await eventually(edge_us_would_choose("eu-0", shared + question))
        meta = (await generate(dep, "us", shared + question))["meta_info"]
        assert meta["kvcompass"]["worker"] == "eu-0" and meta["cached_tokens"] >= 3900

    body = await admin(dep, "edge-us", "migrations")
    hot = {(h["trigger"], h["outcome"]): h["misses"] for h in body["hot_prefix_misses"]}
    assert hot[("recompute", "planned")] == 1 and hot[("recompute", "no_idle_worker")] == 0, body
    [record] = body["migrations"]
    assert record["source"] == "eu-0" and record["destination"] in ("us-0", "us-1")
    # The triggering prompt, all of it: the index saw eu-0's match only up to its longest level.
    assert record["mode"] == "recompute" and record["sent"] and record["prefix_len"] > 4000
    replica = record["destination"]

    # The destination's agent recomputes the prefix on its engine; its registration reaches the
    # shards and the US edge's view like any other.
    async def executed():
        done = (await admin(dep, replica, "status"))["migrations"]
        return done and done[-1]["ok"] and done[-1]["source"] == "eu-0"

    await eventually(executed)
    await eventually(edge_us_would_choose(replica, shared + " four"))
    meta = (await generate(dep, "us", shared + " four"))["meta_info"]
    assert meta["kvcompass"]["worker"] == replica and meta["kvcompass"]["region"] == "us"
    # It reuses the whole document there (the emulated engine caches whole blocks).
    assert meta["cached_tokens"] == (len(shared + " ") // SPEC.block_size) * SPEC.block_size

