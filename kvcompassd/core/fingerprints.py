"""Fingerprint bits per slot from a false-lookup budget (issue 31 item 2).

A keyless Ludo view answers a key that was never inserted with whatever value sits in the slot
the key's hashes pick: a false hit when that slot is occupied, about ``load`` of the time. With
``d`` fingerprint bits per slot, the view also compares a ``d``-bit digest of the key and lets a
stranger through only on a digest collision, so one read of a never-inserted key is a false hit
with probability ``p = load * 2**-d``.

How an edge reads (``lookup.PrefixLookup``, ``lookup_plan.LookupPlan``): per request, for every
region group, one read per length toward that group's region that fits the prompt (``levels``
toward a remote region, more toward the edge's own where ``same_region_growth`` and
``same_region_max_step`` add lengths), each in the shard that owns that length's key. The reads that can
start a false claim are those of never-inserted keys:

- with cross-level consistency (the edge's Router always uses it), a worker's match toward a
  group is the unbroken run of hits from the shortest length. Keys that were inserted read
  exact values, so a false claim toward a group needs a false hit at the group's first read of a
  never-inserted key — one read per group and request. (A false run may then lengthen by
  further false hits, with probability ``p`` each; that lengthens a claim, it adds none.)
- without it (the paper's plain rule, ``consistency=False``), any of the group's reads past
  the true run can claim on its own: pass the most reads per group as ``levels``.

So the expected number of false reads per request — region groups in which some worker is
falsely claimed; one false read can name several workers of its group, since it returns a whole
stored value — bounds the probability that a request meets any false claim (union bound), and
is at most ``reads_at_risk * load * 2**-d`` with ``reads_at_risk =
groups`` with consistency and ``groups * levels`` without, and the bits needed for a budget ``B``
are the least ``d`` with ``reads_at_risk * load * 2**-d <= B``. It is an upper bound: every read
is counted as a never-inserted key's and every group as read (a short prompt reads fewer), and
``load`` should be the tables' highest, ``index.max_load``.

Cost: the fingerprint lives in every slot, and a table at load ``L`` has ``1/L`` slots per entry,
so ``d`` bits cost ``d / L`` bits per entry (``d / max_load`` for a full table, up to 1.5 times
that right after a table has grown: ludo_table.c grows by half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layout import IndexLayout

__all__ = ["FingerprintChoice", "MAX_FINGERPRINT_BITS", "budget_shortfall", "expected_false_claims", "fingerprint_bits_for",
           "fingerprint_choice_for_config"]

MAX_FINGERPRINT_BITS = 16  # what the C core stores per slot (ludo_c, LudoTable)


@dataclass(frozen=True, slots=True)
class FingerprintChoice:
    """The bits a budget needs, what they cost, and whether ``configured`` bits meet it."""

    needed_bits: int  # least d meeting the budget; may exceed MAX_FINGERPRINT_BITS
    reads_at_risk: int  # reads per request that can start a false claim
    load: float
    budget: float  # false claims per request
    configured_bits: int
    expected_with_configured: float  # false claims per request with configured_bits
    expected_with_needed: float

    @property
    def meets_budget(self) -> bool:
        return self.expected_with_configured <= self.budget

    @property
    def achievable(self) -> bool:
        return self.needed_bits <= MAX_FINGERPRINT_BITS

    @property
    def bits_per_entry(self) -> float:
        """What the needed bits cost per index entry at ``load``."""
        return self.needed_bits / self.load

    @property
    def configured_bits_per_entry(self) -> float:
        return self.configured_bits / self.load


def _check(groups: int, levels: int, load: float, budget: float) -> None:
    for name, value in (("groups", groups), ("levels", levels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("load", load), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not 0.0 < load <= 1.0:
        raise ValueError(f"load must be in (0, 1], got {load}")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")


def _reads_at_risk(groups: int, levels: int, consistency: bool) -> int:
    return groups if consistency else groups * levels


def expected_false_claims(*, groups: int, levels: int, load: float, bits: int, consistency: bool = True) -> float:
    """Upper bound on false claims per request: ``reads_at_risk * load * 2**-bits``."""
    _check(groups, levels, load, 1.0)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 0:
        raise ValueError(f"bits must be a non-negative integer, got {bits!r}")
    return _reads_at_risk(groups, levels, consistency) * load * 2.0**-bits


def fingerprint_bits_for(*, groups: int, levels: int, load: float, budget: float, consistency: bool = True,
                         configured_bits: int = 0) -> FingerprintChoice:
    """The least fingerprint bits keeping false claims per request within ``budget``.

    ``groups``: region groups an edge reads per lookup; ``levels``: reads per group at most (only
    used without consistency); ``load``: the tables' load (``index.max_load`` for the worst case);
    ``budget``: false claims per request (``index.false_lookup_budget``).
    """
    _check(groups, levels, load, budget)
    if isinstance(configured_bits, bool) or not isinstance(configured_bits, int) or configured_bits < 0:
        raise ValueError(f"configured_bits must be a non-negative integer, got {configured_bits!r}")
    reads = _reads_at_risk(groups, levels, consistency)
    # Least d with reads * load * 2^-d <= budget; the loop guards against float rounding of log2.
    needed = max(0, math.ceil(math.log2(reads * load / budget)))
    while needed > 0 and reads * load * 2.0 ** -(needed - 1) <= budget:
        needed -= 1
    while reads * load * 2.0**-needed > budget:
        needed += 1
    return FingerprintChoice(
        needed_bits=needed,
        reads_at_risk=reads,
        load=float(load),
        budget=float(budget),
        configured_bits=configured_bits,
        expected_with_configured=reads * load * 2.0**-configured_bits,
        expected_with_needed=reads * load * 2.0**-needed,
    )


def fingerprint_choice_for_config(cfg) -> FingerprintChoice:
    """``fingerprint_bits_for`` a cluster config: every region group read, at ``max_load``.

    The edge checks its configured bits with this at start-up; the config generator calls
    ``fingerprint_bits_for`` with the same groups, levels, max_load and budget it writes, so a
    generated config passes the check.
    """
    index = cfg.index
    groups = len(IndexLayout.from_config(cfg).groups)
    return fingerprint_bits_for(groups=groups, levels=index.levels, load=index.max_load,
                                budget=index.false_lookup_budget, consistency=True,
                                configured_bits=index.fingerprint_bits)


def budget_shortfall(choice: FingerprintChoice) -> str | None:
    """What an operator must change when the configured bits cannot meet the budget, else None."""
    if choice.meets_budget:
        return None
    if choice.achievable:
        fix = (f"set index.fingerprint_bits = {choice.needed_bits} (+{choice.bits_per_entry:.1f} bits per entry, "
               f"<= {choice.expected_with_needed:.2g} false claims per request)")
    else:
        fix = (f"{choice.needed_bits} fingerprint bits would be needed, more than the index stores "
               f"({MAX_FINGERPRINT_BITS}): raise index.false_lookup_budget or lower index.max_load")
    return (f"index.fingerprint_bits = {choice.configured_bits} allows up to {choice.expected_with_configured:.2g} "
            f"false claims per request over {choice.reads_at_risk} region groups at load {choice.load:g}, above "
            f"index.false_lookup_budget = {choice.budget:g}; {fix}")
