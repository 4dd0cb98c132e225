"""Soak: a steady request rate through the demo deployment, with no errors and flat memory.

    .venv/bin/python tools/soak.py                      # 10 minutes at 4 req/s
    .venv/bin/python tools/soak.py --minutes 0.5        # the short variant
    .venv/bin/python tools/soak.py --minutes 2 --loss 0.15 --one-way-ms 120   # under WAN loss
    .venv/bin/python tools/soak.py --minutes 2 --hostile     # attack one edge half-way through

Starts ``LocalDeployment`` with the demo's defaults (3 regions, 7 emulated workers, 2 maintenance
units, real processes and QUIC through WAN relays), replays ``kvcompassd.demo.bundled_workload``
prompts as streaming completions at ``--rate`` requests per second (open loop: a request starts
every 1/rate s whatever the others do, up to ``--max-in-flight``), and samples the RSS of every
daemon process (``/proc/<pid>/status`` VmRSS; this process too, as it runs the WAN relays)
every ``--sample-s`` seconds.

Prints per process: RSS first / after warm-up / last / max and the slope (MB per minute, least
squares over the samples after warm-up); the requests: served, failed, hit rate (cached
tokens / prompt tokens), TTFT P50 and P99; how late this process's event loop (which runs the
WAN relays) woke from 50 ms sleeps, so that a stalled relay is not mistaken for loss; and how
long after the last request every edge's views held exactly the shards' state (gaps repaired).

Exits 1 if any request failed, any daemon died, the views did not converge, under --hostile if the
attacked edge grew more than --hostile-max-rss-mb over its idle RSS or its TTFT P99 more than
--hostile-max-slowdown times the quiet half's, or
a process's RSS grew by more than ``--max-growth-mb`` between the end of the warm-up (the first
``--warmup`` fraction of the run, while caches and tables fill) and the end, or (runs of 3
minutes or more, where a slope means something) kept growing faster than ``--max-slope``
MB/min by more than ``--max-growth-mb / 2`` in all: a linear leak that a short run hides.

``--hostile``: the run's second half adds hostile traffic against the first region's edge,
beside the steady load: ``--hostile-uploads`` connections that upload ``--hostile-upload-mb``
bodies slowly (chunked, so no Content-Length refuses them up front; each reconnects when
refused) and ``--hostile-slowloris`` connections that send a header line every few seconds and
never finish (each reconnects when closed). Reports that edge's RSS when idle (before the
load), at the end of the quiet half and at most under attack, and the P99 TTFT and latency of
its served requests in the quiet half against the hostile half.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np

from kvcompassd.demo import Outcome, _one, bundled_workload
from kvcompassd.launcher import DeploymentSpec, LocalDeployment


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """RSS samples per process name: (seconds since start, MB)."""

    def __init__(self, dep: LocalDeployment):
        self.dep = dep
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.t0 = time.monotonic()

    def processes(self) -> dict[str, int]:
        procs = {key: node.proc.pid for key, node in self.dep.nodes.items() if node.alive}
        procs["soak (WAN relays, clients)"] = os.getpid()
        return procs

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        for name, pid in self.processes().items():
            mb = rss_mb(pid)
            if mb is not None:
                self.samples.setdefault(name, []).append((now, mb))

    async def run(self, period: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), period)
            except TimeoutError:
                pass
        self.sample()


class LoopLag:
    """How late this process's loop wakes from short sleeps (it also runs the WAN relays)."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self, stop: asyncio.Event, period: float = 0.05) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(period)
            self.lags.append(time.monotonic() - t0 - period)

    def summary(self) -> str:
        lags = np.array(self.lags or [0.0]) * 1000
        return f"P50 {np.percentile(lags, 50):.1f} ms, P99 {np.percentile(lags, 99):.1f} ms, max {lags.max():.0f} ms"


async def seconds_to_converge(dep: LocalDeployment, timeout: float) -> float | None:
    """Seconds until every edge's views equal the shards' exact state, None if not within timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if await dep.views_converged():
                return time.monotonic() - t0
        except (RuntimeError, TimeoutError, ConnectionError):
            pass  # an admin query that did not get through: ask again
        await asyncio.sleep(0.5)
    return None


class HostileTraffic:
    """Slow uploads and slowloris connections against one edge, over raw sockets; each
    connection reconnects whenever the edge refuses or closes it."""

    def __init__(self, host: str, port: int, uploads: int, upload_mb: float, slowloris: int,
                 upload_kib_s: float = 256.0) -> None:
        self.host, self.port, self.upload_pause = host, port, 64.0 / upload_kib_s
        self.uploads, self.upload_bytes, self.slowloris = uploads, int(upload_mb * (1 << 20)), slowloris
        self.connections = 0
        self.refusals: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [self._upload(stop, i) for i in range(self.uploads)]
        tasks += [self._loris(stop, i) for i in range(self.slowloris)]
        await asyncio.gather(*tasks)

    async def _connect(self, stop: asyncio.Event, delay: float):
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.connections += 1
                return reader, writer
            except OSError:
                await asyncio.sleep(delay)
        return None, None

    def _note(self, head: bytes) -> None:
        status = head.split(b" ", 2)[1].decode(errors="replace") if head.startswith(b"HTTP/") else "closed"
        self.refusals[status] = self.refusals.get(status, 0) + 1

    async def _until_closed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            send, stop: asyncio.Event) -> None:
        """Run ``send`` (a coroutine writing slowly) until the edge answers or closes."""
        answer = asyncio.ensure_future(reader.read(64))
        sending = asyncio.ensure_future(send(writer))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({answer, sending, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (sending, stopping):
            task.cancel()
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            self._note(answer.result())
        else:
            answer.cancel()
        writer.close()

    async def _upload(self, stop: asyncio.Event, i: int) -> None:
        chunk = b"x" * 65536
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n").encode()

        async def send(writer: asyncio.StreamWriter) -> None:
            writer.write(head)
            sent = 0
            while sent < self.upload_bytes:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                await writer.drain()
                await asyncio.sleep(self.upload_pause)
            await asyncio.Event().wait()  # then stall

        while not stop.is_set():
            reader, writer = await self._connect(stop, 0.2)
            if writer is None:
                return
            try:
                await self._until_closed(reader, writer, send, stop)
            except OSError:
                pass

    async def _loris(self, stop: asyncio.Event, i: int) -> None:
        async def send(writer: asyncio.StreamWriter) -> None:
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: {self.host}\r\n".encode())
            n = 0
            while True:
                await asyncio.sleep(2.0 + (i % 10) / 10)
                writer.write(f"X-Slow-{n}: {'a' * 32}\r\n".encode())
                n += 1
                await writer.drain()

        await asyncio.sleep((i % 100) / 50)  # spread the connects
        while not stop.is_set():
            reader, writer = await self._connect(stop, 0.5)
            if writer is None:
                return
            try:
                await self._until_closed(reader, writer, send, stop)
            except OSError:
                pass


def _attack(hostile: HostileTraffic, seconds: float, answers) -> None:
    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await hostile.run(stop)

    asyncio.run(run())
    answers.put((hostile.connections, hostile.refusals, time.process_time()))


def idle_timeouts(logs: Path) -> int:
    return sum(path.read_text(errors="replace").count('"reason": "Idle timeout"') for path in logs.glob("*.log"))


def summarise_rss(samples: dict[str, list[tuple[float, float]]], warm_after: float) -> list[dict]:
    rows = []
    for name, points in sorted(samples.items()):
        t = np.array([p[0] for p in points])
        mb = np.array([p[1] for p in points])
        steady = t >= warm_after
        if steady.sum() < 2:
            steady = np.ones_like(t, dtype=bool)
        ts, ms = t[steady], mb[steady]
        slope = float(np.polyfit(ts / 60.0, ms, 1)[0]) if len(ts) >= 2 and np.ptp(ts) > 0 else 0.0
        rows.append({"process": name, "samples": len(points), "first": mb[0], "warm": ms[0], "last": mb[-1],
                     "max": mb.max(), "growth": mb[-1] - ms[0], "slope": slope})
    return rows


def render(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    cells = [[fmt.format(r[key]) for _, key, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(columns)]
    out = ["  ".join(h.ljust(w) for (h, _, _), w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


async def drive(dep: LocalDeployment, rate: float, seconds: float, max_in_flight: int, seed: int,
                started: list[float] | None = None) -> tuple[list[Outcome], int]:
    """Open-loop requests at ``rate`` per second for ``seconds``; returns outcomes and how many
    starts were skipped because ``max_in_flight`` requests were already running (``started``,
    if given, gets each outcome's start time, in outcome order)."""
    regions = list(dep.spec.workers)
    workload = bundled_workload(2000, regions, seed=seed)
    results: list[Outcome] = []
    skipped = 0
    in_flight: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(req):
            t0 = time.monotonic()
            try:
                outcome = await _one(session, dep.edge_url(req.region), req)
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                # demo._one counts HTTP errors; a request past the client timeout fails here.
                outcome = Outcome(req.region, 0, 0, 0, 0, 0, "", False)
            results.append(outcome)
            if started is not None:
                started.append(t0)

        start = time.monotonic()
        for i, req in enumerate(itertools.cycle(workload)):
            due = start + i / rate
            if due - start >= seconds:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if len(in_flight) >= max_in_flight:
                skipped += 1
                continue
            task = asyncio.create_task(one(req))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)
    return results, skipped


async def soak(args) -> int:
    spec = DeploymentSpec()
    if args.one_way_ms is not None:
        spec = replace(spec, one_way_ms={k: args.one_way_ms for k in spec.one_way_ms})
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvcompass-soak-"))
    dep = LocalDeployment(spec, root, time_scale=args.time_scale, jitter=args.jitter, loss=args.loss)
    seconds = args.minutes * 60.0
    t_start = time.monotonic()
    print(f"starting the demo deployment ({sum(spec.workers.values())} workers, {len(spec.workers)} edges, "
          f"{spec.shards} maintenance units; WAN one-way {sorted(set(spec.one_way_ms.values()))} ms, "
          f"loss {args.loss:.0%}, jitter {args.jitter:.0%}) ...", flush=True)
    try:
        # Under heavy WAN loss the first snapshots can take a while to cross: a longer wait.
        await dep.start(timeout=args.ready_timeout)
        print(f"ready after {time.monotonic() - t_start:.1f} s; {args.rate} req/s for {args.minutes} min ...", flush=True)
        sampler, lag = RssSampler(dep), LoopLag()
        target_region = next(iter(spec.workers))
        target_key = f"edge:{dep.cfg.edges_in(target_region)[0].id}"
        target_pid = dep.nodes[target_key].proc.pid
        idle_rss = rss_mb(target_pid) if args.hostile else None
        cpu_start = cpu_seconds(target_pid)
        stop = asyncio.Event()
        sampling = asyncio.gather(sampler.run(args.sample_s, stop), lag.run(stop))
        starts: list[float] = []
        t_run = time.monotonic()
        driving = asyncio.ensure_future(drive(dep, args.rate, seconds, args.max_in_flight, args.seed, starts))
        hostile = None
        if args.hostile:
            await asyncio.sleep(seconds / 2)
            host, _, port = dep.cfg.edges_in(target_region)[0].http.rpartition(":")
            hostile = HostileTraffic(host, int(port), args.hostile_uploads, args.hostile_upload_mb,
                                     args.hostile_slowloris, args.hostile_upload_kib_s)
            t_attack = time.monotonic()
            cpu_attack = cpu_seconds(target_pid)
            # Its own process: this one's loop runs the WAN relays, which the attack must not slow.
            answers: multiprocessing.Queue = multiprocessing.Queue()
            attacker = multiprocessing.Process(target=_attack, args=(hostile, seconds - (t_attack - t_run), answers))
            attacker.start()
            results, skipped = await driving
            hostile.connections, hostile.refusals, attacker_cpu = await asyncio.to_thread(answers.get)
            cpu_end, t_end = cpu_seconds(target_pid), time.monotonic()
            await asyncio.to_thread(attacker.join)
            await asyncio.sleep(args.sample_s)  # its connections close and their bodies are dropped
            after_rss = rss_mb(dep.nodes[target_key].proc.pid)
        else:
            results, skipped = await driving
        stop.set()
        await sampling
        converged = await seconds_to_converge(dep, args.converge_timeout)
        died = [key for key, node in dep.nodes.items() if not node.alive]
    finally:
        await dep.stop()
    ok = [r for r in results if r.ok]
    failed = len(results) - len(ok)
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = np.array([r.ttft for r in ok]) * 1000 if ok else np.zeros(1)
    rows = summarise_rss(sampler.samples, warm_after=args.warmup * seconds)
    print()
    print(render(rows, [("process", "process", "{}"), ("samples", "samples", "{}"),
                        ("first MB", "first", "{:.1f}"), ("warm MB", "warm", "{:.1f}"), ("last MB", "last", "{:.1f}"),
                        ("max MB", "max", "{:.1f}"), ("growth MB", "growth", "{:+.1f}"),
                        ("slope MB/min", "slope", "{:+.2f}")]))
    print()
    print(f"requests: {len(results)} sent, {len(ok)} served, {failed} failed, {skipped} starts skipped "
          f"(>{args.max_in_flight} in flight)")
    print(f"hit rate (cached / prompt tokens): {sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0:.1%}; "
          f"TTFT P50 {np.percentile(ttft, 50):.0f} ms, P99 {np.percentile(ttft, 99):.0f} ms; "
          f"cross-region served: {sum(1 for r in ok if r.worker_region and r.worker_region != r.region)}")
    print(f"loop lag of this process (WAN relays): {lag.summary()}; connections lost to an idle timeout "
          f"(as the daemons logged them, each end counts): {idle_timeouts(root / 'logs')}")
    print("edge views equal the shards' state " + (f"{converged:.1f} s after the last request" if converged is not None
                                                  else f"NOT within {args.converge_timeout:.0f} s"))
    if hostile is not None:
        attack_at = t_attack - sampler.t0
        edge_rss = sampler.samples.get(target_key, [])
        quiet_rss = [mb for t, mb in edge_rss if t < attack_at]
        attack_rss = [mb for t, mb in edge_rss if t >= attack_at + args.sample_s]
        cut = t_attack - t_run

        def p99_s(values: list[float]) -> float:
            return float(np.percentile(np.array(values), 99)) if values else float("nan")

        def p99(values: list[float]) -> str:
            if not values:
                return "n/a"
            return f"{p99_s(values) * 1000:.0f} ms (P50 {np.percentile(np.array(values), 50) * 1000:.0f} ms)"

        def phase(hostile_phase: bool) -> list[Outcome]:
            return [r for r, t in zip(results, starts) if r.region == target_region and r.ok
                    and ((t - t_run) >= cut) == hostile_phase]

        quiet, attacked = phase(False), phase(True)
        print(f"hostile traffic against {target_key} from {cut:.0f} s: {args.hostile_uploads} slow "
              f"{args.hostile_upload_mb:g} MB uploads ({args.hostile_upload_kib_s:g} KiB/s each) + "
              f"{args.hostile_slowloris} slowloris connections; "
              f"{hostile.connections} connections made; answers {dict(sorted(hostile.refusals.items()))}")
        print(f"  {target_key} RSS: idle {idle_rss:.1f} MB, end of quiet half {quiet_rss[-1] if quiet_rss else 0:.1f} MB, "
              f"under attack max {max(attack_rss, default=0):.1f} MB "
              f"(+{max(attack_rss, default=0) - idle_rss:.1f} MB over idle), {args.sample_s:g} s after it "
              f"{after_rss or 0:.1f} MB")
        print(f"  its served requests: quiet {len(quiet)} (TTFT P99 {p99([r.ttft for r in quiet])}, latency P99 "
              f"{p99([r.total for r in quiet])}), hostile {len(attacked)} (TTFT P99 {p99([r.ttft for r in attacked])}, "
              f"latency P99 {p99([r.total for r in attacked])})")
        print(f"  CPU (cores): {target_key} quiet {(cpu_attack - cpu_start) / cut:.2f}, under attack "
              f"{(cpu_end - cpu_attack) / (t_end - t_attack):.2f}; the attacking process "
              f"{attacker_cpu / (t_end - t_attack):.2f} (on a machine with {os.cpu_count()} cores)")
        attack_growth = max(attack_rss, default=0) - idle_rss
        slowdown = p99_s([r.ttft for r in attacked]) / p99_s([r.ttft for r in quiet])
    long_run = args.minutes >= 3.0
    # Under --hostile the attacked edge's growth is reported above, against its idle RSS.
    attacked = (target_key, "soak (WAN relays, clients)") if hostile is not None else ()
    grown = [r["process"] for r in rows if r["process"] not in attacked and (
             r["growth"] > args.max_growth_mb
             or (long_run and r["slope"] > args.max_slope and r["growth"] > args.max_growth_mb / 2))]
    verdict = []
    if failed:
        verdict.append(f"{failed} requests failed")
    if died:
        verdict.append(f"daemons died: {', '.join(died)}")
    if converged is None:
        verdict.append("edge views did not converge to the shards' state")
    if grown:
        verdict.append(f"RSS grew after warm-up (> {args.max_growth_mb} MB, or > {args.max_slope} MB/min "
                       f"and > {args.max_growth_mb / 2} MB): {', '.join(grown)}")
    if not ok:
        verdict.append("no request served")
    if hostile is not None and attack_growth > args.hostile_max_rss_mb:
        verdict.append(f"{target_key} RSS under attack {attack_growth:+.1f} MB over idle (> {args.hostile_max_rss_mb} MB)")
    if hostile is not None and not slowdown <= args.hostile_max_slowdown:
        verdict.append(f"{target_key} TTFT P99 under attack {slowdown:.2f}x the quiet half's "
                       f"(> {args.hostile_max_slowdown}x)")
    print("verdict: " + ("; ".join(verdict) if verdict else "OK (no errors, memory flat)"))
    if verdict:
        print(f"logs kept under {root / 'logs'}")
    elif not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if verdict else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests started per second")
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=3.0, help="RSS sampling period")
    parser.add_argument("--warmup", type=float, default=0.3, help="fraction of the run before growth is judged")
    parser.add_argument("--max-growth-mb", type=float, default=16.0, help="allowed RSS growth after warm-up")
    parser.add_argument("--max-slope", type=float, default=1.5,
                        help="allowed steady RSS slope in MB/min after warm-up (runs of >= 3 min)")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--loss", type=float, default=0.0, help="WAN packet loss (0..1) on every relay")
    parser.add_argument("--jitter", type=float, default=0.0, help="WAN delay jitter as a fraction of the delay")
    parser.add_argument("--one-way-ms", type=float, default=None, help="set every inter-region one-way delay")
    parser.add_argument("--ready-timeout", type=float, default=180.0,
                        help="seconds to wait for every edge to have all shard views before the run")
    parser.add_argument("--converge-timeout", type=float, default=120.0,
                        help="seconds to wait after the run for every edge's views to equal the shards'")
    parser.add_argument("--hostile", action="store_true",
                        help="add hostile traffic against the first region's edge for the second half of the run")
    parser.add_argument("--hostile-uploads", type=int, default=40, help="slow chunked uploads at once")
    parser.add_argument("--hostile-upload-mb", type=float, default=24.0, help="size of each slow upload")
    parser.add_argument("--hostile-upload-kib-s", type=float, default=256.0, help="rate of each slow upload")
    parser.add_argument("--hostile-max-rss-mb", type=float, default=100.0,
                        help="allowed RSS of the attacked edge over its idle RSS")
    parser.add_argument("--hostile-max-slowdown", type=float, default=2.0,
                        help="allowed ratio of its TTFT P99 under attack to the quiet half's")
    parser.add_argument("--hostile-slowloris", type=int, default=2000, help="slowloris connections at once")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvcompassd.daemon import install_uvloop

    install_uvloop()
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
