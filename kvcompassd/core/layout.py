"""Where each worker's 2-bit tier field lives: region groups and field positions.

A Ludo value packs one 2-bit tier field per worker of one *region group*: 16 workers with 32-bit
values, 32 with 64-bit values. A region with more workers is split into several groups, each with
its own table per shard (paper §3.2). Groups are numbered in config order so every node derives
the same layout from the same config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RegionGroup:
    """One Ludo table per shard holds the fields of these workers."""

    group: int
    region: str
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FieldSlot:
    group: int
    field: int


class UnknownWorkerError(ValueError):
    """A worker id that the cluster config does not name."""


class IndexLayout:
    """Region groups and per-worker field positions for a cluster, in config worker order."""

    def __init__(self, regions: tuple[str, ...], workers: tuple[tuple[str, str], ...], value_bits: int):
        if value_bits not in (32, 64):
            raise ValueError(f"value_bits must be 32 or 64, got {value_bits}")
        self.value_bits = value_bits
        self.fields_per_value = value_bits // 2
        groups: list[RegionGroup] = []
        slots: dict[str, FieldSlot] = {}
        for region in regions:
            members = [w for w, r in workers if r == region]
            for start in range(0, len(members), self.fields_per_value):
                chunk = tuple(members[start : start + self.fields_per_value])
                gid = len(groups)
                groups.append(RegionGroup(gid, region, chunk))
                for field, worker in enumerate(chunk):
                    slots[worker] = FieldSlot(gid, field)
        self.groups: tuple[RegionGroup, ...] = tuple(groups)
        self.worker_ids: tuple[str, ...] = tuple(w for w, _ in workers)
        self.worker_region: dict[str, str] = dict(workers)
        self._slots = slots
        self._index = {w: i for i, w in enumerate(self.worker_ids)}
        # Per worker (config order): its group and the bit shift of its field, for vectorised decode.
        self.worker_group = np.array([slots[w].group for w in self.worker_ids], dtype=np.intp)
        self.worker_shift = np.array([2 * slots[w].field for w in self.worker_ids], dtype=np.uint64)

    @classmethod
    def from_config(cls, cfg) -> "IndexLayout":
        return cls(
            tuple(cfg.region_names()),
            tuple((w.id, w.region) for w in cfg.workers),
            cfg.index.value_bits,
        )

    def slot(self, worker: str) -> FieldSlot:
        try:
            return self._slots[worker]
        except KeyError:
            raise UnknownWorkerError(f"unknown worker {worker!r}") from None

    def worker_index(self, worker: str) -> int:
        try:
            return self._index[worker]
        except KeyError:
            raise UnknownWorkerError(f"unknown worker {worker!r}") from None

    def groups_of_region(self, region: str) -> tuple[RegionGroup, ...]:
        return tuple(g for g in self.groups if g.region == region)
