"""The kvcompassd edge against the public routers, each alone in front of the same emulated workers.

Arms: ``kvcompassd`` (the whole plane: maintenance unit, one agent per worker, the edge, started
with ``kvcompassd.launcher``) and the routers that install from PyPI: ``smg`` 1.13.0,
``sglang-router`` 0.3.2 and ``vllm-router`` 0.1.17, each with its ``cache_aware`` policy. The
workers are ``kvcompassd emulate-worker`` processes, worker i with ``--seed i+1``, so who served a
request is read off its output tokens (never taken from the router's word).

Per arm and concurrency the windows run ABBA around the arm's start: direct windows at every
concurrency, the router started, router windows at every concurrency and again in reverse, the
router stopped, direct windows in reverse. "Direct" is client-side round robin over the workers
with nothing of any router running (the kvcompassd plane's processes are stopped, not idle).
Every window starts from empty worker caches (``/flush_cache``) and an unmeasured warm-up.

Load: a closed loop of ``c`` clients POSTing SGLang ``/generate``: one of ``--groups`` shared
prefixes (``--prefix-chars`` bytes) plus a unique suffix (``--suffix-chars``), ``max_new_tokens``
8. Modes: ``zero-delay`` (``--time-scale 0``, ample VRAM: what the router costs) and ``service``
(the emulator's A100 timing model at ``--time-scale 1``, VRAM of 16,384 then 8,192 tokens per
worker: what its routing buys).

``--edges N`` runs N edges in the workers' region, the clients' requests taken round robin over
them (their CPU summed as "edge"): each edge then sees the other's dispatches only through the
agents' load readings, which one edge's own charges otherwise stand in for. ``--load-poll-ms``
sets the agents' fast load-reading period, ``--idle`` an ``[idle]`` setting.

Printed per mode, arm and concurrency: throughput ÷ direct, added P50/P99 and mean latency,
the router's CPU per request from ``/proc/<pid>/stat`` (kvcompassd's edge, agents and maintenance
unit separately), prefix affinity (share of a group's requests its top worker served) and
reuse (share of requests whose worker had the group's prefix cached: ``meta_info.cached_tokens``);
then each router's idle CPU (and what its health checks or load polls cost the idle workers),
sampled once its start-up work has died down (a kvcompassd plane first replays each worker's
KV-event history into its agent).

The public routers run from their own venv (``--routers-venv``; the project's test extra pins
sglang-router 0.2.0 for SGLang's mini_lb, so they cannot share the project's). The tool creates
it when it lacks them, as::

    python -m venv VENV && VENV/bin/pip install smg==1.13.0 sglang-router==0.3.2 vllm-router==0.1.17

    python tools/bench_gateway.py --quick                    # ~2 minutes: zero-delay, short windows
    python tools/bench_gateway.py                            # the issue's run (~1 hour)
    python tools/bench_gateway.py --routers kvcompassd smg --modes zero-delay --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from benchlib import cpu_seconds, load_average, percentile, quiet_logs, setting_parser  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvcompassd.emulator.server import output_tokens  # noqa: E402
from kvcompassd.launcher import DeploymentSpec, LocalDeployment, free_loopback_port  # noqa: E402

KVCOMPASSD = "kvcompassd"
ROUTER_PINS = {"smg": "smg==1.13.0", "sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
ARMS = (KVCOMPASSD, *ROUTER_PINS)
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcompassd" / "bench-routers"
AMPLE_VRAM_TOKENS = 200_000
# Runs ``python -m kvcompassd ...`` under cProfile with the process's CPU clock (so that time spent
# waiting for a core on a loaded machine is not charged to whatever function was running).
PROFILED = """import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = sys.argv[2:]
profiler = cProfile.Profile(time.process_time)
profiler.enable()
try:
    runpy.run_module("kvcompassd", run_name="__main__", alter_sys=True)
finally:
    profiler.disable()
    profiler.dump_stats(out)
"""
SERVICE_VRAM_TOKENS = (16384, 8192)


# -- the pure parts: prompts, attribution, window arithmetic ----------------------------------


class Prompts:
    """Prompts of ``groups`` prefix groups: a shared prefix, then a unique suffix (printable ASCII:
    one byte, one token under the emulator's byte tokenizer)."""

    def __init__(self, groups: int, prefix_chars: int, suffix_chars: int, seed: int, block_size: int = 16):
        rng = random.Random(seed)
        alphabet = "abcdefghijklmnopqrstuvwxyz ,."
        self.prefixes = ["".join(rng.choice(alphabet) for _ in range(prefix_chars)) for _ in range(groups)]
        self.suffix_chars = suffix_chars
        # What a hit on the group's prefix reuses: the whole cache pages of it.
        self.shared_tokens = prefix_chars // block_size * block_size
        self.rng = rng
        self.counter = itertools.count()

    def next(self) -> tuple[int, str]:
        group = self.rng.randrange(len(self.prefixes))
        head = f" q{next(self.counter)} "
        tail = "".join(self.rng.choice("abcdefghij") for _ in range(max(0, self.suffix_chars - len(head))))
        return group, self.prefixes[group] + head + tail


def served_by(text: str, output_ids, seeds: dict[str, int], max_new_tokens: int) -> str | None:
    """The worker whose seed produces ``output_ids`` for ``text`` (byte tokens), None if none does."""
    prompt = list(text.encode())
    wanted = [int(t) for t in output_ids or ()]
    for worker, seed in seeds.items():
        if output_tokens(prompt, max_new_tokens, seed) == wanted:
            return worker
    return None


def prefix_affinity(served: list[tuple[int, str | None]]) -> float:
    """Share of requests served by their group's most frequent worker (request-weighted; 1/N for
    round robin over N workers). An unattributed request counts against its group."""
    per_group: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for group, worker in served:
        per_group[group][worker] += 1
    top = sum(max((n for w, n in c.items() if w is not None), default=0) for c in per_group.values())
    return top / len(served) if served else float("nan")


def reuse_share(cached_tokens: list[int], shared_tokens: int) -> float:
    """Share of requests whose serving worker had the whole shared prefix cached."""
    return sum(c >= shared_tokens for c in cached_tokens) / len(cached_tokens) if cached_tokens else float("nan")


def window_stats(latencies_s: list[float], elapsed_s: float, served: list[tuple[int, str | None]],
                 cached_tokens: list[int], shared_tokens: int, errors: int = 0) -> dict:
    """One measured window's figures."""
    n = len(latencies_s)
    return {
        "requests": n,
        "rps": n / elapsed_s if elapsed_s > 0 else float("nan"),
        "p50_ms": percentile(latencies_s, 50) * 1000,
        "p99_ms": percentile(latencies_s, 99) * 1000,
        "mean_ms": sum(latencies_s) / n * 1000 if n else float("nan"),
        "affinity": prefix_affinity(served),
        "reuse": reuse_share(cached_tokens, shared_tokens),
        "unattributed": sum(w is None for _, w in served),
        "errors": errors,
        "elapsed_s": elapsed_s,
    }


def retries_in_metrics(text: str) -> float:
    """The edge's ``kvcompass_retries_total`` in a Prometheus text page (attempts it moved to
    another worker before the first token: a late or failed worker)."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "kvcompass_retries_total")


def _mean(values) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def quiet_for(rates: list[float], cores: float, slices: int) -> bool:
    """Whether the last ``slices`` of the CPU ``rates`` sampled (cores) were each below ``cores``."""
    return len(rates) >= slices and all(rate < cores for rate in rates[-slices:])


def compare(direct: list[dict], routed: list[dict], idle: dict[str, float] | None = None) -> dict:
    """An arm's ABBA windows at one concurrency against its direct ones: means over each side's
    windows (their order cancels a linear drift of the machine's load). With the arm's ``idle``
    rates (cores), also the CPU per request net of what the process burns idle
    (``cpu_net_us.<process>``): what one more request costs, apart from the fixed cost."""
    d = {k: _mean(w[k] for w in direct) for k in ("rps", "p50_ms", "p99_ms", "mean_ms")}
    r = {k: _mean(w[k] for w in routed) for k in ("rps", "p50_ms", "p99_ms", "mean_ms", "affinity", "reuse")}
    out = {
        "direct_rps": d["rps"], "rps": r["rps"],
        "ratio": r["rps"] / d["rps"] if d["rps"] else float("nan"),
        "added_p50_ms": r["p50_ms"] - d["p50_ms"], "added_p99_ms": r["p99_ms"] - d["p99_ms"],
        "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "mean_ms": r["mean_ms"], "direct_mean_ms": d["mean_ms"],
        "affinity": r["affinity"], "reuse": r["reuse"],
        "direct_affinity": _mean(w["affinity"] for w in direct), "direct_reuse": _mean(w["reuse"] for w in direct),
        "errors": sum(w["errors"] for w in direct + routed),
        "unattributed": sum(w["unattributed"] for w in direct + routed),
        "retries": sum(w.get("retries", 0) for w in routed),
    }
    requests = out["requests"] = sum(w["requests"] for w in routed)
    if all("requests_per_url" in w for w in routed) and routed:
        out["requests_per_url"] = [sum(counts) for counts in zip(*(w["requests_per_url"] for w in routed))]
    for key in {k for w in routed for k in w.get("cpu_s", {})}:
        cpu = sum(w["cpu_s"].get(key, 0.0) for w in routed)
        out[f"cpu_us.{key}"] = cpu / requests * 1e6 if requests else float("nan")
        if idle is not None and key in idle:
            fixed = idle[key] * sum(w["elapsed_s"] for w in routed)
            out[f"cpu_net_us.{key}"] = (cpu - fixed) / requests * 1e6 if requests else float("nan")
    return out


# -- processes: CPU accounting, the routers ----------------------------------------------------


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its live descendants (a router may run its server in a child)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    total, frontier, seen = 0.0, [pid], set()
    while frontier:
        p = frontier.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
        frontier.extend(children.get(p, ()))
    return total


def router_argv(name: str, binary: str, port: int, worker_urls: list[str]) -> list[str]:
    """The command that starts public router ``name`` with its cache-aware policy (from each
    one's ``--help``: smg and sglang-router take a ``launch`` subcommand, vllm-router none)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware"]
    if name in ("smg", "sglang-router"):
        return [binary, "launch", *common, "--log-level", "warn", "--worker-urls", *worker_urls]
    if name == "vllm-router":
        return [binary, *common, "--log-level", "warning", "--worker-urls", *worker_urls]
    raise ValueError(f"unknown router {name!r}")


def routers_in_venv(venv: Path, wanted: list[str], install: bool) -> dict[str, str]:
    """The binaries of ``wanted`` routers in ``venv``; missing ones are pip-installed there first
    (the venv created if need be) when ``install``."""
    binaries = {name: venv / "bin" / name for name in wanted}
    missing = [name for name, path in binaries.items() if not path.exists()]
    if missing and install:
        if not (venv / "bin" / "python").exists():
            print(f"creating {venv} for the public routers", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pins = [ROUTER_PINS[name] for name in missing]
        print(f"installing {' '.join(pins)} into {venv}", file=sys.stderr)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *pins], check=True)
    return {name: str(path) for name, path in binaries.items() if path.exists()}


# -- load --------------------------------------------------------------------------------------


@dataclass
class Window:
    latencies: list[float] = field(default_factory=list)
    served: list[tuple[int, str, list[int]]] = field(default_factory=list)  # (group, text, output ids)
    cached: list[int] = field(default_factory=list)
    per_url: dict[str, int] = field(default_factory=dict)  # requests served through each url
    errors: int = 0
    elapsed: float = 0.0


async def closed_loop(session: aiohttp.ClientSession, urls: list[str], concurrency: int, seconds: float,
                      prompts: Prompts, max_new_tokens: int) -> Window:
    """``concurrency`` clients, each sending its next request when its last one returned; a
    list of several ``urls`` is taken round robin (the direct arm)."""
    window = Window(per_url={u: 0 for u in urls})
    rr = itertools.cycle(urls)
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop_at:
            group, text = prompts.next()
            body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}}
            start = time.perf_counter()
            url = next(rr)
            try:
                async with session.post(url + "/generate", json=body) as resp:
                    data = await resp.json(content_type=None)
                    ok = resp.status == 200 and isinstance(data, dict)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                ok = False
            if not ok:
                window.errors += 1
                continue
            window.latencies.append(time.perf_counter() - start)
            window.per_url[url] += 1
            window.served.append((group, text, data.get("output_ids") or []))
            window.cached.append(int((data.get("meta_info") or {}).get("cached_tokens") or 0))

    began = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    window.elapsed = time.monotonic() - began
    return window


# -- the run -----------------------------------------------------------------------------------


def deployment_spec(args, vram_tokens: int) -> DeploymentSpec:
    """The kvcompassd arm's fleet: one region of emulated workers and ``--edges`` edges, one
    shard, no WAN, with the ``--sync``, ``--score`` and ``--idle`` settings."""
    return DeploymentSpec(workers={"us": args.workers}, one_way_ms={}, shards=1, wan=False,
                          max_running=args.max_running, vram_kv_tokens=vram_tokens, dram_kv_tokens=0,
                          edges_per_region=args.edges, sync=dict(args.sync), score=dict(args.score),
                          idle=dict(args.idle))


class Bench:
    def __init__(self, args, session: aiohttp.ClientSession, mode: str, time_scale: float, vram_tokens: int):
        self.args, self.session, self.mode = args, session, mode
        spec = deployment_spec(args, vram_tokens)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvbench-gateway-"))
        self.seeds = {f"us-{i}": i + 1 for i in range(args.workers)}
        node_args = {f"emulate-worker:{w}": ("--seed", str(seed)) for w, seed in self.seeds.items()}
        self.deployment = LocalDeployment(spec, self.workdir, time_scale=time_scale, node_args=node_args)
        for key in self._plane_keys():  # read when the nodes are spawned
            self.deployment.node_args[key] = ("--log-level", args.plane_log_level)
            if key.startswith("agent:") and args.load_poll_ms is not None:
                self.deployment.node_args[key] += ("--load-poll-ms", str(args.load_poll_ms))
        self.worker_urls = [w.http for w in self.deployment.cfg.workers]
        self.profile_dir = Path(args.profile_edge) if args.profile_edge else None
        self.profile_plane = bool(args.profile_plane)
        self.label = f"{mode} (VRAM {vram_tokens} tokens/worker)"

    def _plane_keys(self) -> list[str]:
        cfg = self.deployment.cfg
        return ([f"maintenance:{m.id}" for m in cfg.maintenance] + [f"edge:{e.id}" for e in cfg.edges]
                + [f"agent:{w.id}" for w in cfg.workers])

    async def start_workers(self) -> None:
        """Start the deployment's processes, then stop all but the workers: direct first."""
        await self.deployment.start(wait=False)
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            keys = self._plane_keys() if self.profile_plane else [f"edge:{e.id}" for e in self.deployment.cfg.edges]
            for key in keys:
                node = self.deployment.nodes[key]
                out = self.profile_dir / f"{self.mode}-{key.replace(':', '-')}.prof"
                node.argv = [sys.executable, "-c", PROFILED, str(out), "kvcompassd", *node.argv[3:]]
        for url in self.worker_urls:
            await self._wait_ok(url + "/v1/loads")
        self.stop_plane()

    def stop_plane(self) -> None:
        for key in self._plane_keys():
            mode, node_id = key.split(":", 1)
            self.deployment.kill(mode, node_id, signal.SIGTERM)

    async def start_plane(self) -> dict[str, list[int]]:
        for key in self._plane_keys():
            mode, node_id = key.split(":", 1)
            self.deployment.restart(mode, node_id)
        await self.deployment.wait_ready()
        nodes = self.deployment.nodes
        cfg = self.deployment.cfg
        return {"edge": [nodes[f"edge:{e.id}"].proc.pid for e in cfg.edges],
                "agents": [nodes[f"agent:{w.id}"].proc.pid for w in cfg.workers],
                "maintenance": [nodes[f"maintenance:{m.id}"].proc.pid for m in cfg.maintenance]}

    async def _wait_ok(self, url: str, timeout: float = 60.0, body: dict | None = None,
                       alive=None, what: str = "answering 200") -> None:
        """Poll ``url`` (POST ``body``, else GET) until it answers 200; ``alive()`` raises if the
        process behind it died (default: the deployment's nodes)."""
        alive = alive or self.deployment._check_alive
        deadline = time.monotonic() + timeout
        while True:
            alive()
            try:
                method = self.session.post if body is not None else self.session.get
                async with method(url, json=body, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not {what} after {timeout} s")
            await asyncio.sleep(0.2)

    async def flush(self) -> None:
        for url in self.worker_urls:
            async with self.session.post(url + "/flush_cache") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url}/flush_cache answered {resp.status}")
        await asyncio.sleep(self.args.settle)  # the plane's withdrawals reach the edge's view

    def edge_urls(self) -> list[str]:
        return [f"http://{e.http}" for e in self.deployment.cfg.edges_in("us")]

    async def window(self, urls: list[str], concurrency: int, pids: dict[str, list[int]], seed: int,
                     metrics_urls: list[str] = ()) -> dict:
        """One measured window; ``metrics_urls`` (the edges') also count their retries in it."""
        args = self.args
        prompts = Prompts(args.groups, args.prefix_chars, args.suffix_chars, seed=seed)
        await self.flush()
        await closed_loop(self.session, urls, concurrency, args.warmup, prompts, args.max_new_tokens)
        retries0 = await self._retries(metrics_urls)
        cpu0 = {k: sum(tree_cpu_seconds(p) for p in v) for k, v in pids.items()}
        w = await closed_loop(self.session, urls, concurrency, self._seconds(), prompts, args.max_new_tokens)
        cpu = {k: sum(tree_cpu_seconds(p) for p in v) - cpu0[k] for k, v in pids.items()}
        retries = await self._retries(metrics_urls) - retries0
        # Attribution after the timed part: it costs the client's CPU.
        served = [(g, served_by(text, ids, self.seeds, args.max_new_tokens)) for g, text, ids in w.served]
        stats = window_stats(w.latencies, w.elapsed, served, w.cached, prompts.shared_tokens, w.errors)
        stats["cpu_s"] = cpu
        stats["requests_per_url"] = list(w.per_url.values())
        stats["load"] = load_average()  # the machine's other load, at the end of this window
        if metrics_urls:
            stats["retries"] = retries
        return stats

    async def _retries(self, metrics_urls: list[str]) -> float:
        total = 0.0
        for url in metrics_urls:
            async with self.session.get(url) as resp:
                total += retries_in_metrics(await resp.text())
        return total

    def _seconds(self) -> float:
        return self.args.seconds if self.mode == "zero-delay" else self.args.service_seconds

    async def until_quiet(self, pids: dict[str, list[int]]) -> float:
        """Wait (1 s slices, up to ``--quiet-limit`` s) until the arm's processes together have
        burnt less than ``--quiet-cores`` for ``--quiet-slices`` slices in a row; returns the
        seconds waited. A starting kvcompassd plane replays each worker's KV-event history into
        its agent (0.6-1 core for seconds after the direct windows' traffic): sampled then, its
        "idle" figure was that catch-up, not idling. The replay starts when an agent's probe of
        its idle engine finds the gap, which can be a quiet second or more after the start."""
        args = self.args
        began = time.monotonic()
        rates: list[float] = []
        while time.monotonic() - began < args.quiet_limit:
            before = sum(tree_cpu_seconds(p) for v in pids.values() for p in v)
            t0 = time.monotonic()
            await asyncio.sleep(1.0)
            rates.append((sum(tree_cpu_seconds(p) for v in pids.values() for p in v) - before) / (time.monotonic() - t0))
            if quiet_for(rates, args.quiet_cores, args.quiet_slices):
                break
        return time.monotonic() - began

    async def idle(self, pids: dict[str, list[int]]) -> dict[str, float]:
        """Cores each process group burns with no requests (the workers' too: polls cost them)."""
        worker_pids = [self.deployment.nodes[f"emulate-worker:{w}"].proc.pid for w in self.seeds]
        groups = {**pids, "workers": worker_pids}
        before = {k: sum(tree_cpu_seconds(p) for p in v) for k, v in groups.items()}
        t0 = time.monotonic()
        await asyncio.sleep(self.args.idle_seconds)
        elapsed = time.monotonic() - t0
        return {k: (sum(tree_cpu_seconds(p) for p in v) - before[k]) / elapsed for k, v in groups.items()}

    async def start_router(self, name: str, binary: str) -> tuple[subprocess.Popen, str]:
        port = free_loopback_port()
        log = open(self.workdir / "logs" / f"{name}.log", "ab")
        with log:
            proc = subprocess.Popen(router_argv(name, binary, port, self.worker_urls), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        probe = {"text": "ready?", "sampling_params": {"max_new_tokens": 1}}
        try:
            await self._wait_router(proc, url + "/generate", probe)
        except BaseException:
            _stop(proc)
            raise
        return proc, url

    async def _wait_router(self, proc: subprocess.Popen, url: str, probe: dict, timeout: float = 90.0) -> None:
        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}; log in {self.workdir / 'logs'}")

        await self._wait_ok(url, timeout, probe, alive, what=f"serving; log in {self.workdir / 'logs'}")

    async def arm(self, name: str, binary: str | None) -> dict:
        """ABBA: direct at each concurrency, the router's windows forth and back, direct back."""
        args = self.args
        cs = list(args.concurrency)
        windows: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
        loads = [load_average()]

        async def direct(order):
            for c in order:
                windows[("direct", c)].append(await self.window(self.worker_urls, c, {}, seed=c))
                _progress(self.label, name, "direct", c, windows[("direct", c)][-1])

        await direct(cs)
        idle_direct = await self.idle({})
        proc = None
        metrics_urls: list[str] = []
        if name == KVCOMPASSD:
            pids = await self.start_plane()
            urls = self.edge_urls()
            metrics_urls = [url + "/metrics" for url in urls]
        else:
            proc, url = await self.start_router(name, binary)
            urls, pids = [url], {"router": [proc.pid]}
        try:
            await asyncio.sleep(args.idle_settle)  # start-up work (connections, first health checks) done
            quiet_wait_s = await self.until_quiet(pids)
            idle = await self.idle(pids)
            for c in cs + cs[::-1]:
                windows[("router", c)].append(await self.window(urls, c, pids, seed=c, metrics_urls=metrics_urls))
                _progress(self.label, name, name, c, windows[("router", c)][-1])
        finally:
            if proc is not None:
                _stop(proc)
            else:
                self.stop_plane()
        await direct(cs[::-1])
        loads.append(load_average())
        by_c = {c: compare(windows[("direct", c)], windows[("router", c)], idle) for c in cs}
        for c in cs:  # the machine's load average at the end of each window, in the order they ran
            by_c[c]["window_loads"] = {kind: [w["load"] for w in windows[(kind, c)]] for kind in ("direct", "router")}
        return {"by_c": by_c,
                "edges": len(urls) if name == KVCOMPASSD else 0, "idle": idle, "idle_direct": idle_direct, "idle_after_s": args.idle_settle + quiet_wait_s,
                "loads": loads}

    async def run(self, binaries: dict[str, str]) -> dict:
        await self.start_workers()
        try:
            results = {}
            for name in self.args.routers:
                if name != KVCOMPASSD and name not in binaries:
                    print(f"{name}: not installed in {self.args.routers_venv}; skipped", file=sys.stderr)
                    continue
                results[name] = await self.arm(name, binaries.get(name))
            return results
        finally:
            await self.deployment.stop()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _progress(label: str, arm: str, path: str, c: int, w: dict) -> None:
    cpu = " ".join(f"{k} {v / max(1, w['requests']) * 1e6:.0f}us" for k, v in w.get("cpu_s", {}).items())
    print(f"  [{label}] {arm:<13} {path:<13} c={c:<3} {w['rps']:7.0f} req/s  P50 {w['p50_ms']:7.2f}  "
          f"P99 {w['p99_ms']:7.2f} ms  affinity {w['affinity']:.2f}  reuse {w['reuse']:.2f}  {cpu}"
          f"{'  errors ' + str(w['errors']) if w['errors'] else ''}  load {w.get('load', '?')}", flush=True)


# -- report ------------------------------------------------------------------------------------


def _f(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)


def report(label: str, args, results: dict) -> list[str]:
    lines = [f"\n== {label}: {args.workers} emulated workers, {args.groups} groups of {args.prefix_chars}-char "
             f"prefixes + {args.suffix_chars}-char suffixes, max_new_tokens {args.max_new_tokens}, "
             f"{args.seconds if label.startswith('zero') else args.service_seconds:g} s windows (ABBA: 2 direct + 2 router per point)"]
    header = (f"{'arm':<13}{'c':>4}{'direct/s':>10}{'req/s':>9}{'÷direct':>8}{'+P50ms':>8}{'+P99ms':>9}{'P99ms':>9}"
              f"{'mean ms':>9}{'d.mean':>8}{'CPU us/req':>11}{'edge':>7}{'agents':>8}{'maint':>7}{'net':>7}"
              f"{'affin':>7}{'reuse':>7}{'d.reuse':>8}")
    lines += [header, "-" * len(header)]
    for name, r in results.items():
        for c, x in r["by_c"].items():
            parts = {k.split(".", 1)[1]: v for k, v in x.items() if k.startswith("cpu_us.")}
            total = sum(parts.values())
            # The router's own process net of its idle burn (kvcompassd: the edge's).
            net = x.get("cpu_net_us.edge", x.get("cpu_net_us.router", float("nan")))
            lines.append(
                f"{name:<13}{c:>4}{_f(x['direct_rps'], '.0f'):>10}{_f(x['rps'], '.0f'):>9}{_f(x['ratio'], '.2f'):>8}"
                f"{_f(x['added_p50_ms'], '+.2f'):>8}{_f(x['added_p99_ms'], '+.2f'):>9}{_f(x['p99_ms'], '.1f'):>9}"
                f"{_f(x['mean_ms'], '.2f'):>9}{_f(x['direct_mean_ms'], '.2f'):>8}{_f(total, '.0f'):>11}"
                f"{_f(parts.get('edge', float('nan')), '.0f'):>7}{_f(parts.get('agents', float('nan')), '.0f'):>8}"
                f"{_f(parts.get('maintenance', float('nan')), '.0f'):>7}{_f(net, '.0f'):>7}{_f(x['affinity'], '.2f'):>7}"
                f"{_f(x['reuse'], '.2f'):>7}{_f(x['direct_reuse'], '.2f'):>8}"
                + (f"  errors {x['errors']}" if x["errors"] else "")
                + (f"  retries {x['retries']:.0f}" if x.get("retries") else "")
                + (f"  unattributed {x['unattributed']}" if x["unattributed"] else ""))
    lines.append("idle, cores (no requests; 'workers' = what the arm's polls and health checks cost the workers, "
                 "'workers alone' = the same with nothing of any router running):")
    for name, r in results.items():
        idle = ", ".join(f"{k} {v:.3f}" for k, v in r["idle"].items())
        lines.append(f"  {name:<13} {idle}; workers alone {r['idle_direct']['workers']:.3f}; "
                     f"sampled {r['idle_after_s']:.0f} s after start; load average {r['loads'][0]} -> {r['loads'][1]}")
    return lines


async def main_async(args) -> None:
    quiet_logs()
    binaries = {}
    external = [n for n in args.routers if n != KVCOMPASSD]
    if external:
        binaries = routers_in_venv(Path(args.routers_venv), external, install=args.install)
    plans = []
    if "zero-delay" in args.modes:
        plans.append(("zero-delay", 0.0, args.ample_vram_tokens))
    if "service" in args.modes:
        plans += [("service", 1.0, v) for v in args.service_vram_tokens]
    print(f"bench_gateway: arms {', '.join(args.routers)}; concurrency {args.concurrency}; {os.cpu_count()} cores; "
          f"load average {load_average()}" + (f"; kvcompassd [sync] {dict(args.sync)}" if args.sync else "")
          + (f"; kvcompassd [score] {dict(args.score)}" if args.score else "")
          + (f"; kvcompassd [idle] {dict(args.idle)}" if args.idle else "")
          + (f"; {args.edges} kvcompassd edges" if args.edges > 1 else "")
          + (f"; agents' --load-poll-ms {args.load_poll_ms:g}" if args.load_poll_ms is not None else ""), flush=True)
    out: list[str] = []
    everything: dict[str, dict] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        for mode, time_scale, vram in plans:
            bench = Bench(args, session, mode, time_scale, vram)
            results = await bench.run(binaries)
            out += report(bench.label, args, results)
            everything[bench.label] = results
            if not args.keep_logs:
                shutil.rmtree(bench.workdir, ignore_errors=True)
    print("\n".join(out))
    print("\nCPU us/req: the arm's processes' user+system CPU over its measured windows ÷ requests served "
          "(kvcompassd: edge + agents + maintenance unit); net: the router's (kvcompassd: the edge's) less its "
          "idle burn over the windows, i.e. what a request adds. affin: share of each prefix group's requests served "
          "by its top worker (read off the output tokens). reuse: share served with the whole prefix cached "
          f"(d.reuse: direct round robin's). Load average at the end: {load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1, default=str))


sync_setting, score_setting, idle_setting = setting_parser("sync"), setting_parser("score"), setting_parser("idle")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--modes", nargs="+", choices=("zero-delay", "service"), default=["zero-delay", "service"])
    p.add_argument("--routers-venv", default=str(DEFAULT_VENV), help="venv holding the public routers")
    p.add_argument("--install", action=argparse.BooleanOptionalAction, default=True,
                   help="pip-install missing routers into --routers-venv")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-running", type=int, default=64, help="each emulated worker's batch limit")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per zero-delay window")
    p.add_argument("--service-seconds", type=float, default=30.0, help="measured seconds per service-time window")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each window")
    p.add_argument("--settle", type=float, default=0.3, help="seconds after a cache flush")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="CPU of each idle arm is sampled this long")
    p.add_argument("--idle-settle", type=float, default=2.0, help="seconds after an arm starts before its idle sample")
    p.add_argument("--quiet-cores", type=float, default=0.1,
                   help="then wait until the arm's processes burn less than this many cores (1 s slices)")
    p.add_argument("--quiet-limit", type=float, default=30.0, help="... for at most this many seconds")
    p.add_argument("--quiet-slices", type=int, default=3, help="... this many 1 s slices in a row")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-chars", type=int, default=1500)
    p.add_argument("--suffix-chars", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--ample-vram-tokens", type=int, default=AMPLE_VRAM_TOKENS)
    p.add_argument("--service-vram-tokens", type=int, nargs="+", default=list(SERVICE_VRAM_TOKENS))
    p.add_argument("--plane-log-level", default="warning", help="the kvcompassd daemons' (the routers run at warn)")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--profile-edge", metavar="DIR",
                   help="run the edge under cProfile (CPU clock), DIR/<mode>-edge-<id>.prof")
    p.add_argument("--profile-plane", action="store_true",
                   help="with --profile-edge: the agents and maintenance units too (DIR/<mode>-<role>-<id>.prof)")
    p.add_argument("--sync", type=sync_setting, action="append", default=[], metavar="NAME=NUMBER",
                   help="a [sync] setting of the kvcompassd plane (repeatable), e.g. report_delay_ms=50")
    p.add_argument("--score", type=score_setting, action="append", default=[], metavar="NAME=NUMBER",
                   help="a [score] setting of the kvcompassd plane (repeatable), e.g. copy_weight=2")
    p.add_argument("--idle", type=idle_setting, action="append", default=[], metavar="NAME=NUMBER",
                   help="an [idle] setting of the kvcompassd plane (repeatable), e.g. load_tolerance_ms=0")
    p.add_argument("--edges", type=int, default=1,
                   help="kvcompassd edges in the workers' region; requests are taken round robin over them")
    p.add_argument("--load-poll-ms", type=float, default=None, metavar="MS",
                   help="the kvcompassd agents' fast load-reading period (their default: 20)")
    p.add_argument("--json", help="also write the results here (mode -> arm -> figures)")
    p.add_argument("--quick", action="store_true", help="zero-delay only, 1 s windows (~2 minutes)")
    args = p.parse_args(argv)
    if args.edges < 1:
        p.error("--edges must be at least 1")
    if args.load_poll_ms is not None and not 0 < args.load_poll_ms <= 10_000:
        p.error("--load-poll-ms must be in (0, 10000], as the agents take it")
    if args.quick:
        args.modes = ["zero-delay"]
        args.seconds, args.warmup, args.idle_seconds, args.settle, args.idle_settle = 1.0, 0.3, 1.0, 0.2, 0.5
    return args


def main(argv: list[str] | None = None) -> None:
    uvloop.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
