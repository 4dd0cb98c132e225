"""KVCompass as a simulator policy, driving the real discovery-plane core.

The objects are the ones the daemon runs: one ``MaintenanceShard`` per shard (``cfg.shards``),
one ``EdgeIndexView`` + ``Router`` per region (that region's edge), one ``BlockTree`` per
worker. Worker ``w``'s engine block events go through its block tree; the resulting index
events go to the owning shards (``key % N``); every shard that changed flushes one
``UpdateBatchPublished``, and each batch is delivered to every edge view. A shard flushes what
it applied within ``flush_interval_ms`` (default 1 ms) as one batch, as the daemon's maintenance
unit flushes once per event-loop turn; 0 flushes after every worker's event batch.

Update transport (§5.7), modelled the way the daemon moves updates:

- Placement: shard ``s`` runs beside worker ``floor(s * W / N)`` (config order; the paper puts
  each maintenance unit next to a worker), so it sits in that worker's region.
- Delay: with ``wan_propagation`` (default) index events take the one-way latency from the
  worker's region to the shard's region (agent -> maintenance), and batches take the one-way
  latency from the shard's region to the edge's plus ``update_delay_ms`` (maintenance -> edge).
  Without it only ``update_delay_ms`` applies. The delay of one (shard, edge) stream is
  constant, so batches arrive in order, as on the daemon's QUIC stream.
- Shared views: without loss every edge applies the same batches in the same order and differs
  from the others only by its delay, so by default (``shared_views=None``: when ``update_loss``
  is 0) the edges' views are one set of shared table versions and each edge's position is worked
  out from the batches' publish times when it reads (``shared_views.py``): one copy of the index
  instead of one per edge, no delivery event per (batch, edge), and the same decisions as per-edge
  views (``shared_views=False``; tests/test_sim_shared_views.py compares them).
- Loss: each (batch, edge) delivery is lost independently with probability ``update_loss``.
  What an edge does about it is the daemon's own protocol, ``kvcompassd.core.sync`` (one
  ``EdgeSync`` per edge, ``catch_up`` at the shard), which this policy only moves messages for:
  with ``repair=True`` (the daemon) the next batch of that shard shows the gap, the edge sends a
  ``ResyncRequested`` (one outstanding per edge and shard, sent again on its timeout), and
  ``catch_up`` answers from the replay log (or a snapshot) after the edge->shard latency plus
  one more propagation delay; requests and answers are not lost (the daemon's control stream is
  reliable and resent on reconnection). A shard that published nothing for
  ``position_heartbeat_ms`` announces its position to every edge (lost as a batch is), so a
  lost *last* batch is repaired too (the daemon's ``[sync] position_heartbeat_ms``). With ``repair=False`` (the paper's prototype, §5.7:
  failed batches are not retransmitted) the edge applies the next batch over the gap: Ludo
  records carry absolute state, so the buckets the lost batch touched stay stale until a later
  update rewrites them. A batch the view cannot apply at all (a lost table rebuild changed the
  Ludo epoch) makes the edge reload that shard from a snapshot, the paper's "reloading the
  maintenance units' lookup view".

The simulator engine has its own ``update_delay_ms``/``update_loss`` that act on the engine
events before any policy sees them. For KVCompass those belong here, on the index update stream,
where gap detection lives: ``adopt_update_transport(settings)`` moves them into the policy and
returns the settings with the engine's copies zeroed, so nothing is counted twice.

Feeds read (see ``policy.py``): the request at its edge; worker block events; responses with the
reused tokens (cache belief) and the piggybacked queue vector; live load only of the edge's own
region's workers; a timer for the Delta broadcasts of queue vectors between regions and for
deliveries in flight.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvcompassd.core.ablation import Ablation
from kvcompassd.core.events import IndexEvent, PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard, table_capacities
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.migration import HOT_MISS_OUTCOMES, MigrationPlanned
from kvcompassd.core.router import ForwardDecided, Router
from kvcompassd.core.sync import EdgeSync, PositionHeartbeats, SyncSettings, SyncStep, catch_up
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.core.messages import (ResyncRequested, RoomVectorBroadcast, ShardPositionAnnounced, ShardSnapshotSent,
                                      UpdateBatchPublished)

from .shared_views import SharedViews, lookup_readers
from .policy import (FALSE_INDEX_BEHIND, FALSE_KEYLESS, FALSE_PENDING, FALSE_VIEW_BEHIND, BasePolicy, MigrationOrdered, PolicyError,
                     RouteDecision, Topology)
from .workloads import Request

__all__ = ["KVCompassPolicy"]

# Kinds of deliveries in flight (heap payload tags).
_TO_SHARD, _TO_EDGE, _RESYNC_AT_SHARD, _REPLAY_TO_EDGE, _BROADCAST, _FLUSH, _SYNC_TIMER = range(7)
_HEARTBEAT, _POSITION_TO_EDGE = 7, 8  # an idle shard's position announcement: due, and delivered
EPOCH = 1


def _due_and_seq(send: tuple) -> tuple[float, int]:
    return send[0], send[1]


class KVCompassPolicy(BasePolicy):
    """KVCompass over the real core. Options: ``ablation`` (§5.4, passed to every Router),
    ``consistency`` (cross-level consistency of the lookup), the update transport
    (``update_delay_ms``, ``update_loss``, ``repair``, ``wan_propagation``,
    ``flush_interval_ms``; see the module docstring), ``seed`` (loss draws only) and ``top_k``
    (score terms kept per decision: the daemon logs 3, the simulator needs none).
    ``shared_views`` (None: shared when there is no loss; see the module docstring);
    ``context_tokens`` replaces ``[index] context_tokens`` (how far the indexed lengths reach;
    core/levels.py), e.g. 16384 for the paper's reach against the same prompts."""

    name = "kvcompass"

    def __init__(
        self,
        topo: Topology,
        *,
        ablation: Ablation | None = None,
        consistency: bool = True,
        update_delay_ms: float = 0.0,
        update_loss: float = 0.0,
        repair: bool = True,
        wan_propagation: bool = True,
        flush_interval_ms: float = 1.0,
        seed: int = 0,
        top_k: int = 0,
        fingerprint_bits: int | None = None,
        context_tokens: int | None = None,
        shared_views: bool | None = None,
        position_heartbeat_ms: float = 1000.0,
    ) -> None:
        super().__init__(topo)
        if not (update_delay_ms >= 0 and math.isfinite(update_delay_ms)):
            raise PolicyError(f"update_delay_ms must be finite and >= 0, got {update_delay_ms!r}")
        if not 0 <= update_loss < 1:
            raise PolicyError(f"update_loss must be in [0, 1), got {update_loss!r}")
        if not (position_heartbeat_ms >= 0 and math.isfinite(position_heartbeat_ms)):
            raise PolicyError(f"position_heartbeat_ms must be finite and >= 0, got {position_heartbeat_ms!r}")
        if not (flush_interval_ms >= 0 and math.isfinite(flush_interval_ms)):
            raise PolicyError(f"flush_interval_ms must be finite and >= 0, got {flush_interval_ms!r}")
        self.flush_interval_s = flush_interval_ms / 1000.0
        cfg = topo.config
        if context_tokens is not None:  # the index's reach only (16384: the paper's lengths); prompts keep theirs
            cfg = dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, context_tokens=context_tokens))
        self.cfg = cfg
        self.ablation = ablation or Ablation()
        self.update_delay_ms = float(update_delay_ms)
        self.update_loss = float(update_loss)
        self.repair = bool(repair)
        self.wan_propagation = bool(wan_propagation)
        self._rng = np.random.default_rng(seed)

        self.layout = IndexLayout.from_config(cfg)
        self.plan = LevelPlan.from_config(cfg)
        n_shards = cfg.shards
        self.n_shards = n_shards
        index = cfg.index
        capacities = table_capacities(cfg, self.layout)
        self.shards = [
            MaintenanceShard(self.layout, s, n_shards, epoch=EPOCH, initial_capacity=capacities,
                             fingerprint_bits=index.fingerprint_bits if fingerprint_bits is None else fingerprint_bits,
                             max_load=index.max_load)
            for s in range(n_shards)
        ]
        self.regions = topo.regions
        self._region_index = {r: i for i, r in enumerate(self.regions)}
        edge_ids = {}
        for e in cfg.edges:
            edge_ids.setdefault(e.region, e.id)
        self._edge_views = [EdgeIndexView(self.layout, n_shards, edge=edge_ids.get(r, f"edge-{r}"))
                            for r in self.regions]
        self._edge_of = {v.edge: i for i, v in enumerate(self._edge_views)}
        self.routers = [
            Router(cfg, r, view, now=0.0, ablation=self.ablation, consistency=consistency, top_k=top_k,
                   plan=self.plan)
            for r, view in zip(self.regions, self._edge_views)
        ]
        self._shared_option = shared_views
        self._shared: SharedViews | None = None
        self.syncs: list[EdgeSync] = []
        self._now = 0.0
        salt = namespace_salt(cfg.model, cfg.tenant)
        self._salt = salt
        lengths = list(self.plan.registration_lengths())
        # salt=: the same keys as prefix_keys(path, lengths, salt), hashed incrementally
        self.trees = [BlockTree(w, lengths, salt=salt) for w in topo.worker_ids]
        self.worker_ids = topo.worker_ids
        self._worker_region = topo.worker_region.tolist()

        # Latency legs in seconds (see the module docstring).
        n_workers = topo.n_workers
        shard_region = [self._worker_region[(s * n_workers) // n_shards] if n_workers else 0 for s in range(n_shards)]
        self.shard_region = tuple(self.regions[r] for r in shard_region)
        owm = topo.one_way_ms if self.wan_propagation else np.zeros_like(topo.one_way_ms)
        # agent (region a) -> shard s
        self._to_shard_s = [[owm[a, shard_region[s]] / 1000.0 for s in range(n_shards)] for a in range(len(self.regions))]
        # shard s -> edge e, plus the configured propagation delay
        self._to_edge_s = [[0.0] * len(self.regions) for _ in range(n_shards)]
        self._edge_to_shard_s = [[0.0] * n_shards for _ in self.regions]
        self._set_push_delays()
        for e in range(len(self.regions)):
            for s in range(n_shards):
                self._edge_to_shard_s[e][s] = owm[e, shard_region[s]] / 1000.0
        self._owm_s = topo.one_way_ms / 1000.0  # for piggyback send times and broadcasts
        self._setup_views()

        self._arrivals_done = False
        self._heap: list[tuple[float, int, int, Any]] = []
        self._heap_seq = 0
        self._sync_timer_at: dict[tuple[int, int], float] = {}  # (edge, shard) -> its armed catch-up timeout
        self._flush_pending = [False] * n_shards
        self._inbox: list[list[tuple[str, list[IndexEvent]]]] = [[] for _ in range(n_shards)]  # (worker, events) delivered, not yet applied
        # Deliveries on their way to each shard, held by the shard rather than as heap events
        # (``_en_route``; see ``_send_to_shard``): per shard a heap of (due, seq, sent at, sent
        # without a leg, worker, events), the due time of its next flush (inf: none armed) and
        # the first delivery of the current flush round that a read of the shard took early.
        self._en_route: list[list[tuple]] = [[] for _ in range(n_shards)]
        self._flush_at = [math.inf] * n_shards
        self._round_first: list[tuple | None] = [None] * n_shards
        self._held_by_shards: bool | None = None  # decided at the first index event (_holds_deliveries)
        # [sync] position_heartbeat_ms (0: off): an idle shard announces its position to every
        # edge, lost as a batch is, so a lost last batch is repaired (per-edge views only).
        self._heartbeats = (PositionHeartbeats(position_heartbeat_ms / 1000.0, (), now=0.0)
                            if position_heartbeat_ms > 0 and self.repair else None)
        self._heartbeat_armed = False
        self._heartbeat_rng = np.random.default_rng([seed, 1])
        # request id -> (edge, claimed tokens, from the ledger, the decision's dispatch)
        self._claims: dict[int, tuple[int, int, bool, int, Tier]] = {}  # ... and the claim's tier
        # With the engine's exact cache map (on_truth_tracked): (key, worker) -> the seq of the
        # batch that carries its eviction, for explain_claim; dropped when it is cached again.
        self._evicted_in: dict[tuple[int, str], int] | None = None
        self._migrations: list[MigrationOrdered] = []
        # Each router's broadcast deadline as last read: a lower bound of its true one (a
        # deadline only moves later: what was sent, or piggybacked, is never unsent).
        self._deadlines = [self._deadline_of(i, 0.0) for i in range(len(self.routers))]
        self._next_broadcast = self._broadcast_deadline(0.0)
        self.counters = dict.fromkeys(
            ("index_events", "batches_published", "batch_deliveries", "batches_lost", "resyncs", "replays",
             "snapshots_installed", "migrations_planned", "broadcasts", "urgent_broadcasts", "room_broadcasts", "decisions",
             "remote_decisions"), 0)
        self.counters["positions_announced"] = 0  # idle shards' announcements (per shard, not per edge)

    # ------------------------------------------------------------------------------ setup

    def _set_push_delays(self) -> None:
        extra = self.update_delay_ms / 1000.0
        owm = self.topo.one_way_ms if self.wan_propagation else np.zeros_like(self.topo.one_way_ms)
        for s in range(self.n_shards):
            sr = self._region_index[self.shard_region[s]]
            for e in range(len(self.regions)):
                self._to_edge_s[s][e] = owm[sr, e] / 1000.0 + extra

    def _setup_views(self) -> None:
        """Every edge's views from the shards' initial snapshots: shared table versions, or a
        copy per edge with its sync follower (with loss; or ``shared_views=False``)."""
        shared = self.update_loss == 0 if self._shared_option is None else self._shared_option
        if shared and self.update_loss > 0:
            raise PolicyError("shared views need update_loss = 0: a lost batch makes an edge's state its own")
        for view in self._edge_views:
            for st in view.state:
                st.views, st.epoch, st.seq = {}, -1, -1
        snapshots = [shard.snapshot() for shard in self.shards]
        if shared:
            pointers = [router.lookup.native_plan()[1] for router in self.routers]
            readers = [lookup_readers(r.lookup.group_lengths, r.lookup.query_lengths) for r in self.routers]
            self._shared, self.syncs = SharedViews(self._edge_views, pointers, readers, self._to_edge_s), []
            for snap in snapshots:
                self._shared.install(snap)
        else:
            self._shared = None
            self.syncs = [EdgeSync(view, SyncSettings(repair=self.repair)) for view in self._edge_views]
            for sync in self.syncs:
                for snap in snapshots:
                    sync.on_snapshot(snap, now=0.0)

    @property
    def views(self) -> list[EdgeIndexView]:
        """Each region's edge view, as of the latest time the policy was given."""
        if self._shared is not None:
            self._shared.advance_all(self._now)
        return self._edge_views

    @property
    def shared_views(self) -> bool:
        return self._shared is not None

    def adopt_update_transport(self, settings: Any) -> Any:
        """Take the engine's ``update_delay_ms``/``update_loss`` (a ``SimSettings``) into this
        policy's update stream and return the settings with the engine's copies zeroed."""
        if settings.update_loss:
            if not 0 <= settings.update_loss < 1:
                raise PolicyError(f"update_loss must be in [0, 1), got {settings.update_loss!r}")
            self.update_loss = float(settings.update_loss)
            self._setup_views()  # before any event: per-edge views, as loss needs
        if settings.update_delay_ms:
            self.update_delay_ms = float(settings.update_delay_ms)
            self._set_push_delays()
            if self._shared is not None:
                self._shared.set_delays()
        return dataclasses.replace(settings, update_delay_ms=0.0, update_loss=0.0)

    # ------------------------------------------------------------------------------ in flight

    def _push(self, due: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (due, self._heap_seq, kind, payload))
        self._heap_seq += 1

    def _advance(self, now: float) -> None:
        if now > self._now:
            self._now = now
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, kind, payload = heapq.heappop(heap)
            # The kinds in the order of how often they come (without loss: no _TO_EDGE at all; with
            # shared views, deliveries to shards wait at the shard, not here: no _TO_SHARD).
            if kind == _FLUSH:
                if self._held_by_shards:
                    if due == self._flush_at[payload]:  # (else a flush re-armed earlier since)
                        self._flush_round(payload, due)
                    continue
                self._flush_pending[payload] = False
                self._publish(payload, due)
            elif kind == _BROADCAST:
                sends, i, checked = payload
                if i + 1 < len(sends):  # the router's next message of this Delta takes its place
                    heapq.heappush(heap, (*sends[i + 1][:2], _BROADCAST, (sends, i + 1, checked)))
                if self._arrivals_done:
                    continue
                msg = sends[i][2]
                queues = self.routers[self._region_index[msg.to_region]].queues
                if msg.__class__ is RoomVectorBroadcast:  # its rooms checked once too, as the vector
                    key = ("rooms", id(msg.rooms))
                    if checked.get(key) is None:
                        checked[key] = queues.room_updates(msg.from_region, msg.rooms)
                    queues.on_room_broadcast(msg, now=due, updates=checked[key])
                    continue
                if checked.get(id(msg.vector)) is None:  # its first receiver checks it for all
                    checked[id(msg.vector)] = queues.remote_updates(msg.from_region, msg.vector)
                queues.on_broadcast(msg, now=due, updates=checked[id(msg.vector)])
            elif kind == _TO_SHARD:
                self._shard_apply(payload[0], payload[1], due)
            elif kind == _TO_EDGE:
                self._deliver(payload[0], payload[1], due)
            elif kind == _RESYNC_AT_SHARD:
                self._answer_resync(payload, due)
            elif kind == _REPLAY_TO_EDGE:
                self._deliver_replay(payload[0], payload[1], due)
            elif kind == _SYNC_TIMER:
                self._sync_timeout(payload[0], payload[1], due)
            elif kind == _HEARTBEAT:
                self._announce_positions(due)
            elif kind == _POSITION_TO_EDGE:
                self._sync_step(payload[0], payload[1].shard, self.syncs[payload[0]].on_position(payload[1], now=due), due)

    def next_timer(self) -> float | None:
        t = self._next_broadcast
        if self._heap and self._heap[0][0] < t:
            t = self._heap[0][0]
        return None if t == math.inf else t

    def on_timer(self, *, now: float) -> None:
        self._advance(now)
        if now >= self._next_broadcast:
            # Only the routers whose deadline has come (the others have nothing due: asking
            # each of 64 for its 63 regions every time one is due was ~5 % of a scale run).
            deadlines = self._deadlines
            for i, router in enumerate(self.routers):
                if deadlines[i] > now:
                    continue
                # One region's broadcasts share one vector, and every router is built from the
                # same config: its (worker index, ms) pairs are checked once, by the first
                # receiver, for all of them (by the vector's id: each message holds its vector).
                checked: dict[int, Any] = {}
                broadcasts = router.queues.due_broadcasts(now=now)
                # Each with the region's VRAM room, while some worker is short of it.
                rooms = router.queues.room_broadcasts([m.to_region for m in broadcasts], now=now)
                self.counters["broadcasts"] += len(broadcasts)
                self.counters["room_broadcasts"] += len(rooms)
                # All of them as one heap entry at a time (the earliest yet to arrive; each
                # message keeps the due time and seq it had as an entry of its own, so they come
                # out in the same order): the heap holds ~one entry per router, not ~4,000.
                sends = []
                for msg in broadcasts + rooms:
                    a, b = self._region_index[msg.from_region], self._region_index[msg.to_region]
                    sends.append((now + self._owm_s[a, b], self._heap_seq, msg))
                    self._heap_seq += 1
                if sends:
                    sends.sort(key=_due_and_seq)
                    heapq.heappush(self._heap, (*sends[0][:2], _BROADCAST, (sends, 0, checked)))
                deadlines[i] = self._deadline_of(i, now)
            self._next_broadcast = self._broadcast_deadline(now)

    def on_arrivals_end(self, *, now: float) -> None:
        """No request is left to route: queue estimates feed nothing any more, so the Delta
        broadcasts stop (at 64 regions they are 4,032 messages per 100 ms, and a run's drain
        lasts seconds). Index updates go on: the shards' state is reported at the end."""
        self._arrivals_done = True
        self._next_broadcast = math.inf

    def _deadline_of(self, i: int, now: float) -> float:
        d = self.routers[i].queues.next_deadline(now=now)
        return math.inf if d is None else d

    def _broadcast_deadline(self, now: float) -> float:
        """The earliest router deadline, as every router's ``next_deadline(now)`` gives it: the
        least lower bound is read again until it holds (then no true deadline is earlier)."""
        if self._arrivals_done:
            return math.inf
        deadlines = self._deadlines
        while deadlines:
            i = min(range(len(deadlines)), key=deadlines.__getitem__)
            if deadlines[i] == math.inf:
                break
            true = self._deadline_of(i, now)
            if true == deadlines[i]:
                return true
            deadlines[i] = true
        return math.inf

    # ------------------------------------------------------------------------------ index updates

    def on_cache_events(self, worker_index: int, events: Sequence[Any], *, now: float) -> None:
        self._advance(now)
        index_events = self.trees[worker_index].apply_each(events)  # each event's diff in turn, as apply()
        if not index_events:
            return
        self.counters["index_events"] += len(index_events)
        n = self.n_shards
        # Only the shards these events touch (a request's few dozen events reach as many of 64
        # shards; a list per shard per call was most of this loop), in shard order as before.
        per_shard: dict[int, list[IndexEvent]] = {}
        for ev in index_events:
            s = ev.key % n
            evs = per_shard.get(s)
            if evs is None:
                per_shard[s] = [ev]
            else:
                evs.append(ev)
        legs = self._to_shard_s[self._worker_region[worker_index]]
        held = self._held_by_shards
        if held is None:
            held = self._held_by_shards = self._holds_deliveries()
        for s in sorted(per_shard):
            evs = per_shard[s]
            if held:
                self._send_to_shard(s, evs, now, legs[s])
            elif legs[s] > 0:
                self._push(now + legs[s], _TO_SHARD, (s, evs))
            else:
                self._shard_apply(s, evs, now)

    # Deliveries held by their shard (no heap event per delivery).
    #
    # A delivery to a shard changes nothing anyone reads until the shard's flush publishes it,
    # and the flush times follow from the deliveries' due times alone: a round starts with the
    # first delivery due after the last flush (at a0) and is flushed at a0 + flush interval, with
    # every delivery due before then. So each shard holds what is on its way to it and the heap
    # holds only its next flush, armed (again, earlier) when a delivery due sooner is sent. A
    # delivery due exactly at the flush went into it when it was in the heap before the round's
    # first delivery was taken out (its seq then ran before the flush's): sent before a0 (or,
    # when the first came without a leg and so was taken at once, sent before it). That is the
    # same batch, in the same order, published at the same time as with one event per delivery
    # (tests/test_sim_kvcompass.py runs both). Only with shared views, a flush interval, and no
    # eviction carriers to note on arrival (explain_claim's, with the engine's exact cache map).

    _deliveries_held_by_shards = True  # (False: one heap event per delivery, as before; for tests)

    def _holds_deliveries(self) -> bool:
        return (self._deliveries_held_by_shards and self._shared is not None and self.flush_interval_s > 0
                and self._evicted_in is None)

    def _send_to_shard(self, s: int, events: list[IndexEvent], now: float, leg: float) -> None:
        direct = not leg > 0
        due = now if direct else now + leg
        heapq.heappush(self._en_route[s], (due, self._heap_seq, now, direct, events[0].worker, events))
        self._heap_seq += 1
        flush_at = due + self.flush_interval_s
        if flush_at < self._flush_at[s]:  # due before every other: its round's flush comes sooner
            self._flush_at[s] = flush_at
            self._push(flush_at, _FLUSH, s)

    def _take_arrived(self, s: int, now: float) -> None:
        """Move the deliveries that have reached shard ``s`` by ``now`` into its inbox."""
        en_route, inbox = self._en_route[s], self._inbox[s]
        while en_route and en_route[0][0] <= now:
            item = heapq.heappop(en_route)
            if self._round_first[s] is None:
                self._round_first[s] = item
            inbox.append((item[4], item[5]))

    def _flush_round(self, s: int, f: float) -> None:
        en_route, inbox = self._en_route[s], self._inbox[s]
        first = self._round_first[s]
        if first is None:
            first = en_route[0]
        self._round_first[s] = None
        a0, q0, direct0 = first[0], first[1], first[3]
        while en_route:
            item = en_route[0]
            due = item[0]
            if due > f or (due == f and (item[1] > q0 if direct0 else item[2] >= a0)):
                break
            heapq.heappop(en_route)
            inbox.append((item[4], item[5]))
        if en_route:
            self._flush_at[s] = en_route[0][0] + self.flush_interval_s
            self._push(self._flush_at[s], _FLUSH, s)
        else:
            self._flush_at[s] = math.inf
        shard = self.shards[s]
        if inbox:  # (not _shard: it would take what arrives after f, read later than f)
            self._inbox[s] = []
            shard.apply_reports(inbox)
        self._send_published(s, shard.flush(), f)

    def _shard_apply(self, s: int, events: list[IndexEvent], now: float) -> None:
        # The events wait in the shard's inbox until its flush, which applies everything that
        # reached the shard since in one C call (MaintenanceShard.apply_reports): the same state
        # and batch as applying each delivery on arrival, as nothing reads the shard's tables in
        # between (what does, applies the inbox first: _shard).
        self._inbox[s].append((events[0].worker, events))
        evicted_in = self._evicted_in
        if evicted_in is not None:
            carrier = self.shards[s].seq + 1  # the next flush publishes what was just delivered
            for ev in events:
                if type(ev) is PrefixEvicted:
                    evicted_in[(ev.key, ev.worker)] = carrier
                elif type(ev) is PrefixCached:
                    evicted_in.pop((ev.key, ev.worker), None)
        if self.flush_interval_s <= 0:
            self._publish(s, now)
        elif not self._flush_pending[s]:
            # Like the daemon's flush per event-loop turn: what arrives within the interval
            # goes out as one batch.
            self._flush_pending[s] = True
            self._push(now + self.flush_interval_s, _FLUSH, s)

    def _shard(self, s: int) -> MaintenanceShard:
        """Shard ``s`` with every delivery that has reached it by the latest time the policy
        was given applied (its inbox emptied)."""
        if self._en_route[s]:
            self._take_arrived(s, self._now)
        inbox = self._inbox[s]
        if inbox:
            self._inbox[s] = []
            self.shards[s].apply_reports(inbox)
        return self.shards[s]

    def _publish(self, s: int, now: float) -> None:
        self._send_published(s, self._shard(s).flush(), now)

    def _send_published(self, s: int, batch: UpdateBatchPublished | None, now: float) -> None:
        if batch is None:
            return
        self.counters["batches_published"] += 1
        if self._shared is not None:
            self._shared.publish(batch, now)
            return
        if self._heartbeats is not None:
            self._heartbeat_published(s, now)
        legs = self._to_edge_s[s]
        loss = self.update_loss
        lost = self._rng.random(len(self._edge_views)) < loss if loss > 0 else None
        for e in range(len(self._edge_views)):
            if lost is not None and lost[e]:
                self.counters["batches_lost"] += 1
                continue
            if legs[e] > 0:
                self._push(now + legs[e], _TO_EDGE, (e, batch))
            else:
                self._deliver(e, batch, now)

    # The idle-shard position heartbeat (maintenance.py's, [sync] position_heartbeat_ms).

    def _heartbeat_published(self, s: int, now: float) -> None:
        self._heartbeats.published(s, now=now)
        if not self._heartbeat_armed:
            self._heartbeat_armed = True
            self._push(self._heartbeats.next_deadline(), _HEARTBEAT, None)

    def _announce_positions(self, now: float) -> None:
        """Each idle shard's position to every edge, each copy lost as a batch is (own draws: the
        batches' losses stay those of a run without heartbeats). A shard whose every edge is at
        its position stops announcing until it publishes again: the edges would ignore it, and
        a run must end."""
        for s in self._heartbeats.due(now=now):
            shard = self.shards[s]
            if all(sync.followers[s].position == (shard.epoch, shard.seq) for sync in self.syncs):
                self._heartbeats.stop(s)
                continue
            self.counters["positions_announced"] += 1
            announced = ShardPositionAnnounced(s, shard.epoch, shard.seq, "")
            lost = self._heartbeat_rng.random(len(self._edge_views)) < self.update_loss
            for e, leg in enumerate(self._to_edge_s[s]):
                if not lost[e]:
                    self._push(now + leg, _POSITION_TO_EDGE, (e, announced))
        deadline = self._heartbeats.next_deadline()
        self._heartbeat_armed = deadline is not None
        if deadline is not None:
            self._push(deadline, _HEARTBEAT, None)

    # The sync protocol's decisions are core/sync.py's; below only moves its messages and arms
    # its timers on the virtual clock.

    def _deliver(self, e: int, batch: UpdateBatchPublished, now: float) -> None:
        self.counters["batch_deliveries"] += 1
        self._sync_step(e, batch.shard, self.syncs[e].on_batch(batch, now=now), now)

    def _sync_step(self, e: int, s: int, step: SyncStep, now: float) -> None:
        if step.send is not None:
            self._request_resync(e, step.send, now)
        deadline = self.syncs[e].followers[s].deadline
        if deadline is not None and self._sync_timer_at.get((e, s)) != deadline:
            self._sync_timer_at[(e, s)] = deadline
            self._push(deadline, _SYNC_TIMER, (e, s))

    def _sync_timeout(self, e: int, s: int, now: float) -> None:
        if self._sync_timer_at.get((e, s)) != now:
            return  # a timer armed for a deadline that has moved since
        del self._sync_timer_at[(e, s)]
        self._sync_step(e, s, self.syncs[e].followers[s].on_timer(now=now), now)

    def _request_resync(self, e: int, request: ResyncRequested, now: float) -> None:
        self.counters["resyncs"] += 1
        delay = self._edge_to_shard_s[e][request.shard]
        if delay > 0:
            self._push(now + delay, _RESYNC_AT_SHARD, request)
        else:
            self._answer_resync(request, now)

    def _answer_resync(self, request: ResyncRequested, now: float) -> None:
        e, s = self._edge_of[request.edge], request.shard
        answer = catch_up(self._shard(s), request.epoch, request.from_seq)
        self._send_published(s, answer.published, now)  # pending edits go to every edge first
        if answer.snapshot is None:
            self.counters["replays"] += 1
        delay = self._to_edge_s[s][e]
        if delay > 0:
            self._push(now + delay, _REPLAY_TO_EDGE, (e, answer.messages))
        else:
            self._deliver_replay(e, answer.messages, now)

    def _deliver_replay(self, e: int, messages: tuple[UpdateBatchPublished | ShardSnapshotSent, ...],
                        now: float) -> None:
        sync = self.syncs[e]
        for message in messages:
            if isinstance(message, ShardSnapshotSent):
                step = sync.on_snapshot(message, now=now)
                self.counters["snapshots_installed"] += int(step.applied)
            else:
                step = sync.on_batch(message, now=now)
            self._sync_step(e, message.shard, step, now)

    # ------------------------------------------------------------------------------ requests

    def route(self, req: Request, *, now: float) -> RouteDecision:
        self._advance(now)
        try:
            e = self._region_index[req.region]
        except KeyError:
            raise PolicyError(f"request {req.id} enters at unknown region {req.region!r}") from None
        if self._shared is not None:  # the tables this prompt's lookup reads, brought to now
            self._shared.prepare(e, self.routers[e].lookup.query_keys(req.tokens), now)
        router = self.routers[e]
        decision: ForwardDecided = router.decide(req.tokens, now=now)
        self.counters["decisions"] += 1
        if router.queues.urgent and not self._arrivals_done:  # broadcast now, not at the next Delta
            self.counters["urgent_broadcasts"] += 1
            self._deadlines[e] = now
            self._next_broadcast = min(self._next_broadcast, now)
        if not decision.local:
            self.counters["remote_decisions"] += 1
        if decision.migration is not None:
            self._plan_migration(decision.migration, req, now)
        self._claims[req.id] = (e, decision.claimed_tokens, decision.pending, decision.dispatch, decision.tier)
        return RouteDecision(decision.worker_index, 0.0, decision.claimed_tokens)

    def _plan_migration(self, plan: MigrationPlanned, req: Request, now: float) -> None:
        self.counters["migrations_planned"] += 1
        index = self.layout.worker_index
        # The engine copies within a region and ships + recomputes across regions, which is the
        # plan's own mode (the planner copies only from a local holder).
        self._migrations.append(MigrationOrdered(index(plan.destination_worker), req.tokens[: plan.prefix_len],
                                                 index(plan.source_worker)))

    def on_truth_tracked(self) -> None:
        if self._held_by_shards:
            raise PolicyError("on_truth_tracked must come before the first index event")
        self._evicted_in = {}

    def explain_claim(self, req: Request, decision: RouteDecision, *, now: float) -> int:
        """Which index was behind, or neither: does the claimed length's shard (full keys) list
        the worker; if not, had the edge's view applied the batch that carried its eviction?
        A claim the edge's pending ledger made is that ledger's (the index never listed it)."""
        claim = self._claims.get(req.id)
        if claim is not None and claim[2]:
            return FALSE_PENDING
        key = int(prefix_keys(req.tokens, [decision.claimed_tokens], self._salt)[0])
        s = key % self.n_shards
        shard, worker = self._shard(s), self.worker_ids[decision.worker_index]
        if worker in shard.holders(key):
            return FALSE_INDEX_BEHIND
        e = self._region_index[req.region]
        if self._shared is not None:
            self._shared.position(e, s, now)
        epoch, seq = self._edge_views[e].position(s)
        carrier = (self._evicted_in or {}).get((key, worker))
        if epoch != shard.epoch or (carrier is not None and seq < carrier):
            return FALSE_VIEW_BEHIND
        return FALSE_KEYLESS  # the view has every change the shard made to it: a keyless false hit

    def take_migrations(self) -> list[MigrationOrdered]:
        """Migrations planned since the last call; the engine polls this after routes and timers."""
        out, self._migrations = self._migrations, []
        return out

    def on_response(self, worker_index: int, req: Request, reused_tokens: int,
                    queue_vector: Mapping[int, float], *, now: float) -> None:
        self._advance(now)
        e, claimed, _, dispatch, tier = self._claims.pop(req.id, (self._region_index[req.region], 0, False, -1,
                                                                  Tier.ABSENT))
        ids = self.worker_ids
        vector = {ids[i]: float(ms) for i, ms in queue_vector.items()}
        router = self.routers[e]
        # The response reaches the edge with the first token, as the daemon's first byte: the
        # dispatch's charge is retired and its prefill timed on the virtual clock. The engine
        # reports no end to policies, so the dispatch ends here (its decode is not timed).
        router.on_first_token(dispatch, now=now)
        router.on_finished(dispatch, prompt_tokens=len(req.tokens), cached_tokens=int(reused_tokens), output_tokens=1,
                           now=now)
        if self._shared is not None and reused_tokens < claimed and tier != Tier.DRAM:  # what its check reads, now
            self._shared.prepare(e, router.lookup.query_keys(req.tokens[:claimed]), now)
        router.on_response(ids[worker_index], claimed_tokens=claimed, reused_tokens=int(reused_tokens),
                           queue_vector=vector, now=now, tokens=req.tokens, claimed_tier=tier)
        g = self._worker_region[worker_index]
        if g != e and vector:
            # The worker's region piggybacked its vector toward the edge's region when the
            # response left it: suppress that region's broadcast toward this one (Delta rule).
            sent_at = max(0.0, now - self._owm_s[g, e])
            self.routers[g].queues.note_piggyback_sent(self.regions[e], now=sent_at)

    def on_request_end(self, worker_index: int, req: Request, *, now: float) -> None:
        """The request's end reached its edge, as the daemon's edge sees its stream end: its
        rate learner times a prefill that waited for memory from it (``core/rates.py``)."""
        self._advance(now)
        self.routers[self._region_index[req.region]].rates.ended(worker_index, now=now)

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        # Only the edge of the worker's own region reads it live.
        router = self.routers[self._worker_region[worker_index]]
        # The worker model's drained queue can come out a rounding error below zero.
        router.queues.set_local(self.worker_ids[worker_index], max(0.0, float(queue_ms)), now=now, running=running)

    def on_worker_room(self, worker_index: int, steps: tuple[tuple[float, int], ...], *, now: float) -> None:
        # Read with the live queue, by the edge of the worker's own region.
        router = self.routers[self._worker_region[worker_index]]
        router.queues.set_room(self.worker_ids[worker_index], steps, now=now)

    # ------------------------------------------------------------------------------ inspection

    @property
    def in_flight(self) -> int:
        """Messages and timers on their way (a router's broadcasts of one Delta are one heap entry)."""
        waiting = sum(len(p[0]) - p[1] - 1 for _, _, kind, p in self._heap if kind == _BROADCAST)
        return len(self._heap) + waiting + sum(map(len, self._en_route))

    def unapplied_deliveries(self) -> int:
        """Deliveries that have reached their shard and wait for its flush to be applied."""
        now = self._now
        return sum(map(len, self._inbox)) + sum(1 for r in self._en_route for item in r if item[0] <= now)

    def settle(self, *, now: float) -> None:
        """Deliver everything in flight (for tests and end-of-run inspection)."""
        while self._heap:
            now = max(now, max(item[0] for item in self._heap))
            self._advance(now)
        if self._shared is not None:
            self._now = max(now, self._now, self._shared.last_due())
            self._shared.advance_all(self._now)

    @property
    def hot_misses_by_outcome(self) -> dict[str, int]:
        """Local misses that found their family hot, summed over edges and triggers, by outcome
        (``HOT_MISS_OUTCOMES``): why the run migrated as much as it did."""
        out = dict.fromkeys(HOT_MISS_OUTCOMES, 0)
        for router in self.routers:
            for (_, outcome), n in router.hot.hot_misses.items():
                out[outcome] += n
        return out

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["index_entries"] = sum(self._shard(s).entries() for s in range(self.n_shards))
        for cause in self.routers[0].explained_shortfalls if self.routers else ():  # not held against belief
            out[f"shortfalls_{cause}"] = sum(r.explained_shortfalls[cause] for r in self.routers)
        if self._shared is not None:
            out["batch_deliveries"] = self._shared.deliveries
            out["table_versions"] = self._shared.live_versions()
        out["gaps_skipped"] = sum(f.gaps_skipped for sync in self.syncs for f in sync.followers)  # repair=False
        out["gap_detections"] = sum(sync.gaps for sync in self.syncs)  # inputs that found a gap (several share one of "resyncs")
        return out
