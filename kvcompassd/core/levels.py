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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import ClusterConfig

__all__ = ["LevelPlan", "LevelError"]


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
        low = out[-1]
        steps = math.ceil(math.log(nxt / low) / math.log(max_step) - 1e-9)
        for j in range(1, steps):
            length = _round_up(math.ceil(low * (nxt / low) ** (j / steps) - 1e-9), block)
            if out[-1] < length < nxt:
                out.append(length)
        out.append(nxt)
    return tuple(out)


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
