"""Hot-prefix detection and migration planning at an edge (paper §3.4; DESIGN.md §5).

Prefixes are grouped into *families* by their first-level key (all prompts sharing the first
indexed chunk). The Router reports every forwarding decision as a :class:`DecisionObserved`. A
decision is a *local miss* when the chosen worker is not a local holder of the prompt's prefix
(including when there is no local holder at all). When a family collects ``H`` local misses
within ``T_h`` (``score.hot_prefix_misses``, ``score.hot_prefix_window_ms``), a migration is
planned if one of the paper's two triggers holds for the triggering decision:

(a) the region has no local holder, and the best remote holder's match reaches the first
    latency-derived length of the holder's region toward this edge (``n1``: matches are
    quantised to indexed lengths, so a match at ``n1`` already pays for the WAN detour, and a
    local replica saves that detour for every later request); or
(b) local holders exist but every one of them kept losing the joint score to load: ``H``
    decisions in the window where the Router reported ``local_holders_lost_to_load``.

The destination is a persistently idle worker of this region (per :class:`QueueEstimates`)
that does not already hold the prefix and is not the worker serving the triggering request
(which will hold it anyway). The replica lands in DRAM. Within a region the KV tensors are
copied worker to worker (``mode="copy"``); across regions the prompt is shipped and recomputed
(``mode="recompute"``): regional networks beat recompute for KV transfer, the WAN does not
(paper §3.5). What migrates is the triggering request's own prefix, which contains the part
the family shares: for a copy, the holder's matched prefix; for a recompute, the whole prompt
(the index quantises what an edge sees of a holder's match to its levels, not what the holder
has: a long document cut at the longest level would leave its siblings a recompute of the rest
at the replica, and the remote holder would keep winning them). A family that migrated is left
alone for a cooldown, and the number of tracked families is bounded (least recently missed
evicted first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Collection

from .ablation import FULL, Ablation
from .config import ClusterConfig
from .events import MAX_KEY, Tier
from .levels import LevelPlan
from .queues import QueueEstimates

__all__ = ["DecisionObserved", "HotPrefixDetector", "MigrationInputError", "MigrationPlanned", "HOT_MISS_OUTCOMES"]

MODES = ("copy", "recompute")
# What became of a local miss that found its family hot: a plan, or why none. The simulated
# fleets under steady load see no_idle_worker (no replica without an idle destination, by design)
# and no_remote_match (hot, but nothing abroad worth the detour): the operator's reason for zero
# migrations, counted per trigger in HotPrefixDetector.hot_misses.
PLANNED, NO_IDLE_WORKER, NO_REMOTE_MATCH = HOT_MISS_OUTCOMES = ("planned", "no_idle_worker", "no_remote_match")


class MigrationInputError(ValueError):
    """A decision report or plan is malformed or names workers of the wrong region."""


def _check_key(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_KEY:
        raise MigrationInputError(f"family_key must be an int in [0, 2^63), got {value!r}")


def _check_tokens(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MigrationInputError(f"{name} must be a non-negative integer, got {value!r}")


def _check_worker(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise MigrationInputError(f"{name} must be a non-empty worker id, got {value!r}")


@dataclass(frozen=True, slots=True)
class DecisionObserved:
    """What the Router decided for one request, as the hot-prefix detector needs it.

    ``local_holders``: (worker, matched tokens) for every holder in the edge's region;
    ``remote_best``: (worker, region, matched tokens) of the longest remote match, or None;
    ``local_holders_lost_to_load``: local holders existed and each lost the joint score because
    of its queue (it would have won with its queue term at the winner's).
    """

    family_key: int
    prompt_len: int
    chosen_worker: str
    local_holders: tuple[tuple[str, int], ...] = ()
    remote_best: tuple[str, str, int] | None = None
    local_holders_lost_to_load: bool = False

    def __post_init__(self) -> None:
        _check_key(self.family_key)
        _check_tokens("prompt_len", self.prompt_len)
        _check_worker("chosen_worker", self.chosen_worker)
        holders = []
        for entry in self.local_holders:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise MigrationInputError(f"local_holders entries are (worker, matched), got {entry!r}")
            _check_worker("local holder", entry[0])
            _check_tokens("local holder match", entry[1])
            if entry[1] > self.prompt_len:
                raise MigrationInputError(f"local holder match {entry[1]} exceeds prompt_len {self.prompt_len}")
            holders.append((entry[0], entry[1]))
        object.__setattr__(self, "local_holders", tuple(holders))
        if self.remote_best is not None:
            best = self.remote_best
            if not isinstance(best, (tuple, list)) or len(best) != 3:
                raise MigrationInputError(f"remote_best is (worker, region, matched), got {best!r}")
            _check_worker("remote_best worker", best[0])
            if not isinstance(best[1], str) or not best[1]:
                raise MigrationInputError(f"remote_best region must be a non-empty string, got {best[1]!r}")
            _check_tokens("remote_best match", best[2])
            if best[2] > self.prompt_len:
                raise MigrationInputError(f"remote_best match {best[2]} exceeds prompt_len {self.prompt_len}")
            object.__setattr__(self, "remote_best", (best[0], best[1], best[2]))
        if not isinstance(self.local_holders_lost_to_load, bool):
            raise MigrationInputError(f"local_holders_lost_to_load must be a bool, got {self.local_holders_lost_to_load!r}")


@dataclass(frozen=True, slots=True)
class MigrationPlanned:
    """Replicate ``prefix_len`` tokens of the triggering prompt onto ``destination_worker``'s DRAM."""

    family_key: int
    prefix_len: int
    source_worker: str
    destination_worker: str
    mode: str
    tier: Tier = Tier.DRAM

    def __post_init__(self) -> None:
        _check_key(self.family_key)
        _check_tokens("prefix_len", self.prefix_len)
        if self.prefix_len == 0:
            raise MigrationInputError("prefix_len must be positive")
        _check_worker("source_worker", self.source_worker)
        _check_worker("destination_worker", self.destination_worker)
        if self.source_worker == self.destination_worker:
            raise MigrationInputError(f"source and destination are the same worker {self.source_worker!r}")
        if self.mode not in MODES:
            raise MigrationInputError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "tier", Tier(self.tier))
        if self.tier not in (Tier.VRAM, Tier.DRAM):
            raise MigrationInputError(f"tier must be VRAM or DRAM, got {self.tier!r}")


@dataclass(slots=True)
class _Family:
    misses: deque[float]  # times of the last H local misses
    load_losses: deque[float]  # times of the last H misses where local holders lost to load
    cooldown_until: float = field(default=float("-inf"))


class HotPrefixDetector:
    """Counts local misses per prefix family and plans migrations for the edge of ``region``.

    ``queues`` is the same edge's :class:`QueueEstimates`, consulted for idle destinations.
    ``cooldown_ms`` (default 5 x T_h) keeps one family from migrating again while the first
    replica is still being made and registered.
    """

    def __init__(
        self,
        cfg: ClusterConfig,
        region: str,
        level_plan: LevelPlan,
        *,
        queues: QueueEstimates,
        ablation: Ablation = FULL,
        cooldown_ms: float | None = None,
        max_families: int = 4096,
    ) -> None:
        if region not in cfg.region_names():
            raise MigrationInputError(f"unknown region {region!r}")
        if queues.region != region:
            raise MigrationInputError(f"queue estimates are for region {queues.region!r}, not {region!r}")
        if isinstance(max_families, bool) or not isinstance(max_families, int) or max_families < 1:
            raise MigrationInputError(f"max_families must be a positive integer, got {max_families!r}")
        self.region = region
        self.ablation = ablation
        self._plan = level_plan
        self._queues = queues
        self._region_of = {w.id: w.region for w in cfg.workers}
        self._misses_needed = cfg.score.hot_prefix_misses
        self._window_s = cfg.score.hot_prefix_window_ms / 1000.0
        cooldown = 5.0 * cfg.score.hot_prefix_window_ms if cooldown_ms is None else float(cooldown_ms)
        if not cooldown >= 0.0:
            raise MigrationInputError(f"cooldown_ms must be >= 0, got {cooldown_ms!r}")
        self._cooldown_s = cooldown / 1000.0
        self._max_families = max_families
        self._families: OrderedDict[int, _Family] = OrderedDict()
        # (trigger, outcome) -> local misses that found their family hot (see HOT_MISS_OUTCOMES)
        self.hot_misses: dict[tuple[str, str], int] = dict.fromkeys(
            ((t, o) for t in MODES for o in HOT_MISS_OUTCOMES), 0)

    def __len__(self) -> int:
        """Number of prefix families currently tracked."""
        return len(self._families)

    def _check_regions(self, decision: DecisionObserved) -> None:
        for worker, _ in decision.local_holders:
            if self._region_of.get(worker) != self.region:
                raise MigrationInputError(f"local holder {worker!r} is not a worker of region {self.region!r}")
        if self._region_of.get(decision.chosen_worker) is None:
            raise MigrationInputError(f"unknown chosen worker {decision.chosen_worker!r}")
        if decision.remote_best is not None:
            worker, region, _ = decision.remote_best
            if region == self.region or self._region_of.get(worker) != region:
                raise MigrationInputError(f"remote_best {worker!r} is not a worker of remote region {region!r}")

    def _recent(self, times: deque[float], now: float) -> int:
        return sum(1 for t in times if now - t <= self._window_s)

    def observe(self, decision: DecisionObserved, *, now: float) -> MigrationPlanned | None:
        """Account one forwarding decision; returns a migration plan when a family turns hot."""
        if not self.ablation.migration:
            return None
        self._check_regions(decision)
        now = float(now)
        holders = {worker for worker, matched in decision.local_holders if matched > 0}
        if decision.chosen_worker in holders:
            return None  # a local hit
        trigger = self.note_miss(decision.family_key, now=now, holders=bool(holders),
                                 lost_to_load=decision.local_holders_lost_to_load)
        return None if trigger is None else self._make_plan(decision, holders, trigger, now)

    def note_miss(self, family_key: int, *, now: float, holders: bool = False,
                  lost_to_load: bool = False) -> str | None:
        """Count one local miss of a family; returns the trigger now due, ``"copy"`` or
        ``"recompute"``, or None.

        ``observe`` is this plus the plan, for a decision whose winner is not a local holder:
        ``holders`` says local holders exist, ``lost_to_load`` that each lost to load. A caller
        that knows no plan can come of it (no local holder, and no remote match at its region's
        first length) only counts the miss this way, without building a ``DecisionObserved``;
        otherwise a due trigger is handed to ``plan`` with the full decision.
        """
        if not self.ablation.migration:
            return None
        if family_key.__class__ is not int or not 0 <= family_key <= MAX_KEY:
            _check_key(family_key)
        now = float(now)
        family = self._count_miss(family_key)
        family.misses.append(now)
        lost_to_load = bool(holders) and bool(lost_to_load)
        if lost_to_load:
            family.load_losses.append(now)
        if now < family.cooldown_until:
            return None
        if holders:
            if lost_to_load and self._recent(family.load_losses, now) >= self._misses_needed:
                return "copy"
        elif self._recent(family.misses, now) >= self._misses_needed:
            return "recompute"
        return None

    def plan(self, decision: DecisionObserved, trigger: str, *, now: float) -> MigrationPlanned | None:
        """The migration for a decision whose miss ``note_miss`` already counted and found ``trigger`` due."""
        if trigger not in ("copy", "recompute"):
            raise MigrationInputError(f"trigger must be 'copy' or 'recompute', got {trigger!r}")
        self._check_regions(decision)
        holders = {worker for worker, matched in decision.local_holders if matched > 0}
        return self._make_plan(decision, holders, trigger, float(now))

    def note_unplanned(self, trigger: str, outcome: str) -> None:
        """Count a due trigger that a caller found could not plan (``observe`` and ``plan`` count
        their own): ``NO_REMOTE_MATCH`` or ``NO_IDLE_WORKER``."""
        if (trigger, outcome) not in self.hot_misses or outcome == PLANNED:
            raise MigrationInputError(f"not an unplanned trigger outcome: {(trigger, outcome)!r}")
        self.hot_misses[trigger, outcome] += 1

    def has_destination(self, local_holders: Collection[str], chosen_worker: str, *, now: float) -> bool:
        """Whether a persistently idle local worker outside ``local_holders`` and other than
        ``chosen_worker`` exists: without one, ``plan`` returns None for either trigger."""
        return any(w not in local_holders and w != chosen_worker
                   for w in self._queues.persistently_idle_local(now=float(now)))

    def _make_plan(self, decision: DecisionObserved, holders: set[str], trigger: str,
                   now: float) -> MigrationPlanned | None:
        if trigger == "copy":
            plan, outcome = self._plan_copy(decision, holders, now)
        else:
            plan, outcome = self._plan_recompute(decision, now)
        self.hot_misses[trigger, outcome] += 1
        if plan is not None:
            family = self._families.get(decision.family_key)
            if family is not None:
                family.cooldown_until = now + self._cooldown_s
                family.misses.clear()
                family.load_losses.clear()
        return plan

    def _count_miss(self, family_key: int) -> _Family:
        """The family's record, created or marked most recently missed (bounded LRU)."""
        family = self._families.get(family_key)
        if family is None:
            family = _Family(deque(maxlen=self._misses_needed), deque(maxlen=self._misses_needed))
            self._families[family_key] = family
            if len(self._families) > self._max_families:
                self._families.popitem(last=False)
        else:
            self._families.move_to_end(family_key)
        return family

    def _destination(self, decision: DecisionObserved, holders: set[str], now: float) -> str | None:
        for worker in self._queues.persistently_idle_local(now=now):
            if worker not in holders and worker != decision.chosen_worker:
                return worker
        return None

    def _plan_copy(self, decision: DecisionObserved, holders: set[str],
                   now: float) -> tuple[MigrationPlanned | None, str]:
        # Trigger (b): copy from the local holder with the longest match (first on ties).
        destination = self._destination(decision, {worker for worker, _ in decision.local_holders}, now)
        if destination is None:
            return None, NO_IDLE_WORKER
        source, matched = max(decision.local_holders, key=lambda h: h[1])
        return MigrationPlanned(decision.family_key, matched, source, destination, "copy"), PLANNED

    def _plan_recompute(self, decision: DecisionObserved, now: float) -> tuple[MigrationPlanned | None, str]:
        # Trigger (a): no local holder, and a remote match worth the detour exists.
        if not self.ablation.cross_region or decision.remote_best is None:
            return None, NO_REMOTE_MATCH
        worker, region, matched = decision.remote_best
        first = self._plan.first_length_toward(self.region, region)
        if first is None or matched < first:
            return None, NO_REMOTE_MATCH
        destination = self._destination(decision, {w for w, _ in decision.local_holders}, now)
        if destination is None:
            return None, NO_IDLE_WORKER
        return MigrationPlanned(decision.family_key, decision.prompt_len, worker, destination, "recompute"), PLANNED
