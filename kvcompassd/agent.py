"""``kvcompassd agent``: beside one inference engine (SGLang, or the emulated worker).

- Follows the engine's KV-event stream (ZMQ SUB + replay), mirrors its block tree, and reports
  the resulting index events to the maintenance units owning their keys.
- Reads the engine's load and reports it to its region's edges (QUIC datagrams).
- Runs prompts forwarded by edges on the engine with ``/generate`` and ``input_ids``, streams the
  output back, and closes with the reused-token count and the region's queue vector.
- Executes migrations: recomputes a hot prefix on its idle engine.

Each (re)registration with the maintenance units uses a new incarnation: the unit drops what
it held for this worker and the agent re-sends everything its engine holds now, so nothing
missed while disconnected can linger in the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
import structlog

from kvcompassd.certs import TlsFiles
from kvcompassd.core.config import ClusterConfig, WorkerConfig, bootstrap_port_of
from kvcompassd.core.events import IndexEvent, IndexEventColumns, PrefixCached
from kvcompassd.core.keys import namespace_salt
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.queues import STEADY_REPEATS
from kvcompassd.daemon import daemon_transport, split_address
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.client import EngineClient, EngineError, EngineOutput, EngineRejected, EngineStatusError
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.engine.disaggregated import (
    FAKE_BOOTSTRAP_HOST,
    BootstrapFields,
    DecodeFailed,
    generate_on_pair,
    new_bootstrap_room,
)
from kvcompassd.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    ScannedEvents,
)
from kvcompassd.engine.subscriber import (
    BatchesLost,
    BatchRejected,
    KvEventSubscriber,
    OddSequenceRejected,
    PublisherRestarted,
)
from kvcompassd.metrics import AgentMetrics
from kvcompassd.pacing import LoadPollSchedule, LoadReports, LoadTolerance, ReadingCadence, VectorInterest
from kvcompassd.reports import ReportCoalescer
from kvcompassd.tokenizer_check import answer_for_agent
from kvcompassd.transport import ChannelInfo, Peer, QuicNode, TransportError
from kvcompassd.wire import (
    AdminAnswered,
    AdminQueried,
    MAX_WORKER_LATENCY_S,
    ErrorReported,
    MigrationRequested,
    NodeIdentity,
    PiggybackSent,
    PrefillDecodeForwarded,
    PrefixEventsReported,
    QueueVectorBroadcast,
    QueueVectorInterestReported,
    RequestFailed,
    RequestForwarded,
    RequestRejected,
    ResponseChunked,
    ResponseCompleted,
    Role,
    TokenizationRequested,
    WorkerLoadReported,
    WorkerPinnedReported,
    WorkerRegistered,
    WorkerRoomReported,
    WorkerWithdrawn,
    encode,
)

log = structlog.get_logger(__name__)

ENGINE_DOWN_AFTER = 5  # consecutive failed load readings
FOLLOW_RETRY_S = 1.0  # after the event follower failed on a bug
SLICE_BLOCKS = 2048  # engine blocks applied between two yields to the event loop
# The region's queue vector is wanted until this long after the last request from another
# region ended (VectorInterest): a region that sends one every few seconds keeps it coming.
VECTOR_LINGER_S = 10.0
# CPython's full collection scans every tracked object; with a mirror of 10^5 blocks it takes
# hundreds of ms, and while such a mirror grows the default (700, 10, 10) runs one every few
# thousand blocks (tools/bench_event_stall.py: ~1.3 s stalls for a 150 k-block batch, ~0.3 s
# with this). The agent makes few reference cycles; younger generations are collected as usual.
GC_THRESHOLDS = (700, 10, 1000)


def load_tolerance(cfg: ClusterConfig, worker: WorkerConfig) -> LoadTolerance:
    """How far the worker's load may move before its edges are told (``[idle]``): the score's
    terms from the config; a decode worker's counts exactly (the edges pick decode workers by them)."""
    return LoadTolerance(queue_ms=cfg.idle.load_tolerance_ms, queue_share=cfg.idle.load_tolerance_share,
                         occupancy_ms_per_running=cfg.score.occupancy_ms_per_running,
                         stall_weight=cfg.score.decode_stall_weight, counts_exact=worker.role == "decode")


def tune_gc_for_large_mirrors() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


class AgentNode:
    def __init__(
        self,
        cfg: ClusterConfig,
        worker: WorkerConfig,
        tls: TlsFiles,
        *,
        replay_endpoint: str | None = None,
        load_interval: float = 0.02,
        load_idle_interval: float | None = None,
        chaos_drop_engine_batches: float = 0.0,
    ):
        if not worker.agent or not worker.http:
            raise ValueError(f"worker {worker.id} needs 'agent' and 'http' addresses in the config to run an agent")
        self.cfg = cfg
        self.worker = worker
        self.plan = LevelPlan.from_config(cfg)
        salt = namespace_salt(cfg.model, cfg.tenant)
        self.tree = BlockTree(worker.id, self.plan.registration_lengths(), salt=salt,  # keys as prefix_keys, incremental
                              page_size=cfg.index.block_size)
        self.node = QuicNode(NodeIdentity(Role.AGENT, worker.id), tls, on_message=self._on_message,
                             on_peer_state=self._on_peer_state, options=daemon_transport(cfg))
        self.metrics = AgentMetrics(worker=worker.id, region=worker.region)
        self._batches_applied = self.metrics.engine_batches.labels("applied")  # (counted per batch)
        self.replay_endpoint = replay_endpoint
        self.load_interval = load_interval
        # Fault injection: discard this share of the engine's live batches on arrival, which
        # exercises gap detection and replay exactly as real loss on the ZMQ link does.
        self.chaos_drop = chaos_drop_engine_batches
        self.incarnation = 0
        # Index events gather per shard for [sync] report_delay_ms and leave as one report.
        self.reports = ReportCoalescer(worker.id, cfg.shards, self._send_report,
                                       delay_s=cfg.sync.report_delay_ms / 1000.0)
        self._shard_peers: dict[int, Peer] = {}
        self._edge_peers: dict[str, Peer] = {}
        self.region_vector: dict[str, float] = {}
        self.queue_ms = 0.0
        self.engine_up = False
        # True from an engine-down withdrawal until the engine answers again: reports wait, and
        # the answer re-registers the mirror (kept: the engine process and its cache may be fine).
        self._withdrawn = False
        self._load_failures = 0
        self._heartbeat_s = cfg.idle.heartbeat_ms / 1000.0
        # Idle, the engine is read once per heartbeat, not 50 times a second (issue 30 item 4).
        idle = self._heartbeat_s if load_idle_interval is None else load_idle_interval
        # A KV-event batch (work done) brings a reading at most once per queue broadcast period
        # (what an edge's view of the other edges' dispatches lags by anyway); a forwarded
        # request (work arriving) after a fast period, as a reading showing work does.
        idle_s = max(load_interval, idle)
        self.load_schedule = LoadPollSchedule(
            busy_s=load_interval, idle_s=idle_s,
            done_spacing_s=min(idle_s, max(load_interval, cfg.score.broadcast_period_ms / 1000.0)))
        # One edge sending all the work: its own charges carry the queue, readings can be slower.
        sole_s = cfg.idle.sole_edge_poll_ms / 1000.0
        self.reading_cadence = ReadingCadence(fast_s=load_interval,
                                              sole_s=min(idle_s, max(load_interval, sole_s)))
        self.reading_period = (load_interval, "starting")  # the busy period and why, as of the last reading
        self.load_reports = LoadReports(heartbeat_s=self._heartbeat_s, steady_repeats=STEADY_REPEATS,
                                        tolerance=load_tolerance(cfg, worker))
        # The region's queue vector, wanted only while serving other regions (VectorInterest);
        # an unchanged one comes every heartbeat, so one older than that and two periods is stale.
        self.vector_interest = VectorInterest(
            linger_s=VECTOR_LINGER_S, fresh_s=self._heartbeat_s + 2.0 * cfg.score.broadcast_period_ms / 1000.0)
        self._piggybacked = {"region": 0, "own": 0}  # responses to other regions, by the vector carried
        self._load_wake = asyncio.Event()
        self._wake_for_arrival = False  # the wake-up was work arriving, not only KV events (work done)
        self._reading_started = float("-inf")  # time.monotonic() of the latest load reading
        self._tasks: list[asyncio.Task] = []
        self.migrations: list[dict] = []
        self.address: tuple[str, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        tune_gc_for_large_mirrors()
        host, port = split_address(self.worker.agent, f"[[workers]] {self.worker.id} agent")
        self.address = await self.node.listen(host, port)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                           connector=aiohttp.TCPConnector(limit=0))
        self._engine_http = WorkerConnections()  # keep-alive pools toward this engine (and a decode engine)
        self.engine = EngineClient(self.worker.http, self._engine_http)
        # A decode worker's KV is never indexed (its prefill worker's is): its agent follows no
        # KV events and registers nothing with the maintenance units.
        for m in self.cfg.maintenance if self.worker.role != "decode" else ():
            self._shard_peers[m.shard] = self.node.peer(split_address(m.quic, m.id), expected_role=Role.MAINTENANCE,
                                                        expected_id=m.id)
        for e in self.cfg.edges_in(self.worker.region):
            self._edge_peers[e.id] = self.node.peer(split_address(e.quic, e.id), expected_role=Role.EDGE,
                                                    expected_id=e.id)
        if self.worker.role == "decode":
            log.info("decode worker: no KV events followed, nothing indexed")
        elif self.worker.kv_events:
            self._tasks.append(asyncio.create_task(self._follow_engine_events()))
        else:
            log.warning("no kv_events endpoint configured: this worker's caches will not be indexed")
        self._tasks.append(asyncio.create_task(self._load_loop()))
        log.info("agent started", worker=self.worker.id, quic=self.address, engine=self.worker.http)

    async def stop(self) -> None:
        self.reports.cancel()  # (no report window's timer left to fire on closed peers)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.close()
        await self._engine_http.close()
        await self.node.close()

    def status(self) -> str:
        return f"worker {self.worker.id}, engine {'up' if self.engine_up else 'down'}, {len(self.tree.registered())} keys"

    async def _follow_engine_events(self) -> None:
        """Find the engine's replay socket, then follow its event stream until cancelled.

        The engine may start after the agent: ask ``/server_info`` until it answers. Batches it
        published before the subscription are not lost: the first live batch shows a gap from
        seq 0, which the replay socket fills.
        """
        replay = await self.find_replay_endpoint()
        drop = None
        if self.chaos_drop > 0:
            rng = random.Random(self.worker.id)
            drop = lambda seq: seq > 0 and rng.random() < self.chaos_drop  # noqa: E731
        self.subscriber = KvEventSubscriber(self.worker.kv_events, replay, self._on_engine_events, drop=drop,
                                            topic=self.worker.kv_events_topic,
                                            idle_probe_max=self.cfg.idle.engine_probe_max_ms / 1000.0,
                                            coalesce=True)
        retry = FOLLOW_RETRY_S
        while True:
            try:
                await self.subscriber.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug on some engine input must not end the following for good while the
                # agent looks healthy: the same subscriber (its position) goes on, and the
                # index is re-registered from the mirror, whatever the failure left half-applied.
                log.exception("kv-event follower failed; following again and re-registering the mirror")
                self.metrics.engine_batches.labels("rejected").inc()
                if not self._withdrawn:
                    self._register_again()
                await asyncio.sleep(retry)
                retry = min(30.0, retry * 2)  # a failure that repeats must not re-register every second

    async def find_replay_endpoint(self) -> str | None:
        """The configured replay endpoint, else the one the engine's ``/server_info`` reports
        (asked until the engine answers), else None: the stream is followed without replay.
        An engine that answers ``/server_info`` with a 4xx has none (vLLM): waiting for it
        would leave the worker's events unfollowed for good."""
        replay = self.replay_endpoint or self.worker.kv_events_replay
        delay = 0.05
        while replay is None:
            try:
                replay = await self._replay_endpoint_from_engine()
                if replay is None:
                    log.warning("engine reports no replay endpoint: gaps in its event stream cannot be repaired")
                break
            except EngineStatusError as exc:
                if 400 <= exc.status < 500:
                    log.warning("engine has no /server_info (vLLM?) and no kv_events_replay is configured: "
                                "gaps in its event stream cannot be repaired", status=exc.status)
                    break
                log.info("waiting for the engine's /server_info", error=str(exc))
            except EngineError as exc:
                log.info("waiting for the engine's /server_info", error=str(exc))
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
        return replay

    async def _replay_endpoint_from_engine(self) -> str | None:
        """SGLang's ``/server_info`` carries the ``--kv-events-config`` JSON with the replay
        endpoint. Raises EngineError while the engine does not answer."""
        info = await self.engine.server_info()
        config = info.get("kv_events_config")
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError:
                config = None
        replay = config.get("replay_endpoint") if isinstance(config, dict) else None
        if isinstance(replay, str) and replay:
            # SGLang reports its bind address ("tcp://*:5558"); dial the engine's host instead.
            host = split_address(self.worker.kv_events.removeprefix("tcp://"), "kv_events")[0]
            return replay.replace("*", host).replace("0.0.0.0", host)
        return None

    # -- index registration -------------------------------------------------------------------

    async def _on_engine_events(self, item) -> None:
        if isinstance(item, EventBatch):
            self._batches_applied.inc()
            await self._apply_in_slices(item)
        elif isinstance(item, PublisherRestarted):
            # concluded from the replay socket's evidence, never from one odd seq (subscriber.py)
            log.warning("engine restarted: withdrawing its registrations", previous_seq=item.previous_seq)
            self.metrics.engine_batches.labels("restart").inc()
            self._enqueue(*self.tree.withdraw_all_with_lengths())
        elif isinstance(item, BatchesLost):
            # The engine's replay buffer no longer has them: entries may be stale until the
            # engine reports those blocks again; the edges' cache belief absorbs the difference.
            log.warning("engine batches lost beyond replay", first=item.first_seq, last=item.last_seq)
            self.metrics.engine_batches.labels("lost").inc()
        elif isinstance(item, BatchRejected):
            log.warning("malformed engine batch rejected", seq=item.seq, reason=item.reason)
            self.metrics.engine_batches.labels("rejected").inc()
        elif isinstance(item, OddSequenceRejected):  # logged by the subscriber; nothing withdrawn
            self.metrics.engine_batches.labels("odd_seq").inc()

    async def _apply_in_slices(self, batch: EventBatch) -> None:
        """Apply a batch in one pass (``BlockTree.apply_events``), or a huge one ``SLICE_BLOCKS``
        blocks at a time, yielding to the loop between slices:
        an engine batch of 150 k blocks must not stall QUIC keep-alives and load reports for
        seconds (the maintenance unit would withdraw this worker). Reports are diffs, so a
        registration sent between two slices and the diffs that follow stay consistent."""
        self._work_arriving(done=True)
        events = batch.events
        blocks = (events.block_count() if type(events) is ScannedEvents  # (counted without building its events)
                  else sum(len(e.block_hashes) for e in events if type(e) is not AllBlocksCleared))
        if blocks <= SLICE_BLOCKS:
            self._enqueue(*self.tree.apply_events_with_lengths(events))  # the usual batch: one pass, one diff
            return
        pending: list[KvEvent] = []
        done = 0
        for event in events:
            if isinstance(event, BlockStored):
                parts: Iterable[KvEvent] = event.slices(SLICE_BLOCKS)
            elif isinstance(event, BlockRemoved) and len(event.block_hashes) > SLICE_BLOCKS:
                parts = (BlockRemoved(event.block_hashes[i : i + SLICE_BLOCKS], event.medium, event.group_idx)
                         for i in range(0, len(event.block_hashes), SLICE_BLOCKS))
            else:
                parts = (event,)
            for part in parts:
                pending.append(part)
                done += len(part.block_hashes) if not isinstance(part, AllBlocksCleared) else SLICE_BLOCKS
                if done >= SLICE_BLOCKS:
                    self._enqueue(*self.tree.apply_events_with_lengths(pending))
                    pending, done = [], 0
                    await asyncio.sleep(0)
        if pending:
            self._enqueue(*self.tree.apply_events_with_lengths(pending))

    def _enqueue(self, events: list[IndexEvent], lengths: list[int]) -> None:
        # Each event's indexed length: the unit sends each edge region only what it looks up.
        self.reports.add_events(events, lengths)

    def _send_report(self, shard: int, report: PrefixEventsReported) -> bool:
        if self._withdrawn:
            return False  # the re-registration when the engine is back sends the current state
        peer = self._shard_peers.get(shard)
        if peer is None or not peer.is_connected or peer.identity is None:
            return False  # the re-registration on reconnection sends the current state
        try:
            peer.send_encoded(encode(report))
        except TransportError:
            return False
        self.metrics.index_events.inc(len(report.events))
        return True

    def _register_with(self, shard: int, peer: Peer) -> None:
        """New incarnation, then everything the engine holds now for this shard. The report seq
        is not reset: one counter serves every shard, and a unit that sees a new incarnation
        accepts any seq above -1."""
        self.incarnation = max(self.incarnation + 1, time.time_ns())
        peer.send_encoded(encode(WorkerRegistered(self.worker.id, self.incarnation)))
        mine = [(key, tier, length) for key, (tier, length) in self.tree.registered_with_lengths().items()
                if key % self.cfg.shards == shard]
        events = [PrefixCached(self.worker.id, key, tier) for key, tier, _ in mine]
        self.reports.discard(shard)
        self.reports.report(shard, IndexEventColumns.from_events(events, [length for _, _, length in mine]))
        log.info("registered with maintenance", shard=shard, incarnation=self.incarnation, keys=len(events))

    def _on_peer_state(self, peer: Peer, connected: bool) -> None:
        if connected and peer.identity is not None and peer.identity.role == Role.EDGE:
            if peer.outbound:  # (the connection on which the edge listens for what we want)
                self._say_vector_interest(peer)
            # A new edge knows nothing of this worker's load: read and report it now, not at
            # the next idle heartbeat (an unknown worker is never taken for an idle one).
            self.load_reports.listener_joined()
            self._wake_for_arrival = True  # (read a fast period after the previous reading, not a done sign's spacing)
            self._load_wake.set()
            return
        if not connected or peer.identity is None or peer.identity.role != Role.MAINTENANCE:
            return
        if self._withdrawn:
            return  # registered once the engine answers again
        for shard, p in self._shard_peers.items():
            if p is peer:
                self._register_with(shard, peer)

    # -- load ---------------------------------------------------------------------------------

    async def _load_loop(self) -> None:
        while True:
            started = self._reading_started = time.monotonic()
            try:
                load = await self.engine.load(self.worker.prefill_ms_per_token)
            except EngineError as exc:
                self.load_schedule.failed()
                self.load_reports.failed()
                self._load_failures += 1
                if self.engine_up and self._load_failures >= ENGINE_DOWN_AFTER:
                    self._engine_down(str(exc))
            else:
                if not self.engine_up:
                    log.info("engine up", worker=self.worker.id)
                self.engine_up = True
                if self._withdrawn:
                    self._register_again()
                self._load_failures = 0
                self.queue_ms = load.queue_ms
                self.region_vector[self.worker.id] = load.queue_ms
                self.metrics.queue_ms.set(load.queue_ms)
                # Edges want a live value, not a stream of identical ones (LoadReports says
                # which readings go, and marks the first after a freeze or failure).
                changed, send, resumed = self.load_reports.reading(load, started=started, now=time.monotonic())
                (self.metrics.load_readings_sent if send else self.metrics.load_readings_held).inc()
                self.reading_period = self.reading_cadence.period(
                    edges=sum(p.is_connected for p in self._edge_peers.values()),
                    remote=self.vector_interest.wanted, pool_share=load.pinned_share,
                    decode=self.worker.role == "decode")
                self.metrics.reading_periods[self.reading_period[1]].inc()
                self.load_schedule.observed(changed=changed,
                                            busy=load.queue_ms > 0 or load.running > 0 or load.waiting > 0,
                                            period_s=self.reading_period[0])
                if send:
                    report = WorkerLoadReported(self.worker.id, load.queue_ms, load.running, load.waiting,
                                                resumed=resumed)
                    # When its VRAM frees up, where the engine says (a long prompt waits for room).
                    room = None if load.room_steps is None else WorkerRoomReported(self.worker.id, load.room_steps)
                    # An engine that gives no room steps but its KV pool's use (a real SGLang):
                    # the share its requests hold, which prices a copy there (score.copy_weight).
                    pinned = (WorkerPinnedReported(self.worker.id, load.pinned_share)
                              if room is None and load.pinned_share is not None else None)
                    for peer in self._edge_peers.values():
                        if peer.is_connected:
                            try:
                                peer.send_datagram(report)
                                if room is not None:
                                    peer.send_datagram(room)
                                if pinned is not None:
                                    peer.send_datagram(pinned)
                            except TransportError:
                                pass
            if self.vector_interest.lapsed(now=time.monotonic()):
                self._say_vector_interest()
            await self._sleep_until_next_reading()

    def _say_vector_interest(self, only: Peer | None = None) -> None:
        """Tell this region's edges (or ``only`` one) whether to send us the queue vector, on
        the ordered control channel: a lost "not wanted" would leave the packets flowing, a lost
        "wanted" stale piggybacks."""
        body = encode(QueueVectorInterestReported(self.worker.id, self.vector_interest.wanted))
        for peer in (only,) if only is not None else tuple(self._edge_peers.values()):
            if peer.is_connected:
                try:
                    peer.send_encoded(body)
                except TransportError:
                    pass

    async def _sleep_until_next_reading(self) -> None:
        """The schedule's delay, cut short by a wake-up (work arriving, an edge connecting, KV
        events), which reads at once, or a fast period (for KV events alone ``done_spacing_s``)
        after the previous reading."""
        self._load_wake.clear()
        self._wake_for_arrival = False
        try:
            async with asyncio.timeout(self.load_schedule.delay_s):
                await self._load_wake.wait()
        except TimeoutError:
            return
        while True:  # another sign meanwhile is read again: work arriving cuts a done sign's longer wait
            wait = self.load_schedule.wake_delay(time.monotonic() - self._reading_started,
                                                 done=not self._wake_for_arrival)
            if wait <= 0:
                return
            self._load_wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._load_wake.wait()
            except TimeoutError:
                return

    def _work_arriving(self, *, done: bool = False) -> None:
        """A forwarded request, or KV events (``done``: work the engine did): its load is about
        to move or moved, read it soon (the schedule's ``wake_delay``; the reading, not this
        sign, decides whether the fast period comes back)."""
        if self.load_schedule.hastens(done=done):
            if not done:
                self._wake_for_arrival = True
            self._load_wake.set()

    def _engine_down(self, reason: str) -> None:
        """Take the worker out of the index while its engine does not answer, but keep the
        mirror: a busy or restarting HTTP side says nothing about the engine's cache, and the
        event stream goes on (a really restarted engine is concluded from its replay socket,
        which withdraws the mirror). Wiping it here lost the holdings for good, as the
        subscriber's position stayed past the batches that had built them."""
        log.warning("engine down: withdrawing the worker from the index", worker=self.worker.id, reason=reason)
        self.engine_up = False
        self._withdrawn = True
        for peer in self._shard_peers.values():
            if peer.is_connected:
                try:
                    peer.send_encoded(encode(WorkerWithdrawn(self.worker.id)))
                except TransportError:
                    pass

    def _register_again(self) -> None:
        """The engine answers again after a withdrawal: a new incarnation with the mirror's
        current state for every connected unit (others register when they connect)."""
        self._withdrawn = False
        for shard, peer in self._shard_peers.items():
            if peer.is_connected and peer.identity is not None:
                self._register_with(shard, peer)

    # -- messages from edges ------------------------------------------------------------------

    def _on_message(self, peer: Peer, message: Any, channel: ChannelInfo):
        if isinstance(message, (RequestForwarded, PrefillDecodeForwarded)):
            self._work_arriving()
            return self._serve(peer, message, channel)
        if isinstance(message, QueueVectorBroadcast):
            # Only an edge of this worker's region speaks for its queues (the vector this agent
            # piggybacks on its responses to other regions).
            sender = peer.identity.node_id if peer.identity is not None else None
            if message.from_region != self.worker.region or sender not in self._edge_peers:
                self.metrics.refused_messages.labels("QueueVectorBroadcast").inc()
                log.warning("message refused", peer=str(peer.identity), type="QueueVectorBroadcast",
                            detail=f"queue vector of region {message.from_region!r} from a non-{self.worker.region} edge")
                return None
            self.region_vector.update(dict(message.vector))
            self.region_vector[self.worker.id] = self.queue_ms
            self.vector_interest.vector_received(now=time.monotonic())
            return None
        if isinstance(message, MigrationRequested):
            self._work_arriving()
            return self._migrate(message)
        if isinstance(message, TokenizationRequested):
            return self._tokenize(message, channel)
        if isinstance(message, AdminQueried):
            from kvcompassd.inspect import AGENT_QUERIES, refusal

            body = self.describe() if message.what in AGENT_QUERIES else refusal("an agent", message.what, AGENT_QUERIES)
            reply = encode(AdminAnswered(message.what, body))
            if channel.stream is not None:
                channel.stream.send_encoded(reply, end=True)
            return None
        if isinstance(message, ErrorReported):
            log.warning("peer reported an error", peer=str(peer.identity), code=message.code, detail=message.detail)
            return None
        log.warning("unexpected message", peer=str(peer.identity), type=type(message).__name__)
        return None

    async def _tokenize(self, msg: TokenizationRequested, channel: ChannelInfo) -> None:
        """An edge checks it tokenises as this worker's engine does (kvcompassd.tokenizer_check)."""
        if channel.stream is not None:
            await channel.stream.send(await answer_for_agent(self._http, self.worker, msg), end=True)

    async def _serve(self, peer: Peer, msg: RequestForwarded | PrefillDecodeForwarded, channel: ChannelInfo) -> None:
        """Run a forwarded request until it completes or the edge abandons the exchange (its
        client went away, or a deadline passed there): then the engine request is aborted by
        closing its connection, as SGLang expects, rather than computed for nobody."""
        stream = channel.stream
        if stream is None:
            log.warning("forwarded request outside an exchange dropped", request_id=msg.request_id)
            return
        log_ = log.bind(request_id=msg.request_id, edge=msg.edge)
        if not self.engine_up:
            await stream.send(RequestFailed(msg.request_id, self.worker.id, "engine down", True), end=True)
            self.metrics.requests.labels("refused").inc()
            return
        if isinstance(msg, PrefillDecodeForwarded):
            refusal = self._pair_refusal(msg)
            if refusal is not None:
                self.metrics.refused_messages.labels("PrefillDecodeForwarded").inc()
                log_.warning("message refused", peer=str(peer.identity), type="PrefillDecodeForwarded", detail=refusal)
                await stream.send(ErrorReported("forbidden", refusal), end=True)
                return
        remote = msg.origin_region != self.worker.region
        if remote and self.vector_interest.remote_started(now=time.monotonic()):
            self._say_vector_interest()  # the edges send the vector at once: it is here before the response
        work = asyncio.ensure_future(self._run_forwarded(stream, msg, log_))
        abandoned = asyncio.ensure_future(stream.wait_aborted())
        try:
            await asyncio.wait({work, abandoned}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if remote:
                self.vector_interest.remote_ended(now=time.monotonic())
            abandoned.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self.metrics.requests.labels("abandoned").inc()
                log_.info("edge abandoned the request: engine request aborted")

    def _pair_refusal(self, msg: PrefillDecodeForwarded) -> str | None:
        """Why this agent cannot run ``msg`` on a prefill-decode pair (None: it can)."""
        if self.worker.role != "prefill":
            return f"worker {self.worker.id} is a {self.worker.role} worker, not a prefill worker"
        try:
            decode = self.cfg.worker(msg.decode_worker)
        except KeyError:
            return f"unknown decode worker {msg.decode_worker!r}"
        if decode.role != "decode" or decode.region != self.worker.region or not decode.http:
            return (f"worker {decode.id} is not a decode worker of region {self.worker.region} with an http address "
                    f"(role {decode.role}, region {decode.region})")
        return None

    def _generation(self, msg: RequestForwarded | PrefillDecodeForwarded):
        """The engine request(s) for ``msg``: this engine alone, or with a decode engine of the
        region as SGLang's prefill-decode router runs a pair."""
        if isinstance(msg, RequestForwarded):
            return self.engine.generate(msg.input_ids, msg.sampling_params, stream=True, rid=msg.request_id)
        decode = self.cfg.worker(msg.decode_worker)
        bootstrap = BootstrapFields.for_prefill(self.worker.http, bootstrap_port_of(self.worker), msg.bootstrap_room)
        return generate_on_pair(self.engine, EngineClient(decode.http, self._engine_http), bootstrap, msg.input_ids,
                                msg.sampling_params, rid=msg.request_id)

    async def _run_forwarded(self, stream, msg: RequestForwarded | PrefillDecodeForwarded, log_) -> None:
        produced = False
        try:
            # Always streamed from the engine: each token goes on at once, and the edge's
            # deadlines see the output as it comes.
            async with contextlib.aclosing(self._generation(msg)) as items:
                async for item in items:
                    if isinstance(item, EngineOutput):
                        produced = True
                        await stream.send(ResponseChunked(msg.request_id, item.token_ids, item.text, False))
                    else:
                        vector, piggyback = self._piggyback_for(msg.origin_region)
                        latency = item.worker_latency_s
                        await stream.send(ResponseCompleted(msg.request_id, self.worker.id, item.cached_tokens,
                                                            item.prompt_tokens, item.completion_tokens,
                                                            item.finish_reason, vector,
                                                            -1.0 if latency is None else min(latency, MAX_WORKER_LATENCY_S)),
                                          end=True)
                        self.metrics.requests.labels("ok").inc()
                        if piggyback:
                            self._note_piggyback(msg.origin_region)
                        log_.info("served", cached=item.cached_tokens, claimed=msg.claimed_tokens,
                                  prompt=item.prompt_tokens, completion=item.completion_tokens)
                        return
        except EngineRejected as exc:
            # The request's own fault (a 4xx): the edge hands it to its client, no retry.
            self.metrics.requests.labels("rejected").inc()
            log_.info("engine rejected the request", status=exc.status, error=exc.message)
            with contextlib.suppress(TransportError):
                await stream.send(RequestRejected(msg.request_id, self.worker.id, exc.status, exc.message), end=True)
        except EngineError as exc:
            self.metrics.requests.labels("failed").inc()
            # A pair's decode half failed: name the decode worker, so the edge keeps this one.
            blamed = msg.decode_worker if isinstance(exc, DecodeFailed) else self.worker.id  # type: ignore[union-attr]
            log_.warning("engine failed the request", error=str(exc), produced=produced, worker=blamed)
            with contextlib.suppress(TransportError):
                await stream.send(RequestFailed(msg.request_id, blamed, str(exc)[:1000], not produced), end=True)
        except TransportError as exc:
            log_.warning("edge went away mid-response", error=str(exc))

    def _piggyback_for(self, origin_region: str) -> tuple[tuple[tuple[str, float], ...], bool]:
        """The queue vector a response to ``origin_region`` carries, and whether it is the
        region's (so the edges may skip their next broadcast there): the region's if fresh,
        else this worker's own reading alone; none to this region's own edge, which has it."""
        if origin_region == self.worker.region:
            return (), False
        if self.vector_interest.fresh(now=time.monotonic()):
            self._piggybacked["region"] += 1
            self.metrics.piggybacked_region.inc()
            return tuple(self.region_vector.items()), True
        self._piggybacked["own"] += 1
        self.metrics.piggybacked_own.inc()
        return ((self.worker.id, self.queue_ms),), False

    def _note_piggyback(self, to_region: str) -> None:
        """Tell this region's edges that ``to_region`` just got our queue vector."""
        note = PiggybackSent(self.worker.id, to_region)
        for peer in self._edge_peers.values():
            if peer.is_connected:
                try:
                    peer.send_datagram(note)
                except TransportError:
                    pass

    async def _migrate(self, msg: MigrationRequested) -> None:
        if msg.destination_worker != self.worker.id:
            log.warning("migration for another worker ignored", destination=msg.destination_worker)
            return
        # SGLang exposes no worker-to-worker KV copy; both modes recompute on this idle engine.
        record = {"request_id": msg.request_id, "source": msg.source_worker, "mode": msg.mode,
                  "tokens": len(msg.input_ids), "ok": False}
        # A prefill worker computes for nobody with SGLang's fake bootstrap host: cached, not sent.
        extra = ({"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": new_bootstrap_room()}
                 if self.worker.role == "prefill" else None)
        try:
            async for _ in self.engine.generate(msg.input_ids, {"max_new_tokens": 1}, stream=False,
                                                rid=f"migrate-{msg.request_id}", extra=extra):
                pass
            record["ok"] = True
            self.metrics.migrations.labels(msg.mode).inc()
        except EngineError as exc:
            record["error"] = str(exc)
        self.migrations.append(record)
        del self.migrations[:-100]
        log.info("migration executed", **record)

    def describe(self) -> dict:
        return {
            "mode": "agent",
            "worker": self.worker.id,
            "region": self.worker.region,
            "engine_up": self.engine_up,
            "queue_ms": self.queue_ms,
            "incarnation": self.incarnation,
            "registered_keys": len(self.tree.registered()),
            "engine_batches": getattr(getattr(self, "subscriber", None), "delivered", 0),
            "engine_replays": getattr(getattr(self, "subscriber", None), "replays", 0),
            "engine_restarts": getattr(getattr(self, "subscriber", None), "restarts", 0),
            "engine_odd_seqs": getattr(getattr(self, "subscriber", None), "odd_seqs", 0),
            "engine_ignored_messages": getattr(getattr(self, "subscriber", None), "ignored_messages", 0),
            "engine_last_seq": getattr(getattr(getattr(self, "subscriber", None), "tracker", None), "last_applied", None),
            "blocks": len(self.tree),
            "region_vector": self.region_vector,
            # how often its busy engine is read, and why (ReadingCadence)
            "reading_period_ms": round(self.reading_period[0] * 1000.0, 3),
            "reading_period_why": self.reading_period[1],
            # whether it asks its edges for that vector (while serving other regions), and the
            # age of the one it holds (None: none yet); a response piggybacks it while fresh
            "vector_wanted": self.vector_interest.wanted,
            "vector_age_s": self.vector_interest.age_s(now=time.monotonic()),
            "piggybacked": dict(self._piggybacked),
            "migrations": self.migrations[-20:],
        }
