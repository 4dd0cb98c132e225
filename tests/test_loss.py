"""Update loss and delay on a real deployment: every cross-region packet goes through a WAN
relay that drops 15 % of them and delays the rest by 120 ms (+-20 % jitter).

What the paper's "update loss" means for us
-------------------------------------------
The paper's prototype pushes update batches over an unreliable channel and never retransmits
them (§5.7): a lost batch leaves stale entries until later reports overwrite them. kvcompassd
sends batches on the edge's ordered QUIC control stream, which retransmits: *packet* loss on
the WAN becomes delay (and, with enough of it, a dead connection), never a missing batch on a
live connection. A batch is lost to an edge only when its connection to the maintenance unit
dies (unit or edge restart, idle timeout under heavy loss) or when the edge refuses a batch;
the next batch's seq (or the unit's position heartbeat of an idle stream, or the
re-subscription's (epoch, seq)) then shows the gap and the unit
repairs it by replay from its bounded log or by a snapshot. So the tests here check (1) that
with real packet loss and delay every edge still converges to the shards' exact state and
requests are served, and (2) that the gap repair works end to end against the real unit: a
probe edge holding a real ``EdgeIndexView`` and the edge's own sync protocol (``EdgeSync``),
reached through the lossy relay, deliberately drops batches and must still converge by asking
for resyncs. The sans-IO protocol itself is tested in tests/test_sync.py. Hit rate and P99 TTFT under loss are measured by
``tools/soak.py --loss 0.15 --one-way-ms 120`` (figures, not assertions: tests never time).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from e2e_helpers import admin, assert_views_converged, doc, eventually
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.sync import SNAPSHOT_MESSAGES, EdgeSync
from kvcompassd.core.layout import IndexLayout
from kvcompassd.daemon import tls_files
from kvcompassd.launcher import DeploymentSpec, LocalDeployment
from kvcompassd.transport import QuicNode, TransportOptions
from kvcompassd.transport.base import HandshakeFailed
from kvcompassd.wire import (
    ErrorReported,
    NodeIdentity,
    Role,
    ShardPositionAnnounced,
    SnapshotChunkSent,
    UpdateBatchPublished,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOSS, JITTER, ONE_WAY_MS = 0.15, 0.2, 120.0
# Two edges per region: the probe edge speaks as a configured edge (the far region's second, stopped
# first), since a unit serves only the edges its config names, each its region's stream. No relay
# inside a region: every edge takes its batches from the unit, over the lossy WAN under test.
SPEC = DeploymentSpec(workers={"us": 2, "eu": 2}, one_way_ms={("us", "eu"): ONE_WAY_MS}, shards=2,
                      edges_per_region=2, sync={"relay": False}, prefill_ms_per_token=0.02,
                      decode_ms_per_token=1.0)
CONVERGE_S = 90.0  # generous: a connection may die under loss and need its resync


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("loss"), time_scale=1.0, jitter=JITTER, loss=LOSS)
    async with d:
        yield d


async def _generate(session, url: str, text: str) -> dict:
    async with session.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_requests_served_and_every_edge_converges_under_loss_and_delay(dep):
    # Documents first read in one region, then asked about from the other: cross-region
    # reuse needs the remote edge's view, which only the lossy WAN brings.
    served = cached = prompt = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for round_ in range(3):
            jobs = []
            for d in range(6):
                home, away = ("us", "eu") if d % 2 == 0 else ("eu", "us")
                region = home if round_ == 0 else away
                jobs.append(_generate(session, dep.edge_url(region), doc(8000 + d, 1200) + f" q{round_}"))
            for meta in (r["meta_info"] for r in await asyncio.gather(*jobs)):
                served += 1
                cached += meta["cached_tokens"]
                prompt += meta["prompt_tokens"]
    assert served == 18
    await assert_views_converged(dep, timeout=CONVERGE_S)
    print(f"\n{LOSS:.0%} loss, {ONE_WAY_MS:.0f} ms one way: {served} requests served, "
          f"hit rate {cached / prompt:.1%}; every edge's views equal the shards' exact state")


class ProbeEdge:
    """An edge of our own that keeps a real EdgeIndexView of one shard, fed over the lossy
    relay and followed by the edge's sync protocol; it drops batches on purpose while
    ``dropping``, and the protocol repairs the gaps."""

    def __init__(self, dep, shard: int, name: str):
        self.dep, self.shard, self.name = dep, shard, name
        dep.kill("edge", name)
        self.view = EdgeIndexView(IndexLayout.from_config(dep.cfg), dep.cfg.shards, edge=name)
        self.sync = EdgeSync(self.view)
        self.dropping = False
        self.dropped = self.applied = self.resyncs = self.snapshots = self.announcements = 0
        self.errors: list[ErrorReported] = []
        self.node = QuicNode(NodeIdentity(Role.EDGE, name), tls_files(dep.tls_dir, name),
                             on_message=self._on_message, options=TransportOptions(idle_timeout=10.0))

    async def connect(self, unit: str, from_region: str) -> None:
        region = self.dep.maintenance_region[unit]
        assert region != from_region, "the probe must reach the unit over the WAN"
        address = await self.dep.wan.address_for(from_region, unit)
        for attempt in range(3):  # the lossy WAN may eat a handshake: dial again, as an edge does
            try:
                self.peer = await self.node.connect(address, timeout=30)
                break
            except HandshakeFailed:
                if attempt == 2:
                    raise
        await self.peer.send(self.sync.subscription(self.shard, now=time.monotonic()))

    def _on_message(self, peer, message, channel) -> None:
        step = None
        if isinstance(message, SNAPSHOT_MESSAGES):  # whole, or a transfer's header or chunk
            self.snapshots += not isinstance(message, SnapshotChunkSent)
            step = self.sync.on_snapshot_message(message, now=time.monotonic())
        elif isinstance(message, UpdateBatchPublished):
            epoch, seq = self.view.position(self.shard)
            if self.dropping and message.seq % 3 == 0 and message.seq > seq:
                self.dropped += 1  # as if the network had eaten it
                return
            step = self.sync.on_batch(message, now=time.monotonic())
            self.applied += step.applied
        elif isinstance(message, ShardPositionAnnounced):  # the unit's heartbeat of an idle stream
            self.announcements += 1
            step = self.sync.on_position(message, now=time.monotonic())
        elif isinstance(message, ErrorReported):
            self.errors.append(message)
        # A request is sent when a batch, snapshot or position shows a gap, or (``tick``) when one
        # outstanding was not answered in time.
        if step is not None and step.send is not None:
            self._request(step.send)

    def _request(self, request) -> None:
        self.resyncs += 1
        self.peer.send_encoded(_encode(request))

    def tick(self) -> None:
        """The sync timer, as the edge daemon arms it: this probe drops batches itself, replays
        included, so an answered request can still leave a gap only the timeout repairs."""
        for request in self.sync.on_timer(now=time.monotonic()):
            self._request(request)

    def values(self, group: int, keys: list[int]) -> list[int]:
        view = self.view.view(self.shard, group)
        if view is None:
            return [0] * len(keys)
        return view.lookup_many(np.array(keys, dtype=np.uint64)).tolist()


def _encode(message) -> bytes:
    from kvcompassd.wire import encode

    return encode(message)


async def test_edge_that_loses_batches_detects_the_gaps_and_repairs_them_over_the_lossy_wan(dep):
    unit = dep.cfg.maintenance[0]
    far = next(r for r in dep.cfg.region_names() if r != dep.maintenance_region[unit.id])
    probe = ProbeEdge(dep, unit.shard, f"edge-{far}-1")
    home = next(w for w in dep.cfg.workers if w.region == far)
    try:
        await probe.connect(unit.id, far)
        await eventually(lambda: _ready(probe), timeout=CONVERGE_S)
        probe.dropping = True
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            sent = 0

            async def dropped_some() -> bool:
                # The probe drops only batches whose seq is a multiple of 3, and a busy agent folds
                # several requests into one report: keep making batches until one is dropped. On a
                # worker of the probe's region: its stream carries every length of that region's
                # group (a request an edge sends to the other region may send it nothing).
                nonlocal sent
                if probe.dropped:
                    return True
                await _generate(session, home.http, doc(9000 + sent, 900))
                sent += 1
                return False

            await eventually(dropped_some, timeout=CONVERGE_S, interval=0.2)
            probe.dropping = False

            async def converged() -> bool:
                probe.tick()
                state = await admin(dep, unit.id, "entries", {"edge": probe.name})
                for group, kv in state["groups"].items():
                    if probe.values(int(group), kv["keys"]) != kv["values"]:
                        # No further request: if the last batches were dropped, the unit's
                        # position heartbeat of the idle stream shows the gap.
                        return False
                return probe.view.position(unit.shard) == (state["epoch"], state["seq"])

            await eventually(converged, timeout=CONVERGE_S, interval=0.5)
        assert probe.dropped > 0 and probe.resyncs > 0, (probe.dropped, probe.resyncs)
        assert probe.errors == []
        print(f"\nprobe edge over the lossy WAN: dropped {probe.dropped} batches on purpose, "
              f"{probe.resyncs} resyncs, {probe.snapshots} snapshots, {probe.announcements} position "
              f"announcements; view equals the shard's exact state")
    finally:
        await probe.node.close()


async def _ready(probe: ProbeEdge) -> bool:
    return probe.view.state[probe.shard].ready
