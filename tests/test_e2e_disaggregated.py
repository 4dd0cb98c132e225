"""A prefill-decode disaggregated fleet end to end, with real daemons on loopback: the edges
play SGLang's prefill-decode router (the score picks the prefill worker, a decode worker of the
prefill's region streams the answer), emulated workers in both roles hand the KV over by
bootstrap room, only prefill workers are indexed, and a conversation's next turn finds its
prompt + answer on the prefill worker that computed it.

us: 2 prefill + 1 decode, eu: 1 prefill + 1 decode; one deployment for the module.
"""

from __future__ import annotations

import re

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(workers={"us": 3, "eu": 2}, decode_workers={"us": 1, "eu": 1},
                      one_way_ms={("us", "eu"): 10.0}, shards=2, prefill_ms_per_token=0.05, decode_ms_per_token=1.0,
                      fingerprint_bits=16)
BLOCK = SPEC.block_size
PREFILL = {"us": ("us-p0", "us-p1"), "eu": ("eu-p0",)}
DECODE = {"us": "us-d0", "eu": "eu-d0"}


def aligned(n: int) -> int:
    return n // BLOCK * BLOCK


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    async with LocalDeployment(SPEC, tmp_path_factory.mktemp("e2e-pd"), time_scale=1.0) as d:
        yield d


async def holder_visible(dep, edge: str, text: str, worker: str):
    async def check():
        body = await admin(dep, edge, "holders", {"text": text})
        return body if any(h["worker"] == worker for h in body["holders"]) else None

    return await eventually(check)


async def test_the_deployment_is_disaggregated_as_specified():
    cfg = LocalDeployment(SPEC).cfg
    assert {w.id: w.role for w in cfg.workers} == {"us-p0": "prefill", "us-p1": "prefill", "us-d0": "decode",
                                                   "eu-p0": "prefill", "eu-d0": "decode"}
    assert all(w.bootstrap_port for w in cfg.workers if w.role == "prefill")
    assert all(w.kv_events is None for w in cfg.workers if w.role == "decode")


async def test_a_shared_document_is_prefilled_once_then_reused_and_the_next_turn_finds_prompt_and_answer(dep):
    shared = doc(10, 1200)
    first = await generate(dep, "us", shared + " first question", max_new_tokens=24)
    meta = first["meta_info"]
    holder = meta["kvcompass"]["worker"]
    assert holder in PREFILL["us"] and meta["kvcompass"]["decode_worker"] == DECODE["us"]
    assert meta["cached_tokens"] == 0 and meta["completion_tokens"] == 24 and len(first["text"]) == 24

    await holder_visible(dep, "edge-us", shared + " second question", holder)
    second = (await generate(dep, "us", shared + " second question"))["meta_info"]
    assert second["kvcompass"]["worker"] == holder and second["kvcompass"]["decode_worker"] == DECODE["us"]
    assert second["cached_tokens"] == aligned(len(shared) + 1)  # the document, prefilled once

    # The next turn carries the first answer; prefilling it puts prompt + answer in the holder's
    # cache and the index, where the turn after finds it.
    turn2 = shared + " first question" + first["text"] + " and then?"
    answer2 = await generate(dep, "us", turn2, max_new_tokens=8)
    assert answer2["meta_info"]["kvcompass"]["worker"] == holder
    assert answer2["meta_info"]["cached_tokens"] == aligned(len(shared + " first question"))
    turn3 = turn2 + answer2["text"] + " thanks"
    await holder_visible(dep, "edge-us", turn3, holder)
    third = (await generate(dep, "us", turn3))["meta_info"]
    assert third["kvcompass"]["worker"] == holder and third["kvcompass"]["decode_worker"] == DECODE["us"]
    assert third["cached_tokens"] == aligned(len(turn2)) > len(shared + " first question" + first["text"])


async def test_another_regions_holder_prefills_and_its_regions_decode_worker_decodes(dep):
    shared = doc(20, 4000)
    first = (await generate(dep, "eu", shared + " one"))["meta_info"]
    assert (first["kvcompass"]["worker"], first["kvcompass"]["decode_worker"]) == ("eu-p0", "eu-d0")
    await holder_visible(dep, "edge-us", shared + " two", "eu-p0")

    async def holder_idle_as_seen_from_us():
        queues = {q["worker"]: q["queue_ms"] for q in (await admin(dep, "edge-us", "queues"))["workers"]}
        return queues["eu-p0"] == 0.0

    await eventually(holder_idle_as_seen_from_us)
    # From us: 4000 reusable tokens (200 ms of prefill) beat the 20 ms round trip, so the score
    # sends the prefill to eu-p0 through its agent, and the decode stays in eu with the KV.
    meta = (await generate(dep, "us", shared + " two"))["meta_info"]
    assert (meta["kvcompass"]["worker"], meta["kvcompass"]["region"]) == ("eu-p0", "eu")
    assert meta["kvcompass"]["decode_worker"] == "eu-d0"
    assert meta["cached_tokens"] >= 3900


async def test_decode_workers_are_never_indexed_and_the_edge_counts_where_decode_ran(dep):
    text = doc(30, 900)
    for i in range(3):
        await generate(dep, "us", text + f" q{i}")

    async def holders():  # the prefill workers' registrations reach the edge's view asynchronously
        return (await admin(dep, "edge-us", "holders", {"text": text + " q9"}))["holders"]

    await eventually(holders, timeout=30)
    assert all(h["worker"] not in DECODE.values() for h in await holders())
    decode_state = (await admin(dep, "edge-us", "status"))["decode"]
    assert decode_state["policy"] == "least_loaded" and decode_state["workers"]["us-d0"]["chosen"] >= 3
    for decode in DECODE.values():
        status = await admin(dep, decode, "status")
        assert status["registered_keys"] == 0 and status["engine_batches"] == 0 and status["blocks"] == 0
    async with aiohttp.ClientSession() as s:
        async with s.get(dep.edge_url("us") + "/metrics") as r:
            metrics = await r.text()
        async with s.get(dep.cfg.worker("us-d0").http + "/metrics") as r:
            decoded = await r.text()
        async with s.get(dep.cfg.worker("us-d0").http + "/server_info") as r:
            info = await r.json()
    choices = {m[0]: float(m[1]) for m in re.findall(r'kvcompass_decode_choices_total\{worker="([^"]+)"\} (\S+)', metrics)}
    assert choices.get("us-d0", 0) >= 3
    served = re.search(r'sglang:num_requests_total\{model_name="[^"]+"\} (\S+)', decoded)
    assert served and float(served.group(1)) >= 3
    assert info["disaggregation_mode"] == "decode" and info["kv_events_config"] is None


async def test_last_a_region_whose_decode_worker_died_has_its_requests_served_by_another_regions_pair(dep):
    dep.kill("emulate-worker", "us-d0")  # the last test of the module: us has no decode worker left
    meta = (await generate(dep, "us", doc(50, 600) + " after the failure"))["meta_info"]
    assert (meta["kvcompass"]["worker"], meta["kvcompass"]["decode_worker"]) == ("eu-p0", "eu-d0")
    assert meta["kvcompass"]["attempts"] >= 2
