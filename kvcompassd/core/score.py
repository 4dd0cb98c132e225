"""The joint score of paper §3.4 (DESIGN.md §5), vectorised over every worker of every region.

    score(r) = WAN(o, r) + Tq(r) + (1 + lambda) * beta_r * (L - b_r * m_r)
               + gamma * b_r * m_r * [t_r = DRAM]
    lambda   = min(lambda_max, min_r' Tq(r') / tau)

``o`` is the edge's region, ``L`` the prompt length, ``m_r``/``t_r`` worker r's longest indexed
match and its tier, ``b_r`` its cache belief, ``Tq`` the queue estimate. The request goes to
the minimum over all workers (ties: the first in config order). ``WAN`` is the round trip by
default (the request goes there and the first token comes back) or the one-way latency when
``score.wan = "one_way"``.

The per-worker constants (WAN, beta) are precomputed in config worker order. When the arrays
have the dtypes the Router produces (int64 matches, uint8 tiers, float64 queue and belief, bool
eligibility), one decision is one C loop (``lookup_plan.ScoreKernel``: the same operations in the
same order, bit-identical); otherwise, or with ``native=False``, a dozen numpy operations.

With ``score.copy_weight`` set, the Router adds a charge for the copy a non-holder would make
to the decided scores, where the winner is not a top holder (``Router._charge_copy``;
``ScoreResult.copies``, ``ScoreTerms.copy_ms``); with it at 0 (the default) the score is the
paper's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .ablation import FULL, Ablation
from .config import ClusterConfig
from .events import Tier
from .lookup_plan import (SCORE_CROSS_REGION, SCORE_LOAD_AWARE, SCORE_TIER_AWARE, SMALL_FLEET, ScoreBlocks,
                          ScoreKernel, top_k)

__all__ = ["JointScorer", "NoEligibleWorkerError", "ScoreInputError", "ScoreResult", "ScoreTerms",
           "score_result_from_arrays"]

_TIERS = (Tier.ABSENT, Tier.VRAM, Tier.DRAM)


class ScoreInputError(ValueError):
    """Arrays passed to the scorer do not match the worker list, or the prompt length is bad."""


class NoEligibleWorkerError(ScoreInputError):
    """Every worker was excluded from the decision."""


def joint_score(wan_ms, queue_ms, cost_per_token, prompt_len, effective, reload_per_token):
    """THE joint score (paper §3), the one statement of it in Python, on floats or arrays:

        score = WAN + Tq + (1 + λ)·β·(L − e) + γ·e·[DRAM],   e = min(b·m, L)

    with ``cost_per_token`` = (1 + λ)·β and ``reload_per_token`` = γ for DRAM, else 0. It is
    written as the C kernel (``ludo_c``) computes it, WAN + Tq + c·L + e·(r − c), so that the
    reference path (``JointScorer``) and the kernel agree to the bit and break ties alike
    (tests/test_score.py, tests/test_lookup_plan.py). ``request_terms`` splits it into terms.
    """
    return wan_ms + queue_ms + cost_per_token * prompt_len + effective * (reload_per_token - cost_per_token)


def request_terms(cost_per_token, prompt_len, effective, reload_per_token):
    """The request's own terms of ``joint_score``: prefilling the ``prompt_len - effective``
    tokens it does not reuse, and reloading the ``effective`` ones it reuses. ``ScoreResult``
    shows them; the Router charges them (at λ = 0) as the work it sends a worker."""
    return cost_per_token * (prompt_len - effective), reload_per_token * effective


@dataclass(frozen=True, slots=True)
class ScoreTerms:
    """One worker's score broken into its terms (ms), for logs and inspection."""

    worker: str
    region: str
    wan_ms: float
    queue_ms: float
    prefill_ms: float
    reload_ms: float
    matched: int
    tier: Tier
    belief: float
    total: float
    # The copy's charge (``score.copy_weight``; 0 when off or when this worker holds the most).
    copy_ms: float = 0.0


class ScoreResult:
    """A scored decision; read-only. Arrays are in config worker order.

    The result keeps references to the arrays it was scored from (copying them would cost more
    than the rest of the decision): pass arrays nobody mutates afterwards. ``CacheBelief.values``
    and ``QueueEstimates.queue_ms()`` return immutable snapshots; the Router's per-request
    match and tier arrays are fresh.

    The Router's fused decision makes it from the C call's one output buffer
    (``lookup_plan.DecisionArrays``) and the winner's match and tier: the winner's terms
    (``top(1)``, ``total``, what the daemon reads per request) come from those without an
    array; ``scores``, ``queue_ms`` and the other workers' terms make the arrays' views when
    first read.
    """

    __slots__ = ("chosen", "worker", "lam", "_state")

    def __init__(self, chosen: int, worker: str, lam: float, scores: np.ndarray, scorer: JointScorer,
                 prompt_len: int, matched: np.ndarray, tier: np.ndarray, queue: np.ndarray,
                 belief: np.ndarray, ablation: Ablation, eligible: np.ndarray | None = None,
                 complete: bool = True, copies: np.ndarray | None = None) -> None:
        # Written through the slot descriptors (``__setattr__`` refuses).
        _set_chosen(self, chosen)
        _set_worker(self, worker)
        _set_lam(self, lam)
        # The sparse C call scores only the workers that can win (lookup_plan.SparseForwardKernel):
        # the others' scores are computed when something reads them (the same C loop, same bits).
        # [scores, scorer, prompt_len, matched, tier, queue, belief, ablation, eligible, complete,
        #  top (k, the top k's terms) once asked for, DecisionArrays or None, the chosen's match
        #  and tier when the arrays are not made yet, the copy charges added to the scores or None]
        _set_state(self, [scores, scorer, prompt_len, matched, tier, queue, belief, ablation, eligible, complete,
                          None, None, 0, 0, copies])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ScoreResult is read-only")

    def __repr__(self) -> str:
        return f"ScoreResult(worker={self.worker!r}, chosen={self.chosen}, lam={self.lam:.4g}, total={self.total:.4g})"

    def _array(self, slot: int, name: str) -> np.ndarray:
        state = self._state
        array = state[slot]
        if array is None:
            array = state[slot] = getattr(state[_ARRAYS], name)()
        return array

    @property
    def _matched(self) -> np.ndarray:
        return self._array(_MATCHED, "matched")

    @property
    def _tier(self) -> np.ndarray:
        return self._array(_TIER, "tier")

    @property
    def _complete(self) -> bool:
        return self._state[_COMPLETE]

    @property
    def copies(self) -> np.ndarray | None:
        """The copy charges added to the scores (``score.copy_weight``), or None: not charged."""
        return self._state[_COPIES]

    @property
    def queue_ms(self) -> np.ndarray:
        """The queue estimates the decision was scored with (ms, worker order)."""
        return self._array(_QUEUE, "queue")

    @property
    def scores(self) -> np.ndarray:
        """Every worker's score (worker order; +inf for an ineligible one)."""
        state = self._state
        scores = self._array(_SCORES, "scores")
        if not state[_COMPLETE]:
            s = state[_SCORER]
            _, _, scores = s.kernel.run(float(state[_PROMPT_LEN]), self.queue_ms, state[_BELIEF], self._matched,
                                        self._tier, state[_ELIGIBLE], s.kernel_flags(state[_ABLATION]))
            state[_SCORES] = scores
            state[_COMPLETE] = True
        return scores

    @property
    def total(self) -> float:
        scores = self._state[_SCORES]  # the winner is always scored
        if scores is None:
            return self._state[_ARRAYS].score_at(self.chosen)
        return float(scores.item(self.chosen))

    def terms(self, index: int) -> ScoreTerms:
        """Worker ``index``'s score split into its terms (recomputed here, off the hot path)."""
        index = int(index)
        return self._terms(index, self.total if index == self.chosen else float(self.scores.item(index)))

    def _terms(self, index: int, total: float) -> ScoreTerms:
        state = self._state
        s, ab, prompt_len = state[_SCORER], state[_ABLATION], state[_PROMPT_LEN]
        arrays = state[_ARRAYS]
        if arrays is not None and index == self.chosen and state[_MATCHED] is None:
            matched, raw_tier = state[_CHOSEN_MATCHED], state[_CHOSEN_TIER]
            queue = arrays.queue_at(index)
        else:
            matched = int(self._matched.item(index))
            raw_tier = self._tier.item(index)
            queue = float(self.queue_ms.item(index))
        belief = float(state[_BELIEF].item(index))
        tier = _TIERS[raw_tier] if 0 <= raw_tier < 3 else Tier.ABSENT  # the invalid field 11: no tier
        if not ab.cross_region and not s.local_list[index]:
            effective = 0.0
        else:
            effective = min(belief * matched, prompt_len)
        prefill, reload = request_terms((1.0 + self.lam) * s.beta_list[index], prompt_len, effective,
                                        s.gamma if ab.tier_aware and tier is Tier.DRAM else 0.0)
        copies = state[_COPIES]
        return ScoreTerms(
            s.worker_ids[index],
            s.worker_regions[index],
            s.wan_list[index],
            queue if ab.load_aware else 0.0,
            prefill,
            reload,
            matched,
            tier,
            belief,
            total,
            0.0 if copies is None else float(copies.item(index)),
        )

    def top(self, k: int = 3) -> tuple[ScoreTerms, ...]:
        """The ``k`` best-scoring eligible workers, best first (ties in config order).

        Built when first asked for (logs, metrics, inspection), then kept: a decision's readers
        ask for the same ``k`` several times, and nothing is built for a decision nobody reads.
        """
        if k <= 0:
            return ()
        state = self._state
        cached = state[_TOP]
        if cached is not None and cached[0] == k:
            return cached[1]
        if k == 1:
            total = self.total
            top = (self._terms(self.chosen, total),) if math.isfinite(total) else ()
        else:
            scores = self.scores
            top = tuple(self._terms(i, s) for i in top_k(scores, k) if math.isfinite(s := scores.item(i)))
        state[_TOP] = (k, top)
        return top


(_SCORES, _SCORER, _PROMPT_LEN, _MATCHED, _TIER, _QUEUE, _BELIEF, _ABLATION, _ELIGIBLE, _COMPLETE, _TOP, _ARRAYS,
 _CHOSEN_MATCHED, _CHOSEN_TIER, _COPIES) = range(15)
_set_chosen, _set_worker, _set_lam, _set_state = (getattr(ScoreResult, name).__set__ for name in ScoreResult.__slots__)
_new_result = object.__new__


def score_result_from_arrays(chosen: int, worker: str, lam: float, scorer: JointScorer, prompt_len: int,
                             belief: np.ndarray, ablation: Ablation, eligible: np.ndarray | None, complete: bool,
                             arrays, chosen_matched: int, chosen_tier: int) -> ScoreResult:
    """A ``ScoreResult`` over a fused decision's ``lookup_plan.DecisionArrays`` (the Router's
    per-request path): no array is made until read; ``chosen_matched``/``chosen_tier`` are the
    winner's (``chosen``, the argmin)."""
    result = _new_result(ScoreResult)
    _set_chosen(result, chosen)
    _set_worker(result, worker)
    _set_lam(result, lam)
    _set_state(result, [None, scorer, prompt_len, None, None, None, belief, ablation, eligible, complete, None,
                        arrays, chosen_matched, chosen_tier, None])
    return result


class JointScorer:
    """Scores every worker for requests entering at an edge of ``origin_region``."""

    def __init__(self, cfg: ClusterConfig, origin_region: str) -> None:
        if origin_region not in cfg.region_names():
            raise ScoreInputError(f"unknown origin region {origin_region!r}")
        self.origin_region = origin_region
        self.worker_ids: tuple[str, ...] = cfg.worker_ids()
        self.worker_regions: tuple[str, ...] = tuple(w.region for w in cfg.workers)
        self.n_workers = len(self.worker_ids)
        self._shape = (self.n_workers,)
        params = cfg.score
        latency = cfg.rtt_ms if params.wan == "rtt" else cfg.one_way_ms
        self.wan_ms = _frozen(np.array([latency(origin_region, r) for r in self.worker_regions], dtype=np.float64))
        # The C loop reads beta from this buffer, so a learned rate (``set_prefill_rates``) takes
        # effect at the next decision; everyone else reads the read-only view.
        self._beta_buffer = np.array([w.prefill_ms_per_token for w in cfg.workers], dtype=np.float64)
        self.beta = _frozen(self._beta_buffer.view())
        local = np.array([r == origin_region for r in self.worker_regions], dtype=bool)
        self.is_local = _frozen(local)
        # Plain-Python copies for the per-candidate breakdown (top-k), where numpy scalars cost more.
        self.wan_list: tuple[float, ...] = tuple(self.wan_ms.tolist())
        self.beta_list: tuple[float, ...] = tuple(self.beta.tolist())
        self.local_list: tuple[bool, ...] = tuple(local.tolist())
        self.lambda_max = params.lambda_max
        self.tau_ms = params.tau_ms
        self.gamma = params.gamma_ms_per_token
        # Reload cost per effective matched token, indexed by tier (only DRAM pays).
        # 256 entries so any uint8 is a valid index: only DRAM (2) pays, other codes never do.
        reload_by_tier = np.zeros(256, dtype=np.float64)
        reload_by_tier[Tier.DRAM] = self.gamma
        self._reload_by_tier = _frozen(reload_by_tier)
        self._local_factor = _frozen(local.astype(np.float64))
        # Without cross-region reuse remote workers are not eligible, unless there is no local one.
        penalty = np.where(local, 0.0, np.inf) if local.any() else np.zeros(self.n_workers)
        self._remote_penalty = _frozen(penalty)
        self._flags: dict[Ablation, int] = {}
        self._kernel = ScoreKernel(self.wan_ms, self._beta_buffer, self._local_factor, self._remote_penalty,
                                   gamma=self.gamma, lambda_max=self.lambda_max, tau=self.tau_ms)
        self._blocks = ScoreBlocks(self._kernel)  # the pruned C score's bounds (lookup_plan.SparseForwardKernel)

    def set_prefill_rates(self, ms_per_token: np.ndarray) -> bool:
        """Score the workers at these prefill rates from now on (rates the edge learned);
        returns whether they differ from the rates scored with until now."""
        rates = np.asarray(ms_per_token, dtype=np.float64)
        if rates.shape != self._shape:
            raise ScoreInputError(f"prefill rates must be {self.n_workers} finite numbers > 0")
        values = tuple(rates.tolist())
        # An edge's few workers checked in Python (it sets them after most responses: 0.7 µs
        # for 4 rates against numpy's 4.0), the simulator's many in numpy.
        if not (all(0.0 < v < math.inf for v in values) if len(values) <= SMALL_FLEET
                else bool(np.isfinite(rates).all() and (rates > 0.0).all())):
            raise ScoreInputError(f"prefill rates must be {self.n_workers} finite numbers > 0")
        if values == self.beta_list:
            return False
        np.copyto(self._beta_buffer, rates)
        self._blocks.refresh()
        self.beta_list = values
        return True

    def _bad_shape(self, name: str, array: object) -> ScoreInputError:
        shape = getattr(array, "shape", type(array).__name__)
        return ScoreInputError(f"{name} must be a numpy array of shape {self._shape}, got {shape}")

    def score(
        self,
        prompt_len: int,
        matched: np.ndarray,
        tier: np.ndarray,
        queue_ms: np.ndarray,
        belief: np.ndarray,
        *,
        ablation: Ablation = FULL,
        eligible: np.ndarray | None = None,
        native: bool = True,
    ) -> ScoreResult:
        """Score all workers and pick the minimum.

        ``matched`` (tokens, <= prompt_len), ``tier`` (uint8 ``Tier`` values), ``queue_ms`` and
        ``belief`` are arrays in config worker order; ``eligible`` (bool) can exclude workers,
        e.g. unreachable ones. ``native=False`` forces the numpy reference path.
        """
        shape = self._shape
        if matched.__class__ is not np.ndarray or matched.shape != shape:
            raise self._bad_shape("matched", matched)
        if tier.__class__ is not np.ndarray or tier.shape != shape:
            raise self._bad_shape("tier", tier)
        if queue_ms.__class__ is not np.ndarray or queue_ms.shape != shape:
            raise self._bad_shape("queue_ms", queue_ms)
        if belief.__class__ is not np.ndarray or belief.shape != shape:
            raise self._bad_shape("belief", belief)
        if prompt_len.__class__ is not int:
            if not isinstance(prompt_len, (int, np.integer)) or isinstance(prompt_len, bool):
                raise ScoreInputError(f"prompt_len must be an integer, got {prompt_len!r}")
            prompt_len = int(prompt_len)
        if prompt_len < 0:
            raise ScoreInputError(f"prompt_len must be >= 0, got {prompt_len}")

        if eligible is not None and (eligible.__class__ is not np.ndarray or eligible.shape != shape):
            raise self._bad_shape("eligible", eligible)
        if native and matched.dtype == _INT64 and tier.dtype == _UINT8 and queue_ms.dtype == _FLOAT64 \
                and belief.dtype == _FLOAT64 and (eligible is None or eligible.dtype == _BOOL):
            flags = self.kernel_flags(ablation)
            try:
                chosen, lam, scores = self._kernel.run(float(prompt_len), queue_ms, belief, matched, tier,
                                                       eligible, flags)
            except ValueError:  # a strided view: the C loop reads contiguous arrays
                chosen, lam, scores = self._kernel.run(
                    float(prompt_len), _contiguous(queue_ms), _contiguous(belief), _contiguous(matched),
                    _contiguous(tier), None if eligible is None else _contiguous(eligible), flags)
        else:
            chosen, lam, scores = self._score_numpy(prompt_len, matched, tier, queue_ms, belief, ablation, eligible)
        if not math.isfinite(scores.item(chosen)):
            raise NoEligibleWorkerError("no eligible worker for this request")
        return ScoreResult(chosen, self.worker_ids[chosen], lam, scores, self, prompt_len,
                           matched, tier, queue_ms, belief, ablation)

    @property
    def kernel(self) -> ScoreKernel:
        """The C score loop over this scorer's constants (the Router fuses it into its decision)."""
        return self._kernel

    @property
    def blocks(self) -> ScoreBlocks:
        """The pruned score's per-block bounds over ``kernel``'s constants, kept current."""
        return self._blocks

    def kernel_flags(self, ablation: Ablation) -> int:
        """The C loop's ``SCORE_*`` flags for an ablation."""
        flags = self._flags.get(ablation)
        if flags is None:
            flags = self._flags[ablation] = (
                (SCORE_LOAD_AWARE if ablation.load_aware else 0)
                | (SCORE_TIER_AWARE if ablation.tier_aware else 0)
                | (SCORE_CROSS_REGION if ablation.cross_region else 0))
        return flags

    def _score_numpy(self, prompt_len: int, matched: np.ndarray, tier: np.ndarray, queue_ms: np.ndarray,
                     belief: np.ndarray, ablation: Ablation,
                     eligible: np.ndarray | None) -> tuple[int, float, np.ndarray]:
        """The reference path (any dtypes): (argmin, lam, scores)."""
        length = float(prompt_len)
        if ablation.load_aware:
            lam = min(self.lambda_max, min(queue_ms.tolist()) / self.tau_ms)
            queue = queue_ms
        else:
            lam, queue = 0.0, 0.0
        effective = np.minimum(belief * matched, length)
        if not ablation.cross_region:
            effective = effective * self._local_factor
        reload = self._reload_by_tier.take(tier) if ablation.tier_aware else 0.0
        scores = joint_score(self.wan_ms, queue, (1.0 + lam) * self.beta, length, effective, reload)
        if not ablation.cross_region:
            scores = scores + self._remote_penalty
        if eligible is not None:
            scores[~eligible.astype(bool)] = np.inf
        return int(scores.argmin()), lam, scores


_INT64, _UINT8, _FLOAT64, _BOOL = np.dtype(np.int64), np.dtype(np.uint8), np.dtype(np.float64), np.dtype(bool)


def _contiguous(array: np.ndarray) -> np.ndarray:
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array
