"""The maintenance unit's update batches (kvcompassd.maintenance): what an agent's reports
applied within ``[sync] batch_delay_ms`` of the window's first edit goes out as one batch per
stream, and a lone report's edits go within the window. The unit is driven through its message
handlers, as its QUIC connections would; what it publishes is recorded instead of sent."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcompassd import certs
from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier
from kvcompassd.daemon import tls_files
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.maintenance import MaintenanceNode
from kvcompassd.wire import NodeIdentity, PrefixEventsReported, Role, WorkerRegistered

WINDOW_MS = 50.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, wan=False))
    cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, batch_delay_ms=WINDOW_MS))
    unit = cfg.maintenance[0]
    tmp = tmp_path_factory.mktemp("maintenance-tls")
    certs.init_ca(Path(tmp), cluster_name=cfg.name)
    certs.issue(Path(tmp), Path(tmp), role=Role.MAINTENANCE, node_id=unit.id)
    return cfg, unit, tls_files(str(tmp), unit.id)


async def test_reports_within_the_batch_window_are_published_as_one_batch(cluster):
    cfg, unit, tls = cluster
    node = MaintenanceNode(cfg, unit, tls, epoch=1)
    loop = asyncio.get_running_loop()
    published = []  # (loop time, {stream: batch})
    node._publish = lambda batches: published.append((loop.time(), batches))
    worker = cfg.workers[0].id
    agent = SimpleNamespace(identity=NodeIdentity(Role.AGENT, worker))
    node._worker_registered(agent, WorkerRegistered(worker, 1), None)
    seqs = iter(range(1, 100))

    def report(*keys: int) -> None:
        columns = IndexEventColumns.from_events([PrefixCached(worker, k, Tier.VRAM) for k in keys], [64] * len(keys))
        node._events_reported(agent, PrefixEventsReported(worker, next(seqs), columns), None)

    def shard_keys(n: int, first: int) -> list[int]:  # keys this unit's shard owns
        return [k for k in range(first, first + n * cfg.shards * 4) if k % cfg.shards == unit.shard][:n]

    try:
        began = loop.time()
        for key in shard_keys(3, 1000):
            report(key)
        assert node.stats.events_applied == 3 and published == []
        await asyncio.sleep(0.2)  # due after the window's timer, so it runs after it
        assert len(published) == 1 and published[0][0] >= began + WINDOW_MS / 1000 - 1e-3
        full = published[0][1][None]
        assert full.seq == 1  # one batch of the full stream carries the three reports' edits
        lone_at = loop.time()
        report(*shard_keys(1, 5000))
        assert len(published) == 1
        await asyncio.sleep(0.2)
        assert len(published) == 2 and published[1][1][None].seq == 2
        assert published[1][0] >= lone_at + WINDOW_MS / 1000 - 1e-3
    finally:
        node._batches.cancel()
        await node.node.close()


def test_the_batch_window_comes_from_the_config_unless_given(cluster):
    cfg, unit, tls = cluster
    assert MaintenanceNode(cfg, unit, tls, epoch=1)._batches.delay_s == WINDOW_MS / 1000
    assert MaintenanceNode(cfg, unit, tls, epoch=1, batch_delay_s=0.0)._batches.delay_s == 0.0
