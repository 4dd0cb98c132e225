"""The fused decision (``kvc_forward_decide`` through ``ForwardKernel``) equals its parts and the reference Router."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from kvcompassd.core.ablation import Ablation
from kvcompassd.core.events import PrefixCached, Tier
from kvcompassd.core.keys import SHA256_BACKENDS, prefix_keys
from kvcompassd.core.lookup_plan import ForwardKernel, LookupPlanError, MissSummary, ScoreBlocks, SparseForwardKernel
from kvcompassd.core.router import Router
from kvcompassd.core.score import NoEligibleWorkerError

from test_lookup_plan import World, _prompt, _state


def _kernel_of(router: Router, *, backend: int, last_sent: np.ndarray | None = None) -> ForwardKernel:
    plan, pointers = router.lookup.native_plan()
    return ForwardKernel(plan, pointers, router.lookup.query_lengths, router.lookup.salt, router.scorer.kernel,
                         router.scorer.kernel_flags(router.ablation), router._miss_summary,
                         router._last_sent if last_sent is None else last_sent,
                         family_index=router.lookup.family_index(), backend=backend)


def _register(w: World, worker: str, tokens: np.ndarray, upto: int, tier: Tier = Tier.VRAM) -> None:
    lengths = [n for n in w.plan.registration_lengths_upto(upto) if n <= len(tokens)]
    if lengths:
        w.send([PrefixCached(worker, int(k), tier) for k in prefix_keys(tokens, lengths, w.salt)])


@settings(max_examples=30, deadline=None)
@given(holdings=st.lists(st.tuples(st.integers(0, 22), st.integers(0, 3), st.integers(16, 900),
                                   st.sampled_from([Tier.VRAM, Tier.DRAM])), max_size=12),
       queue=st.lists(st.floats(0.0, 500.0), min_size=23, max_size=23),
       belief=st.lists(st.floats(0.0, 1.0), min_size=23, max_size=23),
       excluded=st.frozensets(st.integers(0, 22), max_size=22),
       last_sent=st.lists(st.integers(0, 3), min_size=23, max_size=23),
       prompt_len=st.integers(0, 900), region=st.sampled_from(["a", "b", "c"]),
       ablation=st.sampled_from([Ablation(), Ablation(cross_region=False), Ablation(load_aware=False),
                                 Ablation(tier_aware=False)]))
@example(holdings=[], queue=[0.0] * 23, belief=[0.0] * 23, excluded=frozenset({0, 1, 2}), last_sent=[0] * 23,
         prompt_len=0, region="a", ablation=Ablation(cross_region=False))  # own region all excluded
def test_one_call_equals_hashing_lookup_score_ties_and_summary(holdings, queue, belief, excluded, last_sent,
                                                               prompt_len, region, ablation):
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    prompts = [_prompt(40 + p, 900) for p in range(4)]
    for worker_index, p, upto, tier in holdings:
        _register(w, w.layout.worker_ids[worker_index], prompts[p], upto, tier)
    router = Router(w.cfg, region, w.views[region], now=0.0, ablation=ablation)
    tokens = prompts[holdings[0][1] if holdings else 0][:prompt_len]
    queue_ms, beliefs = np.array(queue), np.array(belief)
    eligible = np.array([i not in excluded for i in range(23)])
    sent = np.array(last_sent, dtype=np.int64)
    outcomes = []
    for backend in ("portable", "auto"):
        kernel = _kernel_of(router, backend=SHA256_BACKENDS[backend], last_sent=sent)
        matched, tier, scores, best, chosen, lam, miss, family = kernel.run(tokens, queue_ms, beliefs, eligible)
        n_keys = int(np.searchsorted(router.lookup.query_lengths, len(tokens), side="right"))
        outcomes.append((matched.tobytes(), tier.tobytes(), scores.tobytes(), best, chosen, lam, miss, family,
                         kernel.keys()[:n_keys].tobytes()))
        # The parts, each through its own wrapper.
        found = router.lookup.lookup(tokens)
        np.testing.assert_array_equal(matched, found.matched)
        np.testing.assert_array_equal(tier, found.tier)
        assert family == found.family_key
        np.testing.assert_array_equal(kernel.keys()[:n_keys],
                                      prefix_keys(tokens, router.lookup.query_lengths[:n_keys], w.salt))
        try:
            result = router.scorer.score(len(tokens), found.matched, found.tier, queue_ms, beliefs,
                                         ablation=ablation, eligible=eligible)
        except NoEligibleWorkerError:
            # Nobody may serve: all excluded, or (no cross-region reuse) all of the own region.
            own = np.array([w.cfg.worker(wid).region == region for wid in w.layout.worker_ids])
            reachable = eligible if ablation.cross_region else eligible & own
            assert not reachable.any() and best == -1
            assert not np.isfinite(scores).any()
            continue
        assert best == result.chosen and lam == result.lam and scores.tobytes() == result.scores.tobytes()
        ties = np.flatnonzero(scores == scores[best])
        assert chosen == int(ties[np.argmin(sent[ties])])
        assert miss == router._miss_summary.flags(matched, scores, queue_ms, chosen)
    assert outcomes[0] == outcomes[1]


def test_decisions_follow_replaced_and_missing_views():
    """Shard 1 not ready at first (its views read as misses), then a snapshot installs its views."""
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 2))
    fast = Router(w.cfg, "a", w.views["a"], now=0.0)
    slow = Router(w.cfg, "a", w.views["a"], now=0.0, native=False)
    tokens = _prompt(5, 900)
    for i, holder in enumerate(("b-3", "a-1")):
        _register(w, holder, tokens, 900)
        a, b = fast.decide(tokens, now=1.0 + i), slow.decide(tokens, now=1.0 + i)
        assert (a.worker, a.claimed_tokens, a.tier) == (b.worker, b.claimed_tokens, b.tier)
        assert a.score.scores.tobytes() == b.score.scores.tobytes()
    full = max(n for n in w.plan.lengths_toward("a", "a") if n <= 900)
    assert a.worker == "a-1" and a.claimed_tokens < full  # the run stops at a key of the missing shard
    w.shards[1].flush()  # the missing shard arrives as a snapshot: new view objects
    assert w.views["a"].install_snapshot(w.shards[1].snapshot()).applied
    for router in (fast, slow):  # the work dispatched so far is done
        for worker in w.cfg.workers_in("a"):
            router.queues.set_local(worker.id, 0.0, now=5.0)
    a, b = fast.decide(tokens, now=5.0), slow.decide(tokens, now=5.0)
    assert a.worker == b.worker == "a-1" and a.claimed_tokens == b.claimed_tokens == full
    assert a.score.scores.tobytes() == b.score.scores.tobytes() and _state(fast) == _state(slow)


def test_decisions_keep_their_arrays():
    """Each decision owns its per-worker arrays: the next one (same buffers in C) changes none."""
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, "a", w.views["a"], now=0.0)
    tokens = _prompt(8, 600)
    _register(w, "a-2", tokens, 600)
    first = router.decide(tokens, now=1.0)
    kept = (first.score.scores.copy(), first.score._matched.copy())
    router.decide(_prompt(9, 600), now=2.0)
    np.testing.assert_array_equal(first.score.scores, kept[0])
    np.testing.assert_array_equal(first.score._matched, kept[1])
    assert first.worker == "a-2" and first.claimed_tokens > 0


def test_bad_inputs_raise_and_leave_the_router_usable():
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, "c", w.views["c"], now=0.0)
    with pytest.raises(ValueError):
        router.decide([1, -2, 3], now=0.0)
    with pytest.raises(ValueError):
        router.decide(np.zeros((2, 2), dtype=np.uint32), now=0.0)
    with pytest.raises(NoEligibleWorkerError):
        router.decide(_prompt(1, 50), now=0.0, exclude=range(23))
    assert router.decide(_prompt(1, 50), now=0.0).worker.startswith("c-")


def test_kernel_arguments_are_checked():
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    router = Router(w.cfg, "a", w.views["a"], now=0.0)
    plan, pointers = router.lookup.native_plan()
    auto = SHA256_BACKENDS["auto"]
    parts = (plan, pointers, router.lookup.query_lengths, router.lookup.salt, router.scorer.kernel, 0,
             router._miss_summary, router._last_sent)
    family = router.lookup.family_index()
    with pytest.raises(LookupPlanError, match="query lengths"):
        ForwardKernel(plan, pointers, router.lookup.query_lengths[1:], *parts[3:], family_index=family, backend=auto)
    with pytest.raises(LookupPlanError, match="strictly ascending"):
        ForwardKernel(plan, pointers, router.lookup.query_lengths[::-1], *parts[3:], family_index=family, backend=auto)
    few = MissSummary(np.zeros(3, dtype=np.uint8), np.zeros(3, dtype=np.int64))
    with pytest.raises(LookupPlanError, match="same workers"):
        ForwardKernel(*parts[:6], few, router._last_sent, family_index=family, backend=auto)
    with pytest.raises(LookupPlanError, match="last_sent"):
        ForwardKernel(*parts[:7], np.zeros(23, dtype=np.int32), family_index=family, backend=auto)
    queue, belief = router.queues.queue_ms(), router.belief.values
    kernel = ForwardKernel(*parts, family_index=family, backend=99)  # a backend C does not know: the call refuses it
    with pytest.raises(LookupPlanError, match="code"):
        kernel.run(_prompt(1, 100), queue, belief, None)
    with pytest.raises(LookupPlanError, match="family_index"):
        ForwardKernel(*parts, family_index=len(router.lookup.query_lengths), backend=auto)
    kernel = ForwardKernel(*parts, family_index=family, backend=auto)
    for short in ((queue[:-1], belief, None), (queue, belief[1:], None), (queue, belief, np.ones(5, dtype=bool))):
        with pytest.raises(LookupPlanError, match="must hold 23 values"):
            kernel.run(_prompt(1, 100), *short)
    assert kernel.run(_prompt(1, 100), queue, belief, None)[3] >= 0


# Adversarial per-worker values: signed zeros, infinities and NaN beside ordinary numbers, and
# many exact ties (repeated values), so the one-pass argmin, tie rotation and four-lane queue
# minimum meet every case the separate passes handle.
_value = st.one_of(st.sampled_from([0.0, -0.0, 1.0, 2.5, np.inf, np.nan]), st.floats(0.0, 1e4))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all((a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))))


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.tuples(_value, _value, _value, _value, st.integers(0, 5000), st.integers(0, 3),
                               st.sampled_from([0.0, 1.0]), st.sampled_from([0.0, np.inf]), st.booleans(),
                               st.integers(0, 3)), min_size=1, max_size=40),
       prompt_len=st.integers(0, 5000), flags=st.integers(0, 7), with_eligible=st.booleans(),
       with_last_sent=st.booleans(), gamma=st.sampled_from([0.0, 0.01, 3.0]), lambda_max=st.sampled_from([0.0, 2.0]),
       tau=st.sampled_from([1.0, 250.0]))
def test_one_pass_score_and_choice_equal_the_score_then_ties(rows, prompt_len, flags, with_eligible, with_last_sent,
                                                             gamma, lambda_max, tau):
    from kvcompassd.core._ludo_cffi import ffi, lib

    wan, beta, queue, belief, matched, tier, local, penalty, eligible, last_sent = zip(*rows)
    f64 = [np.array(a, dtype=np.float64) for a in (wan, beta, queue, belief, local, penalty)]
    wan, beta, queue, belief, local, penalty = f64
    matched, tier = np.array(matched, dtype=np.int64), np.array(tier, dtype=np.uint8)
    eligible = np.array(eligible, dtype=np.uint8) if with_eligible else None
    last_sent = np.array(last_sent, dtype=np.int64) if with_last_sent else None
    n = len(rows)

    def ptr(kind, a):
        return ffi.NULL if a is None else ffi.from_buffer(kind, a)

    common = (n, float(prompt_len), ptr("double[]", wan), ptr("double[]", beta), ptr("double[]", queue),
              ptr("double[]", belief), ptr("int64_t[]", matched), ptr("uint8_t[]", tier), ptr("double[]", local),
              ptr("double[]", penalty), ptr("uint8_t[]", eligible), gamma, lambda_max, tau, flags)
    expected_scores, expected_lam = np.zeros(n), ffi.new("double *")
    best = lib.kvc_score_joint(*common, ptr("double[]", expected_scores), expected_lam)
    chosen = best  # the tie rotation kvc_forward_decide ran before
    if last_sent is not None:
        for i in range(best + 1, n):
            if expected_scores[i] == expected_scores[best] and last_sent[i] < last_sent[chosen]:
                chosen = i
    scores, lam, chosen_out = np.zeros(n), ffi.new("double *"), ffi.new("int64_t *")
    got = lib.kvc_score_choose(*common, ptr("int64_t[]", last_sent), ptr("double[]", scores), lam, chosen_out)
    # Bit for bit (signed zeros included), except a NaN's sign and payload, which C leaves to the
    # compiler's choice of operand order.
    assert _same_bits(scores, expected_scores)
    assert _same_bits(np.array([lam[0]]), np.array([expected_lam[0]]))
    assert (got, chosen_out[0]) == (best, chosen)


def test_the_queue_minimum_keeps_the_first_zero_and_a_leading_nan():
    from kvcompassd.core._ludo_cffi import ffi, lib

    def lam_of(queue):
        queue = np.array(queue, dtype=np.float64)
        n = queue.size
        ones, zeros = np.ones(n), np.zeros(n)
        lam, chosen = ffi.new("double *"), ffi.new("int64_t *")
        lib.kvc_score_choose(n, 10.0, ffi.from_buffer("double[]", zeros), ffi.from_buffer("double[]", ones),
                             ffi.from_buffer("double[]", queue), ffi.from_buffer("double[]", zeros),
                             ffi.from_buffer("int64_t[]", np.zeros(n, dtype=np.int64)),
                             ffi.from_buffer("uint8_t[]", np.zeros(n, dtype=np.uint8)),
                             ffi.from_buffer("double[]", ones), ffi.from_buffer("double[]", zeros), ffi.NULL,
                             0.0, 1e9, 1.0, int(lib.KVC_SCORE_LOAD_AWARE), ffi.NULL,
                             ffi.from_buffer("double[]", np.zeros(n)), lam, chosen)
        return lam[0]

    assert np.signbit(lam_of([5.0] * 9 + [-0.0, 0.0]))  # the first zero is -0.0
    assert not np.signbit(lam_of([5.0] * 6 + [0.0] + [5.0] * 5 + [-0.0]))
    assert lam_of([np.nan] + [1.0] * 12) == 1e9  # a leading NaN is the minimum: lam = lambda_max
    assert lam_of([7.0, np.nan] + [3.0] * 10 + [2.0]) == 2.0



@settings(max_examples=300, deadline=None)
@given(base=st.lists(st.one_of(st.sampled_from([3.0, np.inf]), st.floats(0.5, 1e4)), min_size=1, max_size=300),
       marks=st.lists(st.tuples(st.integers(0, 299), st.one_of(st.sampled_from([0.0, -0.0, np.nan, np.inf]),
                                                               st.floats(0.0, 0.5))), max_size=6),
       tau=st.sampled_from([0.5, 250.0]))
@example(base=[5.0] * 16, marks=[(14, 0.25)], tau=250.0)  # the least value in the last lane
@example(base=[5.0] * 17, marks=[(16, 0.25)], tau=250.0)  # in the scalar tail
@example(base=[5.0] * 24, marks=[(23, -0.0), (9, 0.0)], tau=250.0)  # the first zero is in index order
@example(base=[5.0] * 24, marks=[(9, np.nan), (20, 0.25)], tau=250.0)
def test_the_pruned_score_takes_the_full_pass_queue_minimum(base, marks, tau):
    """kvc_score_choose_pruned's queue minimum (eight SSE2 lanes from 8 workers on, the scalar
    loop before and for the tail) gives the full pass's lam bit for bit, wherever the zeros of
    either sign, NaNs and infinities fall, at every length around the lanes' edges."""
    from kvcompassd.core._ludo_cffi import ffi, lib

    queue = np.array(base, dtype=np.float64)
    n = queue.size
    for at, value in marks:
        queue[at % n] = value
    ones, zeros = np.ones(n), np.zeros(n)
    ptr = ffi.from_buffer
    common = (n, 10.0, ptr("double[]", zeros), ptr("double[]", ones), ptr("double[]", queue), ptr("double[]", zeros),
              ptr("int64_t[]", np.zeros(n, dtype=np.int64)), ptr("uint8_t[]", np.zeros(n, dtype=np.uint8)),
              ptr("double[]", ones), ptr("double[]", zeros), ffi.NULL, 0.0, 1e9, tau,
              int(lib.KVC_SCORE_LOAD_AWARE), ffi.NULL)
    want_lam, want_chosen = ffi.new("double *"), ffi.new("int64_t *")
    want_best = lib.kvc_score_choose(*common, ptr("double[]", np.zeros(n)), want_lam, want_chosen)
    blocks = ffi.new("kvc_score_blocks *")
    starts = np.arange(0, n, 8)
    wan_min, beta_min = np.zeros(starts.size), np.ones(starts.size)
    blocks.block, blocks.n_blocks = 8, starts.size
    blocks.wan_min, blocks.beta_min, blocks.penalty_min = ptr("double[]", wan_min), ptr("double[]", beta_min), \
        ptr("double[]", wan_min)
    lam, chosen, complete = ffi.new("double *"), ffi.new("int64_t *"), ffi.new("int *")
    best = lib.kvc_score_choose_pruned(*common, ffi.NULL, 0, blocks, ptr("double[]", np.zeros(n)), lam, chosen,
                                       complete)
    assert _same_bits(np.array([lam[0]]), np.array([want_lam[0]]))
    assert (best, chosen[0]) == (want_best, want_chosen[0])


# ---- the sparse decision (kvc_forward_decide_sparse and its parts) ----------------------------

def _sparse_lookup(plan, pointers, keys: np.ndarray):
    """kvc_lookup_sparse through cffi: (matched, tier, holders)."""
    from kvcompassd.core._ludo_cffi import ffi, lib

    field_worker = plan.field_worker()
    n = plan.workers
    matched, tier = np.full(n, -7, dtype=np.int64), np.full(n, 9, dtype=np.uint8)  # junk: must be overwritten
    holders, held = np.zeros(max(1, n), dtype=np.int32), ffi.new("size_t *")
    values = np.zeros(max(1, plan.groups * plan.max_levels), dtype=np.uint64)
    rc = lib.kvc_lookup_sparse(pointers.pointers(), plan.shards, plan.groups, ffi.from_buffer("uint64_t[]", keys),
                               keys.size, ffi.from_buffer("int64_t[]", plan._lengths),
                               ffi.from_buffer("int32_t[]", plan._key_index), plan.max_levels,
                               ffi.from_buffer("int32_t[]", field_worker), n, int(plan.consistency),
                               ffi.from_buffer("uint64_t[]", values), ffi.from_buffer("int64_t[]", matched),
                               ffi.from_buffer("uint8_t[]", tier), ffi.from_buffer("int32_t[]", holders), held)
    assert rc == 0
    return matched, tier, holders[:held[0]]


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 22), st.integers(0, 3), st.integers(0, 4095),
                              st.sampled_from([Tier.VRAM, Tier.DRAM])), max_size=15),
       fingerprint_bits=st.sampled_from([0, 8]), consistency=st.booleans(),
       prompt_lengths=st.lists(st.integers(1, 900), min_size=1, max_size=4))
def test_sparse_lookup_equals_the_plan(ops, fingerprint_bits, consistency, prompt_lengths):
    """Bit-mask decoding gives every worker the plan's match and tier, holes and false hits included."""
    from kvcompassd.core.lookup import PrefixLookup

    w = World(fingerprint_bits=fingerprint_bits, consistency=consistency, value_bits=32, ready=(0, 1, 2))
    prompts = [_prompt(500 + p, 900) for p in range(4)]
    lengths = w.plan.registration_lengths_upto(900)
    for worker_index, p, mask, tier in ops:
        # Arbitrary subsets of lengths: runs with holes, as stale or partial registrations leave.
        chosen = [n for i, n in enumerate(lengths) if mask >> (i % 12) & 1]
        if chosen:
            keys = prefix_keys(prompts[p], chosen, w.salt).tolist()
            w.send([PrefixCached(w.layout.worker_ids[worker_index], k, tier) for k in keys])
    for region in ("a", "b", "c"):
        lookup = PrefixLookup(w.layout, w.plan, region, w.salt, w.views[region], consistency=consistency)
        plan, pointers = lookup.native_plan()
        for tokens in [p[:n] for p in prompts + [_prompt(999, 900)] for n in prompt_lengths]:
            keys = lookup.query_keys(tokens)
            want_matched, want_tier = plan.run(pointers.pointers(), keys)
            matched, tier, holders = _sparse_lookup(plan, pointers, keys)
            np.testing.assert_array_equal(matched, want_matched)
            np.testing.assert_array_equal(tier, want_tier)
            assert sorted(holders.tolist()) == np.flatnonzero(want_matched).tolist()


_MANY_GROUPS: dict = {}


def _many_groups_fleet():
    """A fleet of 520 region groups (more than one chunk of the sparse reads, 512 groups), once."""
    from kvcompassd.core.keys import namespace_salt
    from kvcompassd.core.layout import IndexLayout
    from kvcompassd.core.levels import LevelPlan
    from clusters import make_cluster

    if not _MANY_GROUPS:
        cfg = make_cluster({"r": 32 * 519 + 1, "s": 1}, shards=2, levels=3, same_region_min_tokens=16)
        layout = IndexLayout.from_config(cfg)
        assert len(layout.groups) > 512
        _MANY_GROUPS.update(layout=layout, plan=LevelPlan.from_config(cfg), salt=namespace_salt(cfg.model))
    return _MANY_GROUPS["layout"], _MANY_GROUPS["plan"], _MANY_GROUPS["salt"]


@settings(max_examples=12, deadline=None)
@given(holders=st.lists(st.tuples(st.one_of(st.integers(0, 40), st.integers(32 * 510, 32 * 514),  # chunk edges
                                            st.integers(0, 32 * 519)), st.integers(1, 12), st.booleans(),
                                  st.integers(0, 2**12 - 1)), min_size=1, max_size=120),
       prompt_lengths=st.lists(st.sampled_from([16, 40, 41, 150, 300]), min_size=1, max_size=3))
def test_sparse_lookup_over_more_groups_than_one_read_chunk(holders, prompt_lengths):
    """More region groups than one chunk of reads, and more reads than one batch: the sparse
    lookup's level-by-level path (its list of live groups, each key's view row computed once)
    gives the plan's match and tier to every worker, runs with holes and both rules included."""
    from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
    from kvcompassd.core.lookup import PrefixLookup

    layout, plan, salt = _many_groups_fleet()
    shards = [MaintenanceShard(layout, s, 2, epoch=1, initial_capacity=16) for s in range(2)]
    tokens = _prompt(12, 300)
    keys = prefix_keys(tokens, plan.registration_lengths_upto(300), salt).tolist()
    for worker, run, dram, holes in holders:
        # A run of the first `run` keys, some of them missing (a stale or partial registration).
        held = [k for i, k in enumerate(keys[:run]) if i == 0 or not holes >> i & 1]
        tier = Tier.DRAM if dram else Tier.VRAM
        for k in held:
            shards[k % 2].apply([PrefixCached(layout.worker_ids[worker], k, tier)])
    view = EdgeIndexView(layout, 2, edge="e")
    for s in shards:
        s.flush()
        assert view.install_snapshot(s.snapshot()).applied
    for consistency in (True, False):
        lookup = PrefixLookup(layout, plan, "r", salt, view, consistency=consistency)
        lp, pointers = lookup.native_plan()
        for n in prompt_lengths:
            query = lookup.query_keys(tokens[:n])
            want_matched, want_tier = lp.run(pointers.pointers(), query)
            matched, tier, found = _sparse_lookup(lp, pointers, query)
            np.testing.assert_array_equal(matched, want_matched)
            np.testing.assert_array_equal(tier, want_tier)
            assert sorted(found.tolist()) == np.flatnonzero(want_matched).tolist()


# Finite per-worker values with many exact ties; the queue may hold a NaN (the full pass's case).
_finite = st.one_of(st.sampled_from([0.0, -0.0, 1.0, 2.5]), st.floats(0.0, 1e4))


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.tuples(_finite, _finite, st.one_of(_finite, st.sampled_from([np.inf, np.nan])),
                               st.floats(0.0, 1.0), st.integers(0, 3), st.integers(0, 5000), st.integers(0, 3),
                               st.sampled_from([0.0, 1.0]), st.sampled_from([0.0, np.inf]), st.booleans(),
                               st.integers(0, 3)), min_size=1, max_size=60),
       prompt_len=st.integers(0, 5000), flags=st.integers(0, 7), with_eligible=st.booleans(),
       with_last_sent=st.booleans(), gamma=st.sampled_from([0.0, 0.01, 3.0]), lambda_max=st.sampled_from([0.0, 2.0]),
       tau=st.sampled_from([1.0, 250.0]), block=st.sampled_from([1, 2, 3, 7, 64]))
def test_pruned_score_equals_the_full_pass(rows, prompt_len, flags, with_eligible, with_last_sent, gamma, lambda_max,
                                           tau, block):
    """Holders first, then only the blocks whose bound reaches the best: the same argmin, tie
    rotation, lam and scores (where scored) as kvc_score_choose."""
    from kvcompassd.core._ludo_cffi import ffi, lib

    wan, beta, queue, belief, holds, length, tier, local, penalty, eligible, last_sent = zip(*rows)
    wan, beta, queue, belief, local, penalty = (np.array(a, dtype=np.float64)
                                                for a in (wan, beta, queue, belief, local, penalty))
    matched = np.where(np.array(holds) == 0, np.array(length), 0).astype(np.int64)  # a quarter hold something
    tier = np.array(tier, dtype=np.uint8)
    eligible = np.array(eligible, dtype=np.uint8) if with_eligible else None
    last_sent = np.array(last_sent, dtype=np.int64) if with_last_sent else None
    n = len(rows)
    holders = np.flatnonzero(matched).astype(np.int32)
    starts = np.arange(0, n, block)
    wan_min, beta_min, penalty_min = (np.minimum.reduceat(a, starts) for a in (wan, beta, penalty))

    def ptr(kind, a):
        return ffi.NULL if a is None else ffi.from_buffer(kind, a)

    common = (n, float(prompt_len), ptr("double[]", wan), ptr("double[]", beta), ptr("double[]", queue),
              ptr("double[]", belief), ptr("int64_t[]", matched), ptr("uint8_t[]", tier), ptr("double[]", local),
              ptr("double[]", penalty), ptr("uint8_t[]", eligible), gamma, lambda_max, tau, flags,
              ptr("int64_t[]", last_sent))
    want_scores, want_lam, want_chosen = np.zeros(n), ffi.new("double *"), ffi.new("int64_t *")
    want_best = lib.kvc_score_choose(*common, ptr("double[]", want_scores), want_lam, want_chosen)
    blocks = ffi.new("kvc_score_blocks *")
    blocks.block, blocks.n_blocks = block, starts.size
    blocks.wan_min, blocks.beta_min = ptr("double[]", wan_min), ptr("double[]", beta_min)
    blocks.penalty_min = ptr("double[]", penalty_min)
    scores, lam, chosen, complete = np.full(n, -123.0), ffi.new("double *"), ffi.new("int64_t *"), ffi.new("int *")
    best = lib.kvc_score_choose_pruned(*common, ptr("int32_t[]", holders), holders.size, blocks,
                                       ptr("double[]", scores), lam, chosen, complete)
    assert (best, chosen[0]) == (want_best, want_chosen[0])
    assert _same_bits(np.array([lam[0]]), np.array([want_lam[0]]))
    scored = scores != -123.0  # a sentinel no score takes here
    if complete[0]:
        assert scored.all()
    assert scored[holders].all() and scored[best] and scored[chosen[0]]
    assert _same_bits(scores[scored], want_scores[scored])
    # Whatever was skipped scores above the best.
    assert (want_scores[~scored] > want_scores[best]).all()


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.floats(0.0, 50.0), st.floats(0.0, 50.0),
                               st.integers(-1, 3)), min_size=1, max_size=30),
       chosen_seed=st.integers(0, 10**6))
def test_miss_summary_from_the_holders_equals_the_full_summary(data, chosen_seed):
    from kvcompassd.core._ludo_cffi import ffi, lib

    local, matched, scores, queue, floors = zip(*data)
    local = np.array(local, dtype=np.uint8)
    matched = np.array(matched, dtype=np.int64)
    scores, queue, floors = np.array(scores), np.array(queue), np.array(floors, dtype=np.int64)
    n = len(data)
    chosen = chosen_seed % n
    holders = np.flatnonzero(matched > 0).astype(np.int32)
    args = (ffi.from_buffer("int64_t[]", matched), ffi.from_buffer("uint8_t[]", local),
            ffi.from_buffer("int64_t[]", floors))
    want = lib.kvc_miss_summary(n, *args, ffi.from_buffer("double[]", scores), ffi.from_buffer("double[]", queue),
                                chosen)
    floor_free = int(bool(np.any((local == 0) & (floors <= 0))))
    got = lib.kvc_miss_summary_holders(ffi.from_buffer("int32_t[]", holders), holders.size, *args, floor_free,
                                       ffi.from_buffer("double[]", scores), ffi.from_buffer("double[]", queue),
                                       chosen, n)
    assert got == want


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=700), salt=st.binary(max_size=150),
       picks=st.lists(st.integers(1, 700), min_size=1, max_size=80), backend=st.sampled_from(["auto", "portable"]))
def test_paired_prefix_keys_equal_hashlib(tokens, salt, picks, backend):
    """The finals compressed beside the stream give hashlib's keys (lengths dense and sparse,
    salts across a block boundary, more finals than the jobs held at once)."""
    from kvcompassd.core._ludo_cffi import ffi, lib
    from kvcompassd.core.keys import prefix_keys_reference

    toks = np.array(tokens, dtype=np.uint32)
    lengths = np.array(sorted({p for p in picks if p <= toks.size} or {toks.size}), dtype=np.int64)
    out = np.zeros(lengths.size, dtype=np.uint64)
    rc = lib.kvc_prefix_keys_paired(salt, len(salt), ffi.from_buffer("uint8_t[]", toks), toks.size,
                                    ffi.from_buffer("int64_t[]", lengths), lengths.size, SHA256_BACKENDS[backend],
                                    ffi.from_buffer("uint64_t[]", out))
    assert rc == 0
    np.testing.assert_array_equal(out, prefix_keys_reference(toks, lengths, salt))
    bad = np.array([2, 1], dtype=np.int64)
    assert lib.kvc_prefix_keys_paired(salt, len(salt), ffi.from_buffer("uint8_t[]", toks), toks.size,
                                      ffi.from_buffer("int64_t[]", bad), 2, 0, ffi.from_buffer("uint64_t[]", out)) != 0


def _sparse_of(router: Router, block: int) -> SparseForwardKernel:
    plan, pointers = router.lookup.native_plan()
    kernel = SparseForwardKernel(plan, pointers, router.lookup.query_lengths, router.lookup.salt,
                                 router.scorer.kernel, router.scorer.kernel_flags(router.ablation),
                                 router._miss_summary, router._last_sent, family_index=router.lookup.family_index(),
                                 backend=SHA256_BACKENDS["auto"], blocks=ScoreBlocks(router.scorer.kernel, block))
    kernel.age_from(*router.queues.aging_arrays())
    return kernel


def _one_holder(seed: int, length: int, holder: int, region: str) -> tuple[Router, SparseForwardKernel, np.ndarray]:
    """A prompt of ``length`` tokens held whole by worker ``holder``, the ``region`` edge's Router
    and a sparse kernel (blocks of 4) over its plan."""
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    tokens = _prompt(seed, length)
    _register(w, w.layout.worker_ids[holder], tokens, length)
    router = Router(w.cfg, region, w.views[region], now=0.0)
    return router, _sparse_of(router, 4), tokens


@settings(max_examples=30, deadline=None)
@given(holdings=st.lists(st.tuples(st.integers(0, 22), st.integers(0, 3), st.integers(16, 900),
                                   st.sampled_from([Tier.VRAM, Tier.DRAM])), max_size=12),
       queue=st.lists(st.floats(0.0, 500.0), min_size=23, max_size=23),
       belief=st.lists(st.floats(0.0, 1.0), min_size=23, max_size=23),
       excluded=st.frozensets(st.integers(0, 22), max_size=22),
       prompt_len=st.integers(0, 900), region=st.sampled_from(["a", "b", "c"]), block=st.sampled_from([1, 2, 5, 32]),
       ablation=st.sampled_from([Ablation(), Ablation(cross_region=False), Ablation(load_aware=False),
                                 Ablation(tier_aware=False)]))
def test_sparse_call_equals_the_full_call(holdings, queue, belief, excluded, prompt_len, region, block, ablation):
    """kvc_forward_decide_sparse answers as kvc_forward_decide: matches, winner, rotation, lam,
    miss summary, family, and every score it wrote."""
    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    prompts = [_prompt(40 + p, 900) for p in range(4)]
    for worker_index, p, upto, tier in holdings:
        _register(w, w.layout.worker_ids[worker_index], prompts[p], upto, tier)
    router = Router(w.cfg, region, w.views[region], now=0.0, ablation=ablation)
    router._last_sent[:] = np.arange(23) % 3
    tokens = prompts[holdings[0][1] if holdings else 0][:prompt_len]
    queue_ms, beliefs = np.array(queue), np.array(belief)
    eligible = np.array([i not in excluded for i in range(23)])
    full = _kernel_of(router, backend=SHA256_BACKENDS["auto"]).run(tokens, queue_ms, beliefs, eligible)
    sparse = _sparse_of(router, block).run(tokens, queue_ms, beliefs, eligible)
    matched, tier, scores, best, chosen, lam, miss, family = full
    s_matched, s_tier, s_scores, s_best, s_chosen, s_lam, s_miss, s_family, complete = sparse
    np.testing.assert_array_equal(s_matched, matched)
    np.testing.assert_array_equal(s_tier, tier)
    assert (s_best, s_lam, s_family) == (best, lam, family)
    if best >= 0:
        assert (s_chosen, s_miss) == (chosen, miss)
        written = np.flatnonzero(matched).tolist() + [best, chosen]
        assert s_scores[written].tobytes() == scores[written].tobytes()
        if complete:
            assert s_scores.tobytes() == scores.tobytes()


def test_the_aged_call_adds_correction_and_occupancy_as_numpy_does():
    """run_aged's estimates: the aged values, plus a region's correction and a worker's
    occupancy, in QueueEstimates.queue_ms's operations (bit for bit), and the same decision as
    run on them."""
    router, kernel, tokens = _one_holder(77, 600, 5, "a")
    rng = np.random.default_rng(9)
    taken_at, rate, occupancy, slot = router.queues.aging_arrays()
    taken_at[:] = rng.uniform(0.0, 2.0, 23)
    rate[:] = np.where(rng.random(23) < 0.5, -1.0, rng.uniform(0.0, 3.0, 23))
    occupancy[:] = np.where(rng.random(23) < 0.5, 0.0, rng.uniform(0.0, 2.0, 23))
    ms = rng.uniform(0.0, 400.0, 23)
    correction = rng.uniform(0.0, 30.0, int(slot.max()) + 1)
    belief = np.ones(23)
    for corr, occupied in ((None, False), (correction, False), (None, True), (correction, True)):
        out = kernel.run_aged(tokens, ms, 2.5, corr, occupied, belief, None)
        aged, queue = out[-2:]
        want_aged = np.maximum(0.0, ms + rate * np.maximum(0.0, (2.5 - taken_at) * 1000.0))
        want = want_aged if corr is None else want_aged + corr[slot]
        want = want + occupancy if occupied else want
        assert aged.tobytes() == want_aged.tobytes() and queue.tobytes() == want.tobytes()
        assert (queue is aged) == (corr is None and not occupied)
        again = kernel.run(tokens, queue, belief, None)
        assert out[3:8] == again[3:8] and out[0].tobytes() == again[0].tobytes()
        # A belief the pruned score cannot bound takes the full call, on the same estimates.
        odd = belief.copy()
        odd[3] = np.inf
        full = kernel.run_aged(tokens, ms, 2.5, corr, occupied, odd, None)
        assert full[-2].tobytes() == want_aged.tobytes() and full[-1].tobytes() == want.tobytes()
        assert full[8] and full[3:8] == kernel.run(tokens, queue, odd, None)[3:8]


# Readings as a report carries them (a -0.0 reading is left out: numpy's SIMD maximum may keep
# it where the C comparison gives 0.0).
_estimate = st.one_of(st.sampled_from([0.0, np.nan, np.inf]), st.floats(-50.0, 400.0).map(lambda x: x + 0.0))


@settings(max_examples=60, deadline=None)
@given(ms=st.lists(_estimate, min_size=23, max_size=23),
       rate=st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0]), min_size=23, max_size=23),
       taken=st.lists(st.floats(0.0, 4.0), min_size=23, max_size=23),
       correction=st.one_of(st.none(), st.lists(st.one_of(st.sampled_from([-0.0, 0.0]), st.floats(-30.0, 30.0)),
                                                min_size=8, max_size=8)),
       occupied=st.booleans())
def test_the_aged_call_prices_capacity_from_the_estimates_it_ages(ms, rate, taken, correction, occupied):
    """run_aged's capacity price (lam, from the estimates' least value) and decision are run's on
    the estimates numpy computes, with zeros of either sign, NaN and infinite readings and
    negative corrections."""
    router, kernel, tokens = _one_holder(78, 500, 4, "b")
    taken_at, rates, occupancy, slot = router.queues.aging_arrays()
    taken_at[:], rates[:] = taken, rate
    occupancy[:] = np.linspace(0.0, 3.0, 23)
    corr = None if correction is None else np.array(correction)[: int(slot.max()) + 1].copy()
    ms = np.array(ms)
    belief = np.ones(23)
    out = kernel.run_aged(tokens, ms, 2.5, corr, occupied, belief, None)
    aged = np.maximum(0.0, ms + rates * np.maximum(0.0, (2.5 - taken_at) * 1000.0))
    queue = aged if corr is None else aged + corr[slot]
    queue = queue + occupancy if occupied else queue
    assert out[-2].tobytes() == aged.tobytes() and out[-1].tobytes() == queue.tobytes()
    again = kernel.run(tokens, queue, belief, None)
    assert out[3:8] == again[3:8] or (np.isnan(out[5]) and np.isnan(again[5]) and out[3:5] == again[3:5])
    assert np.signbit(out[5]) == np.signbit(again[5])



@settings(max_examples=100, deadline=None)
@given(ms=st.lists(st.floats(1.0, 300.0), min_size=23, max_size=23),
       rate=st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=23, max_size=23),
       taken=st.lists(st.floats(0.0, 2.5), min_size=23, max_size=23),
       least=st.integers(0, 22), nan_at=st.one_of(st.none(), st.integers(0, 22)))
@example(ms=[200.0] * 23, rate=[0.0] * 23, taken=[2.5] * 23, least=2, nan_at=None)
@example(ms=[200.0] * 23, rate=[0.0] * 23, taken=[2.5] * 23, least=7, nan_at=None)
@example(ms=[200.0] * 23, rate=[0.0] * 23, taken=[2.5] * 23, least=22, nan_at=None)
@example(ms=[200.0] * 23, rate=[0.0] * 23, taken=[2.5] * 23, least=3, nan_at=14)
def test_the_aged_call_takes_the_least_estimate_wherever_it_is(ms, rate, taken, least, nan_at):
    """Without a correction or the occupancy the decision scores the aged estimates, and their
    least value (lam's) is found in the aging pass itself (kvc_queue_aged_low, lanes of two): the
    same lam, decision and aged values as numpy's estimates scored by ``run``, wherever the least
    estimate (none of them 0 here, so no zero decides it) or a NaN reading falls."""
    router, kernel, tokens = _one_holder(79, 500, 4, "b")
    taken_at, rates, _, _ = router.queues.aging_arrays()
    taken_at[:], rates[:] = taken, rate
    ms = np.array(ms)
    ms[least] = 0.5
    if nan_at is not None:
        ms[nan_at] = np.nan
    belief = np.ones(23)
    out = kernel.run_aged(tokens, ms, 2.5, None, False, belief, None)
    aged = np.maximum(0.0, ms + rates * np.maximum(0.0, (2.5 - taken_at) * 1000.0))
    assert out[-2].tobytes() == aged.tobytes() and out[-1] is out[-2]
    again = kernel.run(tokens, aged, belief, None)
    assert out[3:5] == again[3:5] and _same_bits(np.array([out[5]]), np.array([again[5]]))
    if nan_at is None:
        scorer = router.scorer
        assert out[5] == min(scorer.lambda_max, float(aged.min()) / scorer.tau_ms)


def test_pruned_decisions_equal_the_reference_router_and_complete_their_scores():
    """A Router on the pruned score (blocks of one worker, so most workers are skipped) decides
    as the reference Router, also after its prefill rates change; a decision's skipped scores
    are filled in, bit for bit, when read."""
    from test_lookup_plan import _reference_router

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    prompts = [_prompt(90 + p, 900) for p in range(3)]
    _register(w, w.layout.worker_ids[0], prompts[0], 900)
    _register(w, w.layout.worker_ids[9], prompts[0], 400, Tier.DRAM)
    _register(w, w.layout.worker_ids[17], prompts[1], 700)
    skipped = 0
    for region in ("a", "b", "c"):
        fast = Router(w.cfg, region, w.views[region], now=0.0)
        fast.scorer._blocks = ScoreBlocks(fast.scorer.kernel, 1)
        plan, pointers = fast.lookup.native_plan()
        fast._kernel = SparseForwardKernel(plan, pointers, fast.lookup.query_lengths, fast.lookup.salt,
                                           fast.scorer.kernel, fast.scorer.kernel_flags(fast.ablation),
                                           fast._miss_summary, fast._last_sent,
                                           family_index=fast.lookup.family_index(), backend=SHA256_BACKENDS["auto"],
                                           blocks=fast.scorer.blocks)
        fast._kernel.age_from(*fast.queues.aging_arrays())
        slow = _reference_router(w.cfg, region, w.views[region], Ablation())
        now = 1.0
        for step in range(12):
            if step == 6:  # learned rates: the bounds follow the new beta
                rates = np.linspace(0.05, 0.4, 23)[::-1].copy()
                for router in (fast, slow):
                    router.scorer.set_prefill_rates(rates)
            for router in (fast, slow):
                local = w.cfg.workers_in(region)
                router.queues.set_local(local[step % len(local)].id, 7.0 * step, now=now, running=step % 2)
            now += 0.05
            a = fast.decide(prompts[step % 3], now=now)
            b = slow.decide(prompts[step % 3], now=now)
            skipped += not a.score._complete
            assert (a.worker, a.claimed_tokens, a.tier, a.lam, a.migration) == (b.worker, b.claimed_tokens, b.tier,
                                                                                b.lam, b.migration)
            assert a.score.total == b.score.total
            assert a.candidates == b.candidates
            assert a.score.scores.tobytes() == b.score.scores.tobytes()
            np.testing.assert_array_equal(fast.queues.queue_ms(now=now), slow.queues.queue_ms(now=now))
    assert skipped  # the pruned path did skip workers


def test_sparse_lookup_refuses_a_map_that_names_a_worker_twice():
    """Two fields naming one worker would write more holders than there are workers: refused,
    nothing written past the buffers; the Python plan refuses two workers in one field."""
    from kvcompassd.core._ludo_cffi import ffi, lib
    from kvcompassd.core.lookup_plan import LookupPlan

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    tokens = _prompt(61, 600)
    for worker in (0, 1, 2):  # region a's three workers: one group, fields 0-2
        _register(w, w.layout.worker_ids[worker], tokens, 600)
    router = Router(w.cfg, "a", w.views["a"], now=0.0)
    plan, pointers = router.lookup.native_plan()
    keys = router.lookup.query_keys(tokens)
    g = int(plan._worker_group[0])
    assert (plan._worker_group[:3] == g).all()
    field_worker = np.full_like(plan.field_worker(), -1)
    field_worker[g, plan._worker_shift[:3] // 2] = (0, 1, 0)  # worker 0 named twice, in a map of two workers
    n = 2  # three fields hit: more holders than the buffers hold
    holders, held = np.zeros(n, dtype=np.int32), ffi.new("size_t *")
    matched, tier = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint8)
    values = np.zeros(plan.groups * plan.max_levels, dtype=np.uint64)
    rc = lib.kvc_lookup_sparse(pointers.pointers(), plan.shards, plan.groups, ffi.from_buffer("uint64_t[]", keys),
                               keys.size, ffi.from_buffer("int64_t[]", plan._lengths),
                               ffi.from_buffer("int32_t[]", plan._key_index), plan.max_levels,
                               ffi.from_buffer("int32_t[]", field_worker), n, 1, ffi.from_buffer("uint64_t[]", values),
                               ffi.from_buffer("int64_t[]", matched), ffi.from_buffer("uint8_t[]", tier),
                               ffi.from_buffer("int32_t[]", holders), held)
    assert rc != 0 and held[0] == 0
    field_worker[g, plan._worker_shift[2] // 2] = -1  # the control: each worker once
    rc = lib.kvc_lookup_sparse(pointers.pointers(), plan.shards, plan.groups, ffi.from_buffer("uint64_t[]", keys),
                               keys.size, ffi.from_buffer("int64_t[]", plan._lengths),
                               ffi.from_buffer("int32_t[]", plan._key_index), plan.max_levels,
                               ffi.from_buffer("int32_t[]", field_worker), n, 1, ffi.from_buffer("uint64_t[]", values),
                               ffi.from_buffer("int64_t[]", matched), ffi.from_buffer("uint8_t[]", tier),
                               ffi.from_buffer("int32_t[]", holders), held)
    assert rc == 0 and held[0] == 2 and sorted(holders.tolist()) == [0, 1] and matched.all()
    shared = LookupPlan(plan._lengths, router.lookup.query_lengths, np.zeros(2, dtype=np.int32),
                        np.zeros(2, dtype=np.uint8), shards=plan.shards, consistency=True)
    with pytest.raises(LookupPlanError, match="share one field"):
        shared.field_worker()


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.lists(st.integers(-1, 40), min_size=32, max_size=32), min_size=1, max_size=6),
       workers=st.integers(1, 41))
def test_field_masks_are_the_fields_with_a_worker(rows, workers):
    """``kvc_field_masks`` (made once per edge, what the fused call reads instead of deriving each
    group's mask per decision): the low bit of every field naming a worker; a worker out of range
    refused."""
    from kvcompassd.core._ludo_cffi import ffi, lib

    field_worker = np.array(rows, dtype=np.int32)
    masks = np.zeros(len(rows), dtype=np.uint64)
    rc = lib.kvc_field_masks(ffi.from_buffer("int32_t[]", field_worker), len(rows), workers,
                             ffi.from_buffer("uint64_t[]", masks))
    if (field_worker >= workers).any():
        assert rc != 0
        return
    assert rc == 0
    want = [sum(1 << (2 * f) for f, w in enumerate(row) if w >= 0) for row in rows]
    assert masks.tolist() == want


def _untracked(router: Router) -> Router:
    """``router`` with a fused kernel that ages every worker on every decision (no change log)."""
    plan, pointers = router.lookup.native_plan()
    router._kernel = SparseForwardKernel(plan, pointers, router.lookup.query_lengths, router.lookup.salt,
                                         router.scorer.kernel, router.scorer.kernel_flags(router.ablation),
                                         router._miss_summary, router._last_sent,
                                         family_index=router.lookup.family_index(),
                                         backend=SHA256_BACKENDS["auto"], blocks=router.scorer.blocks)
    router._kernel.age_from(*router.queues.aging_arrays())
    return router


_queue_op = st.one_of(
    st.tuples(st.just("local"), st.integers(0, 7), st.one_of(st.just(0.0), st.floats(0.0, 400.0)),
              st.sampled_from([0, 0, 0, 1, 2, 7, 300])),
    st.tuples(st.just("vector"), st.integers(0, 1), st.lists(st.one_of(st.just(0.0), st.floats(0.0, 400.0)),
                                                             min_size=1, max_size=8),
              st.sampled_from(["trend", "steady", "piggyback"])),
    st.tuples(st.just("decide"), st.integers(0, 2)),
    st.tuples(st.just("end"), st.sampled_from(["first_token", "aborted", "finished"])),
    st.tuples(st.just("clock"), st.sampled_from([0.0, 0.001, 0.004, 0.01, 0.03, 0.1, 0.4, 3.0, -0.02])),
)


@settings(max_examples=100, deadline=None)
@given(start=st.lists(st.floats(1.0, 400.0), min_size=23, max_size=23),
       running=st.lists(st.sampled_from([0, 0, 1, 3, 64]), min_size=23, max_size=23),
       ops=st.lists(_queue_op, min_size=1, max_size=40), region=st.sampled_from(["a", "b", "c"]))
def test_decisions_that_age_only_the_changed_workers_equal_those_that_age_all(start, running, ops, region):
    """A Router whose fused call ages only the workers its queue estimates logged as changed and
    those whose values still move (the buffer's aging record, ``QueueEstimates.change_log``)
    decides, prices capacity and leaves the estimates as one that ages every worker each time,
    bit for bit: from every worker busy (the least estimate is no idle worker's 0) and own-region
    workers running batches (the occupancy added to the queue scored), through readings with and
    without running batches (the occupancy coming, changing and going), trending, steady and
    piggybacked vectors, dispatches and their ends, and a clock that stands, runs and steps back."""
    from kvcompassd.core.messages import QueueVectorBroadcast

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    prompts = [_prompt(95 + p, 700) for p in range(3)]
    _register(w, w.layout.worker_ids[1], prompts[0], 700)
    _register(w, w.layout.worker_ids[12], prompts[1], 400, Tier.DRAM)
    _register(w, w.layout.worker_ids[20], prompts[2], 300)
    tracked = Router(w.cfg, region, w.views[region], now=0.0)
    full = _untracked(Router(w.cfg, region, w.views[region], now=0.0))
    assert tracked._kernel._changes is not None and full._kernel._changes is None
    local = [wk.id for wk in w.cfg.workers_in(region)]
    remote = [r for r in ("a", "b", "c") if r != region]
    now, sent_at, dispatches = 1.0, 0.0, []
    for router in (tracked, full):
        for i, wid in enumerate(w.layout.worker_ids):
            if wid in local:
                router.queues.set_local(wid, start[i], now=now, running=running[i])
        for source in remote:
            vector = tuple((wk.id, start[w.layout.worker_ids.index(wk.id)]) for wk in w.cfg.workers_in(source))
            router.queues.on_broadcast(QueueVectorBroadcast(source, region, 0.0, vector), now=now)
    for op in ops:
        kind = op[0]
        if kind == "clock":
            now += op[1]
        elif kind == "local":
            for router in (tracked, full):
                router.queues.set_local(local[op[1] % len(local)], op[2], now=now, running=op[3])
        elif kind == "vector":
            source = remote[op[1]]
            workers = [wk.id for wk in w.cfg.workers_in(source)]
            vector = tuple(zip(workers, op[2]))
            sent_at += 0.001
            for router in (tracked, full):
                if op[3] == "piggyback":
                    router.queues.on_piggyback(source, dict(vector), now=now)
                else:
                    router.queues.on_broadcast(QueueVectorBroadcast(source, region, sent_at, vector,
                                                                    steady=op[3] == "steady"), now=now)
        elif kind == "decide":
            a = tracked.decide(prompts[op[1]], now=now)
            b = full.decide(prompts[op[1]], now=now)
            assert (a.worker, a.claimed_tokens, a.tier, a.dispatch) == (b.worker, b.claimed_tokens, b.tier, b.dispatch)
            assert _same_bits(np.array([a.lam, a.score.total]), np.array([b.lam, b.score.total]))
            assert a.score.queue_ms.tobytes() == b.score.queue_ms.tobytes()
            dispatches.append(a.dispatch)
        elif dispatches:
            dispatch = dispatches.pop(0)
            for router in (tracked, full):
                if op[1] == "first_token":
                    router.on_first_token(dispatch, now=now)
                elif op[1] == "aborted":
                    router.on_aborted(dispatch, now=now)
                else:
                    router.on_finished(dispatch, prompt_tokens=700, cached_tokens=0, output_tokens=8, now=now)
    # (read only at the end: a read at a decision's now would let that decision skip the fused call)
    assert tracked.queues.queue_ms(now=now).tobytes() == full.queues.queue_ms(now=now).tobytes()


def test_a_decision_ages_only_the_logged_and_the_moving_workers():
    """The aging record of a Router's reused buffer: current to the change log's count after each
    decision, listing as moving the own-region workers whose queue still drains (rate -1, value
    above 0) and no idle or remote one; a reading logs its worker, and a clock that steps back
    makes the next decision age every worker again (the same estimates as numpy's either way)."""
    from kvcompassd.core.lookup_plan import DecisionArrays

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    tokens = _prompt(99, 600)
    _register(w, w.layout.worker_ids[4], tokens, 600)
    router = Router(w.cfg, "a", w.views["a"], now=0.0)
    queues, n = router.queues, len(w.layout.worker_ids)
    local = [i for i, wid in enumerate(w.layout.worker_ids) if w.cfg.worker(wid).region == "a"]
    at = DecisionArrays.aging_at(n)

    def record(arrays):
        head = arrays.out[at:at + 4]
        moving = arrays.out[at + 4 + 2 * ((n + 15) // 16):].view(np.int32)[:int(head[3])]
        return head[0], int(head[1]), head[2], sorted(moving.tolist())

    def numpy_aged(now):
        return np.maximum(0.0, queues._ms + queues._rate * np.maximum(0.0, (now - queues._taken_at) * 1000.0))

    def moving_at(now):  # a positive rate, or a negative one whose value is not clamped to 0 yet
        ms, rate = queues._ms, queues._rate
        left = ms + rate * np.maximum(0.0, (now - queues._taken_at) * 1000.0)
        return np.flatnonzero((rate > 0) | ((rate < 0) & (left > 0))).tolist()

    queues.set_local(w.layout.worker_ids[local[0]], 30.0, now=1.0)  # drains to 0 by 1.03 s
    for step in range(3):
        now = 1.0 + 0.02 * step
        want_moving, want_aged, logged = moving_at(now), numpy_aged(now), int(queues.change_log()[0])
        assert (local[0] in want_moving) == (step < 2)
        decision = router.decide(tokens, now=now)
        arrays = queues._adopted[2]
        flag, count, at_now, moving = record(arrays)
        assert (flag, count, at_now) == (1.0, logged, now)
        assert moving == want_moving
        assert arrays.aged().tobytes() == want_aged.tobytes()
        router.on_aborted(decision.dispatch, now=now)
    now -= 0.5  # back in time: every worker aged again, the record made anew
    want_aged, logged = numpy_aged(now), int(queues.change_log()[0])
    router.decide(tokens, now=now)
    arrays = queues._adopted[2]
    assert record(arrays)[:3] == (1.0, logged, now)
    assert arrays.aged().tobytes() == want_aged.tobytes()


def test_a_decision_with_running_batches_carries_the_occupied_queue_over():
    """With own-region workers running batches the score reads the aged estimates plus each
    worker's occupancy, and the reused buffer's aging record is kept for that queue (flag 2.0):
    only the logged and moving workers are carried again, and a reading that changes only a
    worker's running count moves the least estimate (here the occupancy alone makes it) and lam
    as a Router that ages every worker does; the occupancy gone, the record is made anew for the
    aged values alone (flag 1.0)."""
    from kvcompassd.core.lookup_plan import DecisionArrays
    from kvcompassd.core.messages import QueueVectorBroadcast

    w = World(fingerprint_bits=0, consistency=True, value_bits=32, ready=(0, 1, 2))
    tokens = _prompt(97, 600)
    _register(w, w.layout.worker_ids[4], tokens, 600)
    tracked = Router(w.cfg, "a", w.views["a"], now=0.0)
    full = _untracked(Router(w.cfg, "a", w.views["a"], now=0.0))
    n = len(w.layout.worker_ids)
    local = [wk.id for wk in w.cfg.workers_in("a")]
    at = DecisionArrays.aging_at(n)
    per_running = w.cfg.score.occupancy_ms_per_running
    assert per_running > 0.0
    for router in (tracked, full):
        for wid in local:  # idle but running: the occupancy alone is their queue
            router.queues.set_local(wid, 0.0, now=1.0, running=40 if wid == local[0] else 80)
        for source in ("b", "c"):
            vector = tuple((wk.id, 500.0) for wk in w.cfg.workers_in(source))
            router.queues.on_broadcast(QueueVectorBroadcast(source, "a", 0.0, vector), now=1.0)
    queues = tracked.queues

    def decide_both(now):
        aged = np.maximum(0.0, queues._ms + queues._rate * np.maximum(0.0, (now - queues._taken_at) * 1000.0))
        want = aged + queues._occupancy if queues._occupied else aged
        logged = int(queues.change_log()[0])
        a, b = tracked.decide(tokens, now=now), full.decide(tokens, now=now)
        assert (a.worker, a.claimed_tokens, a.tier) == (b.worker, b.claimed_tokens, b.tier)
        assert _same_bits(np.array([a.lam, a.score.total]), np.array([b.lam, b.score.total]))
        assert a.score.queue_ms.tobytes() == b.score.queue_ms.tobytes()
        arrays = queues._adopted[2]
        assert int(arrays.out[at + 1]) == logged and arrays.out[at + 2] == now
        assert arrays.queue().tobytes() == want.tobytes() and arrays.aged().tobytes() == aged.tobytes()
        tracked.on_aborted(a.dispatch, now=now)
        full.on_aborted(b.dispatch, now=now)
        assert queues.queue_ms(now=now).tobytes() == full.queues.queue_ms(now=now).tobytes()
        # (the buffer is left to the ring: the next decisions reuse it and its record)
        return a.lam, arrays.out[at], int(arrays.out[at + 3]), arrays.queue().min()

    lam, flag, moving, least = decide_both(1.0)
    assert flag == 2.0 and moving == 0  # every value settled: none listed as moving
    assert least == 40 * per_running  # local[0]'s occupancy is the least estimate
    for now in (1.002, 1.004, 1.006):  # carried over, only the dispatched and aborted worker again
        assert decide_both(now) == (lam, 2.0, 0, least)
    logged = int(queues.change_log()[0])
    for router in (tracked, full):  # only local[0]'s running count changes: the least goes up
        router.queues.set_local(local[0], 0.0, now=1.01, running=120)
    assert int(queues.change_log()[0]) == logged + 1
    for now in (1.01, 1.012, 1.014):
        changed = decide_both(now)
        assert changed[1:] == (2.0, 0, 80 * per_running) and changed[0] != lam
    for router in (tracked, full):  # every running batch done: the occupancy is no longer added
        for wid in local:
            router.queues.set_local(wid, 0.0, now=1.02, running=0)
    assert not queues.estimate_terms(1.02)[2]
    for now in (1.02, 1.022, 1.024):
        assert decide_both(now) == (0.0, 1.0, 0, 0.0)
    for router in (tracked, full):  # the remote values change while the scored queue is the aged one
        for source in ("b", "c"):
            vector = tuple((wk.id, 300.0) for wk in w.cfg.workers_in(source))
            router.queues.on_broadcast(QueueVectorBroadcast(source, "a", 0.5, vector), now=1.03)
    for now in (1.03, 1.032, 1.034):
        assert decide_both(now) == (0.0, 1.0, 0, 0.0)
    for router in (tracked, full):  # the occupancy back: a record made for the aged values is not current
        for wid in local:
            router.queues.set_local(wid, 0.0, now=1.04, running=20)
    for now in (1.04, 1.042, 1.044):
        assert decide_both(now)[1:] == (2.0, 0, 20 * per_running)
