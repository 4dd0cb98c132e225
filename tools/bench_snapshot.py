"""Benchmark a large shard bootstrapping a new edge: a real ``kvcompassd maintenance`` process
holding ``--entries`` entries sends its snapshot, in chunks over QUIC, to a real ``kvcompassd
edge`` process started afterwards, and the edge's view must end byte-identical to the shard
(admin ``digest``: the CRC-32 of every region group's table exported as a snapshot blob, which a
view of the same state exports byte for byte).

This process plays the agent of worker ``us-0`` (registrations sent as reports of 2^17 events)
to fill the shard, which is sized for them ([index] initial_capacity). Printed: the snapshot's
bytes and chunks; the time from the edge's process start to its view equal to the shard, and the
transfer alone (the edge's log: header received -> last chunk installed); peak RSS (VmHWM) of the
edge and of the maintenance unit.

    .venv/bin/python tools/bench_snapshot.py [--entries 10000000] [--chunk-bytes 524288]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from benchlib import Cluster, quiet_logs  # noqa: E402

from kvcompassd.core.config import dump_config, load_config  # noqa: E402
from kvcompassd.core.events import EventOp, IndexEventColumns  # noqa: E402
from kvcompassd.ctl import query  # noqa: E402
from kvcompassd.daemon import split_address, tls_files  # noqa: E402
from kvcompassd.launcher import DeploymentSpec  # noqa: E402
from kvcompassd.transport import QuicNode  # noqa: E402
from kvcompassd.wire import NodeIdentity, PrefixEventsReported, Role, WorkerRegistered  # noqa: E402

# Reports of 2^17 events: each costs the unit ~30 ms to apply, so its event loop never stalls
# past the connection's idle timeout even on a loaded machine (2^20, the wire's bound, did).
REPORT_EVENTS = 1 << 17


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident set, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def admin(cluster: Cluster, node: str, what: str, args: dict | None = None) -> dict:
    return await query(cluster.cfg, cluster.tls_dir, "admin", node, what, args or {}, timeout=60.0)


async def until(check, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while True:
        cluster.check_alive()
        try:
            if await check():
                return
        except (ConnectionError, TimeoutError):
            pass  # a node still starting
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s; logs in {cluster.workdir / 'logs'}")
        await asyncio.sleep(0.2)


def log_records(cluster: Cluster, mode: str, node: str, event: str) -> list[dict]:
    out = []
    for line in (cluster.workdir / "logs" / f"{mode}.{node}.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


async def fill(cluster: Cluster, entries: int, seed: int) -> None:
    """Register ``entries`` distinct keys for us-0 at the shard's unit."""
    # Every report is built before connecting: seconds of CPU on a busy machine would otherwise
    # hold this event loop past the connection's idle timeout.
    # Distinct keys below 2^63 (the table hashes them, so a regular pattern costs nothing).
    keys = np.arange(1, entries + 1, dtype=np.uint64) * np.uint64(2654435761 + 2 * seed)
    reports = [PrefixEventsReported("us-0", seq, IndexEventColumns(bytes([EventOp.CACHED_VRAM]) * len(part),
                                                                   part.astype("<u8").tobytes()))
               for seq, part in enumerate((keys[i:i + REPORT_EVENTS] for i in range(0, entries, REPORT_EVENTS)), 1)]
    node = QuicNode(NodeIdentity(Role.AGENT, "us-0"), tls_files(cluster.tls_dir, "us-0"),
                    on_message=lambda peer, msg, ch: print(f"unit answered: {msg}", file=sys.stderr))
    try:
        peer = await node.connect(split_address(cluster.cfg.maintenance[0].quic, "mnt-0"),
                                  expected_role=Role.MAINTENANCE, timeout=30)
        await peer.send(WorkerRegistered("us-0", 1))
        for report in reports:
            await peer.send(report)

        async def filled() -> bool:
            return (await admin(cluster, "mnt-0", "status"))["entries"] >= entries

        await until(filled, 600, "the shard's fill", cluster)
    finally:
        await node.close()


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    # The shard is sized for what it will hold ([index] initial_capacity), as an operator would.
    cluster = Cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False),
                      initial_capacity=max(4096, args.entries))
    if args.chunk_bytes:
        cfg = replace(cluster.cfg, sync=replace(cluster.cfg.sync, snapshot_chunk_bytes=args.chunk_bytes))
        cluster.config_path.write_text(dump_config(cfg))
        cluster.cfg = load_config(cluster.config_path)
    try:
        unit = cluster.spawn("maintenance", "mnt-0", "--log-level", "info")
        await until(lambda: admin(cluster, "mnt-0", "status"), 60, "the maintenance unit", cluster)
        began = time.monotonic()
        await fill(cluster, args.entries, args.seed)
        status = await admin(cluster, "mnt-0", "status")
        print(f"shard filled: {status['entries']:,} entries in {time.monotonic() - began:.1f} s "
              f"(tables: {[(t['entries'], t['load']) for t in status['tables']]})")
        shard = await admin(cluster, "mnt-0", "digest")
        unit_before = rss_mib(unit.pid, "VmRSS"), rss_mib(unit.pid)

        started = time.monotonic()
        edge = cluster.spawn("edge", "edge-us", "--log-level", "info")

        async def equal() -> bool:
            view = await admin(cluster, "edge-us", "digest", {"shard": 0})
            return view["position"] == shard["position"] and view["groups"] == shard["groups"]

        await until(equal, args.timeout, "the edge's view equal to the shard", cluster)
        elapsed = time.monotonic() - started
        headers = [r for r in log_records(cluster, "edge", "edge-us", "snapshot transfer") if r.get("accepted")]
        header = headers[-1]
        [last] = [r for r in log_records(cluster, "edge", "edge-us", "snapshot chunk")
                  if r.get("installed") and r["snapshot_id"] == header["snapshot_id"]]
        transfer_s = (datetime.fromisoformat(last["timestamp"]) - datetime.fromisoformat(header["timestamp"])).total_seconds()
        stats = (await admin(cluster, "mnt-0", "status"))["stats"]
        print(f"snapshot: {header['entries']:,} entries, {header['bytes']:,} bytes, {header['chunks']} chunks of "
              f"<= {cluster.cfg.sync.snapshot_chunk_bytes:,} bytes (chunks sent {stats['snapshot_chunks_sent']})")
        print(f"new edge: view equal to the shard {elapsed:.2f} s after its process started; "
              f"transfer (header -> last chunk installed) {transfer_s:.2f} s")
        print(f"peak RSS: edge {rss_mib(edge.pid):.0f} MiB; maintenance {rss_mib(unit.pid):.0f} MiB (before the "
              f"edge started: {unit_before[0]:.0f} MiB resident, {unit_before[1]:.0f} MiB peak while filling)")
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--chunk-bytes", type=int, default=0, help="[sync] snapshot_chunk_bytes (0: the default)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
