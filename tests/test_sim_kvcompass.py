"""KVCompass in the simulator: the policy adapter over the real core (shards, edge views, routers,
block trees), its update transport with loss and repair, ablations, and determinism."""

from __future__ import annotations

import numpy as np
import pytest

from clusters import make_cluster
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.keys import prefix_keys
from kvcompassd.core.ludo import LudoView
from kvcompassd.core.migration import HOT_MISS_OUTCOMES
from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.engine.kvevents import BlockStored
from kvcompassd.sim.engine import SimSettings, simulate
from kvcompassd.sim.kvcompass_policy import KVCompassPolicy
from kvcompassd.sim.policy import (FALSE_INDEX_BEHIND, FALSE_KEYLESS, FALSE_PENDING, FALSE_VIEW_AHEAD, FALSE_VIEW_BEHIND,
                                   BasePolicy, PolicyError, RouteDecision, Topology)
from kvcompassd.sim.workloads import Request

BLOCK = 16


def _topo(shards: int = 2, **kw) -> Topology:
    cfg = make_cluster({"us": 3, "eu": 2}, shards=shards, one_way_ms=20.0, prefill_ms_per_token=0.1,
                       levels=4, same_region_min_tokens=32, **kw)
    return Topology.from_config(cfg)


def _prompt(seed: int, n: int = 1200) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n, dtype=np.uint32)


def _cache() -> PrefixCache:
    return PrefixCache(block_size=BLOCK, vram_tokens=1 << 20, dram_tokens=1 << 20)


def _request(rid: int, tokens: np.ndarray, region: str, at: float = 1.0) -> Request:
    return Request(rid, at, region, rid, tokens, 8)


def _assert_views_equal_shards(policy: KVCompassPolicy, probe: np.ndarray) -> None:
    """Every edge view answers every probe key exactly as a view built from the shard's state."""
    for s, shard in enumerate(policy.shards):
        snap = shard.snapshot()
        for view in policy.views:
            assert view.position(s) == (shard.epoch, shard.seq)
            for group, blob in snap.tables:
                fresh = LudoView.from_snapshot(blob).lookup_many(probe)
                assert np.array_equal(view.view(s, group).lookup_many(probe), fresh)


def test_a_prefix_cached_through_real_block_events_is_routed_to_its_holder():
    topo = _topo()
    policy = KVCompassPolicy(topo, wan_propagation=False)
    prompt = _prompt(1)
    holder = topo.worker_ids.index("us-1")
    policy.on_cache_events(holder, _cache().insert(prompt.tolist(), now=0.0), now=0.0)
    decision = policy.route(_request(0, prompt, "us"), now=1.0)
    assert decision.worker_index == holder
    # Credited with the longest own-region length the prompt covers.
    fits = [n for n in policy.plan.lengths_toward("us", "us") if n <= len(prompt)]
    assert decision.claimed_tokens == fits[-1]
    # A different prompt finds no holder and does not claim anything.
    assert policy.route(_request(1, _prompt(2), "us"), now=1.0).claimed_tokens == 0


def test_hand_made_block_events_register_a_remote_holder_after_the_wan_propagation():
    topo = _topo()
    policy = KVCompassPolicy(topo)  # wan_propagation: updates cross the WAN like the daemon's
    prompt = _prompt(3)
    tokens = prompt.tolist()
    events = [BlockStored((i + 1,), i or None, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), BLOCK, None, "GPU")
              for i in range(len(tokens) // BLOCK)]
    holder = topo.worker_ids.index("eu-0")
    policy.on_cache_events(holder, events, now=0.0)
    # Nothing has reached the us edge yet: the update is still crossing the WAN.
    assert policy.route(_request(0, prompt, "us", 0.0), now=0.0).claimed_tokens == 0
    assert policy.in_flight > 0
    t = policy.next_timer()
    while policy.in_flight:
        policy.on_timer(now=t)
        t = policy.next_timer()
    # (At 2.5 s the us edge's own credit for where it sent request 0 has expired: ready after
    # that worker's 120 ms prefill, held 1 s more.)
    decision = policy.route(_request(1, prompt, "us"), now=2.5)
    assert decision.worker_index == holder and decision.claimed_tokens > 0


def test_a_shard_read_between_a_delivery_and_its_flush_has_the_delivery_applied():
    """Deliveries wait in the shard's inbox until its flush; anything that reads the shard
    before then (stats, explain_claim, a resync) sees them applied, as when each delivery was
    applied on arrival (flush_interval_ms=0 publishes every delivery at once)."""
    topo = _topo()
    prompt, holder = _prompt(13), topo.worker_ids.index("eu-0")
    events = _cache().insert(prompt.tolist(), now=0.0)
    batched = KVCompassPolicy(topo, flush_interval_ms=50.0)
    at_once = KVCompassPolicy(topo, flush_interval_ms=0.0)
    for policy in (batched, at_once):
        policy.on_cache_events(holder, events, now=0.0)
        policy.on_timer(now=0.03)  # past the 20 ms agent -> shard leg, before the 50 ms flush
    assert batched.unapplied_deliveries() > 0  # delivered and not applied yet
    entries = at_once.stats()["index_entries"]
    assert entries > 0 and batched.stats()["index_entries"] == entries
    assert batched.unapplied_deliveries() == 0
    for a, b in zip(batched.shards, at_once.shards):
        assert a.group_items().keys() == b.group_items().keys()
        for g, (keys, values) in a.group_items().items():
            assert dict(zip(keys.tolist(), values.tolist())) == dict(zip(*(x.tolist() for x in b.group_items()[g])))


def test_a_false_claim_is_explained_by_the_index_that_was_behind():
    topo = _topo()
    # Updates cross the WAN: agent -> shard -> edge views take time. Per-edge views, whose
    # deliveries are timer events this test can step through (shared views apply them when read).
    policy = KVCompassPolicy(topo, shared_views=False)
    policy.on_truth_tracked()  # what the engine does when it keeps the exact cache map
    prompt, holder = _prompt(11), topo.worker_ids.index("eu-0")
    cache = _cache()
    policy.on_cache_events(holder, cache.insert(prompt.tolist(), now=0.0), now=0.0)
    t = policy.next_timer()
    while policy.in_flight:
        policy.on_timer(now=t)
        t = policy.next_timer()
    length = policy.plan.lengths_toward_upto("us", "eu", len(prompt))[-1]
    claim = RouteDecision(holder, 0.0, length)
    req = _request(0, prompt, "us")
    # Every index lists the worker: had it held less, its eviction had not reached the index.
    assert policy.explain_claim(req, claim, now=1.0) == FALSE_INDEX_BEHIND
    # The worker evicts it; the shard applies that, and the us view is a batch behind for a while.
    policy.on_cache_events(holder, cache.flush(), now=1.0)
    seen, t = [], policy.next_timer()
    while policy.in_flight:
        policy.on_timer(now=t)
        seen.append(policy.explain_claim(req, claim, now=t))
        t = policy.next_timer()
    assert FALSE_VIEW_BEHIND in seen
    # Once the view has caught up, a claim the index does not back is the keyless table's false hit.
    assert seen[-1] == FALSE_KEYLESS
    # A worker that never held the prefix is a keyless false hit even while the view is behind
    # the shard on other changes: only the batch carrying this worker's eviction matters.
    s = int(prefix_keys(prompt, [length], policy._salt)[0]) % policy.n_shards
    shard, us_view = policy.shards[s], policy.views[policy.regions.index("us")]
    policy.on_cache_events(holder, cache.insert(_prompt(12).tolist(), now=t), now=t)
    while us_view.position(s)[1] == shard.seq:  # until the shard has published past the view
        t = policy.next_timer()
        policy.on_timer(now=t)
    never = RouteDecision(topo.worker_ids.index("eu-1"), 0.0, length)
    assert policy.explain_claim(req, never, now=t) == FALSE_KEYLESS
    assert BasePolicy.explain_claim(policy, req, claim, now=t) == FALSE_VIEW_AHEAD  # undiagnosed default


def test_a_false_claim_of_the_pending_ledger_is_put_down_to_it():
    topo = _topo()
    policy = KVCompassPolicy(topo, wan_propagation=False)
    prompt = _prompt(13)
    first = policy.route(_request(0, prompt, "us"), now=0.0)
    assert first.claimed_tokens == 0
    # No engine here: the worker never reports caching it. Once its response (the first token)
    # reached the edge, the edge credits it anyway, and a false claim that follows is the
    # ledger's, not the index's.
    policy.on_response(first.worker_index, _request(0, prompt, "us"), 0, {}, now=0.2)
    again = policy.route(_request(1, prompt, "us"), now=0.5)
    assert again.worker_index == first.worker_index and again.claimed_tokens > 0
    assert policy.explain_claim(_request(1, prompt, "us"), again, now=0.5) == FALSE_PENDING


def _lossy_rounds(policy: KVCompassPolicy, rounds: int, *, start: int = 0) -> list[np.ndarray]:
    caches = [_cache() for _ in policy.worker_ids]
    prompts = []
    for i in range(start, start + rounds):
        w = i % len(caches)
        prompt = _prompt(100 + i, 200 + 16 * (i % 7))
        prompts.append(prompt)
        t = 0.01 * i
        policy.on_cache_events(w, caches[w].insert(prompt.tolist(), now=t), now=t)
        if i % 5 == 4:  # evictions too, so views must also forget
            policy.on_cache_events(w, caches[w].flush(), now=t)
    return prompts


def test_lost_batches_are_repaired_by_resync_and_views_converge_to_the_shards():
    policy = KVCompassPolicy(_topo(shards=3), update_loss=0.4, update_delay_ms=5.0, seed=7)
    prompts = _lossy_rounds(policy, 60)
    assert policy.counters["batches_lost"] > 0
    # The stream goes on without loss until every shard has published again: its next batch
    # shows each edge the gap, and the resync repairs it.
    policy.update_loss = 0.0
    seqs = [s.seq for s in policy.shards]
    extra = 0
    while any(s.seq == q for s, q in zip(policy.shards, seqs)):
        _lossy_rounds(policy, 1, start=1000 + extra)
        extra += 1
    policy.settle(now=100.0)
    assert policy.counters["resyncs"] > 0 and policy.counters["replays"] > 0
    keys = np.concatenate([np.array(list(t.registered()), dtype=np.uint64) for t in policy.trees]
                          + [np.random.default_rng(0).integers(0, 1 << 63, 2000, dtype=np.uint64)])
    _assert_views_equal_shards(policy, keys)
    assert prompts  # the rounds did register prefixes
    assert sum(s.entries() for s in policy.shards) > 0


def test_a_lost_last_batch_is_repaired_by_the_position_heartbeat_without_a_later_batch():
    """Loss goes on and no shard publishes again: only the idle shards' position announcements
    (lost as batches are, and repeated) show an edge that it lost a shard's last batches.
    Without them (``position_heartbeat_ms=0``) some edge stays behind for good."""
    positions = {}
    for heartbeat_ms in (1000.0, 0.0):
        policy = KVCompassPolicy(_topo(shards=3), update_loss=0.4, update_delay_ms=5.0, seed=7,
                                 position_heartbeat_ms=heartbeat_ms)
        _lossy_rounds(policy, 60)
        policy.settle(now=100.0)
        positions[heartbeat_ms] = [[view.position(s) for view in policy.views] for s in range(len(policy.shards))]
        shards = [(shard.epoch, shard.seq) for shard in policy.shards]
        if heartbeat_ms:
            assert policy.counters["positions_announced"] > 0
            assert sum(f.position_gaps for sync in policy.syncs for f in sync.followers) > 0
            keys = np.concatenate([np.array(list(t.registered()), dtype=np.uint64) for t in policy.trees])
            _assert_views_equal_shards(policy, keys)
        else:
            assert policy.counters["positions_announced"] == 0
            assert any(p != shards[s] for s, row in enumerate(positions[0.0]) for p in row)
    with pytest.raises(PolicyError, match="position_heartbeat_ms"):
        KVCompassPolicy(_topo(), position_heartbeat_ms=-1.0)


def test_without_repair_the_edge_skips_gaps_and_never_resyncs_them():
    policy = KVCompassPolicy(_topo(shards=3), update_loss=0.4, repair=False, seed=7)
    _lossy_rounds(policy, 60)
    policy.settle(now=100.0)
    assert policy.counters["batches_lost"] > 0 and policy.stats()["gaps_skipped"] > 0
    assert policy.counters["replays"] == 0
    # Skipping keeps each view at its shard's position (the latest batch applied) even though
    # the lost batches' contents were never delivered.
    for s, shard in enumerate(policy.shards):
        for view in policy.views:
            epoch, seq = view.position(s)
            assert epoch == shard.epoch and seq <= shard.seq


def test_no_cross_region_ablation_never_routes_remote():
    topo = _topo()
    full = KVCompassPolicy(topo, wan_propagation=False)
    local_only = KVCompassPolicy(topo, ablation=Ablation(cross_region=False), wan_propagation=False)
    prompt = _prompt(9, 3000)
    holder = topo.worker_ids.index("eu-1")
    events = _cache().insert(prompt.tolist(), now=0.0)
    for policy in (full, local_only):
        policy.on_cache_events(holder, events, now=0.0)
    # Recomputing 3000 tokens (300 ms) costs more than the 80 ms round trip: full KVCompass goes remote.
    assert full.route(_request(0, prompt, "us"), now=1.0).worker_index == holder
    us = {i for i, w in enumerate(topo.worker_ids) if w.startswith("us-")}
    own_longest = local_only.plan.lengths_toward("us", "us")[-1]
    for i in range(20):
        d = local_only.route(_request(i, prompt, "us"), now=1.0 + i)
        assert d.worker_index in us
        # Credited only where this edge sent the earlier ones (its ledger), at own-region lengths.
        assert d.claimed_tokens == 0 if i == 0 else d.claimed_tokens <= own_longest


def _workload(topo: Topology, n: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    shared = [_prompt(500 + k, 800) for k in range(4)]
    out = []
    for i in range(n):
        head = shared[int(rng.integers(len(shared)))]
        tail = rng.integers(0, 30000, int(rng.integers(16, 400)), dtype=np.uint32)
        region = topo.regions[int(rng.integers(len(topo.regions)))]
        out.append(Request(i, 0.02 * i, region, i, np.concatenate([head, tail]), int(rng.integers(1, 20))))
    return out


def test_the_engine_runs_the_policy_deterministically_and_ablation_keeps_requests_home():
    topo = _topo(shards=3)
    settings = SimSettings(update_delay_ms=20.0, update_loss=0.2, seed=3)

    def run(ablation: Ablation | None = None):
        policy = KVCompassPolicy(topo, ablation=ablation, seed=3)
        engine_settings = policy.adopt_update_transport(settings)
        assert engine_settings.update_loss == 0 and engine_settings.update_delay_ms == 0  # not twice
        assert policy.update_loss == 0.2 and policy.update_delay_ms == 20.0
        return policy, simulate(topo, policy, _workload(topo, 120, seed=11), settings=engine_settings)

    p1, r1 = run()
    p2, r2 = run()
    assert r1.completed == 120
    for field in r1.records:
        assert np.array_equal(r1.records[field], r2.records[field]), field
    assert p1.stats() == p2.stats()
    assert r1.records["reused_tokens"].sum() > 0 and p1.counters["batches_lost"] > 0
    _, r3 = run(Ablation(cross_region=False))
    assert np.array_equal(r3.records["worker_region"], r3.records["edge_region"])
    # Every hot-family miss is in the results by outcome; each plan is one migration run.
    assert {k: v for k, v in r1.extra.items() if k.startswith("hot_misses_")} == {
        f"hot_misses_{o}": n for o, n in p1.hot_misses_by_outcome.items()}
    assert r1.extra["hot_misses_planned"] == r1.extra["migrations"]
    _, r4 = run(Ablation(migration=False))
    assert r4.extra["migrations"] == 0 and not any(r4.extra[f"hot_misses_{o}"] for o in HOT_MISS_OUTCOMES)


def test_bad_settings_and_unknown_regions_are_rejected():
    topo = _topo()
    with pytest.raises(PolicyError):
        KVCompassPolicy(topo, update_loss=1.0)
    with pytest.raises(PolicyError):
        KVCompassPolicy(topo, update_delay_ms=-1.0)
    with pytest.raises(PolicyError):
        KVCompassPolicy(topo).route(_request(0, _prompt(1), "mars"), now=0.0)


def test_a_shard_flushes_what_arrives_within_the_interval_as_one_batch():
    topo = _topo(shards=1)
    coalescing = KVCompassPolicy(topo, wan_propagation=False, flush_interval_ms=1.0)
    eager = KVCompassPolicy(topo, wan_propagation=False, flush_interval_ms=0.0)
    for policy in (coalescing, eager):
        for w in range(3):
            policy.on_cache_events(w, _cache().insert(_prompt(40 + w, 300).tolist(), now=0.0), now=0.0005 * w)
        policy.settle(now=1.0)
    assert eager.counters["batches_published"] == 3
    assert coalescing.counters["batches_published"] == 2  # t=0 and 0.5 ms together, then 1 ms
    probe = np.concatenate([np.array(list(t.registered()), dtype=np.uint64) for t in eager.trees])
    _assert_views_equal_shards(coalescing, probe)
    _assert_views_equal_shards(eager, probe)


class _HeapDeliveries(KVCompassPolicy):
    """The policy as it was: one heap event per delivery to a shard."""

    _deliveries_held_by_shards = False


def _recording(policy: KVCompassPolicy) -> list:
    """Every batch ``policy`` publishes, as (shard, seq, publish time, tables)."""
    published = []
    send = policy._send_published

    def record(s, batch, now):
        if batch is not None:
            published.append((s, batch.seq, now, batch.tables))
        send(s, batch, now)

    policy._send_published = record
    return published


@pytest.mark.parametrize("seed", range(4))
def test_deliveries_held_by_their_shard_publish_the_batches_of_one_event_each(seed):
    """A shard holding what is on its way to it (its next flush the only heap event) publishes
    the same batches, with the same contents, at the same times, and the edges decide the same,
    as one heap event per delivery: on a grid of binary times whose legs and flush interval are
    whole steps, so deliveries fall exactly on flushes (both sides of the tie), and with workers
    in the shards' own regions (no leg: applied as sent)."""
    step_ms = 1.953125  # 2**-9 s: sums of steps are exact
    cfg = make_cluster({"us": 2, "eu": 2, "ap": 2}, shards=3, one_way_ms=step_ms, prefill_ms_per_token=0.1,
                       levels=4, same_region_min_tokens=32)
    topo = Topology.from_config(cfg)
    held, heap = (cls(topo, flush_interval_ms=step_ms) for cls in (KVCompassPolicy, _HeapDeliveries))
    published = [_recording(held), _recording(heap)]
    rng = np.random.default_rng(seed)
    caches = [PrefixCache(block_size=BLOCK, vram_tokens=4096, dram_tokens=4096) for _ in topo.worker_ids]
    heads = [_prompt(900 + k, 256) for k in range(3)]
    tick, decisions = 0, [[], []]
    for i in range(160):
        tick += int(rng.integers(0, 3))
        now = tick * step_ms / 1000.0
        for policy in (held, heap):  # the engine's loop: every timer due first
            t = policy.next_timer()
            while t is not None and t <= now:
                policy.on_timer(now=t)
                t = policy.next_timer()
        if rng.random() < 0.2:
            prompt = np.concatenate([heads[int(rng.integers(3))], _prompt(i, 64)])
            region = topo.regions[int(rng.integers(3))]
            for k, policy in enumerate((held, heap)):
                d = policy.route(_request(i, prompt, region, now), now=now)
                decisions[k].append((d.worker_index, d.claimed_tokens))
            continue
        w = int(rng.integers(len(caches)))
        tokens = np.concatenate([heads[int(rng.integers(3))], _prompt(1000 + i, int(rng.integers(16, 200)))])
        events = caches[w].insert(tokens.tolist(), now=now)
        for policy in (held, heap):
            policy.on_cache_events(w, events, now=now)
    assert held.unapplied_deliveries() == heap.unapplied_deliveries()
    assert held.stats() == heap.stats()
    for policy in (held, heap):
        policy.settle(now=tick * step_ms / 1000.0)
    # (Shards flushing at one instant may publish in either order: each shard's batches are its own.)
    assert sorted(published[0], key=lambda b: b[:2]) == sorted(published[1], key=lambda b: b[:2])
    assert len(published[0]) > 20
    assert decisions[0] == decisions[1] and any(claimed for _, claimed in decisions[0])
    assert held.stats() == heap.stats() and held.in_flight == heap.in_flight == 0
    for a, b in zip(held.shards, heap.shards):
        assert (a.epoch, a.seq) == (b.epoch, b.seq)


def test_a_run_with_deliveries_held_by_their_shard_is_the_run_with_one_event_each():
    topo = _topo(shards=3)
    runs = []
    for cls in (KVCompassPolicy, _HeapDeliveries):
        policy = cls(topo)
        runs.append((policy, simulate(topo, policy, _workload(topo, 150, seed=5))))
    (p1, r1), (p2, r2) = runs
    assert p1._held_by_shards and not p2._held_by_shards
    for field in r1.records:
        assert np.array_equal(r1.records[field], r2.records[field]), field
    assert p1.stats() == p2.stats() and p1.counters["batches_published"] > 10


def test_live_load_stays_in_its_region_and_reaches_others_by_broadcast_or_piggyback():
    topo = _topo()
    policy = KVCompassPolicy(topo)
    us, eu = topo.regions.index("us"), topo.regions.index("eu")
    eu0 = topo.worker_ids.index("eu-0")
    policy.on_worker_load(eu0, 50.0, now=0.0)
    assert policy.routers[eu].queues.get("eu-0") == 50.0
    assert policy.routers[us].queues.get("eu-0") == 0.0  # not live across regions
    t = policy.next_timer()
    while policy.routers[us].queues.get("eu-0") == 0.0:
        assert t is not None and t < 1.0
        policy.on_timer(now=t)
        t = policy.next_timer()
    # The broadcast left at its period and crossed the one-way WAN latency (20 ms here).
    assert policy.routers[us].queues.last_heard_from("eu") >= topo.one_way_ms[eu, us] / 1000.0
    assert policy.routers[us].queues.get("eu-0") == 50.0
    # A response from eu piggybacks eu's vector (EWMA-folded, w = 0.5).
    req = _request(0, _prompt(1), "us")
    policy.route(req, now=0.3)
    eu_workers = {i: 10.0 for i, w in enumerate(topo.worker_ids) if w.startswith("eu-")}
    policy.on_response(eu0, req, 0, eu_workers, now=0.4)  # inside the trend window: no trend yet
    assert policy.routers[us].queues.get("eu-0") == pytest.approx(30.0)


def test_a_routers_broadcasts_of_one_delta_arrive_in_due_order_as_if_each_were_its_own_event():
    """One heap entry per router's Delta, its messages merged with every other entry by (due
    time, send order): each receiver gets what it would have with one entry per message."""
    cfg = make_cluster({"us": 2, "eu": 2, "ap": 2, "sa": 1}, shards=2, one_way_ms=7.0, prefill_ms_per_token=0.1,
                       levels=4, same_region_min_tokens=32)
    topo = Topology.from_config(cfg)
    policy = KVCompassPolicy(topo)
    sent, delivered = [], []
    for router in policy.routers:
        queues = router.queues
        for name in ("due_broadcasts", "room_broadcasts"):
            def sending(*args, _f=getattr(queues, name), _a=topo.regions.index(queues.region), **kw):
                out = _f(*args, **kw)
                sent.extend((kw["now"] + policy._owm_s[_a, topo.regions.index(m.to_region)], len(sent) + k, m)
                            for k, m in enumerate(out))
                return out
            setattr(queues, name, sending)
        for name in ("on_broadcast", "on_room_broadcast"):
            def receiving(msg, *, now, _f=getattr(queues, name), **kw):
                delivered.append((now, msg))
                return _f(msg, now=now, **kw)
            setattr(queues, name, receiving)
    rng = np.random.default_rng(3)
    t = 0.0
    while t < 0.6:
        t = policy.next_timer()
        if rng.random() < 0.3:  # moving queues: vectors change, so regions keep broadcasting
            w = int(rng.integers(topo.n_workers))
            policy.on_worker_load(w, float(rng.integers(0, 200)), now=t)
        policy.on_timer(now=t)
    policy.on_arrivals_end(now=t)
    expected = sorted(sent, key=lambda x: x[:2])
    assert len(delivered) > 50 and len({msg.from_region for _, msg in delivered}) == len(topo.regions)
    assert len(delivered) == sum(due <= t for due, _, _ in expected)
    assert all(got is want for (_, got), (_, _, want) in zip(delivered, expected))
    assert [now for now, _ in delivered] == [due for due, _, _ in expected[:len(delivered)]]


def test_context_tokens_option_sets_the_index_reach_only():
    topo = _topo()
    long = KVCompassPolicy(topo, wan_propagation=False)
    paper = KVCompassPolicy(topo, wan_propagation=False, context_tokens=topo.config.index.block_size)
    assert long.plan.max_length == topo.config.index.context_tokens == 131072
    assert paper.plan.max_length < 131072 and paper.cfg.index.context_tokens == topo.config.index.block_size
    assert set(paper.plan.registration_lengths()) < set(long.plan.registration_lengths())
    assert paper.routers[0].plan.max_length == paper.plan.max_length  # the edges use the same plan


@pytest.mark.parametrize("urgent_ms", [1000.0, 0.0])
def test_a_long_prompt_sent_at_home_reaches_the_other_regions_queues_one_way_later(urgent_ms):
    # [score] urgent_broadcast_ms: the us edge's 12,000-token dispatch (1,200 ms of prefill at
    # 0.1 ms/token) goes out at once, so eu's edge sees it one way (20 ms) later, not at us's
    # next Delta (100 ms after its last broadcast) + one way.
    cfg = make_cluster({"us": 3, "eu": 2}, shards=1, one_way_ms=20.0, prefill_ms_per_token=0.1, levels=4,
                       same_region_min_tokens=32, urgent_broadcast_ms=urgent_ms)
    topo = Topology.from_config(cfg)
    policy = KVCompassPolicy(topo, wan_propagation=False)
    while (t := policy.next_timer()) is not None and t <= 1.05:
        policy.on_timer(now=t)  # the periodic broadcasts up to 1.05 s
    decision = policy.route(_request(0, _prompt(7, 12_000), "us", at=1.06), now=1.06)
    chosen = topo.worker_ids[decision.worker_index]
    assert chosen.startswith("us-")
    eu = policy.routers[policy._region_index["eu"]].queues
    if urgent_ms:
        assert policy.next_timer() == 1.06
        policy.on_timer(now=1.06)
        assert policy.counters["urgent_broadcasts"] == 1
    else:
        assert policy.next_timer() > 1.06
    policy._advance(1.0805)  # one way after the dispatch
    seen = eu.queue_ms(now=1.0805)[decision.worker_index]
    assert seen == (pytest.approx(1200.0, rel=0.05) if urgent_ms else 0.0)
