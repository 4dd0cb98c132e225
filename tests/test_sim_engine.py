"""The simulation loop: hand-checked TTFTs on a tiny deployment, conservation, determinism."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from sim_fixtures import BETA, DECODE, ONE_WAY, two_region_topology

from kvcompassd.sim.baselines import make_baseline
from kvcompassd.sim.engine import Simulation, SimSettings, SimulationError, simulate
from kvcompassd.sim.policy import FALSE_NO_VRAM_ROOM, BasePolicy, MigrationOrdered, PolicyError, RouteDecision
from kvcompassd.sim.synthetic import ChatWorkload, MixedWorkload
from kvcompassd.sim.workloads import Request

INTRA = 0.5


class Fixed(BasePolicy):
    """Routes every request to one worker, with a fixed discovery delay; records what it sees."""

    name = "fixed"

    def __init__(self, topo, worker: int, lookup_ms: float = 0.0, claim: int = 0):
        super().__init__(topo)
        self.worker, self.lookup_ms, self.claim = worker, lookup_ms, claim
        self.events: list = []
        self.responses: list = []
        self.loads: list = []

    def route(self, req, *, now):
        return RouteDecision(self.worker, self.lookup_ms, self.claim)

    def on_cache_events(self, worker_index, events, *, now):
        self.events.append((worker_index, now, list(events)))

    def on_response(self, worker_index, req, reused_tokens, queue_vector, *, now):
        self.responses.append((worker_index, req.id, reused_tokens, dict(queue_vector), now))

    def on_worker_load(self, worker_index, queue_ms, *, now, running=0):
        self.loads.append((worker_index, queue_ms, now))


def req(i: int, t: float, tokens: np.ndarray, out: int = 1, region: str = "a") -> Request:
    return Request(i, t, region, i, tokens.astype(np.uint32), out)


TOKENS = np.arange(1000, 1320)  # 320 tokens = 20 full blocks


def test_remote_request_ttft_by_hand():
    topo = two_region_topology(1, 1)
    res = simulate(topo, Fixed(topo, worker=1), [req(0, 0.0, TOKENS, out=3)])
    r = res.records
    prefill = 320 * BETA
    assert r["ttft_ms"][0] == pytest.approx(ONE_WAY + prefill + ONE_WAY)
    # Two more tokens, each a batch-1 decode step, then the way back.
    assert r["e2e_ms"][0] == pytest.approx(ONE_WAY + prefill + 2 * DECODE + ONE_WAY)
    assert r["reused_tokens"][0] == 0 and r["worker_region"][0] == 1


def test_reuse_skips_cached_prefill_and_lookup_delay_adds():
    topo = two_region_topology(1, 1)
    policy = Fixed(topo, worker=0, lookup_ms=7.0)
    res = simulate(topo, policy, [req(0, 0.0, TOKENS), req(1, 1.0, TOKENS)])
    r = res.records
    assert r["ttft_ms"][0] == pytest.approx(7.0 + INTRA + 320 * BETA + INTRA)
    # Everything but the last prompt token is reused (an engine computes at least one token).
    assert r["reused_tokens"][1] == 319
    assert r["ttft_ms"][1] == pytest.approx(7.0 + INTRA + 1 * BETA + INTRA)
    assert r["lookup_ms"].tolist() == [7.0, 7.0]


def test_queueing_second_request_waits_for_first_prefill():
    topo = two_region_topology(1, 0)
    other = np.arange(5000, 5320)
    res = simulate(topo, Fixed(topo, worker=0), [req(0, 0.0, TOKENS), req(1, 0.0, other)])
    r = res.records
    assert r["ttft_ms"][1] == pytest.approx(INTRA + 2 * 320 * BETA + INTRA)


def test_policy_feeds_events_responses_and_load():
    topo = two_region_topology(1, 1)
    policy = Fixed(topo, worker=1)
    simulate(topo, policy, [req(0, 0.0, TOKENS, out=2)])
    stored = [e for _, _, evs in policy.events for e in evs if type(e).__name__ == "BlockStored"]
    assert len(stored) == 20  # every full block of the prompt
    (w, rid, reused, qv, at), = policy.responses
    assert (w, rid, reused) == (1, 0, 0)
    assert set(qv) == {1}  # the queue vector of the worker's own region
    assert at == pytest.approx((ONE_WAY + 320 * BETA + ONE_WAY) / 1000)
    assert any(q > 0 for _, q, _ in policy.loads) and policy.loads[-1][1] == 0.0


def test_update_delay_and_loss():
    topo = two_region_topology(1, 0)
    delayed = Fixed(topo, worker=0)
    simulate(topo, delayed, [req(0, 0.0, TOKENS)], settings=SimSettings(update_delay_ms=300))
    first_token_at = (INTRA + 320 * BETA) / 1000
    assert min(t for _, t, _ in delayed.events) == pytest.approx(first_token_at + 0.3)
    lossy = Fixed(topo, worker=0)
    res = simulate(topo, lossy, [req(i, i * 0.01, np.arange(i * 400, i * 400 + 320)) for i in range(50)],
                   settings=SimSettings(update_loss=0.5, seed=3))
    assert res.events_lost > 0 and res.events_delivered > 0
    assert res.events_lost + res.events_delivered == 50 * 20


def test_one_client_sends_each_request_when_the_previous_answer_is_back():
    topo = two_region_topology(1, 0)
    other = np.arange(5000, 5320)
    reqs = [req(0, 0.0, TOKENS, out=3), req(1, 0.0, other), req(2, 5.0, TOKENS)]
    res = simulate(topo, Fixed(topo, worker=0), reqs, settings=SimSettings(clients=1))
    r = res.records
    e2e_0 = INTRA + 320 * BETA + 2 * DECODE + INTRA
    # Request 1 waits for request 0's answer, then is sent: its TTFT counts from the send
    assert r["arrival_s"][1] == pytest.approx(e2e_0 / 1000.0)
    assert r["ttft_ms"][1] == pytest.approx(INTRA + 320 * BETA + INTRA)
    # Request 2 is due after the client is free again: sent at its own arrival time
    assert r["arrival_s"][2] == 5.0
    # Open loop, the same requests queue at the worker instead (as in the test above)
    open_loop = simulate(topo, Fixed(topo, worker=0), reqs).records
    assert open_loop["arrival_s"][1] == 0.0 and open_loop["ttft_ms"][1] > r["ttft_ms"][1]


class Alternating(Fixed):
    def route(self, req, *, now):
        return RouteDecision(req.id % 2)


def test_a_request_due_while_clients_were_busy_is_sent_when_one_frees_never_in_the_past():
    topo = two_region_topology(2, 0)
    # r0 and r1 run side by side and finish at the same instant T; r2 and r3 are due at 0
    reqs = [req(i, 0.0, np.arange(1000 * i, 1000 * i + 320)) for i in range(4)]
    r = simulate(topo, Alternating(topo, worker=0), reqs, settings=SimSettings(clients=2)).records
    t_done = (INTRA + 320 * BETA + INTRA) / 1000.0
    assert r["finish_s"][0] == r["finish_s"][1] == pytest.approx(t_done)
    assert r["arrival_s"][2] == r["arrival_s"][3] == pytest.approx(t_done)  # both sent at T, not at 0
    assert r["ttft_ms"][3] == pytest.approx(INTRA + 320 * BETA + INTRA)


def test_clients_bound_the_requests_outstanding():
    topo = two_region_topology(3, 2, vram=20_000, dram=40_000)
    res = simulate(topo, make_baseline("load-balance-oracle", topo), MixedWorkload(2000.0, {"a": 3.0, "b": 2.0}, seed=5),
                   settings=SimSettings(eviction="lfu", clients=4), max_requests=200)
    r = res.records
    assert sorted(r["id"].tolist()) == list(range(200))
    sent, done = r["arrival_s"], r["finish_s"]
    for t in np.unique(sent):  # at every send, at most 4 requests are out (the one sent included)
        assert ((sent <= t) & (done > t)).sum() <= 4
    assert (np.diff(sent[np.argsort(r["id"])]) >= 0).all()  # sent in stream order
    with pytest.raises(SimulationError):
        SimSettings(clients=0)


def test_conservation_and_determinism_on_mixed():
    topo = two_region_topology(3, 2, vram=20_000, dram=40_000)
    weights = {"a": 3.0, "b": 2.0}

    def run():
        return simulate(topo, make_baseline("dynamo", topo), MixedWorkload(200.0, weights, seed=5),
                        settings=SimSettings(eviction="lfu"), max_requests=300)

    a, b = run(), run()
    ids = a.records["id"]
    assert sorted(ids.tolist()) == list(range(300))  # every request completed exactly once
    reused, prompt = a.records["reused_tokens"], a.records["prompt_tokens"]
    assert (reused >= 0).all() and (reused < prompt).all()
    assert a.records["dram_tokens"].sum() <= reused.sum()
    assert (a.records["ttft_ms"] > 0).all() and (a.records["e2e_ms"] >= a.records["ttft_ms"]).all()
    for f in a.records:
        np.testing.assert_array_equal(a.records[f], b.records[f])
    assert a.load_bins.sum() > 0


def test_a_run_is_freed_without_the_collector_and_collection_is_as_it_was(monkeypatch):
    """simulate runs with automatic collection off; the Simulation (a cycle through its workers'
    callbacks) is freed by reference counting once the result is out, and the collector is left
    as it was found (fails if release() keeps the cycle or simulate leaves collection off)."""
    topo = two_region_topology(2, 2, vram=20_000, dram=40_000)
    release, runs, during = Simulation.release, [], []

    def watched(self):
        runs.append(weakref.ref(self))
        during.append(gc.isenabled())
        release(self)

    monkeypatch.setattr(Simulation, "release", watched)
    gc.collect()
    assert gc.isenabled()
    gc.disable()  # nothing but reference counting can free the Simulation below
    try:
        simulate(topo, make_baseline("dynamo", topo), MixedWorkload(200.0, {"a": 1, "b": 1}, seed=5),
                 max_requests=50)
        assert not gc.isenabled()  # left off, as it was
        assert runs and runs[0]() is None
    finally:
        gc.enable()
    simulate(topo, make_baseline("dynamo", topo), MixedWorkload(200.0, {"a": 1, "b": 1}, seed=5), max_requests=50)
    assert during == [False, False] and gc.isenabled() and runs[1]() is None


def test_chat_with_jitter_is_seeded():
    topo = two_region_topology(2, 2)
    weights = {"a": 1.0, "b": 1.0}
    runs = [simulate(topo, make_baseline("load-balance-oracle", topo), ChatWorkload(100.0, weights, flavour="lmsys", seed=1),
                     settings=SimSettings(wan_jitter=0.5, seed=s), max_requests=100) for s in (1, 1, 2)]
    assert np.array_equal(runs[0].records["ttft_ms"], runs[1].records["ttft_ms"])
    assert not np.array_equal(runs[0].records["ttft_ms"], runs[2].records["ttft_ms"])


def test_bad_decisions_and_settings_are_rejected():
    topo = two_region_topology(1, 1)
    with pytest.raises(PolicyError):
        simulate(topo, Fixed(topo, worker=5), [req(0, 0.0, TOKENS)])
    with pytest.raises(PolicyError):
        RouteDecision(-1)
    with pytest.raises(SimulationError):
        SimSettings(eviction="fifo")
    with pytest.raises(SimulationError):
        simulate(topo, Fixed(topo, worker=0), [req(0, 1.0, TOKENS), req(1, 0.5, TOKENS)])


class Migrating(Fixed):
    def __init__(self, topo, order):
        super().__init__(topo, worker=0)
        self.orders = [order]

    def take_migrations(self):
        out, self.orders = self.orders, []
        return out


def test_cross_region_migration_recomputes_on_destination():
    topo = two_region_topology(1, 1)
    policy = Migrating(topo, MigrationOrdered(dest_worker=1, tokens=TOKENS.astype(np.uint32), source_worker=0))
    res = simulate(topo, policy, [req(0, 0.0, np.arange(9000, 9100)), req(1, 1.0, TOKENS, region="b")])
    assert res.extra["migrations"] == 1
    assert any(w == 1 for w, _, _ in policy.events)  # the destination registered the prefix
    assert res.completed == 2  # migration jobs are not user requests


def test_kvcompass_adapter_runs_in_the_engine_and_reuses():
    from kvcompassd.sim.schemes import make_policy

    topo = two_region_topology(2, 2, vram=50_000)
    shared = np.arange(20_000, 22_000)
    reqs = [req(i, 0.05 * i, np.concatenate([shared, np.arange(i * 100, i * 100 + 50)]), region="ab"[i % 2])
            for i in range(12)]
    res = simulate(topo, make_policy("kvcompass", topo), reqs)
    assert res.completed == 12
    assert res.records["reused_tokens"][1:].max() >= 1984  # later requests find the shared prefix
    # The claimed matches the view returned are real: no request reused less than claimed here.
    assert (res.records["claimed_tokens"] <= res.records["reused_tokens"] + 16).all()


def test_larger_pages_keep_baselines_consistent():
    topo = two_region_topology(2, 2, page_tokens=64)
    assert topo.block_size == 64
    tokens = np.arange(300, 300 + 640)
    res = simulate(topo, make_baseline("central-directory", topo), [req(0, 0.0, tokens), req(1, 1.0, tokens)])
    assert res.records["claimed_tokens"][1] == 640 and res.records["reused_tokens"][1] == 639


class StuckTimer(Fixed):
    def next_timer(self):
        return 0.0


def test_a_policy_timer_that_never_advances_is_reported():
    topo = two_region_topology(1, 0)
    with pytest.raises(SimulationError, match="timer stuck"):
        simulate(topo, StuckTimer(topo, worker=0), [req(0, 1.0, TOKENS)])


# One worker with 40 pages of VRAM. TOKENS (20 pages) is demoted to DRAM by a 40-page prompt;
# that prompt's follow-up pins all 40 VRAM pages while its long suffix is prefilled and while it
# decodes (99 more tokens), and a request for TOKENS queues behind it.
ROOM_FILLER = np.arange(20_000, 20_640)
ROOM_STREAM = [req(0, 0.0, TOKENS), req(1, 1.0, ROOM_FILLER),
               req(2, 2.0, np.concatenate([ROOM_FILLER, np.arange(30_000, 35_000)]), out=100),
               req(3, 2.001, np.concatenate([TOKENS, np.arange(40_000, 40_100)])),
               req(4, 10.0, np.concatenate([TOKENS, np.arange(40_000, 40_100)]))]


def test_a_prefill_waits_for_room_beside_the_running_requests_then_reloads_its_dram_copy():
    topo = two_region_topology(1, 0, vram=640, dram=10_000)
    res = simulate(topo, Fixed(topo, worker=0, claim=320), ROOM_STREAM, settings=SimSettings(track_truth=True))
    r = res.records
    # Its 26 pages do not fit beside the follow-up's 40 pinned ones: it starts when the
    # follow-up finishes (prefill of 5,000 tokens, then 99 batch-1 steps), and reloads TOKENS.
    follow_up_done = 2.0 + INTRA / 1000 + (5000 * BETA + 99 * DECODE) / 1000
    assert r["queue_ms"][3] == pytest.approx((follow_up_done - 2.001 - INTRA / 1000) * 1000)
    assert r["reused_tokens"][3] == 320 and r["dram_tokens"][3] == 320 and r["false_cause"][3] == 0


def test_the_queue_a_worker_reports_counts_the_wait_for_vram_room():
    # When the follow-up's prefill ends, the request for TOKENS is at the head with no room
    # beside the follow-up's 40 pinned pages: the load reported then is the wait of a new
    # arrival behind it, the follow-up's 99 decode steps, then TOKENS's reload and the rest of
    # its prefill; not its prefill alone (a report blind to the room gave that, ~11.7 ms).
    topo = two_region_topology(1, 0, vram=640, dram=10_000)
    policy = Fixed(topo, worker=0, claim=320)
    simulate(topo, policy, ROOM_STREAM)
    prefilled = 2.0 + INTRA / 1000 + 5000 * BETA / 1000
    reported = [q for w, q, now in policy.loads if now == pytest.approx(prefilled)][-1]
    own_prefill = 100 * BETA + 320 * topo.gamma_ms_per_token  # TOKENS reloaded, 100 tokens computed
    assert reported == pytest.approx(99 * DECODE + own_prefill)


class SeesEnds(Fixed):
    """A policy told each request's end as it reaches its edge."""

    def __init__(self, topo, worker: int):
        super().__init__(topo, worker)
        self.ends: list = []

    def on_request_end(self, worker_index, req, *, now):
        self.ends.append((worker_index, req.id, now))


def test_a_policy_that_asks_is_told_each_requests_end_when_it_reaches_the_edge():
    topo = two_region_topology(1, 1)
    policy = SeesEnds(topo, worker=1)
    res = simulate(topo, policy, [req(0, 0.0, TOKENS, out=3), req(1, 0.5, TOKENS, out=1)])
    r = res.records
    assert policy.ends == [(1, 0, pytest.approx(r["e2e_ms"][0] / 1000)),
                           (1, 1, pytest.approx(0.5 + r["e2e_ms"][1] / 1000))]


def test_a_dram_copy_that_finds_no_vram_to_reload_into_is_told_apart_from_one_lost_in_flight(monkeypatch):
    # Where prefills start without waiting for room (a disaggregated fleet's prefill workers,
    # whose KV stays pinned through its transfer), the request for TOKENS finds, when its
    # prefill starts, its prefix held (in DRAM) and nowhere to reload it.
    monkeypatch.setattr(Simulation, "_admit_only_if_room", False)
    topo = two_region_topology(1, 0, vram=640, dram=10_000)
    res = simulate(topo, Fixed(topo, worker=0, claim=320), ROOM_STREAM, settings=SimSettings(track_truth=True))
    r = res.records
    assert r["held_at_decision"][3] == 320 and r["reused_tokens"][3] == 0
    assert r["false_cause"][3] == FALSE_NO_VRAM_ROOM
    # Once the pins are gone the same claim is delivered: no false lookup.
    assert r["reused_tokens"][4] >= 320 and r["false_cause"][4] == 0


def test_the_prefix_is_matched_when_the_prefill_starts_not_at_arrival():
    # SGLang and vLLM match the prompt against the cache as the request leaves the waiting queue.
    # Two identical prompts arriving together: the second starts after the first's prefill has
    # cached the prompt, so it reuses all of it but the last token.
    topo = two_region_topology(1, 0)
    res = simulate(topo, Fixed(topo, worker=0), [req(0, 0.0, TOKENS), req(1, 0.0, TOKENS)])
    r = res.records
    assert r["reused_tokens"].tolist() == [0, 319]
    assert r["ttft_ms"][1] == pytest.approx(INTRA + 320 * BETA + 1 * BETA + INTRA)


def test_a_prefix_evicted_while_the_request_waits_is_computed_again():
    # 40 pages of VRAM, no DRAM. TOKENS (20 pages) is cached; a 40-page prompt arrives, then a
    # request for TOKENS while that prompt is prefilled. Its prefix was not pinned on arrival,
    # so caching the 40-page prompt evicts it and the request reuses nothing.
    topo = two_region_topology(1, 0, vram=640, dram=0)
    big = np.arange(20_000, 20_640)
    mine = np.concatenate([TOKENS, np.arange(40_000, 40_100)])
    res = simulate(topo, Fixed(topo, worker=0), [req(0, 0.0, TOKENS), req(1, 1.0, big), req(2, 1.001, mine)])
    r = res.records
    assert r["reused_tokens"].tolist() == [0, 0, 0]
    queued = 640 * BETA - 1.0  # behind the 40-page prefill, which started 1 ms before it arrived
    assert r["queue_ms"][2] == pytest.approx(queued)
    assert r["ttft_ms"][2] == pytest.approx(INTRA + queued + 420 * BETA + INTRA)


class CountsRunning(Fixed):
    def on_worker_load(self, worker_index, queue_ms, *, now, running=0):
        self.loads.append((worker_index, running, now))


def test_a_workers_last_request_ending_is_reported_at_once_with_nothing_running():
    # Two requests decode together on worker 0 and end 5 and 20 decode steps after their
    # prefills; nothing waits, so no queue changes then. The daemon's agent sends a count reaching
    # zero at once (pacing.LoadReports; a change within its tolerance waits): each end is a reading with one request fewer,
    # the last with none, at the instant it ended (the score's decode stall reads the count).
    topo = two_region_topology(1, 0)
    policy = CountsRunning(topo, worker=0)
    res = simulate(topo, policy, [req(0, 0.0, TOKENS, out=6), req(1, 0.0, np.arange(5000, 5320), out=21)])
    ends = sorted(res.records["finish_s"] - INTRA / 1000)  # at the worker
    counts_at = {round(now, 9): running for _, running, now in policy.loads}
    assert counts_at[round(ends[0], 9)] == 1 and counts_at[round(ends[1], 9)] == 0
    assert policy.loads[-1][1] == 0


def test_a_prompt_past_the_models_context_lengthens_the_room_horizon():
    """A replayed trace's prompt longer than the context is served (no front door here), and
    from it on, a worker reports its room until it has that prompt's pages free."""
    topo = two_region_topology(1, 0, context=256)
    sim = Simulation(topo, Fixed(topo, worker=0))
    assert sim._room_enough_pages == 16
    res = sim.run([req(0, 0.0, TOKENS[:200]), req(1, 1.0, TOKENS), req(2, 2.0, TOKENS[:100])])
    assert res.completed == 3 and sim._room_enough_pages == 20  # 320 tokens


def _room_heavy_stream(n: int = 80) -> list[Request]:
    """Prompts of up to the context (2,048 tokens) on four workers of 4,096 tokens of VRAM,
    with long answers: a worker's running requests often pin more than the 2,048 tokens it
    must keep free to take any prompt, and often less."""
    rng = np.random.default_rng(7)
    stems = [np.arange(100_000 * k, 100_000 * k + 1024) for k in range(4)]
    out = []
    for i in range(n):
        stem = stems[int(rng.integers(len(stems)))][: int(rng.integers(256, 1024))]
        tail = np.arange(1_000_000 + 10_000 * i, 1_000_000 + 10_000 * i + int(rng.integers(16, 1024)))
        out.append(req(i, 0.02 * i, np.concatenate([stem, tail]), out=int(rng.integers(5, 60)), region="ab"[i % 2]))
    return out


def test_room_read_empty_past_a_context_s_worth_free_routes_as_the_full_steps(monkeypatch):
    """A worker with the model's context free reports no room steps (``room_steps``'s
    ``enough_pages``): no prompt waits there, so KVCompass decides exactly as with the full
    steps. Both cases occur: reports cut to nothing, and steps still reported."""
    from kvcompassd.sim.schemes import make_policy

    topo = two_region_topology(2, 2, vram=4096, context=2048)
    runs, reported = {}, {}
    for cut in (True, False):
        monkeypatch.setattr(Simulation, "_room_cut_at_context", cut)
        policy = make_policy("kvcompass", topo)
        told = policy.on_worker_room
        seen = reported[cut] = []

        def on_worker_room(w, steps, *, now, told=told, seen=seen):
            seen.append(bool(steps))
            return told(w, steps, now=now)

        policy.on_worker_room = on_worker_room
        runs[cut] = simulate(topo, policy, _room_heavy_stream())
    assert len(reported[True]) == len(reported[False])
    assert any(reported[True]) and sum(reported[True]) < sum(reported[False])
    for field, column in runs[False].records.items():
        assert np.array_equal(runs[True].records[field], column, equal_nan=column.dtype.kind == "f"), field
