"""The edge's decision end to end in-process: lookup + score + belief + queues + migration."""

from __future__ import annotations

import collections

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clusters import make_cluster
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.messages import RoomVectorBroadcast
from kvcompassd.core.router import RESCORE_RATE_TOLERANCE, SHORTFALL_DRAM, SHORTFALL_EVICTED, Router, copy_pressure

SHARDS = 2


def _world(regions=None, **score):
    cfg = make_cluster(regions or {"us": 3, "eu": 2}, shards=SHARDS, one_way_ms=20.0, prefill_ms_per_token=0.1,
                       levels=4, same_region_min_tokens=32, **score)
    layout = IndexLayout.from_config(cfg)
    shards = [MaintenanceShard(layout, s, SHARDS, epoch=1, initial_capacity=64) for s in range(SHARDS)]
    view = EdgeIndexView(layout, SHARDS, edge="edge-us")
    for s in shards:
        view.install_snapshot(s.snapshot())
    return cfg, layout, shards, view


def _register(cfg, shards, view, worker, tokens, cached, tier=Tier.VRAM):
    plan = LevelPlan.from_config(cfg)
    keys = prefix_keys(tokens, plan.registration_lengths_upto(cached), namespace_salt(cfg.model))
    for k in keys:
        shards[int(k) % SHARDS].apply([PrefixCached(worker, int(k), tier)])
    for s in shards:
        if (b := s.flush()) is not None:
            assert view.apply_next(b) is None


PROMPT = np.random.default_rng(5).integers(0, 30000, 2000, dtype=np.uint32)


def test_idle_cluster_prefers_the_local_holder():
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker == "us-1" and d.local and d.outcome == "local_hit"
    assert d.claimed_tokens == LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-1] == 2000
    assert d.candidates[0].worker == "us-1" and len(d.candidates) == 3


def test_loaded_holder_loses_to_an_idle_recompute_only_when_the_formula_says_so():
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    # Own-region lengths double 32 ... 1024 (until the longest remote length, 1008), then go on
    # in steps of 1.25 toward the context (1280, 1600, 2000, ...): the holder is credited 2000
    # tokens, a saving of beta * 2000 = 200 ms (lambda = 0 while an idle worker exists). It wins
    # while its queue is shorter than that, and loses beyond.
    assert LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-4:] == (1024, 1280, 1600, 2000)
    router.queues.set_local("us-1", 195.0, now=0.0)
    assert router.decide(PROMPT, now=0.0).worker == "us-1"
    router.queues.set_local("us-1", 205.0, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker in ("us-0", "us-2") and d.outcome == "recompute"


# Room steps: 4,000 of a worker's 8,000 VRAM tokens free now, all once its requests finish:
# half its VRAM pinned (a 2,000-token prompt still fits, so it waits for no room).
HALF_PINNED = ((0.0, 4000), (50.0, 8000))


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_weight_charges_a_non_holder_the_copy_it_would_evict_for(native):
    # One region (a remote worker's room comes from its edge's broadcasts), where the holder is
    # credited `held` of the 2000 tokens, a saving of beta * held at lambda = 0: without a copy
    # weight it keeps the prompt while its queue is under that. With copy_weight 2 and half of
    # their VRAM pinned, the non-holders are charged the copy once more (2 x 0.5 x beta * held):
    # the holder keeps the prompt until its queue passes twice the saving, and the charge is a
    # term of the winner's score. Each decision comes from a fresh edge (no dispatch charged).
    cfg, layout, shards, view = _world({"us": 3}, copy_weight=2.0, copy_pinned_floor=0.0)
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    held = LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-1]

    def decide(holder_queue):
        router = Router(cfg, "us", view, now=0.0, native=native)
        for w in ("us-0", "us-2"):
            router.queues.set_room(w, HALF_PINNED, now=0.0)
        router.queues.set_local("us-1", holder_queue, now=0.0)
        return router.decide(PROMPT, now=0.0)

    assert decide(0.1 * held + 5.0).worker == "us-1"
    assert decide(0.2 * held - 5.0).worker == "us-1"
    d = decide(0.2 * held + 5.0)
    assert d.worker in ("us-0", "us-2") and d.outcome == "recompute"
    terms = {t.worker: t for t in d.candidates}
    assert terms[d.worker].copy_ms == pytest.approx(0.1 * held) and terms["us-1"].copy_ms == 0.0
    for t in terms.values():
        assert t.total == pytest.approx(t.wan_ms + t.queue_ms + t.prefill_ms + t.reload_ms + t.copy_ms)
    assert d.score.copies is not None and d.score.total == pytest.approx(terms[d.worker].total)


def test_the_copy_charge_is_what_the_best_holder_has_more_of_at_the_decisions_price():
    # us-1 holds all 2000 of the prompt's tokens, us-0 1024, us-2 none; the eu workers are idle,
    # so lambda = 0 and a token costs beta = 0.1 ms, and at copy_weight 1 with half the VRAM
    # pinned another 0.05 where the best holder has it and the worker does not. Without the
    # charge us-0 would win (100 + 97.6 ms against us-1's 230); with it us-0 pays 48.8 ms more
    # and us-1 keeps the prompt.
    def world(weight):
        cfg, layout, shards, view = _world(copy_weight=weight, copy_pinned_floor=0.0)
        _register(cfg, shards, view, "us-1", PROMPT, 2000)
        _register(cfg, shards, view, "us-0", PROMPT, 1024)
        router = Router(cfg, "us", view, now=0.0)
        for w, q in (("us-0", 100.0), ("us-2", 100.0), ("us-1", 230.0)):
            router.queues.set_local(w, q, now=0.0)
            router.queues.set_room(w, HALF_PINNED, now=0.0)
        return layout, router

    layout, router = world(1.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker == "us-1" and d.score.lam == 0.0
    index = layout.worker_index
    copies, scores = d.score.copies, d.score.scores
    assert copies[index("us-0")] == pytest.approx(0.05 * 976) and copies[index("us-2")] == pytest.approx(0.05 * 2000)
    assert copies[index("us-1")] == 0.0
    t = d.score.terms(index("us-0"))
    assert t.prefill_ms == pytest.approx(0.1 * 976) and t.copy_ms == pytest.approx(0.05 * 976)
    assert scores[index("us-0")] == t.total == pytest.approx(t.wan_ms + t.queue_ms + t.prefill_ms + t.copy_ms)
    # Without the weight the same world sends it to us-0.
    assert world(0.0)[1].decide(PROMPT, now=0.0).worker == "us-0"


def test_a_pinned_share_an_sglang_worker_reports_prices_the_copy_as_room_steps_would():
    # No room steps (a real SGLang's agent sends none), but half of each non-holder's KV pool
    # held by its requests (WorkerPinnedReported): the same decisions as with half-pinned steps.
    cfg, layout, shards, view = _world({"us": 3}, copy_weight=2.0, copy_pinned_floor=0.0)
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    held = LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-1]
    for holder_queue, kept in ((0.2 * held - 5.0, True), (0.2 * held + 5.0, False)):
        router = Router(cfg, "us", view, now=0.0)
        for w in ("us-0", "us-2"):
            router.queues.set_pinned(w, 0.5)
        router.queues.set_local("us-1", holder_queue, now=0.0)
        d = router.decide(PROMPT, now=0.0)
        assert (d.worker == "us-1") is kept
    assert {t.worker: t.copy_ms for t in d.candidates}[d.worker] == pytest.approx(0.1 * held)


# Room steps with 3/4 of a worker's 16,000 VRAM tokens pinned (4,000 free now, room enough for
# the 2,000-token prompt; all once its requests finish): at the default floor of 1/2, half the
# copy charge.
THREE_QUARTERS_PINNED = ((0.0, 4000), (50.0, 16000))


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_is_charged_only_past_the_pinned_floor(native):
    # At the default copy_pinned_floor (0.5) a non-holder with half its VRAM pinned is charged
    # nothing: the holder loses the prompt where it would with no copy weight at all (its queue
    # past the saving, beta * held). With 3/4 pinned the charge is (3/4 - 1/2) / (1/2) = half
    # of it, 2 x 0.5 x beta * held: the holder keeps the prompt until its queue passes twice the
    # saving, as the proportional charge kept it at half pinned.
    cfg, layout, shards, view = _world({"us": 3}, copy_weight=2.0)
    assert cfg.score.copy_pinned_floor == 0.5
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    held = LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-1]

    def decide(holder_queue, steps):
        router = Router(cfg, "us", view, now=0.0, native=native)
        for w in ("us-0", "us-2"):
            router.queues.set_room(w, steps, now=0.0)
        router.queues.set_local("us-1", holder_queue, now=0.0)
        return router.decide(PROMPT, now=0.0), router.copy_charges

    d, counts = decide(0.1 * held + 5.0, HALF_PINNED)
    assert d.worker in ("us-0", "us-2") and d.score.copies is None
    assert all(t.copy_ms == 0.0 for t in d.candidates) and counts == {"moved": 0, "kept": 0}
    # Without the charge a non-holder would win these two; it moved the first back to the holder.
    d, counts = decide(0.1 * held + 5.0, THREE_QUARTERS_PINNED)
    assert d.worker == "us-1" and counts == {"moved": 1, "kept": 0}
    assert decide(0.2 * held - 5.0, THREE_QUARTERS_PINNED)[0].worker == "us-1"
    d, counts = decide(0.2 * held + 5.0, THREE_QUARTERS_PINNED)
    assert d.worker in ("us-0", "us-2") and counts == {"moved": 0, "kept": 1}
    assert {t.worker: t.copy_ms for t in d.candidates}[d.worker] == pytest.approx(0.1 * held)


def test_a_pinned_share_an_sglang_worker_reports_is_charged_only_past_the_floor():
    # SGLang's share (WorkerPinnedReported) goes through the same floor: half held is no charge,
    # 3/4 half of it.
    cfg, layout, shards, view = _world({"us": 3}, copy_weight=2.0)
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    held = LevelPlan.from_config(cfg).lengths_toward_upto("us", "us", len(PROMPT))[-1]
    for share, kept in ((0.5, False), (0.75, True)):
        router = Router(cfg, "us", view, now=0.0)
        for w in ("us-0", "us-2"):
            router.queues.set_pinned(w, share)
        router.queues.set_local("us-1", 0.2 * held - 5.0, now=0.0)
        assert (router.decide(PROMPT, now=0.0).worker == "us-1") is kept


@given(share=st.floats(0.0, 1.0), other=st.floats(0.0, 1.0), floor=st.floats(0.0, 0.999))
def test_copy_pressure_is_zero_to_the_floor_then_rises_to_one(share, other, floor):
    p = copy_pressure(share, floor)
    assert 0.0 <= p <= 1.0
    assert (p == 0.0) == (share <= floor)
    assert copy_pressure(1.0, floor) == 1.0
    if share <= other:
        assert p <= copy_pressure(other, floor)
    assert copy_pressure(share, 0.0) == pytest.approx(share)


def test_a_worker_with_no_room_steps_is_not_charged_for_a_copy():
    # Nothing pinned, or an engine whose load report has no room steps (a real SGLang's): the
    # cache's oldest entries make room, and the copy costs nothing more than its prefill.
    cfg, layout, shards, view = _world(copy_weight=2.0)
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    router.queues.set_local("us-1", 205.0, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker != "us-1" and d.score.copies is None and all(t.copy_ms == 0.0 for t in d.candidates)


def test_without_a_copy_weight_nothing_is_charged():
    cfg, layout, shards, view = _world()
    assert cfg.score.copy_weight == 0.0
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    router.queues.set_room("us-0", HALF_PINNED, now=0.0)
    router.queues.set_local("us-1", 205.0, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker != "us-1" and d.score.copies is None and all(t.copy_ms == 0.0 for t in d.candidates)


def test_long_remote_match_beats_local_recompute_and_belief_discounts_false_claims():
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "eu-0", PROMPT, 2000, Tier.VRAM)
    router = Router(cfg, "us", view, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    # n1 toward eu = ceil(40 ms / 0.1) = 400 tokens; then block-aligned steps of n1/2; then the
    # long lengths from the plan's longest (1024) in steps of 1.25 toward the context.
    assert LevelPlan.from_config(cfg).lengths_toward_upto("us", "eu", 2000) == (
        400, 608, 800, 1008, 1024, 1280, 1600, 2000)
    assert d.worker == "eu-0" and d.outcome == "remote_hit" and d.claimed_tokens == 2000
    # The worker keeps reusing nothing of what the edge credits it with: belief decays.
    for t in range(20):
        router.on_response("eu-0", claimed_tokens=1000, reused_tokens=0, queue_vector={"eu-0": 0.0, "eu-1": 0.0}, now=t)
    assert router.belief.get(layout.worker_index("eu-0")) < 0.1
    assert router.decide(PROMPT, now=30.0).region == "us"


def test_excluded_workers_are_skipped_for_the_next_best():
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(PROMPT, now=0.0)
    second = router.decide(PROMPT, now=0.0, exclude={first.worker_index})
    assert second.worker != first.worker


def test_tier_blind_ablation_ignores_the_dram_reload_cost():
    cfg, layout, shards, view = _world(gamma_ms_per_token=1.0)
    _register(cfg, shards, view, "us-1", PROMPT, 2000, Tier.DRAM)
    aware = Router(cfg, "us", view, now=0.0)
    blind = Router(cfg, "us", view, now=0.0, ablation=Ablation(tier_aware=False))
    assert aware.decide(PROMPT, now=0.0).worker != "us-1"  # reloading 256 tokens costs 256 ms
    assert blind.decide(PROMPT, now=0.0).worker == "us-1"


def test_hot_remote_prefix_migrates_to_a_persistently_idle_local_worker():
    cfg, layout, shards, view = _world(hot_prefix_misses=3, hot_prefix_window_ms=1000.0, idle_period_ms=100.0)
    _register(cfg, shards, view, "eu-0", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    for w in ("us-0", "us-1", "us-2"):
        router.queues.set_local(w, 0.0, now=0.0)
    plans = [router.decide(PROMPT, now=1.0 + 0.1 * i).migration for i in range(3)]
    assert plans[:2] == [None, None]
    plan = plans[2]
    assert plan is not None and plan.mode == "recompute" and plan.source_worker == "eu-0"
    assert plan.destination_worker.startswith("us-") and plan.tier == Tier.DRAM
    assert Router(cfg, "us", view, now=0.0, ablation=Ablation(migration=False)).decide(PROMPT, now=1.0).migration is None
    assert {k: v for k, v in router.hot.hot_misses.items() if v} == {("recompute", "planned"): 1}


def test_a_hot_family_without_an_idle_worker_is_counted_not_migrated():
    """The Router's short cuts (no remote match worth it, no idle destination) count the same
    outcomes the detector's full observation would."""
    cfg, layout, shards, view = _world(hot_prefix_misses=3, hot_prefix_window_ms=1000.0, idle_period_ms=100.0,
                                       pending_hold_ms=0.0)  # no engine here: nothing registers what was sent
    _register(cfg, shards, view, "eu-0", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)  # no reading yet: no local worker is known idle
    assert [router.decide(PROMPT, now=1.0 + 0.1 * i).migration for i in range(4)] == [None] * 4
    assert {k: v for k, v in router.hot.hot_misses.items() if v} == {("recompute", "no_idle_worker"): 2}
    cold = Router(cfg, "us", view, now=0.0)
    other = np.concatenate([PROMPT[:200], np.full(len(PROMPT) - 200, 7, dtype=np.uint32)])  # below eu's lengths
    for w in ("us-0", "us-1", "us-2"):
        cold.queues.set_local(w, 0.0, now=0.0)
    assert [cold.decide(other, now=1.0 + 0.1 * i).migration for i in range(3)] == [None] * 3
    assert {k: v for k, v in cold.hot.hot_misses.items() if v} == {("recompute", "no_remote_match"): 1}


def test_exact_ties_rotate_instead_of_piling_onto_the_first_worker():
    cfg, layout, shards, view = _world(pending_hold_ms=0.0)  # the ledger would credit the first one
    router = Router(cfg, "us", view, now=0.0)
    chosen = []
    for i in range(6):
        # Fresh readings say every worker is idle again (their queues drain between reports).
        for w in ("us-0", "us-1", "us-2"):
            router.queues.set_local(w, 0.0, now=float(i))
        chosen.append(router.decide(PROMPT, now=float(i)).worker)
    assert chosen == ["us-0", "us-1", "us-2"] * 2


def test_a_fast_follow_up_goes_where_the_edge_just_sent_its_previous_turn():
    """The view shows nothing yet (the registration is still crossing the WAN): the pending
    ledger credits the worker the edge sent the first turn to, once its prefill has started."""
    cfg, layout, shards, view = _world(pending_hold_ms=1000.0)
    first_turn, follow_up = PROMPT[:1500], PROMPT[:1900]
    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(first_turn, now=0.0)
    assert first.outcome == "recompute" and not first.pending
    later = router.decide(follow_up, now=0.4)
    assert later.worker == first.worker and later.claimed_tokens == 1280  # longest own length <= 1500
    assert later.tier == Tier.VRAM and later.outcome == "local_hit" and later.pending
    # Credited from its prefill's start (no queue ahead of it: at once). A follow-up sent while
    # the first turn is still being computed (1500 tokens x 0.1 ms: until 150 ms) waits for it
    # there and finds it (prefills run in admission order; the prefix is matched at the start).
    early = Router(cfg, "us", view, now=0.0)
    sent = early.decide(first_turn, now=0.0)
    during = early.decide(follow_up, now=0.1)
    assert during.worker == sent.worker and during.claimed_tokens == 1280 and during.pending
    # Had that worker failed the first turn, nothing would be credited to it.
    failed = Router(cfg, "us", view, now=0.0)
    failed.on_failed(failed.decide(first_turn, now=0.0).worker_index)
    assert failed.decide(follow_up, now=0.4).claimed_tokens == 0
    # Without the ledger the follow-up is a recompute wherever the rotation puts it.
    cfg_off, _, _, view_off = _world(pending_hold_ms=0.0)
    router_off = Router(cfg_off, "us", view_off, now=0.0)
    router_off.decide(first_turn, now=0.0)
    router_off.decide(follow_up, now=0.1)
    assert router_off.decide(follow_up, now=0.4).claimed_tokens == 0


def test_from_first_token_the_ledger_credits_a_prompt_only_once_its_first_token_came_back():
    """For workers that match a prompt when it arrives: past the estimate (its queue, 0, and
    prefill, 150 ms) but without a first token the worker may still be computing the prompt,
    and a follow-up there would miss."""
    cfg, layout, shards, view = _world(pending_hold_ms=1000.0, pending_from_first_token=True)
    first_turn, follow_up = PROMPT[:1500], PROMPT[:1900]
    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(first_turn, now=0.0)
    assert router.decide(follow_up, now=0.2).claimed_tokens == 0
    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(first_turn, now=0.0)
    router.on_first_token(first.dispatch, now=0.3)
    later = router.decide(follow_up, now=0.4)
    assert later.worker == first.worker and later.claimed_tokens == 1280 and later.pending


def test_a_response_that_reused_less_than_credited_ends_the_credit_and_full_hits_keep_the_group():
    """Under cache pressure a worker evicts (or could not cache) a prompt the ledger credits it
    with: the group's requests went on missing there. The first response that reports less than
    the credit ends it; a worker whose responses report the credited tokens keeps the group."""
    cfg, layout, shards, view = _world(pending_hold_ms=1000.0)
    group = PROMPT[:1500]
    rng = np.random.default_rng(8)

    def member() -> np.ndarray:
        return np.concatenate([group, rng.integers(0, 30000, 200, dtype=np.uint32)])

    def serve(router, d, now, cached):
        router.on_first_token(d.dispatch, now=now)
        router.on_finished(d.dispatch, prompt_tokens=d.prompt_len, cached_tokens=cached, output_tokens=1, now=now)
        router.on_response(d.worker, claimed_tokens=d.claimed_tokens, reused_tokens=cached, now=now)

    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(member(), now=0.0)
    holder = first.worker_index
    serve(router, first, 0.2, 0)
    # A worker that keeps reporting full hits keeps its group.
    t = 0.25
    for _ in range(5):
        d = router.decide(member(), now=t)
        assert d.worker_index == holder and d.claimed_tokens == 1280 and d.pending
        serve(router, d, t + 0.01, d.claimed_tokens)
        t += 0.02
    # It evicted the prefix: the next request misses there, and its response ends the credit.
    d = router.decide(member(), now=t)
    assert d.worker_index == holder and d.claimed_tokens == 1280
    serve(router, d, t + 0.01, 0)
    assert router.pending.refuted > 0
    after = router.decide(member(), now=t + 0.02)
    assert after.claimed_tokens == 0 and not after.pending
    # Without refute the ledger credits the evicted prefix on until its hold ends.
    cfg_old, _, _, view_old = _world(pending_hold_ms=1000.0, pending_refute=False)
    old = Router(cfg_old, "us", view_old, now=0.0)
    first = old.decide(member(), now=0.0)
    serve(old, first, 0.2, 0)
    d = old.decide(member(), now=0.3)
    serve(old, d, 0.31, 0)
    assert old.decide(member(), now=0.32).claimed_tokens == 1280


def test_a_whole_prompt_credited_by_the_ledger_is_refuted_by_a_response_that_reused_less():
    """A repeated prompt the ledger credits in full (its length is an indexed one) leaves no
    longer length to note, but its credit is still recorded for the response to refute."""
    cfg, layout, shards, view = _world(pending_hold_ms=1000.0)
    prompt = PROMPT[:1280]
    router = Router(cfg, "us", view, now=0.0)
    first = router.decide(prompt, now=0.0)
    router.on_first_token(first.dispatch, now=0.2)
    router.on_finished(first.dispatch, prompt_tokens=1280, cached_tokens=0, output_tokens=1, now=0.2)
    again = router.decide(prompt, now=0.25)
    assert again.worker_index == first.worker_index and again.claimed_tokens == again.prompt_len == 1280
    assert again.pending
    router.on_first_token(again.dispatch, now=0.26)
    router.on_finished(again.dispatch, prompt_tokens=1280, cached_tokens=0, output_tokens=1, now=0.26)
    assert router.pending.refuted > 0
    assert router.decide(prompt, now=0.27).claimed_tokens == 0


def test_pending_credit_is_the_same_on_the_native_and_the_reference_path():
    cfg, layout, shards, view = _world(pending_hold_ms=300.0)
    _register(cfg, shards, view, "eu-0", PROMPT, 2000)
    rng = np.random.default_rng(11)
    prompts = [PROMPT[:n] for n in (100, 700, 1200, 1900, 2000)] + [rng.integers(0, 30000, 900, dtype=np.uint32)]
    native = Router(cfg, "us", view, now=0.0)
    reference = Router(cfg, "us", view, now=0.0, native=False)
    for step in range(40):
        now = 0.05 * step
        tokens = prompts[int(rng.integers(len(prompts)))]
        a, b = native.decide(tokens, now=now), reference.decide(tokens, now=now)
        assert (a.worker, a.claimed_tokens, a.tier) == (b.worker, b.claimed_tokens, b.tier)
        np.testing.assert_allclose(a.score.scores, b.score.scores)
    assert len(native.pending) == len(reference.pending) > 0


def test_withheld_workers_get_no_requests_and_no_replicas():
    """An edge withholds a worker whose tokenizer it has not verified (or refused): neither the
    decision nor a hot-prefix replica goes there, until it is released."""
    def world(withheld):
        cfg, layout, shards, view = _world(hot_prefix_misses=3, hot_prefix_window_ms=1000.0, idle_period_ms=100.0)
        _register(cfg, shards, view, "us-1", PROMPT, 2000)
        _register(cfg, shards, view, "eu-0", PROMPT[::-1].copy(), 2000)
        router = Router(cfg, "us", view, now=0.0)
        for w in ("us-0", "us-1", "us-2"):
            router.queues.set_local(w, 0.0, now=0.0)
        for w in withheld:
            router.withhold(layout.worker_ids.index(w))
        return layout, router

    def replicas(router):
        return [d.migration.destination_worker for i in range(3)
                if (d := router.decide(PROMPT[::-1].copy(), now=1.0 + 0.1 * i)).migration is not None]

    # Every decision goes to eu-0 (its 2,000-token match is credited in full), so the hot remote
    # family is replicated onto the first idle local worker, us-0, unless it is withheld; with
    # every local worker withheld there is no replica.
    assert replicas(world([])[1]) == ["us-0"]
    assert replicas(world(["us-0"])[1]) == ["us-1"]
    layout, router = world(["us-0", "us-1", "us-2"])
    assert replicas(router) == [] and router.hot.hot_misses["recompute", "no_idle_worker"] == 1

    layout, router = world(["us-1", "us-2"])
    us1, us2 = layout.worker_ids.index("us-1"), layout.worker_ids.index("us-2")
    assert router.withheld == {us1, us2}
    assert router.decide(PROMPT, now=0.0).worker == "us-0"  # not the holder us-1
    assert router.decide_from(router.lookup.lookup(PROMPT), now=0.0).worker != "us-1"
    router.withhold(us1, False)
    assert router.withheld == {us2} and router.decide(PROMPT, now=2.0).worker == "us-1"
    try:
        router.withhold(len(layout.worker_ids))
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown worker index must be refused")


def test_decode_workers_of_a_disaggregated_fleet_are_never_routed_to():
    """A decode worker only receives KV a prefill worker hands it: no request is routed there,
    even when it is the only idle worker, and releasing a withheld worker does not free it."""
    cfg, layout, shards, view = _world()
    cfg = replace(cfg, workers=tuple(replace(w, role="decode") if w.id in ("us-0", "us-2") else
                                     replace(w, role="prefill") if w.id == "us-1" else w for w in cfg.workers))
    router = Router(cfg, "us", view, now=0.0)
    us0, us2 = layout.worker_ids.index("us-0"), layout.worker_ids.index("us-2")
    assert router.withheld == {us0, us2}
    router.queues.set_local("us-1", 5000.0, now=0.0)  # the prefill worker is busy; decoders idle
    assert router.decide(PROMPT, now=0.0).worker in ("us-1", "eu-0", "eu-1")
    router.withhold(us0, False)
    assert router.withheld == {us0, us2}
    assert router.decide_from(router.lookup.lookup(PROMPT), now=0.0).worker not in ("us-0", "us-2")

@pytest.mark.parametrize("regions", [{"us": 3, "eu": 2}, {"us": 20}], ids=["small fleet", "large fleet"])
def test_learned_rates_reach_the_scorer_once_they_move_past_the_tolerance(regions):
    """A learned prefill rate that moves by less than ``RESCORE_RATE_TOLERANCE`` of the one
    scored with is not handed to the scorer (each hand-over re-derives its bounds), one that
    moves further is, with every worker's rate as learned: the scorer's rates and the charges
    never stray further than the tolerance from the learned ones."""
    cfg, layout, shards, view = _world(regions)
    router = Router(cfg, "us", view, now=0.0)
    handed = []
    set_rates = router.scorer.set_prefill_rates
    router.scorer.set_prefill_rates = lambda rates: handed.append(rates.tolist()) or set_rates(rates)
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    others = [j for j in range(len(layout.worker_ids)) if j != 0]
    t, moved = 1.0, 0
    # Prefills of 1,000 tokens that take 0.1 ms a token at first, then a per mille longer each.
    for n in range(60):
        d = router.decide(PROMPT[:1000] + n, now=t, exclude=others)
        took = 1000 * 0.1 * 1.001 ** n / 1000.0
        router.on_first_token(d.dispatch, now=t + rtt + took)
        before = router.rates.prefill_rates().tolist()
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=t + rtt + took)
        learned = router.rates.prefill_rates().tolist()
        moved += learned != before
        scored = list(router.scorer.beta_list)
        assert all(abs(a - b) <= RESCORE_RATE_TOLERANCE * b for a, b in zip(learned, scored)), n
        assert router._beta_list == router.scorer.beta_list  # the charges' rates are the scored ones
        if handed and handed[-1] == learned:
            assert scored == learned
        t += 1.0
    # The window's median moved on most samples, crossing the tolerance a few times.
    assert moved > 40 and 1 <= len(handed) < moved / 4
    assert router.rates.prefill_ms_per_token(0) > 0.1 * (1 + RESCORE_RATE_TOLERANCE)


def test_a_first_token_retires_the_dispatch_charge_and_an_end_teaches_the_rate():
    cfg, layout, shards, view = _world()
    router = Router(cfg, "us", view, now=0.0)
    prompt = PROMPT[:1000]
    d = router.decide(prompt, now=1.0)
    i = d.worker_index
    assert router.queues.queue_ms(now=1.0)[i] == pytest.approx(0.1 * 1000)  # charged beta * uncached
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    router.on_first_token(d.dispatch, now=1.0 + rtt + 0.02)  # 20 ms: a worker 5x faster than configured
    assert router.queues.queue_ms(now=1.0 + rtt + 0.02)[i] == 0.0  # no phantom queue
    router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=4, now=1.1)
    # Four more like it and the worker's learned rate is a fifth of the configured one, in the
    # score (the C kernel reads it) and in the next charge.
    others = [j for j in range(len(layout.worker_ids)) if j != i]
    failed = router.decide(prompt, now=1.5, exclude=others)
    router.on_failed(i, dispatch=failed.dispatch, now=1.5)  # a failure teaches nothing, retires its charge
    assert router.queues.queue_ms(now=1.5)[i] == 0.0
    t = 2.0
    for _ in range(4):
        d = router.decide(prompt, now=t, exclude=others)
        router.on_first_token(d.dispatch, now=t + rtt + 0.02)
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=t + rtt + 0.02)
        t += 1.0
    assert router.rates.prefill_ms_per_token(i) == pytest.approx(0.02)
    assert router.scorer.beta[i] == pytest.approx(0.02)
    d = router.decide(prompt, now=t, exclude=others)
    assert d.score.terms(i).prefill_ms == pytest.approx(0.02 * 1000)
    assert d.score.scores[i] == pytest.approx(0.02 * 1000 + cfg.rtt_ms("us", "us"))
    assert router.queues.queue_ms(now=t)[i] == pytest.approx(0.02 * 1000)
    router.on_aborted(d.dispatch, now=t)  # the client went away before its first token
    assert router.queues.queue_ms(now=t)[i] == 0.0
    assert router.queues.open_charges() == 0 and len(router.rates) == 0


def test_equal_workers_whose_learned_rates_differ_by_noise_share_the_prompts_nobody_holds():
    # One request at a time, each a prompt nobody holds, each worker's samples a few per cent
    # off the others' (what the median of noisy samples gives equal workers). Read as real, the
    # cheapest-looking worker would get every one of them: under cache pressure its VRAM then
    # holds every group's prefix and evicts them in turn. Within OWN_RATE_MARGIN of the fleet's
    # factor the workers are equal, so the misses rotate over them.
    cfg, layout, shards, view = _world()
    router = Router(cfg, "us", view, now=0.0)
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    us = [layout.worker_ids.index(w) for w in ("us-0", "us-1", "us-2")]
    service_s = {us[0]: 0.100, us[1]: 0.097, us[2]: 0.103}  # 1,000 tokens at 0.1 ms: +-3 %
    rng = np.random.default_rng(11)
    t, chosen = 1.0, []
    for n in range(24):
        prompt = rng.integers(0, 30000, 1000, dtype=np.uint32)
        if n < 15:  # five samples each: every worker's own rate is ready
            d = router.decide(prompt, now=t, exclude=[j for j in us if j != us[n % 3]])
        else:
            d = router.decide(prompt, now=t)
            chosen.append(d.worker_index)
        first = t + rtt + service_s[d.worker_index]
        router.on_first_token(d.dispatch, now=first)
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=first)
        t += 1.0
    assert router.rates.prefill_ms_per_token(us[1]) == router.rates.prefill_ms_per_token(us[0])
    assert sorted(collections.Counter(chosen).values()) == [3, 3, 3]
    # A worker truly slower than the margin keeps its own rate and is passed over.
    for _ in range(31):
        d = router.decide(rng.integers(0, 30000, 1000, dtype=np.uint32), now=t,
                          exclude=[j for j in range(len(layout.worker_ids)) if j != us[2]])
        router.on_first_token(d.dispatch, now=t + rtt + 0.2)
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=t + rtt + 0.2)
        t += 1.0
    assert router.rates.prefill_ms_per_token(us[2]) > 1.25 * router.rates.prefill_ms_per_token(us[0])
    assert router.decide(rng.integers(0, 30000, 1000, dtype=np.uint32), now=t).worker_index != us[2]


def test_charges_retired_at_the_first_token_keep_a_burst_of_one_prefix_on_its_holder():
    # Each dispatch to the holder of an 800-token prefix is charged its modelled prefill of the
    # 1,200 tokens that follow (120 ms), more than the hit saves (80 ms), while the worker is in
    # fact done within 2 ms. A burst of follow-ups whose first tokens come back fast stays on the
    # holder once charges retire at the first token; left to age, they pushed the burst away.
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 800)
    holder = layout.worker_index("us-1")
    rng = np.random.default_rng(3)

    def burst(router, retire: bool) -> list[int]:
        served, t = [], 1.0
        for _ in range(40):
            prompt = np.concatenate([PROMPT[:800], rng.integers(0, 30000, 1200, dtype=np.uint32)])
            d = router.decide(prompt, now=t)
            served.append(d.worker_index)
            if retire:
                router.on_first_token(d.dispatch, now=t + 0.002)
            t += 0.002  # 500 req/s, no reading in between (an idle-looking worker reports every 100 ms)
        return served

    kept = burst(Router(cfg, "us", view, now=0.0), retire=True)
    assert kept.count(holder) == len(kept)
    aged = burst(Router(cfg, "us", view, now=0.0), retire=False)
    assert aged.count(holder) <= len(aged) // 2


def _evict(cfg, shards, view, worker, tokens, cached):
    plan = LevelPlan.from_config(cfg)
    keys = prefix_keys(tokens, plan.registration_lengths_upto(cached), namespace_salt(cfg.model))
    for k in keys:
        shards[int(k) % SHARDS].apply([PrefixEvicted(worker, int(k))])
    for s in shards:
        if (b := s.flush()) is not None:
            assert view.apply_next(b) is None


def test_a_shortfall_the_index_has_explained_leaves_the_belief_alone():
    # The holder had the prompt when the edge sent it there and lost it to cache turnover on
    # the way; by the response the index has applied the eviction: not a false entry.
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker == "us-1" and d.claimed_tokens == 2000
    index = layout.worker_index("us-1")
    assert router.explain_shortfall(PROMPT, index, 2000) is None
    _evict(cfg, shards, view, "us-1", PROMPT, 2000)
    assert router.explain_shortfall(PROMPT, index, 2000) == SHORTFALL_EVICTED
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=0, now=1.0, tokens=PROMPT)
    assert router.belief.get(index) == 1.0
    assert router.explained_shortfalls == {SHORTFALL_EVICTED: 1, SHORTFALL_DRAM: 0}
    # Without the prompt (an older caller) the shortfall counts, as before.
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=0, now=1.0)
    assert router.belief.get(index) < 1.0


def test_a_dram_copy_a_busy_worker_could_not_reload_is_not_a_false_entry():
    # The index lists the prefix in the worker's DRAM, as it is: the worker reused less because
    # its VRAM was pinned by the requests ahead, which its queue estimate prices, not its belief.
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000, Tier.DRAM)
    router = Router(cfg, "us", view, now=0.0)
    index = layout.worker_index("us-1")
    assert router.explain_shortfall(PROMPT, index, 2000) == SHORTFALL_DRAM
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=0, now=1.0, tokens=PROMPT)
    assert router.belief.get(index) == 1.0 and router.explained_shortfalls[SHORTFALL_DRAM] == 1
    # A shorter claim the view does not back at all on another worker: evicted (never listed).
    assert router.explain_shortfall(PROMPT, layout.worker_index("us-2"), 1024) == SHORTFALL_EVICTED


def test_the_decisions_dram_tier_explains_a_shortfall_after_the_recompute_is_back_in_vram():
    # The daemon learns the reuse at the request's end: by then the worker's recompute of the
    # prompt is in the view again, in VRAM. The decision's tier still says what was claimed.
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000, Tier.DRAM)
    router = Router(cfg, "us", view, now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker == "us-1" and d.tier == Tier.DRAM and d.claimed_tokens == 2000
    _register(cfg, shards, view, "us-1", PROMPT, 2000, Tier.VRAM)
    index = layout.worker_index("us-1")
    assert router.explain_shortfall(PROMPT, index, 2000) is None  # the view alone: a VRAM entry not delivered
    assert router.explain_shortfall(None, index, 2000, Tier.DRAM) == SHORTFALL_DRAM  # no lookup needed
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=0, now=1.0, tokens=PROMPT, claimed_tier=d.tier)
    assert router.belief.get(index) == 1.0 and router.explained_shortfalls[SHORTFALL_DRAM] == 1
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=0, now=2.0, tokens=PROMPT, claimed_tier=Tier.VRAM)
    assert router.belief.get(index) < 1.0


def test_a_shortfall_the_view_still_contradicts_lowers_the_belief():
    # The view still lists the worker at the claimed length in VRAM (a keyless false hit, or an
    # eviction not yet propagated): that is what the belief discounts.
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 2000)
    router = Router(cfg, "us", view, now=0.0)
    index = layout.worker_index("us-1")
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=500, now=1.0, tokens=PROMPT)
    assert router.belief.get(index) == pytest.approx(1.0 - cfg.score.belief_weight * 0.75)
    assert sum(router.explained_shortfalls.values()) == 0
    # A full reuse is no shortfall: nothing to check, the belief recovers as before.
    router.on_response("us-1", claimed_tokens=2000, reused_tokens=2000, now=2.0, tokens=PROMPT)
    assert router.belief.get(index) > 1.0 - cfg.score.belief_weight * 0.75
    assert sum(router.explained_shortfalls.values()) == 0


def test_a_worker_other_edges_keep_busy_is_not_learned_slower():
    # us-0 is 2 s behind with other edges' work (its live reading) and prefills at the configured
    # 0.1 ms/token: every request this edge sends there comes back 2.1 s later. The decision
    # tells the rates what it estimated ahead, so the wait is not taken for prefill (it was
    # learned 16x too slow, the bound, and the score then priced us-0 out at any load).
    cfg, layout, shards, view = _world()
    router = Router(cfg, "us", view, now=0.0)
    w = layout.worker_index("us-0")
    others = [j for j in range(len(layout.worker_ids)) if j != w]
    prompt = PROMPT[:1000]
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 1.0
    for _ in range(8):
        router.queues.set_local("us-0", 2000.0, now=t)
        d = router.decide(prompt, now=t, exclude=others)
        router.on_first_token(d.dispatch, now=t + rtt + 2.1)
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=t + rtt + 2.1)
        t += 3.0
    assert router.rates.prefill_ms_per_token(w) == pytest.approx(0.1)
    # Found idle, the same worker teaches its rate (here 0.05 ms/token).
    for _ in range(8):
        router.queues.set_local("us-0", 0.0, now=t)
        d = router.decide(prompt, now=t, exclude=others)
        router.on_first_token(d.dispatch, now=t + rtt + 0.05)
        router.on_finished(d.dispatch, prompt_tokens=1000, cached_tokens=0, output_tokens=1, now=t + rtt + 0.05)
        t += 3.0
    assert router.rates.prefill_ms_per_token(w) == pytest.approx(0.05)


@pytest.mark.parametrize("native", [True, False])
def test_a_long_prompt_goes_where_its_kv_fits_not_to_an_idle_worker_whose_vram_is_pinned(native):
    # us-0 and us-2 are idle (queue 0) and hold nothing of the prompt, but us-0's running
    # requests pin all but 500 tokens of its VRAM until 1.2 s from now. The queue figure is that
    # of a prompt needing no new KV: by it the two tie and us-0, first in order, wins. Its
    # 2,000-token prompt would wait 1.2 s there for room (SGLang's PrefillAdder); us-2 has it.
    cfg, layout, shards, view = _world()
    router = Router(cfg, "us", view, now=0.0, native=native)
    router.queues.set_local("us-0", 0.0, now=0.0)
    router.queues.set_local("us-1", 500.0, now=0.0)
    router.queues.set_local("us-2", 0.0, now=0.0)
    router.queues.set_room("us-0", ((0.0, 500), (1200.0, 100_000)), now=0.0)
    d = router.decide(PROMPT, now=0.0)
    assert d.worker == "us-2"
    # A prompt that fits in the 500 free tokens waits for nothing there (us-2 now carries the
    # first one's charge).
    assert router.decide(PROMPT[:400], now=0.0).worker == "us-0"
    # The wait is counted from the reading: 1.19 s later us-0's room is 10 ms away, less than
    # the others' queues and the 40 ms round trip to eu.
    router.queues.set_local("us-1", 500.0, now=1.19)
    router.queues.set_local("us-2", 300.0, now=1.19)
    assert router.decide(PROMPT, now=1.19).worker == "us-0"


def test_a_long_prompt_is_not_sent_abroad_to_a_worker_whose_pinned_vram_only_its_own_region_saw():
    # Every us worker's running requests hold its VRAM for 0.5 s more; eu-0 and eu-1 look idle
    # (queue 0) 40 ms away, but theirs hold it for 1 s: what eu's edge broadcasts with its
    # queue vector (RoomVectorBroadcast). Knowing only its own region's room, the edge would
    # send the prompt abroad to wait longer there.
    cfg, layout, shards, view = _world()

    def edge() -> Router:
        # A new edge each time: one that sent PROMPT would credit its worker with it (pending ledger).
        router = Router(cfg, "us", view, now=0.0)
        for w in ("us-0", "us-1", "us-2"):
            router.queues.set_local(w, 0.0, now=0.0)
            router.queues.set_room(w, ((0.0, 500), (500.0, 100_000)), now=0.0)
        return router
    assert edge().decide(PROMPT, now=0.0).region == "eu"
    router = edge()
    pinned = ((0.0, 500), (1_020.0, 100_000))  # sent 20 ms (one way) before it is read
    assert router.queues.on_room_broadcast(RoomVectorBroadcast("eu", "us", 0.0, (("eu-0", pinned), ("eu-1", pinned))),
                                           now=0.02)
    assert router.decide(PROMPT, now=0.02).region == "us"


@pytest.mark.parametrize("native", [True, False])
def test_a_decode_stall_weight_prices_the_decodes_a_prefill_would_pause(native):
    # A prompt nobody holds, at beta 0.1: 200 ms of prefill anywhere. us-0 decodes 8 requests,
    # us-1 one behind a 20 ms queue, us-2 two. Without the weight the idle queues win (us-0 or
    # us-2, 200 ms); at 0.25 each prefill is priced at 1 + min(1, 0.25 x running): us-0 400 ms
    # (capped at twice, not 1 + 0.25 x 8 = 3 times), us-2 300, us-1 20 + 250: us-1 wins.
    def decide(**score):
        cfg, layout, shards, view = _world({"us": 3}, **score)
        router = Router(cfg, "us", view, now=0.0, native=native)
        for worker, queue, running in (("us-0", 0.0, 8), ("us-1", 20.0, 1), ("us-2", 0.0, 2)):
            router.queues.set_local(worker, queue, now=0.0, running=running)
        before = router.queues.queue_ms(now=0.0).copy()
        return router, before, router.decide(PROMPT, now=0.0)

    _, _, plain = decide()
    assert plain.worker in ("us-0", "us-2")
    router, before, d = decide(decode_stall_weight=0.25)
    assert d.worker == "us-1"
    prefill = {t.worker: t.prefill_ms / (1.0 + d.lam) for t in d.candidates}  # (lambda: us-1's short queue)
    assert prefill == pytest.approx({"us-0": 400.0, "us-1": 250.0, "us-2": 300.0})
    # The queue charged for the dispatch is the prefill's own time, not its price.
    charged = router.queues.queue_ms(now=0.0) - before
    assert charged[1] == pytest.approx(200.0) and charged[0] == charged[2] == 0.0


def test_a_remote_worker_is_priced_as_the_own_regions_least_busy_decoder():
    cfg, layout, shards, view = _world({"us": 2, "eu": 1}, decode_stall_weight=0.25)
    router = Router(cfg, "us", view, now=0.0)
    router.queues.set_local("us-0", 0.0, now=0.0, running=4)
    router.queues.set_local("us-1", 0.0, now=0.0, running=2)
    d = router.decide(PROMPT, now=0.0)
    prefill = {t.worker: t.prefill_ms / (1.0 + d.lam) for t in d.candidates}
    # us-0 1 + min(1, 1) = 2, us-1 1.5; eu-0 reads no running count: the region's floor, 1.5.
    assert prefill == pytest.approx({"us-0": 400.0, "us-1": 300.0, "eu-0": 300.0})
    # A reading that changes a count reprices the next decision; one that does not leaves it.
    router.queues.set_local("us-1", 0.0, now=0.0, running=0)
    d = router.decide(PROMPT, now=0.0)
    prefill = {t.worker: t.prefill_ms / (1.0 + d.lam) for t in d.candidates}
    assert prefill["us-1"] == pytest.approx(200.0) and prefill["eu-0"] == pytest.approx(200.0)


def test_a_learned_rate_is_priced_with_the_stalls_and_charged_without_them():
    cfg, layout, shards, view = _world({"us": 2}, decode_stall_weight=0.5)
    router = Router(cfg, "us", view, now=0.0)
    router.queues.set_local("us-0", 0.0, now=0.0, running=1)
    rng = np.random.default_rng(7)
    # Prompts nobody holds, one at a time, each first token 400 ms after its dispatch: 2,000
    # tokens at 0.2 ms, twice the configured rate, which the edge learns (the fleet's factor,
    # so for both workers).
    for n in range(8):
        now = float(n)
        d = router.decide(rng.integers(0, 30000, 2000, dtype=np.uint32), now=now)
        if n == 0:
            assert router.scorer.beta_list == pytest.approx((0.15, 0.1))  # the configured rates, us-0 priced
        queued = router.queues.queue_ms(now=now).item(d.worker_index)
        router.on_first_token(d.dispatch, now=now + 0.4)
        router.on_finished(d.dispatch, prompt_tokens=2000, cached_tokens=0, output_tokens=1, now=now + 0.4)
    assert router.rates.prefill_rates() == pytest.approx([0.2, 0.2], rel=0.01)
    assert router.scorer.beta_list == pytest.approx((0.3, 0.2), rel=0.01)
    # The last dispatch was charged its prefill at the rate learned then, without the price.
    assert queued == pytest.approx(0.2 * 2000 + cfg.score.occupancy_ms_per_running * (d.worker == "us-0"), rel=0.01)
