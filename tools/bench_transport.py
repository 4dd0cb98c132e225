"""Benchmark the QUIC transport on loopback: round trips, frame rates, bulk throughput.

The receiving node runs in its own process (as in a deployment), the sending node in this
one, both under uvloop by default. Medians of ``--runs`` runs of ``--seconds`` each; the
reference of every table is aioquic's stock configuration measured in the same run.

Pacers: "aioquic" stock, "auto" the coarse pacer (the default), "off" no pacing.

1. 16 KiB request/response exchanges (a 4096-token prompt, a 4096-token reply) over one
   connection: exchanges/s and round-trip P50/P99, stock pacer versus the coarse pacer, 1
   versus 64 concurrent exchanges, the 64 multiplexed on the default pool of 4 QUIC streams
   versus 64 streams (what one stream per in-flight exchange amounts to).
2. One-way frames on the control stream (agent -> maintenance event reports of 1 and of 1000
   events), stock versus coarse pacer.
3. Bulk 1 MiB snapshot frames (maintenance -> edge), stock versus coarse pacer.

For 2 and 3, "paced/s" counts how often per second the sender's pacer held a packet back and
"<1ms" the share of those waits shorter than uvloop's 1 ms timer resolution (each of which
uvloop stretches to >= 1 ms): the trap the coarse pacer removes, visible even when the shared
machine is too loaded for throughput figures to be stable.

    .venv/bin/python tools/bench_transport.py [--seconds 3] [--runs 3] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import structlog
import uvloop

from kvcompassd.certs import TlsFiles, init_ca, issue
from kvcompassd.core.events import PrefixCached, Tier
from kvcompassd.transport.aioquic_tweaks import packet_pacer
from kvcompassd.transport import QuicNode, TransportOptions
from kvcompassd.wire import (
    AdminAnswered,
    NodeIdentity,
    PrefixEventsReported,
    RequestForwarded,
    ResponseChunked,
    Role,
    ShardSnapshotSent,
    encode,
)

PROMPT = tuple(range(4096))  # 16 KiB packed
LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def make_pki(root: Path) -> dict[str, TlsFiles]:
    init_ca(root / "ca", cluster_name="bench")
    return {
        "edge": issue(root / "ca", root / "n", role="edge", node_id="edge-b"),
        "agent": issue(root / "ca", root / "n", role="agent", node_id="agent-b"),
        "mnt": issue(root / "ca", root / "n", role="maintenance", node_id="mnt-b"),
    }


# ---- the receiving process ------------------------------------------------------------------


async def receiver(tls: TlsFiles, identity: NodeIdentity, options: TransportOptions, ack_every: int, ports) -> None:
    """Answer exchanges with a 16 KiB reply; acknowledge every ``ack_every`` control frames."""
    received = 0

    async def on_message(peer, message, channel):
        nonlocal received
        if channel.stream is not None:
            await channel.stream.send(ResponseChunked(message.request_id, PROMPT, "", True), end=True)
            return
        received += 1
        if received % ack_every == 0:
            peer.send_encoded(encode(AdminAnswered("ack", {"received": received})))

    node = QuicNode(identity, tls, on_message=on_message, options=options)
    address = await node.listen("127.0.0.1", 0)
    ports.put(address[1])
    await asyncio.Event().wait()  # until terminated


def receiver_main(loop_name, tls, identity, options, ack_every, ports) -> None:
    quiet_logs()
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(receiver(tls, identity, options, ack_every, ports))


class Receiver:
    """A receiving node in a child process, for one measurement run."""

    def __init__(self, loop_name: str, tls: TlsFiles, identity: NodeIdentity, options: TransportOptions, ack_every: int = 1):
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        self.process = context.Process(
            target=receiver_main, args=(loop_name, tls, identity, options, ack_every, ports), daemon=True
        )
        self.process.start()
        self.address = ("127.0.0.1", ports.get(timeout=30))

    def stop(self) -> None:
        self.process.terminate()
        self.process.join()


# ---- the measurements ------------------------------------------------------------------------


async def round_trips(pki, address, *, options: TransportOptions, concurrency: int, seconds: float) -> dict[str, float]:
    edge = QuicNode(NodeIdentity(Role.EDGE, "edge-b"), pki["edge"], on_message=lambda *a: None, options=options)
    peer = await edge.connect(address)
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            async with peer.open_stream() as exchange:
                await exchange.send(RequestForwarded(f"r{index}-{n}", "edge-b", "us", PROMPT, {}, False, 0), end=True)
                async for _ in exchange:
                    pass
            latencies.append(time.monotonic() - started)
            n += 1

    started = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.monotonic() - started
    await edge.close()
    latencies.sort()
    return {
        "per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


async def one_way(
    pki, address, *, sender: str, body: bytes, options: TransportOptions, ack_every: int, window: int, seconds: float
) -> dict[str, float]:
    """Send ``body`` frames on the control stream with at most ``window`` unacknowledged."""
    acked = 0
    progressed = asyncio.Event()

    def on_ack(peer, message, channel):
        nonlocal acked
        acked = message.body["received"]
        progressed.set()

    identity = NodeIdentity(Role.AGENT, "agent-b") if sender == "agent" else NodeIdentity(Role.MAINTENANCE, "mnt-b")
    node = QuicNode(identity, pki[sender], on_message=on_ack, options=options)
    peer = await node.connect(address)
    probe = PacingProbe(peer._connection)
    sent = 0
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    while time.monotonic() < deadline:
        while sent - acked < window:
            for _ in range(ack_every):
                peer.send_encoded(body)
            sent += ack_every
        progressed.clear()
        await progressed.wait()
    while acked < sent:
        progressed.clear()
        await progressed.wait()
    elapsed = time.monotonic() - started
    await node.close()
    return {
        "per_s": acked / elapsed,
        "mb_s": acked * len(body) / elapsed / 1e6,
        "paced_per_s": probe.waits / elapsed,
        "sub_ms_share": probe.sub_ms / probe.waits if probe.waits else 0.0,
    }


class PacingProbe:
    """Counts the waits the sender's pacer asks for (how often a packet was held back) and
    how many of them were shorter than uvloop's 1 ms timer resolution."""

    def __init__(self, connection) -> None:
        self.waits = 0
        self.sub_ms = 0
        pacer = packet_pacer(connection._quic)
        original = pacer.next_send_time

        def next_send_time(now: float):
            at = original(now)
            if at is not None:
                self.waits += 1
                self.sub_ms += at - now < 0.0009  # (a full 1 ms tick may round below 0.001)
            return at

        pacer.next_send_time = next_send_time


def report(events: int) -> bytes:
    return encode(
        PrefixEventsReported("agent-b", 1, tuple(PrefixCached("agent-b", (1 << 62) + i, Tier.VRAM) for i in range(events)))
    )


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--loop", choices=sorted(LOOPS), default="uvloop")
    args = parser.parse_args()
    quiet_logs()
    pki = make_pki(Path(tempfile.mkdtemp(prefix="bench-transport-")))
    agent = NodeIdentity(Role.AGENT, "agent-b")
    mnt = NodeIdentity(Role.MAINTENANCE, "mnt-b")
    edge = NodeIdentity(Role.EDGE, "edge-b")

    def measure(receiver_tls, receiver_identity, options, make, ack_every=1) -> dict[str, float]:
        runs = []
        for _ in range(args.runs):
            far = Receiver(args.loop, receiver_tls, receiver_identity, options, ack_every)
            try:
                with asyncio.Runner(loop_factory=LOOPS[args.loop]) as runner:
                    runs.append(runner.run(make(far.address)))
            finally:
                far.stop()
        return median_of(runs)

    print(f"loop={args.loop} seconds/run={args.seconds} runs={args.runs} (medians; receiver in its own process)")
    print('pacers: "aioquic" = stock, "auto" = coarse pacer (the default), "off" = no pacing')
    print("\n1. 16 KiB request/response exchanges over one connection")
    print(f"{'pacer':<8} {'concurrent':>10} {'streams':>8} {'exch/s':>9} {'P50 ms':>8} {'P99 ms':>8} {'vs ref':>7}")
    reference = None
    for pacing, concurrency, streams in [
        ("aioquic", 1, 4),
        ("auto", 1, 4),
        ("aioquic", 64, 4),
        ("auto", 64, 4),
        ("auto", 64, 64),
    ]:
        options = TransportOptions(pacing=pacing, exchange_streams=streams)
        result = measure(
            pki["agent"],
            agent,
            options,
            lambda address: round_trips(pki, address, options=options, concurrency=concurrency, seconds=args.seconds),
        )
        reference = reference or result
        print(
            f"{pacing:<8} {concurrency:>10} {streams:>8} {result['per_s']:>9.0f} {result['p50_ms']:>8.2f} "
            f"{result['p99_ms']:>8.2f} {result['per_s'] / reference['per_s']:>6.2f}x"
        )

    print("\n2. One-way frames on the control stream (agent -> maintenance event reports)")
    print(f"{'pacer':<8} {'frame':>14} {'frames/s':>10} {'MB/s':>8} {'vs ref':>7} {'paced/s':>8} {'<1ms':>5}")
    for events, ack_every, window in [(1, 64, 4096), (1000, 1, 64)]:
        body = report(events)
        reference = None
        for pacing in ("aioquic", "auto", "off"):
            options = TransportOptions(pacing=pacing)
            result = measure(
                pki["mnt"],
                mnt,
                options,
                lambda address: one_way(
                    pki, address, sender="agent", body=body, options=options, ack_every=ack_every, window=window,
                    seconds=args.seconds,
                ),
                ack_every,
            )
            reference = reference or result
            label = f"{events} ev ({len(body)} B)"
            print(
                f"{pacing:<8} {label:>14} {result['per_s']:>10.0f} {result['mb_s']:>8.1f} "
                f"{result['per_s'] / reference['per_s']:>6.2f}x {result['paced_per_s']:>8.0f} "
                f"{result['sub_ms_share']:>5.0%}"
            )

    print("\n3. Bulk 1 MiB snapshot frames (maintenance -> edge)")
    print(f"{'pacer':<8} {'frames/s':>10} {'MB/s':>8} {'vs ref':>7} {'paced/s':>8} {'<1ms':>5}")
    body = encode(ShardSnapshotSent(0, 1, 1, ((0, b"\x5a" * (1 << 20)),)))
    reference = None
    for pacing in ("aioquic", "auto", "off"):
        options = TransportOptions(pacing=pacing)
        result = measure(
            pki["edge"],
            edge,
            options,
            lambda address: one_way(
                pki, address, sender="mnt", body=body, options=options, ack_every=1, window=4, seconds=args.seconds
            ),
        )
        reference = reference or result
        print(
            f"{pacing:<8} {result['per_s']:>10.1f} {result['mb_s']:>8.1f} {result['per_s'] / reference['per_s']:>6.2f}x "
            f"{result['paced_per_s']:>8.0f} {result['sub_ms_share']:>5.0%}"
        )


if __name__ == "__main__":
    main()
