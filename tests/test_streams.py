"""Per-edge-region update streams (kvcompassd.core.streams): an edge that follows only its region's
stream looks up the same holders and makes the same decisions as one that follows everything,
receives fewer updates, and keeps the sync protocol's gap detection and repair."""

from __future__ import annotations

import dataclasses
import random
import tomllib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompassd.core.config import parse_config
from kvcompassd.core.events import IndexEventColumns, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.keys import prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.messages import ResyncRequested
from kvcompassd.core.router import Router
from kvcompassd.core.streams import LengthFilter, ShardStreams, as_lengths
from kvcompassd.core.sync import EdgeSync, catch_up
from kvcompassd.sim.geo import DEPLOYMENTS, census_fleet, render_toml


def fleet(workers: int, regions: int, shards: int):
    spec = census_fleet(DEPLOYMENTS["census-128x16"], workers=workers, regions=regions, shards=shards)
    cfg = parse_config(tomllib.loads(render_toml(spec, over_budget=True)), spec.name)
    # 16 fingerprint bits: keyless false hits (which differ between any two tables) stay out of
    # the comparison; what is compared is what the tables hold.
    return dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, fingerprint_bits=16))


def streams_for(cfg, plan, layout):
    return [ShardStreams(layout, plan, s, cfg.shards, epoch=7, initial_capacity=64,
                         fingerprint_bits=cfg.index.fingerprint_bits) for s in range(cfg.shards)]


def register(streams, cfg, plan, salt, rng: random.Random, prompts: list[np.ndarray], rounds: int):
    """Workers cache random prompts' prefixes (every registration length they cover) and evict
    some; every event goes to its key's shard with its length."""
    held: dict[tuple[str, int], int] = {}  # (worker, key) -> length
    workers = [w.id for w in cfg.workers]
    for _ in range(rounds):
        worker = rng.choice(workers)
        tokens = rng.choice(prompts)[: rng.randrange(1, len(prompts[0]) + 1)]
        lengths = plan.registration_lengths_upto(len(tokens))
        if not lengths:
            continue
        keys = prefix_keys(tokens, lengths, salt)
        tier = rng.choice([Tier.VRAM, Tier.DRAM])
        events = [(PrefixCached(worker, int(k), tier), n) for k, n in zip(keys.tolist(), lengths)]
        if held and rng.random() < 0.3:  # evict a few of what some worker holds
            for (w, k) in rng.sample(sorted(held), min(len(held), 5)):
                events.append((PrefixEvicted(w, k), held.pop((w, k))))
        for event, n in events:
            if isinstance(event, PrefixCached):
                held[(event.worker, event.key)] = n
        for s, stream in enumerate(streams):
            mine = [(e, n) for e, n in events if e.key % cfg.shards == s]
            if mine:
                stream.apply([e for e, _ in mine], [n for _, n in mine])
    return held


def follow(view: EdgeIndexView, sync: EdgeSync, batches) -> None:
    for batch in batches:
        step = sync.on_batch(batch, now=0.0)
        assert step.applied, step.reason


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.integers(24, 96), regions=st.integers(16, 20), shards=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_a_regions_stream_gives_the_same_lookups_and_decisions_as_the_full_one(workers, regions, shards, seed):
    cfg = fleet(workers, regions, shards)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    longest = min(plan.max_length + 64, 40_000)
    prompts = [nprng.integers(0, 128_000, size=longest, dtype=np.uint32) for _ in range(4)]
    streams = streams_for(cfg, plan, layout)
    region = rng.choice(cfg.region_names())
    full_view, own_view = EdgeIndexView(layout, cfg.shards, edge="full"), EdgeIndexView(layout, cfg.shards, edge="own")
    full_sync, own_sync = EdgeSync(full_view), EdgeSync(own_view)
    for stream in streams:
        full_sync.on_snapshot(stream.full.snapshot(), now=0.0)
        own_sync.on_snapshot(stream.stream(region).snapshot(), now=0.0)
    full_router, own_router = Router(cfg, region, full_view, now=0.0), Router(cfg, region, own_view, now=0.0)
    salt = full_router.lookup.salt
    received = {"full": 0, "own": 0}
    found = 0
    for _ in range(3):
        register(streams, cfg, plan, salt, rng, prompts, rounds=15)
        for stream in streams:
            published = stream.flush()
            for key, view, sync in ((None, full_view, full_sync), (region, own_view, own_sync)):
                if key in published:
                    follow(view, sync, [published[key]])
                    received["full" if key is None else "own"] += sum(
                        len(blob) for _, blob in published[key].tables)
        for router in (full_router, own_router):
            for w in cfg.workers_in(region):
                router.queues.set_local(w.id, 0.0, now=0.0)
        for tokens in prompts + [nprng.integers(0, 128_000, size=3000, dtype=np.uint32)]:
            for cut in (len(tokens), len(tokens) // 3):
                a, b = full_router.lookup.lookup(tokens[:cut]), own_router.lookup.lookup(tokens[:cut])
                assert np.array_equal(a.matched, b.matched) and np.array_equal(a.tier, b.tier)
                found += int(a.matched.any())
                da, db = full_router.decide(tokens[:cut], now=1.0), own_router.decide(tokens[:cut], now=1.0)
                assert (da.worker, da.claimed_tokens, da.tier) == (db.worker, db.claimed_tokens, db.tier)
    assert received["own"] < received["full"]  # it received less: the lengths it never reads
    assert found  # holders were found, not just misses compared


def test_registered_keys_read_the_same_value_in_the_regions_table():
    """Below the decisions: every registered key at a length the region reads holds the full
    table's value in the region's table, and keys at other lengths are not there at all."""
    cfg = fleet(64, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng, nprng = random.Random(5), np.random.default_rng(5)
    prompts = [nprng.integers(0, 128_000, size=plan.max_length, dtype=np.uint32) for _ in range(4)]
    (stream,) = streams_for(cfg, plan, layout)
    salt = Router(cfg, cfg.region_names()[0], EdgeIndexView(layout, 1, edge="x"), now=0.0).lookup.salt
    held = register([stream], cfg, plan, salt, rng, prompts, rounds=60)
    stream.flush()
    keys_of_full, values_of_full = {}, {}
    for g, (keys, values) in stream.full.group_items().items():
        keys_of_full[g] = dict(zip(keys.tolist(), values.tolist()))
        values_of_full[g] = values
    length_of = {k: n for (_, k), n in held.items()}
    checked = 0
    for region in cfg.region_names():
        shard = stream.stream(region)
        filt = stream.filters[region]
        for g, (keys, values) in shard.group_items().items():
            mine = dict(zip(keys.tolist(), values.tolist()))
            for key, value in keys_of_full[g].items():
                if length_of[key] in filt.per_group[g]:
                    assert mine.get(key) == value
                    checked += 1
                else:
                    assert key not in mine
    assert checked > 0


def test_a_filtered_stream_repairs_gaps_with_its_own_sequence_numbers():
    """Loss on a region's stream: the follower sees the gap in that stream's numbering, asks
    that stream's shard, and ends byte-identical to it (replay, then a snapshot once the replay
    log is gone); the full stream's numbering is another one."""
    cfg = fleet(48, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng, nprng = random.Random(11), np.random.default_rng(11)
    prompts = [nprng.integers(0, 128_000, size=plan.max_length, dtype=np.uint32) for _ in range(4)]
    stream = ShardStreams(layout, plan, 0, 1, epoch=3, initial_capacity=64, replay_batches=4,
                          fingerprint_bits=cfg.index.fingerprint_bits)
    region = cfg.region_names()[1]
    mine = stream.stream(region)
    view = EdgeIndexView(layout, 1, edge="e")
    sync = EdgeSync(view)
    sync.on_snapshot(mine.snapshot(), now=0.0)
    salt = Router(cfg, region, view, now=0.0).lookup.salt
    lost_replayable = lost_forever = 0
    for i in range(30):
        register([stream], cfg, plan, salt, rng, prompts, rounds=3)
        published = stream.flush()
        batch = published.get(region)
        if batch is None:
            continue
        assert batch.seq == mine.seq  # numbered in the region's stream
        if i in (4, 5):
            lost_replayable += 1
            continue
        if 12 <= i < 22:
            lost_forever += 1
            continue
        step = sync.on_batch(batch, now=float(i))
        if step.send is not None:
            assert isinstance(step.send, ResyncRequested)
            answer = catch_up(mine, step.send.epoch, step.send.from_seq)
            assert answer.published is None
            for message in answer.messages:
                if message.__class__.__name__ == "ShardSnapshotSent":
                    sync.on_snapshot(message, now=float(i))
                else:
                    sync.on_batch(message, now=float(i))
    assert lost_replayable and lost_forever
    assert sync.gaps >= 2 and sync.followers[0].snapshots_installed >= 1
    assert view.position(0) == (mine.epoch, mine.seq)
    assert view.digests(0) == mine.digests()
    assert stream.full.seq != mine.seq or stream.full.digests() != mine.digests()


def test_a_blob_of_another_stream_is_refused_as_foreign():
    cfg = fleet(32, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    stream = ShardStreams(layout, plan, 0, 1, epoch=1, initial_capacity=256)
    a, b = cfg.region_names()[:2]
    view = EdgeIndexView(layout, 1, edge="e")
    sync = EdgeSync(view)
    sync.on_snapshot(stream.stream(a).snapshot(), now=0.0)
    worker = cfg.workers_in(b)[0].id
    lengths = LengthFilter.for_edge_region(plan, layout, a).per_group[layout.slot(worker).group]
    stream.apply([PrefixCached(worker, 12345, Tier.VRAM)], [lengths[0]])
    published = stream.flush()
    other = dataclasses.replace(published[None], seq=1)
    step = sync.on_batch(other, now=0.0)
    assert not step.applied and "another table" in step.reason
    assert sync.on_batch(published[a], now=0.0).applied


def test_lengths_are_checked_and_unknown_lengths_pass_every_filter():
    cfg = fleet(32, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    with pytest.raises(ValueError):
        as_lengths([1, 2], 3)
    with pytest.raises(ValueError):
        as_lengths([-1], 1)
    with pytest.raises(ValueError):
        as_lengths([1.5], 1)
    with pytest.raises(ValueError):
        LengthFilter("x", ((32, 16),))
    stream = ShardStreams(layout, plan, 0, 1, epoch=1, initial_capacity=256)
    worker = cfg.workers[0].id
    stream.apply([PrefixCached(worker, 99, Tier.VRAM)])  # no lengths: an older agent
    assert all(s.entries() == 1 for s in stream.filtered.values())
    never = plan.max_length + 1  # no region reads it
    stream.apply([PrefixCached(worker, 100, Tier.VRAM)], [never])
    assert stream.full.entries() == 2 and all(s.entries() == 1 for s in stream.filtered.values())


def test_columns_and_event_objects_fill_the_streams_alike():
    cfg = fleet(48, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng = random.Random(2)
    by_objects, by_columns = (ShardStreams(layout, plan, 0, 1, epoch=1, initial_capacity=256) for _ in range(2))
    registered = plan.registration_lengths()
    for worker in [w.id for w in cfg.workers][:12]:
        events = [PrefixCached(worker, rng.randrange(1 << 63), rng.choice([Tier.VRAM, Tier.DRAM])) for _ in range(80)]
        lengths = [rng.choice(registered) if rng.random() < 0.9 else 0 for _ in events]
        events += [PrefixEvicted(worker, e.key) for e in events[:20]]
        lengths += lengths[:20]
        by_objects.apply(events, lengths)
        by_columns.apply_columns(worker, IndexEventColumns.from_events(events), np.array(lengths, dtype=np.uint32))
    for region in [None, *cfg.region_names()]:
        assert by_objects.stream(region).digests() == by_columns.stream(region).digests()
    assert by_columns.stream(cfg.region_names()[0]).entries() < by_columns.full.entries()


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.integers(24, 64), shards=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       reports=st.integers(4, 24), capacity=st.sampled_from([4, 64]), scaled=st.booleans())
def test_one_c_call_per_report_fills_every_stream_as_event_by_event(workers, shards, seed, reports, capacity, scaled):
    """``apply_columns`` (the full table and every region's stream in one C call per report)
    against ``apply`` (event objects, one stream at a time): the same full-shard outcomes, the
    same ``applied`` counts, and byte-identical batches from every stream at every flush. Reports
    mix registrations, tier moves and evictions (some refused: never registered), lengths of
    every kind (read by some regions, by none, unknown) and, with several shards, now and then a
    key of another shard (the checking path); tables that start tiny grow on the way (a batch
    then carries a snapshot of the grown table)."""
    cfg = fleet(workers, 16, shards)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng = random.Random(seed)
    shard = rng.randrange(shards)
    routed, by_objects = (ShardStreams(layout, plan, shard, shards, epoch=3, initial_capacity=capacity,
                                       scale_filtered_capacity=scaled, fingerprint_bits=cfg.index.fingerprint_bits)
                          for _ in range(2))
    registered = plan.registration_lengths()
    never = plan.max_length + 1  # no region reads it
    pool = [k for k in (rng.randrange(1 << 63) for _ in range(4000)) if k % shards == shard][:150]
    stray = next(k for k in (rng.randrange(1 << 63) for _ in range(100)) if k % shards != shard) if shards > 1 else None
    length_of = {k: rng.choice(registered) for k in pool}  # a key has one length, as the agents report it
    workers_ = [w.id for w in cfg.workers] + ["no-such-worker"]
    flushes = 0
    for r in range(reports):
        worker = rng.choice(workers_) if rng.random() < 0.1 else rng.choice(workers_[:-1])
        events, lengths = [], []
        for _ in range(rng.randrange(1, 60)):
            key = rng.choice(pool)
            kind = rng.random()
            if kind < 0.55:
                events.append(PrefixCached(worker, key, rng.choice([Tier.VRAM, Tier.DRAM])))
            elif kind < 0.75:
                events.append(TierChanged(worker, key, rng.choice([Tier.VRAM, Tier.DRAM])))
            else:
                events.append(PrefixEvicted(worker, key))
            pick = rng.random()
            lengths.append(0 if pick < 0.1 else never if pick < 0.15 else length_of[key])
        if stray is not None and rng.random() < 0.15:
            at = rng.randrange(len(events) + 1)
            events.insert(at, PrefixCached(worker, stray, Tier.VRAM))
            lengths.insert(at, rng.choice(registered))
        want = by_objects.apply(events, lengths)
        got = routed.apply_columns(worker, IndexEventColumns.from_events(events, lengths))
        assert got == want
        assert routed.applied == by_objects.applied
        if rng.random() < 0.4 or r == reports - 1:
            a, b = routed.flush(), by_objects.flush()
            assert a == b  # every stream's batch: the same positions, table ids and record bytes
            flushes += len(a)
    for region in [None, *routed.filtered]:
        assert routed.stream(region).digests() == by_objects.stream(region).digests()
        assert routed.stream(region).snapshot() == by_objects.stream(region).snapshot()
    assert flushes and routed.applied[None] > 0


@pytest.mark.slow
def test_at_1024_by_64_each_region_receives_far_fewer_updates_for_the_same_decisions():
    """The issue's fleet size (one shard: the filter does not depend on the shard count): edges of
    three regions follow their regions' streams beside an edge following everything, and decide
    alike on the registered prompts and fresh ones, on at most a quarter of the updates."""
    cfg = fleet(1024, 64, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    rng, nprng = random.Random(1), np.random.default_rng(1)
    prompts = [nprng.integers(0, 128_000, size=min(plan.max_length, 24_000), dtype=np.uint32) for _ in range(8)]
    (stream,) = streams_for(cfg, plan, layout)
    regions = cfg.region_names()[:: len(cfg.region_names()) // 3][:3]
    views = {r: EdgeIndexView(layout, 1, edge=f"edge-{r}") for r in [None, *regions]}
    syncs = {r: EdgeSync(v) for r, v in views.items()}
    for r, sync in syncs.items():
        sync.on_snapshot(stream.stream(r).snapshot(), now=0.0)
    salt = Router(cfg, regions[0], views[None], now=0.0).lookup.salt
    register([stream], cfg, plan, salt, rng, prompts, rounds=120)
    published = stream.flush()
    for r, sync in syncs.items():
        follow(views[r], sync, [published[r]])
    found = 0
    for r in regions:
        assert stream.applied[r] * 4 <= stream.applied[None]
        full, own = Router(cfg, r, views[None], now=0.0), Router(cfg, r, views[r], now=0.0)
        for router in (full, own):
            for w in cfg.workers_in(r):
                router.queues.set_local(w.id, 0.0, now=0.0)
        for tokens in prompts + [nprng.integers(0, 128_000, size=5000, dtype=np.uint32)]:
            for cut in (len(tokens), len(tokens) // 4):
                a, b = full.lookup.lookup(tokens[:cut]), own.lookup.lookup(tokens[:cut])
                assert np.array_equal(a.matched, b.matched) and np.array_equal(a.tier, b.tier)
                found += int(a.matched.any())
                da, db = full.decide(tokens[:cut], now=1.0), own.decide(tokens[:cut], now=1.0)
                assert (da.worker, da.claimed_tokens) == (db.worker, db.claimed_tokens)
    assert found >= len(regions) * len(prompts)  # holders were found, not just misses compared


# -- the maintenance unit's send side (StreamFanout), without sockets ------------------------------


def small_cluster(**sync):
    from kvcompassd.launcher import DeploymentSpec, build_cluster

    cfg = build_cluster(DeploymentSpec(shards=1, wan=False))
    return dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, **sync)) if sync else cfg


def test_each_edge_gets_the_stream_of_the_region_its_identity_names():
    """Three edges subscribe; a us worker caches a short prefix (64 tokens: read only inside us)
    and a long one (read from every region). edge-us's stream carries both, edge-eu's only the
    long one, edge-asia (named in full_stream_edges) the full stream; each edge's view ends
    equal to its stream, and the eu edge applied fewer entries than the full stream holds."""
    from kvcompassd.core.streams import StreamFanout, stream_regions

    cfg = small_cluster(full_stream_edges=("edge-asia",))
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    streams = ShardStreams(layout, plan, 0, 1, epoch=5, regions=stream_regions(cfg), initial_capacity=64)
    assert sorted(streams.filtered) == ["eu", "us"]  # asia's only edge follows the full stream
    fanout = StreamFanout(cfg, streams)
    views = {e.id: EdgeIndexView(layout, 1, edge=e.id) for e in cfg.edges}
    syncs = {edge: EdgeSync(view) for edge, view in views.items()}
    for edge in views:
        fanout.subscribe(edge, edge)  # the handle: here the edge's name
        syncs[edge].on_snapshot(fanout.shard_of(edge).snapshot(), now=0.0)
    assert fanout.followers() == {"us": ["edge-us"], "eu": ["edge-eu"], "full": ["edge-asia"]}
    short = 64
    assert short not in plan.lengths_toward("eu", "us") and short in plan.lengths_toward("us", "us")
    long_ = plan.lengths_toward("eu", "us")[0]
    columns = IndexEventColumns.from_events([PrefixCached("us-0", 11, Tier.VRAM), PrefixCached("us-0", 12, Tier.DRAM)],
                                            [short, long_])
    streams.apply_columns("us-0", columns)
    published = streams.flush()
    got = {edge: stream for edge, _, stream in fanout.deliveries(published)}
    assert got == {"edge-us": "us", "edge-eu": "eu", "edge-asia": None}
    for _edge, handle, stream in fanout.deliveries(published):
        assert syncs[handle].on_batch(published[stream], now=0.0).applied
    for edge, view in views.items():
        assert view.digests(0) == fanout.shard_of(edge).digests()
    assert streams.stream("eu").entries() == 1 and streams.stream("us").entries() == 2 and streams.full.entries() == 2
    # Only a short prefix changes: edge-eu's stream publishes nothing, so edge-eu gets nothing.
    streams.apply_columns("us-0", IndexEventColumns.from_events([PrefixCached("us-0", 13, Tier.VRAM)], [short]))
    published = streams.flush()
    assert sorted(edge for edge, _, _ in fanout.deliveries(published)) == ["edge-asia", "edge-us"]


def test_an_edge_not_in_the_config_follows_no_stream_and_full_mode_sends_everyone_the_full_one():
    from kvcompassd.core.streams import StreamFanout, UnknownEdge, edge_stream, stream_regions

    cfg = small_cluster()
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    streams = ShardStreams(layout, plan, 0, 1, epoch=1, regions=stream_regions(cfg), initial_capacity=64)
    fanout = StreamFanout(cfg, streams)
    with pytest.raises(UnknownEdge, match="edge-probe.*not in this cluster's config"):
        fanout.subscribe("edge-probe", object())
    assert fanout.edges == []
    assert [edge_stream(cfg, e.id) for e in cfg.edges] == ["us", "eu", "asia"]
    full = small_cluster(edge_streams="full")
    assert stream_regions(full) == [] and {edge_stream(full, e.id) for e in full.edges} == {None}
    # A unit built for other regions (a config that changed under it) refuses rather than guess.
    partial = ShardStreams(layout, plan, 0, 1, epoch=1, regions=["us"], initial_capacity=64)
    with pytest.raises(UnknownEdge, match="no update stream for region 'eu'"):
        StreamFanout(cfg, partial).stream_of("edge-eu")
    # A reconnection replaces the handle; a stale handle's disconnection does not unsubscribe.
    old, new = object(), object()
    fanout.subscribe("edge-us", old)
    fanout.subscribe("edge-us", new)
    assert not fanout.unsubscribe("edge-us", old) and fanout.handle("edge-us") is new
    assert fanout.unsubscribe("edge-us", new) and fanout.edges == []


def test_catch_ups_come_from_the_stream_the_edge_follows():
    """An edge that missed batches of its region's stream is answered from that stream's replay
    log (its seq numbers), and a new one gets that stream's snapshot."""
    from kvcompassd.core.streams import StreamFanout, stream_regions

    cfg = small_cluster()
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    streams = ShardStreams(layout, plan, 0, 1, epoch=9, regions=stream_regions(cfg), initial_capacity=64)
    fanout = StreamFanout(cfg, streams)
    view = EdgeIndexView(layout, 1, edge="edge-eu")
    sync = EdgeSync(view)
    sub = sync.subscription(0, now=0.0)
    answer = catch_up(fanout.shard_of("edge-eu"), sub.epoch, sub.seq + 1)
    assert answer.snapshot is not None and sync.on_snapshot(answer.snapshot, now=0.0).applied
    fanout.subscribe("edge-eu", "edge-eu")
    far = plan.lengths_toward("eu", "us")
    for i in range(6):
        streams.apply_columns("us-1", IndexEventColumns.from_events(
            [PrefixCached("us-1", 100 + i, Tier.VRAM), PrefixCached("us-1", 200 + i, Tier.VRAM)], [64, far[i]]))
        published = streams.flush()
        if i in (1, 2):
            continue  # lost on the way
        step = sync.on_batch(published["eu"], now=float(i))
        if step.send is not None:
            answer = catch_up(fanout.shard_of("edge-eu"), step.send.epoch, step.send.from_seq)
            assert answer.snapshot is None and [b.seq for b in answer.replay] == [2, 3, 4]
            for batch in answer.replay:
                sync.on_batch(batch, now=float(i))
    assert view.position(0) == (9, streams.stream("eu").seq) == (9, 6)
    assert view.digests(0) == streams.stream("eu").digests()
    assert streams.stream("eu").entries() == 6 and streams.full.entries() == 12


def test_with_relay_a_units_live_batches_go_to_one_edge_per_region_and_stream():
    """[sync] relay: three edges per region, one of them per region on the full stream; the unit
    sends each stream's batch to the first subscribed edge of each (stream, region) only, the
    others get it from that edge (relays_to), and when it leaves the next one takes over."""
    from kvcompassd.core.streams import StreamFanout, relays_to, stream_regions
    from kvcompassd.launcher import DeploymentSpec, build_cluster

    cfg = build_cluster(DeploymentSpec(shards=1, wan=False, edges_per_region=3))
    cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, full_stream_edges=("edge-us-2", "edge-eu-2",
                                                                                  "edge-asia-1", "edge-asia-2")))
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    streams = ShardStreams(layout, plan, 0, 1, epoch=1, regions=stream_regions(cfg), initial_capacity=64)
    fanout = StreamFanout(cfg, streams)
    for edge in reversed([e.id for e in cfg.edges]):  # subscription order does not pick the relay
        fanout.subscribe(edge, edge)
    assert fanout.live_edges() == {"us": ["edge-us"], "eu": ["edge-eu"], "asia": ["edge-asia"],
                                   None: ["edge-us-2", "edge-eu-2", "edge-asia-1"]}
    assert relays_to(cfg, "edge-us") == ["edge-us-1"] and relays_to(cfg, "edge-us-2") == []
    assert relays_to(cfg, "edge-asia-1") == ["edge-asia-2"]  # asia's two full-stream edges
    streams.apply_columns("us-0", IndexEventColumns.from_events([PrefixCached("us-0", 5, Tier.VRAM)], [64]))
    published = streams.flush()
    sent = sorted(edge for edge, _, _ in fanout.deliveries(published))
    assert sent == ["edge-asia-1", "edge-eu-2", "edge-us", "edge-us-2"]  # 4 sends for 9 edges
    fanout.unsubscribe("edge-us")
    assert fanout.live_edges()["us"] == ["edge-us-1"]
    unrelayed = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, relay=False))
    assert relays_to(unrelayed, "edge-us") == []
    plain = StreamFanout(unrelayed, streams)
    for edge in [e.id for e in cfg.edges]:
        plain.subscribe(edge, edge)
    assert len(plain.deliveries(published)) == 6  # every follower of a stream that published


def test_a_regions_tables_can_start_at_the_share_of_lengths_it_reads_and_hold_the_same():
    cfg = fleet(64, 16, 1)
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    capacities = tuple(4096 + 64 * g.group for g in layout.groups)
    scaled, same = (ShardStreams(layout, plan, 0, 1, epoch=1, initial_capacity=capacities, fingerprint_bits=16,
                                 scale_filtered_capacity=scale) for scale in (True, False))
    region = cfg.region_names()[0]
    registered = len(plan.registration_lengths())
    for g, stats in enumerate(scaled.stream(region).table_stats()):
        assert stats["memory_bytes"] < same.stream(region).table_stats()[g]["memory_bytes"]
        assert len(scaled.filters[region].per_group[g]) < registered
    assert scaled.full.table_stats() == same.full.table_stats()
    rng = random.Random(3)
    for worker in [w.id for w in cfg.workers][:16]:
        keys = [rng.randrange(1 << 62) for _ in range(300)]
        lengths = [rng.choice(plan.registration_lengths()) for _ in keys]
        columns = IndexEventColumns.from_events([PrefixCached(worker, k, Tier.VRAM) for k in keys], lengths)
        for streams in (scaled, same):
            streams.apply_columns(worker, columns)
    for streams in (scaled, same):
        streams.flush()
    for g, (keys, values) in scaled.stream(region).group_items().items():  # the same content, grown as needed
        other_keys, other_values = same.stream(region).group_items()[g]
        assert dict(zip(keys.tolist(), values.tolist())) == dict(zip(other_keys.tolist(), other_values.tolist()))
