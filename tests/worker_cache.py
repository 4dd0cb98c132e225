"""A worker's cache side for tests that drive a :class:`WorkerQueueModel` with a real prefix
cache, as the simulator does (``kvcompassd/sim/engine.py``)."""

from __future__ import annotations

from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.worker.workermodel import WorkerQueueModel, WorkerTiming


class CacheOwner:
    """A worker's cache side as the simulator drives it: lock at the prefill's start (only if
    the prompt's pages fit beside the running requests'), insert at its end, unlock at the finish."""

    def __init__(self, vram_tokens: int, block_size: int = 4, dram_tokens: int = 0) -> None:
        self.cache = PrefixCache(block_size=block_size, vram_tokens=vram_tokens, dram_tokens=dram_tokens)
        self.tokens: dict[str, list[int]] = {}
        self.leases: dict[str, object] = {}
        self.pinned: dict[str, tuple[int, ...]] = {}
        self.estimates: dict[str, tuple[int, int]] = {}
        self.estimate_missed = False  # a prefill reused other than its arrival estimate
        self.uncached: dict[str, int] = {}  # prompt tokens each request computed

    def starts(self, rid: str, now: float) -> tuple[int, int] | None:
        locked = self.cache.lock(self.tokens[rid], now=now, only_if_room=True)
        if locked is None:
            return None
        lease, match, _ = locked
        self.leases[rid] = lease
        self.estimate_missed |= self.estimates[rid] != (match.vram_tokens, match.dram_tokens)
        self.uncached[rid] = len(self.tokens[rid]) - match.vram_tokens - match.dram_tokens
        return match.vram_tokens, match.dram_tokens

    def ends(self, rid: str, now: float) -> None:
        self.cache.insert(self.tokens[rid], now=now, lease=self.leases[rid])
        self.pinned[rid] = tuple(self.leases[rid].pages)

    def finished(self, rid: str, now: float) -> None:
        self.cache.unlock(self.leases.pop(rid))
        self.pinned.pop(rid, None)

    def footprint(self, rid: str) -> tuple[int, ...]:
        if rid in self.pinned:
            return self.pinned[rid]
        return tuple(self.cache.path_ids(self.tokens[rid]))

    def model(self, timing: WorkerTiming, *, counts_room: bool = True) -> WorkerQueueModel:
        room = {"footprint": self.footprint, "vram_pages": self.cache.vram_pages_max} if counts_room else {}
        return WorkerQueueModel(timing, prefill_starts=self.starts, prefill_ends=self.ends,
                                finished=self.finished, **room)

    def admit(self, model: WorkerQueueModel, rid: str, tokens: list[int], output: int, now: float) -> None:
        self.tokens[rid] = tokens
        found = self.cache.match(tokens)
        self.estimates[rid] = (found.vram_tokens, found.dram_tokens)
        model.admit(rid, len(tokens), found.vram_tokens, found.dram_tokens, output, now=now)
