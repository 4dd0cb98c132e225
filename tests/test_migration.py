"""Hot-prefix detection: the two triggers, the window, cooldown, destinations, bounds, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.ablation import Ablation
from kvcompassd.core.config import load_config
from kvcompassd.core.events import Tier
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.migration import DecisionObserved, HotPrefixDetector, MigrationInputError, MigrationPlanned
from kvcompassd.core.queues import QueueEstimates

CFG = load_config(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml")
PLAN = LevelPlan.from_config(CFG)
FAMILY = 12345
N1_ASIA_TO_US = 2976  # 252 ms / 0.085 ms/token, block-aligned


def asia_edge(*, ablation: Ablation = Ablation(), idle: tuple[str, ...] = ("asia-2", "asia-3"), **kw):
    queues = QueueEstimates(CFG, "asia", now=0.0)
    for worker in ("asia-0", "asia-1", "asia-2", "asia-3"):
        queues.set_local(worker, 0.0 if worker in idle else 50.0, now=0.0)
    return HotPrefixDetector(CFG, "asia", PLAN, queues=queues, ablation=ablation, **kw), queues


def remote_miss(matched: int = N1_ASIA_TO_US, *, family: int = FAMILY, chosen: str = "us-0",
                prompt_len: int = 4000) -> DecisionObserved:
    return DecisionObserved(family, prompt_len, chosen, (), ("us-0", "us", matched), False)


def test_no_local_holder_and_a_worthwhile_remote_match_triggers_a_recompute() -> None:
    hot, _ = asia_edge()
    assert hot.observe(remote_miss(), now=10.0) is None
    assert hot.observe(remote_miss(), now=10.3) is None
    plan = hot.observe(remote_miss(), now=10.6)
    # The prompt's own prefix, all of it: the index's longest level within 4000 tokens (3776)
    # is only what the edge could see of the holder's match.
    assert plan == MigrationPlanned(FAMILY, 4000, "us-0", "asia-2", "recompute")
    assert plan.tier is Tier.DRAM


def test_remote_match_below_the_first_level_does_not_trigger() -> None:
    hot, _ = asia_edge()
    for t in (1.0, 1.1, 1.2, 1.3):
        assert hot.observe(remote_miss(N1_ASIA_TO_US - 16), now=t) is None


def test_misses_must_fall_within_the_window() -> None:
    hot, _ = asia_edge()
    assert hot.observe(remote_miss(), now=5.0) is None
    assert hot.observe(remote_miss(), now=5.6) is None
    assert hot.observe(remote_miss(), now=6.2) is None  # 5.0 fell out of the 1 s window
    assert hot.observe(remote_miss(), now=6.3) is not None  # 5.6, 6.2, 6.3


def test_local_hits_do_not_count() -> None:
    hot, _ = asia_edge()
    hit = DecisionObserved(FAMILY, 4000, "asia-0", (("asia-0", 2048),), None, False)
    for t in (1.0, 1.1, 1.2, 1.3):
        assert hot.observe(hit, now=t) is None
    assert len(hot) == 0


def test_holders_losing_to_load_trigger_a_copy_from_the_longest_holder() -> None:
    hot, _ = asia_edge()
    lost = DecisionObserved(FAMILY, 4000, "us-1", (("asia-0", 1024), ("asia-1", 2048)), None, True)
    assert hot.observe(lost, now=1.0) is None
    assert hot.observe(lost, now=1.1) is None
    assert hot.observe(lost, now=1.2) == MigrationPlanned(FAMILY, 2048, "asia-1", "asia-2", "copy")


def test_holders_that_did_not_lose_to_load_do_not_trigger() -> None:
    hot, _ = asia_edge()
    # A local miss (remote winner) but the holders lost on something else than load.
    miss = DecisionObserved(FAMILY, 4000, "us-1", (("asia-0", 1024),), ("us-1", "us", 3776), False)
    for t in (1.0, 1.1, 1.2, 1.3):
        assert hot.observe(miss, now=t) is None


def test_destination_is_idle_not_a_holder_and_not_the_chosen_worker() -> None:
    hot, queues = asia_edge(idle=("asia-0", "asia-2"))
    queues.set_local("asia-2", 0.0, now=0.0)
    lost = DecisionObserved(FAMILY, 4000, "asia-2", (("asia-0", 1024),), None, True)
    for t in (2.0, 2.1):
        hot.observe(lost, now=t)
    # asia-0 is idle but holds it; asia-2 is idle but serves this request: nobody left.
    assert hot.observe(lost, now=2.2) is None
    queues.set_local("asia-3", 0.0, now=0.5)
    assert hot.observe(lost, now=2.3) == MigrationPlanned(FAMILY, 1024, "asia-0", "asia-3", "copy")


def test_no_idle_worker_means_no_plan_until_one_is_idle_long_enough() -> None:
    hot, queues = asia_edge(idle=())
    for t in (1.0, 1.1):
        assert hot.observe(remote_miss(), now=t) is None
    queues.set_local("asia-3", 0.0, now=1.1)
    assert hot.observe(remote_miss(), now=1.2) is None  # hot, but asia-3 idle for only 0.1 s
    assert hot.observe(remote_miss(), now=1.5) is None
    plan = hot.observe(remote_miss(), now=2.15)  # misses 1.2, 1.5, 2.15; asia-3 idle for 1.05 s
    assert plan is not None and plan.destination_worker == "asia-3"


def test_cooldown_keeps_a_family_from_migrating_again() -> None:
    hot, _ = asia_edge(cooldown_ms=3000.0)
    for t in (1.0, 1.1):
        hot.observe(remote_miss(), now=t)
    assert hot.observe(remote_miss(), now=1.2) is not None
    for t in (1.3, 1.4, 1.5, 3.5, 4.1):
        assert hot.observe(remote_miss(), now=t) is None
    assert hot.observe(remote_miss(), now=4.25) is not None  # cooldown over at 4.2; 3.5, 4.1, 4.25 in window


def test_ablations_disable_planning() -> None:
    off, _ = asia_edge(ablation=Ablation.without("migration"))
    no_remote, _ = asia_edge(ablation=Ablation.without("cross_region"))
    for t in (1.0, 1.1, 1.2, 1.3):
        assert off.observe(remote_miss(), now=t) is None
        assert no_remote.observe(remote_miss(), now=t) is None
    assert len(off) == 0


def test_tracked_families_are_bounded() -> None:
    hot, _ = asia_edge(max_families=2)
    for family in (1, 2, 3):
        hot.observe(remote_miss(family=family), now=1.0)
    assert len(hot) == 2
    # Family 1 was evicted: two more misses are not enough to reach H = 3 again.
    for t in (1.1, 1.2):
        assert hot.observe(remote_miss(family=1), now=t) is None


@pytest.mark.parametrize(
    "build",
    [
        lambda: DecisionObserved(-1, 10, "asia-0"),
        lambda: DecisionObserved(2**63, 10, "asia-0"),
        lambda: DecisionObserved(1, -1, "asia-0"),
        lambda: DecisionObserved(1, 10, ""),
        lambda: DecisionObserved(1, 10, "asia-0", (("asia-1",),)),  # type: ignore[arg-type]
        lambda: DecisionObserved(1, 10, "asia-0", (("asia-1", 11),)),
        lambda: DecisionObserved(1, 10, "asia-0", (), ("us-0", "us")),  # type: ignore[arg-type]
        lambda: DecisionObserved(1, 10, "asia-0", (), ("us-0", "us", 20)),
        lambda: DecisionObserved(1, 10, "asia-0", (), None, 1),  # type: ignore[arg-type]
        lambda: MigrationPlanned(1, 0, "a", "b", "copy"),
        lambda: MigrationPlanned(1, 16, "a", "a", "copy"),
        lambda: MigrationPlanned(1, 16, "a", "b", "teleport"),
        lambda: MigrationPlanned(1, 16, "a", "b", "copy", Tier.ABSENT),
    ],
)
def test_malformed_messages_are_rejected(build) -> None:
    with pytest.raises(MigrationInputError):
        build()


def test_decisions_naming_workers_of_the_wrong_region_are_rejected() -> None:
    hot, _ = asia_edge()
    with pytest.raises(MigrationInputError, match="not a worker of region 'asia'"):
        hot.observe(DecisionObserved(1, 100, "us-0", (("us-1", 64),), None, True), now=1.0)
    with pytest.raises(MigrationInputError, match="remote region"):
        hot.observe(DecisionObserved(1, 4000, "us-0", (), ("asia-1", "asia", 2976), False), now=1.0)
    with pytest.raises(MigrationInputError, match="unknown chosen worker"):
        hot.observe(DecisionObserved(1, 100, "ghost", (), None, False), now=1.0)
    with pytest.raises(MigrationInputError):
        HotPrefixDetector(CFG, "eu", PLAN, queues=QueueEstimates(CFG, "asia", now=0.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 0.6), min_size=1, max_size=25))
def test_plans_need_three_misses_within_the_window_and_respect_cooldown(gaps: list[float]) -> None:
    hot, _ = asia_edge(cooldown_ms=2000.0)
    now, times, last_plan = 100.0, [], None
    for gap in gaps:
        now += gap
        times.append(now)
        plan = hot.observe(remote_miss(), now=now)
        if plan is not None:
            assert sum(1 for t in times if now - t <= 1.0) >= 3
            assert last_plan is None or now - last_plan >= 2.0
            last_plan = now
            times = []  # counting restarts after a plan


def test_hot_misses_are_counted_by_trigger_and_outcome() -> None:
    """Each local miss that finds its family hot says what came of it: the operator's reason
    for a fleet that migrates nothing."""
    hot, queues = asia_edge(idle=())
    for t in (1.0, 1.1, 1.2, 1.3):  # hot from the third miss on; nothing abroad worth the detour
        hot.observe(remote_miss(N1_ASIA_TO_US - 16, family=1), now=t)
    for t in (1.0, 1.1, 1.2):  # hot, worth it, but no idle destination
        hot.observe(remote_miss(family=2), now=t)
    lost = DecisionObserved(3, 4000, "us-1", (("asia-0", 1024),), None, True)
    for t in (1.0, 1.1, 1.2):  # holders lost to load, nowhere to copy to
        hot.observe(lost, now=t)
    queues.set_local("asia-3", 0.0, now=0.0)
    hot.observe(remote_miss(family=2), now=1.3)  # asia-3 idle since 0.0: planned
    counts = {k: v for k, v in hot.hot_misses.items() if v}
    assert counts == {("recompute", "no_remote_match"): 2, ("recompute", "no_idle_worker"): 1,
                      ("copy", "no_idle_worker"): 1, ("recompute", "planned"): 1}
    hot.note_unplanned("copy", "no_idle_worker")
    assert hot.hot_misses["copy", "no_idle_worker"] == 2
    for bad in (("copy", "planned"), ("move", "no_idle_worker"), ("copy", "busy")):
        with pytest.raises(MigrationInputError):
            hot.note_unplanned(*bad)
