"""The fused decision (``kvc_forward_decide`` through ``ForwardKernel``) equals its parts and the reference Router."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from kvcompassd.core.ablation import Ablation
from kvcompassd.core.events import PrefixCached, Tier
from kvcompassd.core.keys import SHA256_BACKENDS, prefix_keys
from kvcompassd.core.lookup_plan import ForwardKernel, LookupPlanError, MissSummary
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
