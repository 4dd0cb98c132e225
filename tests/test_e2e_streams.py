"""Per-region update streams on real daemons (kvcompassd.core.streams, maintenance.py): each edge
follows the stream of the region its certificate's config entry names, holds only the lengths
its region looks up, and decides as an edge of the same region given the full stream; a unit
restart and a lost connection converge per stream; an edge the config does not name is refused;
a unit sends a stream's live batches to one edge per region, which relays them to the others;
an edge that missed a quiet stream's last batch (its relay stopped) catches up on the unit's
position heartbeat, with no later batch.

Regions us (2 workers) and eu (1), two edges each; edge-eu-1 follows the full stream
(``[sync] full_stream_edges``), edge-eu its region's. An eu edge looks toward us only from 4,000
tokens on (``kvcompassctl edge-eu levels``; the test checks it), so a us worker's registrations
of a short prompt never reach edge-eu, and those of a long one reach it at a few lengths.
"""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest
import pytest_asyncio

from e2e_helpers import NotYet, admin, assert_views_converged, doc, eventually
from kvcompassd import certs
from kvcompassd.daemon import split_address, tls_files
from kvcompassd.launcher import DeploymentSpec, LocalDeployment
from kvcompassd.transport import QuicNode
from kvcompassd.wire import (
    ErrorReported,
    NodeIdentity,
    Role,
    ShardPositionAnnounced,
    UpdateBatchPublished,
    UpdatesSubscribed,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# 16 fingerprint bits: holders compared between two edges must not include keyless false hits,
# which differ between the region's tables and the full ones (other tables, the same rate).
SPEC = DeploymentSpec(workers={"us": 2, "eu": 1}, one_way_ms={("us", "eu"): 40.0}, shards=1, wan=False,
                      prefill_ms_per_token=0.02, decode_ms_per_token=1.0, fingerprint_bits=16,
                      edges_per_region=2, sync={"full_stream_edges": ["edge-eu-1"], "position_heartbeat_ms": 300})
REGION_EDGE, FULL_EDGE = "edge-eu", "edge-eu-1"
SHORT = doc(310, 600)  # registers 64..512 tokens: read only inside us
LONG = doc(311, 8300)  # also up to 8192: 4000, 6000 and 8000 are read from eu


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("streams"), time_scale=1.0)
    async with d:
        yield d


def _edge(dep, edge_id: str):
    return next(e for e in dep.cfg.edges if e.id == edge_id)


async def _generate(dep, edge_id: str, text: str) -> str:
    """Serve ``text`` through edge ``edge_id``; the worker that served it."""
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{_edge(dep, edge_id).http}/generate",
                          json={"text": text, "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-KVCompass-Worker"]


async def _view_entries(dep, edge_id: str) -> int:
    return sum(row["entries"] for row in (await admin(dep, edge_id, "views"))["views"])


async def test_a_regions_edge_holds_only_its_lengths_and_decides_as_the_full_stream_edge(dep):
    toward_us = (await admin(dep, REGION_EDGE, "levels"))["toward"]["us"]
    assert len(SHORT) < toward_us[0] < len(LONG)
    for text in (SHORT, LONG):
        await _generate(dep, "edge-us", text)
    await _generate(dep, "edge-eu", doc(312, 2600))
    await assert_views_converged(dep, timeout=60)
    status = await admin(dep, "mnt-0", "status")
    streams = status["streams"]
    assert streams["eu"]["edges"] == [REGION_EDGE] and FULL_EDGE in streams["full"]["edges"]
    assert streams["us"]["edges"] == ["edge-us", "edge-us-1"]
    # [sync] relay: the unit sends the us stream to edge-us only, which forwards it to edge-us-1
    # (whose view converged above all the same).
    assert streams["us"]["live_to"] == ["edge-us"] and streams["eu"]["live_to"] == [REGION_EDGE]
    assert (await admin(dep, "edge-us", "status"))["batches_relayed"] > 0
    assert (await admin(dep, "edge-us-1", "status"))["batches_relayed"] == 0
    # The eu stream carried fewer updates and holds fewer entries: the us lengths below 944.
    assert 0 < streams["eu"]["entries"] < streams["full"]["entries"], streams
    assert streams["eu"]["updates"] < streams["full"]["updates"], streams
    assert await _view_entries(dep, REGION_EDGE) == streams["eu"]["entries"]
    assert await _view_entries(dep, FULL_EDGE) == streams["full"]["entries"]
    print(f"\nentries: full stream {streams['full']['entries']}, eu {streams['eu']['entries']}, "
          f"us {streams['us']['entries']}; updates: full {streams['full']['updates']}, eu {streams['eu']['updates']}")

    # The same holders and the same choice for prompts cached or not, whole or extended.
    texts = [SHORT, LONG, LONG + " and more", SHORT + " q", doc(312, 2600) + " z", doc(313, 1500)]
    found = 0
    for text in texts:
        async def alike(text=text):
            a = await admin(dep, REGION_EDGE, "holders", {"text": text})
            b = await admin(dep, FULL_EDGE, "holders", {"text": text})
            return (a["holders"], a["chosen"]) == (b["holders"], b["chosen"]) and a

        body = await eventually(alike, timeout=30)  # both idle: their queue estimates settle alike
        found += bool(body["holders"])
    assert found >= 3  # holders were compared, not only misses
    # Requests: the region's edge and the full-stream edge send the same prompt to the same worker.
    for text in (LONG + " routed", doc(312, 2600) + " routed"):
        first = await _generate(dep, REGION_EDGE, text)
        await assert_views_converged(dep, timeout=60)
        assert await _generate(dep, FULL_EDGE, text) == first


async def test_an_edge_the_config_does_not_name_is_refused_with_a_clear_error(dep):
    stranger = "edge-stranger"
    certs.issue(dep.tls_dir, dep.tls_dir, role=Role.EDGE, node_id=stranger)
    inbox: asyncio.Queue = asyncio.Queue()
    node = QuicNode(NodeIdentity(Role.EDGE, stranger), tls_files(dep.tls_dir, stranger),
                    on_message=lambda peer, msg, ch: inbox.put_nowait(msg))
    try:
        peer = await node.connect(split_address(dep.cfg.maintenance[0].quic, "mnt-0"),
                                  expected_role=Role.MAINTENANCE, timeout=30)
        await peer.send(UpdatesSubscribed(stranger, 0, 0, -1))
        async with asyncio.timeout(30):
            reply = await inbox.get()
    finally:
        await node.close()
    assert isinstance(reply, ErrorReported) and reply.code == "forbidden", reply
    assert "not in this cluster's config" in reply.detail
    status = await admin(dep, "mnt-0", "status")
    assert stranger not in status["subscribers"]
    lines = [json.loads(line) for line in dep.node("maintenance", "mnt-0").log_path.read_text().splitlines()
             if line.startswith("{")]
    assert any(r.get("event") == "refused" and "edge-stranger" in r.get("peer", "") for r in lines)


async def test_only_an_edge_of_the_same_region_and_stream_may_relay_batches(dep):
    """edge-eu (another region) pushes a batch to edge-us as if relaying: refused with a log line,
    and edge-us's view does not move."""
    before = (await admin(dep, "edge-us", "digest", {"shard": 0}))["position"]
    node = QuicNode(NodeIdentity(Role.EDGE, "edge-eu"), tls_files(dep.tls_dir, "edge-eu"),
                    on_message=lambda peer, msg, ch: None)
    try:
        peer = await node.connect(split_address(_edge(dep, "edge-us").quic, "edge-us"), expected_role=Role.EDGE,
                                  timeout=30)
        await peer.send(UpdateBatchPublished(0, before[0], before[1] + 1, ()))

        def refused():
            return [json.loads(line) for line in dep.node("edge", "edge-us").log_path.read_text().splitlines()
                    if line.startswith("{") and '"message refused"' in line and "does not relay" in line]

        async def logged():
            return refused()

        (line, *_) = await eventually(logged, timeout=30)
    finally:
        await node.close()
    assert line["peer"] == "edge:edge-eu" and line["type"] == "UpdateBatchPublished"
    assert (await admin(dep, "edge-us", "digest", {"shard": 0}))["position"] == before


async def test_only_the_shards_unit_or_a_relaying_edge_may_announce_a_position_and_only_of_the_edges_stream(dep):
    """A position announcement above edge-us's view would make it ask for a replay: one from
    another region's edge, or from the unit for another stream, is refused with a log line, and
    the sender told why; the view and its requests do not move; the connection carries on."""
    before = await admin(dep, "edge-us", "digest", {"shard": 0})
    resyncs = (await admin(dep, "edge-us", "status"))["resyncs"]
    epoch, seq = before["position"]
    for sender, role, announced, why in (
            ("edge-eu", Role.EDGE, ShardPositionAnnounced(0, epoch, seq + 5, "us"), "does not relay"),
            ("mnt-0", Role.MAINTENANCE, ShardPositionAnnounced(0, epoch, seq + 5, "eu"), "this edge follows 'us'")):
        inbox: asyncio.Queue = asyncio.Queue()
        node = QuicNode(NodeIdentity(role, sender), tls_files(dep.tls_dir, sender),
                        on_message=lambda peer, msg, ch: inbox.put_nowait(msg))
        try:
            peer = await node.connect(split_address(_edge(dep, "edge-us").quic, "edge-us"), expected_role=Role.EDGE,
                                      timeout=30)
            await peer.send(announced)
            async with asyncio.timeout(30):
                reply = await inbox.get()
                while not isinstance(reply, ErrorReported):  # what else the edge sends this identity
                    reply = await inbox.get()
            assert reply.code == "forbidden" and why in reply.detail, reply

            async def logged(sender=sender, why=why):
                return [json.loads(line) for line in dep.node("edge", "edge-us").log_path.read_text().splitlines()
                        if line.startswith("{") and '"message refused"' in line and why in line
                        and f'"{role.value}:{sender}"' in line and '"ShardPositionAnnounced"' in line]

            await eventually(logged, timeout=30)
            assert peer.is_connected
        finally:
            await node.close()
    assert (await admin(dep, "edge-us", "digest", {"shard": 0}))["position"] == before["position"]
    assert (await admin(dep, "edge-us", "status"))["resyncs"] == resyncs


async def test_when_the_relaying_edge_stops_the_next_edge_of_its_region_takes_over(dep):
    dep.kill("edge", "edge-us", signal.SIGTERM)  # its connections close: the unit sees it leave

    async def taken_over():
        status = await admin(dep, "mnt-0", "status")
        return status["streams"]["us"]["live_to"] == ["edge-us-1"] and status

    await eventually(taken_over, timeout=60, interval=0.3)
    await _generate(dep, "edge-us-1", doc(315, 8300))
    await assert_views_converged(dep, timeout=60)  # the running edges, edge-us-1 among them
    dep.restart("edge", "edge-us")

    async def back():
        status = await admin(dep, "mnt-0", "status")
        return status["streams"]["us"]["live_to"] == ["edge-us"] and status

    await eventually(back, timeout=90, interval=0.5)  # first in config order: it relays again
    await _generate(dep, "edge-us-1", doc(316, 8300))
    await eventually(lambda: _ready(dep, "edge-us"), timeout=90, interval=0.5)
    await assert_views_converged(dep, timeout=60)


async def _ready(dep, edge: str) -> bool:
    return (await admin(dep, edge, "status"))["shards_ready"] == dep.cfg.shards


async def test_a_unit_restart_and_an_edge_restart_converge_on_each_stream(dep):
    before = await admin(dep, "mnt-0", "status")
    dep.restart("maintenance", "mnt-0")  # a new epoch: every stream starts again, agents re-register

    async def rebuilt():
        status = await admin(dep, "mnt-0", "status")
        streams = status["streams"]
        return (status["epoch"] > before["epoch"] and len(status["subscribers"]) == len(dep.cfg.edges)
                and 0 < streams["eu"]["entries"] < streams["full"]["entries"]) and status

    status = await eventually(rebuilt, timeout=90, interval=0.5)
    await assert_views_converged(dep, timeout=60)
    # The re-registrations carried their lengths: the eu stream is thin again, not everything.
    assert status["streams"]["eu"]["entries"] < status["streams"]["full"]["entries"]
    # An edge that lost everything (a new process) subscribes from nothing: its stream's snapshot.
    dep.restart("edge", REGION_EDGE)
    await _generate(dep, "edge-us", doc(314, 8300))  # the stream moves on meanwhile

    await eventually(lambda: _ready(dep, REGION_EDGE), timeout=90, interval=0.5)
    await assert_views_converged(dep, timeout=90)
    digest = await admin(dep, "mnt-0", "digest", {"edge": REGION_EDGE})
    view = await admin(dep, REGION_EDGE, "digest", {"shard": 0})
    assert view["position"] == digest["position"] and view["groups"] == digest["groups"]


async def test_an_edge_that_missed_a_quiet_streams_last_batch_catches_up_on_the_position_heartbeat(dep):
    """edge-us relays the us stream to edge-us-1. Stopped (SIGSTOP: a relay that hangs right
    after taking a batch), it never forwards the next batch; no batch follows it, and only the
    unit's position announcement, sent to every edge directly, shows edge-us-1 the gap."""
    relay, follower = "edge-us", "edge-us-1"
    proc = dep.node("edge", relay).proc
    await assert_views_converged(dep, timeout=60)
    for attempt in range(3):
        async def relaying():
            status = await admin(dep, "mnt-0", "status")
            us = status["streams"]["us"]
            return us["live_to"] == [relay] and follower in us["edges"] and status

        before = (await eventually(relaying, timeout=60, interval=0.3))["streams"]["us"]["seq"]
        gaps_before = (await admin(dep, follower, "status"))["position_gaps"]
        proc.send_signal(signal.SIGSTOP)
        try:
            await _generate(dep, follower, doc(320 + attempt, 2600))  # a us worker's: the us stream moves

            async def published():
                status = await admin(dep, "mnt-0", "status")
                return status["streams"]["us"]["seq"] > before and status

            status = await eventually(published, timeout=60, interval=0.2)
            if status["streams"]["us"]["live_to"] != [relay]:
                # The unit gave up on the stopped relay (its idle timeout) before publishing: the
                # batch went to edge-us-1 itself, nothing was missed. Try again.
                continue

            async def caught_up():
                unit = await admin(dep, "mnt-0", "digest", {"edge": follower})
                view = await admin(dep, follower, "digest", {"shard": 0})
                same = unit["position"] == view["position"] and unit["groups"] == view["groups"]
                return same or NotYet(f"unit {unit['position']}, {follower} {view['position']}")

            await eventually(caught_up, timeout=60, interval=0.2)  # the relay is still stopped
            assert (await admin(dep, "mnt-0", "status"))["stats"]["positions_announced"] > 0
            assert (await admin(dep, follower, "status"))["position_gaps"] > gaps_before
            break
        finally:
            proc.send_signal(signal.SIGCONT)
            await assert_views_converged(dep, timeout=90)
    else:
        raise AssertionError("the unit dropped the stopped relay before every attempt's batch")
