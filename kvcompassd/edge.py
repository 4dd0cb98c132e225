"""``kvcompassd edge``: a region's gateway. Holds keyless views of every shard, queue estimates
of every worker, and the joint score; forwards each request to the best worker anywhere.

Peers: every maintenance unit (subscribe to its shard's update stream; resync on gaps), every
worker's agent (forward requests over QUIC; own-region agents report load), every other edge
(queue-vector broadcasts as QUIC datagrams every Delta; a peer edge can hand over its views).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import numpy as np
import structlog
from aiohttp import web

from kvcompassd.certs import TlsFiles
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.config import ClusterConfig, EdgeConfig
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.daemon import daemon_transport, split_address
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import ByteTokenizer, Tokenizer
from kvcompassd.transport import ChannelInfo, Peer, QuicNode, TransportError
from kvcompassd.wire import (
    AdminAnswered,
    AdminQueried,
    ErrorReported,
    NodeIdentity,
    PiggybackSent,
    QueueVectorBroadcast,
    ResyncRequested,
    Role,
    ShardSnapshotSent,
    UpdateBatchPublished,
    UpdatesSubscribed,
    ViewCopyRequested,
    WorkerLoadReported,
    encode,
)

log = structlog.get_logger(__name__)


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
    ):
        self.cfg = cfg
        self.me = me
        self.clock = time.monotonic
        self.layout = IndexLayout.from_config(cfg)
        self.view = EdgeIndexView(self.layout, cfg.shards, edge=me.id)
        self.router = Router(cfg, me.region, self.view, now=self.clock(), ablation=ablation)
        self.metrics = EdgeMetrics()
        self.metrics.watch_hot_prefixes(lambda: self.router.hot.hot_misses)
        self.node = QuicNode(NodeIdentity(Role.EDGE, me.id), tls, on_message=self._on_message,
                             on_peer_state=self._on_peer_state, options=daemon_transport(cfg))
        self.tokenizer = tokenizer or ByteTokenizer()
        self.frontdoor_settings = frontdoor or FrontDoorSettings(model=cfg.model)
        self.local_http = local_http
        self.copy_from = copy_from
        self._shard_peers: dict[int, Peer] = {}
        self._agent_peers: dict[str, Peer] = {}
        self._edge_peers: dict[str, Peer] = {}
        self._own_agents = frozenset(w.id for w in cfg.workers_in(me.region))
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
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
        self.forwarder = Forwarder(self.me.id, self.router, self._agent_peers.get, self._http, clock=self.clock,
                                   metrics=self.metrics, local_http=self.local_http)
        guard = FrontDoorGuard(self.cfg.frontdoor, self.metrics)
        self.frontdoor = FrontDoor(self.forwarder, self.tokenizer, self.frontdoor_settings, self.metrics,
                                   health=self.health, guard=guard)
        self._runner = guard.runner(self.frontdoor.app)
        await self._runner.setup()
        host, port = split_address(self.me.http, f"[[edges]] {self.me.id} http")
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.http_address = site._server.sockets[0].getsockname()[:2]
        self._tasks.append(asyncio.create_task(self._broadcast_loop()))
        log.info("edge started", region=self.me.region, http=self.http_address, quic=self.quic_address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        await self._http.close()
        await self.node.close()

    def status(self) -> str:
        ready = sum(s.ready for s in self.view.state)
        return f"region {self.me.region}, views {ready}/{self.cfg.shards} shards"

    def health(self) -> dict:
        return {"ready": self.view.ready, "edge": self.me.id, "region": self.me.region,
                "shards_ready": sum(s.ready for s in self.view.state), "shards": self.cfg.shards}

    async def wait_ready(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while not self.view.ready:
                await asyncio.sleep(0.01)

    # -- index sync ---------------------------------------------------------------------------

    def _on_peer_state(self, peer: Peer, connected: bool) -> None:
        if not connected or peer.identity is None or peer.identity.role != Role.MAINTENANCE:
            return
        for shard, p in self._shard_peers.items():
            if p is peer:
                epoch, seq = self.view.position(shard)
                peer.send_encoded(encode(UpdatesSubscribed(self.me.id, shard, max(epoch, 0), seq)))
                log.info("subscribed", shard=shard, epoch=epoch, seq=seq)

    def _on_message(self, peer: Peer, message: Any, channel: ChannelInfo) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            log.warning("unexpected message", peer=str(peer.identity), type=type(message).__name__)
            try:
                peer.send_encoded(encode(ErrorReported("forbidden", f"an edge does not accept {type(message).__name__}")))
            except TransportError:
                pass
            return
        handler(self, peer, message, channel)

    def _batch(self, peer: Peer, msg: UpdateBatchPublished, channel: ChannelInfo) -> None:
        outcome = self.view.apply_batch(msg)
        if outcome.applied:
            self.metrics.batches.inc()
        elif outcome.resync is not None:
            self._request_resync(msg.shard, outcome.resync, outcome.reason)
        else:
            log.debug("batch ignored", shard=msg.shard, seq=msg.seq, reason=outcome.reason)

    def _snapshot(self, peer: Peer, msg: ShardSnapshotSent, channel: ChannelInfo) -> None:
        if peer.identity.role != Role.MAINTENANCE:
            log.warning("snapshot refused: only maintenance units push snapshots", peer=str(peer.identity))
            return
        outcome = self.view.install_snapshot(msg)
        log.info("snapshot", shard=msg.shard, epoch=msg.epoch, seq=msg.seq, applied=outcome.applied, reason=outcome.reason)

    def _request_resync(self, shard: int, resync: ResyncRequested, reason: str) -> None:
        self.metrics.resyncs.inc()
        log.info("resync", shard=shard, from_seq=resync.from_seq, reason=reason)
        peer = self._shard_peers.get(shard)
        if peer is not None and peer.is_connected:
            peer.send_encoded(encode(ResyncRequested(self.me.id, shard, resync.epoch, resync.from_seq)))

    async def copy_view_from(self, edge_id: str) -> None:
        """Bootstrap every shard from a peer edge's views (then the maintenance streams catch up)."""
        target = next((e for e in self.cfg.edges if e.id == edge_id), None)
        if target is None:
            raise ValueError(f"unknown edge {edge_id!r}")
        peer = await self.node.connect(split_address(target.quic, target.id), expected_role=Role.EDGE,
                                       expected_id=target.id)
        async with peer.open_stream() as exchange:
            await exchange.send(ViewCopyRequested(self.me.id))
            async for reply in exchange:
                if isinstance(reply, ShardSnapshotSent):
                    outcome = self.view.install_snapshot(reply)
                    log.info("copied shard from peer edge", peer=edge_id, shard=reply.shard, applied=outcome.applied)
                elif isinstance(reply, ErrorReported):
                    raise RuntimeError(f"peer edge refused the copy: {reply.detail}")

    def _view_copy(self, peer: Peer, msg: ViewCopyRequested, channel: ChannelInfo) -> None:
        if channel.stream is None:
            return
        ready = [s for s in range(self.cfg.shards) if self.view.state[s].ready]
        for i, shard in enumerate(ready):
            channel.stream.send_encoded(encode(self.view.snapshot(shard)), end=i == len(ready) - 1)
        if not ready:
            channel.stream.send_encoded(encode(ErrorReported("unavailable", "this edge has no views yet")), end=True)

    # -- queue estimates ----------------------------------------------------------------------

    def _load(self, peer: Peer, msg: WorkerLoadReported, channel: ChannelInfo) -> None:
        if peer.identity.node_id != msg.worker or msg.worker not in self._own_agents:
            log.warning("load report refused", peer=str(peer.identity), worker=msg.worker)
            return
        self.router.queues.set_local(msg.worker, msg.queue_ms, now=self.clock(), running=msg.running)

    def _piggyback_sent(self, peer: Peer, msg: PiggybackSent, channel: ChannelInfo) -> None:
        if peer.identity.node_id != msg.worker or msg.worker not in self._own_agents:
            return
        try:
            self.router.queues.note_piggyback_sent(msg.to_region, now=self.clock())
        except ValueError as exc:
            log.warning("piggyback note refused", peer=str(peer.identity), error=str(exc))

    def _broadcast(self, peer: Peer, msg: QueueVectorBroadcast, channel: ChannelInfo) -> None:
        try:
            self.router.queues.on_broadcast(msg, now=self.clock())
        except ValueError as exc:
            log.warning("queue vector refused", peer=str(peer.identity), error=str(exc))

    async def _broadcast_loop(self) -> None:
        period = self.cfg.score.broadcast_period_ms / 1000.0
        while True:
            now = self.clock()
            for b in self.router.queues.due_broadcasts(now=now):
                msg = QueueVectorBroadcast(from_region=b.from_region, to_region=b.to_region, sent_at=b.sent_at,
                                           vector=b.vector)
                for e in self.cfg.edges_in(b.to_region):
                    self._send_datagram(self._edge_peers.get(e.id), msg)
            # Own-region agents piggyback this vector on their responses to other regions.
            local = QueueVectorBroadcast(from_region=self.me.region, to_region=self.me.region, sent_at=now,
                                         vector=self.router.queues.local_vector(now=now))
            for w in self._own_agents:
                self._send_datagram(self._agent_peers.get(w), local)
            ages = self.router.queues.ages(now=now)
            finite = ages[np.isfinite(ages)]
            self.metrics.queue_age.set(float(finite.max()) if finite.size else 0.0)
            for region, ms in self.router.queues.surprises(now=now).items():
                self.metrics.queue_correction.labels(region=region).set(ms)
            for region, k in self.router.queues.herd_factors(now=now).items():
                self.metrics.herd_factor.labels(region=region).set(k)
            deadline = self.router.queues.next_deadline(now=self.clock())
            await asyncio.sleep(max(0.001, min(period, (deadline or now + period) - self.clock())))

    @staticmethod
    def _send_datagram(peer: Peer | None, msg) -> None:
        if peer is not None and peer.is_connected:
            try:
                peer.send_datagram(msg)
            except TransportError:
                pass

    # -- admin --------------------------------------------------------------------------------

    def _admin(self, peer: Peer, msg: AdminQueried, channel: ChannelInfo) -> None:
        from kvcompassd.inspect import describe_edge

        try:
            body = describe_edge(self, msg.what, msg.args)
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
        ShardSnapshotSent: _snapshot,
        WorkerLoadReported: _load,
        PiggybackSent: _piggyback_sent,
        QueueVectorBroadcast: _broadcast,
        ViewCopyRequested: _view_copy,
        AdminQueried: _admin,
        ErrorReported: _error,
    }
