"""``kvcompassd edge --workers N``: N front-door processes on one port sharing one copy of the view.

Process 0 is the edge daemon as ever (``SyncEdgeNode``, an ``EdgeNode``): it holds the QUIC
sessions to the maintenance units, the agents and the peer edges, runs the index sync into views
kept in shared memory (``kvcompassd.shared_view.SharedViewWriter``), answers admin queries, serves
metrics, and is one of the front doors. Processes 1..N-1 (``FrontDoorProcess``, started by process
0 as ``kvcompassd edge-frontdoor``) map those views read-only and serve HTTP on the same port:
every front door binds it with ``SO_REUSEPORT`` and the kernel spreads connections across them.
A front door forwards as process 0 does: own-region workers over HTTP, others through their agents
over its own QUIC connections (under the edge's identity).

Queue readings, dispatch charges and the pending ledger are SHARED; learned rates, the cache
belief and tie rotation are each process's own. What the edge learns from outside (agents' load
readings, peer edges' queue vectors, piggyback notes, which workers are withheld or back) arrives
at process 0, which applies it and copies it to every front door over a control socket, so every
process holds the same base readings. What a decision adds (the charge of its dispatch until its
first token and end, ``SharedCharges``; the ledger's credit of its prompt until the views show
it, and what becomes of it, ``SharedLedger``) goes from the process that made it to all the
others (a front door's through process 0, which applies it too and passes it on). So a decision
anywhere sees every request of the edge, as a single-process edge's would, a control frame
later: tens of microseconds for a charge or a credit, up to ``FRAME_LAG_S`` (5 ms) for news that
only lowers a charge or settles a credit and for a copied reading (``FrameBatch``).
Partitioned, each process saw 1/N of the fresh charges and credits between readings: a burst
spread over the processes could herd onto a worker each saw idle, and a prompt one process had
just sent was sent elsewhere by another.

Learned rates and the belief stay per process: each learns from the responses it sees, which
the kernel's spreading of connections makes a sample of the same traffic. With one front door
(or the same requests in the same order at one process), decisions are exactly those of a
single-process edge: tests/test_shared_view.py and tests/test_edge_workers.py.

A prefill-decode fleet runs the same way: every front door picks the prefill worker by the score
and a decode worker of its region by the decode chooser (``core/decode_choice.py``), whose
reported loads process 0 copies like the queue readings; each process counts its own requests in
flight and avoids for a while a decode worker that failed one of its own requests (another
process learns it on its first failure there and retries the request on another decode worker).
Bootstrap rooms are drawn from a per-process random source seeded by the OS, 63 bits as SGLang's
router draws them, so two processes' rooms collide no more than two requests' in one process.

Metrics: every front door keeps its counters and histograms in process memory and copies them
each second (and before answering ``/metrics``, and when it stops) into files in a directory of
the edge's (prometheus_client's multiprocess format), which process 0 merges with its own at every
scrape; a front door answers ``/metrics`` with process 0's merged text
(``kvcompassd/metrics_front_doors.py``; a killed front door loses at most a second of counts).

Control frames (process 0 -> front door, msgpack lists over a SOCK_SEQPACKET socket pair; frames
go back to back in one datagram at the end of the event loop's pass that made a charge or a
credit, or ``FRAME_LAG_S`` after the first of the others, ``FrameBatch``):
``["load", worker, queue_ms, now, running]``, ``["vector", wire bytes, now]``,
``["piggyback", to_region, now]``, ``["room", worker, [[ms, free tokens]...], now]``,
``["room_vector", wire bytes, now]``, ``["pinned", worker, share]``, ``["withheld", [worker index...], checked]``,
``["back", worker, reason]``, ``["decode_load", worker, running, waiting]`` (a decode worker's
reading, for the decode chooser of a prefill-decode fleet), ``["metrics", asked, last, text bytes]``
(one chunk of the edge's metrics); front door -> process 0: ``["ready", pid]``,
``["metrics?", asked]``; both ways, the frames of ``SharedCharges`` and ``SharedLedger``. ``now`` is
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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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
from kvcompassd.http_server import Request, Response
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.metrics_front_doors import (PUBLISH_PERIOD_S, BufferedMetricValues, EdgeWideRegistry,
                                            FrontDoorMetricsDirectory, FrontDoorPublisher)
from kvcompassd.shared_view import SEGMENT_DIR, SharedViewReader, SharedViewWriter, share_router_view
from kvcompassd.tokenizer import ByteTokenizer, Tokenizer
from kvcompassd.transport import ChannelInfo, Peer, QuicNode
from kvcompassd.wire import ErrorReported, NodeIdentity, QueueVectorBroadcast, Role, RoomVectorBroadcast, decode, encode

log = structlog.get_logger(__name__)

MAX_WORKERS = 64
MAX_FRAME = 64 * 1024
METRICS_CHUNK = 48 * 1024  # of the metrics text per control frame (inside MAX_FRAME)
METRICS_TIMEOUT_S = 10.0
DROP_CHECK_S = 1.0
CONTROL_BUFFER_BYTES = 4 << 20
READY_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0


def _pack(*frame: Any) -> bytes:
    return msgpack.packb(list(frame), use_bin_type=True)


def unpack_frames(data: bytes):
    """The frames of one control datagram, in order: (frame, its packed bytes) for each. A
    datagram holds one frame or several back to back (``FrameBatch``); a malformed one raises
    ``msgpack.UnpackException`` (or ValueError) where it stops making sense, after the frames
    before it were yielded."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME)
    unpacker.feed(data)
    start = 0
    for frame in unpacker:
        end = unpacker.tell()
        yield frame, data[start:end]
        start = end
    if start != len(data):
        raise ValueError(f"a control datagram ends inside a frame ({len(data) - start} bytes left)")


# What applying a well-formed frame with wrong contents raises (an unknown worker, a bad charge).
FRAME_ERRORS = (ValueError, TypeError, IndexError, KeyError, OverflowError)


def handle_frames(data: bytes, handle: Any, refused: str) -> None:
    """Each frame of one control datagram to ``handle(frame, packed)``, in order: a frame it
    refuses (``FRAME_ERRORS``) is logged as ``refused`` and the next one goes on; a malformed
    datagram is logged where it stops making sense."""
    try:
        for frame, packed in unpack_frames(data):
            try:
                handle(frame, packed)
            except FRAME_ERRORS as exc:
                log.warning(refused, error=str(exc))
    except (ValueError, msgpack.UnpackException) as exc:
        log.warning(refused, error=str(exc))


class FrameBatch:
    """The frames a process sends one control socket, back to back in one datagram. A frame that
    keeps the other processes from sending a burst onto one worker (a charge, a ledger credit,
    what is withheld) goes at the end of the event loop's pass that made it, with everything
    queued before it; one that only brings later news (``LAGGING_FRAMES``: a charge retired, a
    credit turned ready or refuted, a reading copied) waits up to ``lag`` seconds for one of
    those, or goes alone then. A full datagram (``MAX_FRAME``) goes at once. Each datagram wakes
    the other process and costs a send and a receive: one per frame was most of what sharing
    cost (README, ``edge --workers N``), and one per pass still sent a request's charge, its
    first token and its end apart. ``send(data, frames)`` sends a datagram of ``frames`` frames."""

    __slots__ = ("_send", "_parts", "_size", "_scheduled", "_timer")

    def __init__(self, send: Any) -> None:
        self._send = send
        self._parts: list[bytes] = []
        self._size = 0
        self._scheduled = False  # a flush at the end of this pass
        self._timer: asyncio.TimerHandle | None = None  # a flush when the lag is up

    def add(self, packed: bytes, *, lag: float = 0.0) -> None:
        if self._parts and self._size + len(packed) > MAX_FRAME:
            self.flush()
        self._parts.append(packed)
        self._size += len(packed)
        if self._scheduled or (lag > 0.0 and self._timer is not None):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (outside the event loop: nothing to wait for)
            self.flush()
            return
        if lag > 0.0:
            self._timer = loop.call_later(lag, self.flush)
        else:
            self._scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        parts = self._parts
        if not parts:
            return
        self._parts, self._size = [], 0
        self._send(parts[0] if len(parts) == 1 else b"".join(parts), len(parts))


class _Fanout:
    """Process 0's ends of the control sockets: every frame to every live front door, in one
    ``FrameBatch`` per socket."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self._batches: dict[socket.socket, FrameBatch] = {}
        self.dropped = 0

    def send(self, *frame: Any, but: socket.socket | None = None) -> None:
        self.send_packed(_pack(*frame), but=but, lag=frame_lag(frame[0]))

    def send_packed(self, packed: bytes, *, but: socket.socket | None = None, lag: float = 0.0) -> None:
        """A frame already packed (one relayed from a front door) to every front door but
        ``but``, within ``lag`` seconds (``FrameBatch``)."""
        for sock in self.sockets:
            if sock is not but:
                batch = self._batches.get(sock)
                if batch is None:
                    batch = self._batches[sock] = FrameBatch(lambda data, frames, sock=sock: self._write(sock, data, frames))
                batch.add(packed, lag=lag)

    def remove(self, sock: socket.socket) -> None:
        """A front door gone: nothing more to it (what its batch held is dropped)."""
        if sock in self.sockets:
            self.sockets.remove(sock)
        self._batches.pop(sock, None)

    def _write(self, sock: socket.socket, data: bytes, frames: int) -> None:
        if sock not in self.sockets:
            return
        try:
            sock.send(data)
        except BlockingIOError:
            # A front door that stopped reading: its readings repeat every broadcast period.
            self.dropped += frames
        except OSError as exc:
            log.warning("front door gone", error=str(exc))
            self.remove(sock)


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

    def on_room_broadcast(self, msg: RoomVectorBroadcast, *, now: float) -> bool:
        taken = self._queues.on_room_broadcast(msg, now=now)  # raises on a bad one: not copied
        self._fanout.send("room_vector", encode(msg), now)
        return taken

    def set_room(self, worker_id: str, steps: Any, *, now: float) -> None:
        self._queues.set_room(worker_id, steps, now=now)  # raises on bad steps: not copied
        self._fanout.send("room", worker_id, [[float(ms), int(free)] for ms, free in steps], now)

    def set_pinned(self, worker_id: str, share: float) -> None:
        self._queues.set_pinned(worker_id, share)  # raises on a bad share: not copied
        self._fanout.send("pinned", worker_id, float(share))


QUEUE_FRAMES = frozenset({"load", "vector", "piggyback", "room", "room_vector", "pinned"})
CHARGE_FRAMES = frozenset({"charge", "first_token", "retired"})
LEDGER_FRAMES = frozenset({"credit", "ready", "refute", "drop", "forget"})
# Frames the other processes may hear of up to FRAME_LAG_S late (FrameBatch): a charge that goes
# leaves them a queue a few milliseconds too long; a reading copied is a few milliseconds older
# (the agents read every 20 ms at the fastest). A charge and a credit go at the end of the pass.
LAGGING_FRAMES = frozenset({"first_token", "retired", "ready", "refute", "drop", "forget", "decode_load"}
                           | QUEUE_FRAMES)
FRAME_LAG_S = 0.005


def frame_lag(kind: Any) -> float:
    """How long a frame of ``kind`` may wait for others to share its datagram."""
    return FRAME_LAG_S if kind in LAGGING_FRAMES else 0.0


# Other processes' dispatches whose charge this process holds (one per request in flight at
# them); beyond it the oldest are forgotten, as QueueEstimates forgets its own.
MAX_SHARED_CHARGES = 1 << 14


class SharedCharges:
    """Queue estimates whose dispatch charges every process of the edge holds: each charge this
    process makes (``note_dispatched``) and each retirement (its request's first token, its end)
    goes out as a frame (``send``), and the other processes' frames are applied here
    (``apply_frame``) as if this process had made them, at the time their process did. So the
    queue a decision sees holds every request the edge sent, whichever process sent it, less
    what is still on its way (a control frame, tens of microseconds), and the herd factor of a
    remote region is measured against all of the edge's sends (it is the edge's WAN traffic).
    Sans-IO: the frames are ``("charge", origin, handle, worker, ms, now)``,
    ``("first_token", origin, handle, now)`` and ``("retired", origin, handle, now)``."""

    def __init__(self, queues: Any, send: Any, *, origin: int) -> None:
        self._queues = queues
        self._send = send
        self.origin = origin
        self.queue_ms = queues.queue_ms  # what every decision calls, bound once
        self._charged: set[int] = set()  # own handles whose charge went out
        self._theirs: OrderedDict[tuple[int, int], int] = OrderedDict()  # (origin, handle) -> own handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queues, name)

    def note_dispatched(self, worker_id: str, added_ms: float, *, now: float) -> int:
        handle = self._queues.note_dispatched(worker_id, added_ms, now=now)
        if added_ms:  # a zero charge changes nothing anywhere
            if len(self._charged) >= MAX_SHARED_CHARGES:
                self._charged.clear()  # a shell that lost track of its requests: start over
            self._charged.add(handle)
            self._send(("charge", self.origin, handle, worker_id, float(added_ms), float(now)))
        return handle

    def retire_prefill(self, handle: int, *, now: float) -> float:
        left = self._queues.retire_prefill(handle, now=now)
        if handle in self._charged:
            self._send(("first_token", self.origin, handle, float(now)))
        return left

    def retire(self, handle: int, *, now: float) -> None:
        self._queues.retire(handle, now=now)
        if handle in self._charged:
            self._charged.discard(handle)
            self._send(("retired", self.origin, handle, float(now)))

    def apply_frame(self, frame: Sequence[Any], *, now: float) -> None:
        """Another process's charge or retirement, at the time it made it (never after ``now``).
        ValueError for a frame that is not one (an unknown worker, a bad charge)."""
        kind, origin, handle = frame[0], int(frame[1]), int(frame[2])
        key = (origin, handle)
        if kind == "charge":
            _, _, _, worker, added, at = frame
            theirs = self._theirs
            if len(theirs) >= MAX_SHARED_CHARGES:
                theirs.popitem(last=False)
            theirs[key] = self._queues.note_dispatched(worker, float(added), now=min(float(at), now))
        elif kind == "first_token":
            mine = self._theirs.get(key)
            if mine is not None:
                self._queues.retire_prefill(mine, now=min(float(frame[3]), now))
        elif kind == "retired":
            mine = self._theirs.pop(key, None)
            if mine is not None:
                self._queues.retire(mine, now=min(float(frame[3]), now))
        else:
            raise ValueError(f"not a charge frame: {kind!r}")


class SharedLedger:
    """The pending ledger (``core/pending.py``) every process of the edge holds alike: each
    prompt this process notes as sent (its query keys, a few dozen), and what becomes of the
    dispatch (its first token, a response that refutes credits, its end, a worker that failed),
    goes out as a frame (``send``); the other processes' frames are applied here
    (``apply_frame``) under dispatch ids of their own (negative: never one of this process's
    queue handles). So a prompt sent by one process is credited to its worker by every process
    until the views show it. ``refuted`` counts this process's refutations only (the edge's
    metric sums the processes'). Sans-IO: ``("credit", origin, dispatch, worker, keys,
    prompt_len, shown, starts_at, ready_at, now)``, ``("ready", origin, dispatch, now)``, ``("refute",
    origin, dispatch, reused)``, ``("drop", origin, dispatch)``, ``("forget", origin, worker)``."""

    def __init__(self, pending: Any, send: Any, *, origin: int) -> None:
        self._pending = pending
        self._send = send
        self.origin = origin
        self.overlay = pending.overlay  # what every decision calls, bound once
        self._theirs: OrderedDict[tuple[int, int], int] = OrderedDict()  # (origin, dispatch) -> id here
        self._next_id = -1
        self._their_refuted = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pending, name)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def refuted(self) -> int:
        return self._pending.refuted - self._their_refuted

    def note_sent(self, worker: int, keys: np.ndarray, prompt_len: int, shown: int, *, ready_at: float,
                  now: float, dispatch: int | None = None, starts_at: float | None = None) -> int:
        noted = self._pending.note_sent(worker, keys, prompt_len, shown, ready_at=ready_at, now=now,
                                        dispatch=dispatch, starts_at=starts_at)
        self._send(("credit", self.origin, -1 if dispatch is None else dispatch, worker, keys.tolist(),
                    int(prompt_len), int(shown), float(ready_at if starts_at is None else starts_at),
                    float(ready_at), float(now)))
        return noted

    def mark_ready(self, dispatch: int, *, now: float) -> bool:
        self._send(("ready", self.origin, dispatch, float(now)))
        return self._pending.mark_ready(dispatch, now=now)

    def refute(self, dispatch: int, reused_tokens: int) -> int:
        self._send(("refute", self.origin, dispatch, int(reused_tokens)))
        return self._pending.refute(dispatch, reused_tokens)

    def drop_dispatch(self, dispatch: int) -> None:
        self._send(("drop", self.origin, dispatch))
        self._pending.drop_dispatch(dispatch)

    def forget(self, worker: int) -> int:
        self._send(("forget", self.origin, int(worker)))
        return self._pending.forget(worker)

    def apply_frame(self, frame: Sequence[Any], *, now: float) -> None:
        """Another process's ledger change, at the time it made it (never after ``now``).
        ValueError (or TypeError, IndexError) for a frame that is not one."""
        kind, origin = frame[0], int(frame[1])
        pending = self._pending
        if kind == "forget":
            worker = int(frame[2])
            if not 0 <= worker < len(pending._worker_lengths):
                raise ValueError(f"no worker {worker}")
            pending.forget(worker)
            return
        key = (origin, int(frame[2]))
        if kind == "credit":
            _, _, sent, worker, keys, prompt_len, shown, starts_at, ready_at, at = frame
            if not 0 <= int(worker) < len(pending._worker_lengths):
                raise ValueError(f"no worker {worker}")
            dispatch = None
            if sent >= 0:
                dispatch = self._next_id
                self._next_id -= 1
                theirs = self._theirs
                if len(theirs) >= MAX_SHARED_CHARGES:
                    theirs.popitem(last=False)
                theirs[key] = dispatch
            at = min(float(at), now)
            ready_at = max(float(ready_at), at)
            pending.note_sent(int(worker), np.asarray(keys, dtype=np.uint64), int(prompt_len), int(shown),
                              starts_at=min(max(float(starts_at), at), ready_at), ready_at=ready_at, now=at,
                              dispatch=dispatch)
        elif kind == "ready":
            dispatch = self._theirs.get(key)
            if dispatch is not None:
                pending.mark_ready(dispatch, now=min(float(frame[3]), now))
        elif kind == "refute":
            dispatch = self._theirs.pop(key, None)
            if dispatch is not None:
                self._their_refuted += pending.refute(dispatch, int(frame[3]))
        elif kind == "drop":
            dispatch = self._theirs.pop(key, None)
            if dispatch is not None:
                pending.drop_dispatch(dispatch)
        else:
            raise ValueError(f"not a ledger frame: {kind!r}")


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
    elif kind == "room":
        _, worker, steps, at = frame
        queues.set_room(worker, tuple((ms, free) for ms, free in steps), now=min(at, now))
    elif kind == "room_vector":
        msg = decode(frame[1])
        if not isinstance(msg, RoomVectorBroadcast):
            raise ValueError(f"not a room vector: {type(msg).__name__}")
        queues.on_room_broadcast(msg, now=min(frame[2], now))
    elif kind == "pinned":
        _, worker, share = frame
        queues.set_pinned(worker, share)
    else:
        raise ValueError(f"not a queue frame: {kind!r}")


class SyncEdgeNode(EdgeNode):
    """Process 0 of ``edge --workers N``: the edge, its views in shared memory, N-1 more front doors."""

    def __init__(self, cfg: ClusterConfig, me: EdgeConfig, tls: TlsFiles, *, workers: int,
                 front_door_args: list[str], **kwargs: Any):
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be in [1, {MAX_WORKERS}], got {workers}")
        self.shared_view = SharedViewWriter(IndexLayout.from_config(cfg), cfg.shards, edge=me.id)
        self.front_door_metrics = FrontDoorMetricsDirectory(SEGMENT_DIR / f"{self.shared_view.prefix}-metrics")
        try:
            super().__init__(cfg, me, tls, view=self.shared_view, reuse_port=True, **kwargs)
        except BaseException:
            self.shared_view.close()  # refused before it started: leave nothing in /dev/shm
            self.front_door_metrics.close()
            raise
        # What the metrics port and /metrics serve: this process's metrics and every front door's.
        self.metrics.registry = EdgeWideRegistry(self.metrics.registry, self.front_door_metrics)
        self.workers = workers
        self._front_door_args = list(front_door_args)
        self.fanout = _Fanout()
        self.router.queues = SharedCharges(_QueueFanout(self.router.queues, self.fanout),
                                           lambda frame: self.fanout.send(*frame), origin=0)
        if self.router.pending is not None:
            self.router.pending = SharedLedger(self.router.pending, lambda frame: self.fanout.send(*frame), origin=0)
        self._withhold = self.router.withhold
        self.router.withhold = self._withhold_and_tell  # type: ignore[method-assign]
        self._children: dict[socket.socket, subprocess.Popen] = {}  # by control socket
        self._front_doors_ready = False
        self._metrics_sends: set[asyncio.Task] = set()
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
        chooser = self.forwarder.decode_chooser
        if chooser is not None:  # a prefill-decode fleet: every front door chooses decode workers
            reported = chooser.load_reported

            def decode_load_reported(worker: str, running: int, waiting: int) -> None:
                reported(worker, running, waiting)
                self.fanout.send("decode_load", worker, int(running), int(waiting))

            chooser.load_reported = decode_load_reported  # type: ignore[method-assign]
        try:
            await self._start_front_doors()
        except BaseException:
            await self._stop_front_doors()
            raise
        self._tasks.append(asyncio.create_task(self._tell_when_checked()))
        self._tasks.append(asyncio.create_task(self._repair_after_drops()))

    async def _tell_when_checked(self) -> None:
        if self.tokenizer_check is not None:
            await self.tokenizer_check.settled.wait()
        self._send_withheld()

    async def _repair_after_drops(self) -> None:
        """A front door that stopped reading for a while loses frames (``_Fanout``): readings,
        charges and credits it lost are replaced by the next ones, but which workers are withheld
        is said only on a change, so it is said again after any loss."""
        dropped = 0
        while True:
            await asyncio.sleep(DROP_CHECK_S)
            if self.fanout.dropped != dropped:
                log.warning("control frames dropped by a front door that did not read",
                            frames=self.fanout.dropped - dropped)
                dropped = self.fanout.dropped
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
        env.update(self.front_door_metrics.environment())
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (mine, theirs):
            # Six frames a request each way plus the readings: room for a front door that is not
            # scheduled for a while (the kernel caps it at net.core.wmem_max).
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CONTROL_BUFFER_BYTES)
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
            handle_frames(data, lambda frame, packed: self._from_front_door_frame(sock, ready, frame, packed),
                          "front door frame refused")
            self.wake_broadcasts()  # if a front door's long prompt made them urgent: the other regions hear now
            return
        # The front door exited: its socket left the port's group, the others keep serving.
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        self.fanout.remove(sock)
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

    def _from_front_door_frame(self, sock: socket.socket, ready: asyncio.Future, frame: Any, packed: bytes) -> None:
        """One frame from a front door."""
        kind = frame[0] if frame.__class__ is list and frame else None
        if kind == "ready" and not ready.done():
            ready.set_result(frame[1])
            self._send_withheld()  # anything that changed while it started
        elif kind in CHARGE_FRAMES:
            # A front door's charge: held here too, and passed on to the other front doors.
            self.router.queues.apply_frame(frame, now=self.clock())
            self.fanout.send_packed(packed, but=sock, lag=frame_lag(kind))
        elif kind in LEDGER_FRAMES and self.router.pending is not None:
            self.router.pending.apply_frame(frame, now=self.clock())
            self.fanout.send_packed(packed, but=sock, lag=frame_lag(kind))
        elif kind == "metrics?":
            task = asyncio.create_task(self._send_metrics(sock, int(frame[1])))
            self._metrics_sends.add(task)
            task.add_done_callback(self._metrics_sends.discard)

    async def _send_metrics(self, sock: socket.socket, asked: int) -> None:
        """The edge's metrics (this process's and every front door's) to the front door that
        was asked for /metrics, in chunks that fit a control frame."""
        text = generate_latest(self.metrics.registry)
        loop = asyncio.get_running_loop()
        chunks = [text[i:i + METRICS_CHUNK] for i in range(0, len(text), METRICS_CHUNK)] or [b""]
        try:
            for k, chunk in enumerate(chunks):
                await loop.sock_sendall(sock, _pack("metrics", asked, k == len(chunks) - 1, chunk))
        except OSError as exc:
            log.warning("metrics not sent to a front door", error=str(exc))

    async def _replace_front_door(self, gone: subprocess.Popen | None) -> None:
        if gone is not None:  # reap it (it closed its control socket: it is exiting)
            try:
                await asyncio.wait_for(asyncio.to_thread(gone.wait), timeout=20)
            except TimeoutError:
                gone.kill()
                await asyncio.to_thread(gone.wait)
            log.info("front door reaped", pid=gone.pid, exit_code=gone.returncode)
            # It writes no more: its counts stay in the edge's totals once, its live gauges go.
            self.front_door_metrics.retire(gone.pid)
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
        for task in list(self._metrics_sends):
            task.cancel()
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
            self.front_door_metrics.close()

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
        self.router.queues = SharedCharges(self.router.queues, self._send_to_edge, origin=os.getpid())
        if self.router.pending is not None:
            self.router.pending = SharedLedger(self.router.pending, self._send_to_edge, origin=os.getpid())
        self.charge_frames_dropped = 0
        self._to_edge = FrameBatch(self._write_to_edge)
        for i in range(len(self.layout.worker_ids)):  # until process 0 says which workers it verified
            self.router.withhold(i)
        # Before any metric is made: this process's values, published to the edge's directory.
        self.metric_values = BufferedMetricValues.from_environment()
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
        self.frontdoor: FrontDoor | None = None
        self.http_address: tuple[str, int] | None = None
        self._http: WorkerConnections | None = None
        self.forwarder: Forwarder | None = None
        self.publisher: FrontDoorPublisher | None = None
        self._metrics_asked = 0
        self._metrics_answer: asyncio.Future | None = None
        self._metrics_chunks: list[bytes] = []

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
        self.frontdoor = _OneOfManyFrontDoors(self.forwarder, self.tokenizer, self.frontdoor_settings, self.metrics,
                                              health=self.health, guard=guard, edge_metrics=self.edge_metrics)
        self.publisher = FrontDoorPublisher(self.metrics, lambda: self.router.hot.hot_misses, self.metric_values)
        if self.metric_values is not None:  # the edge reads this process's metrics from its files
            self._publishing = asyncio.create_task(self._publish_metrics())
        host, port = split_address(self.http_address_arg, "--http")
        self.http_address = await self.frontdoor.serve(host, port, reuse_port=True)
        self.control.send(_pack("ready", os.getpid()))
        log.info("front door started", http=self.http_address, view_directory=self.view.directory_name)

    async def _publish_metrics(self) -> None:
        while True:
            self.publisher.publish()
            await asyncio.sleep(PUBLISH_PERIOD_S)

    async def edge_metrics(self) -> bytes:
        """The edge's metrics text, as process 0 merges them (this process's, fresh, among them).
        Concurrent asks share one answer."""
        answer = self._metrics_answer
        if answer is None or answer.done():
            if self.publisher is not None:
                self.publisher.publish()
            self._metrics_asked += 1
            self._metrics_chunks = []
            answer = self._metrics_answer = asyncio.get_running_loop().create_future()
            await asyncio.get_running_loop().sock_sendall(self.control, _pack("metrics?", self._metrics_asked))
        try:
            async with asyncio.timeout(METRICS_TIMEOUT_S):
                return await asyncio.shield(answer)
        except TimeoutError:
            if not answer.done():  # every waiter gives up; the next scrape asks again
                answer.set_exception(TimeoutError("the edge process did not answer for its metrics"))
            raise

    def _metrics_chunk(self, asked: int, last: bool, chunk: bytes) -> None:
        answer = self._metrics_answer
        if answer is None or answer.done() or asked != self._metrics_asked:
            return  # an answer nobody waits for any more
        self._metrics_chunks.append(bytes(chunk))
        if last:
            answer.set_result(b"".join(self._metrics_chunks))
            self._metrics_chunks = []

    async def stop(self) -> None:
        publishing = getattr(self, "_publishing", None)
        if publishing is not None:
            publishing.cancel()
        try:
            asyncio.get_running_loop().remove_reader(self.control.fileno())
        except (ValueError, OSError):
            pass
        try:
            if self.frontdoor is not None:
                await self.frontdoor.close()
            if self.forwarder is not None:
                await self.forwarder.close()
            if self._http is not None:
                await self._http.close()
            await self.node.close()
        finally:  # what it counted since its last publication, the requests it just finished among them
            if self.publisher is not None:
                self.publisher.publish()
            if self.metric_values is not None:
                self.metric_values.close()

    def _send_to_edge(self, frame: tuple) -> None:
        self._to_edge.add(_pack(*frame), lag=frame_lag(frame[0]))

    def _write_to_edge(self, data: bytes, frames: int) -> None:
        try:
            self.control.send(data)
        except BlockingIOError:
            # Process 0 stopped reading for a moment: the others miss these charges, which the
            # workers' next readings replace anyway.
            self.charge_frames_dropped += frames
        except OSError:
            pass  # process 0 is gone: this front door stops (_on_control)

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
            handle_frames(data, lambda frame, _: self.apply_control(frame), "control frame refused")

    def apply_control(self, frame: list) -> None:
        kind = frame[0]
        if kind in QUEUE_FRAMES:
            apply_queue_frame(self.router.queues, frame, now=self.clock())
        elif kind in CHARGE_FRAMES:
            self.router.queues.apply_frame(frame, now=self.clock())
        elif kind in LEDGER_FRAMES:
            if self.router.pending is not None:
                self.router.pending.apply_frame(frame, now=self.clock())
        elif kind == "withheld":
            withheld, self._checked = set(frame[1]), bool(frame[2])
            for i in range(len(self.layout.worker_ids)):
                if (i in withheld) != (i in self.router.withheld):
                    self.router.withhold(i, i in withheld)
            self._state_received.set()
        elif kind == "back":
            if self.forwarder is not None:
                self.forwarder.worker_back(frame[1], frame[2])
        elif kind == "decode_load":
            chooser = self.forwarder.decode_chooser if self.forwarder is not None else None
            if chooser is not None:
                chooser.load_reported(frame[1], int(frame[2]), int(frame[3]))
        elif kind == "metrics":
            self._metrics_chunk(int(frame[1]), bool(frame[2]), frame[3])
        else:
            raise ValueError(f"unknown control frame {kind!r}")


class _OneOfManyFrontDoors(FrontDoor):
    """A front door of ``edge --workers N`` other than process 0: ``/metrics`` says the edge's
    (every process's), not this process's alone."""

    def __init__(self, *args: Any, edge_metrics: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._edge_metrics = edge_metrics

    async def metrics_route(self, request: Request) -> Response:
        try:
            body = await self._edge_metrics()
        except (TimeoutError, OSError) as exc:
            log.warning("edge metrics unavailable", error=str(exc))
            return Response(b"the edge process did not answer for its metrics\n", status=503,
                            content_type="text/plain; charset=utf-8")
        return Response(body, content_type=CONTENT_TYPE_LATEST)
