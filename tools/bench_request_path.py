"""The edge's request path alone: front door, decision and forward to a worker, CPU per request.

This process runs the edge's request path as the edge daemon builds it (``FrontDoor`` serving
under its ``FrontDoorGuard``, a ``Forwarder`` with a real ``Router`` on an index view where the
worker holds the client's 8 shared prefixes, as the plane's view shows them once served
(``--empty-view``: nothing in it), the client toward workers the edge opens); a ``kvcompassd
emulate-worker --time-scale 0`` is the worker (``--worker-time-scale`` gives it modelled time, so that it decodes and streams token by
token; ``--max-new-tokens`` sets each request's answer, which the client asks for whole, or as
a stream with ``--client-stream``) and a closed-loop client runs in a child process. Nothing
else shares the edge's process (no QUIC, no index updates, no load polls), so its CPU time over
a window divided by the requests served is what one request costs the edge's HTTP and
forwarding path. ``--profile FILE`` writes a cProfile of the measured windows (CPU clock) for
the shares.

    python tools/bench_request_path.py [--concurrency 16] [--seconds 5] [--windows 3] [--direct] [--profile out.prof]

``--against CHECKOUT`` compares this checkout with another in one run: ABBA rounds (the other
checkout, this one, this one, the other), each a run of this tool under that checkout's
``PYTHONPATH``, at every ``--concurrency`` given; it prints each side's median over all its
windows and the ratio. The tool runs either side (a checkout from before ``http_server`` serves
with aiohttp's runner).

    python tools/bench_request_path.py --against ../main --concurrency 1 16 --rounds 1 --windows 5

CPU time per request on a shared machine moves with everything else that runs (one checkout's
runs at load 8-10 spread 900-1,600 us), so a change of a few per cent cannot be read off it.
``--callgrind`` counts instructions instead, which the machine's load does not change: run the
tool under ``valgrind --tool=callgrind --collect-atstart=no --trace-children=no`` (the worker and
the client are other processes, not counted) and each measured window's instructions in this
process are dumped on their own, named with the requests served; ``--callgrind-summary FILE...``
prints instructions per request from those dumps (under valgrind the edge serves some 30x fewer
requests a second, so give it longer windows):

    valgrind --tool=callgrind --collect-atstart=no --trace-children=no --callgrind-out-file=OUT \
        python tools/bench_request_path.py --callgrind --seconds 20 --windows 2
    python tools/bench_request_path.py --callgrind-summary OUT.*

``--stage`` serves the same client with less than the whole path, to tell how much of a
request's CPU each part costs (``--stages`` runs several, each in its own process, in rounds
whose order reverses every other round, and prints each one's median and what it adds to the
one before):

- ``relay``: the front door's HTTP server and the client toward workers alone: the request's
  body read (within the guard's limits) and sent to the worker as it came, the worker's answer
  returned as it came (no JSON, no decision): the floor of this HTTP layer;
- ``parse``: ``relay`` plus the request's JSON parsed, its text tokenized and the worker's body
  written with the ``input_ids`` (``generate_body``), as the front door does;
- ``route``: ``parse`` plus the Router's decision and its bookkeeping of the response (first
  token, end, cache belief), the worker's answer parsed and written again;
- ``full``: the edge's whole path (the default).

    python tools/bench_request_path.py --stages relay parse route full --rounds 2 --windows 3

``--metric-values`` chooses how the request path's counters and histograms keep their values:
``edge`` (the default, process 0's in-process values), ``front-door`` (a front door of ``edge
--workers N``: in-process values published to files each second, ``BufferedMetricValues``) or
``client-multiprocess`` (prometheus_client's own multiprocess values, a getpid and a file write
per update, as front doors had them before), so that callgrind's counts compare them:

    for v in edge front-door client-multiprocess; do valgrind --tool=callgrind --collect-atstart=no \
        --trace-children=no --callgrind-out-file=cg-$v python tools/bench_request_path.py --callgrind \
        --seconds 20 --windows 2 --metric-values $v; done
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import uvloop

from benchlib import callgrind_helper, hold_prompt

from kvcompassd.core.config import dump_config
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.router import Router
from kvcompassd.forwarding import Forwarder
from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
from kvcompassd.httplimits import FrontDoorGuard
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.logs import configure_logging
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import ByteTokenizer


def client_process(url: str, concurrency: int, seconds: float, prefix_chars: int, suffix_chars: int,
                   max_new_tokens: int, stream: bool, out: multiprocessing.Queue) -> None:
    """Closed loop in its own process: ``concurrency`` clients for ``seconds``; puts (served,
    errors, median latency of the served requests in ms)."""

    async def run() -> tuple[int, int, float]:
        served = errors = 0
        latencies: list[float] = []
        prefixes = group_prefixes(prefix_chars)
        stop_at = time.monotonic() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int) -> None:
                nonlocal served, errors
                n = 0
                while time.monotonic() < stop_at:
                    n += 1
                    text = prefixes[(i + n) % 8] + f" {i}-{n} " + "x" * suffix_chars
                    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": stream}
                    try:
                        started = time.perf_counter()
                        async with session.post(url + "/generate", json=body) as resp:
                            await resp.read()
                            if resp.status == 200:
                                served += 1
                                latencies.append((time.perf_counter() - started) * 1e3)
                            else:
                                errors += 1
                    except aiohttp.ClientError:
                        errors += 1
            await asyncio.gather(*(one(i) for i in range(concurrency)))
        return served, errors, statistics.median(latencies) if latencies else float("nan")

    out.put(uvloop.run(run()))


def callgrind_summary(paths: list[str]) -> None:
    """Instructions per request of each window dumped by ``--callgrind``, and their median."""
    per_request = []
    for path in paths:
        text = Path(path).read_text(errors="replace")
        served = re.search(r"^desc: Trigger: Client Request: window-\d+ served=(\d+)", text, re.M)
        totals = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if served is None or totals is None:
            continue  # the dump valgrind writes at exit, or not one of this tool's
        n, ir = int(served.group(1)), int(totals.group(1))
        per_request.append(ir / n)
        print(f"  {path}: {ir:,} instructions over {n} requests: {ir / n:,.0f} per request")
    if per_request:
        print(f"median {statistics.median(per_request):,.0f} instructions per request over {len(per_request)} windows")


STAGES = ("relay", "parse", "route", "full")


def group_prefixes(prefix_chars: int) -> list[str]:
    """The client's 8 prompt groups: each prompt is one of these plus a unique suffix."""
    return [chr(97 + g) * prefix_chars for g in range(8)]


def hold_prefixes(cfg, shard: MaintenanceShard, worker_id: str, prefix_chars: int) -> None:
    """The view as the edge's plane shows it once the worker has served each group: the worker
    holds the client's shared prefixes (``group_prefixes``), so a decision takes the fused path,
    as nearly all of the edge's do under the gateway's load. Over an empty view the pending
    ledger raised nearly every decision into its rescoring path, which the edge's own plane
    takes for a few in a thousand (README, issue 30's entry under "Development")."""
    tokenizer = ByteTokenizer()
    for prefix in group_prefixes(prefix_chars):
        hold_prompt(cfg, [shard], worker_id, tokenizer.encode_array(prefix))
    shard.flush()  # (the batch an edge would get: the snapshot holds it)


def stage_handler(stage: str, guard: FrontDoorGuard, pool, router: Router):
    """The front door's handler for one of ``STAGES`` short of ``full`` (see the module's
    docstring): what the edge's own path does at that stage, in the same calls, without the rest."""
    from kvcompassd.engine.client import generate_body
    from kvcompassd.http_server import Response
    from kvcompassd.httplimits import read_body

    tokenizer = ByteTokenizer()
    headers = b"Content-Type: application/json\r\n"

    async def handle(request):
        body, held = await read_body(request, guard)
        try:
            if stage == "relay":
                out = bytes(body)
            else:
                fields = orjson.loads(body)
                tokens = tokenizer.encode_array(fields["text"])
                if stage == "route":
                    decision = router.decide(tokens, now=time.monotonic())
                out = generate_body(tokens, {"sampling_params": fields.get("sampling_params") or {}})
        finally:
            guard.budget.release(held)
        async with pool.request(b"POST", b"/generate", out, headers) as response:
            answer = await response.read(1 << 24)
        if stage == "route":
            now = time.monotonic()
            reply = orjson.loads(answer)
            meta = reply["meta_info"]
            router.on_first_token(decision.dispatch, now=now)
            router.on_finished(decision.dispatch, prompt_tokens=meta["prompt_tokens"],
                               cached_tokens=meta["cached_tokens"], output_tokens=meta["completion_tokens"], now=now)
            router.on_response(decision.worker, claimed_tokens=decision.claimed_tokens,
                               reused_tokens=meta["cached_tokens"], now=now, tokens=tokens,
                               claimed_tier=decision.tier)
            answer = orjson.dumps(reply)
        return Response(answer)

    return handle


def worker_client():
    """The edge's client toward workers, as edge.py opens it: the lean keep-alive pools, or on a
    checkout from before them (to compare against) aiohttp's session."""
    try:
        from kvcompassd.engine.http1 import WorkerConnections
    except ImportError:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                     connector=aiohttp.TCPConnector(limit=0))
    return WorkerConnections()


async def wait_worker(url: str, proc: subprocess.Popen) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the emulated worker exited with {proc.returncode}")
            try:
                async with session.get(url + "/v1/loads") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("the emulated worker did not come up")


class Listener:
    """The front door listening on a free loopback port, as this checkout's edge serves it:
    ``FrontDoor.serve``, or on a checkout from before it aiohttp's runner (to compare against)."""

    def __init__(self, frontdoor: FrontDoor, guard: FrontDoorGuard) -> None:
        self.frontdoor, self.guard = frontdoor, guard
        self._runner = self._site = None

    async def open(self) -> str:
        if hasattr(self.frontdoor, "serve"):
            _, port = await self.frontdoor.serve("127.0.0.1", 0)
            return f"http://127.0.0.1:{port}"
        from aiohttp import web

        if self._runner is None:
            self._runner = self.guard.runner(self.frontdoor.app)
            await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await self._site.start()
        return f"http://127.0.0.1:{self._site._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._site is None:
            await self.frontdoor.close()
        else:
            await self._site.stop()

    async def cleanup(self) -> None:
        await self.close()
        if self._runner is not None:
            await self._runner.cleanup()


async def main_async(args) -> None:
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False,
                                       vram_kv_tokens=200_000, dram_kv_tokens=0, max_running=64))
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-path-"))
    config = workdir / "cluster.toml"
    config.write_text(dump_config(cfg))
    worker = cfg.workers[0]
    proc = subprocess.Popen([sys.executable, "-m", "kvcompassd", "emulate-worker", "--config", str(config), "--id",
                             worker.id, "--time-scale", str(args.worker_time_scale), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_worker(worker.http, proc)
        layout = IndexLayout.from_config(cfg)
        view = EdgeIndexView(layout, 1, edge=cfg.edges[0].id)
        # (sized as a unit sizes it: a 64-slot table answered false hits past the prefixes)
        shard = MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=cfg.index.initial_capacity)
        if not args.empty_view:
            hold_prefixes(cfg, shard, worker.id, args.prefix_chars)
        view.install_snapshot(shard.snapshot())
        router = Router(cfg, worker.region, view, now=time.monotonic())  # the edge's clock
        publishing = install_metric_values(args.metric_values, workdir / "metrics")  # before the metrics
        metrics = EdgeMetrics()
        if publishing is not None:
            publishing = asyncio.create_task(publishing(metrics, router))
        guard = FrontDoorGuard(cfg.frontdoor, metrics)  # as edge.py builds it
        session = worker_client()
        forwarder = Forwarder(cfg.edges[0].id, router, lambda w: None, session,
                              clock=time.monotonic, metrics=metrics)
        frontdoor = FrontDoor(forwarder, ByteTokenizer(), FrontDoorSettings(model=cfg.model), metrics, guard=guard)
        if args.stage != "full":
            address = urlsplit(worker.http)
            frontdoor.handle = stage_handler(args.stage, guard, session.pool(address.hostname, address.port), router)
        listener = Listener(frontdoor, guard)
        url = await listener.open()
        profiler = cProfile.Profile(time.process_time) if args.profile else None
        helper = callgrind_helper(workdir) if args.callgrind else None
        per_request: list[float] = []
        system_per_request: list[float] = []  # the kernel's part (socket calls on loopback, the epoll wait)
        p50_edge: list[float] = []
        served_per_window: list[int] = []
        errors_per_window: list[int] = []
        p50_direct: list[float] = []  # the same client straight to the worker, in the windows between
        ctx = multiprocessing.get_context("spawn")

        async def closed_loop(target: str) -> tuple[int, int, float, float]:
            out = ctx.Queue()
            client = ctx.Process(target=client_process, args=(target, args.concurrency, args.seconds,
                                                              args.prefix_chars, args.suffix_chars,
                                                              args.max_new_tokens, args.client_stream, out))
            client.start()
            await asyncio.sleep(0.5)  # the child's interpreter starting is not the edge's
            cpu0, system0 = time.process_time(), os.times().system
            if profiler is not None and measured:
                profiler.enable()
            if helper is not None and measured:
                helper.kvc_bench_zero()
                helper.kvc_bench_toggle()
            served, errors, p50 = await asyncio.to_thread(out.get)
            if profiler is not None and measured:
                profiler.disable()
            if helper is not None and measured:
                helper.kvc_bench_toggle()
                helper.kvc_bench_dump(f"window-{window} served={served}".encode())
            cpu, system = time.process_time() - cpu0, os.times().system - system0
            await asyncio.to_thread(client.join)
            return served, errors, p50, cpu, system

        for window in range(args.windows + 1):  # the first warms up, unmeasured
            measured = bool(window)
            served, errors, p50, cpu, system = await closed_loop(url)
            if window:
                served_per_window.append(served)
                errors_per_window.append(errors)
            if window and served:
                per_request.append(cpu / served * 1e6)
                system_per_request.append(system / served * 1e6)
                p50_edge.append(p50)
                print(f"  window {window}: {served} requests ({errors} errors), edge CPU {cpu / served * 1e6:.0f} "
                      f"us/request (kernel {system / served * 1e6:.0f}), P50 {p50:.2f} ms, load average {os.getloadavg()[0]:.2f}", flush=True)
            if window and args.direct:
                measured = False
                await listener.close()  # direct: no listening front door while the client goes straight to the worker
                served, errors, p50, _, _ = await closed_loop(worker.http)
                url = await listener.open()
                if served:
                    p50_direct.append(p50)
                    print(f"  direct {window}: {served} requests ({errors} errors), P50 {p50:.2f} ms, "
                          f"load average {os.getloadavg()[0]:.2f}", flush=True)
        if publishing is not None:
            publishing.cancel()
        await listener.cleanup()
        await forwarder.close()
        await session.close()
        result = {"concurrency": args.concurrency, "stage": args.stage, "us_per_request": per_request,
                  "served": served_per_window, "errors": errors_per_window,
                  "median_us": statistics.median(per_request) if per_request else float("nan"),
                  "p50_ms": p50_edge, "direct_p50_ms": p50_direct,
                  "added_p50_ms": (statistics.median(p50_edge) - statistics.median(p50_direct)
                                   if p50_edge and p50_direct else None),
                  "load_average": os.getloadavg()}
        print(f"edge request path ({args.stage}), c = {args.concurrency}: median {result['median_us']:.0f} us of CPU per request over "
              f"{len(per_request)} windows of {args.seconds:g} s"
              + (f"; added P50 {result['added_p50_ms']:.2f} ms" if result["added_p50_ms"] is not None else "")
              + f"; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        if profiler is not None:
            profiler.dump_stats(args.profile)
    finally:
        proc.terminate()
        proc.wait()


def install_metric_values(kind: str, directory: Path):
    """Make every metric made after this keep its values as ``kind`` says (see the module's
    docstring); for ``front-door``, the coroutine that publishes them as a front door does."""
    if kind == "edge":
        return None
    directory.mkdir()
    from prometheus_client import values

    if kind == "client-multiprocess":
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        values.ValueClass = values.MultiProcessValue()
        return None
    from kvcompassd.metrics_front_doors import PUBLISH_PERIOD_S, BufferedMetricValues, FrontDoorPublisher

    buffered = BufferedMetricValues(directory)
    buffered.install()

    async def publish(metrics, router) -> None:
        publisher = FrontDoorPublisher(metrics, lambda: router.hot.hot_misses, buffered)
        while True:
            publisher.publish()
            await asyncio.sleep(PUBLISH_PERIOD_S)

    return publish


def _child_command(args, concurrency: int, out: Path) -> list[str]:
    """This tool's command for one run at ``concurrency`` with ``args``' load and windows,
    writing its figures to ``out`` (``--against`` and ``--stages`` run one per round)."""
    return [sys.executable, __file__, "--concurrency", str(concurrency), "--seconds", str(args.seconds),
            "--windows", str(args.windows), "--prefix-chars", str(args.prefix_chars),
            "--suffix-chars", str(args.suffix_chars), "--log-level", args.log_level, "--json", str(out),
            "--max-new-tokens", str(args.max_new_tokens), "--worker-time-scale", str(args.worker_time_scale),
            *(["--client-stream"] if args.client_stream else []), *(["--empty-view"] if args.empty_view else [])]


def compare(args) -> None:
    """ABBA runs of this tool under two checkouts' PYTHONPATHs; pooled medians and ratios."""
    here = str(Path(__file__).resolve().parents[1])
    other = str(Path(args.against).resolve())
    results: dict[tuple[int, str], list[float]] = {}
    p50s: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-abba-") as tmp:
        for concurrency in args.concurrency:
            for round_ in range(args.rounds):
                for step, (label, path) in enumerate((("other", other), ("this", here), ("this", here),
                                                      ("other", other))):
                    out = Path(tmp) / f"{concurrency}-{round_}-{step}.json"
                    cmd = _child_command(args, concurrency, out)
                    print(f"[{label}: {path}, c = {concurrency}]", flush=True)
                    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path})
                    run = json.loads(out.read_text())
                    results.setdefault((concurrency, label), []).extend(run["us_per_request"])
                    p50s.setdefault((concurrency, label), []).extend(run["p50_ms"])
    summary = []
    for concurrency in args.concurrency:
        this, that = results[(concurrency, "this")], results[(concurrency, "other")]
        line = {"concurrency": concurrency, "this_median_us": statistics.median(this),
                "other_median_us": statistics.median(that),
                "this_p50_ms": statistics.median(p50s[(concurrency, "this")]),
                "other_p50_ms": statistics.median(p50s[(concurrency, "other")]), "windows": len(this)}
        line["ratio"] = line["this_median_us"] / line["other_median_us"]
        summary.append(line)
        print(f"c = {concurrency}: this checkout {line['this_median_us']:.0f} us of edge CPU per request "
              f"(P50 {line['this_p50_ms']:.2f} ms), {other} {line['other_median_us']:.0f} us "
              f"(P50 {line['other_p50_ms']:.2f} ms), medians of {len(this)} windows each; "
              f"ratio {line['ratio']:.2f}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary))


def stages(args) -> None:
    """Each of ``args.stages`` in its own run of this tool per round, the order reversed every
    other round; each stage's median over all its windows and what it adds to the stage before."""
    results: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-stages-") as tmp:
        for concurrency in args.concurrency:
            for round_ in range(args.rounds):
                order = args.stages if round_ % 2 == 0 else args.stages[::-1]
                for stage in order:
                    out = Path(tmp) / f"{concurrency}-{round_}-{stage}.json"
                    cmd = [*_child_command(args, concurrency, out), "--stage", stage]
                    print(f"[{stage}, c = {concurrency}, round {round_ + 1}]", flush=True)
                    subprocess.run(cmd, check=True)
                    results.setdefault((concurrency, stage), []).extend(json.loads(out.read_text())["us_per_request"])
    summary = []
    for concurrency in args.concurrency:
        before = None
        for stage in args.stages:
            median = statistics.median(results[(concurrency, stage)])
            added = "" if before is None else f", {median - before:+.0f} us on the stage before"
            print(f"c = {concurrency}, {stage}: {median:.0f} us of edge CPU per request (median of "
                  f"{len(results[(concurrency, stage)])} windows){added}", flush=True)
            summary.append({"concurrency": concurrency, "stage": stage, "median_us": median,
                            "us_per_request": results[(concurrency, stage)]})
            before = median
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16],
                   help="one value; several with --against")
    p.add_argument("--against", metavar="CHECKOUT", help="ABBA against another checkout (its root directory)")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds per concurrency with --against or --stages")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--direct", action="store_true",
                   help="after each measured window, one with the same client straight to the worker: added P50")
    p.add_argument("--stage", choices=STAGES, default="full", help="serve with this much of the path (docstring)")
    p.add_argument("--stages", choices=STAGES, nargs="+", help="several stages, each in its own process, in rounds")
    p.add_argument("--max-new-tokens", type=int, default=8, help="each request's answer")
    p.add_argument("--client-stream", action="store_true", help="the client asks for a stream (else the answer whole)")
    p.add_argument("--worker-time-scale", type=float, default=0.0,
                   help="the emulated worker's --time-scale (0: no modelled time; > 0: it decodes, and streams, token by token)")
    p.add_argument("--prefix-chars", type=int, default=1500)
    p.add_argument("--suffix-chars", type=int, default=500)
    p.add_argument("--profile", metavar="FILE", help="cProfile of the measured windows (CPU clock)")
    p.add_argument("--callgrind", action="store_true",
                   help="under callgrind: count this process's instructions over each measured window (see above)")
    p.add_argument("--callgrind-summary", metavar="FILE", nargs="+", help="instructions per request of the dumps")
    p.add_argument("--metric-values", choices=("edge", "front-door", "client-multiprocess"), default="edge",
                   help="how the metrics keep their values: the edge process's, a front door's of edge --workers N, "
                   "or prometheus_client's multiprocess values (see above)")
    p.add_argument("--empty-view", action="store_true",
                   help="decide over an empty view (before 2026-12-07: the pending ledger then raises nearly every decision)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--log-level", default="warning", help="the edge daemon's default is info: a line per request")
    args = p.parse_args()
    if args.callgrind_summary:
        callgrind_summary(args.callgrind_summary)
        return
    if args.against:
        compare(args)
        return
    if args.stages:
        stages(args)
        return
    if len(args.concurrency) != 1:
        p.error("several --concurrency values need --against or --stages")
    args.concurrency = args.concurrency[0]
    configure_logging(args.log_level, json=True, node="edge-bench")
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
