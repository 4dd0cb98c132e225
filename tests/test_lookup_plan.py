"""The C lookup (``kvc_lookup_plan``) and C score (``kvc_score_joint``) equal their Python references."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from clusters import make_cluster
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.lookup import PrefixLookup
from kvcompassd.core.lookup_plan import SMALL_FLEET, LookupPlan, LookupPlanError, QueueAging, ViewPointers, top_k
from kvcompassd.core.score import JointScorer, NoEligibleWorkerError

SHARDS = 3
REGIONS = {"a": 3, "b": 18, "c": 2}  # b is split into two groups with 32-bit values


class World:
    """Shards, and per region an edge view read by a native and a reference lookup."""

    def __init__(self, *, fingerprint_bits: int, consistency: bool, value_bits: int, ready: tuple[int, ...],
                 **score: float):
        self.cfg = make_cluster(REGIONS, shards=SHARDS, one_way_ms=2.0, fingerprint_bits=fingerprint_bits,
                                value_bits=value_bits, levels=5, same_region_min_tokens=16, **score)
        self.layout = IndexLayout.from_config(self.cfg)
        self.plan = LevelPlan.from_config(self.cfg)
        self.salt = namespace_salt(self.cfg.model)
        # Tiny tables: the keyless views then answer most never-inserted keys with some other
        # key's value (false hits), which is what the consistency rule and early stop act on.
        self.shards = [MaintenanceShard(self.layout, s, SHARDS, epoch=1, initial_capacity=16,
                                        fingerprint_bits=fingerprint_bits) for s in range(SHARDS)]
        self.ready = ready
        self.views = {r: EdgeIndexView(self.layout, SHARDS, edge=f"edge-{r}") for r in REGIONS}
        self.pairs = {}
        for r, view in self.views.items():
            self.install(view)
            self.pairs[r] = (PrefixLookup(self.layout, self.plan, r, self.salt, view, consistency=consistency),
                             PrefixLookup(self.layout, self.plan, r, self.salt, view, consistency=consistency,
                                          native=False))

    def install(self, view: EdgeIndexView) -> None:
        for s in self.ready:
            assert view.install_snapshot(self.shards[s].snapshot()).applied

    def send(self, events) -> None:
        for e in events:
            self.shards[e.key % SHARDS].apply([e])
        for s in self.ready:
            batch = self.shards[s].flush()
            if batch is not None:
                for view in self.views.values():
                    assert view.apply_next(batch) is None

    def assert_equal(self, tokens: np.ndarray) -> None:
        for region, (native, reference) in self.pairs.items():
            got, want = native.lookup(tokens), reference.lookup(tokens)
            assert got.prompt_len == want.prompt_len
            assert got.family_key == want.family_key, region
            assert got.matched.dtype == want.matched.dtype and got.tier.dtype == want.tier.dtype
            np.testing.assert_array_equal(got.matched, want.matched, err_msg=region)
            np.testing.assert_array_equal(got.tier, want.tier, err_msg=region)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, n, dtype=np.uint32)


# (worker, prompt, which registration lengths as a bit mask, tier, evict instead)
operations = st.lists(
    st.tuples(st.integers(0, 22), st.integers(0, 3), st.integers(0, (1 << 12) - 1),
              st.sampled_from([Tier.VRAM, Tier.DRAM]), st.booleans()),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=operations, fingerprint_bits=st.sampled_from([0, 8]), consistency=st.booleans(),
       value_bits=st.sampled_from([32, 64]), ready=st.sampled_from([(0, 1, 2), (0, 2)]),
       prompt_lengths=st.lists(st.integers(1, 900), min_size=1, max_size=4))
def test_native_lookup_equals_the_python_reference(ops, fingerprint_bits, consistency, value_bits, ready,
                                                   prompt_lengths):
    w = World(fingerprint_bits=fingerprint_bits, consistency=consistency, value_bits=value_bits, ready=ready)
    prompts = [_prompt(200 + p, 900) for p in range(4)]
    lengths = w.plan.registration_lengths_upto(900)
    for worker_index, p, mask, tier, evict in ops:
        worker = w.layout.worker_ids[worker_index]
        # Arbitrary subsets of lengths: runs with holes, as stale or partial registrations leave.
        chosen = [n for i, n in enumerate(lengths) if mask >> (i % 12) & 1]
        if not chosen:
            continue
        keys = prefix_keys(prompts[p], chosen, w.salt).tolist()
        if evict:
            holders = [k for k in keys if worker in w.shards[k % SHARDS].holders(k)]
            w.send([PrefixEvicted(worker, k) for k in holders])
        else:
            w.send([PrefixCached(worker, k, tier) for k in keys])
    for p in prompts:
        for n in prompt_lengths:
            w.assert_equal(p[:n])
    w.assert_equal(_prompt(999, 900))  # never registered: only false hits can show
    # A snapshot replaces a shard's views: the native path must follow the new ones.
    for view in w.views.values():
        for s in ready:
            w.shards[s].flush()
            snap = w.shards[s].snapshot()
            assert view.install_snapshot(snap).applied or snap.seq <= view.position(s)[1]
    w.send([PrefixCached(w.layout.worker_ids[0], int(k), Tier.DRAM) for k in prefix_keys(prompts[0], lengths, w.salt)])
    for p in prompts:
        w.assert_equal(p)


def test_a_replaced_view_is_followed_and_kept_alive():
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    tokens = _prompt(1, 700)
    native, reference = w.pairs["a"]
    before = native.lookup(tokens).matched.copy()
    assert not before.any()
    keys = prefix_keys(tokens, w.plan.registration_lengths_upto(700), w.salt).tolist()
    for k in keys:
        w.shards[k % SHARDS].apply([PrefixCached("a-1", k, Tier.VRAM)])
    view = w.views["a"]
    for s in range(SHARDS):  # the edge learns the change by snapshot only: new view objects
        w.shards[s].flush()
        assert view.install_snapshot(w.shards[s].snapshot()).applied
    after = native.lookup(tokens)
    assert after.matched[w.layout.worker_index("a-1")] == w.plan.lengths_toward_upto("a", "a", 700)[-1]
    np.testing.assert_array_equal(after.matched, reference.lookup(tokens).matched)


def test_plan_without_ready_shards_reads_nothing():
    layout = IndexLayout.from_config(make_cluster({"x": 2, "y": 1}, shards=2))
    view = EdgeIndexView(layout, 2, edge="e")
    group_lengths = np.array([[32, 64, 0], [48, 64, 96]], dtype=np.int64)
    plan = LookupPlan(group_lengths, np.array([32, 48, 64, 96]), layout.worker_group, layout.worker_shift,
                      shards=2, consistency=True)
    matched, tier = plan.run(ViewPointers(view, 2).pointers(), np.arange(1, 5, dtype=np.uint64))
    assert matched.tolist() == [0, 0, 0] and tier.tolist() == [0, 0, 0]
    assert not plan.values().any()


@pytest.mark.parametrize("kwargs, message", [
    (dict(group_lengths=np.array([32, 64])), "2-D"),
    (dict(group_lengths=np.array([[64, 32]])), "ascend"),
    (dict(group_lengths=np.array([[32, 0, 64]])), "padding"),
    (dict(group_lengths=np.array([[32, 80]])), "query lengths"),
    (dict(query_lengths=np.array([64, 32])), "ascending"),
    (dict(worker_group=np.array([0, 1])), "groups"),
    (dict(worker_shift=np.array([3, 0])), "even"),
    (dict(worker_shift=np.array([0])), "one length"),
    (dict(shards=0), "shards"),
])
def test_bad_plans_are_rejected(kwargs, message):
    args = dict(group_lengths=np.array([[32, 64]]), query_lengths=np.array([32, 64]),
                worker_group=np.array([0, 0]), worker_shift=np.array([0, 2]), shards=1)
    args.update(kwargs)
    shards = args.pop("shards")
    with pytest.raises(LookupPlanError, match=message):
        LookupPlan(**args, shards=shards, consistency=True)


def test_run_rejects_keys_that_are_not_uint64():
    plan = LookupPlan(np.array([[32]]), np.array([32]), np.array([0]), np.array([0]), shards=1, consistency=False)
    layout = IndexLayout(("r",), (("w", "r"),), 32)
    pointers = ViewPointers(EdgeIndexView(layout, 1, edge="e"), 1).pointers()
    with pytest.raises(LookupPlanError, match="uint64"):
        plan.run(pointers, np.array([1, 2], dtype=np.int64))


# -- the score -------------------------------------------------------------------------------

SCORE_CFG = make_cluster({"us": 4, "eu": 3, "ap": 2}, one_way_ms=30.0, prefill_ms_per_token=0.08)
N = len(SCORE_CFG.workers)
floats = st.floats(0.0, 500.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(prompt_len=st.integers(0, 5000),
       matched=st.lists(st.integers(0, 5000), min_size=N, max_size=N),
       tier=st.lists(st.integers(0, 3), min_size=N, max_size=N),
       queue=st.lists(st.one_of(floats, st.just(0.0), st.just(float("inf"))), min_size=N, max_size=N),
       belief=st.lists(st.floats(0.0, 1.0), min_size=N, max_size=N),
       eligible=st.one_of(st.none(), st.lists(st.booleans(), min_size=N, max_size=N)),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       origin=st.sampled_from(["us", "eu", "ap"]))
def test_native_score_equals_the_numpy_reference(prompt_len, matched, tier, queue, belief, eligible, flags, origin):
    scorer = JointScorer(SCORE_CFG, origin)
    ablation = Ablation(load_aware=flags[0], tier_aware=flags[1], cross_region=flags[2])
    args = (prompt_len, np.array(matched, np.int64), np.array(tier, np.uint8), np.array(queue, np.float64),
            np.array(belief, np.float64))
    mask = None if eligible is None else np.array(eligible, dtype=bool)
    outcomes = []
    for native in (True, False):
        try:
            r = scorer.score(*args, ablation=ablation, eligible=mask, native=native)
        except ValueError as exc:
            outcomes.append(type(exc))
        else:
            outcomes.append((r.chosen, r.worker, r.lam, r.scores.tobytes(), r.top(3)))
    assert outcomes[0] == outcomes[1]


@settings(max_examples=150, deadline=None)
@given(prompt_len=st.integers(0, 5000),
       matched=st.lists(st.sampled_from([0, 16, 700, 5000]), min_size=N, max_size=N),
       tier=st.lists(st.integers(0, 3), min_size=N, max_size=N),
       queue=st.lists(st.sampled_from([0.0, 3.5, 250.0, float("inf")]), min_size=N, max_size=N),
       belief=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=N, max_size=N),
       eligible=st.one_of(st.none(), st.lists(st.booleans(), min_size=N, max_size=N)),
       last_sent=st.lists(st.integers(0, 3), min_size=N, max_size=N),
       origin=st.sampled_from(["us", "eu", "ap"]))
def test_score_choose_rotates_ties_as_the_router_did(prompt_len, matched, tier, queue, belief, eligible, last_sent,
                                                      origin):
    """``ScoreKernel.choose`` (the Router's rescoring after a pending-ledger credit) gives the
    scores, argmin and lam of ``JointScorer.score`` and the winner the Router's numpy tie
    rotation gave (among scores equal to the argmin's, the first of the least recently sent).
    Few distinct values, so that exact ties are common."""
    scorer = JointScorer(SCORE_CFG, origin)
    args = (np.array(matched, np.int64), np.array(tier, np.uint8), np.array(queue, np.float64),
            np.array(belief, np.float64))
    mask = None if eligible is None else np.array(eligible, dtype=bool)
    sent = np.array(last_sent, dtype=np.int64)
    try:
        reference = scorer.score(prompt_len, *args, eligible=mask)
    except Exception as exc:  # noqa: BLE001 - the same refusal is expected below
        reference = exc
    matched_a, tier_a, queue_a, belief_a = args
    best, chosen, lam, scores = scorer.kernel.choose(float(prompt_len), queue_a, belief_a, matched_a, tier_a, mask,
                                                     scorer.kernel_flags(Ablation()), sent)
    if isinstance(reference, Exception):
        assert not np.isfinite(scores[best])
        return
    assert (best, lam, scores.tobytes()) == (reference.chosen, reference.lam, reference.scores.tobytes())
    ties = np.flatnonzero(scores == scores[best])
    expected = int(ties[np.argmin(sent[ties])]) if ties.size > 1 else best
    assert chosen == expected


# -- the whole decision ----------------------------------------------------------------------


def _reference_router(cfg, region, view, ablation):
    """A Router forced onto every reference path: Python lookup, numpy score, full observation."""
    from kvcompassd.core.router import Router

    router = Router(cfg, region, view, now=0.0, ablation=ablation, native=False)
    assert router._kernel is None and not router.lookup.native

    def observe_everything(found, result, chosen, now, flags):
        # What the Router did before the C summary: a full observation for every miss.
        return router.hot.observe(router._observation(found, result.scores, chosen, now), now=now)

    router._observe = observe_everything
    return router



def _idle_locals(w, region: str, *routers) -> None:
    """Each router's own-region workers read idle (0 ms) at time 0."""
    for router in routers:
        for worker in w.cfg.workers_in(region):
            router.queues.set_local(worker.id, 0.0, now=0.0)

def _state(router):
    return [(k, list(f.misses), list(f.load_losses), f.cooldown_until) for k, f in router.hot._families.items()]


@settings(max_examples=20, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 22), st.integers(0, 900), st.booleans(),
                                st.lists(st.tuples(st.integers(0, 22), st.integers(1, 5000), st.integers(0, 3)),
                                         max_size=4)),
                      min_size=1, max_size=12),
       region=st.sampled_from(["a", "b", "c"]))
def test_a_reused_buffer_zeroes_what_its_last_decision_or_a_writer_left(steps, region):
    """``run_out`` reuses a buffer whose last decision's matches C zeroes at the workers it
    listed, or everywhere when a ``writable`` view may have changed others: each decision's
    matches and tiers equal a fresh ``run_aged``'s, whatever the previous decision on the same
    buffer found or a writer put there; the views are read-only unless asked for writable."""
    from kvcompassd.core.router import Router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, region, w.views[region], now=0.0)
    kernel, queues = router._kernel, router.queues
    prompts = [_prompt(700 + p, n_tokens) for p, n_tokens in enumerate((900, 333, 10))]
    lengths = w.plan.registration_lengths_upto(900)
    belief = router.belief.values.copy()
    now = 1.0
    buffers = set()
    for p, worker_index, cached, write, junk in steps:
        covered = [m for m in lengths if m <= min(cached, len(prompts[p]))]
        if covered:
            w.send([PrefixCached(w.layout.worker_ids[worker_index], k, Tier.VRAM)
                    for k in prefix_keys(prompts[p], covered, w.salt).tolist()])
        now += 0.05
        ms = queues.queue_ms()
        m, t = kernel.run_aged(prompts[p], ms, now, None, False, belief, None)[:2]
        arrays = kernel.run_out(prompts[p], ms, now, None, False, belief, None)[0]
        buffers.add(id(arrays.out))
        assert arrays.matched().tobytes() == m.tobytes() and arrays.tier().tobytes() == t.tobytes()
        assert not arrays.matched().flags.writeable and not arrays.tier().flags.writeable
        if write:  # what the pending ledger does: raise matches in place
            matched, tier = arrays.matched(writable=True), arrays.tier(writable=True)
            for i, length, code in junk:
                matched[i], tier[i] = length, code
            del matched, tier
        del arrays
    assert len(buffers) == 1  # nothing held a decision: each reused the one buffer


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 22), st.integers(0, 900),
                                st.sampled_from([Tier.VRAM, Tier.DRAM]), st.floats(0.0, 40.0),
                                st.frozensets(st.integers(0, 22), max_size=3), st.booleans()),
                      min_size=1, max_size=25),
       ablation=st.sampled_from([Ablation(), Ablation(cross_region=False), Ablation(load_aware=False),
                                 Ablation(tier_aware=False)]),
       region=st.sampled_from(["a", "b", "c"]))
def test_router_decisions_equal_the_reference_paths(steps, ablation, region):
    """Same winners, terms, migrations and detector state as with every reference path."""
    from kvcompassd.core.router import Router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    view = w.views[region]
    fast = Router(w.cfg, region, view, now=0.0, ablation=ablation)
    slow = _reference_router(w.cfg, region, view, ablation)
    _idle_locals(w, region, fast, slow)
    # Prompts shorter than some or all query lengths too (the shortest fits none).
    prompts = [_prompt(300 + p, n) for p, n in enumerate((900, 900, 10, 333, 900))]
    lengths = w.plan.registration_lengths_upto(900)
    now = 2.0
    for p, worker_index, cached, tier, queue, exclude, as_list in steps:
        worker = w.layout.worker_ids[worker_index]
        covered = [n for n in lengths if n <= min(cached, len(prompts[p]))]
        keys = prefix_keys(prompts[p], covered, w.salt).tolist() if covered else []
        w.send([PrefixCached(worker, k, tier) for k in keys])
        for router in (fast, slow):
            router.queues.set_local(w.cfg.workers_in(region)[0].id, queue, now=now)
        now += 0.1
        tokens = prompts[p].tolist() if as_list else prompts[p]
        # Without cross-region reuse, an exclusion of every own-region worker leaves none
        # eligible: both paths must say so.
        decided = []
        for router in (fast, slow):
            try:
                decided.append(router.decide(tokens, now=now, exclude=exclude))
            except NoEligibleWorkerError:
                decided.append(None)
        a, b = decided
        assert (a is None) == (b is None)
        if a is None:
            continue
        for name in ("worker", "worker_index", "region", "claimed_tokens", "tier", "lam", "prompt_len", "local",
                     "migration", "top_k", "outcome", "candidates"):
            assert getattr(a, name) == getattr(b, name), name
        assert type(a.tier) is Tier and type(a.claimed_tokens) is int
        assert a.score.scores.tobytes() == b.score.scores.tobytes()
        assert _state(fast) == _state(slow)
        np.testing.assert_array_equal(fast.queues.queue_ms(), slow.queues.queue_ms())


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 22), st.integers(0, 900),
                                st.sampled_from([Tier.VRAM, Tier.DRAM]), st.floats(0.0, 40.0),
                                st.frozensets(st.integers(0, 22), max_size=3), st.booleans(), st.booleans(),
                                st.booleans()),
                      min_size=1, max_size=12),
       region=st.sampled_from(["a", "b", "c"]))
def test_run_out_equals_run_aged_bit_for_bit(steps, region):
    """The one-buffer fused call (``run_out``, what the Router runs) gives ``run_aged``'s arrays and
    answers: each ``DecisionArrays`` view and value read equals its array, the winner's match and
    tier equal the arrays' (with and without a correction, the occupancy, excluded workers)."""
    from kvcompassd.core.router import Router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, region, w.views[region], now=0.0)
    kernel, queues = router._kernel, router.queues
    n = len(w.layout.worker_ids)
    prompts = [_prompt(500 + p, n_tokens) for p, n_tokens in enumerate((900, 333, 10))]
    lengths = w.plan.registration_lengths_upto(900)
    now = 1.0
    for p, worker_index, cached, tier, queue, exclude, corrected, occupied, belief_nan in steps:
        worker = w.layout.worker_ids[worker_index]
        covered = [m for m in lengths if m <= min(cached, len(prompts[p]))]
        if covered:
            w.send([PrefixCached(worker, k, tier) for k in prefix_keys(prompts[p], covered, w.salt).tolist()])
        queues.set_local(w.cfg.workers_in(region)[0].id, queue, now=now)
        now += 0.05
        ms = queues.queue_ms()
        slots = int(queues.aging_arrays()[3].max()) + 1
        correction = np.linspace(0.0, queue, slots) if corrected else None
        belief = router.belief.values.copy()
        if belief_nan:
            belief[worker_index] = np.nan  # the full (unpruned) call, copied into one buffer
        eligible = None
        if exclude:
            eligible = np.ones(n, dtype=bool)
            eligible[list(exclude)] = False
        want = kernel.run_aged(prompts[p], ms, now, correction, occupied, belief, eligible)
        keys_want = kernel.keys().copy()
        got = kernel.run_out(prompts[p], ms, now, correction, occupied, belief, eligible)
        np.testing.assert_array_equal(kernel.keys(), keys_want)
        m, t, scores, best, chosen, lam, miss, family, complete, aged, scored = want
        arrays = got[0]
        assert got[1:7] == (best, chosen, lam, miss, family, complete)
        # best is -1 when no worker is eligible (its values then 0)
        assert got[7:] == (m.item(chosen), t.item(chosen), m.item(best) if best >= 0 else 0,
                           t.item(best) if best >= 0 else 0)
        assert type(got[7]) is int and type(got[8]) is int
        assert arrays.matched().tobytes() == m.tobytes() and arrays.tier().tobytes() == t.tobytes()
        assert arrays.aged().tobytes() == aged.tobytes() and arrays.queue().tobytes() == scored.tobytes()
        assert (arrays.queue() is arrays.aged()) == (scored is aged)
        assert not arrays.aged().flags.writeable and not arrays.queue().flags.writeable
        if best >= 0:
            assert arrays.score_at(best) == scores.item(best)
        # Unless complete, only the holders' and the unpruned blocks' scores were written.
        written = np.arange(n) if complete else np.unique(np.r_[kernel.holders(), [best, chosen]])
        written = written[written >= 0]
        assert arrays.scores()[written].tobytes() == scores[written].tobytes()
        for i in range(n):
            assert arrays.queue_at(i) == scored.item(i) and arrays.aged_at(i) == aged.item(i)


@pytest.mark.parametrize("regions", [{"a": 2, "b": 2}, REGIONS], ids=["small fleet", "large fleet"])
def test_the_pruned_call_takes_only_finite_beliefs_and_falls_back_for_the_rest(regions):
    """``belief_finite`` lets the pruned call take finite beliefs only (checked in Python up to
    ``SMALL_FLEET`` workers, in numpy past it): a NaN or an infinity takes the full call, and so
    do finite values too large to sum in a small fleet; ``run_out`` then gives ``run_aged``'s
    answers all the same. A belief array of the wrong length is never taken."""
    from kvcompassd.core.router import Router

    cfg = make_cluster(regions, shards=SHARDS, one_way_ms=2.0, levels=5, same_region_min_tokens=16)
    layout = IndexLayout.from_config(cfg)
    shard = MaintenanceShard(layout, 0, 1, epoch=1)
    prompt = _prompt(77, 600)
    salt = namespace_salt(cfg.model)
    shard.apply([PrefixCached(layout.worker_ids[1], k, Tier.VRAM)
                 for k in prefix_keys(prompt, LevelPlan.from_config(cfg).registration_lengths_upto(600), salt).tolist()])
    shard.flush()
    view = EdgeIndexView(layout, 1, edge="edge-a")
    assert view.install_snapshot(shard.snapshot()).applied
    router = Router(cfg, "a", view, now=0.0)
    kernel, n = router._kernel, len(layout.worker_ids)
    small = n <= SMALL_FLEET
    assert small == (regions is not REGIONS)
    ms = router.queues.queue_ms()
    cases = {"ones": (np.ones(n), True), "nan": (np.r_[np.nan, np.ones(n - 1)], False),
             "inf": (np.r_[np.ones(n - 1), np.inf], False), "-inf": (np.r_[-np.inf, np.ones(n - 1)], False),
             "too large to sum": (np.full(n, 1e308), not small), "one short": (np.ones(n - 1), False)}
    for name, (belief, finite) in cases.items():
        assert kernel.belief_finite(belief) is finite, name
        if len(belief) != n:
            continue
        want = kernel.run_aged(prompt, ms, 1.0, None, False, belief, None)
        got = kernel.run_out(prompt, ms, 1.0, None, False, belief, None)
        assert got[1:7] == want[3:9], name
        assert got[0].matched().tobytes() == want[0].tobytes(), name
        assert want[0].item(1) > 0, name  # (the holder is found whatever the beliefs)


@settings(max_examples=20, deadline=None)
@given(keep=st.lists(st.sampled_from(["drop", "arrays", "matched", "aged", "queue", "scores", "tier"]),
                     min_size=1, max_size=14),
       region=st.sampled_from(["a", "b", "c"]))
def test_run_out_reuses_a_buffer_only_once_nothing_else_holds_it(keep, region):
    """``run_out`` takes its buffer from a small ring: a decision whose ``DecisionArrays``, or any
    array made from them, is still held keeps its values through every later decision; a buffer
    nothing holds any more is written again instead of a new one being made."""
    from kvcompassd.core.router import Router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, region, w.views[region], now=0.0)
    kernel, queues = router._kernel, router.queues
    prompts = [_prompt(900 + p, n_tokens) for p, n_tokens in enumerate((900, 333, 10))]
    lengths = w.plan.registration_lengths_upto(900)
    for worker_index in (0, 5, 11):
        covered = [m for m in lengths if m <= 600]
        w.send([PrefixCached(w.layout.worker_ids[worker_index], k, Tier.VRAM)
                for k in prefix_keys(prompts[0], covered, w.salt).tolist()])
    belief = router.belief.values.copy()
    held, buffers = [], set()
    now = 1.0
    for step, what in enumerate(keep):
        queues.set_local(w.cfg.workers_in(region)[0].id, float(step), now=now)
        now += 0.05
        arrays = kernel.run_out(prompts[step % 3], queues.queue_ms(), now, None, step % 2 == 1, belief, None)[0]
        buffers.add(id(arrays.out))
        whole = arrays.out.copy()
        if what == "arrays":
            held.append((arrays, arrays.out, whole))
        elif what != "drop":
            part = getattr(arrays, what)()
            held.append((part, part.base if part.base is not None else part, part.copy()))
        del arrays
        for part, _, copy in held:
            assert np.asarray(part.out if hasattr(part, "out") else part).tobytes() == \
                np.asarray(copy).tobytes()
    # A buffer held is never one a later decision wrote to.
    assert len({id(base) for _, base, _ in held}) == len(held)
    # Nothing held: after a ring's round, every decision reuses a buffer.
    held.clear()
    ring = len(kernel._out_ring)
    made = []  # weak references: they do not hold a buffer
    for step in range(3 * ring):
        now += 0.05
        arrays = kernel.run_out(prompts[0], queues.queue_ms(), now, None, False, belief, None)[0]
        if step < ring:
            made.append(weakref.ref(arrays.out))
        else:
            assert any(ref() is arrays.out for ref in made)
        del arrays


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 22), st.integers(0, 900),
                                st.sampled_from([Tier.VRAM, Tier.DRAM]), st.floats(0.0, 40.0),
                                st.frozensets(st.integers(0, 22), max_size=3), st.booleans()),
                      min_size=1, max_size=20),
       region=st.sampled_from(["a", "b", "c"]), pending=st.booleans())
def test_a_decisions_terms_do_not_depend_on_what_was_read_first(steps, region, pending):
    """Two Routers make the same decisions; one reads only the winner's terms (``top(1)``,
    ``total``: no array made), the other makes every array first. The winner's terms, the top 3,
    the scores, queues and matches agree, and so do the Routers' pending ledgers and queues."""
    from kvcompassd.core.router import Router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2),
              pending_hold_ms=1000.0 if pending else 0.0)
    view = w.views[region]
    lazy, eager = Router(w.cfg, region, view, now=0.0), Router(w.cfg, region, view, now=0.0)
    _idle_locals(w, region, lazy, eager)
    prompts = [_prompt(700 + p, n) for p, n in enumerate((900, 900, 10, 333, 900))]
    lengths = w.plan.registration_lengths_upto(900)
    now = 2.0
    for p, worker_index, cached, tier, queue, exclude, ends in steps:
        worker = w.layout.worker_ids[worker_index]
        covered = [n for n in lengths if n <= min(cached, len(prompts[p]))]
        if covered:
            w.send([PrefixCached(worker, k, tier) for k in prefix_keys(prompts[p], covered, w.salt).tolist()])
        for router in (lazy, eager):
            router.queues.set_local(w.cfg.workers_in(region)[0].id, queue, now=now)
        now += 0.1
        a = lazy.decide(prompts[p], now=now, exclude=exclude)
        b = eager.decide(prompts[p], now=now, exclude=exclude)
        arrays_first = (b.score.queue_ms.copy(), b.score.scores.copy(), b.score._matched.copy(), b.score._tier.copy())
        top_a, total_a = a.score.top(1), a.score.total
        assert top_a == b.score.top(1) and total_a == b.score.total
        assert top_a[0].worker == a.score.worker and top_a[0].total == total_a
        assert a.score.top(3) == b.score.top(3)
        for x, y in zip((a.score.queue_ms, a.score.scores, a.score._matched, a.score._tier), arrays_first):
            assert x.tobytes() == y.tobytes()
        for name in ("worker", "claimed_tokens", "tier", "lam", "pending", "dispatch", "migration"):
            assert getattr(a, name) == getattr(b, name), name
        np.testing.assert_array_equal(lazy.queues.queue_ms(), eager.queues.queue_ms())
        np.testing.assert_array_equal(lazy.queues.queue_ms(now=now), eager.queues.queue_ms(now=now))
        if pending:
            assert len(lazy.pending) == len(eager.pending)
        if ends:
            for router, d in ((lazy, a), (eager, b)):
                router.on_first_token(d.dispatch, now=now + 0.01)
                router.on_finished(d.dispatch, prompt_tokens=d.prompt_len, cached_tokens=d.claimed_tokens,
                                   output_tokens=4, now=now + 0.02)


def test_a_loaded_local_holder_is_copied_the_same_way_on_both_paths():
    from kvcompassd.core.router import Router

    # Without the pending ledger: with it, the second request of the prompt is credited to the
    # idle worker the first one was sent to (a replica made by recomputing), and nothing misses.
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2), pending_hold_ms=0.0)
    view = w.views["b"]
    fast, slow = Router(w.cfg, "b", view, now=0.0), _reference_router(w.cfg, "b", view, Ablation())
    tokens = _prompt(7, 900)
    keys = prefix_keys(tokens, w.plan.registration_lengths_upto(900), w.salt).tolist()
    w.send([PrefixCached("b-3", k, Tier.VRAM) for k in keys])
    plans = []
    for router in (fast, slow):
        for worker in w.cfg.workers_in("b"):
            router.queues.set_local(worker.id, 0.0, now=0.0)
        router.queues.set_local("b-3", 10_000.0, now=0.0)  # the only holder, far too busy
        plans.append([router.decide(tokens, now=2.0 + 0.1 * i).migration for i in range(4)])
        assert _state(router) == _state(fast)
    assert plans[0] == plans[1]
    assert plans[0][:2] == [None, None] and plans[0][2] is not None and plans[0][3] is None
    assert plans[0][2].mode == "copy" and plans[0][2].source_worker == "b-3"


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.floats(0.0, 50.0), st.floats(0.0, 50.0),
                               st.integers(1, 3)), min_size=1, max_size=12),
       chosen_seed=st.integers(0, 1000))
def test_miss_summary_equals_its_definition(data, chosen_seed):
    from kvcompassd.core.lookup_plan import MISS_LOCAL_HOLDER, MISS_LOST_TO_LOAD, MISS_REMOTE_WORTH, MissSummary

    local = np.array([d[0] for d in data])
    matched = np.array([d[1] for d in data], dtype=np.int64)
    scores = np.array([d[2] for d in data])
    queue = np.array([d[3] for d in data])
    floors = np.array([d[4] for d in data], dtype=np.int64)
    chosen = chosen_seed % len(data)
    holders = np.flatnonzero(local & (matched > 0))
    want = MISS_LOCAL_HOLDER if holders.size else 0
    if holders.size and chosen not in holders.tolist() \
            and np.all(scores[holders] - queue[holders] + queue[chosen] < scores[chosen]):
        want |= MISS_LOST_TO_LOAD
    if np.any(~local & (matched >= floors)):
        want |= MISS_REMOTE_WORTH
    summary = MissSummary(local, floors)
    assert summary.flags(matched, scores, queue, chosen) == want
    assert summary.flags(matched.astype(np.int32), scores, queue[::1], chosen) == want  # converted
    with pytest.raises(LookupPlanError):
        summary.flags(matched, scores, queue, len(data))


def test_more_groups_than_one_read_chunk():
    """66 region groups (reads go 64 groups at a time): native still equals the reference."""
    cfg = make_cluster({"r": 16 * 65 + 1, "s": 1}, shards=2, levels=3, same_region_min_tokens=16)
    layout = IndexLayout.from_config(cfg)
    plan, salt = LevelPlan.from_config(cfg), namespace_salt(cfg.model)
    assert len(layout.groups) == 67
    shards = [MaintenanceShard(layout, s, 2, epoch=1, initial_capacity=16) for s in range(2)]
    rng = np.random.default_rng(4)
    tokens = _prompt(11, 300)
    lengths = plan.registration_lengths_upto(300)
    keys = prefix_keys(tokens, lengths, salt).tolist()
    for worker in rng.choice(len(layout.worker_ids), 200, replace=False).tolist():
        upto = int(rng.integers(1, len(keys) + 1))
        for k in keys[:upto]:
            shards[k % 2].apply([PrefixCached(layout.worker_ids[worker], k, Tier(int(rng.integers(1, 3))))])
    view = EdgeIndexView(layout, 2, edge="e")
    for s in shards:
        s.flush()
        assert view.install_snapshot(s.snapshot()).applied
    for consistency in (True, False):
        native = PrefixLookup(layout, plan, "r", salt, view, consistency=consistency)
        reference = PrefixLookup(layout, plan, "r", salt, view, consistency=consistency, native=False)
        for n in (300, 40, 16):
            got, want = native.lookup(tokens[:n]), reference.lookup(tokens[:n])
            np.testing.assert_array_equal(got.matched, want.matched)
            np.testing.assert_array_equal(got.tier, want.tier)
            assert got.family_key == want.family_key
        assert native.lookup(tokens).matched.any()


def test_slot_constructor_builds_what_the_dataclass_builds():
    from dataclasses import FrozenInstanceError, dataclass

    from kvcompassd.core.lookup_plan import slot_constructor
    from kvcompassd.core.router import ForwardDecided

    build = slot_constructor(ForwardDecided)
    args = ("w", 1, "r", 64, Tier.DRAM, 0.5, 100, False, None, None, 3, False, 7)
    made = build(*args)
    assert made == ForwardDecided(*args) and made.outcome == "remote_hit"
    with pytest.raises(FrozenInstanceError):
        made.worker = "x"

    @dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        slot_constructor(Checked)


# Scores as a decision produces them: finite, +inf (ineligible), and the odd NaN; many exact ties.
_scores = st.lists(st.one_of(st.sampled_from([0.0, -0.0, 1.5, 2.0, np.inf, -np.inf, np.nan]),
                             st.floats(-1e6, 1e6, allow_nan=False)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(scores=_scores, k=st.integers(0, 90))
def test_top_k_is_the_head_of_a_stable_argsort(scores, k):
    array = np.array(scores, dtype=np.float64)
    assert top_k(array, k) == array.argsort(kind="stable")[:k].tolist()


def test_top_k_of_a_large_tied_fleet_and_of_other_dtypes():
    scores = np.full(10_000, 7.0)
    scores[[9_999, 5_000]] = 3.0
    assert top_k(scores, 3) == [5_000, 9_999, 0]  # ties in index order
    assert top_k(scores[::2], 2) == [2_500, 0]  # a strided view: the sort path
    assert top_k(np.array([3, 1, 2]), 2) == [1, 2]  # integers too
    assert top_k(scores, 100) == scores.argsort(kind="stable")[:100].tolist()  # beyond the loop's k


_times = st.floats(-1e3, 1e3, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.one_of(st.floats(0.0, 1e5), st.just(np.inf)), _times,
                               st.one_of(st.sampled_from([-1.0, 0.0]), st.floats(-1.0, 100.0))), min_size=1,
                     max_size=40),
       now=_times)
def test_queue_aging_equals_numpy_bit_for_bit(rows, now):
    ms, taken_at, rate = (np.array(column, dtype=np.float64) for column in zip(*rows))
    expected = np.maximum(0.0, ms + rate * np.maximum(0.0, (now - taken_at) * 1000.0))
    aged = QueueAging(taken_at, rate).aged(ms, now)
    assert aged.tobytes() == expected.tobytes()  # bit for bit, signed zeros and NaN included


def test_queue_aging_reads_its_arrays_as_they_change_and_checks_shapes():
    taken_at, rate = np.zeros(3), np.array([-1.0, 0.0, 2.0])
    aging = QueueAging(taken_at, rate)
    ms = np.array([5.0, 5.0, 5.0])
    assert aging.aged(ms, 0.002).tolist() == [3.0, 5.0, 9.0]
    taken_at[0], rate[1] = 0.002, -1.0  # updated in place by the owner
    assert aging.aged(ms, 0.002).tolist() == [5.0, 3.0, 9.0]
    with pytest.raises(LookupPlanError):
        aging.aged(np.zeros(4), 0.0)
    with pytest.raises(LookupPlanError):
        aging.aged(np.zeros(3, dtype=np.float32), 0.0)
    with pytest.raises(LookupPlanError):
        QueueAging(np.zeros(3), np.zeros(2))
    with pytest.raises(LookupPlanError):
        QueueAging(np.zeros(3, dtype=np.int64), np.zeros(3))


@settings(max_examples=40, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(-1, 2), st.one_of(st.integers(0, 2**63 - 1), st.just(2**64 - 1))),
                      max_size=120),
       fingerprint_bits=st.sampled_from([0, 8]))
def test_lookups_across_views_equal_one_lookup_each(picks, fingerprint_bits):
    """``kvc_view_lookup_multi`` (the fused call's reads) answers each (view, key) pair as
    ``kvc_view_lookup`` does: in any mix of views, with missing views (NULL) and keys >= 2^63."""
    from kvcompassd.core._ludo_cffi import ffi, lib
    from kvcompassd.core.ludo import LudoTable, LudoView

    rng = np.random.default_rng(len(picks))
    views = []
    for seed in range(3):
        table = LudoTable(64, seed=seed + 1, fingerprint_bits=fingerprint_bits)
        keys = np.unique(rng.integers(0, 2**63 - 1, size=40, dtype=np.uint64))
        table.insert_many(keys.tolist(), rng.integers(1, 2**32 - 1, size=keys.size).tolist())
        views.append((LudoView.from_snapshot(table.snapshot()), keys))
    pairs = []
    for which, key in picks:  # half the keys inserted ones, so hits are read too
        view = None if which < 0 else views[which][0]
        if which >= 0 and key % 2 and key < 2**63:
            key = int(views[which][1][key % views[which][1].size])
        pairs.append((view, key))
    pointers = ffi.new("kvc_view *[]", max(1, len(pairs)))
    for i, (view, _) in enumerate(pairs):
        pointers[i] = ffi.NULL if view is None else view._ptr
    keys = np.array([key for _, key in pairs], dtype=np.uint64)
    out = np.full(len(pairs), 12345, dtype=np.uint64)
    lib.kvc_view_lookup_multi(pointers, ffi.from_buffer("uint64_t[]", keys), len(pairs),
                              ffi.from_buffer("uint64_t[]", out))
    expected = [0 if view is None else int(lib.kvc_view_lookup(view._ptr, key)) for view, key in pairs]
    assert out.tolist() == expected
