"""KV-cache events as the index sees them: one worker, one prefix key at one indexed length.

Agents derive these from an engine's block events; maintenance shards apply them. They are
validated on construction so that a bad event is rejected where it is made, not deep inside
the index.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_KEY = (1 << 63) - 1


class Tier(enum.IntEnum):
    """The 2-bit tier field stored per worker in an index value."""

    ABSENT = 0
    VRAM = 1
    DRAM = 2


def _check_common(worker: str, key: int) -> None:
    if not isinstance(worker, str) or not worker:
        raise ValueError(f"worker id must be a non-empty string, got {worker!r}")
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= MAX_KEY:
        raise ValueError(f"prefix key must be an int in [0, 2^63), got {key!r}")


def _check_tier(tier: Tier) -> None:
    if tier not in (Tier.VRAM, Tier.DRAM):
        raise ValueError(f"tier must be VRAM or DRAM, got {tier!r}")


@dataclass(frozen=True, slots=True)
class _TieredEvent:
    worker: str
    key: int
    tier: Tier

    def __post_init__(self) -> None:
        _check_common(self.worker, self.key)
        object.__setattr__(self, "tier", Tier(self.tier))
        _check_tier(self.tier)

    @classmethod
    def trusted(cls, worker: str, key: int, tier: Tier):
        """Build without re-validating, for a decoder that has just checked every field (a report
        carries thousands of events; validation was most of a maintenance unit's decode cost)."""
        event = object.__new__(cls)
        _set(event, "worker", worker)
        _set(event, "key", key)
        _set(event, "tier", tier)
        return event


_set = object.__setattr__


@dataclass(frozen=True, slots=True)
class PrefixCached(_TieredEvent):
    """``worker`` now holds the prefix with ``key`` in ``tier``."""


@dataclass(frozen=True, slots=True)
class TierChanged(_TieredEvent):
    """``worker`` moved the prefix with ``key`` to ``tier`` (VRAM <-> DRAM)."""


@dataclass(frozen=True, slots=True)
class PrefixEvicted:
    """``worker`` no longer holds the prefix with ``key`` in any indexed tier."""

    worker: str
    key: int

    def __post_init__(self) -> None:
        _check_common(self.worker, self.key)

    @classmethod
    def trusted(cls, worker: str, key: int) -> "PrefixEvicted":
        """Build without re-validating (see ``_TieredEvent.trusted``)."""
        event = object.__new__(cls)
        _set(event, "worker", worker)
        _set(event, "key", key)
        return event


IndexEvent = PrefixCached | TierChanged | PrefixEvicted
