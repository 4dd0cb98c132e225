"""The edge's forwarding decision: lookup, joint score, cache belief, queue estimates, migration.

``Router`` is what an edge (daemon or simulator) drives per request: ``decide(tokens, now=...)``
returns a ``ForwardDecided`` naming the winner and the score terms of the top candidates;
``on_response`` feeds back what the chosen worker actually reused and its region's queue vector;
``on_first_token`` and ``on_finished`` (or ``on_failed``) say when the decision's request produced
its first token and ended, which retires its charge in the queue estimates, credits its prompt
in the pending ledger and teaches the edge its workers' rates (``core/rates.py``).
It owns no sockets and reads no clock.

A decision is one C call (``lookup_plan.SparseForwardKernel``: prefix keys, lookup, score, tie
rotation, miss summary, with work that follows the holders and the candidates rather than every
worker); Python only builds the decision objects and updates the edge's state. With
``native=False`` it takes every reference path instead (hashlib keys, Python lookup, numpy score):
tests hold the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Mapping

import numpy as np

from .ablation import Ablation
from .belief import CacheBelief
from .config import ClusterConfig
from .events import Tier
from .index import EdgeIndexView
from .keys import SHA256_BACKENDS, namespace_salt, token_buffer
from .layout import IndexLayout
from .levels import LevelPlan
from .lookup import LookupResult, PrefixLookup, new_lookup_result
from .lookup_plan import (MISS_LOCAL_HOLDER, MISS_LOST_TO_LOAD, MISS_REMOTE_WORTH, SMALL_FLEET, DecisionArrays,
                          MissSummary, SparseForwardKernel, slot_constructor)
from .migration import NO_IDLE_WORKER, NO_REMOTE_MATCH, DecisionObserved, HotPrefixDetector, MigrationPlanned
from .pending import PendingHoldings
from .queues import QueueEstimates
from .rates import LearnedRates
from .score import JointScorer, NoEligibleWorkerError, ScoreResult, ScoreTerms, score_result_from_arrays

# Learned prefill rates within this share of the ones scored with are not handed to the scorer.
# A window's median moves by a fraction of a per cent on most responses (3 in 4 of an edge's at
# zero delay), and each hand-over re-derives the score's pruning bounds: 29 us of a response's
# handling in the edge's request path. A rate's samples spread far wider than this.
RESCORE_RATE_TOLERANCE = 0.01
# Router.copy_charges' keys: a decision the copy price went to another worker, or left alone.
COPY_MOVED, COPY_KEPT = "moved", "kept"


def copy_pressure(pinned_share: float, floor: float) -> float:
    """How much of the copy charge (``score.copy_weight``) a worker whose requests pin
    ``pinned_share`` of its VRAM pays: none up to ``floor`` (``score.copy_pinned_floor``), rising
    linearly to all of it with the pool wholly pinned. Below the floor the cache's unpinned part
    holds the prefixes its groups use and more, so a copy evicts a cold one."""
    if pinned_share <= floor:
        return 0.0
    return (pinned_share - floor) / (1.0 - floor)  # (a share is at most 1: QueueEstimates bounds it)


@dataclass(frozen=True, slots=True)
class ForwardDecided:
    """Where one request goes, and why (score terms of the best candidates, for logs)."""

    worker: str
    worker_index: int
    region: str
    claimed_tokens: int  # the indexed match the edge credits the winner with (m_r)
    tier: Tier
    lam: float
    prompt_len: int
    local: bool  # the winner is in the edge's own region
    score: ScoreResult  # every worker's score; ``candidates`` breaks the best down
    migration: MigrationPlanned | None = None
    top_k: int = 3
    pending: bool = False  # the winner was credited from the edge's pending ledger, beyond its view
    dispatch: int = -1  # names the request in on_first_token / on_finished / on_failed

    @property
    def candidates(self) -> tuple[ScoreTerms, ...]:
        """Score terms of the best ``top_k`` workers (built on demand: it is for logs)."""
        return self.score.top(self.top_k)

    @property
    def outcome(self) -> str:
        """``local_hit``, ``remote_hit`` or ``recompute``: for metrics."""
        if self.claimed_tokens == 0:
            return "recompute"
        return "local_hit" if self.local else "remote_hit"


_new_forward_decided = slot_constructor(ForwardDecided)
# Tier by 2-bit field code; the invalid code 3 goes through Tier() (and raises) as before.
_TIER_BY_CODE = (Tier.ABSENT, Tier.VRAM, Tier.DRAM)
_DRAM = int(Tier.DRAM)
_VRAM = int(Tier.VRAM)
# Router.decide's keys when the ledger has not read them: the kernel's, sliced in _conclude if needed.
_KERNEL_KEYS = np.empty(0, dtype=np.uint64)
# Why a response reused less than its claim, where the view can tell (Router.explain_shortfall).
SHORTFALL_EVICTED = "evicted"
SHORTFALL_DRAM = "dram"


class Router:
    """Forwarding decisions for requests entering at an edge of ``region``."""

    def __init__(
        self,
        cfg: ClusterConfig,
        region: str,
        view: EdgeIndexView,
        *,
        now: float,
        ablation: Ablation | None = None,
        consistency: bool = True,
        tenant: str | None = None,
        top_k: int = 3,
        native: bool = True,
        plan: LevelPlan | None = None,
    ):
        self.cfg = cfg
        self.region = region
        self.ablation = ablation or Ablation()
        self.layout: IndexLayout = view.layout
        # A simulator's edges share one plan: it is the config's, and immutable.
        self.plan = LevelPlan.from_config(cfg) if plan is None else plan
        salt = namespace_salt(cfg.model, cfg.tenant if tenant is None else tenant)
        self.native = native
        self.lookup = PrefixLookup(self.layout, self.plan, region, salt, view, consistency=consistency, native=native)
        self.scorer = JointScorer(cfg, region)
        self.queues = QueueEstimates(cfg, region, now=now)
        self.belief = CacheBelief(len(self.layout.worker_ids), cfg.score.belief_weight)
        self.hot = HotPrefixDetector(cfg, region, self.plan, queues=self.queues, ablation=self.ablation)
        self.worker_regions = tuple(w.region for w in cfg.workers)
        self._worker_ids = self.layout.worker_ids
        self._migration = self.ablation.migration
        self._copy_weight = cfg.score.copy_weight
        self._copy_floor = cfg.score.copy_pinned_floor
        self._local = np.array([r == region for r in self.worker_regions], dtype=bool)
        self._local_list = tuple(self._local.tolist())
        self._local_indexes = tuple(np.flatnonzero(self._local).tolist())
        self.top_k = top_k
        # Workers no request is routed to: decode workers of a disaggregated fleet only receive
        # KV handed over by a prefill worker of their region.
        self._unroutable = frozenset(self.layout.worker_index(w.id) for w in cfg.workers if not cfg.routable(w))
        for index in self._unroutable:
            self.queues.withhold(self.layout.worker_ids[index])
        # Workers this edge routes nothing to (e.g. tokenizer not verified, or refused).
        self._withheld: frozenset[int] = self._unroutable
        self._last_sent = np.zeros(len(self.layout.worker_ids), dtype=np.int64)  # dispatch counter per worker
        self._sent_count = 0
        # Decisions the copy price (score.copy_weight) was added to, by whether it moved the
        # winner (a count for the metrics, read when scraped).
        self.copy_charges = {COPY_MOVED: 0, COPY_KEPT: 0}
        # Responses short of their claim that the index explained, by cause (on_response).
        self.explained_shortfalls = dict.fromkeys((SHORTFALL_EVICTED, SHORTFALL_DRAM), 0)
        # A miss without local holders can only plan a migration when a remote match reaches its
        # region's first length toward us (trigger a): that least match, per remote worker.
        never = np.iinfo(np.int64).max
        floors = []
        for r in self.worker_regions:
            first = self.plan.first_length_toward(region, r) if r != region and self.ablation.cross_region else None
            floors.append(never if first is None else max(1, first))
        self._miss_summary = MissSummary(self._local, np.array(floors, dtype=np.int64))
        self._beta_list = self.scorer.beta_list  # the prefill rates themselves (charges, learning)
        # score.decode_stall_weight: the scorer's rates are these raised by the decodes each
        # worker's prefill would pause, remade when a reading changes a running count.
        self._stall_weight = cfg.score.decode_stall_weight
        self._stall_seen = -1  # the queue estimates' running_version the scorer's rates were made at
        self.rates = LearnedRates(cfg, region)
        self._gamma = self.scorer.gamma
        hold_ms = cfg.score.pending_hold_ms
        self.pending = (PendingHoldings(self.lookup.group_lengths, self.lookup.query_lengths, self.layout.worker_group,
                                        hold_s=hold_ms / 1000.0,
                                        from_first_token=cfg.score.pending_from_first_token,
                                        refute_misses=cfg.score.pending_refute)
                        if hold_ms > 0 else None)
        self._kernel: SparseForwardKernel | None = None
        if native:
            lookup_plan, pointers = self.lookup.native_plan()
            self._kernel = SparseForwardKernel(lookup_plan, pointers, self.lookup.query_lengths, salt,
                                               self.scorer.kernel, self.scorer.kernel_flags(self.ablation),
                                               self._miss_summary, self._last_sent,
                                               family_index=self.lookup.family_index(),
                                               backend=SHA256_BACKENDS["auto"], blocks=self.scorer.blocks)
            self._kernel.age_from(*self.queues.aging_arrays())
            self._kernel.track_changes(self.queues.change_log())

    @property
    def withheld(self) -> frozenset[int]:
        return self._withheld

    def withhold(self, worker_index: int, withheld: bool = True) -> None:
        """Route nothing to this worker (nor plan replicas onto it) until released."""
        if not 0 <= worker_index < len(self.layout.worker_ids):
            raise ValueError(f"no worker index {worker_index}")
        change = self._withheld.union if withheld else self._withheld.difference
        self._withheld = frozenset(change((worker_index,))) | self._unroutable
        self.queues.withhold(self.layout.worker_ids[worker_index], withheld or worker_index in self._unroutable)

    def decide(self, tokens, *, now: float, exclude: Collection[int] = ()) -> ForwardDecided:
        """Pick the worker for a prompt; ``exclude`` holds worker indexes that already failed it."""
        if self._withheld:
            exclude = self._withheld.union(exclude)
        if self._stall_weight and self.queues.running_version != self._stall_seen:
            self._price_stalls()
        kernel = self._kernel
        if kernel is None:
            return self._decide_reference(tokens, now=now, exclude=exclude)
        data, prompt_len = token_buffer(tokens)
        belief, queues = self.belief.values, self.queues
        eligible = self._eligible(exclude) if exclude else None
        # The queue estimates carried to now in the same C call, when nothing has them yet.
        terms = queues.estimate_terms(now) if kernel.__class__ is SparseForwardKernel else None
        if terms is None:
            queue = queues.queue_ms(now=now)
            matched, tier, scores, best, chosen, lam, miss, family_key, complete = kernel.run(data, queue, belief,
                                                                                             eligible)
            arrays = None
        else:
            # Every per-worker output in one buffer, its arrays made only when read (DecisionArrays):
            # what follows reads the winner's values alone, unless the pending ledger holds something.
            ms, correction, occupied = terms
            (arrays, best, chosen, lam, miss, family_key, complete, claimed, code, best_matched,
             best_tier) = kernel.run_out(data, ms, now, correction, occupied, belief, eligible, True)
            queues.adopt_decision(now, ms, arrays)
        pending = self.pending
        keys = None
        if pending is not None:
            # An empty ledger raises nothing (its purge can wait for the next note_sent); the
            # keys are sliced only when something reads them.
            keys = _KERNEL_KEYS
            if len(pending):
                keys = kernel.keys()[:self.lookup.fitting(prompt_len)]
                key_list = keys.tolist()
                # The arrays only for a ledger that holds one of the keys: three views of the
                # buffer were 24 us of a decision in the edge's request path, where the ledger
                # held none of a prompt's keys on almost every decision (each unique suffix).
                shown = None
                if pending.holds_any(key_list, now=now):
                    if arrays is not None:  # the ledger raises matches in place
                        matched, tier, queue = arrays.matched(writable=True), arrays.tier(writable=True), arrays.queue()
                    shown = pending.overlay(key_list, matched, tier, now=now)
                if shown is not None:
                    roomy = self._with_room_wait(prompt_len, matched, tier, belief, queue, now)
                    return self._rescored(prompt_len, matched, tier, keys, shown, family_key,
                                          queue if roomy is None else roomy, belief, eligible, now)
        if prompt_len > queues.room_floor:
            if arrays is not None:  # (the pending ledger's check may have made them already)
                matched, tier, queue = arrays.matched(), arrays.tier(), arrays.queue()
            roomy = self._with_room_wait(prompt_len, matched, tier, belief, queue, now)
            if roomy is not None:
                return self._rescored(prompt_len, matched, tier, keys, None, family_key, roomy, belief, eligible, now)
        if best < 0:
            raise NoEligibleWorkerError("no eligible worker for this request")
        if arrays is None:
            result = ScoreResult(best, self._worker_ids[best], lam, scores, self.scorer, prompt_len, matched, tier,
                                 queue, belief, self.ablation, eligible, complete)
            return self._conclude(prompt_len, matched, tier, family_key, result, chosen, belief, now, miss, keys, None)
        result = score_result_from_arrays(best, self._worker_ids[best], lam, self.scorer, prompt_len, belief,
                                          self.ablation, eligible, complete, arrays, best_matched, best_tier)
        return self._conclude_fused(prompt_len, arrays, claimed, code, family_key, result, chosen, belief, now, miss,
                                    keys)

    def _decide_reference(self, tokens, *, now: float, exclude: Collection[int]) -> ForwardDecided:
        found = self.lookup.lookup(tokens)
        keys = shown = None
        if self.pending is not None:
            keys = self.lookup.query_keys(tokens)
            matched, tier = found.matched.copy(), found.tier.copy()
            shown = self.pending.overlay(keys.tolist(), matched, tier, now=now)
            if shown is not None:
                found = new_lookup_result(found.prompt_len, matched, tier, found.family_key)
        return self._decide_found(found, now=now, exclude=exclude, keys=keys, shown=shown)

    def _with_room_wait(self, prompt_len: int, matched: np.ndarray, tier: np.ndarray, belief: np.ndarray,
                        queue: np.ndarray, now: float) -> np.ndarray | None:
        """The queue estimates with each worker's wait for VRAM room for this prompt
        (``QueueEstimates.room_wait_ms``: own-region workers' from their readings, the others'
        from their edges' room broadcasts) where that is longer, or None when none is. A
        reported queue is the wait of a prompt that needs no new KV; this one needs its tokens
        less what it reuses from VRAM (a DRAM copy is reloaded into new pages): on a worker
        whose running requests pin most of its VRAM until they finish, a long prompt waits for
        them (what SGLang's ``PrefillAdder`` does), however short the queue."""
        queues = self.queues
        if not self.ablation.load_aware or prompt_len <= queues.room_floor:
            return None
        raised = None
        for i in queues.room_workers:
            reused = min(belief.item(i) * matched.item(i), prompt_len) if tier.item(i) == _VRAM else 0.0
            wait = queues.room_wait_ms(i, prompt_len - reused, now=now)
            if wait > queue.item(i):
                if raised is None:
                    raised = queue.copy()
                raised[i] = wait
        return raised

    def _rescored(self, prompt_len: int, matched: np.ndarray, tier: np.ndarray, keys: np.ndarray,
                  shown: np.ndarray, family_key: int | None, queue: np.ndarray, belief: np.ndarray,
                  eligible: np.ndarray | None, now: float) -> ForwardDecided:
        """Score again after the pending ledger raised some matches (the C call scored the view's).

        The fused call's arrays (its fresh matched and tier, the aged queue, the belief snapshot)
        go straight to the C score, which rotates exact ties in the same pass: what
        ``JointScorer.score`` and ``_rotate_ties`` give, without their checks and numpy passes
        (a ledger credit is most decisions while a prompt family's prefix is not yet indexed)."""
        scorer = self.scorer
        try:
            best, chosen, lam, scores = scorer.kernel.choose(float(prompt_len), queue, belief, matched, tier, eligible,
                                                             scorer.kernel_flags(self.ablation), self._last_sent)
        except ValueError:  # a strided array (never the Router's own): the checked path
            result = scorer.score(prompt_len, matched, tier, queue, belief, ablation=self.ablation, eligible=eligible,
                                  native=self.native)
            return self._conclude(prompt_len, matched, tier, family_key, result, self._rotate_ties(result), belief,
                                  now, None, keys, shown)
        if not math.isfinite(scores.item(best)):
            raise NoEligibleWorkerError("no eligible worker for this request")
        result = ScoreResult(best, self._worker_ids[best], lam, scores, scorer, prompt_len, matched, tier, queue,
                             belief, self.ablation)
        return self._conclude(prompt_len, matched, tier, family_key, result, chosen, belief, now, None, keys, shown)

    def decide_from(self, found: LookupResult, *, now: float, exclude: Collection[int] = ()) -> ForwardDecided:
        """Pick the worker for an already looked-up prompt (no pending ledger: it needs the keys)."""
        if self._withheld:
            exclude = self._withheld.union(exclude)
        return self._decide_found(found, now=now, exclude=exclude, keys=None, shown=None)

    def _decide_found(self, found: LookupResult, *, now: float, exclude: Collection[int],
                      keys: np.ndarray | None, shown: np.ndarray | None) -> ForwardDecided:
        belief = self.belief.values
        queue = self.queues.queue_ms(now=now)
        roomy = self._with_room_wait(found.prompt_len, found.matched, found.tier, belief, queue, now)
        result = self.scorer.score(
            found.prompt_len,
            found.matched,
            found.tier,
            queue if roomy is None else roomy,
            belief,
            ablation=self.ablation,
            eligible=self._eligible(exclude) if exclude else None,
            native=self.native,
        )
        return self._conclude(found.prompt_len, found.matched, found.tier, found.family_key, result,
                              self._rotate_ties(result), belief, now, None, keys, shown)

    def _copy_may_move(self, chosen: int, now: float) -> bool:
        """Whether a copy charge could move this decision: only one on the winner can (every
        other score only rises), and a worker whose requests pin no more of its VRAM than
        ``score.copy_pinned_floor`` is charged nothing (its pinned share, read without building
        its room steps), so that a decision whose winner has VRAM to spare reads no arrays."""
        return self.queues.pinned_share(chosen, now=now) > self._copy_floor

    def _charge_copy(self, prompt_len: int, matched: np.ndarray, tier: np.ndarray, result: ScoreResult, chosen: int,
                     belief: np.ndarray, now: float) -> tuple[ScoreResult, int] | None:
        """The decision with the copy charge (``score.copy_weight``) added to every score, when
        its winner holds less of the prompt than another eligible worker; None when it holds the
        most (every other worker's score then only rises) or the result is charged already.

        A worker holding less of a prompt than the best holder copies the difference into its
        cache, and a full cache makes room by evicting as much, which its own groups recompute
        later: ``weight x pressure_r x (1 + lambda) x beta_r x (most - effective_r)``, with the
        decision's lambda and effective matches as the score takes them (belief x match, within
        the prompt; remote ones only with cross-region reuse). ``pressure_r`` (``copy_pressure``)
        stands for how likely the eviction is to hit a prefix still in use: 0 while the share
        of the worker's VRAM its requests pin (``QueueEstimates.pinned_share``, from its room
        steps) is at most ``score.copy_pinned_floor``, then rising to 1 with the pool wholly
        pinned. With VRAM to spare the cache's oldest entries go first, and those are the cold
        ones (ungated, the charge concentrated groups on 16,384-token emulated workers at c = 16:
        P99 619 / 700 ms against 506 / 531; in proportion to the pinned share, whose values
        there were 0-0.7, it cost 2 % of their throughput). A real SGLang reports no room steps
        but the KV its requests hold (``WorkerPinnedReported``); a remote worker's share comes
        only from its room steps in its edge's broadcasts, so a remote SGLang worker is not
        charged. The scores are the decision's own plus the charges, so lambda and every other
        term stay as scored. Called only where ``_copy_may_move``: the winner's VRAM is pinned past the floor."""
        if result.copies is not None:
            return None
        effective = np.minimum(belief * matched, float(prompt_len))
        if not self.ablation.cross_region:
            effective = np.where(self._local, effective, 0.0)
        if effective.item(chosen) >= effective.max():
            return None  # (most decisions: the winner holds the most; the scores are not read)
        scores = result.scores
        eligible = np.isfinite(scores)
        if not eligible.any():
            return None
        short = float(effective[eligible].max()) - effective
        if short.item(chosen) <= 0.0:
            return None
        queues = self.queues
        pressure = np.zeros(len(short))
        for i in queues.pinned_workers:
            pressure[i] = copy_pressure(queues.pinned_share(i, now=now), self._copy_floor)
        copies = np.maximum(short, 0.0) * pressure * (self._copy_weight * (1.0 + result.lam)) * self.scorer.beta
        if not copies.any():
            return None
        charged = scores + copies
        best = int(charged.argmin())
        result = ScoreResult(best, self._worker_ids[best], result.lam, charged, self.scorer, prompt_len, matched, tier,
                             result.queue_ms, belief, self.ablation, None, True, copies)
        winner = self._rotate_ties(result)
        self.copy_charges[COPY_MOVED if winner != chosen else COPY_KEPT] += 1
        return result, winner

    def _rotate_ties(self, result: ScoreResult) -> int:
        chosen = result.chosen
        scores = result.scores
        ties = np.flatnonzero(scores == scores.item(chosen))
        if ties.size > 1:
            # Exact ties (idle non-holders of one region) would all go to the lowest index and
            # pile up inside one load-report interval: rotate among them, least recently sent first.
            chosen = int(ties[np.argmin(self._last_sent[ties])])
        return chosen

    def _eligible(self, exclude: Collection[int]) -> np.ndarray:
        eligible = np.ones(len(self.layout.worker_ids), dtype=bool)
        eligible[list(exclude)] = False
        return eligible

    def _conclude(self, prompt_len: int, matched: np.ndarray, tier: np.ndarray, family_key: int | None,
                  result: ScoreResult, chosen: int, belief: np.ndarray, now: float, miss: int | None,
                  keys: np.ndarray | None, shown: np.ndarray | None) -> ForwardDecided:
        """Count the dispatch, consult the hot-prefix detector, note it as pending, build the decision.

        ``miss`` is the decision's ``MISS_*`` summary when the fused C call computed it already;
        ``keys`` the prompt's query keys that fit it (None without the pending ledger;
        ``_KERNEL_KEYS``: the fused call's, not sliced yet) and
        ``shown`` the view's matches when the ledger raised some (None when it did not).
        """
        if self._copy_weight and self._copy_may_move(chosen, now):
            charged = self._charge_copy(prompt_len, matched, tier, result, chosen, belief, now)
            if charged is not None:
                result, chosen = charged
                miss = None  # the C call's summary was of its own winner
        self._sent_count = sent = self._sent_count + 1
        self._last_sent[chosen] = sent
        worker = self._worker_ids[chosen]
        claimed = int(matched.item(chosen))
        local = self._local_list[chosen]
        migration = None
        # A local hit is never a miss of its family: the detector has nothing to count.
        if self._migration and family_key is not None and not (local and claimed):
            found = new_lookup_result(prompt_len, matched, tier, family_key)
            migration = self._observe(found, result, chosen, now, miss)
        code = tier.item(chosen)
        # Prefill (and reload) time the request adds to the chosen worker's queue.
        reused = min(belief.item(chosen) * float(claimed), float(prompt_len))
        # The request's own terms of the score at λ = 0, the work itself, not its weight
        # (request_terms' statement, inline: prefill + reload).
        work = self._beta_list[chosen] * (prompt_len - reused) + (self._gamma if code == _DRAM else 0.0) * reused
        dispatch = self.queues.note_dispatched(worker, work, now=now)
        from_ledger = shown is not None and claimed > shown.item(chosen)
        # A full match leaves no longer length to note, but one the ledger credited is still
        # recorded, for a response that reuses less to refute it.
        if keys is not None and (claimed < prompt_len or from_ledger):
            if keys is _KERNEL_KEYS:
                keys = self._kernel.keys()[:self.lookup.fitting(prompt_len)]
            # Credited once its prefill starts (after the queue ahead of it): a request sent there
            # later waits for it and finds it. Cached once its own prefill is done too.
            starts_at = now + result.queue_ms.item(chosen) / 1000.0
            ready_at = starts_at + work / 1000.0
            self.pending.note_sent(chosen, keys, prompt_len, claimed, starts_at=starts_at, ready_at=ready_at,
                                   now=now, dispatch=dispatch)
        # What was ahead of it there, and its own prefill: a wait for other edges' work is no prefill rate.
        self.rates.sent(dispatch, chosen, now=now, ahead_ms=result.queue_ms.item(chosen), work_ms=work)
        return self._decided(worker, chosen, claimed, code, result, prompt_len, local, migration, from_ledger, dispatch)

    def _conclude_fused(self, prompt_len: int, arrays: DecisionArrays, claimed: int, code: int,
                        family_key: int | None, result: ScoreResult, chosen: int, belief: np.ndarray, now: float,
                        miss: int, keys: np.ndarray | None) -> ForwardDecided:
        """``_conclude`` for a fused decision the pending ledger did not raise: the winner's
        ``claimed`` match and tier ``code`` come from the C call, its queue from the output
        buffer, and the match and tier arrays are made only for the hot-prefix detector's
        observation. The same steps, in the same order, with the same values."""
        if self._copy_weight and self._copy_may_move(chosen, now):
            matched, tier = arrays.matched(), arrays.tier()
            charged = self._charge_copy(prompt_len, matched, tier, result, chosen, belief, now)
            if charged is not None:
                return self._conclude(prompt_len, matched, tier, family_key, *charged, belief, now, None, keys, None)
        self._sent_count = sent = self._sent_count + 1
        self._last_sent[chosen] = sent
        worker = self._worker_ids[chosen]
        local = self._local_list[chosen]
        migration = None
        if self._migration and family_key is not None and not (local and claimed):
            found = new_lookup_result(prompt_len, arrays.matched(), arrays.tier(), family_key)
            migration = self._observe(found, result, chosen, now, miss)
        reused = min(belief.item(chosen) * float(claimed), float(prompt_len))
        work = self._beta_list[chosen] * (prompt_len - reused) + (self._gamma if code == _DRAM else 0.0) * reused
        dispatch = self.queues.note_dispatched(worker, work, now=now)
        ahead = arrays.queue_at(chosen)
        if keys is not None and claimed < prompt_len:
            if keys is _KERNEL_KEYS:
                keys = self._kernel.keys()[:self.lookup.fitting(prompt_len)]
            starts_at = now + ahead / 1000.0
            ready_at = starts_at + work / 1000.0
            self.pending.note_sent(chosen, keys, prompt_len, claimed, starts_at=starts_at, ready_at=ready_at,
                                   now=now, dispatch=dispatch)
        self.rates.sent(dispatch, chosen, now=now, ahead_ms=ahead, work_ms=work)
        return self._decided(worker, chosen, claimed, code, result, prompt_len, local, migration, False, dispatch)

    def _decided(self, worker: str, chosen: int, claimed: int, code: int, result: ScoreResult, prompt_len: int,
                 local: bool, migration: MigrationPlanned | None, from_ledger: bool, dispatch: int) -> ForwardDecided:
        """The decision both conclusions return."""
        return _new_forward_decided(worker, chosen, self.worker_regions[chosen], claimed,
                                    _TIER_BY_CODE[code] if code < 3 else Tier(code), result.lam, prompt_len, local,
                                    result, migration, self.top_k, from_ledger, dispatch)

    def _observe(self, found: LookupResult, result: ScoreResult, chosen: int, now: float,
                 flags: int | None) -> MigrationPlanned | None:
        """Report a local miss to the hot-prefix detector: ``hot.observe`` of the full observation.

        The miss is counted from a C summary of the decision (``flags``, or computed here); the
        ``DecisionObserved`` is built only when a trigger is due and can fire (no local holder
        and no remote match at its first length cannot plan, nor can a region without an idle
        destination), which gives the same plans and detector state.
        """
        if flags is None:
            flags = self._miss_summary.flags(found.matched, result.scores, self.queues.queue_ms(now=now), chosen)
        holders = bool(flags & MISS_LOCAL_HOLDER)
        trigger = self.hot.note_miss(found.family_key, now=now, holders=holders,
                                     lost_to_load=bool(flags & MISS_LOST_TO_LOAD))
        if trigger is None:
            return None
        if not (holders or flags & MISS_REMOTE_WORTH):
            self.hot.note_unplanned(trigger, NO_REMOTE_MATCH)
            return None
        matched, ids = found.matched, self.layout.worker_ids
        local_holders = [ids[i] for i in self._local_indexes if matched.item(i) > 0]
        if not self.hot.has_destination(local_holders, ids[chosen], now=now):
            self.hot.note_unplanned(trigger, NO_IDLE_WORKER)
            return None  # nowhere to put a replica: plan would say None
        return self.hot.plan(self._observation(found, result.scores, chosen, now), trigger, now=now)

    def _observation(self, found: LookupResult, scores: np.ndarray, chosen: int, now: float) -> DecisionObserved:
        matched = found.matched
        ids = self.layout.worker_ids
        local_idx = np.flatnonzero(self._local & (matched > 0))
        remote_idx = np.flatnonzero(~self._local & (matched > 0))
        remote_best = None
        if remote_idx.size:
            best = int(remote_idx[np.argmax(matched[remote_idx])])
            remote_best = (ids[best], self.worker_regions[best], int(matched[best]))
        # Every local holder lost to load: each would have won with the winner's queue term.
        lost_to_load = False
        if local_idx.size and chosen not in set(local_idx.tolist()):
            queue = self.queues.queue_ms(now=now)
            unloaded = scores[local_idx] - queue[local_idx] + queue[chosen]
            lost_to_load = bool(np.all(unloaded < scores[chosen]))
        return DecisionObserved(
            family_key=found.family_key,
            prompt_len=found.prompt_len,
            chosen_worker=ids[chosen],
            local_holders=tuple((ids[i], int(matched[i])) for i in local_idx.tolist()),
            remote_best=remote_best,
            local_holders_lost_to_load=lost_to_load,
        )

    # -- feedback -----------------------------------------------------------------------------

    def pending_matches(self, tokens, matched: np.ndarray, tier: np.ndarray, *, now: float) -> np.ndarray | None:
        """``matched``/``tier`` raised in place by the pending ledger, read-only (for inspection):
        the view's matches when any was raised, else None (also without a ledger)."""
        if self.pending is None:
            return None
        keys = self.lookup.query_keys(np.asarray(tokens, dtype=np.uint32))
        return self.pending.overlay(keys.tolist(), matched, tier, now=now, read_only=True)

    def explain_shortfall(self, tokens, worker_index: int, claimed_tokens: int,
                          claimed_tier: Tier | None = None) -> str | None:
        """Why worker ``worker_index`` reused less of the prompt ``tokens`` than the
        ``claimed_tokens`` the edge credited it with (in ``claimed_tier``, the decision's), as far
        as the index can tell:

        - ``SHORTFALL_DRAM``: the claim was on the worker's DRAM copy (the decision's tier), or
          the view lists it there now. The worker holds the prefix but found no VRAM to reload
          it into: a loaded worker whose VRAM is pinned by the requests ahead (on 96 K-token
          GPUs, one or two long prompts). The decision's tier tells it without a lookup, and
          still does when the worker's recompute of the prompt is back in the view by the time
          the response is (the daemon learns the reuse at the request's end).
        - ``SHORTFALL_EVICTED``: the view no longer credits the worker with the claim. The index
          has applied the eviction of that prefix from that worker (turnover after the decision)
          or never listed it (a claim of the pending ledger).
        - None: the view lists the claim in VRAM and the worker did not deliver it: a false or
          stale entry, which is what the cache belief discounts.

        Why it matters (issue 28): on the testbed ~a quarter of the long prompts' claims fell
        short, nearly all DRAM copies that a busy holder could not reload; counting them lowered
        the holders' belief and with it every later claim on them, true or not, so the edge sent
        long prompts away from their holders (>=32 K reuse 36 % against Dynamo's 43 %). One
        lookup over the claimed prefix, on shortfalls only."""
        if claimed_tokens <= 0:
            return None
        if claimed_tier == Tier.DRAM:
            return SHORTFALL_DRAM
        if tokens is None:
            return None
        found = self.lookup.lookup(np.asarray(tokens)[:claimed_tokens])
        if int(found.matched.item(worker_index)) < claimed_tokens:
            return SHORTFALL_EVICTED
        if int(found.tier.item(worker_index)) == Tier.DRAM:
            return SHORTFALL_DRAM
        return None

    def on_failed(self, worker_index: int, *, dispatch: int | None = None, now: float | None = None) -> None:
        """A worker failed a request before its first token: it will not hold that prompt. With
        the decision's ``dispatch`` (and ``now``), its charge is retired too."""
        if self.pending is not None:
            self.pending.forget(worker_index)
        if dispatch is not None:
            if now is None:
                raise ValueError("on_failed with a dispatch needs now")
            self.queues.retire(dispatch, now=now)
            self.rates.dropped(dispatch)

    def on_aborted(self, dispatch: int, *, now: float) -> None:
        """The decision's request ended otherwise (the client went away, the worker failed
        mid-response): retire what is left of its charge; it teaches nothing. A no-op after
        ``on_finished`` or ``on_failed``."""
        self.queues.retire(dispatch, now=now)
        self.rates.dropped(dispatch)
        if self.pending is not None:
            self.pending.drop_dispatch(dispatch)

    def on_first_token(self, dispatch: int, *, now: float) -> None:
        """The decision's request produced its first token (its prefill is done): retire its
        prefill charge, credit its prompt from now, time its prefill."""
        self.queues.retire_prefill(dispatch, now=now)
        if self.pending is not None:
            self.pending.mark_ready(dispatch, now=now)
        self.rates.first_token(dispatch, now=now)

    def on_finished(self, dispatch: int, *, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                    now: float, worker_latency_s: float | None = None) -> int | None:
        """The decision's request ended: retire the rest of its charge and learn its worker's
        rates from it (``cached_tokens`` as the worker reported them, ``worker_latency_s`` its
        own time for the request if it said: ``LearnedRates.finished``). Returns the worker's
        index when one of its learned rates changed, else None."""
        self.queues.retire(dispatch, now=now)
        if self.pending is not None:
            # A worker that reused less than it was credited with did not hold the rest.
            self.pending.refute(dispatch, int(cached_tokens))
        worker = self.rates.worker_of(dispatch)
        if not self.rates.finished(dispatch, uncached_tokens=max(0, int(prompt_tokens) - int(cached_tokens)),
                                   output_tokens=int(output_tokens), now=now,
                                   worker_latency_s=worker_latency_s):
            return None
        # (the fleet's factor may have moved too; a sample may also leave every median as it was)
        learned = self.rates.prefill_rates()
        if self._stall_weight:
            self._beta_list = tuple(learned.tolist())
            self._price_stalls()  # (the scorer keeps its rates when the prices come out the same)
        elif self._rates_moved(learned) and self.scorer.set_prefill_rates(learned):
            self._beta_list = self.scorer.beta_list
        return worker

    def _rates_moved(self, learned: np.ndarray) -> bool:
        """Whether a learned prefill rate is off the one scored with by more than
        ``RESCORE_RATE_TOLERANCE`` of it (or the scorer's rates never were learned ones)."""
        scored = self.scorer.beta_list
        tolerance = RESCORE_RATE_TOLERANCE
        if len(scored) <= SMALL_FLEET:
            return any(abs(rate - was) > tolerance * was for rate, was in zip(learned.tolist(), scored))
        was = self.scorer.beta
        return bool((np.abs(learned - was) > tolerance * was).any())

    def _price_stalls(self) -> None:
        """Score each worker's prefill at its rate times 1 + min(1, weight x the requests it is
        decoding), which the prefill would pause (``score.decode_stall_weight``). The running
        counts are own-region readings; a remote worker counts as the own region's least busy
        worker (the region's floor, not a guess that would favour or shun the remote ones).
        The charges and the rates learned stay the prefill's own time (``_beta_list``)."""
        queues = self.queues
        self._stall_seen = queues.running_version
        running = queues.running
        local = self._local
        if not local.all():
            floor = running[local].min() if local.any() else 0.0
            running = np.where(local, running, floor)
        stall = np.minimum(1.0, self._stall_weight * running)
        self.scorer.set_prefill_rates(np.array(self._beta_list) * (1.0 + stall))

    def prefill_price(self, worker: int) -> float:
        """The multiple of worker ``worker``'s prefill rate the latest decision scored it at
        (``score.decode_stall_weight``; 1 when off)."""
        return self.scorer.beta_list[worker] / self._beta_list[worker]

    def on_response(
        self,
        worker: str,
        *,
        claimed_tokens: int,
        reused_tokens: int,
        queue_vector: Mapping[str, float] | None = None,
        now: float,
        tokens=None,
        claimed_tier: Tier | None = None,
    ) -> None:
        """Fold a response into the cache belief and (for a remote region) the queue estimates.

        With the decision's ``claimed_tier`` and the prompt's ``tokens``, a shortfall
        (``reused < claimed``) the index explains is not held against the worker
        (``explain_shortfall``: a DRAM copy a busy worker could not reload, or an eviction the
        index has since recorded). The belief is for claims the index shows in VRAM and the
        worker does not deliver (keyless false hits, evictions not yet propagated). Without
        either every shortfall counts."""
        index = self.layout.worker_index(worker)
        cause = (self.explain_shortfall(tokens, index, claimed_tokens, claimed_tier)
                 if reused_tokens < claimed_tokens else None)
        if cause is None:
            self.belief.observe(index, claimed_tokens, reused_tokens)
        else:
            self.explained_shortfalls[cause] += 1
        region = self.worker_regions[index]
        if queue_vector and region != self.region:
            self.queues.on_piggyback(region, queue_vector, now=now)
