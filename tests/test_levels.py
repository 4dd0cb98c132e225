"""Latency-derived levels: the testbed's n1 by hand, block alignment, monotonicity, the union."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.config import ClusterConfig, IndexParams, LinkConfig, RegionConfig, WorkerConfig, load_config
from kvcompassd.core.levels import (LevelError, LevelPlan, bridged_lengths, filled_lengths, long_lengths, refined_lengths,
                                     remote_lengths)

TESTBED = Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml"


def doublings_only_testbed() -> ClusterConfig:
    """The testbed without its own-region fill (same_region_max_step 2) and within the paper's
    reach (context_tokens 16384: no long lengths): the hand-computed lengths below are the
    doublings and the refinement; the fill and the long lengths have their own tests."""
    cfg = load_config(TESTBED)
    return dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, same_region_max_step=2.0,
                                                              context_tokens=16384))


def test_testbed_first_lengths_by_hand() -> None:
    plan = LevelPlan.from_config(doublings_only_testbed())
    # US-EU: RTT 320 ms / 0.085 ms/token = 3764.7 -> 3765 -> next multiple of 16 = 3776.
    assert plan.lengths_toward("us", "eu") == (3776, 5664, 7552, 9440, 11328, 13216)
    # US-Asia: 252 / 0.085 = 2964.7 -> 2965 -> 2976; EU-Asia: 298 / 0.085 = 3505.9 -> 3506 -> 3520.
    assert plan.lengths_toward("asia", "us")[0] == 2976
    assert plan.lengths_toward("eu", "asia")[:3] == (3520, 5280, 7040)
    assert plan.lengths_toward("eu", "us") == plan.lengths_toward("us", "eu")  # symmetric links
    # Own region: doubling from 64 for six levels, and on until the longest remote length is
    # reached (13216 from us and eu, 12320 from asia), so a local holder is never under-credited;
    # between the doublings, the registered remote lengths at least 1.25x the last one read
    # (after 2048: 2976 >= 2560; then 3520 < 3720 is skipped, 3776 read; 4096 doubles; ...).
    doubling = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    for region in ("us", "eu", "asia"):
        assert plan.lengths_toward(region, region) == (
            64, 128, 256, 512, 1024, 2048, 2976, 3776, 4096, 5280, 7040, 8192, 10416, 13216, 16384)
    assert plan.first_length_toward("us", "eu") == 3776
    # same_region_growth = 2: the doublings only, as in the paper.
    cfg = doublings_only_testbed()
    paper = LevelPlan.from_config(dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, same_region_growth=2.0)))
    assert all(paper.lengths_toward(r, r) == doubling for r in ("us", "eu", "asia"))
    assert paper.registration_lengths() == plan.registration_lengths()  # refining registers nothing new


def test_registration_is_the_sorted_union() -> None:
    plan = LevelPlan.from_config(doublings_only_testbed())
    union = set()
    for o in ("us", "eu", "asia"):
        for g in ("us", "eu", "asia"):
            union.update(plan.lengths_toward(o, g))
    assert plan.registration_lengths() == tuple(sorted(union))
    assert len(plan.registration_lengths()) == 9 + 3 * 6  # own-region doubling to 16384, three remote pairs
    assert plan.registration_lengths_upto(4000) == (64, 128, 256, 512, 1024, 2048, 2976, 3520, 3776)
    assert plan.registration_lengths_upto(10) == ()
    assert plan.max_length == 16384
    assert plan.lengths_toward_upto("us", "eu", 6000) == (3776, 5664)


def test_unknown_pair_is_rejected() -> None:
    plan = LevelPlan.from_config(load_config(TESTBED))
    with pytest.raises(LevelError):
        plan.lengths_toward("us", "mars")


def test_one_block_n1_stays_strictly_increasing() -> None:
    # n1 = one block: 1.5 and 2 blocks would round to the same length; the plan bumps it.
    assert remote_lengths(0.0, 0.1, 16, 5) == (16, 32, 48, 64, 80)
    assert remote_lengths(1.6, 0.1, 16, 4) == (16, 32, 48, 64)


def test_slowest_worker_sets_beta_and_empty_regions_have_no_levels() -> None:
    workers = (
        WorkerConfig("a0", "a", 0.1, 10.0, 1, 1),
        WorkerConfig("b0", "b", 0.05, 10.0, 1, 1),
        WorkerConfig("b1", "b", 0.2, 10.0, 1, 1),
    )
    cfg = ClusterConfig(
        name="c", model="m",
        regions=(RegionConfig("a"), RegionConfig("b"), RegionConfig("c")),
        workers=workers,
        links=(LinkConfig(("a", "b"), 50.0), LinkConfig(("a", "c"), 5.0), LinkConfig(("b", "c"), 5.0)),
    )
    plan = LevelPlan.from_config(cfg)
    assert plan.lengths_toward("a", "b")[0] == 512  # 100 ms / 0.2 = 500 -> 512
    assert plan.lengths_toward("a", "c") == ()  # region c has no workers
    assert plan.lengths_toward("c", "a")[0] == 112  # 10 ms / 0.1 = 100 -> 112


@settings(max_examples=150, deadline=None)
@given(
    rtt=st.floats(0.0, 1000.0),
    beta=st.floats(0.001, 2.0),
    block=st.sampled_from([1, 8, 16, 32, 64, 256]),
    levels=st.integers(1, 12),
)
def test_remote_lengths_are_block_aligned_increasing_and_profitable(rtt, beta, block, levels) -> None:
    lengths = remote_lengths(rtt, beta, block, levels)
    assert len(lengths) == levels
    assert all(c % block == 0 and c > 0 for c in lengths)
    assert all(b > a for a, b in zip(lengths, lengths[1:]))
    n1 = lengths[0]
    # n1 saves at least the round trip, and one block less would not (unless n1 is one block).
    assert n1 * beta >= rtt - 1e-6
    assert n1 == block or (n1 - block) * beta < rtt + 1e-6
    # Equal steps of n1/2, each rounded up to a block (bumped only when rounding collides).
    for k, c in enumerate(lengths):
        assert c >= math.ceil(n1 * (2 + k) / 2)


@settings(max_examples=50, deadline=None)
@given(min_tokens=st.sampled_from([16, 32, 64, 128]), levels=st.integers(1, 8))
def test_same_region_lengths_double(min_tokens, levels) -> None:
    cfg = load_config(TESTBED)
    # Doublings only, within the paper's reach (a context shorter than every length adds none).
    index = IndexParams(same_region_min_tokens=min_tokens, levels=levels, same_region_growth=2.0, context_tokens=16)
    cfg = ClusterConfig(name=cfg.name, model=cfg.model, regions=cfg.regions, workers=cfg.workers,
                        links=cfg.links, index=index)
    plan = LevelPlan.from_config(cfg)
    own = plan.lengths_toward("eu", "eu")
    # Doubling, at least `levels` of them, and just far enough to reach the longest remote length.
    assert own == tuple(min_tokens * 2**k for k in range(len(own))) and len(own) >= levels
    longest_remote = max(plan.lengths_toward("eu", g)[-1] for g in ("us", "asia"))
    assert own[-1] >= longest_remote and (len(own) == levels or own[-2] < longest_remote)
    assert all(len(plan.lengths_toward(o, g)) == levels for o in ("us", "eu") for g in ("asia", "us") if o != g)


@settings(max_examples=150, deadline=None)
@given(
    registered=st.sets(st.integers(1, 4096).map(lambda n: 16 * n), max_size=60),
    levels=st.integers(1, 10),
    growth=st.floats(1.01, 2.0),
)
def test_refined_own_lengths_keep_the_doublings_and_add_only_registered_ones(
        registered: set[int], levels: int, growth: float) -> None:
    doubling = tuple(64 << k for k in range(levels))
    union = sorted(registered | set(doubling))
    refined = refined_lengths(doubling, union, growth)
    assert set(doubling) <= set(refined) <= set(union)
    assert list(refined) == sorted(set(refined))  # strictly increasing
    for prev, length in zip(refined, refined[1:]):
        assert length in doubling or length >= prev * growth
    assert refined[0] == doubling[0]  # nothing below the own-region minimum
    # Greedy: every registered length skipped below the top was too close to the one before it.
    for length in union:
        if doubling[0] < length <= doubling[-1] and length not in refined:
            assert length < max(c for c in refined if c < length) * growth


def test_max_step_fills_the_bare_doublings_and_registers_them() -> None:
    base = LevelPlan.from_config(doublings_only_testbed())
    cfg = load_config(TESTBED)  # same_region_max_step = 1.25
    plan = LevelPlan.from_config(dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, context_tokens=16384)))
    # The testbed registers nothing below its first remote length (2976), so each doubling up
    # to 2048 is split into four steps of 2^(1/4) = 1.19 (block-aligned: 64 -> 80 -> 96 -> 112
    # -> 128), and every gap above wider than 1.25 into the fewest equal steps (2048 -> 2976 in
    # two, 2976 -> 3776 is 1.27: two, ...).
    own = (64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 368, 432, 512, 624, 736, 864, 1024, 1232, 1456, 1728,
           2048, 2480, 2976, 3360, 3776, 4096, 4656, 5280, 6112, 7040, 8192, 9248, 10416, 11744, 13216, 16384)
    for region in ("us", "eu", "asia"):
        assert plan.lengths_toward(region, region) == own
        assert all(b <= -(-math.ceil(a * 1.25) // 16) * 16 for a, b in zip(own, own[1:]))  # 1.25, block-aligned
        for target in ("us", "eu", "asia"):
            if target != region:  # remote lengths are latency-derived: untouched
                assert plan.lengths_toward(region, target) == base.lengths_toward(region, target)
    added = set(own) - set(base.lengths_toward("us", "us"))
    assert set(plan.registration_lengths()) == set(base.registration_lengths()) | added


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.sets(st.integers(1, 4096).map(lambda n: 16 * n), min_size=1, max_size=30),
    max_step=st.floats(1.1, 2.0),
)
def test_filled_lengths_keep_every_length_and_close_every_gap(lengths: set[int], max_step: float) -> None:
    given_lengths = tuple(sorted(lengths))
    filled = filled_lengths(given_lengths, max_step, 16)
    assert set(given_lengths) <= set(filled) and list(filled) == sorted(set(filled))
    assert all(c % 16 == 0 for c in filled)
    if max_step >= 2.0:  # 2: off
        assert filled == given_lengths
        return
    for a, b in zip(filled, filled[1:]):
        # The next length is no further than one step (rounded up to the block) above the last.
        assert b <= -(-math.ceil(a * max_step - 1e-9) // 16) * 16


# ---------------------------------------------------------------- long prompts (issue 28)

LADDER = (16384, 20176, 24848, 30576, 37648, 46352, 57056, 70240, 86480, 106464, 131072)


def within_paper_reach(cfg: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, context_tokens=cfg.index.block_size))


def with_long_growth(cfg: ClusterConfig, growth: float) -> ClusterConfig:
    return dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, long_growth=growth))


def test_shipped_configs_credit_a_long_match_at_least_91_percent_of_itself() -> None:
    # The shipped long_growth is 1.1: 16384 -> 131072 in 22 equal steps of 8^(1/22) = 1.099 on
    # the testbed, so a whole-prompt match past the paper's lengths is credited >= 1/1.1 of it.
    cfg = load_config(TESTBED)
    assert cfg.index.context_tokens == 131072 and cfg.index.long_growth == 1.1
    plan = LevelPlan.from_config(cfg)
    ladder = long_lengths(16384, 131072, 1.1, 16)
    assert len(ladder) == 22 and ladder[-1] == 131072
    assert plan.registration_lengths()[-22:] == ladder
    assert len(plan.registration_lengths()) == 72  # 48 for the paper's reach
    reads = plan.lengths_toward("us", "us")
    for match in range(16384, 131073, 997):
        credited = max(n for n in reads if n <= match)
        assert credited >= match / 1.1 - cfg.index.block_size
    census = load_config(Path(__file__).resolve().parent.parent / "config" / "census-64x8.toml")
    assert census.index.long_growth == 1.1 and len(LevelPlan.from_config(census).registration_lengths()) == 173


def test_testbed_reaches_its_context_in_ten_shared_steps() -> None:
    # The mechanism by hand at long_growth 1.25 (the shipped value until issue 28's tables showed
    # 1.1 reusing more); the shipped value is checked above.
    cfg = with_long_growth(load_config(TESTBED), 1.25)
    assert cfg.index.context_tokens == 131072
    paper = LevelPlan.from_config(within_paper_reach(cfg))
    plan = LevelPlan.from_config(cfg)
    # 16384 -> 131072 (8x) in the fewest equal steps of at most 1.25: ten of 8^(1/10) = 1.231,
    # each rounded up to the block; shared by every pair, so ten more registered keys in all.
    assert plan.registration_lengths() == paper.registration_lengths() + LADDER[1:]
    assert plan.max_length == 131072
    for origin in ("us", "eu", "asia"):
        for target in ("us", "eu", "asia"):
            before, after = paper.lengths_toward(origin, target), plan.lengths_toward(origin, target)
            assert after[:len(before)] == before  # the paper's lengths are kept as they were
            assert after[-len(LADDER):] == LADDER
    # From asia toward us the paper's lengths stop at 3.5 x 2976 = 10416; the lookup goes on by
    # registered lengths within 1.25 of each other (12320 from eu-asia, 13216 from us-eu).
    assert plan.lengths_toward("asia", "us")[5:] == (10416, 12320, 13216) + LADDER


def test_census_fills_the_gap_below_the_last_doubling_once() -> None:
    census = Path(__file__).resolve().parent.parent / "config" / "census-64x8.toml"
    cfg = with_long_growth(load_config(census), 1.25)
    paper = LevelPlan.from_config(within_paper_reach(cfg))
    plan = LevelPlan.from_config(cfg)
    assert paper.registration_lengths()[-2:] == (10704, 16384)  # 1.53 apart: one length between
    assert plan.registration_lengths() == paper.registration_lengths()[:-1] + (13248,) + LADDER
    assert plan.lengths_toward("us", "us")[-len(LADDER) - 2:] == (10368, 13248) + LADDER


def test_long_lengths_and_bridges_by_hand() -> None:
    assert long_lengths(16384, 131072, 1.25, 16) == LADDER[1:]
    assert long_lengths(16384, 16384, 1.25, 16) == ()
    assert long_lengths(100, 150, 2.0, 16) == (144,)  # the context rounded down to the block
    # From 10416 by registered lengths: 12320 is the longest within 1.25 (13020); 13216 then
    # ends within one step of the top (16384 <= 16528).
    assert bridged_lengths(10416, 16384, [9440, 11328, 12320, 13216, 16384], 1.25, 16) == (12320, 13216)
    assert bridged_lengths(1000, 16384, [5000], 1.25, 16) == (5000,)  # too sparse: the nearest one
    assert bridged_lengths(1000, 16384, [], 1.25, 16) == ()



def _bridged_by_scans(last: int, top: int, registered: list[int], growth: float, block: int) -> tuple[int, ...]:
    """The first implementation (list scans), kept as the reference for the bisecting one."""
    between = [c for c in registered if last < c < top]
    out: list[int] = []
    current = last
    while True:
        reach = -(-math.ceil(current * growth - 1e-9) // block) * block
        if top <= reach:
            return tuple(out)
        ahead = [c for c in between if c > current]
        if not ahead:
            return tuple(out)
        within = [c for c in ahead if c <= reach]
        current = within[-1] if within else ahead[0]
        out.append(current)


@settings(max_examples=300, deadline=None)
@given(registered=st.lists(st.integers(1, 4000).map(lambda b: b * 16), max_size=60, unique=True).map(sorted),
       last=st.integers(1, 3000).map(lambda b: b * 16), span=st.integers(1, 3000).map(lambda b: b * 16),
       growth=st.sampled_from([1.05, 1.25, 1.5, 2.0]))
def test_bridged_lengths_bisecting_equals_scans(registered: list[int], last: int, span: int, growth: float) -> None:
    top = last + span
    assert bridged_lengths(last, top, registered, growth, 16) == _bridged_by_scans(last, top, registered, growth, 16)


regions = st.integers(2, 4)


@settings(max_examples=120, deadline=None)
@given(
    n_regions=regions,
    rtts=st.lists(st.floats(0.0, 400.0), min_size=6, max_size=6),
    betas=st.lists(st.floats(0.005, 0.5), min_size=4, max_size=4),
    block=st.sampled_from([1, 16, 64, 256]),
    levels=st.integers(1, 8),
    min_blocks=st.integers(1, 8),
    max_step=st.sampled_from([1.25, 1.5, 2.0]),
    context_blocks=st.integers(1, 1 << 14),
    long_growth=st.floats(1.1, 4.0),
)
def test_long_lengths_reach_the_context_increasing_aligned_and_bounded(
        n_regions, rtts, betas, block, levels, min_blocks, max_step, context_blocks, long_growth) -> None:
    names = [f"r{i}" for i in range(n_regions)]
    workers = tuple(WorkerConfig(f"w{i}", name, betas[i], 10.0, 1, 1) for i, name in enumerate(names))
    links = tuple(LinkConfig((a, b), rtts[k % len(rtts)]) for k, (a, b) in
                  enumerate((a, b) for i, a in enumerate(names) for b in names[i + 1:]))
    context = min(block * context_blocks, 1 << 24)
    index = IndexParams(block_size=block, levels=levels, same_region_min_tokens=block * min_blocks,
                        same_region_max_step=max_step, context_tokens=context, long_growth=long_growth)
    cfg = ClusterConfig(name="c", model="m", regions=tuple(RegionConfig(n) for n in names), workers=workers,
                        links=links, index=index)
    plan = LevelPlan.from_config(cfg)
    paper = LevelPlan.from_config(within_paper_reach(cfg))
    top = paper.max_length
    registered = set(plan.registration_lengths())
    for origin in names:
        for target in names:
            lengths, before = plan.lengths_toward(origin, target), paper.lengths_toward(origin, target)
            assert all(c % block == 0 and c > 0 for c in lengths)
            assert all(b > a for a, b in zip(lengths, lengths[1:]))
            assert set(before) <= set(lengths) <= registered
            assert lengths[:len(before)] == before or context > top  # nothing changes within reach
            if context > top:
                assert lengths[-1] == context  # every pair reaches the longest prompt
                past = [c for c in lengths if c >= top]
                assert past[0] == top
                for a, b in zip(past, past[1:]):  # past the paper's lengths: steps of <= long_growth
                    assert b <= -(-math.ceil(a * long_growth - 1e-9) // block) * block
            else:
                assert lengths == before
    # Bounded: the shared ladder, and at most the split of the union's last gap, are new keys.
    extra = len(registered) - len(paper.registration_lengths())
    if context > top:
        ladder = math.ceil(math.log(context / top) / math.log(long_growth) - 1e-9)
        union = paper.registration_lengths()
        gap = math.ceil(math.log(union[-1] / union[-2]) / math.log(long_growth) - 1e-9) - 1 if len(union) > 1 else 0
        assert extra <= ladder + max(0, gap)
    else:
        assert extra == 0
