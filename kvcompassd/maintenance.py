"""``kvcompassd maintenance``: the single writer of one index shard.

Agents report their workers' index events; this unit applies them through the core
(``MaintenanceShard``), coalesces everything applied within ``[sync] batch_delay_ms`` (10 ms)
of the window's first edit into one update batch ``(epoch, seq)`` per stream, encodes it once and pushes the
same bytes to every subscribed edge of that stream on the edge's ordered control channel. Each
edge follows its region's stream (``kvcompassd.core.streams``: only the lengths its region looks
up), chosen from the edge's certified identity, or the full stream (``[sync] edge_streams``);
each stream has its own ``(epoch, seq)``, replay log and snapshots. Edges that are new,
restarted, or found a gap get a replay from the bounded log or a snapshot. A snapshot of any
size goes out as a transfer (``kvcompassd.core.snapshots``): its header at once, then its
chunks paced by the connection's acknowledgements (``[sync] snapshot_window_bytes``), while
update batches keep flowing to the edge between them; one snapshot serves every edge asking at
the same position, and the last two are kept (for a minute after the last transfer) so an edge
that lost the stream can resume. A stream that has published nothing for ``[sync]
position_heartbeat_ms`` announces its position to every edge following it
(``ShardPositionAnnounced``, ``PositionHeartbeats``), so an edge that lost the last batch of a
quiet stream finds the gap without waiting for the next. A restarted unit starts a new epoch;
agents re-register what their engines hold when they reconnect, so the shard is rebuilt without
any state on disk.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import asdict, dataclass, field

import structlog

from kvcompassd.certs import TlsFiles
from kvcompassd.core.config import ClusterConfig, MaintenanceConfig
from kvcompassd.core.index import table_capacities
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.snapshots import SnapshotChunker, SnapshotSource
from kvcompassd.core.streams import ShardStreams, StreamFanout, UnknownEdge, stream_regions
from kvcompassd.core.sync import PositionHeartbeats, catch_up
from kvcompassd.daemon import daemon_transport, split_address
from kvcompassd.metrics import MaintenanceMetrics
from kvcompassd.pacing import FlushPacer
from kvcompassd.transport import ChannelInfo, EncodedMessage, Peer, QuicNode, TransportError
from kvcompassd.wire import (
    AdminAnswered,
    AdminQueried,
    ErrorReported,
    NodeIdentity,
    PrefixEventsReported,
    ResyncRequested,
    Role,
    ShardPositionAnnounced,
    SnapshotResumeRequested,
    UpdatesSubscribed,
    WireError,
    WorkerRegistered,
    WorkerWithdrawn,
    encode,
)

# An admin holders query names at most this many keys (its answer stays far below a frame).
MAX_ADMIN_KEYS = 4096

log = structlog.get_logger(__name__)

# A batch leaves ``[sync] batch_delay_ms`` after the first edit it carries (or once this many
# edits are pending): under a steady stream a batch then carries several reports, and every
# edge gets fewer, fuller packets. Each batch costs about as much transport CPU as a report of
# 64 events costs to apply.
DEFAULT_MAX_BATCH_EVENTS = 4096
# Kept snapshots are dropped once no transfer has run for this long: an edge that lost its
# stream comes back within seconds, and a kept image costs as much memory as the shard's view.
KEEP_SNAPSHOTS_S = 60.0


@dataclass
class _WorkerStream:
    """What this unit knows of one agent's report stream."""

    incarnation: int = -1
    last_seq: int = -1
    stale_reports: int = 0


@dataclass
class MaintenanceStats:
    reports: int = 0
    events_applied: int = 0
    events_ignored: int = 0
    stale_reports: int = 0
    batches: int = 0
    snapshots_sent: int = 0  # transfers started (a resumed one counts again)
    snapshots_resumed: int = 0
    snapshots_taken: int = 0
    snapshot_chunks_sent: int = 0
    replays_sent: int = 0
    positions_announced: int = 0  # ShardPositionAnnounced sent (one per edge of an idle stream)
    refused: dict[str, int] = field(default_factory=dict)


class MaintenanceNode:
    """One maintenance unit: QUIC listener, shard, subscribers."""

    def __init__(self, cfg: ClusterConfig, me: MaintenanceConfig, tls: TlsFiles, *,
                 epoch: int | None = None, metrics: MaintenanceMetrics | None = None, agent_grace_s: float = 3.0,
                 batch_delay_s: float | None = None, max_batch_events: int = DEFAULT_MAX_BATCH_EVENTS):
        self.cfg = cfg
        self.me = me
        self.layout = IndexLayout.from_config(cfg)
        # A new epoch per start: edges holding an older epoch's state are told to resync.
        self.epoch = epoch if epoch is not None else time.time_ns() // 1_000_000
        # The full tables (exact holders, admin answers) and one filtered stream per region
        # whose edges follow their region's stream (core/streams.py).
        self.streams = ShardStreams(
            self.layout,
            LevelPlan.from_config(cfg),
            me.shard,
            cfg.shards,
            epoch=self.epoch,
            regions=stream_regions(cfg),
            scale_filtered_capacity=True,  # a region's tables start at the share of lengths it reads
            initial_capacity=table_capacities(cfg, self.layout),
            fingerprint_bits=cfg.index.fingerprint_bits,
            max_load=cfg.index.max_load,
        )
        self.shard = self.streams.full
        self.node = QuicNode(NodeIdentity(Role.MAINTENANCE, me.id), tls, on_message=self._on_message,
                             on_peer_state=self._on_peer_state, options=daemon_transport(cfg))
        self.fanout = StreamFanout(cfg, self.streams)
        # Per stream (None: the full one). Snapshot ids are random: an edge may ask to resume one
        # from an earlier life of this unit.
        self.snapshots = {stream: SnapshotSource(self.streams.stream(stream), new_id=lambda: secrets.randbits(64) or 1,
                                                 chunk_bytes=cfg.sync.snapshot_chunk_bytes)
                          for stream in (None, *self.streams.filtered)}
        self._transfers: dict[str, asyncio.Task] = {}  # edge -> the task sending it a snapshot's chunks
        self._release_timer: asyncio.TimerHandle | None = None
        self._stopped = False
        self.workers: dict[str, _WorkerStream] = {}
        self.stats = MaintenanceStats()
        self.metrics = metrics or MaintenanceMetrics()
        # Entries and load per region group, what an operator sizes initial_capacity and
        # fingerprint_bits by.
        self.metrics.watch_tables(self.shard.table_stats)
        self.metrics.watch_position(lambda: [(self.me.shard, "full" if r is None else r, self.epoch, s.seq)
                                             for r, s in ((None, self.streams.full), *self.streams.filtered.items())])
        # Idle streams announce their positions: one due time per stream, one timer at the earliest.
        period_s = cfg.sync.position_heartbeat_ms / 1000.0
        self.heartbeats = (PositionHeartbeats(period_s, (None, *self.streams.filtered), now=time.monotonic())
                           if period_s > 0 else None)
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        if batch_delay_s is None:
            batch_delay_s = cfg.sync.batch_delay_ms / 1000.0
        self._batches = FlushPacer(self._flush, delay_s=batch_delay_s, max_pending=max_batch_events)
        self.agent_grace_s = agent_grace_s
        self._grace_timers: dict[int, asyncio.TimerHandle] = {}  # pending withdrawals, cancelled by stop()
        self._grace_ids = itertools.count()
        self.address: tuple[str, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = split_address(self.me.quic, f"[[maintenance]] {self.me.id} quic")
        self.address = await self.node.listen(host, port)
        self._arm_heartbeat()
        log.info("maintenance started", shard=self.me.shard, epoch=self.epoch, address=self.address)

    async def stop(self) -> None:
        self._stopped = True
        self._batches.cancel()
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
        for task in self._transfers.values():
            task.cancel()
        self._transfers.clear()
        if self._release_timer is not None:
            self._release_timer.cancel()
        for timer in self._grace_timers.values():
            timer.cancel()
        self._grace_timers.clear()
        await self.node.close()

    def status(self) -> str:
        return f"shard {self.me.shard} epoch {self.epoch} seq {self.shard.seq} entries {self.shard.entries()}"

    # -- messages -----------------------------------------------------------------------------

    @property
    def subscribers(self) -> list[str]:
        return self.fanout.edges

    def _on_peer_state(self, peer: Peer, connected: bool) -> None:
        if connected or peer.identity is None:
            return
        node_id = peer.identity.node_id
        if self.fanout.unsubscribe(node_id, peer):
            log.info("edge unsubscribed", edge=node_id)
        if peer.identity.role == Role.AGENT and node_id in self.workers:
            # An agent that stays away cannot serve forwarded requests: after a grace period
            # (room for a reconnection) its worker's entries leave the index.
            stream = self.workers[node_id]
            incarnation = stream.incarnation
            timer_id = next(self._grace_ids)
            self._grace_timers[timer_id] = asyncio.get_running_loop().call_later(
                self.agent_grace_s, self._withdraw_if_gone, node_id, incarnation, timer_id)

    def _withdraw_if_gone(self, worker: str, incarnation: int, timer_id: int) -> None:
        self._grace_timers.pop(timer_id, None)
        stream = self.workers.get(worker)
        connected = any(p.identity is not None and p.identity.node_id == worker and p.is_connected
                        for p in self.node.peers)
        if stream is None or stream.incarnation != incarnation or connected:
            return
        outcome = self.streams.withdraw_worker(worker)
        self._applied(outcome)
        stream.incarnation = incarnation  # a returning agent registers a newer one
        log.warning("agent gone: worker withdrawn from the shard", worker=worker, withdrawn=outcome.applied)

    def _on_message(self, peer: Peer, message, channel: ChannelInfo) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            self._refuse(peer, message, "forbidden", f"a maintenance unit does not accept {type(message).__name__}")
            return
        handler(self, peer, message, channel)

    def _refuse(self, peer: Peer, message, code: str, detail: str) -> None:
        """Count and log (with the sender's certified identity) a refused message, and tell the
        sender; the connection's other traffic carries on."""
        self.stats.refused[code] = self.stats.refused.get(code, 0) + 1
        self.metrics.refused_messages.labels(type(message).__name__, code).inc()
        log.warning("refused", peer=str(peer.identity), type=type(message).__name__, code=code, detail=detail)
        try:
            peer.send_encoded(encode(ErrorReported(code, detail)))
        except ConnectionError:
            pass

    def _own_worker(self, peer: Peer, msg, worker: str) -> bool:
        """An agent may write only its own worker's fields."""
        if peer.identity.node_id != worker:
            self._refuse(peer, msg, "forbidden", f"agent {peer.identity.node_id} may not write worker {worker}'s fields")
            return False
        try:
            self.layout.slot(worker)
        except ValueError:
            self._refuse(peer, msg, "malformed", f"unknown worker {worker!r}: not in this cluster's config")
            return False
        return True

    def _worker_registered(self, peer: Peer, msg: WorkerRegistered, channel: ChannelInfo) -> None:
        if not self._own_worker(peer, msg, msg.worker):
            return
        stream = self.workers.setdefault(msg.worker, _WorkerStream())
        if msg.incarnation < stream.incarnation:
            self._refuse(peer, msg, "malformed", f"incarnation {msg.incarnation} older than {stream.incarnation}")
            return
        if msg.incarnation > stream.incarnation:
            if stream.incarnation >= 0:
                # The engine restarted: nothing it registered before is in its cache any more.
                outcome = self.streams.withdraw_worker(msg.worker)
                self._applied(outcome)
                log.info("worker restarted", worker=msg.worker, withdrawn=outcome.applied)
            stream.incarnation, stream.last_seq = msg.incarnation, -1

    def _events_reported(self, peer: Peer, msg: PrefixEventsReported, channel: ChannelInfo) -> None:
        if not self._own_worker(peer, msg, msg.worker):
            return
        stream = self.workers.get(msg.worker)
        if stream is None or stream.incarnation < 0:
            self._refuse(peer, msg, "malformed", f"worker {msg.worker} reported events before WorkerRegistered")
            return
        if msg.seq <= stream.last_seq:
            stream.stale_reports += 1
            self.stats.stale_reports += 1
            self._refuse(peer, msg, "malformed", f"stale or replayed report seq {msg.seq} for {msg.worker} "
                                            f"(last applied {stream.last_seq}); ignored")
            return
        stream.last_seq = msg.seq
        self.stats.reports += 1
        outcome = self.streams.apply_columns(msg.worker, msg.events)  # the report's lengths pick the streams
        self._applied(outcome)
        if outcome.ignored:
            # The rest of the report was applied; tell the agent which events made no sense.
            shown = "; ".join(outcome.ignored[:3])
            more = f" (+{len(outcome.ignored) - 3} more)" if len(outcome.ignored) > 3 else ""
            self._refuse(peer, msg, "malformed", f"{len(outcome.ignored)} of {len(msg.events)} events of report "
                                            f"{msg.seq} ignored: {shown}{more}")

    def _worker_withdrawn(self, peer: Peer, msg: WorkerWithdrawn, channel: ChannelInfo) -> None:
        if self._own_worker(peer, msg, msg.worker):
            self._applied(self.streams.withdraw_worker(msg.worker))

    def _applied(self, outcome) -> None:
        self.stats.events_applied += outcome.applied
        self.stats.events_ignored += len(outcome.ignored)
        self.metrics.events.labels("applied").inc(outcome.applied)
        self.metrics.events.labels("ignored").inc(len(outcome.ignored))
        if outcome.applied:
            # The batch leaves batch_delay_s after the first edit of its window, carrying
            # everything applied meanwhile.
            self._batches.added(outcome.applied)

    def _flush(self) -> None:
        self._publish(self.streams.flush())

    def _publish(self, published: dict) -> None:
        """Each stream's batch to the edges following that stream, encoded once per stream."""
        if not published:
            return
        self.stats.batches += len(published)
        self.metrics.batches.inc(len(published))
        if self.heartbeats is not None:
            now = time.monotonic()
            for stream in published:  # the batch carries the position: no announcement for a period
                self.heartbeats.published(stream, now=now)
        encoded = {stream: EncodedMessage(batch) for stream, batch in published.items()}
        for edge, peer, stream in self.fanout.deliveries(published):
            try:
                peer.send_encoded(encoded[stream].body_for(peer))
            except ConnectionError:
                # Its resync on reconnection repairs what it misses here.
                self.fanout.unsubscribe(edge, peer)

    def _arm_heartbeat(self) -> None:
        if self.heartbeats is None or self._stopped:
            return
        deadline = self.heartbeats.next_deadline()
        if deadline is not None:
            self._heartbeat_timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), self._announce_positions)

    def _announce_positions(self) -> None:
        """Each idle stream's position to every edge following it, directly, relay or not: an
        announcement is a few bytes, and sent past the relaying edge it also shows an edge the
        batches a dead or stalled relay never forwarded (relayed, it would die with the relay).
        On the control stream, so it never overtakes a batch the unit sent that edge before; a
        relayed batch still on its way after a whole idle period costs one needless replay."""
        self._heartbeat_timer = None
        try:
            due = self.heartbeats.due(now=time.monotonic())
            followers = self.fanout.followers() if due else {}
            for stream in due:
                edges = followers.get("full" if stream is None else stream)
                if not edges:
                    continue
                shard = self.streams.stream(stream)
                try:
                    body = encode(ShardPositionAnnounced(self.me.shard, shard.epoch, shard.seq, stream or ""))
                except WireError as exc:  # e.g. a region name beyond the wire's bound: the others go on
                    log.error("position announcement not sent", stream=stream or "full", error=str(exc))
                    continue
                for edge in edges:
                    peer = self.fanout.handle(edge)
                    try:
                        peer.send_encoded(body)
                        self.stats.positions_announced += 1
                        self.metrics.positions_announced.inc()
                    except ConnectionError:
                        self.fanout.unsubscribe(edge, peer)  # its resubscription catches it up
        finally:
            self._arm_heartbeat()  # whatever happened, the next period's announcements

    def _subscribed(self, peer: Peer, msg: UpdatesSubscribed, channel: ChannelInfo) -> None:
        if not self._own_edge(peer, msg, msg.edge, msg.shard):
            return
        self._send_catch_up(peer, msg.epoch, msg.seq + 1)
        # Added after the catch-up was enqueued, so batches follow it in order.
        stream = self.fanout.subscribe(msg.edge, peer)
        log.info("edge subscribed", edge=msg.edge, epoch=msg.epoch, seq=msg.seq, stream=stream or "full")

    def _resync_requested(self, peer: Peer, msg: ResyncRequested, channel: ChannelInfo) -> None:
        if self._own_edge(peer, msg, msg.edge, msg.shard):
            self._send_catch_up(peer, msg.epoch, msg.from_seq)

    def _resume_requested(self, peer: Peer, msg: SnapshotResumeRequested, channel: ChannelInfo) -> None:
        """An edge lost part of a snapshot (its connection broke, or a chunk went missing): send
        the rest of the same snapshot if it is still kept, else a new one (the edge restarts).
        It is also the edge's (re)subscription."""
        if not self._own_edge(peer, msg, msg.edge, msg.shard):
            return
        # Only a snapshot of the stream this edge follows: another stream's id is "not kept".
        chunker = self.snapshots[self.fanout.stream_of(msg.edge)].get(msg.snapshot_id)
        if chunker is None or msg.from_chunk >= chunker.chunks:
            log.info("snapshot resume: not kept any more, sending a new one", edge=msg.edge,
                     snapshot_id=msg.snapshot_id, from_chunk=msg.from_chunk)
            self._send_catch_up(peer, 0, 0)
        else:
            self.stats.snapshots_resumed += 1
            log.info("snapshot resumed", edge=msg.edge, snapshot_id=msg.snapshot_id, from_chunk=msg.from_chunk,
                     chunks=chunker.chunks)
            self._send_transfer(peer, msg.edge, chunker, msg.from_chunk)
        self.fanout.subscribe(msg.edge, peer)

    def _own_edge(self, peer: Peer, msg, edge: str, shard: int) -> bool:
        if peer.identity.node_id != edge:
            self._refuse(peer, msg, "forbidden", f"edge {peer.identity.node_id} may not speak for {edge}")
            return False
        if shard != self.me.shard:
            self._refuse(peer, msg, "malformed", f"this unit owns shard {self.me.shard}, not {shard}")
            return False
        try:
            self.fanout.stream_of(edge)  # which stream is the edge's certified identity's, never its claim
        except UnknownEdge as exc:
            self._refuse(peer, msg, "forbidden", str(exc))
            return False
        return True

    def _send_catch_up(self, peer: Peer, epoch: int, from_seq: int) -> None:
        # The replay-or-snapshot choice, and publishing pending edits first, are the sync
        # protocol's (core/sync.py); this shell sends what it decided. (Flushing through the
        # pacer keeps its bookkeeping; catch_up then finds nothing pending.)
        if self._batches.scheduled:
            self._batches.flush_now()
        edge = peer.identity.node_id
        stream = self.fanout.stream_of(edge)  # checked by _own_edge
        source = self.snapshots[stream]
        taken = source.taken
        answer = catch_up(source.shard, epoch, from_seq, take_snapshot=lambda: source.latest().snapshot)
        if answer.published is not None:
            self._publish({stream: answer.published})
        if answer.snapshot is None:
            self.stats.replays_sent += 1
            for message in answer.replay:
                peer.send_encoded(EncodedMessage(message).body_for(peer))
            return
        self.stats.snapshots_sent += 1
        self.stats.snapshots_taken += source.taken - taken
        self.metrics.snapshots.inc()
        chunker = source.latest()  # the one catch_up just took or reused
        log.info("snapshot transfer", edge=edge, stream=stream or "full", snapshot_id=chunker.snapshot_id,
                 epoch=chunker.header.epoch, seq=chunker.header.seq, entries=chunker.header.entries,
                 bytes=chunker.header.total_bytes, chunks=chunker.chunks, reused=source.taken == taken)
        self._send_transfer(peer, edge, chunker, 0)

    def _send_transfer(self, peer: Peer, edge: str, chunker: SnapshotChunker, from_chunk: int) -> None:
        """The header now (so the batches published from here on reach the edge after it and are
        held there), then the chunks from ``from_chunk`` in the background, one transfer per edge."""
        previous = self._transfers.pop(edge, None)
        if previous is not None:
            previous.cancel()
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        peer.send_encoded(encode(chunker.header))
        task = asyncio.get_running_loop().create_task(self._stream_chunks(peer, edge, chunker, from_chunk))
        self._transfers[edge] = task
        task.add_done_callback(lambda t, e=edge: self._transfer_done(e, t))

    def _transfer_done(self, edge: str, task: asyncio.Task) -> None:
        if self._transfers.get(edge) is task:
            del self._transfers[edge]
        if not self._transfers and self._release_timer is None and not self._stopped:
            self._release_timer = asyncio.get_running_loop().call_later(KEEP_SNAPSHOTS_S, self._release_snapshots)

    def _release_snapshots(self) -> None:
        self._release_timer = None
        if not self._transfers:
            log.info("kept snapshots released", bytes=sum(s.kept_bytes for s in self.snapshots.values()))
            for source in self.snapshots.values():
                source.release()

    async def _stream_chunks(self, peer: Peer, edge: str, chunker: SnapshotChunker, from_chunk: int) -> None:
        window = self.cfg.sync.snapshot_window_bytes
        try:
            for index in range(from_chunk, chunker.chunks):
                await peer.wait_unacknowledged_below(window)
                peer.send_encoded(encode(chunker.chunk(index)))
                self.stats.snapshot_chunks_sent += 1
        except TransportError as exc:
            # The edge resumes (or restarts) the transfer when it comes back.
            log.info("snapshot transfer interrupted", edge=edge, snapshot_id=chunker.snapshot_id,
                     error=str(exc))

    def _admin(self, peer: Peer, msg: AdminQueried, channel: ChannelInfo) -> None:
        from kvcompassd.inspect import MAINTENANCE_QUERIES, refusal

        if msg.what not in MAINTENANCE_QUERIES:
            body = refusal("a maintenance unit", msg.what, MAINTENANCE_QUERIES)
        else:
            try:
                body = self.describe(msg.what, msg.args)
            except (TypeError, ValueError) as exc:  # arguments of the wrong shape
                body = {"error": f"{msg.what}: {exc}"}
        reply = AdminAnswered(msg.what, body)
        if channel.stream is not None:
            channel.stream.send_encoded(encode(reply), end=True)
        else:
            peer.send_encoded(encode(reply))

    def _described_stream(self, args: dict):
        """The stream an admin query names: ``{"edge": id}`` the one that edge follows,
        ``{"stream": region}`` a region's, ``"full"`` or nothing the full one."""
        if "edge" in args:
            return self.fanout.shard_of(str(args["edge"]))
        stream = args.get("stream", "full")
        return self.streams.stream(None if stream == "full" else str(stream))

    def describe(self, what: str, args: dict) -> dict:
        if what == "holders":
            if "keys" in args:  # many keys in one exchange: a check over a whole cache is one query
                keys = args["keys"]
                if not isinstance(keys, list) or len(keys) > MAX_ADMIN_KEYS:
                    raise ValueError(f"keys must be a list of at most {MAX_ADMIN_KEYS} keys")
                return {"holders": {str(int(k)): {w: t.name for w, t in self.shard.holders(int(k)).items()}
                                    for k in keys}}
            key = int(args.get("key", -1))
            return {"key": key, "holders": {w: t.name for w, t in self.shard.holders(key).items()}}
        if what == "digest":
            shard = self._described_stream(args)
            return {"shard": self.me.shard, "position": [self.epoch, shard.seq], "entries": shard.entries(),
                    "groups": {str(g): crc for g, crc in shard.digests().items()}}
        if what == "entries":
            # The exact (key, value) state per region group, for consistency checks.
            shard = self._described_stream(args)
            limit = int(args.get("limit", 100_000))
            return {"shard": self.me.shard, "epoch": self.epoch, "seq": shard.seq,
                    "groups": {str(g): {"keys": k[:limit].tolist(), "values": v[:limit].tolist()}
                               for g, (k, v) in shard.group_items().items()}}
        followers = self.fanout.followers()
        live = self.fanout.live_edges()
        return {
            "mode": "maintenance",
            "id": self.me.id,
            "shard": self.me.shard,
            "epoch": self.epoch,
            "seq": self.shard.seq,
            "entries": self.shard.entries(),
            "tables": self.shard.table_stats(),
            "subscribers": self.subscribers,
            # What each stream carried: the full one, and each region's (only the lengths its
            # edges look up), with the edges following it now.
            "streams": {("full" if r is None else r): {"seq": shard.seq, "entries": shard.entries(),
                                                       "updates": self.streams.applied[r],
                                                       "edges": followers.get("full" if r is None else r, []),
                                                       # with [sync] relay, one per region: it forwards
                                                       "live_to": live.get(r, []),
                                                       "tables": shard.table_stats()}
                        for r, shard in ((None, self.streams.full), *self.streams.filtered.items())},
            "workers": {w: {"incarnation": s.incarnation, "last_seq": s.last_seq, "stale_reports": s.stale_reports}
                        for w, s in self.workers.items()},
            "stats": asdict(self.stats),
        }

    _handlers = {
        WorkerRegistered: _worker_registered,
        PrefixEventsReported: _events_reported,
        WorkerWithdrawn: _worker_withdrawn,
        UpdatesSubscribed: _subscribed,
        ResyncRequested: _resync_requested,
        SnapshotResumeRequested: _resume_requested,
        AdminQueried: _admin,
    }
