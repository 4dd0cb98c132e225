"""``kvcompassd edge``: a region's gateway. Holds keyless views of every shard, queue estimates
of every worker, and the joint score; forwards each request to the best worker anywhere.

Peers: every maintenance unit (subscribe to its shard's update stream; resync on gaps), every
worker's agent (forward requests over QUIC; own-region agents report load), every other edge
(queue-vector broadcasts as QUIC datagrams every Delta; a peer edge can hand over its views).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

import aiohttp
import numpy as np
import structlog

from kvcompassd.certs import TlsFiles
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.config import ClusterConfig, EdgeConfig, WorkerConfig
from kvcompassd.core.fingerprints import budget_shortfall, fingerprint_choice_for_config
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.queues import STEADY_REPEATS
from kvcompassd.core.router import Router
from kvcompassd.core.snapshots import SnapshotChunker
from kvcompassd.core.streams import UnknownEdge, edge_stream, relays_to
from kvcompassd.transport import EncodedMessage
from kvcompassd.core.sync import SNAPSHOT_MESSAGES, EdgeSync, SyncSettings, SyncStep
from kvcompassd.daemon import daemon_transport, split_address
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, byte_tokenizer_refusal
from kvcompassd.tokenizer_check import TokenizerVerifier, WorkerVerdict, probe_via_agent, probe_worker
from kvcompassd.transport import ChannelInfo, Peer, QuicNode, TransportError
from kvcompassd.wire import (
    AdminAnswered,
    AdminQueried,
    ErrorReported,
    NodeIdentity,
    PiggybackSent,
    QueueVectorBroadcast,
    QueueVectorInterestReported,
    ResyncRequested,
    Role,
    RoomVectorBroadcast,
    ShardPositionAnnounced,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotResumeRequested,
    SnapshotTransferStarted,
    UpdateBatchPublished,
    ViewCopyRequested,
    WorkerLoadReported,
    WorkerPinnedReported,
    WorkerRoomReported,
    encode,
)

log = structlog.get_logger(__name__)


class ViewCopyRefused(Exception):
    """The peer edge answered a view copy with an error."""


class EdgeNode:
    def __init__(
        self,
        cfg: ClusterConfig,
        me: EdgeConfig,
        tls: TlsFiles,
        *,
        tokenizer: Tokenizer | None = None,
        frontdoor: FrontDoorSettings | None = None,
        local_http: bool = True,
        ablation: Ablation | None = None,
        copy_from: str | None = None,
        view: EdgeIndexView | None = None,
        reuse_port: bool = False,
    ):
        self.cfg = cfg
        self.me = me
        self.clock = time.monotonic
        self.layout = IndexLayout.from_config(cfg)
        # ``view``: the views kept in shared memory for more front doors (kvcompassd/edge_workers.py).
        self.view = view if view is not None else EdgeIndexView(self.layout, cfg.shards, edge=me.id)
        self.reuse_port = reuse_port
        # The index-sync protocol (core/sync.py); this shell moves its messages.
        self.sync = EdgeSync(self.view, SyncSettings(max_snapshot_entries=cfg.sync.max_snapshot_entries,
                                                     max_snapshot_bytes=cfg.sync.max_snapshot_bytes,
                                                     max_buffered_bytes=cfg.sync.max_buffered_bytes))
        self._sync_timer: asyncio.TimerHandle | None = None
        self._sync_deadline: float | None = None
        self.router = Router(cfg, me.region, self.view, now=self.clock(), ablation=ablation)
        self.metrics = EdgeMetrics()
        self.metrics.watch_hot_prefixes(lambda: self.router.hot.hot_misses)
        self._stream_name = edge_stream(cfg, me.id) or ""  # as announcements name it ("": the full stream)
        stream = self._stream_name or "full"  # the shard streams this edge's views follow
        self.metrics.watch_views(lambda: [(s, stream, *self.view.position(s)) for s in range(cfg.shards)])
        self.node = QuicNode(NodeIdentity(Role.EDGE, me.id), tls, on_message=self._on_message,
                             on_peer_state=self._on_peer_state, options=daemon_transport(cfg))
        self.tokenizer = tokenizer or ByteTokenizer()
        refusal = byte_tokenizer_refusal(self.tokenizer, cfg.workers)
        if refusal is not None:  # before any socket opens
            raise TokenizerError(f"edge {me.id} refuses to start: {refusal}")
        # Too few fingerprint bits for the fleet's region groups: false claims above the budget.
        # Serving still works (the belief discounts false claims), so warn rather than refuse.
        shortfall = budget_shortfall(fingerprint_choice_for_config(cfg))
        if shortfall is not None:
            log.warning("fingerprint bits below the false-lookup budget", edge=me.id, detail=shortfall)
        self.tokenizer_check: TokenizerVerifier | None = None
        self.frontdoor_settings = frontdoor or FrontDoorSettings(model=cfg.model)
        self.local_http = local_http
        self.copy_from = copy_from
        self._shard_peers: dict[int, Peer] = {}
        # [sync] relay: the edges of this region and stream this edge forwards its units' live
        # batches to (when the unit picks it), and takes theirs from (core/streams.py relays_to).
        self._relay_group = frozenset(relays_to(cfg, me.id))
        self._relayed_upto: dict[int, tuple[int, int]] = {}  # shard -> the last position forwarded
        self.batches_relayed = 0
        self._agent_peers: dict[str, Peer] = {}
        self._edge_peers: dict[str, Peer] = {}
        self._own_agents = frozenset(w.id for w in cfg.workers_in(me.region))
        # Whether each own agent wants the region's queue vector (QueueVectorInterestReported);
        # one not heard from gets it, as every agent did before agents said.
        self._vector_wanted: dict[str, bool] = {}
        self._last_load_report: dict[str, float] = {}
        # An idle agent reports an unchanged load once per heartbeat: three missed ones are a silence.
        self._heartbeat_s = cfg.idle.heartbeat_ms / 1000.0
        self._load_silence_s = 3 * self._heartbeat_s
        self._vector_to_agents: tuple | None = None  # last sent, and when (sent again on change or heartbeat)
        self._vector_to_agents_at = float("-inf")
        self._vector_to_agents_repeats = 0
        self._worker_index = {w: i for i, w in enumerate(self.layout.worker_ids)}
        self._tasks: list[asyncio.Task] = []
        self._broadcast_wake = asyncio.Event()  # an urgent dispatch (core/queues.py): broadcast now
        self.http_address: tuple[str, int] | None = None
        self.quic_address: tuple[str, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = split_address(self.me.quic, f"[[edges]] {self.me.id} quic")
        self.quic_address = await self.node.listen(host, port)
        if self.copy_from:
            await self.copy_view_from(self.copy_from)
        for m in self.cfg.maintenance:
            self._shard_peers[m.shard] = self.node.peer(split_address(m.quic, m.id), expected_role=Role.MAINTENANCE,
                                                        expected_id=m.id)
        for w in self.cfg.workers:
            if w.agent:
                self._agent_peers[w.id] = self.node.peer(split_address(w.agent, w.id), expected_role=Role.AGENT,
                                                         expected_id=w.id)
        for e in self.cfg.edges:
            if e.id != self.me.id:
                self._edge_peers[e.id] = self.node.peer(split_address(e.quic, e.id), expected_role=Role.EDGE,
                                                        expected_id=e.id)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                           connector=aiohttp.TCPConnector(limit=0))
        self._start_tokenizer_check()
        self._workers_http = WorkerConnections()  # own-region workers' keep-alive pools
        self.forwarder = Forwarder(self.me.id, self.router, self._agent_peers.get, self._workers_http, clock=self.clock,
                                   metrics=self.metrics, local_http=self.local_http, on_urgent=self.wake_broadcasts)
        guard = FrontDoorGuard(self.cfg.frontdoor, self.metrics)
        self.frontdoor = FrontDoor(self.forwarder, self.tokenizer, self.frontdoor_settings, self.metrics,
                                   health=self.health, guard=guard)
        # A client that disconnects cancels its request's handler, and with it the forwarding
        # generator, which aborts the request at the worker.
        host, port = split_address(self.me.http, f"[[edges]] {self.me.id} http")
        self.http_address = await self.frontdoor.serve(host, port, reuse_port=self.reuse_port)
        self._tasks.append(asyncio.create_task(self._broadcast_loop()))
        log.info("edge started", region=self.me.region, http=self.http_address, quic=self.quic_address)

    async def stop(self) -> None:
        if self._sync_timer is not None:
            self._sync_timer.cancel()
        for t in self._tasks:
            t.cancel()
        frontdoor = getattr(self, "frontdoor", None)  # None when start() failed before making it
        if frontdoor is not None:
            await frontdoor.close()
        forwarder = getattr(self, "forwarder", None)  # None when start() failed before making it
        if forwarder is not None:
            await forwarder.close()
        await self._http.close()
        if getattr(self, "_workers_http", None) is not None:
            await self._workers_http.close()
        await self.node.close()

    def status(self) -> str:
        ready = sum(s.ready for s in self.view.state)
        return f"region {self.me.region}, views {ready}/{self.cfg.shards} shards"

    def health(self) -> dict:
        check = self.tokenizer_check
        checked = check is not None and check.settled.is_set()
        refused = sorted(w for w, v in check.verdicts.items() if not v.agrees) if check is not None else []
        return {"ready": self.view.ready and checked, "edge": self.me.id, "region": self.me.region,
                "shards_ready": sum(s.ready for s in self.view.state), "shards": self.cfg.shards,
                "tokenizer_checked": checked, "workers_refused": refused}

    # -- tokenizer check ----------------------------------------------------------------------

    def _start_tokenizer_check(self) -> None:
        """No worker gets anything routed to it until it tokenises the probes as this edge does;
        those that disagree stay withheld. Own-region workers are asked over HTTP (the path this
        edge's requests take them), the others through their agents."""
        for w in self.cfg.workers:
            self.router.withhold(self._worker_index[w.id])
        self.tokenizer_check = TokenizerVerifier(self.cfg.workers, self._probe_tokenizer, self._tokenizer_verdict,
                                                 tokenizer_name=self.tokenizer.name)
        self._tasks.append(asyncio.create_task(self.tokenizer_check.run()))

    async def _probe_tokenizer(self, worker: WorkerConfig) -> WorkerVerdict:
        if worker.region == self.me.region and self.local_http:
            return await probe_worker(self._http, worker, self.tokenizer)
        peer = self._agent_peers.get(worker.id)
        if peer is None:
            return WorkerVerdict(worker.id, False, "has no agent address to check its tokenizer through")
        return await probe_via_agent(peer, self.me.id, worker, self.tokenizer)

    def _tokenizer_verdict(self, verdict: WorkerVerdict) -> None:
        if verdict.agrees:
            self.router.withhold(self._worker_index[verdict.worker], False)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while not self.health()["ready"]:
                await asyncio.sleep(0.01)

    # -- index sync ---------------------------------------------------------------------------

    def _on_peer_state(self, peer: Peer, connected: bool) -> None:
        if not connected or peer.identity is None:
            return
        if peer.identity.role == Role.AGENT:
            if not peer.outbound:
                # The agent's own connection: it says again what it wants (an agent of a version
                # before the message says nothing and gets the vector).
                self._vector_wanted.pop(peer.identity.node_id, None)
            # Either connection (ours to the agent, or the agent's to us) says it is up again.
            forwarder = getattr(self, "forwarder", None)
            if forwarder is not None:
                forwarder.worker_back(peer.identity.node_id, "agent connected")
            return
        if peer.identity.role != Role.MAINTENANCE:
            return
        for shard, p in self._shard_peers.items():
            if p is peer:
                sub = self.sync.subscription(shard, now=self.clock())
                peer.send_encoded(encode(sub))
                if isinstance(sub, SnapshotResumeRequested):
                    log.info("subscribed, resuming a snapshot", shard=shard, snapshot_id=sub.snapshot_id,
                             from_chunk=sub.from_chunk)
                else:
                    log.info("subscribed", shard=shard, epoch=sub.epoch, seq=sub.seq)
        self._arm_sync_timer()

    def _on_message(self, peer: Peer, message: Any, channel: ChannelInfo) -> Any:
        handler = self._handlers.get(type(message))
        if handler is None:
            self._refuse(peer, message, "an edge does not accept it")
            try:
                peer.send_encoded(encode(ErrorReported("forbidden", f"an edge does not accept {type(message).__name__}")))
            except TransportError:
                pass
            return
        return handler(self, peer, message, channel)  # the transport awaits an async handler

    def _refuse(self, peer: Peer, msg: Any, detail: str) -> None:
        """A message its sender has no authority for: counted, logged with the sender's
        certified identity, and dropped; the connection's other traffic carries on."""
        self.metrics.refused_messages.labels(type(msg).__name__).inc()
        log.warning("message refused", peer=str(peer.identity), type=type(msg).__name__, detail=detail)

    def _owner_refusal(self, identity: NodeIdentity, shard: int) -> str | None:
        """Why ``identity`` may not write ``shard``'s view: only the unit the config names does."""
        owner = self.cfg.shard_owner(shard)
        if identity.role != Role.MAINTENANCE or identity.node_id != owner:
            return f"shard {shard} is owned by {owner!r}"
        return None

    def _stream_refusal(self, identity: NodeIdentity, shard: int) -> str | None:
        """Why ``identity`` may not send ``shard``'s stream (batches, positions): the shard's
        owner may, and an edge relaying this edge's region stream."""
        if identity.role != Role.EDGE:
            return self._owner_refusal(identity, shard)
        if identity.node_id not in self._relay_group:
            return f"edge {identity.node_id} does not relay this edge's update stream"
        return None

    def _shard_owned_by_sender(self, peer: Peer, msg: Any) -> bool:
        """Only the maintenance unit the config names for a shard writes that shard's view."""
        why = self._owner_refusal(peer.identity, msg.shard)
        if why is not None:
            self._refuse(peer, msg, why)
        return why is None

    def _batch(self, peer: Peer, msg: UpdateBatchPublished, channel: ChannelInfo) -> None:
        why = self._stream_refusal(peer.identity, msg.shard)
        if why is not None:
            self._refuse(peer, msg, why)
            return
        if peer.identity.role != Role.EDGE:  # the unit's own batch: this edge may relay it
            self._relay(msg)
        step = self.sync.on_batch(msg, now=self.clock())
        if step.applied:
            self.metrics.batches.inc()
        else:
            log.debug("batch not applied", shard=msg.shard, seq=msg.seq, reason=step.reason)
        self._sync_step(step)

    def _position(self, peer: Peer, msg: ShardPositionAnnounced, channel: ChannelInfo) -> None:
        """An idle stream's position (core/sync.py): the view is behind it if the stream's last
        batches were lost. Authorised as a batch is: the shard's owner, or an edge relaying this
        edge's stream (units send announcements to every edge directly; see maintenance.py)."""
        why = self._stream_refusal(peer.identity, msg.shard)
        if why is None and msg.stream != self._stream_name:
            # A unit whose config maps this edge to another stream: its positions say nothing of ours.
            why = f"position of stream {msg.stream or 'full'!r}; this edge follows {self._stream_name or 'full'!r}"
        if why is not None:
            self._refuse(peer, msg, why)
            try:
                peer.send_encoded(encode(ErrorReported("forbidden", f"ShardPositionAnnounced refused: {why}")))
            except TransportError:
                pass
            return
        before = self.sync.position_gaps
        step = self.sync.on_position(msg, now=self.clock())
        if self.sync.position_gaps > before:
            self.metrics.position_gaps.inc()
            log.info("gap shown by a position announcement", shard=msg.shard, epoch=msg.epoch, seq=msg.seq,
                     reason=step.reason)
        self._sync_step(step)

    def _relay(self, msg: UpdateBatchPublished) -> None:
        """Forward the unit's batch, as it came, to this region's other edges of the stream (the
        unit sends its live batches to one edge per region). Only batches beyond the last one
        forwarded: a replay this edge asked for is not sent on (the others ask for their own)."""
        if not self._relay_group or (msg.epoch, msg.seq) <= self._relayed_upto.get(msg.shard, (-1, -1)):
            return
        self._relayed_upto[msg.shard] = (msg.epoch, msg.seq)
        encoded = None
        for edge in self._relay_group:
            peer = self._edge_peers.get(edge)
            if peer is None or not peer.is_connected:
                continue  # it finds the gap and asks the unit
            encoded = encoded or EncodedMessage(msg)
            try:
                peer.send_encoded(encoded.body_for(peer))
                self.batches_relayed += 1
            except TransportError:
                pass

    def _snapshot(self, peer: Peer, msg: Any, channel: ChannelInfo) -> None:
        """A snapshot, whole or a transfer's header or chunk. A peer edge's snapshots arrive
        only on the exchange copy_view_from opened, not here."""
        if not self._shard_owned_by_sender(peer, msg):
            return
        self._sync_step(self._take_snapshot_message(msg, source=peer.identity.node_id))

    def _take_snapshot_message(self, msg: Any, *, source: str) -> SyncStep:
        step = self.sync.on_snapshot_message(msg, now=self.clock())
        if isinstance(msg, ShardSnapshotSent):
            log.info("snapshot", shard=msg.shard, epoch=msg.epoch, seq=msg.seq, applied=step.applied,
                     reason=step.reason, source=source)
        elif isinstance(msg, SnapshotTransferStarted):
            level = log.warning if "refused" in step.reason else log.info
            level("snapshot transfer", shard=msg.shard, epoch=msg.epoch, seq=msg.seq, snapshot_id=msg.snapshot_id,
                  entries=msg.entries, bytes=msg.total_bytes, chunks=msg.chunks, accepted=step.applied,
                  reason=step.reason, source=source)
        elif step.reason:
            # A chunk taken says nothing; the last one (installed), duplicates and refusals do.
            level = log.info if step.applied or " again " in step.reason else log.warning
            level("snapshot chunk", shard=msg.shard, snapshot_id=msg.snapshot_id, index=msg.index,
                  installed=step.applied, reason=step.reason, source=source)
        return step

    def _sync_step(self, step: SyncStep) -> None:
        if step.send is not None:
            self._request_resync(step.send, step.reason)
        self._arm_sync_timer()

    def _request_resync(self, resync: ResyncRequested | SnapshotResumeRequested, reason: str) -> None:
        self.metrics.resyncs.inc()
        if isinstance(resync, SnapshotResumeRequested):
            log.info("snapshot resume", shard=resync.shard, snapshot_id=resync.snapshot_id,
                     from_chunk=resync.from_chunk, reason=reason)
        else:
            log.info("resync", shard=resync.shard, epoch=resync.epoch, from_seq=resync.from_seq, reason=reason)
        peer = self._shard_peers.get(resync.shard)
        if peer is not None and peer.is_connected:
            # Not connected: the subscription on reconnection asks for the same.
            peer.send_encoded(encode(resync))

    def _arm_sync_timer(self) -> None:
        """One timer, at the earliest deadline of the sync protocol's outstanding requests."""
        deadline = self.sync.next_deadline()
        if deadline == self._sync_deadline:
            return
        if self._sync_timer is not None:
            self._sync_timer.cancel()
            self._sync_timer = None
        self._sync_deadline = deadline
        if deadline is not None:
            self._sync_timer = asyncio.get_running_loop().call_later(max(0.0, deadline - self.clock()),
                                                                     self._sync_timeout)

    def _sync_timeout(self) -> None:
        self._sync_timer, self._sync_deadline = None, None
        for resync in self.sync.on_timer(now=self.clock()):
            self._request_resync(resync, "catch-up timed out")
        self._arm_sync_timer()

    async def copy_view_from(self, edge_id: str) -> bool:
        """Bootstrap every shard from a peer edge's views (then the maintenance streams catch
        up). Best effort: a peer that is unreachable, refuses or stalls costs at most
        ``[deadlines] view_copy_timeout_s``, after which the maintenance units' snapshots
        bootstrap the views as on any start. Returns whether any shard was copied."""
        target = next((e for e in self.cfg.edges if e.id == edge_id), None)
        if target is None:
            raise ValueError(f"unknown edge {edge_id!r}")  # a config error: fail the start
        copied = 0
        installed_before = [f.snapshots_installed for f in self.sync.followers]
        try:
            async with asyncio.timeout(self.cfg.deadlines.view_copy_timeout_s):
                peer = await self.node.connect(split_address(target.quic, target.id), expected_role=Role.EDGE,
                                               expected_id=target.id)
                async with peer.open_stream() as exchange:
                    await exchange.send(ViewCopyRequested(self.me.id))
                    async for reply in exchange:
                        if isinstance(reply, SNAPSHOT_MESSAGES):
                            self._take_snapshot_message(reply, source=f"edge:{edge_id}")
                        elif isinstance(reply, ErrorReported):
                            raise ViewCopyRefused(f"peer edge refused the copy: {reply.code}: {reply.detail}")
        except (TimeoutError, TransportError, OSError, ViewCopyRefused) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("view copy from peer edge failed: bootstrapping from the maintenance units", peer=edge_id,
                        error=reason)
        finally:
            # A copy that ended part-way cannot be resumed from the maintenance units: forget it.
            for follower, before in zip(self.sync.followers, installed_before):
                if follower.snapshots_installed > before:
                    copied += 1
                    log.info("copied shard from peer edge", peer=edge_id, shard=follower.shard,
                             position=follower.position)
                if follower.transfer is not None:
                    follower.abandon_transfer()
        return bool(copied)

    async def _view_copy(self, peer: Peer, msg: ViewCopyRequested, channel: ChannelInfo) -> None:
        """Every ready shard's view, each as a snapshot transfer, paced like a maintenance unit's."""
        stream = channel.stream
        if stream is None:
            return
        try:
            same_stream = edge_stream(self.cfg, peer.identity.node_id) == edge_stream(self.cfg, self.me.id)
        except UnknownEdge as exc:
            same_stream, why = False, str(exc)
        else:
            why = f"this edge's views follow another update stream than edge {peer.identity.node_id}'s"
        if not same_stream:
            # Its views would hold other lengths, in tables its units' batches do not fit.
            self._refuse(peer, msg, why)
            stream.send_encoded(encode(ErrorReported("forbidden", why)), end=True)
            return
        ready = [s for s in range(self.cfg.shards) if self.view.state[s].ready]
        if not ready:
            stream.send_encoded(encode(ErrorReported("unavailable", "this edge has no views yet")), end=True)
            return
        window = self.cfg.sync.snapshot_window_bytes
        try:
            for shard in ready:
                # Taken whole now (the image never changes as batches keep arriving), sent in chunks.
                chunker = SnapshotChunker(self.view.snapshot(shard), snapshot_id=secrets.randbits(64) or 1,
                                          chunk_bytes=self.cfg.sync.snapshot_chunk_bytes)
                stream.send_encoded(encode(chunker.header))
                for chunk in chunker.chunks_from(0):
                    await peer.wait_unacknowledged_below(window)
                    stream.send_encoded(encode(chunk))
            await stream.close()
        except TransportError as exc:
            log.info("view copy to peer edge interrupted", peer=str(peer.identity), error=str(exc))

    # -- queue estimates ----------------------------------------------------------------------

    def _load(self, peer: Peer, msg: WorkerLoadReported, channel: ChannelInfo) -> None:
        if self._not_its_own(peer, msg, "report only its own worker's load"):
            return
        now = self.clock()
        # An agent reports at least every [idle] heartbeat while its engine answers; readings
        # that resume after a silence say the engine is back (it was down or frozen).
        last = self._last_load_report.get(msg.worker)
        self._last_load_report[msg.worker] = now
        forwarder = getattr(self, "forwarder", None)  # None while start() copies views
        if forwarder is not None and msg.resumed:
            forwarder.worker_back(msg.worker, "its engine answers again after a stall")
        elif forwarder is not None and last is not None and now - last > self._load_silence_s:
            forwarder.worker_back(msg.worker, f"load reports resumed after {now - last:.1f} s")
        self.router.queues.set_local(msg.worker, msg.queue_ms, now=now, running=msg.running)
        if forwarder is not None and forwarder.decode_chooser is not None:
            forwarder.decode_chooser.load_reported(msg.worker, msg.running, msg.waiting)

    def _room(self, peer: Peer, msg: WorkerRoomReported, channel: ChannelInfo) -> None:
        if self._not_its_own(peer, msg, "report only its own worker's room"):
            return
        self.router.queues.set_room(msg.worker, msg.steps, now=self.clock())

    def _pinned(self, peer: Peer, msg: WorkerPinnedReported, channel: ChannelInfo) -> None:
        if self._not_its_own(peer, msg, "report only its own worker's pinned share"):
            return
        self.router.queues.set_pinned(msg.worker, msg.share)

    def _not_its_own(self, peer: Peer, msg: Any, may: str) -> bool:
        """An agent speaks only for its own worker, one of this edge's region: otherwise the
        message is refused (counted and logged) and this says so."""
        if peer.identity.node_id == msg.worker and msg.worker in self._own_agents:
            return False
        self._refuse(peer, msg, f"agent {peer.identity.node_id} may {may}")
        return True

    def _piggyback_sent(self, peer: Peer, msg: PiggybackSent, channel: ChannelInfo) -> None:
        if self._not_its_own(peer, msg, "note only its own worker's piggybacks"):
            return
        try:
            self.router.queues.note_piggyback_sent(msg.to_region, now=self.clock())
        except ValueError as exc:
            log.warning("piggyback note refused", peer=str(peer.identity), error=str(exc))

    def vector_wanted(self, worker: str) -> bool | None:
        """Whether this edge sends ``worker``'s agent the region's queue vector (None: not an own worker)."""
        return self._vector_wanted.get(worker, True) if worker in self._own_agents else None

    def _vector_interest(self, peer: Peer, msg: QueueVectorInterestReported, channel: ChannelInfo) -> None:
        if self._not_its_own(peer, msg, "say only what its own worker's agent wants"):
            return
        was = self._vector_wanted.get(msg.worker, True)
        self._vector_wanted[msg.worker] = msg.wanted
        if msg.wanted and not was:
            # At once, not at the next period: a response to another region is on its way.
            now = self.clock()
            self._send_datagram(self._agent_peers.get(msg.worker),
                                self._vector_for_agents(self.router.queues.local_vector(now=now), now))

    def _vector_for_agents(self, vector: tuple[tuple[str, float], ...], now: float) -> QueueVectorBroadcast:
        """This region's vector as its own agents get it (to piggyback on responses elsewhere)."""
        return QueueVectorBroadcast(from_region=self.me.region, to_region=self.me.region, sent_at=now, vector=vector)

    def _broadcast(self, peer: Peer, msg: QueueVectorBroadcast, channel: ChannelInfo) -> None:
        self._from_its_regions_edge(peer, msg, "queue vector", self.router.queues.on_broadcast)

    def _room_broadcast(self, peer: Peer, msg: RoomVectorBroadcast, channel: ChannelInfo) -> None:
        self._from_its_regions_edge(peer, msg, "room vector", self.router.queues.on_room_broadcast)

    def _from_its_regions_edge(self, peer: Peer, msg, what: str, apply) -> None:
        # Only a region's own edges speak for its queues and its VRAM room (its agents report to them only).
        sender_region = self.cfg.edge_region(peer.identity.node_id)
        if peer.identity.role != Role.EDGE or sender_region != msg.from_region:
            self._refuse(peer, msg, f"{what} of region {msg.from_region!r} from an edge of {sender_region!r}")
            return
        try:
            apply(msg, now=self.clock())
        except ValueError as exc:
            log.warning(f"{what} refused", peer=str(peer.identity), error=str(exc))

    async def _broadcast_loop(self) -> None:
        period = self.cfg.score.broadcast_period_ms / 1000.0
        gauges_at = float("-inf")
        while True:
            now = self.clock()
            # Unchanged vectors go out only every heartbeat (core/queues.py, due_broadcasts).
            broadcasts = self.router.queues.due_broadcasts(now=now, heartbeat_s=self._heartbeat_s)
            sent = bool(broadcasts)
            # Each with the region's VRAM room, while some worker is short of it.
            rooms = self.router.queues.room_broadcasts([m.to_region for m in broadcasts], now=now)
            for msg in broadcasts + rooms:
                for e in self.cfg.edges_in(msg.to_region):
                    self._send_datagram(self._edge_peers.get(e.id), msg)
            # Own-region agents piggyback this vector on their responses to other regions: a
            # new one each period while it changes, an unchanged one STEADY_REPEATS more periods
            # (a datagram may be lost), then every heartbeat; only to the agents that want it
            # (one serving no other region's requests costs a packet at both ends per period).
            vector = self.router.queues.local_vector(now=now)
            repeats = self._vector_to_agents_repeats + 1 if vector == self._vector_to_agents else 0
            if repeats <= STEADY_REPEATS or now - self._vector_to_agents_at >= self._heartbeat_s:
                self._vector_to_agents, self._vector_to_agents_at = vector, now
                self._vector_to_agents_repeats = repeats
                sent = True
                local = self._vector_for_agents(vector, now)
                wanted = self._vector_wanted
                for w in self._own_agents:
                    if wanted.get(w, True):
                        self._send_datagram(self._agent_peers.get(w), local)
            # The gauges move only with the values (and fade slowly): idle, once per heartbeat.
            if sent or now - gauges_at >= self._heartbeat_s:
                gauges_at = now
                ages = self.router.queues.ages(now=now)
                finite = ages[np.isfinite(ages)]
                self.metrics.queue_age.set(float(finite.max()) if finite.size else 0.0)
                for region, ms in self.router.queues.surprises(now=now).items():
                    self.metrics.queue_correction.labels(region=region).set(ms)
                for region, k in self.router.queues.herd_factors(now=now).items():
                    self.metrics.herd_factor.labels(region=region).set(k)
            deadline = self.router.queues.next_deadline(now=self.clock(), heartbeat_s=self._heartbeat_s)
            delay = max(0.001, min(period, (deadline or now + period) - self.clock()))
            if not self._broadcast_wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._broadcast_wake.wait(), delay)
            self._broadcast_wake.clear()

    def wake_broadcasts(self) -> None:
        """Send the queue broadcasts now if a dispatch made them urgent (``QueueEstimates.urgent``)."""
        if self.router.queues.urgent:
            self._broadcast_wake.set()

    @staticmethod
    def _send_datagram(peer: Peer | None, msg) -> None:
        if peer is not None and peer.is_connected:
            try:
                peer.send_datagram(msg)
            except TransportError:
                pass

    # -- admin --------------------------------------------------------------------------------

    async def _admin(self, peer: Peer, msg: AdminQueried, channel: ChannelInfo) -> None:
        from kvcompassd.inspect import describe_edge_paced

        try:
            body = await describe_edge_paced(self, msg.what, msg.args)
        except ValueError as exc:
            body = {"error": str(exc)}
        reply = encode(AdminAnswered(msg.what, body))
        if channel.stream is not None:
            channel.stream.send_encoded(reply, end=True)
        else:
            peer.send_encoded(reply)

    def _error(self, peer: Peer, msg: ErrorReported, channel: ChannelInfo) -> None:
        log.warning("peer reported an error", peer=str(peer.identity), code=msg.code, detail=msg.detail)

    _handlers = {
        UpdateBatchPublished: _batch,
        ShardPositionAnnounced: _position,
        ShardSnapshotSent: _snapshot,
        SnapshotTransferStarted: _snapshot,
        SnapshotChunkSent: _snapshot,
        WorkerLoadReported: _load,
        WorkerRoomReported: _room,
        WorkerPinnedReported: _pinned,
        PiggybackSent: _piggyback_sent,
        QueueVectorInterestReported: _vector_interest,
        QueueVectorBroadcast: _broadcast,
        RoomVectorBroadcast: _room_broadcast,
        ViewCopyRequested: _view_copy,
        AdminQueried: _admin,
        ErrorReported: _error,
    }
