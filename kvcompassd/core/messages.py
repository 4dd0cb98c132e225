"""The discovery plane's messages, as core types: validated on construction, frozen, slotted,
with past-tense names. ``kvcompassd.wire`` registers a codec for each (tag, size bound, sender
roles) and re-exports them; nothing here knows of msgpack, sockets or peers.

Rules:
- A message validates and normalises every field against its class's ``WIRE`` schema in
  ``__post_init__`` (``FieldType.check``), so a bad message is refused where it is made, by
  local code or by the decoder alike; a failure raises ``MessageError`` (``wire.MessageError``).
- ``WIRE`` lists the fields in declaration order (the wire order; ``wire._spec`` checks it).
- Field types bound every size (characters, items, bytes), so a decoded message is bounded.

Here: every message of the discovery plane: the index-sync messages (``kvcompassd.core.sync``; a snapshot of any size travels
in bounded chunks, ``kvcompassd.core.snapshots``),
the queue vector and load reports (``kvcompassd.core.queues``), the agents' index events and
worker lifecycle (``kvcompassd.core.index``), and view copies between edges. ``kvcompassd.wire``
defines only the request-forwarding, admin, tokenizer and error messages of the daemons' shell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Final

from .events import IndexEventColumns, PrefixCached, PrefixEvicted, TierChanged

__all__ = [
    "EPOCH", "ID", "MAX_FRAME_BYTES", "MAX_ID_CHARS", "MAX_SNAPSHOT_BYTES", "MAX_SNAPSHOT_CHUNK_BYTES", "REGION", "SEQ",
    "SHARD", "TABLES", "Blob", "Bool", "Choice", "EventColumns", "FieldType", "Float", "Int", "MessageError", "Pairs",
    "PiggybackSent", "PrefixEventsReported", "QueueVectorBroadcast", "QueueVectorInterestReported", "ResyncRequested", "RoomVectorBroadcast", "check_room_steps", "ShardPositionAnnounced",
    "ShardSnapshotSent",
    "SnapshotChunkSent", "SnapshotResumeRequested", "SnapshotTransferStarted", "Text", "UpdateBatchPublished",
    "UpdatesSubscribed", "ViewCopyRequested", "WireMessage", "WorkerLoadReported", "WorkerPinnedReported", "WorkerRegistered", "WorkerRoomReported",
    "WorkerWithdrawn",
]

KiB: Final = 1024
MiB: Final = 1024 * KiB
MAX_FRAME_BYTES: Final = 16 * MiB  # the largest message of all
# A snapshot crosses the wire in chunks of at most this many bytes (SnapshotChunkSent), so a
# shard of any size bootstraps an edge and a chunk never holds the control channel for long.
MAX_SNAPSHOT_CHUNK_BYTES: Final = 1 * MiB
# The structural bound of one whole snapshot (every region group's blob together); a receiver
# bounds what it accepts far lower, by configuration ([sync] max_snapshot_bytes).
MAX_SNAPSHOT_BYTES: Final = 1 << 40
MAX_ID_CHARS: Final = 128
U32_MAX: Final = (1 << 32) - 1
U64_MAX: Final = (1 << 64) - 1
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1


class MessageError(ValueError):
    """A message is malformed: the sender broke the protocol (or local code built a bad one)."""


# --------------------------------------------------------------------------------------------
# Field types: each checks/normalises a Python value and converts it to and from its wire form.
# --------------------------------------------------------------------------------------------


class FieldType:
    """How one message field is validated and represented on the wire."""

    def check(self, value: Any, where: str) -> Any:
        """Validate ``value`` and return its canonical form; raise MessageError naming ``where``."""
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value

    def from_wire(self, raw: Any, where: str) -> Any:
        return self.check(raw, where)


def _fail(where: str, expected: str, value: Any) -> MessageError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return MessageError(f"{where}: expected {expected}, got {type(value).__name__} {shown}")


class Text(FieldType):
    def __init__(self, max_chars: int = MAX_ID_CHARS, *, allow_empty: bool = False) -> None:
        self.max_chars = max_chars
        self.allow_empty = allow_empty

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise _fail(where, "a string", value)
        if not self.allow_empty and not value:
            raise MessageError(f"{where}: must not be empty")
        if len(value) > self.max_chars:
            raise MessageError(f"{where}: longer than {self.max_chars} characters ({len(value)})")
        return value


class Choice(Text):
    def __init__(self, *choices: str) -> None:
        super().__init__(max(len(c) for c in choices))
        self.choices = frozenset(choices)

    def check(self, value: Any, where: str) -> str:
        value = super().check(value, where)
        if value not in self.choices:
            raise MessageError(f"{where}: must be one of {sorted(self.choices)}, got {value!r}")
        return value


class Int(FieldType):
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(where, "an integer", value)
        if not self.lo <= value <= self.hi:
            raise MessageError(f"{where}: {value} outside [{self.lo}, {self.hi}]")
        return int(value)


class Float(FieldType):
    def __init__(self, lo: float = -math.inf, hi: float = math.inf) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: Any, where: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _fail(where, "a number", value)
        value = float(value)
        if not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise MessageError(f"{where}: {value} is not a finite number in [{self.lo}, {self.hi}]")
        return value


class Bool(FieldType):
    def check(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(where, "a boolean", value)
        return value


class Blob(FieldType):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def check(self, value: Any, where: str) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise _fail(where, "bytes", value)
        value = bytes(value)
        if len(value) > self.max_bytes:
            raise MessageError(f"{where}: {len(value)} bytes exceeds {self.max_bytes}")
        return value


def _exact_test(field: FieldType) -> Callable[[Any], bool] | None:
    """For a number or text field: a test true only of values its ``check`` accepts and returns
    unchanged (decoded msgpack is mostly such values, and the test is a fraction of a check)."""
    kind = type(field)  # (the class itself: a subclass may check more, as Choice does)
    if kind is Int:
        lo, hi = field.lo, field.hi
        return lambda v: type(v) is int and lo <= v <= hi
    if kind is Float:
        lo, hi = field.lo, field.hi
        if math.isfinite(lo) and math.isfinite(hi):  # (NaN and the infinities fail the comparisons)
            return lambda v: type(v) is float and lo <= v <= hi
        return lambda v: type(v) is float and lo <= v <= hi and math.isfinite(v)
    if kind is Text:
        most, empty = field.max_chars, field.allow_empty
        return lambda v: type(v) is str and len(v) <= most and (empty or v != "")
    return None


_SEQUENCES = (list, tuple)


class Pairs(FieldType):
    """A tuple of 2-tuples, e.g. ``((group, blob), ...)`` or ``((worker, queue_ms), ...)``."""

    def __init__(self, first: FieldType, second: FieldType, max_items: int, *, unique_first: bool = False) -> None:
        self.first, self.second, self.max_items = first, second, max_items
        self.unique_first = unique_first  # no two pairs share their first element (a mapping)
        exact = _exact_test(first), _exact_test(second)
        self._exact = exact if None not in exact else None

    def check(self, value: Any, where: str) -> tuple[tuple[Any, Any], ...]:
        exact = self._exact
        if exact is not None and type(value) in _SEQUENCES and len(value) <= self.max_items:
            # The usual value, every pair valid as it is, in one pass; anything else is checked
            # item by item below, which names what is wrong.
            first_ok, second_ok = exact
            if all(type(item) in _SEQUENCES and len(item) == 2 and first_ok(item[0]) and second_ok(item[1])
                   for item in value):
                out = tuple(map(tuple, value))
                if not self.unique_first or len({a for a, _ in out}) == len(out):
                    return out
        if not isinstance(value, (tuple, list)):
            raise _fail(where, "a sequence of pairs", value)
        if len(value) > self.max_items:
            raise MessageError(f"{where}: {len(value)} items exceeds {self.max_items}")
        out = []
        first, second = self.first.check, self.second.check
        for i, item in enumerate(value):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise _fail(f"{where}[{i}]", "a pair", item)
            try:  # the item's own place is named only when it fails (formatting it was most of a check)
                out.append((first(item[0], where), second(item[1], where)))
            except MessageError:
                first(item[0], f"{where}[{i}][0]")  # checks are pure: the same failure, named in full
                second(item[1], f"{where}[{i}][1]")
                raise
        if self.unique_first and len({a for a, _ in out}) != len(out):
            seen: set = set()
            twice = next(a for a, _ in out if a in seen or seen.add(a))
            raise MessageError(f"{where}: {twice!r} appears twice")
        return tuple(out)

    def to_wire(self, value: tuple[tuple[Any, Any], ...]) -> list[list[Any]]:
        return [[self.first.to_wire(a), self.second.to_wire(b)] for a, b in value]


ID = Text()
REQUEST_ID = Text(MAX_ID_CHARS)
REGION = Text()
SHARD = Int(0, 65535)
EPOCH = Int(0, U64_MAX)
SEQ = Int(-1, I64_MAX)  # -1 = "nothing yet"
COUNT = Int(0, U32_MAX)
MILLIS = Float(0.0, 1e9)
SHARE = Float(0.0, 1.0)
TABLE_GROUP_MAX: Final = 65535  # a region group's number in a batch or snapshot
TABLES = Pairs(Int(0, TABLE_GROUP_MAX), Blob(MAX_FRAME_BYTES), 4096)
# A whole snapshot in memory (the simulator moves it as is; daemons stream it in chunks, and it
# encodes as one message only when it fits one frame: the wire's bound for ShardSnapshotSent).
SNAPSHOT_TABLES = Pairs(Int(0, TABLE_GROUP_MAX), Blob(MAX_SNAPSHOT_BYTES), 4096)
SNAPSHOT_ID = Int(1, U64_MAX)
QUEUE_VECTOR = Pairs(ID, MILLIS, 8192, unique_first=True)  # worker -> queue ms
ROOM_STEPS = Pairs(MILLIS, Int(0, I64_MAX), 1024)  # (ms from the reading, free KV tokens from then on)
ROOM_VECTOR = Pairs(ID, ROOM_STEPS, 8192, unique_first=True)  # worker -> its room steps


# Each message class's (field, its check, the name a failure gives it), made on first use: the
# names were formatted anew for every field of every message.
_FIELD_CHECKS: dict[type, tuple[tuple[str, Any, str], ...]] = {}


class WireMessage:
    """Base of every message: validates and normalises fields against the class's ``WIRE``."""

    __slots__ = ()
    WIRE: ClassVar[dict[str, FieldType]]

    def __post_init__(self) -> None:
        cls = type(self)
        checks = _FIELD_CHECKS.get(cls)
        if checks is None:
            checks = _FIELD_CHECKS[cls] = tuple((field_name, field_type.check, f"{cls.__name__}.{field_name}")
                                                for field_name, field_type in cls.WIRE.items())
        for field_name, check, where in checks:
            object.__setattr__(self, field_name, check(getattr(self, field_name), where))
        self._check()

    def _check(self) -> None:
        """Cross-field checks; override where needed."""


@dataclass(frozen=True, slots=True)
class UpdatesSubscribed(WireMessage):
    """edge -> maintenance: send me updates of ``shard`` after (epoch, seq); 0/-1 = I have none."""

    edge: str
    shard: int
    epoch: int
    seq: int
    WIRE: ClassVar = {"edge": ID, "shard": SHARD, "epoch": EPOCH, "seq": SEQ}


@dataclass(frozen=True, slots=True)
class ResyncRequested(WireMessage):
    """edge -> maintenance: I saw a gap; replay ``shard`` from ``from_seq`` or send a snapshot."""

    edge: str
    shard: int
    epoch: int
    from_seq: int
    WIRE: ClassVar = {"edge": ID, "shard": SHARD, "epoch": EPOCH, "from_seq": SEQ}


@dataclass(frozen=True, slots=True)
class UpdateBatchPublished(WireMessage):
    """maintenance -> edge: update records for ``shard`` numbered (epoch, seq), per region group."""

    shard: int
    epoch: int
    seq: int
    tables: tuple[tuple[int, bytes], ...]
    WIRE: ClassVar = {"shard": SHARD, "epoch": EPOCH, "seq": Int(0, I64_MAX), "tables": TABLES}

    @classmethod
    def of_shard(cls, shard: int, epoch: int, seq: int, tables: tuple[tuple[int, bytes], ...]) -> UpdateBatchPublished:
        """The batch a maintenance shard publishes (``MaintenanceShard.flush``), equal to
        ``cls(shard, epoch, seq, tables)``: when every field is already in its checked form
        (plain ints in range, a tuple of ``(group, bytes)`` tuples within a frame) the fields
        are taken as they are, in one pass with no per-field call (a shard flushes after
        nearly every report: building its batches through the generic checks was ~1.4 % of a
        1,024-worker simulation in py-spy);
        anything else goes through the constructor, which names what is wrong."""
        if (shard.__class__ is int and 0 <= shard <= SHARD.hi and epoch.__class__ is int and 0 <= epoch <= EPOCH.hi
                and seq.__class__ is int and 0 <= seq <= I64_MAX and tables.__class__ is tuple
                and len(tables) <= TABLES.max_items and all(
                    pair.__class__ is tuple and len(pair) == 2 and pair[0].__class__ is int and 0 <= pair[0] <= TABLE_GROUP_MAX
                    and pair[1].__class__ is bytes and len(pair[1]) <= MAX_FRAME_BYTES for pair in tables)):
            msg = object.__new__(cls)
            object.__setattr__(msg, "shard", shard)
            object.__setattr__(msg, "epoch", epoch)
            object.__setattr__(msg, "seq", seq)
            object.__setattr__(msg, "tables", tables)
            return msg
        return cls(shard, epoch, seq, tables)


@dataclass(frozen=True, slots=True)
class ShardPositionAnnounced(WireMessage):
    """maintenance -> edge: stream ``stream`` of ``shard`` (a region's name, or "" for the full
    stream) stands at ``(epoch, seq)``: its last published batch. Sent only while the stream
    has published nothing for ``[sync] position_heartbeat_ms`` (a live batch carries the
    position itself), so an edge whose last batch was lost sees the gap without waiting for
    the next one (``kvcompassd.core.sync``)."""

    shard: int
    epoch: int
    seq: int
    stream: str
    WIRE: ClassVar = {"shard": SHARD, "epoch": EPOCH, "seq": Int(0, I64_MAX), "stream": Text(allow_empty=True)}


@dataclass(frozen=True, slots=True)
class ShardSnapshotSent(WireMessage):
    """maintenance (or a peer edge) -> edge: the whole shard view as of (epoch, seq)."""

    shard: int
    epoch: int
    seq: int
    tables: tuple[tuple[int, bytes], ...]
    WIRE: ClassVar = {"shard": SHARD, "epoch": EPOCH, "seq": SEQ, "tables": SNAPSHOT_TABLES}


@dataclass(frozen=True, slots=True)
class SnapshotTransferStarted(WireMessage):
    """maintenance (or a peer edge) -> edge: snapshot ``snapshot_id`` of ``shard``, the shard's
    whole state after batch ``seq`` of ``epoch`` (``entries`` keys), follows in ``chunks``
    SnapshotChunkSent of ``chunk_bytes`` (the last may be shorter). Its image is every region
    group's snapshot blob, in ``tables`` order, end to end: ``tables`` = ((group, bytes), ...)."""

    shard: int
    epoch: int
    seq: int
    snapshot_id: int
    entries: int
    total_bytes: int
    chunk_bytes: int
    chunks: int
    tables: tuple[tuple[int, int], ...]
    WIRE: ClassVar = {"shard": SHARD, "epoch": EPOCH, "seq": Int(0, I64_MAX), "snapshot_id": SNAPSHOT_ID,
                      "entries": Int(0, U64_MAX), "total_bytes": Int(1, MAX_SNAPSHOT_BYTES),
                      "chunk_bytes": Int(1, MAX_SNAPSHOT_CHUNK_BYTES), "chunks": Int(1, U32_MAX),
                      "tables": Pairs(Int(0, 65535), Int(1, MAX_SNAPSHOT_BYTES), 4096, unique_first=True)}

    def _check(self) -> None:
        if sum(n for _, n in self.tables) != self.total_bytes:
            raise MessageError(f"SnapshotTransferStarted: tables add up to {sum(n for _, n in self.tables)} bytes, "
                               f"not total_bytes {self.total_bytes}")
        expected = -(-self.total_bytes // self.chunk_bytes)
        if self.chunks != expected:
            raise MessageError(f"SnapshotTransferStarted: {self.total_bytes} bytes in chunks of {self.chunk_bytes} "
                               f"make {expected} chunks, not {self.chunks}")


@dataclass(frozen=True, slots=True)
class SnapshotChunkSent(WireMessage):
    """maintenance (or a peer edge) -> edge: bytes ``[index * chunk_bytes, ...)`` of snapshot
    ``snapshot_id``'s image; ``crc32`` (zlib's CRC-32) of ``data``, checked by the receiver."""

    shard: int
    snapshot_id: int
    index: int
    crc32: int
    data: bytes
    WIRE: ClassVar = {"shard": SHARD, "snapshot_id": SNAPSHOT_ID, "index": Int(0, U32_MAX - 1),
                      "crc32": Int(0, U32_MAX), "data": Blob(MAX_SNAPSHOT_CHUNK_BYTES)}

    def _check(self) -> None:
        if not self.data:
            raise MessageError("SnapshotChunkSent.data: must not be empty")


@dataclass(frozen=True, slots=True)
class SnapshotResumeRequested(WireMessage):
    """edge -> maintenance: send snapshot ``snapshot_id`` of ``shard`` again from chunk
    ``from_chunk`` (the stream broke off, or a chunk is missing); a sender that no longer holds
    it starts a new snapshot. Also (re)subscribes the edge to the shard's updates."""

    edge: str
    shard: int
    snapshot_id: int
    from_chunk: int
    WIRE: ClassVar = {"edge": ID, "shard": SHARD, "snapshot_id": SNAPSHOT_ID, "from_chunk": Int(0, U32_MAX - 1)}


@dataclass(frozen=True, slots=True)
class QueueVectorBroadcast(WireMessage):
    """Region ``from_region``'s per-worker queue delays (ms) at ``sent_at`` (s, the sender's
    clock): edge -> edge as a datagram every Delta (``QueueEstimates.due_broadcasts``), and
    edge -> its own region's agents (``to_region == from_region``), which piggyback it on their
    answers to other regions. Each worker appears once. ``steady``: the values have stopped
    moving, and the sender sends them again only when one changes or after ``[idle]
    heartbeat_ms`` (``QueueEstimates.due_broadcasts`` with ``heartbeat_s``): a receiver holds
    them as they are until then, rather than carrying them along a trend."""

    from_region: str
    to_region: str
    sent_at: float
    vector: tuple[tuple[str, float], ...]
    steady: bool = False
    WIRE: ClassVar = {"from_region": REGION, "to_region": REGION, "sent_at": Float(0.0), "vector": QUEUE_VECTOR,
                      "steady": Bool()}

    @classmethod
    def to_each(cls, from_region: str, to_regions: tuple[str, ...] | list[str], sent_at: float,
                vector: tuple[tuple[str, float], ...], steady: bool = False) -> tuple[QueueVectorBroadcast, ...]:
        """The same vector to each of ``to_regions``: the fields they share are checked once (the
        first broadcast is built as any message), each destination's name on its own. A region's
        Delta broadcasts go to every other region at once (63 copies of one vector at 64 regions)."""
        if not to_regions:
            return ()
        return _readdressed(cls(from_region, to_regions[0], sent_at, vector, steady), to_regions)


def _readdressed(first: WireMessage, to_regions: tuple[str, ...] | list[str]) -> tuple[WireMessage, ...]:
    """``first`` (addressed to ``to_regions[0]``, built and checked as any message) and a copy of
    it to each other region of ``to_regions``: its fields taken as they are, only ``to_region``
    checked. For broadcasts whose cross-field rules (``_check``) do not read ``to_region``."""
    cls = type(first)
    where = f"{cls.__name__}.to_region"
    out = [first]
    for to_region in to_regions[1:]:
        msg = object.__new__(cls)
        for name in cls.WIRE:
            object.__setattr__(msg, name, getattr(first, name))
        object.__setattr__(msg, "to_region", REGION.check(to_region, where))
        out.append(msg)
    return tuple(out)


def check_room_steps(steps: Any, where: str) -> tuple[tuple[float, int], ...]:
    """Room steps as the wire takes them (at most 1,024 pairs of ms >= 0 and free tokens >= 0,
    both non-decreasing), checked; raises MessageError. Also what an agent reads off its engine."""
    steps = ROOM_STEPS.check(steps, where)
    _check_non_decreasing(steps, where)
    return steps


def _check_non_decreasing(steps: tuple[tuple[float, int], ...], where: str) -> None:
    if any(b[0] < a[0] or b[1] < a[1] for a, b in zip(steps, steps[1:])):
        raise MessageError(f"{where}: must be non-decreasing in both, got {steps!r}")


@dataclass(frozen=True, slots=True)
class RoomVectorBroadcast(WireMessage):
    """Region ``from_region``'s workers' VRAM room at ``sent_at`` (s, the sender's clock): edge ->
    edge as a datagram with its queue vector broadcast (``QueueEstimates.room_broadcasts``). Per
    worker with KV pinned, when it frees up: (ms from ``sent_at``, free KV tokens from then on)
    steps, as its agent reported them (``WorkerRoomReported``); a worker not listed has every
    token free. A new tag within version 2: an edge without it answers "malformed" and carries on."""

    from_region: str
    to_region: str
    sent_at: float
    rooms: tuple[tuple[str, tuple[tuple[float, int], ...]], ...]
    WIRE: ClassVar = {"from_region": REGION, "to_region": REGION, "sent_at": Float(0.0), "rooms": ROOM_VECTOR}

    def _check(self) -> None:
        for worker, steps in self.rooms:  # (each already checked as ROOM_STEPS by WIRE)
            _check_non_decreasing(steps, f"RoomVectorBroadcast.rooms[{worker!r}]")

    @classmethod
    def to_each(cls, from_region: str, to_regions: tuple[str, ...] | list[str], sent_at: float,
                rooms: tuple[tuple[str, tuple[tuple[float, int], ...]], ...]) -> tuple[RoomVectorBroadcast, ...]:
        """The same rooms to each of ``to_regions``, as ``QueueVectorBroadcast.to_each``: the
        fields they share (and the rooms' steps) are checked once, by the first broadcast, built
        as any message; each destination's name on its own."""
        if not to_regions:
            return ()
        return _readdressed(cls(from_region, to_regions[0], sent_at, rooms), to_regions)


# Index events reported by agents, worker lifecycle, view copies and load reports.


_EVENT_TYPES: Final = (PrefixCached, TierChanged, PrefixEvicted)


class EventColumns(FieldType):
    """A report's index events: :class:`IndexEventColumns` (a tuple of event objects is accepted
    and converted). On the wire ``[ops, keys]``: one op byte per event and the keys as packed
    little-endian uint64, so a report of thousands of events decodes without a Python object
    per event. With lengths (``IndexEventColumns.lengths``), a trailing third element
    ``[ops, keys, lengths]``: a report without them (an older agent's) still decodes, as events
    of unknown length."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items

    def check(self, value: Any, where: str) -> IndexEventColumns:
        if isinstance(value, (tuple, list)):
            for i, event in enumerate(value):
                if type(event) not in _EVENT_TYPES:
                    raise _fail(f"{where}[{i}]", "PrefixCached, TierChanged or PrefixEvicted", event)
            value = IndexEventColumns.from_events(value)
        elif not isinstance(value, IndexEventColumns):
            raise _fail(where, "IndexEventColumns or a tuple of index events", value)
        if len(value) > self.max_items:
            raise MessageError(f"{where}: {len(value)} events exceeds {self.max_items}")
        return value

    def to_wire(self, value: IndexEventColumns) -> list[bytes]:
        return [value.ops, value.keys, value.lengths] if value.lengths else [value.ops, value.keys]

    def from_wire(self, raw: Any, where: str) -> IndexEventColumns:
        if type(raw) is not list or len(raw) not in (2, 3) or any(type(part) is not bytes for part in raw):
            raise _fail(where, "[ops, keys] or [ops, keys, lengths] as byte strings", raw)
        if len(raw[0]) > self.max_items:
            raise MessageError(f"{where}: {len(raw[0])} events exceeds {self.max_items}")
        try:
            return IndexEventColumns(*raw)
        except ValueError as exc:
            raise MessageError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class PrefixEventsReported(WireMessage):
    """agent -> maintenance: a worker's index events, numbered per worker incarnation.

    ``events`` are columns (:class:`IndexEventColumns`); built from a tuple of event objects,
    which must all be the report's worker's."""

    worker: str
    seq: int
    events: IndexEventColumns
    WIRE: ClassVar = {"worker": ID, "seq": Int(0, I64_MAX), "events": EventColumns(1 << 20)}

    def __post_init__(self) -> None:
        if isinstance(self.events, (tuple, list)):
            for i, event in enumerate(self.events):
                if getattr(event, "worker", self.worker) != self.worker:
                    raise MessageError(
                        f"PrefixEventsReported.events[{i}]: worker {event.worker!r} is not the "
                        f"report's worker {self.worker!r}"
                    )
        WireMessage.__post_init__(self)


@dataclass(frozen=True, slots=True)
class WorkerWithdrawn(WireMessage):
    """agent -> maintenance: the worker is gone; drop every prefix it holds."""

    worker: str
    WIRE: ClassVar = {"worker": ID}


@dataclass(frozen=True, slots=True)
class WorkerRegistered(WireMessage):
    """agent -> maintenance: the worker (re)started; ``incarnation`` grows with every restart."""

    worker: str
    incarnation: int
    WIRE: ClassVar = {"worker": ID, "incarnation": Int(0, U64_MAX)}


@dataclass(frozen=True, slots=True)
class ViewCopyRequested(WireMessage):
    """edge -> edge: send me your views (answered on the same exchange with each shard's snapshot in
    chunks: SnapshotTransferStarted, then its SnapshotChunkSent)."""

    edge: str
    WIRE: ClassVar = {"edge": ID}


@dataclass(frozen=True, slots=True)
class PiggybackSent(WireMessage):
    """agent -> edges of its region (datagram): a response just carried this region's queue
    vector to ``to_region``, so the edges may skip their next broadcast there (paper §3.4)."""

    worker: str
    to_region: str
    WIRE: ClassVar = {"worker": ID, "to_region": REGION}


@dataclass(frozen=True, slots=True)
class QueueVectorInterestReported(WireMessage):
    """agent -> edges of its region (control channel: ordered, never lost): whether ``worker``'s
    agent wants the region's queue vector (``QueueVectorBroadcast``), which it only piggybacks on
    its responses to other regions. ``wanted`` False: send none; True: send it at once, then
    each period while it changes, until told otherwise. The agent says it when it connects and
    whenever it changes its mind (``kvcompassd.pacing.VectorInterest``: wanted from a request
    from another region until 10 s after the last one ended); an edge sends the vector to an
    agent it has not heard this from, as before the message existed. A new tag within version 3:
    an edge without it answers "malformed" and carries on sending every agent the vector."""

    worker: str
    wanted: bool
    WIRE: ClassVar = {"worker": ID, "wanted": Bool()}


@dataclass(frozen=True, slots=True)
class WorkerLoadReported(WireMessage):
    """agent -> edge: a worker's current queueing delay and batch occupancy. ``resumed``: the
    engine answered this reading after failing or stalling the ones before (the edge stops
    avoiding the worker)."""

    worker: str
    queue_ms: float
    running: int
    waiting: int
    resumed: bool = False
    WIRE: ClassVar = {"worker": ID, "queue_ms": MILLIS, "running": COUNT, "waiting": COUNT, "resumed": Bool()}


@dataclass(frozen=True, slots=True)
class WorkerRoomReported(WireMessage):
    """agent -> edge, after a load report: when its worker's VRAM frees up, ``steps`` of (ms from
    the reading, KV tokens free from then on), both non-decreasing; empty: nothing is pinned.
    The report's queue is the wait of a prompt that needs no new KV; a longer one waits for the
    first step with room for it (``QueueEstimates.set_room``). Sent when the engine says
    (the emulator's ``room_steps``, ``WorkerQueueModel.room_steps``); a real SGLang reports the
    KV its running requests hold but not when they end, so its agent sends none. A new tag
    within version 2: an edge without it answers "malformed" and carries on."""

    worker: str
    steps: tuple[tuple[float, int], ...]
    WIRE: ClassVar = {"worker": ID, "steps": ROOM_STEPS}

    def _check(self) -> None:
        # (each pair's own check ran with the field's: constructed or decoded, only the order is left)
        _check_non_decreasing(self.steps, "WorkerRoomReported.steps")


@dataclass(frozen=True, slots=True)
class WorkerPinnedReported(WireMessage):
    """agent -> edge, after a load report, for an engine that says how much of its KV pool its
    requests hold but not when they end, so sends no room steps (a real SGLang: its
    ``/v1/loads`` ``num_used_tokens`` over ``max_total_num_tokens``): that ``share``. The edge
    prices a copy into the worker's cache by it (``score.copy_weight``). A new tag within
    version 3: an edge without it answers "malformed" and carries on."""

    worker: str
    share: float
    WIRE: ClassVar = {"worker": ID, "share": SHARE}
