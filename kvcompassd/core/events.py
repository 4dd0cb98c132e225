"""KV-cache events as the index sees them: one worker, one prefix key at one indexed length.

Agents derive these from an engine's block events; maintenance shards apply them. They are
validated on construction so that a bad event is rejected where it is made, not deep inside
the index.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

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


class EventOp(enum.IntEnum):
    """One byte per event in :class:`IndexEventColumns`: what happened, and to which tier."""

    CACHED_VRAM = 0
    CACHED_DRAM = 1
    MOVED_TO_VRAM = 2
    MOVED_TO_DRAM = 3
    EVICTED = 4


# The one definition of what each op means: (event class, the tier it leaves the worker's field
# in, whether it needs the worker to hold the prefix already). Everything below derives from it.
OP_MEANING: dict[EventOp, tuple[type, Tier]] = {
    EventOp.CACHED_VRAM: (PrefixCached, Tier.VRAM),
    EventOp.CACHED_DRAM: (PrefixCached, Tier.DRAM),
    EventOp.MOVED_TO_VRAM: (TierChanged, Tier.VRAM),
    EventOp.MOVED_TO_DRAM: (TierChanged, Tier.DRAM),
    EventOp.EVICTED: (PrefixEvicted, Tier.ABSENT),
}
assert list(OP_MEANING) == list(EventOp)
_OP_OF_TIERED = {meaning: op for op, meaning in OP_MEANING.items() if meaning[0] is not PrefixEvicted}
# (event class, tier) -> op code of a registration or tier change (an eviction is EventOp.EVICTED).
OP_OF_TIERED_EVENT: Mapping[tuple[type, Tier], EventOp] = _OP_OF_TIERED
# Per op code, as byte tables for the C apply (``LudoTable.edit_fields``): the tier after, and
# whether a holder is needed (tier changes and evictions need one; registrations do not).
OP_TIER_AFTER = bytes(tier for _, tier in OP_MEANING.values())
OP_NEEDS_HOLDER = bytes(cls is not PrefixCached for cls, _ in OP_MEANING.values())
KEY_DTYPE = np.dtype("<u8")
OP_DTYPE = np.dtype("u1")
LENGTH_DTYPE = np.dtype("<u4")
UNKNOWN_LENGTH = 0  # an event whose indexed length was not reported (kvcompassd.core.streams passes it everywhere)


@dataclass(frozen=True, slots=True)
class IndexEventColumns:
    """One worker's index events as packed columns, validated on construction.

    ``ops`` holds one :class:`EventOp` byte per event, ``keys`` the prefix keys as little-endian
    uint64, in event order. A report carries thousands of events: as columns they are checked,
    sent and applied with array operations, never as one Python object per event. The worker is
    not stored: it is the enclosing report's.

    ``lengths`` (optional: empty, or one little-endian uint32 per event) is each event's indexed
    prefix length in tokens, ``UNKNOWN_LENGTH`` where not known: a maintenance unit sends each
    edge region only the lengths it looks up (kvcompassd.core.streams); without lengths (an
    older agent) every event goes to every region.
    """

    ops: bytes
    keys: bytes
    lengths: bytes = b""

    def __post_init__(self) -> None:
        for name in ("ops", "keys", "lengths"):
            value = getattr(self, name)
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"{name} must be bytes, got {type(value).__name__}")
            _set(self, name, bytes(value))
        if len(self.keys) != KEY_DTYPE.itemsize * len(self.ops):
            raise ValueError(f"{len(self.ops)} ops need {KEY_DTYPE.itemsize * len(self.ops)} key bytes, "
                             f"got {len(self.keys)}")
        if self.lengths and len(self.lengths) != LENGTH_DTYPE.itemsize * len(self.ops):
            raise ValueError(f"{len(self.ops)} ops need {LENGTH_DTYPE.itemsize * len(self.ops)} length bytes "
                             f"(or none), got {len(self.lengths)}")
        if not self.ops:
            return
        # Checked on the bytes (builtin max, no numpy reduction: a report's few events): an op
        # is one byte; a key is past 2^63 - 1 exactly when its little-endian top byte is >= 0x80.
        if max(self.ops) > EventOp.EVICTED:
            ops = self.op_array()
            i = int(np.argmax(ops > EventOp.EVICTED))
            raise ValueError(f"event {i}: unknown op {int(ops[i])}")
        if max(self.keys[7::8]) > 0x7F:
            keys = self.key_array()
            i = int(np.argmax(keys > MAX_KEY))
            raise ValueError(f"event {i}: prefix key {int(keys[i])} is not in [0, 2^63)")

    @classmethod
    def from_events(cls, events: Iterable[IndexEvent], lengths: Sequence[int] | None = None) -> "IndexEventColumns":
        """Columns of already validated events (of one worker: the caller checks that), with
        each one's indexed length if ``lengths`` is given (one per event). Packed with
        ``struct`` and checked with builtins, not numpy: an agent's usual report holds a few
        events, where numpy's per-call cost was most of the work (issue 30 item 4)."""
        ops = bytearray()
        keys = []
        for event in events:
            ops.append(EventOp.EVICTED if type(event) is PrefixEvicted else _OP_OF_TIERED[type(event), event.tier])
            keys.append(event.key)
        n = len(ops)
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{n} events need {n} lengths, got {len(lengths)}")
        if keys and not 0 <= min(keys) <= max(keys) <= MAX_KEY:
            bad = next(k for k in keys if not 0 <= k <= MAX_KEY)
            raise ValueError(f"prefix key {bad} is not in [0, 2^63)")
        try:
            packed_lengths = b"" if lengths is None else struct.pack(f"<{n}I", *lengths)
        except struct.error as exc:
            raise ValueError(f"indexed lengths must be in [0, 2^32): {exc}") from None
        columns = object.__new__(cls)  # ops and keys valid by the checks above: no second pass
        _set(columns, "ops", bytes(ops))
        _set(columns, "keys", struct.pack(f"<{n}Q", *keys))
        _set(columns, "lengths", packed_lengths)
        return columns

    @classmethod
    def concat(cls, parts: Sequence["IndexEventColumns"]) -> "IndexEventColumns":
        """The events of ``parts`` in order; lengths kept when every part has them, else dropped
        (unknown lengths cost bytes, never a decision)."""
        if len(parts) == 1:
            return parts[0]
        lengths = b"".join(p.lengths for p in parts) if all(p.lengths or not len(p) for p in parts) else b""
        return cls(b"".join(p.ops for p in parts), b"".join(p.keys for p in parts), lengths)

    @classmethod
    def evictions(cls, keys: np.ndarray) -> "IndexEventColumns":
        """Evictions of every key in ``keys`` (e.g. all a worker holds)."""
        return cls(bytes([EventOp.EVICTED]) * len(keys), np.asarray(keys, dtype=KEY_DTYPE).tobytes())

    def __len__(self) -> int:
        return len(self.ops)

    def select(self, mask: np.ndarray) -> "IndexEventColumns":
        """The events where ``mask`` (a bool array, one per event) is true, lengths included."""
        lengths = self.length_array()[mask].tobytes() if self.lengths else b""
        return IndexEventColumns(self.op_array()[mask].tobytes(), self.key_array()[mask].tobytes(), lengths)

    def slice(self, start: int, stop: int) -> "IndexEventColumns":
        """Events ``start`` to ``stop`` (a report's chunk), lengths included."""
        k, n = KEY_DTYPE.itemsize, LENGTH_DTYPE.itemsize
        lengths = self.lengths[n * start:n * stop] if self.lengths else b""
        return IndexEventColumns(self.ops[start:stop], self.keys[k * start:k * stop], lengths)

    def length_array(self) -> np.ndarray:
        """Each event's indexed length as uint32 (``UNKNOWN_LENGTH`` everywhere without lengths)."""
        if not self.lengths:
            return np.zeros(len(self.ops), dtype=LENGTH_DTYPE)
        return np.frombuffer(self.lengths, dtype=LENGTH_DTYPE)

    def op_array(self) -> np.ndarray:
        """The op codes as a read-only uint8 array (no copy)."""
        return np.frombuffer(self.ops, dtype=OP_DTYPE)

    def key_array(self) -> np.ndarray:
        """The keys as a read-only uint64 array (no copy on little-endian machines)."""
        return np.frombuffer(self.keys, dtype=KEY_DTYPE)

    def as_events(self, worker: str) -> tuple[IndexEvent, ...]:
        """The same events as objects of ``worker`` (for code that handles one event at a time)."""
        out: list[IndexEvent] = []
        meanings = list(OP_MEANING.values())
        for op, key in zip(self.ops, self.key_array().tolist()):
            cls, tier = meanings[op]
            out.append(PrefixEvicted.trusted(worker, key) if cls is PrefixEvicted else cls.trusted(worker, key, tier))
        return tuple(out)
