"""What the deployment benchmarks (bench_sync, bench_edge) share: a loopback cluster's files,
daemon processes, CPU accounting and percentiles, and callgrind's client requests for the
instruction-counting tools. Not a library for the daemons."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import structlog

from kvcompassd import certs
from kvcompassd.core.config import ClusterConfig, dump_config, load_config
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.wire import Role

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

_CALLGRIND_HELPER = r"""
#include <valgrind/callgrind.h>
void kvc_bench_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void kvc_bench_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void kvc_bench_zero(void) { CALLGRIND_ZERO_STATS; }
"""


def callgrind_helper(directory: Path) -> ctypes.CDLL:
    """The collection toggle, zero and dump of callgrind's client requests, compiled in
    ``directory`` (outside valgrind they do nothing)."""
    source = directory / "toggle.c"
    source.write_text(_CALLGRIND_HELPER)
    library = directory / "toggle.so"
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    helper = ctypes.CDLL(str(library))
    helper.kvc_bench_dump.argtypes = [ctypes.c_char_p]
    return helper


def setting_parser(table: str):
    """An argparse ``type`` for ``NAME=NUMBER``: one numeric setting of the plane's ``[table]``
    (``--sync``, ``--score``)."""
    def parse(text: str) -> tuple[str, float]:
        name, sep, value = text.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name or number is None:
            raise argparse.ArgumentTypeError(f"expected NAME=NUMBER (a [{table}] setting), got {text!r}")
        return name, number
    return parse


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def percentile(values, q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in [0, 100]); NaN when empty."""
    data = sorted(values)
    if not data:
        return float("nan")
    rank = min(len(data) - 1, max(0, int(round(q / 100.0 * len(data) + 0.5)) - 1))
    return data[rank]


def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/<pid>/stat`` utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def hold_prompt(cfg: ClusterConfig, shards: list, worker_id: str, tokens) -> None:
    """Register ``tokens`` as held in VRAM by ``worker_id`` at every registration length up to
    its length, each key in its shard (``key % len(shards)``), as the worker's agent would
    report it, under the salt the edge's Router looks it up with."""
    from kvcompassd.core.events import PrefixCached, Tier
    from kvcompassd.core.keys import namespace_salt, prefix_keys
    from kvcompassd.core.levels import LevelPlan

    lengths = LevelPlan.from_config(cfg).registration_lengths_upto(len(tokens))
    n = len(shards)
    for key in prefix_keys(tokens, lengths, namespace_salt(cfg.model, cfg.tenant)).tolist():
        shards[key % n].apply([PrefixCached(worker_id, key, Tier.VRAM)])


class Cluster:
    """A loopback cluster: config file, certificates, and the daemon processes this bench starts.

    ``extra_certs`` are (role, id) pairs for the identities the benchmark itself plays."""

    def __init__(self, spec: DeploymentSpec, *, initial_capacity: int | None = None,
                 extra_certs: tuple[tuple[Role, str], ...] = (), profile_dir: Path | None = None,
                 host: str | None = None, max_datagram_size: int = 0):
        self.profile_dir = profile_dir  # run the daemons under cProfile, one .prof per process
        self.workdir = Path(tempfile.mkdtemp(prefix="kvbench-"))
        cfg = build_cluster(spec, name="bench")
        if initial_capacity is not None:
            cfg = replace(cfg, index=replace(cfg.index, initial_capacity=initial_capacity))
        if max_datagram_size:
            cfg = replace(cfg, max_datagram_size=max_datagram_size)
        self.config_path = self.workdir / "cluster.toml"
        text = dump_config(cfg)
        if host is not None:
            # Every daemon on ``host`` instead of 127.0.0.1 (e.g. this machine's LAN address, so
            # the transport sizes its datagrams for a real network path rather than loopback).
            text = text.replace("127.0.0.1", host)
        self.config_path.write_text(text)
        self.cfg: ClusterConfig = load_config(self.config_path)
        self.tls_dir = self.workdir / "tls"
        certs.init_ca(self.tls_dir, cluster_name=cfg.name)
        identities = [(Role.MAINTENANCE, m.id) for m in cfg.maintenance]
        identities += [(Role.EDGE, e.id) for e in cfg.edges]
        identities += [(Role.AGENT, w.id) for w in cfg.workers]
        identities += [(Role.ADMIN, "admin"), *extra_certs]
        for role, node_id in identities:
            certs.issue(self.tls_dir, self.tls_dir, role=role, node_id=node_id)
        (self.workdir / "logs").mkdir()
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, mode: str, node_id: str, *extra: str) -> subprocess.Popen:
        profile = []
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            profile = ["-m", "cProfile", "-o", str(self.profile_dir / f"{mode}.{node_id}.prof")]
        argv = [sys.executable, *profile, "-m", "kvcompassd", mode, "--config", str(self.config_path), "--id", node_id,
                "--log-json", "--log-level", "warning"]
        if mode != "emulate-worker":
            argv += ["--tls-dir", str(self.tls_dir)]
        argv += list(extra)
        log_path = self.workdir / "logs" / f"{mode}.{node_id}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.procs[f"{mode}:{node_id}"] = proc
        return proc

    def check_alive(self) -> None:
        for key, proc in self.procs.items():
            if proc.poll() is not None:
                mode, node_id = key.split(":", 1)
                tail = (self.workdir / "logs" / f"{mode}.{node_id}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{key} exited with {proc.returncode}:\n{tail}")

    async def wait_http(self, url: str, timeout: float = 60.0, *, ready_key: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                self.check_alive()
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200 and (ready_key is None or (await resp.json()).get(ready_key)):
                            return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not ready after {timeout} s; logs in {self.workdir / 'logs'}")
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
