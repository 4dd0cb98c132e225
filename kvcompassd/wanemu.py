"""WAN emulation without netem: a user-space UDP relay that delays, jitters and drops packets.

A :class:`WanRelay` listens on one UDP port and forwards every datagram to a target, and the
target's answers back to their sender, each after its direction's one-way delay. So QUIC
between two processes on one machine sees a real RTT, real loss and real reordering (or none).

Packets wait in one timed heap per direction, served by a single ``loop.call_at`` timer armed
at the earliest due time: no task or sleep per packet. A packet is never sent before its due
time (the timer re-arms if the loop wakes early); it may leave up to one timer tick late.
With jitter, packets keep their order by default (each due time is at least the previous
one, as on a real path with a single queue); ``allow_reorder=True`` lets jitter reorder them.
Due times are taken on the monotonic clock, so a packet's real delay is never below its setting.

A :class:`WanEmulator` builds one relay per (source region, destination node) from a
ClusterConfig's latency matrix, so "a node in region A reaching node Y in region B" dials the
relay's address instead of Y's.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

Address = tuple[str, int]


class WanEmulatorError(ValueError):
    """A relay was configured with impossible parameters."""


class _LatencyMatrix(Protocol):
    def one_way_ms(self, a: str, b: str) -> float: ...

    def region_names(self) -> tuple[str, ...]: ...


def split_host_port(value: str) -> Address:
    """``"127.0.0.1:7400"`` or ``"[::1]:7400"`` -> (host, port)."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise WanEmulatorError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class DirectionStats:
    """Counters of one direction of a relay."""

    received: int = 0
    dropped: int = 0
    sent: int = 0


class _DelayLine:
    """Packets of one direction, each released at its due time by one loop timer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        send: Callable[[bytes, Any], None],
        *,
        delay_s: float,
        jitter: float,
        loss: float,
        rng: random.Random,
        allow_reorder: bool,
    ) -> None:
        self._loop = loop
        self._send = send
        self._delay_s = delay_s
        self._jitter = jitter
        self._loss = loss
        self._rng = rng
        self._allow_reorder = allow_reorder
        self._heap: list[tuple[float, int, bytes, Any]] = []
        self._order = itertools.count()
        self._last_due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self.stats = DirectionStats()

    def push(self, data: bytes, destination: Any) -> None:
        self.stats.received += 1
        if self._loss and self._rng.random() < self._loss:
            self.stats.dropped += 1
            return
        delay = self._delay_s
        if self._jitter:
            delay *= 1.0 + self._rng.uniform(-self._jitter, self._jitter)
        # Due times use the real monotonic clock: uvloop's loop.time() is cached per loop
        # iteration at 1 ms resolution, which could release a packet slightly *before* its delay.
        due = time.monotonic() + delay
        if not self._allow_reorder:
            due = max(due, self._last_due)
            self._last_due = due
        heapq.heappush(self._heap, (due, next(self._order), data, destination))
        if due < self._timer_at:
            self._arm(due)

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(self._loop.time() + (due - time.monotonic()), self._release)

    def _release(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = time.monotonic()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, data, destination = heapq.heappop(heap)
            self.stats.sent += 1
            self._send(data, destination)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()


class _Upstream(asyncio.DatagramProtocol):
    """The relay's socket toward the target for one client: answers go back to that client."""

    def __init__(self, relay: WanRelay, client: Address) -> None:
        self.relay = relay
        self.client = client
        self.transport: asyncio.DatagramTransport | None = None
        self.backlog: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        for data in self.backlog:
            self.transport.sendto(data)
        self.backlog.clear()

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._backward.push(data, self.client)

    def send(self, data: bytes) -> None:
        if self.transport is None:
            self.backlog.append(data)
        elif not self.transport.is_closing():
            self.transport.sendto(data)

    def error_received(self, exc: Exception) -> None:
        pass  # e.g. ICMP port unreachable while the target restarts: a lost packet, like a WAN


class _Listener(asyncio.DatagramProtocol):
    def __init__(self, relay: WanRelay) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_client(data, addr)

    def error_received(self, exc: Exception) -> None:
        pass


class WanRelay:
    """Forward UDP between ``listen`` and ``target`` with a one-way delay per direction.

    ``delay_ms`` applies to packets toward the target, ``return_delay_ms`` (default: the same)
    to the answers; ``jitter`` is a fraction (0.1 = each delay uniform within +-10 %);
    ``loss`` is the drop probability of each packet, independently per direction; ``seed``
    makes jitter and loss reproducible.
    """

    def __init__(
        self,
        listen: Address,
        target: Address,
        delay_ms: float,
        *,
        return_delay_ms: float | None = None,
        jitter: float = 0.0,
        loss: float = 0.0,
        seed: int = 0,
        allow_reorder: bool = False,
    ) -> None:
        return_delay_ms = delay_ms if return_delay_ms is None else return_delay_ms
        for name, value in (("delay_ms", delay_ms), ("return_delay_ms", return_delay_ms)):
            if not 0.0 <= value <= 60_000.0:
                raise WanEmulatorError(f"{name} must be in [0, 60000] ms, got {value!r}")
        if not 0.0 <= jitter < 1.0:
            raise WanEmulatorError(f"jitter must be a fraction in [0, 1), got {jitter!r}")
        if not 0.0 <= loss < 1.0:
            raise WanEmulatorError(f"loss must be a probability in [0, 1), got {loss!r}")
        self.listen_address = listen
        self.target = target
        self.delay_ms = delay_ms
        self.return_delay_ms = return_delay_ms
        self.jitter = jitter
        self.loss = loss
        self.seed = seed
        self.allow_reorder = allow_reorder
        self._listener: asyncio.DatagramTransport | None = None
        self._upstreams: dict[Address, _Upstream] = {}
        self._opening: set[asyncio.Task] = set()  # upstream sockets being opened (kept: the loop holds tasks weakly)
        self._forward: _DelayLine
        self._backward: _DelayLine
        self.address: Address | None = None

    async def start(self) -> Address:
        """Bind the listening port (0 = ephemeral) and return the address peers should dial."""
        loop = asyncio.get_running_loop()
        # One random stream per direction, so that one direction's traffic does not change
        # which packets the other drops.
        common = dict(jitter=self.jitter, loss=self.loss, allow_reorder=self.allow_reorder)
        self._forward = _DelayLine(
            loop, self._to_target, delay_s=self.delay_ms / 1000.0, rng=random.Random(f"{self.seed}/forward"), **common
        )
        self._backward = _DelayLine(
            loop, self._to_client, delay_s=self.return_delay_ms / 1000.0, rng=random.Random(f"{self.seed}/backward"), **common
        )
        transport, _ = await loop.create_datagram_endpoint(lambda: _Listener(self), local_addr=self.listen_address)
        self._listener = transport  # type: ignore[assignment]
        host, port = transport.get_extra_info("sockname")[:2]
        self.address = (host, port)
        log.debug("wan_relay_started", listen=f"{host}:{port}", target=f"{self.target[0]}:{self.target[1]}", delay_ms=self.delay_ms)
        return self.address

    @property
    def forward_stats(self) -> DirectionStats:
        return self._forward.stats

    @property
    def backward_stats(self) -> DirectionStats:
        return self._backward.stats

    def _from_client(self, data: bytes, client: Address) -> None:
        client = tuple(client[:2])  # type: ignore[assignment]
        upstream = self._upstreams.get(client)
        if upstream is None:
            upstream = self._upstreams[client] = _Upstream(self, client)
            task = asyncio.get_running_loop().create_task(self._open_upstream(upstream))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
        self._forward.push(data, upstream)

    async def _open_upstream(self, upstream: _Upstream) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_datagram_endpoint(lambda: upstream, remote_addr=self.target)
        except OSError as exc:
            log.warning("wan_relay_upstream_failed", target=self.target, error=str(exc))
            self._upstreams.pop(upstream.client, None)

    def _to_target(self, data: bytes, upstream: _Upstream) -> None:
        upstream.send(data)

    def _to_client(self, data: bytes, client: Address) -> None:
        if self._listener is not None and not self._listener.is_closing():
            self._listener.sendto(data, client)

    async def stop(self) -> None:
        """Close every socket; packets still in flight are lost (as on a cut link)."""
        for task in list(self._opening):
            task.cancel()
        self._forward.close()
        self._backward.close()
        for upstream in self._upstreams.values():
            if upstream.transport is not None:
                upstream.transport.close()
        self._upstreams.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class WanEmulator:
    """Relays for every (source region, destination node) pair of a cluster's latency matrix."""

    def __init__(
        self,
        config: _LatencyMatrix,
        *,
        jitter: float = 0.0,
        loss: float = 0.0,
        seed: int = 0,
        host: str = "127.0.0.1",
        relay_same_region: bool = True,
    ) -> None:
        self.config = config
        self.jitter = jitter
        self.loss = loss
        self.seed = seed
        self.host = host
        self.relay_same_region = relay_same_region
        self._relays: dict[tuple[str, str], WanRelay] = {}
        self._nodes: dict[str, tuple[str, Address]] = {}

    async def add_node(self, node_id: str, region: str, address: Address, *, from_regions: tuple[str, ...]) -> None:
        """Register ``node_id`` of ``region`` at ``address`` and start a relay toward it from
        each region in ``from_regions``."""
        self._nodes[node_id] = (region, address)
        for source in from_regions:
            await self._relay(source, node_id)

    async def add_cluster(self, config: Any, *, maintenance_regions: dict[str, str] | None = None) -> None:
        """Register every node of a ClusterConfig that has a QUIC address (edges, agents of
        workers, and maintenance units placed by ``maintenance_regions``: id -> region),
        reachable from every region."""
        regions = tuple(config.region_names())
        for edge in config.edges:
            if edge.quic:
                await self.add_node(edge.id, edge.region, split_host_port(edge.quic), from_regions=regions)
        for worker in config.workers:
            if worker.agent:
                await self.add_node(worker.id, worker.region, split_host_port(worker.agent), from_regions=regions)
        for unit in config.maintenance:
            if unit.quic and maintenance_regions and unit.id in maintenance_regions:
                await self.add_node(unit.id, maintenance_regions[unit.id], split_host_port(unit.quic), from_regions=regions)

    async def _relay(self, source_region: str, node_id: str) -> Address:
        region, address = self._nodes[node_id]
        if source_region == region and not self.relay_same_region:
            return address
        key = (source_region, node_id)
        relay = self._relays.get(key)
        if relay is None:
            one_way = self.config.one_way_ms(source_region, region)
            # Each pair gets its own reproducible random stream.
            seed = zlib.crc32(f"{self.seed}/{source_region}/{node_id}".encode())
            relay = WanRelay((self.host, 0), address, one_way, jitter=self.jitter, loss=self.loss, seed=seed)
            await relay.start()
            self._relays[key] = relay
        assert relay.address is not None
        return relay.address

    async def address_for(self, source_region: str, node_id: str) -> Address:
        """Where a node in ``source_region`` should dial to reach ``node_id`` through the WAN."""
        if node_id not in self._nodes:
            raise KeyError(f"unknown node {node_id!r}; add it with add_node first")
        return await self._relay(source_region, node_id)

    @property
    def relays(self) -> dict[tuple[str, str], WanRelay]:
        return dict(self._relays)

    async def stop(self) -> None:
        for relay in self._relays.values():
            await relay.stop()
        self._relays.clear()
