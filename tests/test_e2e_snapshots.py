"""A shard's snapshot in chunks, end to end: a real maintenance unit holding a shard of 300,000
entries (many chunks' worth) bootstraps a new edge process over QUIC while the shard keeps
changing, and the edge's view ends byte-identical to the shard. The 10^7-entry run is
``tools/bench_snapshot.py`` (too heavy for the suite)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import pytest_asyncio

from e2e_helpers import admin, eventually
from kvcompassd.core.events import EventOp, IndexEventColumns
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.snapshots import SnapshotAssembly
from kvcompassd.daemon import split_address, tls_files
from kvcompassd.launcher import DeploymentSpec, LocalDeployment
from kvcompassd.transport import QuicNode
from kvcompassd.wire import (
    ErrorReported,
    NodeIdentity,
    PrefixEventsReported,
    Role,
    SnapshotChunkSent,
    SnapshotResumeRequested,
    SnapshotTransferStarted,
    UpdatesSubscribed,
    WorkerRegistered,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A second edge: the probe below speaks with its certificate (a unit serves only the edges its
# config names) once that edge is stopped.
SPEC = DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=1, wan=False,
                      prefill_ms_per_token=0.02, decode_ms_per_token=1.0, edges_per_region=2)
ENTRIES = 300_000
WRITER = "us-1"  # its agent is stopped; the test writes the worker's fields with its certificate


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("snapshots"), time_scale=1.0)
    async with d:
        yield d


class ShardWriter:
    """Reports registrations for one worker straight to the shard's unit, as its agent would
    (the agent's own path from engine events is tested elsewhere; here only volume matters)."""

    def __init__(self, dep):
        self.errors: list[ErrorReported] = []
        self.node = QuicNode(NodeIdentity(Role.AGENT, WRITER), tls_files(dep.tls_dir, WRITER),
                             on_message=lambda peer, msg, ch: self.errors.append(msg))
        self.address = split_address(dep.cfg.maintenance[0].quic, "mnt-0")
        self.seq = 0

    async def __aenter__(self):
        self.peer = await self.node.connect(self.address, expected_role=Role.MAINTENANCE, timeout=30)
        await self.peer.send(WorkerRegistered(WRITER, 1 << 62))
        return self

    async def register(self, keys: np.ndarray) -> None:
        for part in np.array_split(keys, max(1, -(-len(keys) // 200_000))):
            self.seq += 1
            columns = IndexEventColumns(bytes([EventOp.CACHED_VRAM]) * len(part), part.astype("<u8").tobytes())
            await self.peer.send(PrefixEventsReported(WRITER, self.seq, columns))

    async def __aexit__(self, *exc):
        await self.node.close()


KEYS = np.unique(np.random.default_rng(30).integers(1, 1 << 62, ENTRIES + 1000, dtype=np.uint64))[:ENTRIES]


async def _fill(dep, writer: ShardWriter, keys: np.ndarray) -> None:
    await writer.register(keys)

    async def filled():
        return (await admin(dep, "mnt-0", "status"))["entries"] >= len(keys)

    await eventually(filled, timeout=60)


async def _view_equals_shard(dep, edge: str) -> bool:
    shard = await admin(dep, "mnt-0", "digest", {"edge": edge})  # the stream that edge follows
    view = await admin(dep, edge, "digest", {"shard": 0})
    return view["position"] == shard["position"] and view["groups"] == shard["groups"]


def _log(dep, mode: str, node: str, event: str) -> list[dict]:
    out = []
    for line in dep.node(mode, node).log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


async def test_a_shard_of_many_chunks_bootstraps_a_new_edge_while_it_keeps_changing(dep):
    dep.kill("agent", WRITER)
    keys = KEYS
    async with ShardWriter(dep) as writer:
        await _fill(dep, writer, keys[: ENTRIES - 20_000])
        dep.restart("edge", "edge-us")  # a new edge process: no view, bootstraps from the unit
        # The shard keeps changing while the edge bootstraps; nothing published meanwhile is lost.
        await writer.register(keys[ENTRIES - 20_000:])
        await eventually(lambda: _view_equals_shard(dep, "edge-us"), timeout=90, interval=0.5)
        assert writer.errors == []
    status = await admin(dep, "mnt-0", "status")
    assert status["entries"] >= ENTRIES
    # The log file spans both lives of edge-us; the new one's transfer is the filled shard's.
    transfers = [r for r in _log(dep, "edge", "edge-us", "snapshot transfer")
                 if r.get("accepted") and r["entries"] >= ENTRIES - 20_000]
    assert transfers, _log(dep, "edge", "edge-us", "snapshot transfer")
    transfer = transfers[0]
    assert transfer["chunks"] > 1, transfer
    installed = [r for r in _log(dep, "edge", "edge-us", "snapshot chunk")
                 if r.get("installed") and r["snapshot_id"] == transfer["snapshot_id"]]
    assert [r["index"] for r in installed] == [transfer["chunks"] - 1]
    assert status["stats"]["snapshot_chunks_sent"] >= transfer["chunks"]
    print(f"\n{status['entries']} entries: snapshot of {transfer['bytes']} bytes in {transfer['chunks']} chunks; "
          f"the new edge's view equals the shard")


class SnapshotProbe:
    """An edge of our own on the unit's control channel: collects what the unit sends. It
    speaks as the deployment's second edge (stopped first)."""

    NAME = "edge-us-1"

    def __init__(self, dep):
        dep.kill("edge", self.NAME)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.node = QuicNode(NodeIdentity(Role.EDGE, self.NAME), tls_files(dep.tls_dir, self.NAME),
                             on_message=lambda peer, msg, ch: self.inbox.put_nowait(msg))
        self.address = split_address(dep.cfg.maintenance[0].quic, "mnt-0")

    async def __aenter__(self):
        self.peer = await self.node.connect(self.address, expected_role=Role.MAINTENANCE, timeout=30)
        return self

    async def __aexit__(self, *exc):
        await self.node.close()

    async def next(self, kind: type):
        """The next message of ``kind`` (update batches and the like are skipped)."""
        async with asyncio.timeout(30):
            while True:
                message = await self.inbox.get()
                assert not isinstance(message, ErrorReported), message
                if isinstance(message, kind):
                    return message

    async def chunks(self, n: int) -> list[SnapshotChunkSent]:
        return [await self.next(SnapshotChunkSent) for _ in range(n)]


async def test_a_unit_resumes_a_snapshot_from_any_chunk_and_restarts_one_it_no_longer_keeps(dep):
    if (await admin(dep, "mnt-0", "status"))["entries"] < ENTRIES:  # run alone: fill the shard here
        dep.kill("agent", WRITER)
        async with ShardWriter(dep) as writer:
            await _fill(dep, writer, KEYS)
    async with SnapshotProbe(dep) as probe:
        await probe.peer.send(UpdatesSubscribed(probe.NAME, 0, 0, -1))
        header = await probe.next(SnapshotTransferStarted)
        assert header.chunks >= 3, header
        whole = await probe.chunks(header.chunks)
        # The stream "broke" after chunk 1: the same snapshot again from chunk 2, header first.
        await probe.peer.send(SnapshotResumeRequested(probe.NAME, 0, header.snapshot_id, 2))
        assert await probe.next(SnapshotTransferStarted) == header
        assert await probe.chunks(header.chunks - 2) == whole[2:]
        # A snapshot the unit does not keep (another life's): a whole new transfer from chunk 0.
        await probe.peer.send(SnapshotResumeRequested(probe.NAME, 0, 12345, 1))
        fresh = await probe.next(SnapshotTransferStarted)
        assert fresh.snapshot_id != 12345
        assembly = SnapshotAssembly(fresh, max_entries=1 << 30, max_bytes=1 << 30)
        for chunk in await probe.chunks(fresh.chunks):
            assert assembly.add(chunk).kind == "added"
    view = EdgeIndexView(IndexLayout.from_config(dep.cfg), 1, edge=probe.NAME)
    h = assembly.header
    assert view.install_tables(0, h.epoch, h.seq, assembly.tables(), entries=h.entries).applied
    shard = await admin(dep, "mnt-0", "digest", {"edge": probe.NAME})
    assert [h.epoch, h.seq] == shard["position"]
    assert {str(g): crc for g, crc in view.digests(0).items()} == shard["groups"]
    assert (await admin(dep, "mnt-0", "status"))["stats"]["snapshots_resumed"] >= 1
