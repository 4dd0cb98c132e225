"""Each baseline's defining behaviour."""

from __future__ import annotations

import numpy as np
import pytest
from sim_fixtures import ONE_WAY, two_region_topology

from kvcompassd.engine.kvevents import BlockRemoved
from kvcompassd.sim.baselines import BASELINES, make_baseline
from kvcompassd.sim.baselines.directory import CentralDirectoryPolicy
from kvcompassd.sim.baselines.hashing import ChordPolicy, ConsistentHashPolicy
from kvcompassd.sim.blockmirror import GlobalBlockMap, chain_keys
from kvcompassd.sim.engine import ExactWorkerState, SimSettings, request_window, simulate
from kvcompassd.sim.metrics import load_factor_peak
from kvcompassd.sim.policy import PolicyError
from kvcompassd.sim.schemes import ALL_SCHEMES, make_policy
from kvcompassd.sim.synthetic import MixedWorkload
from kvcompassd.sim.workloads import Request
from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.worker.workermodel import WorkerTiming


def req(i, tokens, region="a", t=0.0, out=1):
    return Request(i, t, region, i, np.asarray(tokens, dtype=np.uint32), out)


def test_consistent_hash_sends_one_prefix_to_one_worker_and_spreads_prefixes():
    topo = two_region_topology(4, 4)
    ch = ConsistentHashPolicy(topo)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50_000, 2048)
    # Prompts sharing their first 2048 tokens (the longest level) go to one worker, wherever they enter.
    targets = {ch.route(req(i, np.concatenate([shared, rng.integers(0, 50_000, 30)]), region=r), now=0).worker_index
               for i, r in enumerate("abab")}
    assert len(targets) == 1
    spread = {ch.route(req(i, rng.integers(0, 50_000, 300)), now=0).worker_index for i in range(200)}
    assert len(spread) == 8


def test_chord_resolves_to_the_ring_owner_over_wan_hops():
    topo = two_region_topology(4, 4)
    chord = ChordPolicy(topo, seed=1)
    rng = np.random.default_rng(2)
    for i in range(50):
        tokens = rng.integers(0, 50_000, int(rng.integers(20, 3000)))
        key_path = chord.lookup_path(0, int(rng.integers(0, 2**63)))
        assert len(key_path) <= 2 + 64
        d = chord.route(req(i, tokens), now=0)
        assert d.lookup_delay_ms >= 2 * 0.5  # at least the edge -> node -> edge trip
        assert d.lookup_delay_ms <= (chord.hops_total + 2) * ONE_WAY * 2
    assert chord.hops_total / chord.lookups > 0.5  # multi-hop on average
    # Routing agrees with the ring: the lookup ends at the key's successor.
    for k in rng.integers(0, 2**63, 20).tolist():
        end = chord.lookup_path(3, k)[-1]
        assert end == chord.ring.successor_index(k)


def test_central_directory_pays_one_round_trip_and_finds_holders():
    topo = two_region_topology(1, 2)
    cd = CentralDirectoryPolicy(topo, coordinator_region=1)
    tokens = np.arange(100, 420)
    d = cd.route(req(0, tokens, region="a"), now=0.0)
    assert d.lookup_delay_ms == pytest.approx(2 * ONE_WAY)
    assert cd.route(req(1, tokens, region="b"), now=0.0).lookup_delay_ms == pytest.approx(2 * 0.5)
    # Worker 0 (region a) caches the prompt at t=10 ms; its report reaches the coordinator in b
    # 50 ms later, and the query from a reaches the coordinator 50 ms after it is sent.
    cache = PrefixCache(block_size=16, vram_tokens=10_000)
    cd.on_cache_events(0, cache.insert(tokens.tolist(), now=0.01), now=0.01)
    before = cd.route(req(2, tokens, region="a"), now=0.0)
    assert before.claimed_tokens == 0  # the report is still crossing the WAN
    after = cd.route(req(3, tokens, region="a"), now=0.02)
    assert after.worker_index == 0 and after.claimed_tokens == 320


def exact_state(topo):
    """The simulator's exact worker state over real caches and worker timings, as the engine builds it."""
    caches = [PrefixCache(block_size=topo.block_size, vram_tokens=10_000) for _ in topo.worker_ids]
    timings = [WorkerTiming.from_worker_config(topo.config.worker(w), reload_ms_per_token=topo.gamma_ms_per_token)
               for w in topo.worker_ids]
    blocks = GlobalBlockMap(topo.n_workers, topo.block_size)
    return ExactWorkerState(caches, timings, blocks), caches, blocks


def test_load_balance_oracle_stays_in_the_requests_region_when_that_is_as_good():
    topo = two_region_topology(2, 2)
    oracle = make_baseline("load-balance-oracle", topo)
    oracle.attach_exact_state(exact_state(topo)[0])
    rng = np.random.default_rng(3)
    # A lone request from b on an idle fleet: a worker of b, not a-0 across the WAN.
    assert topo.worker_region[oracle.route(req(0, rng.integers(0, 50_000, 200), region="b"), now=0.0).worker_index] == 1
    second = oracle.route(req(1, rng.integers(0, 50_000, 200), region="b"), now=0.0).worker_index
    assert topo.worker_region[second] == 1  # the other b worker, as idle as the a ones
    # Both b workers now carry a request: balance sends the third to a, and the WAN is charged.
    third = oracle.route(req(2, rng.integers(0, 50_000, 200), region="b"), now=0.0).worker_index
    assert topo.worker_region[third] == 0


def test_load_balance_oracle_is_credited_with_the_exact_cached_length_and_counts_decode():
    topo = two_region_topology(2, 2)
    state, caches, blocks = exact_state(topo)
    oracle = make_baseline("load-balance-oracle", topo)
    oracle.attach_exact_state(state)
    tokens = np.random.default_rng(4).integers(0, 50_000, 330)
    blocks.apply(1, caches[1].insert(tokens[:320].tolist(), now=0.0))
    d = oracle.route(req(0, tokens, out=21), now=0.0)
    # a-1 holds 320 tokens: only the 10 others are prefilled there, the cheapest total.
    assert d.worker_index == 1 and d.claimed_tokens == 320
    timing = state._timings[1]
    decode = 20 * timing.decode_step_ms(timing.max_running) / timing.max_running
    assert oracle.totals_ms[1] == pytest.approx(10 * timing.prefill_ms_per_token + decode)
    # The next request is a miss everywhere: it costs full prefill plus its decode share on a-0.
    d = oracle.route(req(1, np.arange(100), out=5), now=0.0)
    assert d.worker_index == 0 and d.claimed_tokens == 0
    assert oracle.totals_ms[0] == pytest.approx(100 * timing.prefill_ms_per_token
                                                + 4 * timing.decode_step_ms(timing.max_running) / timing.max_running)


def test_load_balance_oracle_counts_exactly_what_the_load_factor_counts():
    topo = two_region_topology(3, 2, vram=20_000, dram=40_000)
    oracle = make_baseline("load-balance-oracle", topo)
    res = simulate(topo, oracle, MixedWorkload(100.0, {"a": 3.0, "b": 2.0}, seed=2),
                   settings=SimSettings(eviction="lfu", track_truth=True), max_requests=200)
    # Its totals are corrected to the exact compute as each prefill starts: equal at the end.
    np.testing.assert_allclose(oracle.totals_ms, res.load_bins.sum(axis=1), rtol=1e-9)
    assert not oracle._estimated_ms  # every routed request's estimate was replaced
    # Its claim is exactly what the worker held at the decision; the prefill, which starts after
    # queueing, may reuse more (an earlier queued request cached the prefix meanwhile) or less.
    assert (res.records["claimed_tokens"] == res.records["held_at_decision"]).all()
    assert (res.records["reused_tokens"] > res.records["claimed_tokens"]).any()
    with pytest.raises(PolicyError, match="exact worker state"):
        make_baseline("load-balance-oracle", topo).route(req(0, np.arange(10)), now=0.0)


def test_load_balance_oracle_peak_is_at_or_below_every_schemes():
    """The bound, on a small fixed run: every scheme replays one stream on fresh workers."""
    topo = two_region_topology(3, 2, vram=20_000, dram=40_000)
    stream = request_window(MixedWorkload(150.0, {"a": 3.0, "b": 2.0}, seed=7), duration_s=None, max_requests=300)
    peaks = {}
    for name in ALL_SCHEMES:
        res = simulate(topo, make_policy(name, topo, seed=0), stream, settings=SimSettings(eviction="lfu"))
        assert res.completed == 300, name
        peaks[name] = load_factor_peak(res)
        if name == "load-balance-oracle":
            slack = res.extra["lf_bound_slack"]
    bound = peaks.pop("load-balance-oracle")
    assert 1.0 <= bound <= min(1.0 + slack, *peaks.values()), (bound, slack, peaks)


@pytest.mark.parametrize("name", ["central-directory", "dynamo", "skywalker"])
def test_load_aware_routers_count_what_they_sent_until_a_report_includes_it(name):
    """Two requests in one report interval: without counting the first, the second would see
    the same least-loaded worker and pile onto it."""
    topo = two_region_topology(2, 2)
    policy = (CentralDirectoryPolicy(topo, coordinator_region=0) if name == "central-directory"
              else make_baseline(name, topo))
    for w, q in enumerate([0.0, 100.0, 100.0, 100.0]):
        policy.on_worker_load(w, q, now=0.0)
    rng = np.random.default_rng(5)
    prompt = 2000  # 2000 x BETA of prefill: more than the others' 100 ms
    first = policy.route(req(0, rng.integers(0, 50_000, prompt)), now=0.001).worker_index
    second = policy.route(req(1, rng.integers(0, 50_000, prompt)), now=0.001).worker_index
    assert first == 0 and second != 0
    policy.on_worker_load(0, 0.0, now=0.002)  # the report that includes it replaces the count
    assert policy.route(req(2, rng.integers(0, 50_000, prompt)), now=0.003).worker_index == 0


def test_skywalker_pushes_only_to_idle_replicas_local_first():
    topo = two_region_topology(2, 2)
    sw = make_baseline("skywalker", topo)
    sw.on_timer(now=0.0)
    sw.on_worker_load(0, 50.0, now=0.0)
    assert sw.route(req(0, np.arange(100)), now=0.0).worker_index == 1  # the idle local one
    sw.on_worker_load(0, 500.0, now=0.0)
    sw.on_worker_load(1, 500.0, now=0.0)
    sw.on_worker_load(2, 0.0, now=0.0)
    sw.on_timer(now=0.001)
    d = sw.route(req(1, np.arange(100)), now=0.06)  # local busy; remote idle per the exchange
    assert topo.worker_region[d.worker_index] == 1


def test_dynamo_prefers_the_holder_and_sees_remote_load_only_by_broadcast():
    topo = two_region_topology(2, 2)
    dyn = make_baseline("dynamo", topo, broadcast_period_ms=100.0)
    tokens = np.arange(7, 7 + 3200)
    cache = PrefixCache(block_size=16, vram_tokens=100_000)
    dyn.on_timer(now=0.0)
    dyn.on_cache_events(1, cache.insert(tokens.tolist(), now=0.0), now=0.0)
    assert dyn.route(req(0, tokens), now=0.01).claimed_tokens == 0  # not broadcast yet
    dyn.on_timer(now=0.1)
    d = dyn.route(req(1, tokens), now=0.2)
    assert d.worker_index == 1 and d.claimed_tokens == 3200


def test_planetserve_follows_its_routing_history():
    topo = two_region_topology(2, 2)
    ps = make_baseline("planetserve", topo)
    tokens = np.arange(3, 1003)
    first = ps.route(req(0, tokens), now=0.0).worker_index
    again = ps.route(req(1, np.concatenate([tokens, np.arange(5)])), now=0.1)
    assert again.worker_index == first and again.claimed_tokens > 0


def test_block_map_tracks_stores_and_removals():
    cache = PrefixCache(block_size=16, vram_tokens=100_000)
    bmap = GlobalBlockMap(2, 16)
    tokens = np.arange(11, 11 + 160)
    events = cache.insert(tokens.tolist(), now=0.0)
    bmap.apply(1, events)
    keys = chain_keys(tokens, 16)
    assert bmap.longest(keys)[1][0] == 160
    stored_ids = [e.block_hashes[0] for e in events]
    bmap.apply(1, [BlockRemoved(tuple(stored_ids[5:]), "GPU")])
    assert bmap.longest(keys)[1][0] == 80
    assert bmap.longest(chain_keys(np.arange(500, 600), 16)) == {}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_runs_the_engine(name):
    topo = two_region_topology(2, 2, vram=20_000)
    res = simulate(topo, make_baseline(name, topo), MixedWorkload(100.0, {"a": 1, "b": 1}, seed=2),
                   settings=SimSettings(), max_requests=60)
    assert res.completed == 60


def test_unknown_baseline_is_a_clear_error():
    with pytest.raises(PolicyError, match="unknown baseline"):
        make_baseline("nope", two_region_topology())


def test_round_robin_cycles_per_router_over_the_fleet_or_its_region():
    topo = two_region_topology(2, 3)
    rr = make_baseline("round-robin", topo)
    assert [rr.route(req(i, np.arange(50), region="a"), now=0).worker_index for i in range(6)] == [0, 1, 2, 3, 4, 0]
    assert rr.route(req(9, np.arange(50), region="b"), now=0).worker_index == 0  # b's router has its own counter
    regional = make_baseline("round-robin-regional", topo)
    assert [regional.route(req(i, np.arange(50), region="b"), now=0).worker_index for i in range(4)] == [2, 3, 4, 2]


@pytest.mark.parametrize("name", ["random-regional", "consistent-hash-regional", "sglang-cache-aware-regional"])
def test_regional_baselines_stay_in_the_edges_region(name):
    topo = two_region_topology(3, 2)
    policy = make_policy(name, topo, seed=4)
    rng = np.random.default_rng(1)
    for i in range(60):
        region = "ab"[i % 2]
        w = policy.route(req(i, rng.integers(0, 50_000, 300), region=region), now=i * 0.01).worker_index
        assert topo.regions[topo.worker_region[w]] == region


def test_sglang_cache_aware_follows_its_own_tree_then_spreads_then_balances():
    topo = two_region_topology(2, 2)
    ca = make_baseline("sglang-cache-aware", topo)
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 50_000, 1000)
    first = ca.route(req(0, doc), now=0.0).worker_index
    # The same document again: matched share 992/1030 > 0.3, so the worker it was sent to.
    again = ca.route(req(1, np.concatenate([doc, rng.integers(0, 50_000, 30)])), now=0.1)
    assert again.worker_index == first and again.claimed_tokens == 992
    # New prefixes go to the worker with the smallest tree: every worker gets one before any gets two.
    spread = {ca.route(req(2 + i, rng.integers(0, 50_000, 2000)), now=0.2).worker_index for i in range(3)}
    assert spread == {0, 1, 2, 3} - {first}
    # Region b's router has its own tree: it has never sent the document anywhere.
    assert ca.trees[1].longest(ca.trees[1].chunk_keys(doc))[0] == 0
    # Imbalance (max - min > 64 and max > 1.5 min of its in-flight counts): the least loaded, tree or not.
    ca.in_flight[0] = [100, 30, 100, 100]
    assert ca.route(req(9, doc), now=0.3).worker_index == 1
    # A response returning lowers the count of the router that sent it.
    ca.on_response(1, req(9, doc), 0, {}, now=0.4)
    assert ca.in_flight[0, 1] == 30
