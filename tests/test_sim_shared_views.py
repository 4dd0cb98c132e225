"""The simulator's shared edge views (sim/shared_views.py) against one view per edge: the same
decisions request by request on shipped and generated fleets, one copy of what edges share, and
the positions and claims explained when read."""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvcompassd.core.config import load_config, parse_config
from kvcompassd.sim.engine import SimSettings, simulate
from kvcompassd.sim.geo import DEPLOYMENTS, render_toml, scale_deployment
from kvcompassd.sim.kvcompass_policy import KVCompassPolicy
from kvcompassd.sim.policy import PolicyError, Topology
from kvcompassd.sim.schemes import make_workload, region_weights

CONFIG = Path(__file__).resolve().parents[1] / "config"


def _fleet(name: str) -> Topology:
    if name == "northamerica-11":
        return Topology.from_config(load_config(CONFIG / "northamerica-11.toml"))
    # 22 workers in 8 regions, a shard per region: many edges at different lags
    spec = scale_deployment(DEPLOYMENTS["northamerica-11"], factor=2, split=2)
    return Topology.from_config(parse_config(tomllib.loads(render_toml(spec)), spec.name))


def _run(topo: Topology, shared: bool, rate: float, duration_s: float, update_delay_ms: float = 0.0):
    policy = KVCompassPolicy(topo, shared_views=shared)
    requests = make_workload("mixed", rate, region_weights(topo), seed=3)
    settings = SimSettings(eviction="lfu", seed=3, update_delay_ms=update_delay_ms)
    result = simulate(topo, policy, requests, settings=settings, duration_s=duration_s)
    return policy, result


def test_an_update_delay_the_engine_hands_over_reaches_the_shared_views():
    topo = _fleet("scaled-22x8")
    rate = 8.0 * topo.n_workers
    old_policy, old = _run(topo, False, rate, 1.0, update_delay_ms=40.0)
    new_policy, new = _run(topo, True, rate, 1.0, update_delay_ms=40.0)
    _, undelayed = _run(topo, True, rate, 1.0)
    assert new_policy.shared_views and new_policy.update_delay_ms == 40.0
    for column in ("worker", "claimed_tokens", "reused_tokens", "ttft_ms"):
        assert np.array_equal(old.records[column], new.records[column]), column
    assert not np.array_equal(new.records["claimed_tokens"], undelayed.records["claimed_tokens"])


@pytest.mark.parametrize("fleet", ["northamerica-11", "scaled-22x8"])
def test_shared_views_make_every_decision_the_per_edge_views_make(fleet):
    topo = _fleet(fleet)
    rate = 8.0 * topo.n_workers  # past the no-reuse capacity: queues, reuse and lagging views all matter
    old_policy, old = _run(topo, False, rate, 2.0)
    new_policy, new = _run(topo, True, rate, 2.0)
    assert new_policy.shared_views and not old_policy.shared_views
    assert old.completed >= 150
    for column in ("id", "worker", "claimed_tokens", "reused_tokens", "ttft_ms"):
        assert np.array_equal(old.records[column], new.records[column]), column
    # Requests were sent across regions and credited with reuse there, so lagging views were read.
    assert (old.records["claimed_tokens"] > 0).mean() > 0.2
    assert (old.records["worker_region"] != old.records["edge_region"]).any()
    old_stats, new_stats = old_policy.stats(), new_policy.stats()
    assert old_stats["decisions"] == new_stats["decisions"]
    assert old_stats["batches_published"] == new_stats["batches_published"]
    # Every (batch, edge) delivery happened once the run settled, without an event of its own.
    new_policy.settle(now=0.0)
    assert new_policy.stats()["batch_deliveries"] == old_stats["batch_deliveries"]


def test_edges_share_one_copy_and_fresh_views_agree_with_the_shards():
    topo = _fleet("scaled-22x8")
    policy, _ = _run(topo, True, 6.0 * topo.n_workers, 0.5)
    policy.settle(now=0.0)
    views = policy.views
    probe = np.random.default_rng(0).integers(0, 1 << 63, 2000, dtype=np.uint64)
    for s, shard in enumerate(policy.shards):
        snap = shard.snapshot()
        for group, _blob in snap.tables:
            # Settled: every edge is at the shard's position, on the very same table object.
            first = views[0].view(s, group)
            assert all(v.view(s, group) is first for v in views)
            assert all(v.position(s) == (shard.epoch, shard.seq) for v in views)
        from kvcompassd.core.ludo import LudoView

        for group, blob in snap.tables:
            assert np.array_equal(views[0].view(s, group).lookup_many(probe), LudoView.from_snapshot(blob).lookup_many(probe))
    assert policy.stats()["table_versions"] == sum(len(s.snapshot().tables) for s in policy.shards)


def test_loss_needs_views_of_their_own():
    topo = _fleet("northamerica-11")
    with pytest.raises(PolicyError, match="update_loss"):
        KVCompassPolicy(topo, update_loss=0.1, shared_views=True)
    assert not KVCompassPolicy(topo, update_loss=0.1).shared_views
    policy = KVCompassPolicy(topo)
    assert policy.shared_views
    policy.adopt_update_transport(SimSettings(update_loss=0.2))  # the engine's loss moves into the policy
    assert not policy.shared_views and len(policy.syncs) == len(topo.regions)


def test_broadcasts_stop_after_the_last_arrival_and_no_decision_changes():
    class KeepsBroadcasting(KVCompassPolicy):
        def on_arrivals_end(self, *, now: float) -> None:
            self.ended_at = now

    topo = _fleet("scaled-22x8")
    requests = list(itertools.islice(make_workload("mixed", 8.0 * topo.n_workers, region_weights(topo), seed=5), 150))
    settings = SimSettings(eviction="lfu", seed=5)
    full = KeepsBroadcasting(topo)
    stopped = KVCompassPolicy(topo)
    a = simulate(topo, full, requests, settings=settings)
    b = simulate(topo, stopped, requests, settings=settings)
    for column in ("worker", "claimed_tokens", "ttft_ms", "e2e_ms"):
        assert np.array_equal(a.records[column], b.records[column]), column
    assert full.ended_at == requests[-1].arrival_s  # told once, at the last arrival
    assert stopped.stats()["broadcasts"] < full.stats()["broadcasts"]  # the drain sent none
    assert stopped.next_timer() is None or stopped.next_timer() > full.ended_at


def test_compaction_moves_lagging_edges_together_up_to_the_slowest_edges_position():
    topo = _fleet("scaled-22x8")
    policy = KVCompassPolicy(topo)
    requests = list(itertools.islice(make_workload("mixed", 8.0 * topo.n_workers, region_weights(topo), seed=7), 300))
    simulate(topo, policy, requests, settings=SimSettings(eviction="lfu", seed=7))
    shared = policy._shared
    now = shared.last_published() + 0.01  # some edges have the last batches, others not yet
    edges = range(len(shared.edges))
    before = shared.live_versions()
    shared.compact(now)
    for s in range(shared.shards):
        positions = [shared.position(e, s, now) for e in edges]
        for g in range(shared.groups):
            at, refs = shared.table_state(s, g)
            low = shared.version_at(s, g, min(positions))
            assert min(at) >= low  # nobody is left behind the slowest edge's position ...
            for e in edges:  # ... nor moved past its own, and its C lookup reads its version's table
                assert at[e] <= shared.version_at(s, g, positions[e])
                pointers = shared.pointers[e]
                assert pointers.pointers()[s * shared.groups + g] == shared.view_pointer(e, s, g)
            assert set(refs) == set(at) and sum(refs.values()) == len(edges)
    assert shared.live_versions() <= before
    # Once every batch has reached every edge, one version of each table is left.
    shared.compact(shared.last_due())
    assert shared.live_versions() == shared.shards * shared.groups


def test_batches_out_of_order_or_corrupt_are_refused_and_change_nothing():
    from kvcompassd.core.ludo import LudoError
    from kvcompassd.core.messages import UpdateBatchPublished

    topo = _fleet("scaled-22x8")
    policy = KVCompassPolicy(topo)
    requests = list(itertools.islice(make_workload("mixed", 8.0 * topo.n_workers, region_weights(topo), seed=7), 60))
    simulate(topo, policy, requests, settings=SimSettings(eviction="lfu", seed=7))
    shared, shard = policy._shared, policy.shards[0]
    state = [shared.table_state(0, g) for g in range(shared.groups)]
    versions = shared.live_versions()
    with pytest.raises(ValueError, match="out of order"):
        shared.publish(UpdateBatchPublished(0, shard.epoch, shard.seq + 2, ()), 1e6)
    blob = bytearray(shard.snapshot().tables[0][1])
    blob[:4] = b"XXXX"
    with pytest.raises(LudoError):
        shared.publish(UpdateBatchPublished(0, shard.epoch, shard.seq + 1, ((0, bytes(blob)),)), 1e6)
    assert [shared.table_state(0, g) for g in range(shared.groups)] == state
    assert shared.live_versions() == versions
    # The next batch in order is still taken.
    shared.publish(UpdateBatchPublished(0, shard.epoch, shard.seq + 1, ((0, shard.snapshot().tables[0][1]),)), 1e6)
