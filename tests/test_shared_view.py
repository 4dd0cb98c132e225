"""Views in shared memory (kvcompassd/shared_view.py, ludo_c/kvc_shared.h): a writer's images read
by other processes answer as the private view does, readers never act on a torn table, several
processes decide as one, and a second process maps the view without a copy of its own."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusters import make_cluster
from kvcompassd.core.events import IndexEventColumns, PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.ludo import LudoError
from kvcompassd.core.router import Router
from kvcompassd import shared_view
from kvcompassd.shared_view import MappedView, SharedViewReader, SharedViewWriter, share_router_view

SHARDS = 2
REGIONS = {"us": 3, "eu": 2}
WORKERS = ("us-0", "us-1", "us-2", "eu-0", "eu-1")


def _cluster(initial_capacity: int = 64, fingerprint_bits: int = 0):
    cfg = make_cluster(REGIONS, shards=SHARDS, one_way_ms=20.0, prefill_ms_per_token=0.1, levels=4,
                       same_region_min_tokens=32, initial_capacity=initial_capacity, fingerprint_bits=fingerprint_bits)
    layout = IndexLayout.from_config(cfg)
    shards = [MaintenanceShard(layout, s, SHARDS, epoch=1, initial_capacity=initial_capacity,
                               fingerprint_bits=fingerprint_bits) for s in range(SHARDS)]
    return cfg, layout, shards


class World:
    """Maintenance shards feeding a private view and a shared one the same stream."""

    def __init__(self, initial_capacity: int = 64, fingerprint_bits: int = 0):
        self.cfg, self.layout, self.shards = _cluster(initial_capacity, fingerprint_bits)
        self.private = EdgeIndexView(self.layout, SHARDS, edge="edge-us")
        self.writer = SharedViewWriter(self.layout, SHARDS, edge="edge-us")
        for s in self.shards:
            snap = s.snapshot()
            assert self.private.install_snapshot(snap).applied
            assert self.writer.install_snapshot(snap).applied

    def reader(self) -> SharedViewReader:
        return SharedViewReader(self.layout, SHARDS, self.writer.directory_name, edge="edge-us")

    def apply(self, events) -> int:
        for e in events:
            self.shards[e.key % SHARDS].apply([e])
        return self.flush()

    def flush(self) -> int:
        n = 0
        for s in self.shards:
            if (b := s.flush()) is not None:
                assert self.private.apply_next(b) is None
                assert self.writer.apply_next(b) is None
                n += 1
        return n

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()


def _answers(view, keys) -> list[np.ndarray]:
    return [view.view(s, g.group).lookup_many(keys) for s in range(SHARDS) for g in view.layout.groups]


def _segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shared_view.SEGMENT_DIR) if n.startswith(prefix))


ops_strategy = st.lists(
    st.tuples(st.sampled_from(WORKERS), st.integers(0, 400), st.sampled_from([Tier.VRAM, Tier.DRAM, None])),
    min_size=1, max_size=300)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(ops_strategy, min_size=1, max_size=6), fingerprint_bits=st.sampled_from([0, 6]))
def test_mapped_views_answer_as_the_private_view_through_growth(batches, fingerprint_bits):
    w = World(initial_capacity=16, fingerprint_bits=fingerprint_bits)  # small: batches grow the tables
    try:
        reader = w.reader()
        probe = np.arange(0, 1 << 62, (1 << 62) // 997, dtype=np.uint64)[:997]
        held: set[tuple[str, int]] = set()
        for ops in batches:
            events = []
            for worker, k, tier in ops:
                key = (k * 0x9E3779B97F4A7C15) % (1 << 63)
                if tier is None:
                    if (worker, key) in held:
                        events.append(PrefixEvicted(worker, key))
                        held.discard((worker, key))
                else:
                    events.append(PrefixCached(worker, key, tier))
                    held.add((worker, key))
            w.apply(events)
            start = reader.begin()
            keys = np.concatenate([probe, np.array([k for _, k in held] or [0], dtype=np.uint64)])
            for mine, theirs in zip(_answers(w.private, keys), _answers(reader, keys)):
                assert np.array_equal(mine, theirs)
            assert reader.valid(start)
            for s in range(SHARDS):
                assert w.writer.digests(s) == w.private.digests(s)  # the images export the same tables
                assert reader.position(s) == w.private.position(s)
    finally:
        w.close()
    assert _segments(w.writer.prefix) == []  # close() leaves nothing behind


def test_an_overflow_map_out_of_room_moves_the_view_to_a_bigger_image(monkeypatch):
    # No headroom beyond the minimum map: the first buckets needing big seeds fill it.
    monkeypatch.setattr(shared_view, "MIN_OVERFLOW_ROOM", 0)
    monkeypatch.setattr(shared_view, "OVERFLOW_ROOM_DIVISOR", 1 << 40)
    w = World(initial_capacity=40000)  # room for every key below: no growth rebuild
    try:
        reader = w.reader()
        keys = [int(k) for k in np.random.default_rng(3).integers(0, 1 << 62, 60000)]
        before = w.writer.images_written
        epochs = [v.epoch for s in w.writer.state for v in s.views.values()]
        for i in range(0, len(keys), 5000):
            w.apply(PrefixCached("us-1", k, Tier.VRAM) for k in keys[i:i + 5000])
        assert [v.epoch for s in w.writer.state for v in s.views.values()] == epochs  # no snapshot came
        assert w.writer.images_written > before  # in-place applies ran out of map room
        overflow = [v.overflow_count for s in w.writer.state for v in s.views.values()]
        assert max(overflow) > 13  # more than the smallest map (16 at load 0.85) could hold
        reader.begin()
        probe = np.array(keys[:20000], dtype=np.uint64)
        for mine, theirs in zip(_answers(w.private, probe), _answers(reader, probe)):
            assert np.array_equal(mine, theirs)
    finally:
        w.close()


def test_a_read_that_a_write_overlapped_is_invalid_and_one_during_a_write_never_starts(world):
    reader = world.reader()
    key = 12345 * 2  # shard 0
    start = reader.begin()
    assert reader.view(0, 0).lookup(key) == 0
    world.apply([PrefixCached("us-0", key, Tier.VRAM)])  # in place, in the mapped image
    assert not reader.valid(start)
    # A write in progress: the counter is odd, and no read that began then is ever valid.
    world.writer._begin()
    odd = int(shared_view.lib.kvc_seq_read_begin(reader._dir.seq_ptr))
    assert odd & 1 and not shared_view.lib.kvc_seq_read_valid(reader._dir.seq_ptr, odd)
    world.writer._end()
    start = reader.begin()
    assert reader.view(0, 0).lookup(key) != 0 and reader.valid(start)


def test_a_rebuilt_table_switches_readers_to_a_new_image_and_the_old_one_stays_whole(world):
    reader = world.reader()
    reader.begin()
    old = reader.view(0, 0)
    keys = [2 * k for k in range(1, 3000)]  # shard 0, enough to grow the 64-entry table
    world.apply(PrefixCached("us-2", k, Tier.DRAM) for k in keys[:10])
    reader.begin()
    assert reader.view(0, 0) is old  # records: in place, same image
    old_answers = old.lookup_many(keys)
    old_names = set(reader.mapped_names())
    world.apply(PrefixCached("us-2", k, Tier.DRAM) for k in keys)  # the table grows: a snapshot
    # Until it re-reads the directory, the reader's image is the retired one: unchanged, whole.
    assert reader.view(0, 0) is old and np.array_equal(old.lookup_many(keys), old_answers)
    reader.begin()
    assert reader.view(0, 0) is not old and reader.view(0, 0).slots > old.slots
    assert set(reader.mapped_names()) != old_names
    for name in old_names - set(reader.mapped_names()):
        assert not (shared_view.SEGMENT_DIR / name).exists()  # unlinked at the switch
    assert np.array_equal(reader.view(0, 0).lookup_many(keys), world.private.view(0, 0).lookup_many(keys))


def test_a_mapped_view_refuses_writes_and_bad_images():
    with pytest.raises(LudoError):
        MappedView.attach(bytearray(4096))  # no image magic
    w = World()
    try:
        view = w.writer.view(0, 0)
        with pytest.raises(LudoError):
            view.apply(b"")
        image = bytearray(view._image)
        image[8:16] = (len(image) + 64).to_bytes(8, "little")  # declares more bytes than there are
        with pytest.raises(LudoError):
            MappedView.attach(image)
    finally:
        w.close()


# -- several processes ---------------------------------------------------------------------------

PROMPTS = [np.random.default_rng(i).integers(0, 30000, n, dtype=np.uint32)
           for i, n in enumerate((2000, 1500, 900, 3000, 700, 2000))]


def _register(world: World, worker: str, tokens: np.ndarray, cached: int, tier=Tier.VRAM) -> None:
    plan = LevelPlan.from_config(world.cfg)
    keys = prefix_keys(tokens, plan.registration_lengths_upto(cached), namespace_salt(world.cfg.model))
    world.apply(PrefixCached(worker, int(k), tier) for k in keys)


def _requests() -> list[tuple[int, float]]:
    # Every prompt several times, with prompts sharing prefixes: hits, ties, queue charges.
    order = [0, 1, 2, 0, 3, 4, 5, 1, 0, 2, 3, 3, 5, 4, 0]
    return [(p, 0.005 * i) for i, p in enumerate(order)]


def _decisions(router: Router) -> list[tuple]:
    out = []
    for prompt, now in _requests():
        d = router.decide(PROMPTS[prompt], now=now)
        out.append((d.worker, d.claimed_tokens, int(d.tier), round(float(d.lam), 9)))
    return out


def _reader_process(directory: str, initial_capacity: int, conn) -> None:
    """A front-door process: maps the writer's view, decides the requests, reports, then waits
    (still mapping the view) until the parent has measured it."""
    cfg, layout, _ = _cluster(initial_capacity)
    reader = SharedViewReader(layout, SHARDS, directory, edge="edge-us")
    router = Router(cfg, "us", reader, now=0.0)
    share_router_view(router, reader)
    decisions = _decisions(router)
    # Read every page of every image, as a long-running front door eventually does.
    touched = 0
    for st_ in reader.state:
        for v in st_.views.values():
            touched += int(np.frombuffer(v._image, dtype=np.uint8)[::4096].sum() >= 0)
    conn.send((decisions, touched))
    conn.recv()


def _mapping_memory(pid: int, prefix: str) -> tuple[int, int]:
    """(Rss, Private_Clean + Private_Dirty) in bytes over a process's mappings of the segments."""
    rss = private = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) >= 6 and f"/{prefix}-" in head[5]
        elif inside and head[0] == "Rss:":
            rss += int(head[1]) * 1024
        elif inside and head[0] in ("Private_Clean:", "Private_Dirty:"):
            private += int(head[1]) * 1024
    return rss, private


def test_two_processes_decide_as_one_and_map_the_view_once():
    w = World(initial_capacity=200_000)  # ~1 MB of arrays per view: page counts are meaningful
    try:
        _register(w, "us-1", PROMPTS[0], 2000)
        _register(w, "eu-0", PROMPTS[1], 1500)
        _register(w, "us-2", PROMPTS[3], 1200, Tier.DRAM)
        _register(w, "us-0", PROMPTS[5], 1024)
        expected = _decisions(Router(w.cfg, "us", w.private, now=0.0))
        assert {d[0] for d in expected} >= {"us-1", "us-2"}  # the requests exercise hits
        ctx = multiprocessing.get_context("spawn")
        procs, conns = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_reader_process, args=(w.writer.directory_name, 200_000, child))
            p.start()
            procs.append(p)
            conns.append(parent)
        try:
            results = [c.recv() for c in conns]
            for decisions, touched in results:
                assert decisions == expected
                assert touched == SHARDS * len(w.layout.groups)
            image_bytes = w.writer.image_bytes()
            assert image_bytes > 3_000_000
            for p in procs:
                rss, private = _mapping_memory(p.pid, w.writer.prefix)
                assert rss >= 0.9 * image_bytes  # it did map and read the whole view...
                assert private <= 0.05 * image_bytes  # ...without a copy of its own
        finally:
            for c in conns:
                c.send("done")
            for p in procs:
                p.join(timeout=60)
        assert all(p.exitcode == 0 for p in procs)
    finally:
        w.close()


def _flipping_writer(layout_args, directory_conn, rounds: int) -> None:
    """Writes two states alternately: key set A held by us-0, then by us-1, batch after batch,
    growing the table on the way (snapshots and new images) and back."""
    cfg, layout, shards = _cluster(64)
    writer = SharedViewWriter(layout, SHARDS, edge="edge-us")
    for s in shards:
        writer.install_snapshot(s.snapshot())
    directory_conn.send(writer.directory_name)
    keys = [2 * k for k in range(1, 400)]  # shard 0
    op = {w: IndexEventColumns.from_events([PrefixCached(w, 2, Tier.VRAM)]).ops[:1] for w in ("us-0", "us-1")}
    evict = IndexEventColumns.evictions(np.array(keys, dtype=np.uint64))
    cached = IndexEventColumns(op["us-0"] * len(keys), np.array(keys, dtype="<u8").tobytes())
    again = IndexEventColumns(op["us-1"] * len(keys), np.array(keys, dtype="<u8").tobytes())
    for r in range(rounds):
        for worker, columns in (("us-0", cached), ("us-1", again), ("us-0", evict), ("us-1", evict)):
            shards[0].apply_columns(worker, columns)
            batch = shards[0].flush()
            assert writer.apply_next(batch) is None
        directory_conn.send(r)
    directory_conn.recv()
    writer.close()


def test_readers_never_see_a_torn_table_while_another_process_writes():
    """Every read a reader validates shows one of the writer's whole states: the key set held by
    nobody, by us-0, by both, or by us-1, all keys alike (the writer changes them in one batch)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    rounds = 30
    p = ctx.Process(target=_flipping_writer, args=(None, child, rounds))
    p.start()
    try:
        directory = parent.recv()
        cfg, layout, _ = _cluster(64)
        reader = SharedViewReader(layout, SHARDS, directory, edge="edge-us")
        keys = np.array([2 * k for k in range(1, 400)], dtype=np.uint64)
        seen: set[int] = set()
        done = -1
        while done < rounds - 1:
            start = reader.begin()
            values = reader.view(0, 0).lookup_many(keys)
            if not reader.valid(start):
                continue
            assert (values == values[0]).all(), "a validated read mixed two states of one batch"
            seen.add(int(values[0]))
            while parent.poll():
                done = parent.recv()
        assert seen  # (which states a reader catches depends on scheduling; wholeness does not)
        parent.send("done")
    finally:
        p.join(timeout=120)
    assert p.exitcode == 0


def test_segments_of_a_writer_killed_before_close_are_reaped_and_live_ones_kept():
    gone = multiprocessing.get_context("spawn").Process(target=os.getpid)
    gone.start()
    gone.join()
    dead = shared_view.SEGMENT_DIR / f"kvc-edge_us-{gone.pid}-0123abcd-dir"
    alive = shared_view.SEGMENT_DIR / f"kvc-edge_us-{os.getpid()}-0123abcd-dir"
    foreign = shared_view.SEGMENT_DIR / f"kvc-not-a-writer-{gone.pid}"
    metrics = shared_view.SEGMENT_DIR / f"kvc-edge_us-{gone.pid}-0123abcd-metrics"  # its front doors' files
    for path in (dead, alive, foreign):
        path.write_bytes(b"x")
    metrics.mkdir()
    (metrics / "counter_12.db").write_bytes(b"x")
    try:
        reaped = shared_view.reap_stale_segments()
        assert dead.name in reaped and metrics.name in reaped
        assert not dead.exists() and not metrics.exists() and alive.exists() and foreign.exists()
    finally:
        for path in (dead, alive, foreign):
            path.unlink(missing_ok=True)
        shutil.rmtree(metrics, ignore_errors=True)


def test_a_writer_stuck_inside_a_write_fails_reads_instead_of_hanging_them(world, monkeypatch):
    monkeypatch.setattr(shared_view, "WRITER_STALL_S", 0.05)
    reader = world.reader()
    world.writer._begin()  # as if the writer died inside a batch
    with pytest.raises(shared_view.SharedViewError, match="inside one write"):
        reader.begin()
    world.writer._end()
    reader.begin()


def test_no_shared_memory_refuses_the_install_or_batch_and_keeps_the_view(world, monkeypatch):
    import errno

    reader = world.reader()
    keys = [2 * k for k in range(1, 3000)]  # shard 0: enough to grow its 64-entry table
    world.apply(PrefixCached("us-0", k, Tier.VRAM) for k in keys[:20])
    reader.begin()
    before = reader.view(0, 0).lookup_many(keys)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_view.os, "posix_fallocate", full)
    for k in keys:
        world.shards[0].apply([PrefixCached("us-0", k, Tier.VRAM)])
    batch = world.shards[0].flush()  # the grown table: a snapshot blob, which needs a new image
    assert world.private.apply_next(batch) is None
    assert "no shared memory" in world.writer.apply_next(batch)
    snap = world.shards[0].snapshot()
    outcome = world.writer.install_snapshot(snap)
    assert not outcome.applied and "no shared memory" in outcome.reason
    assert world.writer.position(0) == (snap.epoch, snap.seq - 1)  # where it was
    reader.begin()
    assert np.array_equal(reader.view(0, 0).lookup_many(keys), before)  # the mapped view is untouched
    images = [n for n in _segments(world.writer.prefix) if not n.endswith("-dir")]
    assert images == sorted(world.writer._names.values())  # nothing half-made is left behind
    monkeypatch.undo()
    assert world.writer.install_snapshot(snap).applied  # the sync protocol's retry goes through
    reader.begin()
    assert np.array_equal(reader.view(0, 0).lookup_many(keys), world.private.view(0, 0).lookup_many(keys))


@settings(max_examples=200, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 191), st.integers(0, 255)), min_size=1, max_size=8))
def test_an_image_with_a_damaged_header_is_refused_or_read_within_its_bounds(edits):
    w = World(initial_capacity=64, fingerprint_bits=6)
    try:
        image = bytearray(w.writer.view(0, 0)._image)
        for at, value in edits:
            image[at] = value
        try:
            view = MappedView.attach(image)
        except LudoError:
            return
        # Accepted: every array it names lies inside the buffer, so any lookup stays in it.
        view.lookup_many(np.arange(0, 1 << 62, (1 << 62) // 2000, dtype=np.uint64))
    finally:
        w.close()
