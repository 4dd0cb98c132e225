"""Per-edge-region update streams: each edge receives only the index updates it can use.

An edge of region ``o`` reads region group ``g``'s table only at the lengths toward ``g``'s
region (``LevelPlan.lengths_toward(o, region(g))``: the latency-derived levels), and workers
register every cached prefix at every length of the union over all pairs. So most of what a
shard publishes is never read by a given edge: at 1,024 x 64 an edge looks up ~25 of the ~560
lengths a prompt registers toward a remote region (tools/scale_projection.py measures the share).

A keyless Ludo view cannot be thinned record by record (a record carries a whole bucket's absolute
state, and the locator words are shared by every key), so the filtering happens one level up:
``ShardStreams`` keeps, beside the shard's full tables, one ``MaintenanceShard`` per edge region
holding only the entries of the lengths that region reads (its ``LengthFilter``). Each is a
stream of its own, with its own ``(epoch, seq)`` numbering, replay log and snapshots, so the sync
protocol (``kvcompassd.core.sync``) and ``catch_up`` work on it unchanged; an edge's views follow
its region's stream, chosen by the maintenance side from the edge's certified region (an edge
declares nothing it could get wrong).

Decisions: for every key an edge looks up that is registered, its region's table holds the same
value as the full table (a key has one length: every event of that key passes or none does), so
its lookups see the same holders and tiers. Keys never registered read some slot's value either
way (a keyless false hit): the filtered tables are other tables with the same load, so such
answers differ key by key but not in rate (tests/test_streams.py).

Events whose length is unknown (an agent that does not report lengths) pass every filter: the
region's table then holds a superset, which costs bytes, never a decision. Agents report each
event's length (``IndexEventColumns.lengths``).

The send side (``StreamFanout``, ``edge_stream``, ``relays_to``): the maintenance unit maps each
subscribed edge's certified id to the stream its ``[[edges]]`` entry's region follows (or the
full one: ``[sync] edge_streams``, ``full_stream_edges``) and refuses ids the config does not
name. With ``[sync] relay`` it sends a stream's live batches to one edge per (stream, region),
the first subscribed in config order, which forwards them unchanged to the region's other edges
of that stream; receivers take relayed batches only from those edges and apply them through the
same sync protocol, so a lost batch is a gap repaired from the unit (the unit's fan-out grows with
regions, not with edges per region). Batches carry no signature of the unit: a receiver checks a
relayed one as any (position, table ids, CRCs), so it trusts the edges of its own region and
stream with its view's content, and no other edge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .events import LENGTH_DTYPE, OP_NEEDS_HOLDER, OP_TIER_AFTER, UNKNOWN_LENGTH, IndexEvent, IndexEventColumns
from .index import MIN_TABLE_CAPACITY, ApplyOutcome, MaintenanceShard
from .layout import IndexLayout
from .levels import LevelPlan
from .ludo import RoutedEditError, RoutedTables
from .messages import UpdateBatchPublished

__all__ = ["LengthFilter", "ShardStreams", "StreamFanout", "UNKNOWN_LENGTH", "UnknownEdge", "edge_stream", "relays_to",
           "stream_regions"]

# UNKNOWN_LENGTH: an event whose length was not reported: every filter passes it


@dataclass(frozen=True, slots=True)
class LengthFilter:
    """The lengths an edge of ``region`` reads in each region group's table (group order)."""

    region: str
    per_group: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for lengths in self.per_group:
            if list(lengths) != sorted(set(lengths)) or any(n <= 0 for n in lengths):
                raise ValueError(f"a group's lengths must be ascending distinct positive ints, got {lengths}")

    @classmethod
    def for_edge_region(cls, plan: LevelPlan, layout: IndexLayout, region: str) -> LengthFilter:
        """What ``PrefixLookup`` of an edge in ``region`` reads, group by group."""
        return cls(region, tuple(tuple(plan.lengths_toward(region, g.region)) for g in layout.groups))

    def keeps(self, group: int, lengths: np.ndarray) -> np.ndarray:
        """Per length, whether this region's table of ``group`` takes it (unknown ones: yes)."""
        wanted = np.asarray(self.per_group[group], dtype=LENGTH_DTYPE)
        return np.isin(lengths, wanted) | (lengths == UNKNOWN_LENGTH)


def as_lengths(lengths: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Each event's indexed length as a uint32 array of ``n`` (all unknown for None)."""
    if lengths is None:
        return np.zeros(n, dtype=LENGTH_DTYPE)
    arr = np.asarray(lengths)
    if arr.shape != (n,) or (arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0
                                           or int(arr.max()) > np.iinfo(LENGTH_DTYPE).max)):
        raise ValueError(f"need {n} event lengths as integers in [0, 2^32), got {arr.dtype} of shape {arr.shape}")
    return arr.astype(LENGTH_DTYPE, copy=False)


class ShardStreams:
    """One shard's full tables and one filtered stream per edge region (see the module docstring).

    ``full`` is the shard as before (exact holders, and the stream of any subscriber that
    asks for everything); ``stream(region)`` is the shard an edge of ``region`` follows. Every
    write goes to ``full`` and, thinned by each region's filter, to that region's shard; ``flush``
    publishes one batch per stream that changed."""

    def __init__(self, layout: IndexLayout, plan: LevelPlan, shard: int, shards: int, *, epoch: int,
                 regions: Iterable[str] | None = None, scale_filtered_capacity: bool = False,
                 **shard_options) -> None:
        self.layout = layout
        self.full = MaintenanceShard(layout, shard, shards, epoch=epoch, **shard_options)
        names = list(dict.fromkeys(regions if regions is not None else (g.region for g in layout.groups)))
        self.filters = {r: LengthFilter.for_edge_region(plan, layout, r) for r in names}
        # Each stream's tables get their own ids, so a blob of one stream is refused by another's views.
        self.filtered = {r: MaintenanceShard(layout, shard, shards, epoch=epoch, table_salt=i + 1,
                                             **self._filtered_options(shard_options, plan, self.filters[r],
                                                                      scale_filtered_capacity))
                         for i, r in enumerate(names)}
        # Updates (changed fields) each stream took so far, the full one under None: what its
        # subscribers apply (tools/scale_projection.py compares them).
        self.applied: dict[str | None, int] = dict.fromkeys([None, *names], 0)
        # One C call per report edits the full table and every stream's (``RoutedTables``): per
        # region group, the streams that take each length (an unknown length: all of them).
        self._order: list[str | None] = [None, *names]
        self._note = [s.note_changed for s in (self.full, *self.filtered.values())]
        self._routed = []
        for g in range(len(layout.groups)):
            routes: dict[int, list[int]] = {UNKNOWN_LENGTH: list(range(len(names)))}
            for j, r in enumerate(names):
                for length in self.filters[r].per_group[g]:
                    routes.setdefault(length, []).append(j)
            self._routed.append(RoutedTables(self.full.table(g), [s.table(g) for s in self.filtered.values()], routes))

    @staticmethod
    def _filtered_options(options: dict, plan: LevelPlan, length_filter: LengthFilter, scale: bool) -> dict:
        """A region stream's shard options: with ``scale``, each group's initial capacity is the
        full table's times the share of the registration lengths the region reads there (a
        region's tables hold that share of the entries at most; they grow past it if needed)."""
        capacity = options.get("initial_capacity")
        if not scale or capacity is None:
            return options
        registered = max(1, len(plan.registration_lengths()))
        per_group = (capacity,) * len(length_filter.per_group) if isinstance(capacity, int) else tuple(capacity)
        scaled = tuple(max(MIN_TABLE_CAPACITY, math.ceil(c * len(lengths) / registered))
                       for c, lengths in zip(per_group, length_filter.per_group))
        return {**options, "initial_capacity": scaled}

    def stream(self, region: str | None) -> MaintenanceShard:
        """The shard an edge of ``region`` follows (None: everything)."""
        if region is None:
            return self.full
        try:
            return self.filtered[region]
        except KeyError:
            raise ValueError(f"no update stream for region {region!r}") from None

    def apply_columns(self, worker: str, columns: IndexEventColumns,
                      lengths: Sequence[int] | np.ndarray | None = None) -> ApplyOutcome:
        """Apply one worker's events to every stream; ``lengths`` (one per event, 0 = unknown;
        by default the columns' own, ``IndexEventColumns.lengths``) decide which regions'
        streams take each. Returns the full shard's outcome.

        One C call edits the full table and each stream's table an event reaches
        (``RoutedTables``), each stream recording exactly what ``MaintenanceShard.apply_columns``
        of its events would. A report naming other shards' keys takes the checking path instead
        (``_apply_checking``), and one of an unknown worker goes to the full shard alone, which
        names the error."""
        n = len(columns)
        lengths_arr = columns.length_array() if lengths is None else as_lengths(lengths, n)
        full = self.full
        if not self.filtered or not n:
            return self._count(None, full.apply_columns(worker, columns))
        keys, ops = columns.key_array(), columns.op_array()
        try:
            slot = self.layout.slot(worker)
        except ValueError:
            return self._count(None, full.apply_columns(worker, columns))  # names the worker, applies nothing
        if full.shards > 1 and (keys % np.uint64(full.shards) != full.shard).any():
            return self._apply_checking(worker, slot.group, columns, lengths_arr)
        try:
            status, changed = self._routed[slot.group].edit_fields(keys, ops, lengths_arr, OP_TIER_AFTER,
                                                                   OP_NEEDS_HOLDER, shift=2 * slot.field, width=2)
        except RoutedEditError as exc:
            self._note_changed(slot.group, exc.changed)  # what changed before the failure is published
            raise
        self._note_changed(slot.group, changed)
        return full.edit_outcome(worker, keys, ops, status, int(changed[0]))

    def _note_changed(self, group: int, changed: np.ndarray) -> None:
        """Count each stream's changed fields and mark its table for the next flush (a Python
        step only per stream that changed)."""
        applied, order, note = self.applied, self._order, self._note
        # (the few streams' counts walked in Python: np.flatnonzero was most of this step's
        # 31 us a report in a maintenance unit, thread CPU timed in place)
        for j, count in enumerate(changed.tolist()):
            if count:
                applied[order[j]] += count
                note[j](group)

    def _count(self, stream: str | None, outcome: ApplyOutcome) -> ApplyOutcome:
        self.applied[stream] += outcome.applied
        return outcome

    def _apply_checking(self, worker: str, group: int, columns: IndexEventColumns,
                        lengths: np.ndarray) -> ApplyOutcome:
        """A report with keys of other shards (a routing error): each stream checks its part on
        its own, naming every stray key and applying the rest (``MaintenanceShard.apply``)."""
        outcome = self._count(None, self.full.apply_columns(worker, columns))
        for region, shard in self.filtered.items():
            mine = self.filters[region].keeps(group, lengths)
            if mine.any():
                self._count(region, shard.apply_columns(worker, columns if mine.all() else columns.select(mine)))
        return outcome

    def apply(self, events: Sequence[IndexEvent], lengths: Sequence[int] | np.ndarray | None = None) -> ApplyOutcome:
        """``apply_columns`` for event objects (of any workers), in order."""
        lengths_arr = as_lengths(lengths, len(events))
        outcome = self.full.apply(events)
        self.applied[None] += outcome.applied
        for region, shard in self.filtered.items():
            filt = self.filters[region]
            kept = []
            for event, length in zip(events, lengths_arr.tolist()):
                try:
                    group = self.layout.slot(event.worker).group
                except ValueError:
                    continue
                if length == UNKNOWN_LENGTH or length in filt.per_group[group]:
                    kept.append(event)
            if kept:
                self.applied[region] += shard.apply(kept).applied
        return outcome

    def withdraw_worker(self, worker: str) -> ApplyOutcome:
        """Clear ``worker``'s fields in every stream; returns the full shard's outcome."""
        for region, shard in self.filtered.items():
            self.applied[region] += shard.withdraw_worker(worker).applied
        outcome = self.full.withdraw_worker(worker)
        self.applied[None] += outcome.applied
        return outcome

    def flush(self) -> dict[str | None, UpdateBatchPublished]:
        """Each stream's batch of what it applied since the last flush (None: the full one)."""
        out: dict[str | None, UpdateBatchPublished] = {}
        for region, shard in ((None, self.full), *self.filtered.items()):
            batch = shard.flush()
            if batch is not None:
                out[region] = batch
        return out


# -- which edge follows which stream, and who gets each batch (the maintenance unit's send side) --


class UnknownEdge(ValueError):
    """An edge identity the config does not name: it follows no stream of this unit."""


def edge_stream(cfg, edge: str) -> str | None:
    """The stream edge ``edge`` follows: its region's (by the config's ``[[edges]]`` entry for
    the edge's certified id: an edge claims nothing), or None for the full stream
    (``[sync] edge_streams = "full"`` or ``full_stream_edges``). Raises ``UnknownEdge``."""
    region = cfg.edge_region(edge)
    if region is None:
        raise UnknownEdge(f"edge {edge!r} is not in this cluster's config ([[edges]]): no update stream for it")
    return None if cfg.sync.full_stream_for(edge) else region


def stream_regions(cfg) -> list[str]:
    """The regions whose edges follow their region's stream, in config order (a unit keeps one
    filtered stream per region that has such an edge, and none for regions without edges)."""
    return list(dict.fromkeys(e.region for e in cfg.edges if not cfg.sync.full_stream_for(e.id)))


class StreamFanout:
    """The subscribed edges of one unit, by the stream each follows (sans-IO).

    ``subscribe`` takes an edge's certified id and an opaque handle (the shell's connection);
    ``deliveries`` says which handles get which of ``ShardStreams.flush``'s batches. An edge
    has one subscription: subscribing again (a reconnection) replaces the handle."""

    def __init__(self, cfg, streams: ShardStreams):
        self.cfg = cfg
        self.streams = streams
        self.relay = cfg.sync.relay
        self._stream_of: dict[str, str | None] = {}  # edge -> the stream it follows
        self._handles: dict[str, object] = {}
        self._order = {e.id: (e.region, i) for i, e in enumerate(cfg.edges)}

    def stream_of(self, edge: str) -> str | None:
        """The stream ``edge`` follows (``edge_stream``), checked against this unit's streams."""
        stream = edge_stream(self.cfg, edge)
        if stream is not None and stream not in self.streams.filtered:
            raise UnknownEdge(f"edge {edge!r}: no update stream for region {stream!r} at this unit")
        return stream

    def shard_of(self, edge: str) -> MaintenanceShard:
        """The shard (stream) an edge's catch-ups and snapshots come from."""
        return self.streams.stream(self.stream_of(edge))

    def subscribe(self, edge: str, handle: object) -> str | None:
        stream = self.stream_of(edge)
        self._stream_of[edge] = stream
        self._handles[edge] = handle
        return stream

    def unsubscribe(self, edge: str, handle: object | None = None) -> bool:
        """Drop ``edge``'s subscription (only if it is still ``handle``'s, when given)."""
        if edge not in self._handles or (handle is not None and self._handles[edge] is not handle):
            return False
        del self._handles[edge], self._stream_of[edge]
        return True

    def handle(self, edge: str) -> object | None:
        return self._handles.get(edge)

    @property
    def edges(self) -> list[str]:
        return sorted(self._handles)

    def followers(self) -> dict[str, list[str]]:
        """Per stream ("full" for the full one), the subscribed edges following it."""
        out: dict[str, list[str]] = {}
        for edge in self.edges:
            stream = self._stream_of[edge]
            out.setdefault("full" if stream is None else stream, []).append(edge)
        return out

    def live_edges(self) -> dict[str | None, list[str]]:
        """Per stream, the subscribed edges its live batches go to: every follower, or with
        ``[sync] relay`` one per region (the first subscribed in config order), which forwards
        them to its region's other edges of the stream (``relays_to``)."""
        out: dict[str | None, list[str]] = {}
        chosen: set[tuple[str | None, str]] = set()
        for edge in sorted(self._stream_of, key=lambda e: self._order[e][1]):
            stream, region = self._stream_of[edge], self._order[edge][0]
            if self.relay and (stream, region) in chosen:
                continue
            chosen.add((stream, region))
            out.setdefault(stream, []).append(edge)
        return out

    def deliveries(self, published: dict[str | None, UpdateBatchPublished]) -> list[tuple[str, object, str | None]]:
        """(edge, handle, stream) for every edge a published batch goes to (``live_edges``;
        ``published[stream]`` is what it gets)."""
        if not published:
            return []
        return [(edge, self._handles[edge], stream) for stream, edges in self.live_edges().items()
                if stream in published for edge in edges]


def relays_to(cfg, edge: str) -> list[str]:
    """The edges ``edge`` forwards its unit's live batches to with ``[sync] relay``: the other
    edges of its region that follow the same stream (config order). The same relation says
    whose batches an edge takes besides its unit's: a relaying edge only forwards, and the
    receiver applies them through its own sync protocol (positions, table ids, CRCs)."""
    if not cfg.sync.relay:
        return []
    region, stream = cfg.edge_region(edge), edge_stream(cfg, edge)
    return [e.id for e in cfg.edges if e.id != edge and e.region == region and edge_stream(cfg, e.id) == stream]
