"""``kvcompassd edge --workers N``: N front-door processes on one port sharing one copy of the view.

Process 0 is the edge daemon as ever (``SyncEdgeNode``, an ``EdgeNode``): it holds the QUIC
sessions to the maintenance units, the agents and the peer edges, runs the index sync into views
kept in shared memory (``kvcompassd.shared_view.SharedViewWriter``), answers admin queries, serves
metrics, and is one of the front doors. Processes 1..N-1 (``FrontDoorProcess``, started by process
0 as ``kvcompassd edge-frontdoor``) map those views read-only and serve HTTP on the same port:
every front door binds it with ``SO_REUSEPORT`` and the kernel spreads connections across them.
A front door forwards as process 0 does: own-region workers over HTTP, others through their agents
over its own QUIC connections (under the edge's identity).

Queue estimates and the pending ledger are PARTITIONED, not shared. What the edge learns from
outside (agents' load readings, peer edges' queue vectors, piggyback notes, which workers are
withheld or back) arrives at process 0, which applies it and copies it to every front door over a
control socket, so every process holds the same base readings. What a front door adds itself (the
charge of each dispatch until its first token and end, the pending ledger's credit for a prompt
until the view shows it, learned rates, the cache belief, tie rotation) stays in that process.
Why: sharing them would put a cross-process lock (or atomics on every score input) on each
decision's path, which is what N processes are for avoiding; and the kernel keeps a client's
keep-alive connection on one process, so the requests that most need the ledger (a conversation's
next turn on the same connection) meet their own process's credit. The cost is that each process
sees 1/N of the fresh charges between load readings (at most one broadcast period). With one
front door (or the same requests in the same order at one process), decisions are exactly those
of a single-process edge: tests/test_shared_view.py and tests/test_edge_workers.py.

Control frames (process 0 -> front door, msgpack lists over a SOCK_SEQPACKET socket pair):
``["load", worker, queue_ms, now, running]``, ``["vector", wire bytes, now]``,
``["piggyback", to_region, now]``, ``["withheld", [worker index...], checked]``,
``["back", worker, reason]``; front door -> process 0: ``["ready", pid]``. ``now`` is
``time.monotonic()``, one clock for every process of the host.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgpack
import structlog
from aiohttp import web

from kvcompassd.certs import TlsFiles
from kvcompassd.core.ablation import Ablation
from kvcompassd.core.config import ClusterConfig, EdgeConfig
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.daemon import daemon_transport, split_address
from kvcompassd.edge import EdgeNode
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.shared_view import SharedViewReader, SharedViewWriter, share_router_view
from kvcompassd.tokenizer import ByteTokenizer, Tokenizer
from kvcompassd.transport import ChannelInfo, Peer, QuicNode
from kvcompassd.wire import ErrorReported, NodeIdentity, QueueVectorBroadcast, Role, decode, encode

log = structlog.get_logger(__name__)

MAX_WORKERS = 64
MAX_FRAME = 64 * 1024
READY_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0


def _pack(*frame: Any) -> bytes:
    return msgpack.packb(list(frame), use_bin_type=True)


class _Fanout:
    """Process 0's ends of the control sockets: every frame to every live front door."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.dropped = 0

    def send(self, *frame: Any) -> None:
        data = _pack(*frame)
        for sock in list(self.sockets):
            try:
                sock.send(data)
            except BlockingIOError:
                # A front door that stopped reading: its readings repeat every broadcast period.
                self.dropped += 1
            except OSError as exc:
                log.warning("front door gone", error=str(exc))
                self.sockets.remove(sock)


class _QueueFanout:
    """Process 0's queue estimates, copying every reading it accepts to the front doors."""

    def __init__(self, queues: Any, fanout: _Fanout) -> None:
        self._queues = queues
        self._fanout = fanout
        # What every decision calls, bound here rather than found through __getattr__ each time.
        self.queue_ms = queues.queue_ms
        self.note_dispatched = queues.note_dispatched

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queues, name)

    def set_local(self, worker_id: str, queue_ms: float, *, now: float, running: int = 0) -> None:
        self._queues.set_local(worker_id, queue_ms, now=now, running=running)
        self._fanout.send("load", worker_id, float(queue_ms), now, int(running))

    def on_broadcast(self, msg: QueueVectorBroadcast, *, now: float) -> bool:
        taken = self._queues.on_broadcast(msg, now=now)  # raises on a bad vector: not copied
        self._fanout.send("vector", encode(msg), now)
        return taken

    def note_piggyback_sent(self, to_region: str, *, now: float) -> None:
        self._queues.note_piggyback_sent(to_region, now=now)
        self._fanout.send("piggyback", to_region, now)


QUEUE_FRAMES = frozenset({"load", "vector", "piggyback"})


def apply_queue_frame(queues: Any, frame: list, *, now: float) -> None:
    """Apply a reading process 0 copied (``_QueueFanout``) to a front door's queue estimates, at
    the time process 0 took it (never later than ``now``). ValueError for a frame that is not one."""
    kind = frame[0]
    if kind == "load":
        _, worker, queue_ms, at, running = frame
        queues.set_local(worker, queue_ms, now=min(at, now), running=running)
    elif kind == "vector":
        msg = decode(frame[1])
        if not isinstance(msg, QueueVectorBroadcast):
            raise ValueError(f"not a queue vector: {type(msg).__name__}")
        queues.on_broadcast(msg, now=min(frame[2], now))
    elif kind == "piggyback":
        queues.note_piggyback_sent(frame[1], now=min(frame[2], now))
    else:
        raise ValueError(f"not a queue frame: {kind!r}")


class SyncEdgeNode(EdgeNode):
    """Process 0 of ``edge --workers N``: the edge, its views in shared memory, N-1 more front doors."""

    def __init__(self, cfg: ClusterConfig, me: EdgeConfig, tls: TlsFiles, *, workers: int,
                 front_door_args: list[str], **kwargs: Any):
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be in [1, {MAX_WORKERS}], got {workers}")
        if workers > 1 and any(w.role != "mixed" for w in cfg.workers):
            # The decode chooser's loads are not copied to the front doors (yet).
            raise ValueError("--workers > 1 does not serve prefill-decode disaggregation yet")
        self.shared_view = SharedViewWriter(IndexLayout.from_config(cfg), cfg.shards, edge=me.id)
        try:
            super().__init__(cfg, me, tls, view=self.shared_view, reuse_port=True, **kwargs)
        except BaseException:
            self.shared_view.close()  # refused before it started: leave nothing in /dev/shm
            raise
        self.workers = workers
        self._front_door_args = list(front_door_args)
        self.fanout = _Fanout()
        self.router.queues = _QueueFanout(self.router.queues, self.fanout)
        self._withhold = self.router.withhold
        self.router.withhold = self._withhold_and_tell  # type: ignore[method-assign]
        self._children: dict[socket.socket, subprocess.Popen] = {}  # by control socket
        self._front_doors_ready = False
        self._stopping = False
        self.front_doors_restarted = 0

    def health(self) -> dict:
        # Ready once every front door serves too: a client's connection may land on any of them.
        body = super().health()
        body["ready"] = body["ready"] and self._front_doors_ready
        body["front_doors"] = self.workers
        return body

    def _withhold_and_tell(self, worker_index: int, withheld: bool = True) -> None:
        self._withhold(worker_index, withheld)
        self._send_withheld()

    def _withheld_frame(self) -> tuple:
        check = self.tokenizer_check
        checked = check is not None and check.settled.is_set()
        return "withheld", sorted(self.router.withheld), checked

    def _send_withheld(self) -> None:
        self.fanout.send(*self._withheld_frame())

    async def start(self) -> None:
        await super().start()
        back = self.forwarder.worker_back

        def worker_back(worker_id: str, why: str) -> None:
            back(worker_id, why)
            self.fanout.send("back", worker_id, why)

        self.forwarder.worker_back = worker_back  # type: ignore[method-assign]
        try:
            await self._start_front_doors()
        except BaseException:
            await self._stop_front_doors()
            raise
        self._tasks.append(asyncio.create_task(self._tell_when_checked()))

    async def _tell_when_checked(self) -> None:
        if self.tokenizer_check is not None:
            await self.tokenizer_check.settled.wait()
        self._send_withheld()

    async def _start_front_doors(self) -> None:
        ready = [self._spawn_front_door() for _ in range(self.workers - 1)]
        if ready:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await asyncio.gather(*ready)
        self._front_doors_ready = True
        log.info("front doors started", workers=self.workers, pids=self.front_door_pids(),
                 view_directory=self.shared_view.directory_name)

    def _spawn_front_door(self) -> asyncio.Future:
        """Start one front-door process; the future is done when it serves the port."""
        host, port = self.http_address
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "kvcompassd", "edge-frontdoor", *self._front_door_args,
                "--view-directory", self.shared_view.directory_name, "--control-fd", str(theirs.fileno()),
                "--http", f"{host}:{port}"]
        try:
            child = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.send(_pack(*self._withheld_frame()))  # what it waits for before serving (buffered until read)
        mine.setblocking(False)
        self._children[mine] = child
        ready = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(mine.fileno(), self._from_front_door, mine, ready)
        self.fanout.sockets.append(mine)
        return ready

    def _from_front_door(self, sock: socket.socket, ready: asyncio.Future) -> None:
        try:
            data = sock.recv(MAX_FRAME)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            frame = msgpack.unpackb(data, raw=False)
            if frame and frame[0] == "ready" and not ready.done():
                ready.set_result(frame[1])
                self._send_withheld()  # anything that changed while it started
            return
        # The front door exited: its socket left the port's group, the others keep serving.
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        if sock in self.fanout.sockets:
            self.fanout.sockets.remove(sock)
        child = self._children.pop(sock, None)
        sock.close()
        if not ready.done():
            ready.set_exception(RuntimeError("a front door exited before it was ready"))
            return
        if self._stopping:
            return
        log.warning("a front door exited: starting another", pid=child.pid if child else None)
        self.front_doors_restarted += 1
        self._tasks.append(asyncio.create_task(self._replace_front_door(child)))

    async def _replace_front_door(self, gone: subprocess.Popen | None) -> None:
        if gone is not None:  # reap it (it closed its control socket: it is exiting)
            try:
                await asyncio.wait_for(asyncio.to_thread(gone.wait), timeout=20)
            except TimeoutError:
                gone.kill()
            log.info("front door reaped", pid=gone.pid, exit_code=gone.returncode)
        await asyncio.sleep(RESTART_DELAY_S)  # a front door that dies at once does not spin
        if self._stopping:
            return
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await self._spawn_front_door()
        except (TimeoutError, RuntimeError, OSError) as exc:
            log.error("a replacement front door did not start", error=str(exc))

    async def _stop_front_doors(self) -> None:
        self._stopping = True
        loop = asyncio.get_running_loop()
        for sock in list(self._children):
            try:
                loop.remove_reader(sock.fileno())
            except (ValueError, OSError):
                pass
        children = list(self._children.values())
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                await asyncio.wait_for(asyncio.to_thread(child.wait), timeout=20)
            except TimeoutError:
                child.kill()
        for sock in list(self._children):
            sock.close()
        self._children.clear()
        self.fanout.sockets.clear()

    async def stop(self) -> None:
        try:
            await self._stop_front_doors()
            await super().stop()
        finally:
            self.shared_view.close()

    def status(self) -> str:
        return f"{super().status()}, {self.workers} front doors"

    def front_door_pids(self) -> list[int]:
        return [c.pid for c in self._children.values()]


class FrontDoorProcess:
    """Front door 1..N-1 of ``edge --workers N``: decides over the mapped views, forwards."""

    def __init__(self, cfg: ClusterConfig, me: EdgeConfig, tls: TlsFiles, *, view_directory: str,
                 control: socket.socket, http_address: str, tokenizer: Tokenizer | None = None,
                 frontdoor: FrontDoorSettings | None = None, local_http: bool = True,
                 ablation: Ablation | None = None):
        self.cfg = cfg
        self.me = me
        self.clock = time.monotonic
        self.layout = IndexLayout.from_config(cfg)
        self.view = SharedViewReader(self.layout, cfg.shards, view_directory, edge=me.id)
        self.router = Router(cfg, me.region, self.view, now=self.clock(), ablation=ablation)
        share_router_view(self.router, self.view)
        for i in range(len(self.layout.worker_ids)):  # until process 0 says which workers it verified
            self.router.withhold(i)
        self.metrics = EdgeMetrics()
        self.node = QuicNode(NodeIdentity(Role.EDGE, me.id), tls, on_message=self._on_message,
                             options=daemon_transport(cfg))
        self.tokenizer = tokenizer or ByteTokenizer()
        self.frontdoor_settings = frontdoor or FrontDoorSettings(model=cfg.model)
        self.local_http = local_http
        self.control = control
        self.http_address_arg = http_address
        self._agent_peers: dict[str, Peer] = {}
        self._state_received = asyncio.Event()
        self._checked = False
        self._runner: web.AppRunner | None = None
        self.http_address: tuple[str, int] | None = None
        self._http: WorkerConnections | None = None
        self.forwarder: Forwarder | None = None

    async def start(self) -> None:
        self.control.setblocking(False)
        asyncio.get_running_loop().add_reader(self.control.fileno(), self._on_control)
        for w in self.cfg.workers:
            # Requests reach own-region workers over HTTP: their agents are dialed only when a
            # migration names one (no idle QUIC session per front door and agent for nothing).
            if w.agent and (w.region != self.me.region or not self.local_http):
                self._agent_peer(w.id)
        self._http = WorkerConnections()
        self.forwarder = Forwarder(self.me.id, self.router, self._agent_peer, self._http, clock=self.clock,
                                   metrics=self.metrics, local_http=self.local_http)
        async with asyncio.timeout(READY_TIMEOUT_S):
            await self._state_received.wait()  # the withheld workers, before any request is decided
        guard = FrontDoorGuard(self.cfg.frontdoor, self.metrics)
        self.frontdoor = FrontDoor(self.forwarder, self.tokenizer, self.frontdoor_settings, self.metrics,
                                   health=self.health, guard=guard)
        self._runner = guard.runner(self.frontdoor.app)
        await self._runner.setup()
        host, port = split_address(self.http_address_arg, "--http")
        site = web.TCPSite(self._runner, host, port, reuse_port=True)
        await site.start()
        self.http_address = site._server.sockets[0].getsockname()[:2]
        self.control.send(_pack("ready", os.getpid()))
        log.info("front door started", http=self.http_address, view_directory=self.view.directory_name)

    async def stop(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.control.fileno())
        except (ValueError, OSError):
            pass
        if self._runner is not None:
            await self._runner.cleanup()
        if self.forwarder is not None:
            await self.forwarder.close()
        if self._http is not None:
            await self._http.close()
        await self.node.close()

    def _agent_peer(self, worker_id: str) -> Peer | None:
        peer = self._agent_peers.get(worker_id)
        if peer is None:
            try:
                worker = self.cfg.worker(worker_id)
            except (KeyError, ValueError):
                return None
            if not worker.agent:
                return None
            peer = self._agent_peers[worker_id] = self.node.peer(split_address(worker.agent, worker_id),
                                                                 expected_role=Role.AGENT, expected_id=worker_id)
        return peer

    def status(self) -> str:
        return f"front door of edge {self.me.id}, pid {os.getpid()}"

    def health(self) -> dict:
        shards_ready = sum(self.view.position(s)[1] >= 0 for s in range(self.cfg.shards))
        return {"ready": self.view.ready and self._checked, "edge": self.me.id, "region": self.me.region,
                "shards_ready": shards_ready, "shards": self.cfg.shards, "tokenizer_checked": self._checked,
                "front_door": os.getpid()}

    def _on_message(self, peer: Peer, message: Any, channel: ChannelInfo) -> None:
        # Agents answer this process's forwarded requests on their streams; nothing else is for it.
        log.warning("message refused by a front door", peer=str(peer.identity), type=type(message).__name__)
        try:
            peer.send_encoded(encode(ErrorReported("forbidden", "a front door process accepts no messages")))
        except Exception:  # noqa: BLE001 - the peer may be gone; nothing to do about it
            pass

    def _on_control(self) -> None:
        while True:
            try:
                data = self.control.recv(MAX_FRAME)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # process 0 is gone: so is this front door
                asyncio.get_running_loop().remove_reader(self.control.fileno())
                log.warning("edge process gone: stopping this front door")
                os.kill(os.getpid(), signal.SIGTERM)
                return
            try:
                self.apply_control(msgpack.unpackb(data, raw=False))
            except (ValueError, TypeError, IndexError, KeyError) as exc:
                log.warning("control frame refused", error=str(exc))

    def apply_control(self, frame: list) -> None:
        kind = frame[0]
        if kind in QUEUE_FRAMES:
            apply_queue_frame(self.router.queues, frame, now=self.clock())
        elif kind == "withheld":
            withheld, self._checked = set(frame[1]), bool(frame[2])
            for i in range(len(self.layout.worker_ids)):
                if (i in withheld) != (i in self.router.withheld):
                    self.router.withhold(i, i in withheld)
            self._state_received.set()
        elif kind == "back":
            if self.forwarder is not None:
                self.forwarder.worker_back(frame[1], frame[2])
        else:
            raise ValueError(f"unknown control frame {kind!r}")
