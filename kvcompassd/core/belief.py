"""Per-worker cache belief ``b_r`` (paper §3.4): how much of a claimed match a worker delivers.

``b_r`` is an EWMA of ``reused / claimed`` tokens, fed from responses: ``claimed`` is the match
the edge credited the worker with when it forwarded, ``reused`` what the worker reported it
actually reused. False hits of the keyless view (and stale entries) lower ``b_r``, which
discounts the worker's future claims in the joint score.

``values`` is an immutable snapshot: ``observe`` replaces the array (a copy of a few dozen
floats) rather than writing into it, so a decision scored from a snapshot never changes.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["BeliefError", "CacheBelief"]


class BeliefError(ValueError):
    """Bad arguments to the cache belief (index out of range, negative counts, bad weight)."""


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise BeliefError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class CacheBelief:
    def __init__(self, n_workers: int, weight: float, initial: float = 1.0) -> None:
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
            raise BeliefError(f"n_workers must be a non-negative integer, got {n_workers!r}")
        for name, value, lo_open in (("weight", weight, True), ("initial", initial, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BeliefError(f"{name} must be a number, got {value!r}")
            if value > 1.0 or value < 0.0 or (lo_open and value == 0.0):
                raise BeliefError(f"{name} must be in {'(0' if lo_open else '[0'}, 1], got {value!r}")
        self.weight = float(weight)
        self._values = np.full(n_workers, float(initial), dtype=np.float64)
        self._values.setflags(write=False)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def values(self) -> np.ndarray:
        """Beliefs in worker order (immutable snapshot)."""
        return self._values

    def get(self, worker_index: int) -> float:
        return float(self._values[self._check_index(worker_index)])

    def _check_index(self, worker_index: int) -> int:
        if isinstance(worker_index, bool) or not isinstance(worker_index, (int, np.integer)) \
                or not 0 <= worker_index < len(self._values):
            raise BeliefError(f"worker index must be in [0, {len(self._values)}), got {worker_index!r}")
        return int(worker_index)

    def observe(self, worker_index: int, claimed_tokens: int, reused_tokens: int) -> float:
        """Fold one response in; returns the new belief. ``claimed == 0`` carries no evidence."""
        i = self._check_index(worker_index)
        claimed = _count(claimed_tokens, "claimed_tokens")
        reused = _count(reused_tokens, "reused_tokens")
        if claimed == 0:
            return float(self._values[i])
        # A worker may reuse more than claimed (a longer unindexed match): that is not evidence
        # of more than full trust, so the ratio is clipped to 1.
        ratio = min(1.0, reused / claimed)
        values = self._values.copy()
        values[i] = (1.0 - self.weight) * values[i] + self.weight * ratio
        values.setflags(write=False)
        self._values = values
        return float(values[i])

    def reset(self, worker_index: int, value: float = 1.0) -> None:
        """Set one worker's belief, e.g. after it restarted with an empty cache and re-registered."""
        i = self._check_index(worker_index)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise BeliefError(f"belief must be in [0, 1], got {value!r}")
        values = self._values.copy()
        values[i] = float(value)
        values.setflags(write=False)
        self._values = values
