"""``edge --workers 2``: the readings process 0 copies to its front doors leave their queue
estimates equal to its own; and through real daemons, two front-door processes on one port
(SO_REUSEPORT), the second deciding over the first's views mapped from shared memory, forwarding
over HTTP and over its own QUIC connections to remote agents."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

import msgpack
import numpy as np
import socket

from e2e_helpers import admin, doc, eventually, generate, session_per_process
from kvcompassd.core.config import load_config
from kvcompassd.core.messages import RoomVectorBroadcast
from kvcompassd.core.queues import QueueEstimates, QueueVectorBroadcast
from kvcompassd.edge_workers import (FRAME_LAG_S, MAX_FRAME, FrameBatch, SharedCharges, SharedLedger, _Fanout,
                                     _QueueFanout, apply_queue_frame, frame_lag, unpack_frames)
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(workers={"us": 2, "eu": 1}, one_way_ms={("us", "eu"): 10.0}, shards=2,
                      prefill_ms_per_token=0.05, decode_ms_per_token=1.0, fingerprint_bits=16)
TESTBED = load_config(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml")


async def test_copied_readings_leave_a_front_doors_queue_estimates_equal_to_the_edges():
    fanout = _Fanout()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    fanout.sockets.append(mine)
    edge = _QueueFanout(QueueEstimates(TESTBED, "us", now=0.0), fanout)
    door = QueueEstimates(TESTBED, "us", now=0.0)
    us = [w.id for w in TESTBED.workers if w.region == "us"]
    eu = [w.id for w in TESTBED.workers if w.region == "eu"]
    edge.set_local(us[0], 120.0, now=0.5, running=3)
    edge.on_broadcast(QueueVectorBroadcast("eu", "us", 0.4, ((eu[0], 30.0), (eu[1], 5.0))), now=0.6)
    with pytest.raises(ValueError):  # refused by the edge: nothing is copied
        edge.on_broadcast(QueueVectorBroadcast("eu", "asia", 0.4, ((eu[0], 1.0),)), now=0.7)
    edge.note_piggyback_sent("eu", now=0.8)
    edge.set_room(us[2], ((0.0, 4_000), (700.0, 98_304)), now=0.85)
    edge.on_room_broadcast(RoomVectorBroadcast("eu", "us", 0.4, ((eu[1], ((0.0, 10), (300.0, 98_304))),)), now=0.86)
    edge.set_pinned(us[1], 0.6)
    with pytest.raises(ValueError):  # another region's worker: refused by the edge, not copied
        edge.set_pinned(eu[0], 0.6)
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):  # readings wait up to FRAME_LAG_S for company
        theirs.recv(65536)
    await asyncio.sleep(0)
    with pytest.raises(BlockingIOError):
        theirs.recv(65536)
    await asyncio.sleep(2 * FRAME_LAG_S)  # (the lag's timer was armed first: it runs first)
    datagrams = []
    while True:
        try:
            datagrams.append(theirs.recv(65536))
        except BlockingIOError:
            break
    assert len(datagrams) == 1  # one datagram for the pass's frames
    frames = [frame for frame, _ in unpack_frames(datagrams[0])]
    assert [f[0] for f in frames] == ["load", "vector", "piggyback", "room", "room_vector", "pinned"]
    for frame in frames:
        apply_queue_frame(door, frame, now=0.9)
    for now in (0.9, 1.5, 4.0):
        assert np.array_equal(door.queue_ms(now=now), edge.queue_ms(now=now))
    room_worker = TESTBED.worker_ids().index(us[2])
    assert door.room_floor == edge.room_floor == 10  # eu[1]'s, from the room broadcast
    assert door.room_wait_ms(room_worker, 50_000, now=0.95) == edge.room_wait_ms(room_worker, 50_000, now=0.95) \
        == pytest.approx(600.0)
    eu1 = TESTBED.worker_ids().index(eu[1])
    assert door.room_workers == edge.room_workers and door.room(eu1, now=0.9) == edge.room(eu1, now=0.9)
    pinned_worker = TESTBED.worker_ids().index(us[1])
    assert door.pinned_workers == edge.pinned_workers and door.pinned_share(pinned_worker, now=0.9) == 0.6
    with pytest.raises(ValueError):
        apply_queue_frame(door, ["withheld", [], True], now=1.0)
    theirs.close()
    edge.set_local(us[1], 1.0, now=1.0)  # a front door gone: dropped from the fan-out, no error
    await asyncio.sleep(2 * FRAME_LAG_S)
    assert fanout.sockets == []
    mine.close()


async def test_frames_made_in_one_pass_go_in_order_in_datagrams_that_fit_a_frame():
    sent: list[tuple[bytes, int]] = []
    batch = FrameBatch(lambda data, frames: sent.append((data, frames)))
    frames = [["charge", 7, n, "us-0", float(n), 0.5] for n in range(3)] + [["metrics", 1, True, b"x" * 30_000]] * 5
    for frame in frames:
        batch.add(msgpack.packb(frame, use_bin_type=True))
    assert len(sent) == 2  # full ones go at once: the three charges and two chunks, then two chunks
    await asyncio.sleep(0)  # the rest at the end of the pass
    assert len(sent) == 3 and sum(n for _, n in sent) == len(frames)
    assert all(len(data) <= MAX_FRAME for data, _ in sent)
    received = [frame for data, _ in sent for frame, _ in unpack_frames(data)]
    assert received == frames
    await asyncio.sleep(0)
    assert len(sent) == 3  # nothing more to send: no empty datagram


async def test_news_waits_for_a_charge_or_its_lag_and_keeps_its_order():
    sent: list[list] = []
    batch = FrameBatch(lambda data, frames: sent.append([frame for frame, _ in unpack_frames(data)]))
    retired = ["retired", 7, 1, 0.5]
    ready = ["ready", 7, 1, 0.5]
    charge = ["charge", 7, 2, "us-0", 3.0, 0.6]
    assert frame_lag("retired") == frame_lag("ready") == frame_lag("load") == FRAME_LAG_S
    assert frame_lag("charge") == frame_lag("credit") == frame_lag("withheld") == 0.0
    for frame in (retired, ready):
        batch.add(msgpack.packb(frame), lag=frame_lag(frame[0]))
    await asyncio.sleep(0)
    assert sent == []  # news alone waits
    batch.add(msgpack.packb(charge), lag=frame_lag("charge"))
    await asyncio.sleep(0)
    assert sent == [[retired, ready, charge]]  # the charge takes it along, in the order made
    await asyncio.sleep(2 * FRAME_LAG_S)
    assert len(sent) == 1  # the lag's timer went with that datagram: nothing sent twice, nothing empty
    batch.add(msgpack.packb(ready), lag=FRAME_LAG_S)
    batch.add(msgpack.packb(retired), lag=FRAME_LAG_S)  # (the first one's timer serves both)
    await asyncio.sleep(0)
    assert len(sent) == 1
    await asyncio.sleep(2 * FRAME_LAG_S)
    assert sent[1:] == [[ready, retired]]  # news with no charge after it goes when its lag is up


async def test_a_datagram_cut_inside_a_frame_gives_the_frames_before_it_then_an_error():
    whole = [msgpack.packb(["ready", 12], use_bin_type=True), msgpack.packb(["retired", 1, 2, 0.5], use_bin_type=True)]
    data = b"".join(whole) + whole[1][:-2]
    got = []
    with pytest.raises(ValueError):
        for frame, packed in unpack_frames(data):
            got.append((frame, packed))
    assert got == [(["ready", 12], whole[0]), (["retired", 1, 2, 0.5], whole[1])]
    with pytest.raises((ValueError, msgpack.UnpackException)):
        list(unpack_frames(b"\xc1"))  # a byte msgpack never uses


async def test_outside_the_event_loop_a_frame_goes_at_once():
    sent = []
    batch = FrameBatch(lambda data, frames: sent.append(frames))
    await asyncio.to_thread(batch.add, msgpack.packb(["back", "us-0", "up"]))  # (a thread has no loop)
    assert sent == [1]


async def test_a_charge_made_by_one_process_is_held_by_the_others_until_it_retires():
    frames: dict[str, list] = {"a": [], "b": []}
    a = SharedCharges(QueueEstimates(TESTBED, "us", now=0.0), frames["a"].append, origin=0)
    b = SharedCharges(QueueEstimates(TESTBED, "us", now=0.0), frames["b"].append, origin=4242)
    alone = QueueEstimates(TESTBED, "us", now=0.0)  # one process making every dispatch itself
    us = [w.id for w in TESTBED.workers if w.region == "us"]
    eu = [w.id for w in TESTBED.workers if w.region == "eu"]
    for q in (a, b, alone):
        q.set_local(us[0], 40.0, now=0.1, running=1)
        q.on_broadcast(QueueVectorBroadcast("eu", "us", 0.05, ((eu[0], 30.0), (eu[1], 5.0))), now=0.1)

    def deliver(now: float) -> None:  # what the control sockets carry, in order
        for frame in frames["a"]:
            b.apply_frame(msgpack.unpackb(msgpack.packb(frame), raw=False), now=now)
        for frame in frames["b"]:
            a.apply_frame(msgpack.unpackb(msgpack.packb(frame), raw=False), now=now)
        frames["a"].clear()
        frames["b"].clear()

    def alike(now: float) -> None:
        assert np.array_equal(a.queue_ms(now=now), alone.queue_ms(now=now))
        assert np.array_equal(b.queue_ms(now=now), alone.queue_ms(now=now))

    mine = a.note_dispatched(us[0], 120.0, now=0.2)
    theirs = b.note_dispatched(eu[1], 300.0, now=0.21)  # a remote worker: in flight for a round trip
    assert b.note_dispatched(us[1], 0.0, now=0.21) >= 0 and frames["b"][-1][3] == eu[1]  # no frame for nothing
    one, two = alone.note_dispatched(us[0], 120.0, now=0.2), alone.note_dispatched(eu[1], 300.0, now=0.21)
    deliver(now=0.22)
    for now in (0.22, 0.25):
        alike(now)
    a.retire_prefill(mine, now=0.23)
    alone.retire_prefill(one, now=0.23)
    b.retire(theirs, now=0.24)
    alone.retire(two, now=0.24)
    deliver(now=0.26)
    alike(0.26)
    a.retire(mine, now=0.27)
    alone.retire(one, now=0.27)
    deliver(now=0.28)
    alike(0.3)
    assert b._theirs == {} and a._theirs == {}  # every charge of the other process retired
    with pytest.raises(ValueError):
        b.apply_frame(["charge", 0, 99, "nobody", 1.0, 0.3], now=0.3)
    with pytest.raises(ValueError):
        b.apply_frame(["load", 0, 99], now=0.3)


def _ledgers():
    from kvcompassd.core.index import EdgeIndexView
    from kvcompassd.core.layout import IndexLayout
    from kvcompassd.core.pending import PendingHoldings
    from kvcompassd.core.router import Router

    r = Router(TESTBED, "us", EdgeIndexView(IndexLayout.from_config(TESTBED), TESTBED.shards, edge="edge-us"), now=0.0)

    def ledger():
        return PendingHoldings(r.lookup.group_lengths, r.lookup.query_lengths, r.layout.worker_group,
                               hold_s=1.0, refute_misses=True)

    queries = [int(n) for n in r.lookup.query_lengths]
    return ledger, queries


async def test_a_prompt_sent_by_one_process_is_credited_by_the_others_alike():
    ledger, queries = _ledgers()
    frames: dict[str, list] = {"a": [], "b": []}
    a = SharedLedger(ledger(), frames["a"].append, origin=0)
    b = SharedLedger(ledger(), frames["b"].append, origin=4242)
    alone = ledger()  # one process sending every prompt itself
    n = len(TESTBED.workers)
    keys = np.arange(1, len(queries) + 1, dtype=np.uint64) * 7919  # a prompt's query keys
    other = keys + 1  # another prompt's

    def deliver(now: float) -> None:
        for frame in frames["a"]:
            b.apply_frame(msgpack.unpackb(msgpack.packb(frame), raw=False), now=now)
        for frame in frames["b"]:
            a.apply_frame(msgpack.unpackb(msgpack.packb(frame), raw=False), now=now)
        frames["a"].clear()
        frames["b"].clear()

    def credited(holdings, prompt, now: float) -> list[int]:
        matched, tier = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int8)
        holdings.overlay(prompt.tolist(), matched, tier, now=now, read_only=True)
        return matched.tolist()

    def alike(prompt, now: float) -> list[int]:
        want = credited(alone, prompt, now)
        assert credited(a, prompt, now) == want and credited(b, prompt, now) == want
        return want

    prompt_len = queries[-1]
    for q in (a, alone):
        q.note_sent(1, keys, prompt_len, 0, ready_at=0.1, now=0.05, dispatch=7)
    for q in (b, alone):
        q.note_sent(2, other, prompt_len, 0, ready_at=0.1, now=0.06, dispatch=7 if q is b else 8)
    deliver(now=0.07)
    assert max(alike(keys, 0.2)) == prompt_len and max(alike(other, 0.2)) == prompt_len
    # Credited from its prefill's start, after a queue ahead of it, in every process alike.
    queued = keys + 3
    for q in (a, alone):
        q.note_sent(4, queued, prompt_len, 0, starts_at=0.15, ready_at=0.18, now=0.07, dispatch=11)
    deliver(now=0.08)
    assert max(alike(queued, 0.12)) == 0 and alike(queued, 0.16)[4] == prompt_len
    # A third prompt at worker 3, then again there on the strength of that credit alone.
    third = keys + 2
    for q in (b, alone):
        q.note_sent(3, third, prompt_len, 0, ready_at=0.1, now=0.08, dispatch=9)
    deliver(now=0.09)
    assert alike(third, 0.2)[3] == prompt_len
    for q in (a, alone):
        q.note_sent(3, third, prompt_len, prompt_len, ready_at=0.3, now=0.25, dispatch=10)
    deliver(now=0.26)
    # Its response reused only the first length: the credits beyond it end in every process.
    assert a.refute(10, queries[0]) == alone.refute(10, queries[0]) > 0
    deliver(now=0.5)
    assert alike(third, 0.5)[3] == queries[0]
    assert b.refuted == 0 and a.refuted == alone.refuted  # each process counts its own
    for q in (a, alone):
        q.forget(2)
    deliver(now=0.6)
    assert max(alike(other, 0.6)) == 0
    with pytest.raises(ValueError):
        b.apply_frame(["forget", 0, n], now=0.7)
    with pytest.raises(ValueError):
        b.apply_frame(["charge", 0, 1], now=0.7)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("edge-workers"), time_scale=1.0,
                        node_args={"edge:edge-us": ("--workers", "2")})
    async with d:
        yield d


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def doors(dep):
    """One keep-alive connection to each front door of edge-us: {front door pid or 0: session}.
    A connection stays on the process that accepted it, so a session speaks to one process."""
    found = await session_per_process(dep, "us")
    yield found
    for s in found.values():
        await s.close()


async def _generate(dep, session: aiohttp.ClientSession, text: str) -> dict:
    async with session.post(dep.edge_url("us") + "/generate",
                            json={"text": text, "sampling_params": {"max_new_tokens": 3}}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["meta_info"]["kvcompass"]


async def _registered(dep, text: str, worker: str) -> None:
    """Until the shared view itself shows the worker's whole registration: process 0's pending
    ledger (its own, per process) credits the prompt it sent beyond the view until then."""
    async def check():
        body = await admin(dep, "edge-us", "holders", {"text": text})
        return (any(h["worker"] == worker for h in body["holders"])
                and not any(p["worker"] == worker for p in body["pending"]))

    await eventually(check)


async def test_both_front_doors_accept_connections_on_one_port(doors):
    assert 0 in doors and len(doors) == 2  # process 0 (the edge) and one front-door process


async def test_front_doors_send_a_registered_prefix_to_its_holder_alike(dep, doors):
    shared = doc(110, 1200)
    holder = (await _generate(dep, doors[0], shared + " first"))["worker"]
    await _registered(dep, shared + " second", holder)
    decisions = {}
    for key, session in doors.items():
        got = [await _generate(dep, session, shared + f" question {i}") for i in range(3)]
        decisions[key] = [(d["worker"], d["claimed_tokens"]) for d in got]
    assert all(w == holder and claimed > 0 for w, claimed in decisions[0])
    (other,) = (k for k in doors if k)
    assert decisions[other] == decisions[0]


async def test_a_front_door_forwards_a_remote_hit_through_the_remote_agent(dep, doors):
    shared = doc(120, 4000)
    first = (await generate(dep, "eu", shared + " one"))["meta_info"]["kvcompass"]
    holder = first["worker"]
    assert holder == "eu-0"
    await _registered(dep, shared + " two", holder)
    decisions = {key: await _generate(dep, session, shared + " two") for key, session in doors.items()}
    (other,) = (k for k in doors if k)
    assert decisions[other]["worker"] == decisions[0]["worker"] == "eu-0"
    assert decisions[other]["claimed_tokens"] == decisions[0]["claimed_tokens"] > 0


async def test_the_front_door_maps_the_views_without_a_copy(dep, doors):
    (pid,) = (k for k in doors if k)
    rss = private = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            # The view's images, not the front door's own metrics files (kvc-...-metrics/).
            inside = len(head) >= 6 and head[5].startswith("/dev/shm/kvc-") and "-metrics/" not in head[5]
        elif inside and head[0] == "Rss:":
            rss += int(head[1]) * 1024
        elif inside and head[0] in ("Private_Clean:", "Private_Dirty:"):
            private += int(head[1]) * 1024
    assert rss > 0  # it maps the views...
    assert private <= 0.05 * rss  # ...which the edge process holds too: one copy on the host


async def _metrics(dep, session: aiohttp.ClientSession) -> dict[tuple[str, tuple], float]:
    async with session.get(dep.edge_url("us") + "/metrics") as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


GENERATED = ("kvcompass_requests_total", (("route", "/generate"), ("status", "200")))
REQUEST_TIMES = ("kvcompass_request_seconds_count", ())


async def test_every_front_doors_requests_are_counted_whichever_process_is_scraped(dep, doors):
    (pid,) = (k for k in doors if k)
    before = await _metrics(dep, doors[pid])  # the front door publishes what it counted so far first
    for i, session in enumerate(doors.values()):
        for k in range(2 + i):  # 2 at process 0, 3 at the other
            await _generate(dep, session, doc(140 + 10 * i + k, 300))
    # Process 0 merges; the other front door publishes its counts, then asks process 0. Scraped
    # first, the front door's counts are then published for process 0's scrape as well (process 0
    # alone would see them as of the front door's last publication, each second).
    for _, session in sorted(doors.items(), key=lambda door: door[0] == 0):
        after = await _metrics(dep, session)
        assert after[GENERATED] - before[GENERATED] == 5
        assert after[REQUEST_TIMES] - before[REQUEST_TIMES] == 5
    learned = {dict(k[1]).get("pid") for k in after if k[0] == "kvcompass_learned_prefill_ms_per_token"}
    assert str(pid) in learned and len(learned) == 2  # each process's own rates, by pid

    async def both_connections_counted():  # a function gauge the front door publishes each second
        return (await _metrics(dep, doors[0]))[("kvcompass_frontdoor_connections", ())] >= 2

    await eventually(both_connections_counted)


async def test_a_front_door_that_dies_is_replaced_and_the_port_keeps_serving(dep, doors):
    (pid,) = (k for k in doors if k)
    for i in range(2):
        await _generate(dep, doors[pid], doc(170 + i, 300))
    counted = (await _metrics(dep, doors[pid]))[GENERATED]  # it published them first
    os.kill(pid, signal.SIGKILL)

    async def replaced():
        try:
            async with aiohttp.ClientSession() as s:  # a new connection each time: any process
                async with s.get(dep.edge_url("us") + "/health") as r:
                    body = await r.json()
        except aiohttp.ClientError:
            return False  # a connection the kernel queued on the killed process's socket: reset
        door = body.get("front_door")
        return door is not None and door != pid and body["ready"]

    await eventually(replaced, timeout=90)
    # The dead front door's requests (as it last published them) are still counted, once.
    assert (await _metrics(dep, doors[0]))[GENERATED] == counted
    # Requests go on being served meanwhile and after, by whichever process takes the connection.
    for i in range(4):
        assert (await generate(dep, "us", doc(130 + i, 300)))["meta_info"]["kvcompass"]["worker"]


async def test_a_front_doors_long_charge_makes_process_0s_broadcasts_urgent():
    # Process 0 sends the queue broadcasts; a front door's long dispatch reaches it as a charge
    # frame, which must make its broadcasts due at once as its own dispatch would.
    frames: list = []
    door = SharedCharges(QueueEstimates(TESTBED, "us", now=0.0), frames.append, origin=4242)
    process0 = SharedCharges(QueueEstimates(TESTBED, "us", now=0.0), [].append, origin=0)
    process0.due_broadcasts(now=0.0)
    us0 = next(w.id for w in TESTBED.workers if w.region == "us")
    door.note_dispatched(us0, TESTBED.score.urgent_broadcast_ms, now=0.01)
    assert not process0.urgent
    for frame in frames:
        process0.apply_frame(msgpack.unpackb(msgpack.packb(frame), raw=False), now=0.02)
    assert process0.urgent and process0.next_deadline(now=0.02) == 0.02
    assert {b.to_region for b in process0.due_broadcasts(now=0.02)} == {"eu", "asia"}
