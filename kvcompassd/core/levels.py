"""Latency-derived indexed lengths (paper §3.2; DESIGN.md §3).

Toward a remote region ``g`` from edge region ``o`` the first length is the shortest match whose
saved prefill pays for the detour: ``n1 = ceil(RTT(o, g) / beta_g)`` rounded up to a multiple
of the block size, then ``n1, 1.5 n1, 2 n1, ...`` (``index.levels`` lengths, each rounded up
to the block size). Inside the edge's own region the round trip is negligible, so lengths
double from ``index.same_region_min_tokens``. Everything is computed once from the static
latency matrix and prefill rates. Workers register each cached prefix at every length of the
union over all (edge, target) pairs, so every edge's view is identical.

A match is credited at the longest indexed length below it, so doubling under-credits a local
holder by up to half its match (a 1,440-token history counts as 1,024), exactly where matches
are long. The registered union already holds many lengths between the doublings (the remote
pairs' steps), at no cost to the index: the own-region lookup also reads those of them that are
at least ``index.same_region_growth`` times the last length read (2: the doublings only, as
in the paper). The cost is a few more prefix keys and table reads per request.

Far-apart regions register nothing below their first remote length (the testbed's start at
2,976 tokens), so there the doublings stay bare. ``index.same_region_max_step`` (2: off) then
splits every gap between consecutive own-region reads wider than that factor into the fewest
equal (geometric) steps, and registers the new lengths: with 1.25, the bound the refinement
aims at, the testbed reads and registers 36 own-region lengths instead of 15 (four per doubling
below 2,048), so a local holder is credited at least 80 % of its match (a 1,900-token history
counts as 1,728 tokens, not 1,024).

Long prompts (issue 28). The rules above stop at the paper's lengths: the own-region doublings
end at the first one past the longest remote length (16,384 tokens on the testbed and the
census), and the remote pairs at ``n1 (1 + (levels - 1)/2)`` (at most 13,216 on the testbed,
10,704 on census-64x8), so a holder of a 100 K-token history was credited a sixth of it.
Continuing the paper's rule to the model's context (``index.context_tokens``, 131,072 for the
shipped configs) would take every remote pair on in steps of ``n1 / 2`` and the own-region
doublings to 131,072: on the testbed 87 lengths for one pair and 239 registered lengths in all
(48 before); on census-64x8, whose nearby regions have an ``n1`` of a block or two, up to 1,637
lengths for one pair and 4,852 registered lengths (147 before), each a key every worker
registers (and evicts) for every cached prompt that long, and a table read per lookup
(tools/bench_levels.py counts them).

What we do instead: the longest length of the paper's plan (its union, ``A``) is the start of
one ladder of long lengths shared by every pair: the fewest equal geometric steps of at most
``index.long_growth`` (1.1 in the shipped fleets of up to 16 region groups, 1.25 past them:
each length is a read in every group) from ``A`` to ``context_tokens`` (``split_gap``; 16,384 ->
131,072 is 22 steps of 1.099 at 1.1). Every pair with workers reads on from its own last length: the
lengths already registered between it and ``A`` (``bridged_lengths``: no new keys, steps of at
most ``long_growth`` where the registered lengths allow), then ``A`` and the ladder. Where the
union's last gap below ``A`` is wider than ``long_growth`` (census-64x8: 10,704 -> 16,384, the
longest remote length to the last doubling), it is split like the ladder, once for all pairs.

A match past ``A`` is credited at least ``1 / long_growth`` (91 %) of itself, and a prompt of
``context_tokens`` costs ``log(context / A) / log(long_growth)`` more keys: 22 on the testbed
and 26 on census-64x8 with its gap below ``A`` (72 and 173 registered lengths instead of 48 and
147), whatever the number of pairs. With 1.25 (80 %: ten and eleven keys, 58 and 158 lengths)
the missing fifth of a long match cost real reuse: on census-64x8's Mooncake trace at 0.5x, a
37,508-token turn whose 37,376-token history one worker held was credited 30,576 tokens, so
~580 ms of prefill charged that the holder would not have done; with its 2.7 s queue it scored
behind an idle worker, and the turn was computed again (TTFT 3.2 s; the holder would have
answered in 2.7 s). 1.1 against 1.25 on the issue-28 tables (KVCompass rerun, every other scheme's runs
kept, seeds 0-5 pooled): the same points met (testbed 8/8/8, census-64x8 8/7/7), long-context
P99 at the testbed's 1x 9.59 -> 8.48 s and 1.5x 32.9 -> 30.5 s, throughput at the testbed's
long 1.5x 135.7 -> 142.2 and census-64x8's 482.4 -> 501.6 Ktok/s, census-64x8's Mooncake 0.5x
>=32 K reuse 15.5 -> 23.3 % (Dynamo 23.3), its 1.5x 64.0 -> 60.6 % (a turn that went to an idle
worker instead of a holder queued 5.8 s, 3.0 s sooner than the holder would have answered).
Registering a 131,072-token prompt costs 2.4x (testbed) and 2.8x (census) one SHA-256 over it
on the index side at 1.1 as at 1.25 (`tools/bench_levels.py --repeat 100 --rounds 2`, both in
one window at load ~30), its update batch 2,300 and 8,158 bytes against 1,856 and 7,468; with
only its first 16,384 tokens indexed it cost 1.0x and 2.7x (a quiet run). An edge's decision on
a 100,000-token prompt cost 1.1x one SHA-256 over it at 1.25, against 0.35x before the long
lengths (tools/bench_forward.py): hashing the whole prompt is the price.
With ``context_tokens`` at or below ``A`` nothing is added (the paper's plan); lengths of the
paper's plan above ``context_tokens`` are kept (no prompt reaches them: they cost nothing).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from .config import ClusterConfig

__all__ = ["LevelPlan", "LevelError", "bridged_lengths", "filled_lengths", "long_lengths", "refined_lengths",
           "remote_lengths", "split_gap"]


class LevelError(ValueError):
    """A level query named an unknown region."""


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def remote_lengths(rtt_ms: float, beta_ms_per_token: float, block_size: int, levels: int) -> tuple[int, ...]:
    """``n1 = ceil(rtt / beta)`` block-aligned (at least one block), then steps of ``n1 / 2``."""
    n1 = max(block_size, _round_up(math.ceil(rtt_ms / beta_ms_per_token - 1e-9), block_size))
    lengths: list[int] = []
    for k in range(levels):
        # (1 + k/2) * n1 in integers, rounded up to the block size; a one-block n1 makes two
        # consecutive steps round to the same block, so bump to keep lengths strictly increasing.
        length = _round_up(-(-n1 * (2 + k) // 2), block_size)
        if lengths and length <= lengths[-1]:
            length = lengths[-1] + block_size
        lengths.append(length)
    return tuple(lengths)


def same_region_lengths(min_tokens: int, levels: int) -> tuple[int, ...]:
    return tuple(min_tokens << k for k in range(levels))


def _union(toward: dict[tuple[str, str], tuple[int, ...]]) -> list[int]:
    """Every length of every (edge, target) pair, sorted: what workers register."""
    return sorted({c for lengths in toward.values() for c in lengths})


def refined_lengths(doubling: tuple[int, ...], registered: list[int], growth: float) -> tuple[int, ...]:
    """The doubling lengths plus every registered length up to the longest doubling that is at
    least ``growth`` times the last length kept."""
    must, top = set(doubling), doubling[-1]
    kept: list[int] = []
    for length in registered:
        if length > top:
            break
        if length in must or (kept and length >= kept[-1] * growth):
            kept.append(length)
    return tuple(kept)


def filled_lengths(lengths: tuple[int, ...], max_step: float, block: int) -> tuple[int, ...]:
    """``lengths`` plus, wherever two consecutive lengths are further apart than ``max_step``,
    the fewest block-aligned lengths that split the gap into geometrically equal steps no
    larger than that (800 -> 1024 at 1.25 gains 912, not 1008 beside 1024)."""
    if max_step >= 2.0 or not lengths:
        return lengths
    out = [lengths[0]]
    for nxt in lengths[1:]:
        out += split_gap(out[-1], nxt, max_step, block)
        out.append(nxt)
    return tuple(out)


def split_gap(low: int, high: int, max_step: float, block: int) -> list[int]:
    """The block-aligned lengths strictly between ``low`` and ``high`` that split the gap into
    the fewest geometrically equal steps of at most ``max_step``."""
    steps = math.ceil(math.log(high / low) / math.log(max_step) - 1e-9)
    out: list[int] = []
    for j in range(1, steps):
        length = _round_up(math.ceil(low * (high / low) ** (j / steps) - 1e-9), block)
        if (out[-1] if out else low) < length < high:
            out.append(length)
    return out


def long_lengths(top: int, context_tokens: int, growth: float, block: int) -> tuple[int, ...]:
    """The shared ladder past ``top``: the fewest block-aligned lengths up to ``context_tokens``
    (rounded down to the block) in equal geometric steps of at most ``growth``; () if the
    context does not reach past ``top``."""
    end = context_tokens // block * block
    if end <= top:
        return ()
    return (*split_gap(top, end, growth, block), end)


def bridged_lengths(last: int, top: int, registered: list[int], growth: float, block: int) -> tuple[int, ...]:
    """Registered lengths strictly between ``last`` and ``top`` that a lookup reads on its way
    from ``last`` to ``top``: greedily the longest within one step of ``growth`` (rounded up to
    the block), or, when the registered lengths leave a wider gap, the nearest one past it. They
    are registered already: reading them adds no key. ``registered`` is sorted ascending."""
    # Bisection, not scans: the plan makes this call once per region pair (4,096 at 64 regions,
    # each over ~550 registered lengths), and every router and agent builds the plan.
    between = registered[bisect_right(registered, last):bisect_left(registered, top)]
    out: list[int] = []
    current = last
    while True:
        reach = _round_up(math.ceil(current * growth - 1e-9), block)
        if top <= reach:
            return tuple(out)
        first_ahead = bisect_right(between, current)
        if first_ahead == len(between):
            return tuple(out)
        past_reach = bisect_right(between, reach)
        current = between[past_reach - 1] if past_reach > first_ahead else between[first_ahead]
        out.append(current)


@dataclass(frozen=True, slots=True)
class LevelPlan:
    """Indexed lengths for every (edge region, target region) pair."""

    toward: dict[tuple[str, str], tuple[int, ...]]
    block_size: int
    _registration: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_registration", tuple(_union(self.toward)))

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> LevelPlan:
        index = cfg.index
        toward: dict[tuple[str, str], tuple[int, ...]] = {}
        for origin in cfg.region_names():
            for target in cfg.region_names():
                workers = cfg.workers_in(target)
                if not workers:
                    toward[(origin, target)] = ()  # nothing to find there
                elif origin == target:
                    continue  # after the remote ones, which bound how far it must reach
                else:
                    # The slowest worker of g sets beta_g: n1 must pay off for every worker the
                    # lookup may name there; with a faster beta some holders would be reported
                    # at lengths whose saved prefill does not cover the round trip.
                    beta = max(w.prefill_ms_per_token for w in workers)
                    toward[(origin, target)] = remote_lengths(
                        cfg.rtt_ms(origin, target), beta, index.block_size, index.levels
                    )
            if cfg.workers_in(origin):
                # Own-region lengths double from the minimum; they go on doubling until they
                # reach the longest remote length, or a local holder of a long prefix would be
                # credited less of it than a remote holder of the same prefix, and lose to it.
                local = list(same_region_lengths(index.same_region_min_tokens, index.levels))
                longest_remote = max((toward[(origin, t)][-1] for t in cfg.region_names()
                                      if t != origin and toward.get((origin, t))), default=0)
                while local[-1] < longest_remote:
                    local.append(local[-1] * 2)
                toward[(origin, origin)] = tuple(local)
        # Refining reads only lengths already in the union (it registers nothing new); filling
        # comes after it, so only the gaps the registered lengths leave are filled.
        registered = _union(toward) if index.same_region_growth < 2.0 else None
        for origin in cfg.region_names():
            if cfg.workers_in(origin):
                own = toward[(origin, origin)]
                if registered is not None:
                    own = refined_lengths(own, registered, index.same_region_growth)
                toward[(origin, origin)] = filled_lengths(own, index.same_region_max_step, index.block_size)
        # The long lengths, after the paper's plan is complete (see the module docstring).
        paper = _union(toward)
        top = paper[-1] if paper else 0
        ladder = long_lengths(top, index.context_tokens, index.long_growth, index.block_size)
        if ladder:
            # Where the paper's union is too sparse just below A (the census: 10,704 -> 16,384),
            # that one gap is filled too, once for every pair: they all cross it.
            below = split_gap(paper[-2], top, index.long_growth, index.block_size) if len(paper) > 1 else []
            paper = sorted(paper + list(below))
            for pair, lengths in toward.items():
                if lengths:
                    # Pairs already past the filled gap (own regions reach A) read it too.
                    lengths = tuple(sorted(set(lengths) | {b for b in below if lengths[0] < b < lengths[-1]}))
                    last = lengths[-1]
                    bridge = bridged_lengths(last, top, paper, index.long_growth, index.block_size)
                    toward[pair] = lengths + bridge + ((top,) if last < top else ()) + ladder
        return cls(toward=toward, block_size=index.block_size)

    def lengths_toward(self, origin: str, target: str) -> tuple[int, ...]:
        try:
            return self.toward[(origin, target)]
        except KeyError:
            raise LevelError(f"unknown region pair ({origin!r}, {target!r})") from None

    def first_length_toward(self, origin: str, target: str) -> int | None:
        """``n1`` toward ``target`` (the own-region minimum when equal); None if it has no workers."""
        lengths = self.lengths_toward(origin, target)
        return lengths[0] if lengths else None

    def lengths_toward_upto(self, origin: str, target: str, n: int) -> tuple[int, ...]:
        """The lengths toward ``target`` that fit a prompt of ``n`` tokens."""
        return tuple(c for c in self.lengths_toward(origin, target) if c <= n)

    def registration_lengths(self) -> tuple[int, ...]:
        """Sorted union of every edge's lengths toward every region: what workers register."""
        return self._registration

    def registration_lengths_upto(self, n: int) -> tuple[int, ...]:
        return tuple(c for c in self._registration if c <= n)

    @property
    def max_length(self) -> int:
        return self._registration[-1] if self._registration else 0
