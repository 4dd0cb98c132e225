"""Security and bad input against real daemon processes (one deployment for the module).

A probe node of our own (a QuicNode with ``check_outgoing_roles=False``, so it can send what
its role may not) connects straight to the daemons' QUIC addresses and checks that:

- a certificate from another CA is refused by an edge, a maintenance unit and an agent;
- a certificate's role limits what it may send (an edge cannot write the index, an agent
  cannot write another worker's fields), with ErrorReported to the sender, no state change,
  and the connection still usable for what the role may do;
- malformed frames, unknown workers, stale or replayed report seqs and events for prefixes
  never stored are refused with a clear error and change nothing;
- a maintenance unit's certificate may write only its own shard's views at an edge, and an
  edge's certificate may speak only for its own region's queues: the rest is refused, logged
  with the sender's identity and counted, and the connection's other traffic carries on.

Every "no state change" check compares a maintenance unit's exact state (``entries``: every
(key, value) of every region group, plus its seq) before and after, once the unit is quiet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import msgpack
import pytest
import pytest_asyncio

from e2e_helpers import NotYet, admin, assert_views_converged, doc, eventually
from kvcompassd import certs
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.core.snapshots import SnapshotAssembly, SnapshotChunker
from kvcompassd.daemon import split_address, tls_files
from kvcompassd.launcher import DeploymentSpec, LocalDeployment
from kvcompassd.transport import PeerUnavailable, QuicNode, TransportOptions
from kvcompassd.transport.framing import HEADER, HEADER_AFTER_LENGTH
from kvcompassd.wire import (
    PROTOCOL_VERSION,
    ErrorReported,
    QueueVectorBroadcast,
    QueueVectorInterestReported,
    NodeIdentity,
    PrefixEventsReported,
    ResyncRequested,
    Role,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotTransferStarted,
    UpdateBatchPublished,
    UpdatesSubscribed,
    WorkerPinnedReported,
    WorkerRegistered,
    WorkerWithdrawn,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A second edge per region: a unit serves only the edges its config names, so the probes that
# subscribe speak as edge-us-1 (stopped at the start; it follows the us stream, as edge-us does).
SPEC = DeploymentSpec(workers={"us": 2, "eu": 1}, one_way_ms={("us", "eu"): 5.0}, shards=2,
                      prefill_ms_per_token=0.02, decode_ms_per_token=1.0, edges_per_region=2)
SUBSCRIBER = "edge-us-1"
PROBE_OPTIONS = TransportOptions(check_outgoing_roles=False, idle_timeout=10.0)
REPLY_TIMEOUT = 10.0  # hang guard only
# Keys of shard 0 (mnt-0 owns key % 2 == 0) that no engine ever produces.
KEY_A = (0x5EC0 << 40) | 2
KEY_B = (0x5EC1 << 40) | 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("security"), time_scale=1.0)
    async with d:
        d.kill("edge", SUBSCRIBER)
        yield d


class Probe:
    """Our own node: collects what it receives, sends anything (even what its role may not)."""

    def __init__(self, identity: NodeIdentity, tls: certs.TlsFiles):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.node = QuicNode(identity, tls, on_message=lambda peer, msg, ch: self.inbox.put_nowait(msg),
                             options=PROBE_OPTIONS)
        self.peer = None

    async def connect(self, address: str):
        self.peer = await self.node.connect(split_address(address, "target"), timeout=REPLY_TIMEOUT)
        return self

    async def send(self, message) -> None:
        await self.peer.send(message)

    def send_raw(self, body: bytes) -> None:
        """A message body that need not decode (framed correctly on the control channel)."""
        self.peer.send_encoded(body)

    async def next(self, kind: type):
        """The next received message of ``kind`` (others, e.g. update batches, are skipped)."""
        async with asyncio.timeout(REPLY_TIMEOUT):
            while True:
                message = await self.inbox.get()
                if isinstance(message, kind):
                    return message

    async def error(self) -> ErrorReported:
        return await self.next(ErrorReported)

    def drain(self) -> None:
        while not self.inbox.empty():
            self.inbox.get_nowait()

    async def close(self) -> None:
        await self.node.close()


async def probe(dep, node_id: str, address: str, role: Role | None = None) -> Probe:
    """A probe with the deployment's certificate for ``node_id``, issuing one if there is none."""
    path = dep.tls_dir / f"{node_id}.pem"
    if not path.exists():
        certs.issue(dep.tls_dir, dep.tls_dir, role=role, node_id=node_id)
    tls = tls_files(dep.tls_dir, node_id)
    identity = certs.peer_identity(certs.load_certificate(tls.cert))
    return await Probe(identity, tls).connect(address)


async def quiet_state(dep, unit: str) -> dict:
    """The unit's exact state once two readings 0.3 s apart agree (no report in flight)."""
    previous = None
    deadline = time.monotonic() + 30
    while True:
        state = await admin(dep, unit, "entries")
        if state == previous:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{unit} never went quiet")
        previous = state
        await asyncio.sleep(0.3)


async def unit_status(dep, unit: str) -> dict:
    return await admin(dep, unit, "status")


def mnt0_address(dep) -> str:
    return dep.cfg.maintenance[0].quic


# -- another CA ---------------------------------------------------------------------------------


async def test_peer_with_certificate_from_another_ca_is_refused_by_every_daemon(dep, tmp_path):
    rogue_dir = tmp_path / "rogue"
    certs.init_ca(rogue_dir, cluster_name="rogue")
    targets = {"edge": dep.cfg.edges[0].quic, "maintenance": mnt0_address(dep),
               "agent": dep.cfg.worker("us-0").agent}
    # The rogue claims a real node's identity and trusts the real CA (so it can verify the
    # daemon): only the daemon's check of the client chain can stop it.
    for role, node_id in ((Role.EDGE, "edge-us"), (Role.AGENT, "us-0"), (Role.ADMIN, "admin")):
        rogue = certs.issue(rogue_dir, rogue_dir, role=role, node_id=node_id)
        tls = certs.TlsFiles(ca=dep.tls_dir / "ca.pem", cert=rogue.cert, key=rogue.key)
        for kind, address in targets.items():
            node = QuicNode(NodeIdentity(role, node_id), tls, on_message=lambda *a: None, options=PROBE_OPTIONS)
            try:
                with pytest.raises(PeerUnavailable):
                    await node.connect(split_address(address, kind), timeout=REPLY_TIMEOUT)
            finally:
                await node.close()
    # Each daemon refused and kept running (and still answers a legitimate peer).
    dep._check_alive()
    assert (await unit_status(dep, "mnt-0"))["mode"] == "maintenance"
    assert (await unit_status(dep, "us-0"))["mode"] == "agent"
    assert (await unit_status(dep, "edge-us"))["ready"]


# -- roles --------------------------------------------------------------------------------------


async def test_edge_cannot_write_the_index_but_may_subscribe_on_the_same_connection(dep):
    edge = await probe(dep, SUBSCRIBER, mnt0_address(dep), Role.EDGE)
    try:
        before = await quiet_state(dep, "mnt-0")
        await edge.send(PrefixEventsReported("us-0", 1 << 40, (PrefixCached("us-0", KEY_A, Tier.VRAM),)))
        assert (await edge.error()).code == "forbidden"
        await edge.send(WorkerWithdrawn("us-0"))
        assert (await edge.error()).code == "forbidden"
        await edge.send(WorkerRegistered("us-0", 1 << 62))
        assert (await edge.error()).code == "forbidden"
        # An edge may not push batches to the unit either (a maintenance unit's message).
        await edge.send(UpdateBatchPublished(0, 1, 1, ()))
        assert (await edge.error()).code == "forbidden"
        # Nor speak for another edge.
        await edge.send(ResyncRequested("edge-us", 0, 0, 0))
        assert (await edge.error()).code == "forbidden"
        assert await quiet_state(dep, "mnt-0") == before
        assert (await admin(dep, "mnt-0", "holders", {"key": KEY_A}))["holders"] == {}
        # The same connection still does what an edge may: its stream (the us region's) comes.
        mine = await admin(dep, "mnt-0", "entries", {"edge": SUBSCRIBER})
        await edge.send(UpdatesSubscribed(SUBSCRIBER, 0, 0, -1))
        snapshot = await _received_snapshot(edge)
        assert snapshot.shard == 0 and snapshot.epoch == before["epoch"] == mine["epoch"] and snapshot.seq == mine["seq"]
    finally:
        await edge.close()


async def test_agent_cannot_write_another_workers_fields(dep):
    # Give us-1 some entries on shard 0's unit first, so there is something to protect.
    await _engine_generate(dep, "us-1", doc(7001, 900))
    await eventually(lambda: _worker_listed(dep, "mnt-0", "us-1"), timeout=20)
    agent = await probe(dep, "us-0", mnt0_address(dep))
    try:
        before = await quiet_state(dep, "mnt-0")
        status = await unit_status(dep, "mnt-0")
        events = (PrefixCached("us-1", KEY_A, Tier.VRAM),)
        await agent.send(PrefixEventsReported("us-1", 1 << 40, events))
        error = await agent.error()
        assert error.code == "forbidden" and "us-1" in error.detail
        await agent.send(WorkerWithdrawn("us-1"))
        assert (await agent.error()).code == "forbidden"
        await agent.send(WorkerRegistered("us-1", 1 << 62))
        assert (await agent.error()).code == "forbidden"
        # The same report hand-encoded (no local validation at all) meets the same refusal.
        agent.send_raw(msgpack.packb([V, 1, "us-1", 1 << 40, [b"\x00", KEY_A.to_bytes(8, "little")]], use_bin_type=True))
        assert (await agent.error()).code == "forbidden"
        assert await quiet_state(dep, "mnt-0") == before
        after = await unit_status(dep, "mnt-0")
        assert after["workers"]["us-1"] == status["workers"]["us-1"]
        assert agent.peer.is_connected
    finally:
        await agent.close()


async def test_unknown_worker_is_refused_with_a_clear_error(dep):
    stranger = await probe(dep, "zz-9", mnt0_address(dep), Role.AGENT)
    try:
        before = await quiet_state(dep, "mnt-0")
        await stranger.send(WorkerRegistered("zz-9", 1))
        error = await stranger.error()
        assert error.code == "malformed" and "unknown worker" in error.detail
        await stranger.send(PrefixEventsReported("zz-9", 1, (PrefixCached("zz-9", KEY_A, Tier.VRAM),)))
        error = await stranger.error()
        assert error.code == "malformed" and "zz-9" in error.detail
        assert await quiet_state(dep, "mnt-0") == before
        assert "zz-9" not in (await unit_status(dep, "mnt-0"))["workers"]
        assert stranger.peer.is_connected
    finally:
        await stranger.close()


V = PROTOCOL_VERSION


def _report(ops: bytes, keys: bytes) -> bytes:
    return msgpack.packb([V, 1, "us-0", 1 << 40, [ops, keys]], use_bin_type=True)


MALFORMED = {
    "not msgpack": b"\xc1\xc1",
    "empty array": msgpack.packb([]),
    "bad version": msgpack.packb([V + 1, 3, "us-0", 1]),
    "version 1 report": msgpack.packb([1, 1, "us-0", 1 << 40, [[0, KEY_A, 1]]]),
    "unknown tag": msgpack.packb([V, 99, "us-0", 1]),
    "missing field": msgpack.packb([V, 3, "us-0"]),
    "extra field": msgpack.packb([V, 3, "us-0", 1, 2]),
    "wrong type": msgpack.packb([V, 3, "us-0", "one"]),
    "negative incarnation": msgpack.packb([V, 3, "us-0", -5]),
    "events not columns": msgpack.packb([V, 1, "us-0", 1 << 40, [[0, KEY_A, 1]]]),
    "event op unknown": _report(b"\x09", KEY_A.to_bytes(8, "little")),
    "key out of range": _report(b"\x00", b"\xff" * 8),
    "keys cut short": _report(b"\x00\x00", KEY_A.to_bytes(8, "little")),
    "trailing bytes": msgpack.packb([V, 3, "us-0", 1]) + b"\x00",
}


async def test_malformed_frames_are_refused_and_the_connection_carries_on(dep):
    agent = await probe(dep, "us-0", mnt0_address(dep))
    try:
        before = await quiet_state(dep, "mnt-0")
        status = await unit_status(dep, "mnt-0")
        for name, body in MALFORMED.items():
            agent.send_raw(body)
            error = await agent.error()
            assert error.code == "malformed", (name, error)
            assert error.detail, name
        # Oversize for its message type (WorkerRegistered is bounded to 1 KiB).
        agent.send_raw(msgpack.packb([V, 3, "u" * 2000, 1]))
        error = await agent.error()
        assert error.code == "malformed" and "bound" in error.detail
        # A frame with unknown flags: the framing stays intact, only that frame is refused.
        connection = agent.peer._connection
        body = msgpack.packb([V, 3, "us-0", 1])
        connection._quic.send_stream_data(connection.control_stream(),
                                          HEADER.pack(HEADER_AFTER_LENGTH + len(body), 0, 0x80) + body)
        connection._transmit_soon()
        error = await agent.error()
        assert error.code == "malformed" and "flags" in error.detail
        assert await quiet_state(dep, "mnt-0") == before
        assert (await unit_status(dep, "mnt-0"))["workers"]["us-0"] == status["workers"]["us-0"]
        assert agent.peer.is_connected
    finally:
        await agent.close()
    # The edge's and the agent's decoders answer the same way.
    for target, node_id in ((dep.cfg.edges[0].quic, "us-0"), (dep.cfg.worker("us-0").agent, "edge-probe")):
        p = await probe(dep, node_id, target, Role.EDGE)
        try:
            for name, body in MALFORMED.items():
                p.send_raw(body)
                assert (await p.error()).code == "malformed", (target, name)
            assert p.peer.is_connected
        finally:
            await p.close()


# -- a worker whose agent is gone ---------------------------------------------------------------


async def test_gone_agents_worker_is_withdrawn_after_the_grace_period(dep):
    """The agent process dies while its engine lives on: after the maintenance units' grace
    period (3 s) plus the QUIC idle timeout (4 s), the worker's prefixes leave the index."""
    await _engine_generate(dep, "us-1", doc(7002, 900))
    await eventually(lambda: _worker_listed(dep, "mnt-0", "us-1"), timeout=20)
    dep.kill("agent", "us-1")
    await eventually(lambda: _not(lambda: _worker_listed(dep, "mnt-0", "us-1")), timeout=30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def impostor(dep):
    """us-1's agent is down; a probe with us-1's certificate takes its place on mnt-0 with a
    fresh incarnation and one report (seq 1) holding KEY_A. The real agent comes back at the end
    (its newer incarnation replaces ours)."""
    dep.kill("agent", "us-1")
    agent = await probe(dep, "us-1", mnt0_address(dep))
    await agent.send(WorkerRegistered("us-1", time.time_ns()))
    await agent.send(PrefixEventsReported("us-1", 1, (PrefixCached("us-1", KEY_A, Tier.VRAM),)))

    async def stored():
        return (await admin(dep, "mnt-0", "holders", {"key": KEY_A}))["holders"] == {"us-1": "VRAM"}

    await eventually(stored)
    yield agent
    await agent.close()
    dep.restart("agent", "us-1")
    await dep.wait_ready(60)


async def test_stale_and_replayed_report_seqs_change_nothing(impostor, dep):
    agent = impostor
    agent.drain()
    before = await quiet_state(dep, "mnt-0")
    stale_before = (await unit_status(dep, "mnt-0"))["workers"]["us-1"]["stale_reports"]
    await agent.send(PrefixEventsReported("us-1", 1, (PrefixEvicted("us-1", KEY_A),)))  # replayed seq
    await agent.send(PrefixEventsReported("us-1", 0, (PrefixEvicted("us-1", KEY_A),)))  # stale seq
    await agent.send(PrefixEventsReported("us-1", 2, (TierChanged("us-1", KEY_A, Tier.VRAM),)))  # a no-op, in order
    await eventually(lambda: _last_seq_is(dep, "us-1", 2))
    assert await quiet_state(dep, "mnt-0") == before
    assert (await unit_status(dep, "mnt-0"))["workers"]["us-1"]["stale_reports"] == stale_before + 2


async def test_stale_and_replayed_report_seqs_get_an_error_for_the_sender(impostor, dep):
    """Issue 8: 'a clear error for the sender' on stale and replayed sequence numbers."""
    agent = impostor
    agent.drain()
    status = await unit_status(dep, "mnt-0")
    last = status["workers"]["us-1"]["last_seq"]
    await agent.send(PrefixEventsReported("us-1", last, (PrefixEvicted("us-1", KEY_A),)))
    error = await agent.error()
    assert error.code == "malformed" and "seq" in error.detail


async def test_events_for_prefixes_never_stored_change_nothing_and_get_an_error(impostor, dep):
    agent = impostor
    agent.drain()
    before = await quiet_state(dep, "mnt-0")
    last = (await unit_status(dep, "mnt-0"))["workers"]["us-1"]["last_seq"]
    await agent.send(PrefixEventsReported("us-1", last + 1, (PrefixEvicted("us-1", KEY_B),
                                                             TierChanged("us-1", KEY_B, Tier.DRAM))))
    await eventually(lambda: _last_seq_is(dep, "us-1", last + 1))
    after = await quiet_state(dep, "mnt-0")
    assert after == before
    assert (await admin(dep, "mnt-0", "holders", {"key": KEY_B}))["holders"] == {}
    # The sender hears why its events were refused.
    error = await agent.error()
    assert error.code == "malformed" and str(KEY_B) in error.detail


async def test_impostor_connection_still_writes_its_own_fields(impostor, dep):
    agent = impostor
    last = (await unit_status(dep, "mnt-0"))["workers"]["us-1"]["last_seq"]
    await agent.send(PrefixEventsReported("us-1", last + 1, (PrefixEvicted("us-1", KEY_A),)))

    async def evicted():
        return (await admin(dep, "mnt-0", "holders", {"key": KEY_A}))["holders"] == {}

    await eventually(evicted)


# -- authority per shard and per region ---------------------------------------------------------


async def _shard_snapshot(dep, unit: str, shard: int) -> ShardSnapshotSent:
    """The unit's current snapshot of ``shard``, as an edge subscribing from scratch gets it."""
    listener = await probe(dep, SUBSCRIBER, dep.cfg.maintenance[shard].quic, Role.EDGE)
    try:
        await listener.send(UpdatesSubscribed(SUBSCRIBER, shard, 0, -1))
        return await _received_snapshot(listener)
    finally:
        await listener.close()


async def _received_snapshot(listener: Probe) -> ShardSnapshotSent:
    """A unit's snapshot transfer (header, then chunks in order), put back together."""
    assembly = SnapshotAssembly(await listener.next(SnapshotTransferStarted), max_entries=1 << 30, max_bytes=1 << 30)
    while not assembly.complete:
        outcome = assembly.add(await listener.next(SnapshotChunkSent))
        assert outcome.kind == "added", outcome
    return assembly.snapshot()


def _edge_log(dep, edge: str, event: str) -> list[dict]:
    out = []
    for line in dep.node("edge", edge).log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


async def _refused_from_us0_to_edge_us(dep, message) -> None:
    """us-0's agent sends edge-us ``message``, which it has no authority for: refused (counted
    once), and the connection carries on."""
    name = type(message).__name__
    refused = await _refused(dep, "us", name)
    agent = await probe(dep, "us-0", dep.cfg.edges_in("us")[0].quic)
    try:
        await agent.send(message)

        async def refused_once():
            return await _refused(dep, "us", name) == refused + 1

        await eventually(refused_once, timeout=REPLY_TIMEOUT)
        assert agent.peer.is_connected
    finally:
        await agent.close()


async def _refused(dep, region: str, message: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(dep.edge_url(region) + "/metrics") as r:
        text = await r.text()
    prefix = f'kvcompass_refused_messages_total{{message="{message}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


async def _edge_position(dep, edge: str, shard: int) -> tuple[int, int]:
    row = next(r for r in (await admin(dep, edge, "views"))["views"] if r["shard"] == shard)
    return row["epoch"], row["seq"]


async def test_a_unit_cannot_write_another_units_shard_at_an_edge_and_keeps_its_own(dep):
    # mnt-1 owns shard 1. With its certificate: shard 0's real snapshot at the same epoch and a
    # huge seq (installed, it would make the edge ignore mnt-0's batches for good), then a batch
    # for shard 0 at the next seq.
    real = await _shard_snapshot(dep, "mnt-0", 0)
    own = await _shard_snapshot(dep, "mnt-1", 1)
    refused_snapshots = await _refused(dep, "us", "ShardSnapshotSent")
    refused_batches = await _refused(dep, "us", "UpdateBatchPublished")
    snapshots_logged = len(_edge_log(dep, "edge-us", "snapshot"))
    rogue = await probe(dep, "mnt-1", dep.cfg.edges_in("us")[0].quic)
    try:
        await rogue.send(dataclasses.replace(real, seq=real.seq + 10**12))
        await rogue.send(UpdateBatchPublished(0, real.epoch, real.seq + 1, ()))

        async def both_refused():
            return (await _refused(dep, "us", "ShardSnapshotSent") == refused_snapshots + 1
                    and await _refused(dep, "us", "UpdateBatchPublished") == refused_batches + 1)

        await eventually(both_refused, timeout=REPLY_TIMEOUT)
        refusals = _edge_log(dep, "edge-us", "message refused")[-2:]
        assert {r["peer"] for r in refusals} == {"maintenance:mnt-1"}
        assert (await _edge_position(dep, "edge-us", 0))[1] < real.seq + 10**12
        # The same connection still writes mnt-1's own shard.
        await rogue.send(own)
        await eventually(lambda: _logged_more(dep, "snapshot", snapshots_logged), timeout=REPLY_TIMEOUT)
        assert _edge_log(dep, "edge-us", "snapshot")[-1]["shard"] == 1
    finally:
        await rogue.close()
    # mnt-0's batches still reach the edge: new entries of shard 0 converge.
    await _engine_generate(dep, "us-0", doc(7301, 900))
    await assert_views_converged(dep, timeout=30)


async def test_a_unit_cannot_send_another_units_shard_in_chunks_and_an_edge_cannot_either(dep):
    # The chunked form of the same attack: mnt-1 (and then an edge) streams shard 0's real
    # snapshot at a huge seq; both the header and the chunks are refused by sender.
    real = await _shard_snapshot(dep, "mnt-0", 0)
    forged = SnapshotChunker(dataclasses.replace(real, seq=real.seq + 10**12), snapshot_id=4242, chunk_bytes=4096)
    for sender, role in (("mnt-1", None), ("edge-eu", Role.EDGE)):
        before = {kind: await _refused(dep, "us", kind) for kind in ("SnapshotTransferStarted", "SnapshotChunkSent")}
        rogue = await probe(dep, sender, dep.cfg.edges_in("us")[0].quic, role)
        try:
            await rogue.send(forged.header)
            for chunk in forged.chunks_from(0):
                await rogue.send(chunk)

            async def all_refused():
                got = {kind: await _refused(dep, "us", kind) - n for kind, n in before.items()}
                return got == {"SnapshotTransferStarted": 1, "SnapshotChunkSent": forged.chunks} or NotYet(repr(got))

            await eventually(all_refused, timeout=REPLY_TIMEOUT)
        finally:
            await rogue.close()
    assert (await _edge_position(dep, "edge-us", 0))[1] < real.seq + 10**12
    await assert_views_converged(dep, timeout=30)


async def _logged_more(dep, event: str, count: int) -> bool:
    return len(_edge_log(dep, "edge-us", event)) > count


async def test_an_edge_cannot_speak_for_another_regions_queues(dep):
    # edge-eu claims region us's queues at edge-us; an edge certificate the config does not
    # name claims region eu's.
    refused = await _refused(dep, "us", "QueueVectorBroadcast")
    lie = 99_999.0
    claims = [("edge-eu", QueueVectorBroadcast("us", "us", time.time() + 1e6, (("us-0", lie),))),
              ("edge-rogue", QueueVectorBroadcast("eu", "us", time.time() + 1e6, (("eu-0", lie),)))]
    liars = [await probe(dep, node_id, dep.cfg.edges_in("us")[0].quic, Role.EDGE) for node_id, _ in claims]
    try:
        for liar, (_, claim) in zip(liars, claims):
            await liar.send(claim)

        async def both_refused():
            return await _refused(dep, "us", "QueueVectorBroadcast") == refused + 2

        await eventually(both_refused, timeout=REPLY_TIMEOUT)
    finally:
        for liar in liars:
            await liar.close()
    assert {r["peer"] for r in _edge_log(dep, "edge-us", "message refused")[-2:]} == {"edge:edge-eu",
                                                                                      "edge:edge-rogue"}
    queues = (await admin(dep, "edge-us", "queues"))["workers"]
    assert all(w["reported_ms"] < lie for w in queues)


async def test_an_agent_may_report_only_its_own_workers_pinned_share(dep):
    # us-0's agent claims that us-1's KV pool is all held (so that copies to us-1 look dear).
    await _refused_from_us0_to_edge_us(dep, WorkerPinnedReported("us-1", 1.0))
    queues = {w["worker"]: w for w in (await admin(dep, "edge-us", "queues"))["workers"]}
    assert queues["us-1"]["pinned_share"] < 1.0


async def test_an_agent_may_say_only_whether_its_own_worker_wants_the_queue_vector(dep):
    # us-0's agent asks, in us-1's name, for the vector us-1's agent said it does not want.
    await _refused_from_us0_to_edge_us(dep, QueueVectorInterestReported("us-1", True))


async def test_an_agent_takes_its_regions_queue_vector_only_from_its_regions_edges(dep):
    # The agent piggybacks this vector on its responses to other regions: edge-eu may not set it.
    liar = await probe(dep, "edge-eu", dep.cfg.worker("us-0").agent, Role.EDGE)
    try:
        await liar.send(QueueVectorBroadcast("us", "us", time.time() + 1e6, (("us-1", 99_999.0),)))

        async def refused():
            log = dep.node("agent", "us-0").log_path.read_text(errors="replace")
            return '"peer": "edge:edge-eu"' in log and '"event": "message refused"' in log

        await eventually(refused, timeout=REPLY_TIMEOUT)
    finally:
        await liar.close()
    assert (await admin(dep, "us-0", "status"))["region_vector"].get("us-1", 0.0) < 99_999.0


# -- helpers ------------------------------------------------------------------------------------


async def _engine_generate(dep, worker: str, text: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(dep.cfg.worker(worker).http + "/generate",
                          json={"text": text, "sampling_params": {"max_new_tokens": 1}}) as r:
            assert r.status == 200, await r.text()


async def _worker_listed(dep, unit: str, worker: str) -> bool:
    """Whether any entry of the unit's exact state has a tier in ``worker``'s field."""
    slot = IndexLayout.from_config(dep.cfg).slot(worker)
    group = (await admin(dep, unit, "entries"))["groups"].get(str(slot.group), {"values": []})
    return any((v >> (2 * slot.field)) & 3 for v in group["values"])


async def _last_seq_is(dep, worker: str, seq: int) -> bool:
    return (await unit_status(dep, "mnt-0"))["workers"][worker]["last_seq"] == seq


async def _not(check) -> bool:
    return not await check()
