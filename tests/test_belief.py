"""Cache belief: EWMA of reused/claimed, clipped, no evidence from zero claims, snapshots."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.belief import BeliefError, CacheBelief


def test_ewma_of_reused_over_claimed() -> None:
    belief = CacheBelief(3, weight=0.2)
    assert belief.values.tolist() == [1.0, 1.0, 1.0]
    assert belief.observe(1, claimed_tokens=1000, reused_tokens=0) == pytest.approx(0.8)
    assert belief.observe(1, claimed_tokens=1000, reused_tokens=500) == pytest.approx(0.8 * 0.8 + 0.2 * 0.5)
    assert belief.get(0) == 1.0 and belief.get(2) == 1.0


def test_ratio_is_clipped_and_zero_claims_carry_no_evidence() -> None:
    belief = CacheBelief(2, weight=0.5, initial=0.5)
    assert belief.observe(0, claimed_tokens=100, reused_tokens=400) == pytest.approx(0.75)  # ratio clipped to 1
    assert belief.observe(1, claimed_tokens=0, reused_tokens=300) == 0.5


def test_snapshots_are_immutable() -> None:
    belief = CacheBelief(2, weight=0.5)
    snapshot = belief.values
    belief.observe(0, 10, 0)
    assert snapshot[0] == 1.0 and belief.values[0] == 0.5
    with pytest.raises(ValueError):
        snapshot[0] = 0.0
    belief.reset(0)
    assert belief.get(0) == 1.0


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.observe(2, 1, 1),
        lambda b: b.observe(-1, 1, 1),
        lambda b: b.observe(0, -1, 1),
        lambda b: b.observe(0, 1, -1),
        lambda b: b.observe(0, 1.5, 1),
        lambda b: b.observe(True, 1, 1),
        lambda b: b.get(5),
        lambda b: b.reset(0, 1.5),
    ],
)
def test_bad_arguments_are_rejected(call) -> None:
    with pytest.raises(BeliefError):
        call(CacheBelief(2, weight=0.5))


@pytest.mark.parametrize("kwargs", [dict(n_workers=-1, weight=0.5), dict(n_workers=2, weight=0.0),
                                    dict(n_workers=2, weight=1.5), dict(n_workers=2, weight=math.nan),
                                    dict(n_workers=2, weight=0.5, initial=2.0)])
def test_bad_construction_is_rejected(kwargs) -> None:
    with pytest.raises(BeliefError):
        CacheBelief(**kwargs)


@settings(max_examples=150, deadline=None)
@given(st.floats(0.01, 1.0), st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 8000)), max_size=40))
def test_matches_reference_and_stays_in_unit_interval(weight: float, responses) -> None:
    belief = CacheBelief(1, weight=weight)
    expected = 1.0
    for claimed, reused in responses:
        belief.observe(0, claimed, reused)
        if claimed:
            expected = (1 - weight) * expected + weight * min(1.0, reused / claimed)
    assert belief.get(0) == pytest.approx(expected)
    assert 0.0 <= belief.get(0) <= 1.0
    assert isinstance(belief.values, np.ndarray) and belief.values.dtype == np.float64
