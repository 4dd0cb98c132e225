"""A whole kvcompass deployment on loopback: certificates, configs, WAN relays and real daemon
processes. The demo runs on it, and so do the integration and fault tests.

Every node is a separate ``python -m kvcompassd <mode>`` process. With WAN emulation on, each
region gets its own copy of the cluster config in which every node of another region is
reached through a UDP relay that delays packets by the configured one-way latency; nodes of
the same region talk directly. Maintenance units are placed in regions round-robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Self

import aiohttp

from kvcompassd import certs
from kvcompassd.core.config import ClusterConfig, dump_config, parse_config
from kvcompassd.loopback_ports import _Ports, free_loopback_port  # noqa: F401  (re-exported for tests and tools)
from kvcompassd.ctl import query
from kvcompassd.wanemu import WanEmulator
from kvcompassd.wire import Role


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """What to run: workers per region, one-way WAN latencies, shards, model parameters."""

    workers: dict[str, int] = field(default_factory=lambda: {"us": 3, "eu": 2, "asia": 2})
    one_way_ms: dict[tuple[str, str], float] = field(
        default_factory=lambda: {("us", "eu"): 40.0, ("us", "asia"): 60.0, ("eu", "asia"): 75.0})
    shards: int = 2
    block_size: int = 16
    levels: int = 6
    same_region_min_tokens: int = 64
    prefill_ms_per_token: float = 0.085
    decode_ms_per_token: float = 8.0
    vram_kv_tokens: int = 200_000
    dram_kv_tokens: int = 800_000
    max_running: int = 16
    wan: bool = True
    fingerprint_bits: int = 0
    score: dict = field(default_factory=dict)
    # The cluster's [tokenizer] path (None: byte); emulated workers get it as --tokenizer too.
    tokenizer: str | None = None
    # Prefill-decode disaggregation: how many of each region's workers are decode workers (the
    # others are prefill workers); empty = every worker serves whole requests.
    decode_workers: dict[str, int] = field(default_factory=dict)
    decode_policy: str = "least_loaded"
    # Edges per region: the first is edge-<region>, the others edge-<region>-1, ...
    edges_per_region: int = 1
    sync: dict = field(default_factory=dict)  # the cluster's [sync] table (e.g. edge_streams)
    idle: dict = field(default_factory=dict)  # the cluster's [idle] table (e.g. heartbeat_ms)

    @classmethod
    def disaggregated(cls, prefill: int = 2, decode: int = 1, regions: tuple[str, ...] = ("us", "eu", "asia"),
                      **overrides) -> DeploymentSpec:
        """Per region ``prefill`` prefill workers and ``decode`` decode workers."""
        return cls(workers={r: prefill + decode for r in regions}, decode_workers={r: decode for r in regions},
                   **overrides)


def build_cluster(spec: DeploymentSpec, name: str = "local") -> ClusterConfig:
    regions = list(spec.workers)
    ports = _Ports()
    _free_port = ports.get
    workers = []
    for region in regions:
        decode = spec.decode_workers.get(region, 0)
        if not 0 <= decode < spec.workers[region] and spec.decode_workers:
            raise ValueError(f"region {region}: {decode} decode workers of {spec.workers[region]} leaves none to prefill")
        for i in range(spec.workers[region]):
            role = ("decode" if i >= spec.workers[region] - decode else "prefill") if spec.decode_workers else "mixed"
            name = {"mixed": f"{region}-{i}", "prefill": f"{region}-p{i}",
                    "decode": f"{region}-d{i - (spec.workers[region] - decode)}"}[role]
            events = _free_port(pair=True)
            workers.append({
                "id": name,
                "region": region,
                "prefill_ms_per_token": spec.prefill_ms_per_token,
                "decode_ms_per_token": spec.decode_ms_per_token,
                "vram_kv_tokens": spec.vram_kv_tokens,
                "dram_kv_tokens": spec.dram_kv_tokens,
                "max_running": spec.max_running,
                "http": f"http://127.0.0.1:{_free_port()}",
                "kv_events": f"tcp://127.0.0.1:{events}",
                "agent": f"127.0.0.1:{_free_port(socket.SOCK_DGRAM)}",
                "emulated": True,
            })
            if role != "mixed":
                workers[-1]["role"] = role
            if role == "prefill":
                workers[-1]["bootstrap_port"] = _free_port()
            if role == "decode":  # publishes nothing: its KV is never indexed
                del workers[-1]["kv_events"]
    data = {
        # Relayed "regions" are WAN paths on loopback addresses: send WAN-sized packets through them.
        "cluster": {"name": name, "model": "kvcompass-demo", "shards": spec.shards,
                    "max_datagram_size": 1200 if spec.wan else 0},
        "index": {"block_size": spec.block_size, "levels": spec.levels,
                  "same_region_min_tokens": spec.same_region_min_tokens, "value_bits": 32,
                  "fingerprint_bits": spec.fingerprint_bits,
                  "initial_capacity": 4096},
        "score": dict(spec.score),
        "tokenizer": {"path": spec.tokenizer} if spec.tokenizer else {},
        "regions": [{"name": r} for r in regions],
        "links": [{"between": [a, b], "one_way_ms": ms} for (a, b), ms in spec.one_way_ms.items()],
        "workers": workers,
        "edges": [{"id": f"edge-{r}" + (f"-{i}" if i else ""), "region": r, "http": f"127.0.0.1:{_free_port()}",
                   "quic": f"127.0.0.1:{_free_port(socket.SOCK_DGRAM)}"}
                  for r in regions for i in range(spec.edges_per_region)],
        "maintenance": [{"id": f"mnt-{s}", "shard": s, "quic": f"127.0.0.1:{_free_port(socket.SOCK_DGRAM)}"}
                        for s in range(spec.shards)],
        "sync": dict(spec.sync),
        "idle": dict(spec.idle),
    }
    if spec.decode_workers:
        data["disaggregation"] = {"decode_policy": spec.decode_policy}
    return parse_config(data, f"<{name}>")


@dataclass
class NodeProcess:
    node_id: str
    mode: str
    region: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalDeployment:
    """Start with ``await start()``; ``edge_url(region)``; ``await stop()``."""

    def __init__(self, spec: DeploymentSpec | None = None, workdir: str | Path | None = None, *,
                 time_scale: float = 1.0, wan_scale: float = 1.0, edge_args: tuple[str, ...] = (),
                 jitter: float = 0.0, loss: float = 0.0, node_args: dict[str, tuple[str, ...]] | None = None):
        self.spec = spec or DeploymentSpec()
        if wan_scale != 1.0:
            self.spec = replace(self.spec, one_way_ms={k: v * wan_scale for k, v in self.spec.one_way_ms.items()})
        self.workdir = Path(workdir) if workdir else Path(os.environ.get("TMPDIR", "/tmp")) / f"kvcompass-{os.getpid()}-{int(time.time())}"
        self.time_scale = time_scale
        self.edge_args = tuple(edge_args)
        self.jitter, self.loss = jitter, loss
        # Extra arguments per "mode:node-id", e.g. {"agent:us-1": ("--chaos-drop-engine-batches", "0.2")}.
        self.node_args = dict(node_args or {})
        self.cfg = build_cluster(self.spec)
        self.nodes: dict[str, NodeProcess] = {}
        self.wan: WanEmulator | None = None
        self.maintenance_region = {m.id: self.cfg.region_names()[i % len(self.cfg.region_names())]
                                   for i, m in enumerate(self.cfg.maintenance)}

    # -- setup --------------------------------------------------------------------------------

    @property
    def tls_dir(self) -> Path:
        return self.workdir / "tls"

    def _issue_certificates(self) -> None:
        certs.init_ca(self.tls_dir, cluster_name=self.cfg.name)
        for m in self.cfg.maintenance:
            certs.issue(self.tls_dir, self.tls_dir, role=Role.MAINTENANCE, node_id=m.id)
        for e in self.cfg.edges:
            certs.issue(self.tls_dir, self.tls_dir, role=Role.EDGE, node_id=e.id)
        for w in self.cfg.workers:
            certs.issue(self.tls_dir, self.tls_dir, role=Role.AGENT, node_id=w.id)
        certs.issue(self.tls_dir, self.tls_dir, role=Role.ADMIN, node_id="admin")

    async def _region_configs(self) -> dict[str, Path]:
        """One config per region: remote nodes' QUIC addresses point at WAN relays."""
        cfg = self.cfg
        paths = {}
        if self.spec.wan:
            self.wan = WanEmulator(cfg, jitter=self.jitter, loss=self.loss, relay_same_region=False)
            regions = cfg.region_names()
            for m in cfg.maintenance:
                await self.wan.add_node(m.id, self.maintenance_region[m.id], _addr(m.quic), from_regions=regions)
            for e in cfg.edges:
                await self.wan.add_node(e.id, e.region, _addr(e.quic), from_regions=regions)
            for w in cfg.workers:
                await self.wan.add_node(w.id, w.region, _addr(w.agent), from_regions=regions)
        for region in cfg.region_names():
            local = cfg
            if self.wan is not None:
                local = await self._rewritten(region)
            path = self.workdir / f"cluster-{region}.toml"
            path.write_text(dump_config(local))
            paths[region] = path
        return paths

    async def _rewritten(self, region: str) -> ClusterConfig:
        cfg, wan = self.cfg, self.wan

        async def via(node_id: str, node_region: str, address: str) -> str:
            if node_region == region:
                return address
            host, port = await wan.address_for(region, node_id)
            return f"{host}:{port}"

        maintenance = tuple([replace(m, quic=await via(m.id, self.maintenance_region[m.id], m.quic)) for m in cfg.maintenance])
        edges = tuple([replace(e, quic=await via(e.id, e.region, e.quic)) for e in cfg.edges])
        workers = tuple([replace(w, agent=await via(w.id, w.region, w.agent)) for w in cfg.workers])
        return replace(cfg, maintenance=maintenance, edges=edges, workers=workers)

    def _node(self, node_id: str, mode: str, region: str, config: Path, extra: tuple[str, ...] = ()) -> NodeProcess:
        argv = [sys.executable, "-m", "kvcompassd", mode, "--config", str(config), "--id", node_id, "--log-json"]
        if mode != "emulate-worker":
            argv += ["--tls-dir", str(self.tls_dir)]
        argv += list(extra) + list(self.node_args.get(f"{mode}:{node_id}", ()))
        node = NodeProcess(node_id, mode, region, argv, self.workdir / "logs" / f"{node_id}.{mode}.log")
        self.nodes[f"{mode}:{node_id}"] = node
        return node

    async def start(self, *, wait: bool = True, timeout: float = 90.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self._issue_certificates()
        configs = await self._region_configs()
        self.configs = configs
        cfg = self.cfg
        for w in cfg.workers:
            tokenizer = ("--tokenizer", self.spec.tokenizer) if self.spec.tokenizer else ()
            self._node(w.id, "emulate-worker", w.region, configs[w.region],
                       ("--time-scale", str(self.time_scale)) + tokenizer)
        for m in cfg.maintenance:
            self._node(m.id, "maintenance", self.maintenance_region[m.id], configs[self.maintenance_region[m.id]])
        for e in cfg.edges:
            self._node(e.id, "edge", e.region, configs[e.region], self.edge_args)
        for w in cfg.workers:
            self._node(w.id, "agent", w.region, configs[w.region])
        for node in self.nodes.values():
            self.spawn(node)
        if wait:
            await self.wait_ready(timeout)

    def spawn(self, node: NodeProcess) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(node.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            node.proc = subprocess.Popen(node.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)

    async def wait_ready(self, timeout: float = 90.0) -> None:
        """Every edge has all shard views and has heard a load report from each local worker."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            for e in self.cfg.edges:
                if getattr(self.nodes.get(f"edge:{e.id}"), "expected_down", False):
                    continue  # a test stopped it
                while True:
                    self._check_alive()
                    try:
                        async with session.get(f"http://{e.http}/health") as resp:
                            if resp.status == 200 and (await resp.json()).get("ready"):
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{e.id} not ready after {timeout} s; logs in {self.workdir / 'logs'}")
                    await asyncio.sleep(0.1)
            for w in self.cfg.workers:
                while True:
                    self._check_alive()
                    try:
                        async with session.get(f"{w.http}/v1/loads") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"worker {w.id} not up after {timeout} s")
                    await asyncio.sleep(0.1)
        # Agents register within a load-poll period of their engine answering.
        await asyncio.sleep(0.5)

    def _check_alive(self) -> None:
        for key, node in self.nodes.items():
            if node.proc is not None and node.proc.poll() is not None and not getattr(node, "expected_down", False):
                tail = node.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{key} exited with {node.proc.returncode}:\n{tail}")

    async def views_converged(self, edges=None) -> bool:
        """Whether every edge's views (or ``edges``') hold exactly the values of the maintenance
        units' streams they follow (their region's, or the full one), key by key (admin queries
        on the direct addresses, not through relays)."""
        running = [e for e in self.cfg.edges if not getattr(self.nodes.get(f"edge:{e.id}"), "expected_down", False)]
        for m in self.cfg.maintenance:
            for e in edges or running:  # an edge a test stopped has no views to compare
                state = await query(self.cfg, self.tls_dir, "admin", m.id, "entries", {"edge": e.id})
                for group, kv in state["groups"].items():
                    if not kv["keys"]:
                        continue
                    got = await query(self.cfg, self.tls_dir, "admin", e.id, "lookup",
                                      {"shard": m.shard, "group": int(group), "keys": kv["keys"]})
                    if got["values"] != kv["values"]:
                        return False
        return True

    def edge_url(self, region: str) -> str:
        return f"http://{self.cfg.edges_in(region)[0].http}"

    def node(self, mode: str, node_id: str) -> NodeProcess:
        return self.nodes[f"{mode}:{node_id}"]

    def kill(self, mode: str, node_id: str, sig: int = signal.SIGKILL) -> None:
        node = self.node(mode, node_id)
        node.expected_down = True
        if node.alive:
            node.proc.send_signal(sig)
            node.proc.wait(timeout=30)

    def restart(self, mode: str, node_id: str) -> None:
        node = self.node(mode, node_id)
        if node.alive:
            self.kill(mode, node_id)
        node.expected_down = False
        self.spawn(node)

    async def stop(self) -> None:
        """SIGTERM every node, wait up to 10 s, SIGKILL the rest. Cancelled while waiting (a
        second Ctrl-C, the demo's own shutdown), it still kills and reaps every node first."""
        procs = [n.proc for n in self.nodes.values() if n.alive]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        try:
            for p in procs:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    await asyncio.to_thread(p.wait, remaining)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        except asyncio.CancelledError:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            raise
        finally:
            if self.wan is not None:
                await self.wan.stop()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def _addr(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
