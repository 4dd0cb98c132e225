"""``edge --workers 2`` in front of a prefill-decode fleet, with real daemons on loopback: both
front-door processes pick the prefill worker by the score over the shared views and a decode
worker of its region, own region over HTTP to both engines, another region through the prefill
worker's agent; a registered document goes to its holder from either process alike.

us: 2 prefill + 1 decode, eu: 1 prefill + 1 decode (as tests/test_e2e_disaggregated.py).
"""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import admin, doc, eventually, generate, session_per_process
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(workers={"us": 3, "eu": 2}, decode_workers={"us": 1, "eu": 1},
                      one_way_ms={("us", "eu"): 10.0}, shards=2, prefill_ms_per_token=0.05, decode_ms_per_token=1.0,
                      fingerprint_bits=16)
PREFILL = {"us": ("us-p0", "us-p1"), "eu": ("eu-p0",)}
DECODE = {"us": "us-d0", "eu": "eu-d0"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    async with LocalDeployment(SPEC, tmp_path_factory.mktemp("edge-workers-pd"), time_scale=1.0,
                               node_args={"edge:edge-us": ("--workers", "2")}) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def doors(dep):
    """One keep-alive connection to each process of edge-us: {front door pid or 0: session}."""
    found = await session_per_process(dep, "us")
    yield found
    for s in found.values():
        await s.close()


async def _generate(dep, session: aiohttp.ClientSession, text: str) -> dict:
    async with session.post(dep.edge_url("us") + "/generate",
                            json={"text": text, "sampling_params": {"max_new_tokens": 4}}) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert len(body["output_ids"]) == 4  # the decode worker streamed the answer
    return body["meta_info"]["kvcompass"]


async def _registered(dep, text: str, worker: str) -> None:
    """Until the shared view itself shows the worker's registration (not process 0's ledger)."""
    async def check():
        body = await admin(dep, "edge-us", "holders", {"text": text})
        return (any(h["worker"] == worker for h in body["holders"])
                and not any(p["worker"] == worker for p in body["pending"]))

    await eventually(check)


async def test_every_front_door_serves_prefill_decode_pairs(dep, doors):
    # Seeds 200, 201, ...: none may be a later test's "fresh" document (its prefix would be cached).
    for i, session in enumerate(doors.values()):
        got = await _generate(dep, session, doc(200 + i, 400))
        assert got["worker"] in PREFILL["us"] and got["decode_worker"] == DECODE["us"]


async def test_front_doors_send_a_registered_document_to_its_prefill_holder_alike(dep, doors):
    shared = doc(210, 1200)
    holder = (await _generate(dep, doors[0], shared + " first"))["worker"]
    await _registered(dep, shared + " second", holder)
    decisions = {}
    for key, session in doors.items():
        got = [await _generate(dep, session, shared + f" question {i}") for i in range(3)]
        decisions[key] = [(d["worker"], d["decode_worker"], d["claimed_tokens"]) for d in got]
    assert all(w == holder and d == DECODE["us"] and claimed > 0 for w, d, claimed in decisions[0])
    (other,) = (k for k in doors if k)
    assert decisions[other] == decisions[0]


async def test_a_front_door_runs_a_remote_pair_through_the_prefill_workers_agent(dep, doors):
    shared = doc(220, 4000)
    first = (await generate(dep, "eu", shared + " one"))["meta_info"]["kvcompass"]
    assert first["worker"] == "eu-p0" and first["decode_worker"] == DECODE["eu"]
    await _registered(dep, shared + " two", "eu-p0")
    for session in doors.values():
        got = await _generate(dep, session, shared + " two")
        assert got["worker"] == "eu-p0" and got["decode_worker"] == DECODE["eu"] and got["claimed_tokens"] > 0
