"""The sharded multi-level discovery index: the writer side of one shard and the edge's view.

``MaintenanceShard`` is the single writer of one shard (keys with ``key % N == shard``). It keeps
one full-key Ludo table per region group, turns index events into 2-bit tier-field edits, and
emits the resulting Ludo update records as ordered batches numbered ``(epoch, seq)``, with a
bounded replay log and full snapshots for edges that are new or found a gap.

``EdgeIndexView`` holds a keyless view of every (shard, group) table and where each stands in
its shard's stream; it is read by the lookup (``kvcompassd.core.lookup``). It only applies what
it is given (the next batch, a snapshot): which batch is next, what is stale, what a gap asks
for and when to ask again is the sync protocol's (``kvcompassd.core.sync``), which the daemons
and the simulator drive.

The batch and snapshot messages are core types (``kvcompassd.core.messages``) that the wire
protocol encodes unchanged; the simulator moves the same objects.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from .events import (OP_NEEDS_HOLDER, OP_OF_TIERED_EVENT, OP_TIER_AFTER, EventOp, IndexEvent, IndexEventColumns,
                     PrefixCached, PrefixEvicted, Tier, TierChanged)
from .layout import IndexLayout
from .messages import ShardSnapshotSent, UpdateBatchPublished
from .ludo import EDIT_CHANGED, EDIT_REFUSED, LudoError, LudoTable, LudoView, TablesEditor, apply_batch

TIER_MASK = 3

# Table sizing when ``[index] initial_capacity = 0`` (the default): a table starts at 1/64 of the
# entries its region group's workers can register in its shard when their caches are full, and
# grows by 1.5x rebuilds (ludo_c) from there: ~10 growths to full, each shipping one snapshot of
# the table to every edge, ~3x the full table's snapshot in all, once. A worker registers at most
# one key per cached block (registration lengths are distinct multiples of the block size), so
# its cached blocks bound what it adds to a table.
AUTO_START_DIVISOR = 64
MIN_TABLE_CAPACITY = 64


def full_table_entries(cfg: Any, layout: IndexLayout) -> tuple[int, ...]:
    """Per region group, the most entries its table in one shard can hold: the group's cached
    blocks (VRAM + DRAM KV tokens / block size, summed over its workers) over the shards."""
    block, shards = cfg.index.block_size, cfg.shards
    out = []
    for g in layout.groups:
        blocks = sum((cfg.worker(w).vram_kv_tokens + cfg.worker(w).dram_kv_tokens) // block for w in g.workers)
        out.append(math.ceil(blocks / shards))
    return tuple(out)


def table_capacities(cfg: Any, layout: IndexLayout | None = None) -> tuple[int, ...]:
    """Initial capacity of each region group's table in one shard: ``[index] initial_capacity``
    when it is set, else sized from the expected entries (``full_table_entries`` /
    ``AUTO_START_DIVISOR``, at least ``MIN_TABLE_CAPACITY``). Tables grow past it as needed."""
    layout = layout or IndexLayout.from_config(cfg)
    fixed = cfg.index.initial_capacity
    if fixed:
        return (fixed,) * len(layout.groups)
    return tuple(max(MIN_TABLE_CAPACITY, math.ceil(n / AUTO_START_DIVISOR)) for n in full_table_entries(cfg, layout))


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    """What one ``MaintenanceShard.apply`` call did: counts, and why events were ignored."""

    applied: int = 0
    unchanged: int = 0
    ignored: tuple[str, ...] = field(default_factory=tuple)


class WrongShardError(ValueError):
    """An event for a key that another shard owns."""


def _tier_change_refused(worker: str, key: int) -> str:
    return f"tier change for a prefix {worker} never registered (key {key})"


def _eviction_refused(worker: str, key: int) -> str:
    return f"eviction of a prefix {worker} does not hold (key {key})"


class MaintenanceShard:
    """Single writer of one shard: full-key tables per region group, ordered update batches."""

    def __init__(
        self,
        layout: IndexLayout,
        shard: int,
        shards: int,
        *,
        epoch: int,
        initial_capacity: int | Sequence[int] = MIN_TABLE_CAPACITY,
        fingerprint_bits: int = 0,
        max_load: float = 0.95,
        replay_batches: int = 4096,
        table_salt: int = 0,
    ):
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} out of range for {shards} shards")
        self.layout = layout
        self.shard = shard
        self.shards = shards
        self.epoch = epoch
        self.seq = 0
        # One capacity for every table, or one per region group (``table_capacities``).
        capacities = ((initial_capacity,) * len(layout.groups) if isinstance(initial_capacity, int)
                      else tuple(initial_capacity))
        if len(capacities) != len(layout.groups):
            raise ValueError(f"{len(capacities)} initial capacities for {len(layout.groups)} region groups")
        self._tables = [
            LudoTable(
                capacities[g.group],
                value_bits=layout.value_bits,
                fingerprint_bits=fingerprint_bits,
                max_load=max_load,
                # The table id: ``table_salt`` keeps another stream's tables of the same shard
                # (kvcompassd.core.streams) apart, so its blobs are refused as foreign.
                seed=(shard << 16) ^ g.group ^ (table_salt << 40),
            )
            for g in layout.groups
        ]
        for table in self._tables:
            table.take_updates()  # the initial state travels as a snapshot, not as records
        self._editor = TablesEditor(self._tables)  # apply_reports' C call over every table
        self._dirty: list[int] = []
        self._replay: deque[UpdateBatchPublished] = deque(maxlen=replay_batches)

    # -- writes -------------------------------------------------------------------------------

    def apply(self, events: Iterable[IndexEvent]) -> ApplyOutcome:
        """Apply index events; events that make no sense are ignored with a reason, never raised.

        Unknown workers and keys of other shards are a caller's error of routing, but one bad
        event must not stop the rest of a batch from an agent, so they are reported, not raised.
        """
        applied = unchanged = 0
        ignored: list[str] = []
        for event in events:
            reason = self._apply_one(event)
            if reason is None:
                applied += 1
            elif reason == "":
                unchanged += 1
            else:
                ignored.append(reason)
        return ApplyOutcome(applied, unchanged, tuple(ignored))

    def apply_columns(self, worker: str, columns: IndexEventColumns) -> ApplyOutcome:
        """Apply one worker's events given as columns in one C call (``LudoTable.edit_fields``):
        the same outcome and end state as ``apply`` of the same events, without a Python object
        per event."""
        n = len(columns)
        if n == 0:
            return ApplyOutcome()
        keys, ops = columns.key_array(), columns.op_array()
        if self.shards > 1 and (keys % np.uint64(self.shards) != self.shard).any():
            return self.apply(columns.as_events(worker))  # a routing error: name each stray key
        try:
            slot = self.layout.slot(worker)
        except ValueError as exc:
            return ApplyOutcome(ignored=(str(exc),) * n)
        status = self._tables[slot.group].edit_fields(keys, ops, OP_TIER_AFTER, OP_NEEDS_HOLDER,
                                                      shift=2 * slot.field, width=2)
        applied = int(np.count_nonzero(status == EDIT_CHANGED))
        if applied:
            self._dirty.append(slot.group)
        return self.edit_outcome(worker, keys, ops, status, applied)

    def apply_reports(self, reports: Sequence[tuple[str, Sequence[IndexEvent]]]) -> ApplyOutcome:
        """Apply several reports (a worker, its events) in order: the same state, pending
        records and next ``flush`` as ``apply`` of each report in turn, with the events edited in
        one C call (``TablesEditor.edit_fields_each``) instead of a Python step per event (the
        simulator hands a shard what reached it between two flushes: a few events from each of a
        few workers). A report this path does not take as it is (an unknown worker, an event of
        another worker or of another shard's key, something not an index event) goes through
        ``apply`` in its turn."""
        outcomes: list[ApplyOutcome] = []
        keys: list[int] = []
        ops = bytearray()
        places = array("I")  # per event: its table (region group) << 8 | its field's shift
        ends: list[tuple[int, str]] = []  # (events gathered so far, worker) after each report
        shards, shard, evicted, op_of = self.shards, self.shard, EventOp.EVICTED, OP_OF_TIERED_EVENT
        for worker, events in reports:
            start = len(keys)
            try:
                slot = self.layout.slot(worker)
                for event in events:
                    if event.key % shards != shard or event.worker != worker:
                        raise KeyError(event.key)
                    ops.append(evicted if type(event) is PrefixEvicted else op_of[type(event), event.tier])
                    keys.append(event.key)
            except (ValueError, KeyError, AttributeError, TypeError):
                del keys[start:], ops[start:]
                outcomes += (self._edit_gathered(keys, ops, places, ends), self.apply(events))  # apply() names what is wrong
                keys, ops, places, ends = [], bytearray(), array("I"), []
                continue
            places.extend(array("I", [slot.group << 8 | 2 * slot.field]) * (len(keys) - start))
            ends.append((len(keys), worker))
        outcomes.append(self._edit_gathered(keys, ops, places, ends))
        if len(outcomes) == 1:
            return outcomes[0]
        return ApplyOutcome(sum(o.applied for o in outcomes), sum(o.unchanged for o in outcomes),
                            tuple(reason for o in outcomes for reason in o.ignored))

    def _edit_gathered(self, keys: list[int], ops: bytearray, places: array, ends: list[tuple[int, str]]) -> ApplyOutcome:
        """``apply_reports``' C call over the events gathered so far (``ends``: each report's end
        and worker, to name a refused event's worker)."""
        if not ops:
            return ApplyOutcome()
        status = self._editor.edit_fields_each(places, array("Q", keys), ops, OP_TIER_AFTER, OP_NEEDS_HOLDER, width=2)
        changed = status.count(EDIT_CHANGED)
        if changed:
            self._dirty.extend({place >> 8 for place, st in zip(places, status) if st == EDIT_CHANGED})
        ignored: list[str] = []
        if EDIT_REFUSED in status:
            report = 0
            for i, st in enumerate(status):
                while ends[report][0] <= i:
                    report += 1
                if st == EDIT_REFUSED:
                    refused = _eviction_refused if ops[i] == EventOp.EVICTED else _tier_change_refused
                    ignored.append(refused(ends[report][1], keys[i]))
        return ApplyOutcome(changed, len(status) - changed - len(ignored), tuple(ignored))

    @staticmethod
    def edit_outcome(worker: str, keys: np.ndarray, ops: np.ndarray, status: np.ndarray, applied: int) -> ApplyOutcome:
        """The outcome of one worker's events from their ``LudoTable.edit_fields`` statuses
        (``applied`` of them changed a field), each refused one named."""
        refused = np.flatnonzero(status == EDIT_REFUSED)
        ignored = tuple((_eviction_refused if ops[i] == EventOp.EVICTED else _tier_change_refused)(worker, int(keys[i]))
                        for i in refused)
        return ApplyOutcome(applied, len(status) - applied - len(ignored), ignored)

    def table(self, group: int) -> LudoTable:
        """Region group ``group``'s table, for a C call that edits several shards' tables at once
        (kvcompassd.core.streams); whoever edits it tells ``note_changed``."""
        return self._tables[group]

    def note_changed(self, group: int) -> None:
        """Group ``group``'s table changed outside this shard's own writes: the next ``flush``
        publishes its records."""
        self._dirty.append(group)

    def _apply_one(self, event: IndexEvent) -> str | None:
        if event.key % self.shards != self.shard:
            return f"key {event.key} belongs to shard {event.key % self.shards}, not {self.shard}"
        try:
            slot = self.layout.slot(event.worker)
        except ValueError as exc:
            return str(exc)
        table = self._tables[slot.group]
        shift = 2 * slot.field
        old = table.get(event.key)
        old_value = 0 if old is None else old
        old_tier = (old_value >> shift) & TIER_MASK
        if isinstance(event, PrefixCached):
            new_tier = int(event.tier)
        elif isinstance(event, TierChanged):
            if old_tier == Tier.ABSENT:
                return _tier_change_refused(event.worker, event.key)
            new_tier = int(event.tier)
        elif isinstance(event, PrefixEvicted):
            if old_tier == Tier.ABSENT:
                return _eviction_refused(event.worker, event.key)
            new_tier = Tier.ABSENT
        else:
            return f"not an index event: {type(event).__name__}"
        if new_tier == old_tier:
            return ""
        new_value = (old_value & ~(TIER_MASK << shift)) | (new_tier << shift)
        if old is None:
            table.insert(event.key, new_value)
        elif new_value == 0:
            table.remove(event.key)
        else:
            table.update(event.key, new_value)
        self._dirty.append(slot.group)
        return None

    def withdraw_worker(self, worker: str) -> ApplyOutcome:
        """Clear every field of ``worker`` in this shard (its engine restarted or it died)."""
        slot = self.layout.slot(worker)
        keys, values = self._tables[slot.group].items()
        shift = 2 * slot.field
        held = keys[((values >> shift) & TIER_MASK) != 0]
        return self.apply_columns(worker, IndexEventColumns.evictions(held))

    def flush(self) -> UpdateBatchPublished | None:
        """The batch of everything applied since the last flush, or None if nothing changed."""
        if not self._dirty:
            return None
        touched = sorted(set(self._dirty))
        self._dirty.clear()
        tables = tuple((g, blob) for g in touched for blob in self._tables[g].take_updates())
        if not tables:
            return None
        self.seq += 1
        batch = UpdateBatchPublished.of_shard(self.shard, self.epoch, self.seq, tables)
        self._replay.append(batch)
        return batch

    # -- reads --------------------------------------------------------------------------------

    def snapshot(self) -> ShardSnapshotSent:
        """Full state at the current (epoch, seq); call ``flush`` first to include pending edits."""
        if self._dirty:
            raise RuntimeError("flush() pending edits before taking a snapshot")
        return ShardSnapshotSent(
            self.shard, self.epoch, self.seq, tuple((g.group, self._tables[g.group].snapshot()) for g in self.layout.groups)
        )

    def replay_from(self, from_seq: int) -> list[UpdateBatchPublished] | None:
        """This epoch's batches from ``from_seq`` on (``[]`` past the last), or None when the
        bounded replay log no longer holds ``from_seq``. ``kvcompassd.core.sync.catch_up``
        chooses between this and a snapshot."""
        if from_seq < 1:
            return None
        if from_seq > self.seq:
            return []
        if self._replay and self._replay[0].seq <= from_seq:
            start = from_seq - self._replay[0].seq
            return [self._replay[i] for i in range(start, len(self._replay))]
        return None

    def holders(self, key: int) -> dict[str, Tier]:
        """Exact holders of ``key`` in this shard (full keys make this exact)."""
        out: dict[str, Tier] = {}
        for g in self.layout.groups:
            value = self._tables[g.group].get(key)
            if value is None:
                continue
            for f, worker in enumerate(g.workers):
                tier = (value >> (2 * f)) & TIER_MASK
                if tier:
                    out[worker] = Tier(tier)
        return out

    def group_items(self) -> dict[int, tuple]:
        """(keys, values) arrays of every region group's table: the shard's exact state."""
        return {g.group: self._tables[g.group].items() for g in self.layout.groups}

    def entries(self) -> int:
        return sum(len(t) for t in self._tables)

    def digests(self) -> dict[int, int]:
        """CRC-32 of every region group's snapshot blob: an edge's view of the same state
        exports byte-identical blobs (``EdgeIndexView.digests``), so equal digests are equal
        states, checked without moving the entries."""
        return {g.group: zlib.crc32(self._tables[g.group].snapshot()) for g in self.layout.groups}

    def table_stats(self) -> list[dict]:
        return [
            {"group": g.group, "region": g.region, "entries": len(t), "load": round(t.load, 4),
             "memory_bytes": t.memory_bytes, "epoch": t.epoch}
            for g, t in zip(self.layout.groups, self._tables)
        ]


class ShardViewState:
    """The edge's keyless copy of one shard and where it stands in that shard's stream.

    ``views`` is replaced as a whole dict when a snapshot is installed; each replacement counts
    in ``changes`` (a one-item list the states of one edge view share), so a reader that caches
    pointers to the views (``lookup_plan.ViewPointers``) knows with one comparison per decision
    that none was replaced."""

    __slots__ = ("epoch", "seq", "_views", "changes")

    def __init__(self, changes: list[int] | None = None) -> None:
        self.epoch = -1
        self.seq = -1
        self.changes = [0] if changes is None else changes
        self._views: dict[int, LudoView] = {}

    @property
    def views(self) -> dict[int, LudoView]:
        return self._views

    @views.setter
    def views(self, views: dict[int, LudoView]) -> None:
        self._views = views
        self.changes[0] += 1

    @property
    def ready(self) -> bool:
        return self.seq >= 0


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """Whether a snapshot was installed, and why not."""

    applied: bool
    reason: str = ""


_APPLIED = BatchOutcome(True)  # immutable: one instance serves every applied batch


class EdgeIndexView:
    """Keyless views of every shard's tables, kept in sync from the ordered update streams."""

    def __init__(self, layout: IndexLayout, shards: int, *, edge: str):
        self.layout = layout
        self.shards = shards
        self.edge = edge
        changes = [0]  # view dicts replaced, over every shard (ShardViewState)
        self.state = [ShardViewState(changes) for _ in range(shards)]
        self.batches_applied = 0

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.state)

    def install_snapshot(self, snap: ShardSnapshotSent) -> BatchOutcome:
        """Replace a shard's views with a snapshot if it is newer than the view's position (a
        position never goes back), whole and well-formed."""
        return self.install_tables(snap.shard, snap.epoch, snap.seq, snap.tables)

    def install_tables(self, shard: int, epoch: int, seq: int, tables, *, entries: int | None = None) -> BatchOutcome:
        """``install_snapshot`` from its parts: ``tables`` are (group, blob) pairs, a blob any
        bytes-like object (a reassembled image's slices are installed without a copy); with
        ``entries``, the blobs must declare that many entries in all. On any refusal the
        shard's views and position are unchanged."""
        if not 0 <= shard < self.shards:
            return BatchOutcome(False, reason=f"snapshot for unknown shard {shard}")
        st = self.state[shard]
        if st.ready and (epoch, seq) <= (st.epoch, st.seq):
            return BatchOutcome(False, reason=f"stale snapshot {(epoch, seq)} <= {(st.epoch, st.seq)}")
        groups = [g for g, _ in tables]
        if len(groups) != len(set(groups)) or set(groups) != {g.group for g in self.layout.groups}:
            return BatchOutcome(False, reason="snapshot does not cover this cluster's region groups")
        try:
            views = {g: LudoView.from_snapshot(blob) for g, blob in tables}
        except LudoError as exc:
            return BatchOutcome(False, reason=f"corrupt snapshot: {exc}")
        if entries is not None and sum(v.snapshot_entries for v in views.values()) != entries:
            return BatchOutcome(False, reason=f"corrupt snapshot: its tables hold "
                                              f"{sum(v.snapshot_entries for v in views.values())} entries, "
                                              f"the transfer declared {entries}")
        st.views, st.epoch, st.seq = views, epoch, seq
        return _APPLIED

    def apply_next(self, batch: UpdateBatchPublished) -> str | None:
        """Apply the batch right after the shard's position; the reason if the view rejects it
        (the position then stays). Calling it with any other batch is a programming error."""
        st = self.state[batch.shard]
        if not st.ready or batch.epoch != st.epoch or batch.seq != st.seq + 1:
            raise ValueError(f"batch {(batch.epoch, batch.seq)} is not next after {(st.epoch, st.seq)}")
        # One C call for the whole batch (no Python per table or record). Record blobs are all
        # validated before any view changes; with a snapshot among them (a table grew) they go
        # one by one, and as Ludo blobs carry absolute state, a blob refused part-way leaves the
        # earlier ones applied harmlessly; the snapshot asked for repairs the rest.
        views = st.views
        try:
            targets = [views[group] for group, _ in batch.tables]
        except KeyError as exc:
            return f"batch names unknown group {exc.args[0]}"
        try:
            apply_batch(targets, [blob for _, blob in batch.tables])
        except LudoError as exc:
            return f"batch rejected by the view: {exc}"
        st.seq = batch.seq
        self.batches_applied += 1
        return None

    def skip_to(self, shard: int, seq: int) -> None:
        """Move a shard's position on without the batches in between (the paper's prototype,
        which never repairs a gap: ``SyncSettings(repair=False)``)."""
        st = self.state[shard]
        if not st.ready or seq < st.seq:
            raise ValueError(f"cannot skip shard {shard} from {st.seq} back to {seq}")
        st.seq = seq

    def position(self, shard: int) -> tuple[int, int]:
        st = self.state[shard]
        return st.epoch, st.seq

    def view(self, shard: int, group: int) -> LudoView | None:
        return self.state[shard].views.get(group)

    def snapshot(self, shard: int) -> ShardSnapshotSent:
        """Export this edge's copy of a shard so a peer edge can bootstrap from it."""
        st = self.state[shard]
        if not st.ready:
            raise RuntimeError(f"shard {shard} has no state yet")
        return ShardSnapshotSent(shard, st.epoch, st.seq, tuple((g, v.snapshot()) for g, v in sorted(st.views.items())))

    def digests(self, shard: int) -> dict[int, int]:
        """CRC-32 of each group's view exported as a snapshot blob (``MaintenanceShard.digests``)."""
        return {g: zlib.crc32(v.snapshot()) for g, v in sorted(self.state[shard].views.items())}

    def stats(self) -> list[dict]:
        out = []
        for shard, st in enumerate(self.state):
            for g, v in sorted(st.views.items()):
                out.append({"shard": shard, "group": g, "epoch": st.epoch, "seq": st.seq, "memory_bytes": v.memory_bytes})
        return out
