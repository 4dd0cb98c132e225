"""Faults on a real deployment: processes killed under load, workers dying mid-request.

No user request may fail, and the index must come back to the exact state.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import admin, assert_views_converged, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Two edges per region: an edge copies its views only from a peer that follows the same update
# stream, i.e. an edge of its own region (edge-eu, the region's relay, and edge-eu-1).
SPEC = DeploymentSpec(workers={"us": 2, "eu": 2}, one_way_ms={("us", "eu"): 5.0}, shards=2, edges_per_region=2,
                      prefill_ms_per_token=0.02, decode_ms_per_token=1.0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("faults"), time_scale=1.0)
    async with d:
        yield d


class Load:
    """Requests in a closed loop through the given edges until stopped; counts every outcome."""

    def __init__(self, dep, regions, concurrency=4, seed=0):
        self.dep, self.regions, self.concurrency, self.seed = dep, regions, concurrency, seed
        self.ok = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()

    async def _client(self, session, k):
        i = 0
        while not self._stop.is_set():
            region = self.regions[(k + i) % len(self.regions)]
            text = doc(self.seed + (i % 5), 600) + f" q{k}-{i}"
            i += 1
            try:
                async with session.post(self.dep.edge_url(region) + "/generate",
                                        json={"text": text, "sampling_params": {"max_new_tokens": 2}}) as r:
                    if r.status == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{region}: HTTP {r.status} {(await r.text())[:200]}")
            except aiohttp.ClientError as exc:
                self.failed.append(f"{region}: {exc!r}")

    async def __aenter__(self):
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._client(self._session, k)) for k in range(self.concurrency)]
        await asyncio.sleep(0.3)
        return self

    async def __aexit__(self, *exc):
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._session.close()


async def test_maintenance_unit_killed_under_load_and_restarted(dep):
    async with Load(dep, ["us", "eu"], seed=100) as load:
        dep.kill("maintenance", "mnt-0")
        await asyncio.sleep(1.0)
        dep.restart("maintenance", "mnt-0")
        restarted = time.monotonic()
        await asyncio.sleep(1.0)
    assert load.failed == [] and load.ok > 0
    # The new unit starts an empty epoch; agents notice the old connection died (QUIC idle
    # timeout, a SIGKILLed peer sends no close) and re-register what their engines hold.
    async def rebuilt():
        state = await admin(dep, "mnt-0", "status")
        return set(state["workers"]) == {w.id for w in dep.cfg.workers} and state["entries"] > 0

    await eventually(rebuilt, timeout=30)
    for i in range(6):  # new caches after the re-registration reach both units
        await generate(dep, ["us", "eu"][i % 2], doc(150 + i, 700))
    await assert_views_converged(dep, timeout=30)
    # The other unit kept accepting every agent's reports across mnt-0's restart (an agent once
    # restarted its report counter there, and mnt-1 dropped the reports as replays).
    other = await admin(dep, "mnt-1", "status")
    assert other["stats"]["stale_reports"] == 0
    print(f"\nmaintenance SIGKILL+restart: shard rebuilt and every edge converged "
          f"{time.monotonic() - restarted:.2f} s after restart; {load.ok} requests served, 0 failed")


async def test_edge_killed_while_others_serve_then_bootstraps(dep):
    async with Load(dep, ["us"], seed=200) as load:
        dep.kill("edge", "edge-eu")
        await asyncio.sleep(1.0)
    assert load.failed == [] and load.ok > 0
    # It comes back by copying its region peer's views (which took over the relay meanwhile),
    # then catches up from the maintenance units.
    node = dep.node("edge", "edge-eu")
    node.argv += ["--copy-view-from", "edge-eu-1"]
    dep.restart("edge", "edge-eu")
    await dep.wait_ready(60)
    await assert_views_converged(dep, edges=dep.cfg.edges_in("eu"), timeout=30)
    assert "copied shard from peer edge" in node.log_path.read_text()


async def test_dead_worker_is_retried_before_first_token_then_withdrawn_and_returns(dep):
    shared = doc(300, 800)
    first = (await generate(dep, "us", shared + " a"))["meta_info"]["kvcompass"]["worker"]

    async def listed():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " b"})
        return any(h["worker"] == first for h in body["holders"])

    await eventually(listed)
    dep.kill("emulate-worker", first)
    # The index still names the dead worker: the edge must fail over before the first token.
    meta = (await generate(dep, "us", shared + " c"))["meta_info"]
    assert meta["kvcompass"]["worker"] != first
    # Within a bounded time the agent notices and the dead worker's prefixes leave the index.
    await eventually(lambda: _not(listed), timeout=10)
    dep.restart("emulate-worker", first)
    await dep.wait_ready(60)
    # Back: its new caches are registered again.
    async with aiohttp.ClientSession() as s:
        async with s.post(dep.cfg.worker(first).http + "/generate",
                          json={"text": shared + " d", "sampling_params": {"max_new_tokens": 1}}) as r:
            assert r.status == 200
    await eventually(listed, timeout=15)


async def _not(check):
    return not await check()


async def test_an_idle_plane_goes_quiet_then_serves_and_converges_when_busy(dep):
    """Idle, unchanged loads and queue vectors travel only as [idle] heartbeats (1 s): eu's
    estimates of the us workers age well past the broadcast period (at 100 ms they never
    did). Work arriving then is served in both regions and the index converges as before."""
    period_s = dep.cfg.score.broadcast_period_ms / 1000.0

    async def quiet():
        body = await admin(dep, "edge-eu", "queues")
        ages = [w["age_s"] for w in body["workers"] if w["region"] == "us"]
        return all(age is not None and age > 3.5 * period_s for age in ages)

    await eventually(quiet, timeout=30)
    for i in range(6):
        reply = await generate(dep, ["us", "eu"][i % 2], doc(400 + i, 700))
        assert reply["meta_info"]["kvcompass"]["worker"]
    await assert_views_converged(dep, timeout=30)
