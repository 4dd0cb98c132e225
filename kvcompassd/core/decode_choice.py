"""Which decode worker takes a disaggregated request (sans-IO).

KVCompass's score picks the prefill worker, where reuse saves work; the decode worker is chosen
among the decode workers of the prefill's region, where the KV can move fast (paper App. C:
"the decode instance and the KV transfer stay with the disaggregated stack"). Two policies
(``[disaggregation] decode_policy``):

- ``least_loaded`` (default): the fewest requests, counting the larger of what this edge has in
  flight there and what the worker's agent last reported (running + waiting; reports come from
  the edge's own region only); ties drawn at random, so equal workers share the load.
- ``random``: uniform, the paper's control (every scheme of its Fig. 18 draws decode this way).

A decode worker that just failed a request is avoided for ``suspect_s`` while another one of
the region can serve. Time comes in as ``now``; randomness from a seeded generator.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kvcompassd.core.config import ClusterConfig

POLICIES = ("least_loaded", "random")


class NoDecodeWorkerError(LookupError):
    """The prefill's region has no decode worker left to try."""


@dataclass(frozen=True, slots=True)
class DecodeWorker:
    id: str
    region: str


class DecodeChooser:
    def __init__(self, workers: Iterable[DecodeWorker], *, policy: str = "least_loaded", seed: int = 0,
                 suspect_s: float = 5.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"decode policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.suspect_s = suspect_s
        self._by_region: dict[str, tuple[str, ...]] = {}
        for w in workers:
            self._by_region[w.region] = self._by_region.get(w.region, ()) + (w.id,)
        self._known = {w for ids in self._by_region.values() for w in ids}
        self._inflight = dict.fromkeys(self._known, 0)
        self._reported = dict.fromkeys(self._known, 0)
        self._avoid_until: dict[str, float] = {}
        self._rng = random.Random(seed)
        self.chosen = dict.fromkeys(self._known, 0)  # per worker, for metrics and kvcompassctl

    @classmethod
    def from_config(cls, cfg: ClusterConfig, *, seed: int = 0) -> DecodeChooser:
        """The decode workers of a ``ClusterConfig``, its ``[disaggregation]`` policy, and its
        ``[deadlines]`` suspicion period."""
        workers = [DecodeWorker(w.id, w.region) for w in cfg.workers if w.role == "decode"]
        return cls(workers, policy=cfg.disaggregation.decode_policy, seed=seed,
                   suspect_s=cfg.deadlines.suspect_initial_s)

    def workers_in(self, region: str) -> tuple[str, ...]:
        return self._by_region.get(region, ())

    def load(self, worker: str) -> int:
        return max(self._inflight[worker], self._reported[worker])

    def choose(self, region: str, *, now: float, exclude: Collection[str] = ()) -> str:
        """A decode worker of ``region`` for the next request (not counted as started yet)."""
        candidates = [w for w in self._by_region.get(region, ()) if w not in exclude]
        if not candidates:
            raise NoDecodeWorkerError(f"region {region!r} has no decode worker left to try")
        trusted = [w for w in candidates if self._avoid_until.get(w, float("-inf")) <= now]
        pool = trusted or candidates  # all suspected: try them anyway (one may be back)
        if self.policy == "least_loaded":
            fewest = min(self.load(w) for w in pool)
            pool = [w for w in pool if self.load(w) == fewest]
        return pool[self._rng.randrange(len(pool))] if len(pool) > 1 else pool[0]

    def started(self, worker: str) -> None:
        self._inflight[worker] += 1
        self.chosen[worker] += 1

    def finished(self, worker: str) -> None:
        self._inflight[worker] = max(0, self._inflight[worker] - 1)

    def served(self, worker: str) -> None:
        """The worker completed a request: no longer suspected."""
        self._avoid_until.pop(worker, None)

    def failed(self, worker: str, *, now: float) -> None:
        self._avoid_until[worker] = now + self.suspect_s

    def load_reported(self, worker: str, running: int, waiting: int) -> None:
        """An agent's reading of the worker's engine (ignored for workers that are not decode workers)."""
        if worker in self._known:
            self._reported[worker] = max(0, int(running)) + max(0, int(waiting))

    def describe(self) -> dict:
        return {"policy": self.policy,
                "workers": {w: {"inflight": self._inflight[w], "reported": self._reported[w], "chosen": self.chosen[w]}
                            for w in sorted(self._known)}}
