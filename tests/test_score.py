"""Joint score: hand-computed decisions on the testbed, lambda, ablations, and a scalar reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.ablation import Ablation
from kvcompassd.core.config import ClusterConfig, ScoreParams, load_config
from kvcompassd.core.events import Tier
from kvcompassd.core.score import JointScorer, NoEligibleWorkerError, ScoreInputError

TESTBED = Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml"
CFG = load_config(TESTBED)
N = len(CFG.workers)  # us-0..7 = 0..7, eu-0..1 = 8..9, asia-0..3 = 10..13
BETA, GAMMA = 0.085, 0.00524
US0, US1, EU0, ASIA0 = 0, 1, 8, 10


def inputs(queue: float = 0.0):
    return (np.zeros(N, np.int64), np.zeros(N, np.uint8), np.full(N, queue), np.ones(N))


def test_idle_recomputing_worker_beats_a_loaded_holder() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs(queue=1000.0)
    matched[US0], tier[US0], queue[US0] = 2048, Tier.VRAM, 500.0
    queue[US1] = 0.0
    result = scorer.score(2048, matched, tier, queue, belief)
    # lambda = min queue / tau = 0; holder: 0.5 + 500 + 0 = 500.5; idle: 0.5 + 0 + 0.085 * 2048 = 174.58
    assert result.lam == 0.0
    assert result.worker == "us-1"
    assert result.total == pytest.approx(0.5 + BETA * 2048)
    assert result.scores[US0] == pytest.approx(500.5)


def test_lightly_loaded_holder_beats_idle_recompute() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs(queue=1000.0)
    matched[US0], tier[US0], queue[US0] = 2048, Tier.VRAM, 100.0
    queue[US1] = 0.0
    result = scorer.score(2048, matched, tier, queue, belief)
    assert result.worker == "us-0" and result.total == pytest.approx(100.5)
    assert result.scores[US1] == pytest.approx(174.58)


def test_capacity_price_shifts_the_choice_to_the_holder_at_saturation() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs(queue=300.0)
    matched[US0], tier[US0], queue[US0] = 2048, Tier.VRAM, 600.0
    result = scorer.score(2048, matched, tier, queue, belief)
    # lambda = 300 / 100 = 3; recompute at us-1: 0.5 + 300 + 4 * 0.085 * 2048 = 996.82 > 600.5
    assert result.lam == pytest.approx(3.0)
    assert result.scores[US1] == pytest.approx(0.5 + 300 + 4 * BETA * 2048)
    assert result.worker == "us-0"
    # Without the price the recompute would win: 0.5 + 300 + 174.08 = 474.58 < 600.5.
    assert 0.5 + 300 + BETA * 2048 < 600.5


def test_lambda_is_capped() -> None:
    scorer = JointScorer(CFG, "us")
    cap = CFG.score.lambda_max
    queue_ms = 2 * cap * CFG.score.tau_ms  # lambda_q = 2 x the cap
    matched, tier, queue, belief = inputs(queue=queue_ms)
    result = scorer.score(100, matched, tier, queue, belief)
    assert result.lam == cap
    assert result.total == pytest.approx(0.5 + queue_ms + (1 + cap) * BETA * 100)


def test_dram_reload_is_charged_unless_tier_blind() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs(queue=1000.0)
    matched[US0], tier[US0], queue[US0] = 2048, Tier.DRAM, 0.0
    matched[US1], tier[US1], queue[US1] = 2048, Tier.VRAM, 5.0
    result = scorer.score(2048, matched, tier, queue, belief)
    # us-0: 0.5 + 0 + 0 + 0.00524 * 2048 = 11.23; us-1: 0.5 + 5 = 5.5
    assert result.scores[US0] == pytest.approx(0.5 + GAMMA * 2048)
    assert result.worker == "us-1"
    blind = scorer.score(2048, matched, tier, queue, belief, ablation=Ablation.without("tier_aware"))
    assert blind.worker == "us-0" and blind.total == pytest.approx(0.5)


def test_remote_holder_wins_when_the_match_pays_for_the_round_trip() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs()
    matched[EU0], tier[EU0] = 4096, Tier.VRAM
    result = scorer.score(4096, matched, tier, queue, belief)
    # eu-0: 320 + 0 = 320; any us worker: 0.5 + 0.085 * 4096 = 348.66
    assert result.worker == "eu-0" and result.total == pytest.approx(320.0)
    # No cross-region reuse: remote workers are out; a local recompute wins.
    local = scorer.score(4096, matched, tier, queue, belief, ablation=Ablation.without("cross_region"))
    assert local.worker == "us-0" and local.total == pytest.approx(0.5 + BETA * 4096)
    assert not np.isfinite(local.scores[EU0])
    # A low belief discounts the claim: 320 + 0.085 * 2048 = 494.08 > 348.66.
    belief[EU0] = 0.5
    doubted = scorer.score(4096, matched, tier, queue, belief)
    assert doubted.worker == "us-0"
    assert doubted.scores[EU0] == pytest.approx(320 + BETA * 2048)


def test_one_way_wan_setting() -> None:
    cfg = ClusterConfig(name=CFG.name, model=CFG.model, regions=CFG.regions, workers=CFG.workers,
                        links=CFG.links, score=ScoreParams(wan="one_way"))
    scorer = JointScorer(cfg, "asia")
    assert scorer.wan_ms[EU0] == 149.0 and scorer.wan_ms[US0] == 126.0 and scorer.wan_ms[ASIA0] == 0.25
    assert JointScorer(CFG, "asia").wan_ms[EU0] == 298.0


def test_no_load_awareness_ignores_queues_and_lambda() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs(queue=1000.0)
    matched[US0], tier[US0], queue[US0] = 2048, Tier.VRAM, 500.0
    queue[US1] = 0.0
    result = scorer.score(2048, matched, tier, queue, belief, ablation=Ablation.without("load_aware"))
    assert result.lam == 0.0 and result.worker == "us-0" and result.total == pytest.approx(0.5)
    assert result.top(1)[0].queue_ms == 0.0


def test_top_terms_add_up_and_are_ordered() -> None:
    scorer = JointScorer(CFG, "eu")
    matched, tier, queue, belief = inputs(queue=20.0)
    matched[US0], tier[US0] = 3776, Tier.DRAM
    belief[US0] = 0.9
    result = scorer.score(5000, matched, tier, queue, belief)
    top = result.top(4)
    assert len(top) == 4 and top[0].worker == result.worker
    assert [t.total for t in top] == sorted(t.total for t in top)
    for terms in top:
        assert terms.total == pytest.approx(terms.wan_ms + terms.queue_ms + terms.prefill_ms + terms.reload_ms)
    us0 = result.terms(US0)
    assert us0.tier is Tier.DRAM and us0.matched == 3776 and us0.belief == 0.9
    assert us0.reload_ms == pytest.approx(GAMMA * 0.9 * 3776)
    assert us0.prefill_ms == pytest.approx((1 + 0.2) * BETA * (5000 - 0.9 * 3776))


def test_eligibility_and_bad_inputs() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs()
    eligible = np.zeros(N, bool)
    eligible[ASIA0] = True
    assert scorer.score(10, matched, tier, queue, belief, eligible=eligible).worker == "asia-0"
    with pytest.raises(NoEligibleWorkerError):
        scorer.score(10, matched, tier, queue, belief, eligible=np.zeros(N, bool))
    with pytest.raises(ScoreInputError, match="matched"):
        scorer.score(10, matched[:3], tier, queue, belief)
    with pytest.raises(ScoreInputError, match="queue_ms"):
        scorer.score(10, matched, tier, list(queue), belief)  # type: ignore[arg-type]
    with pytest.raises(ScoreInputError, match="prompt_len"):
        scorer.score(-1, matched, tier, queue, belief)
    with pytest.raises(ScoreInputError, match="prompt_len"):
        scorer.score(1.5, matched, tier, queue, belief)  # type: ignore[arg-type]
    with pytest.raises(ScoreInputError):
        JointScorer(CFG, "mars")
    result = scorer.score(10, matched, tier, queue, belief)
    with pytest.raises(AttributeError):
        result.worker = "x"  # type: ignore[misc]


def reference_scores(scorer: JointScorer, L, matched, tier, queue, belief, ablation: Ablation):
    """The paper's formula, one worker at a time."""
    q = [float(x) if ablation.load_aware else 0.0 for x in queue]
    lam = min(CFG.score.lambda_max, min(q) / CFG.score.tau_ms) if ablation.load_aware else 0.0
    has_local = any(w.region == scorer.origin_region for w in CFG.workers)
    out = []
    for r, worker in enumerate(CFG.workers):
        local = worker.region == scorer.origin_region
        if not ablation.cross_region and not local and has_local:
            out.append(float("inf"))
            continue
        m = 0 if (not ablation.cross_region and not local) else int(matched[r])
        e = min(float(belief[r]) * m, L)
        wan = CFG.rtt_ms(scorer.origin_region, worker.region)
        reload = GAMMA * e if (ablation.tier_aware and tier[r] == Tier.DRAM) else 0.0
        out.append(wan + q[r] + (1 + lam) * worker.prefill_ms_per_token * (L - e) + reload)
    return out, lam


@settings(max_examples=200, deadline=None)
@given(
    origin=st.sampled_from(["us", "eu", "asia"]),
    L=st.integers(0, 20000),
    data=st.data(),
    ablation=st.builds(Ablation, st.booleans(), st.booleans(), st.booleans(), st.booleans()),
)
def test_vectorised_score_equals_the_scalar_formula(origin, L, data, ablation) -> None:
    scorer = JointScorer(CFG, origin)
    matched = np.array(data.draw(st.lists(st.integers(0, L), min_size=N, max_size=N)), dtype=np.int64)
    tier = np.array([0 if m == 0 else data.draw(st.sampled_from([1, 2])) for m in matched], dtype=np.uint8)
    queue = np.array(data.draw(st.lists(st.floats(0, 3000), min_size=N, max_size=N)))
    belief = np.array(data.draw(st.lists(st.floats(0, 1), min_size=N, max_size=N)))
    result = scorer.score(L, matched, tier, queue, belief, ablation=ablation)
    expected, lam = reference_scores(scorer, L, matched, tier, queue, belief, ablation)
    assert result.lam == pytest.approx(lam)
    np.testing.assert_allclose(result.scores, expected, rtol=1e-9, atol=1e-6)
    best = min(expected)
    assert expected[result.chosen] <= best + 1e-6
    for terms in result.top(3):
        assert terms.total == pytest.approx(terms.wan_ms + terms.queue_ms + terms.prefill_ms + terms.reload_ms)


def test_ablation_switches() -> None:
    assert Ablation().disabled == ()
    assert Ablation.without("tier_aware", "migration").disabled == ("tier_aware", "migration")
    with pytest.raises(ValueError, match="unknown mechanism"):
        Ablation.without("magic")
    with pytest.raises(ValueError):
        Ablation(load_aware=1)  # type: ignore[arg-type]


def test_an_invalid_tier_code_is_not_charged_and_does_not_crash() -> None:
    scorer = JointScorer(CFG, "us")
    matched, tier, queue, belief = inputs()
    matched[US0], tier[US0] = 64, 3  # the 2-bit field 11 is never written
    result = scorer.score(64, matched, tier, queue, belief)
    assert result.scores[US0] == pytest.approx(0.5)
    assert result.terms(US0).tier is Tier.ABSENT and result.terms(US0).reload_ms == 0.0


@pytest.mark.parametrize("workers", [3, 40])  # an edge's few workers (checked in Python), many (numpy)
def test_set_prefill_rates_refuses_what_is_not_a_rate_and_keeps_the_old_ones(workers):
    from clusters import make_cluster

    cfg = make_cluster({"us": workers - 1, "eu": 1})
    scorer = JointScorer(cfg, "us")
    good = np.linspace(0.05, 0.2, workers)
    assert scorer.set_prefill_rates(good) is True
    assert scorer.beta_list == tuple(good.tolist())
    assert scorer.set_prefill_rates(good.copy()) is False  # the same rates: nothing to redo
    for bad in (np.nan, np.inf, 0.0, -0.1):
        rates = good.copy()
        rates[workers // 2] = bad
        with pytest.raises(ScoreInputError):
            scorer.set_prefill_rates(rates)
        assert scorer.beta_list == tuple(good.tolist())
    with pytest.raises(ScoreInputError):
        scorer.set_prefill_rates(good[:-1])
