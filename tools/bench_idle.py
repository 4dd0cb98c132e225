"""What a deployment costs while it serves nothing, and per request it serves: CPU of every
daemon, per worker.

    .venv/bin/python tools/bench_idle.py                     # 3 idle windows of 20 s, 3 busy of 10 s
    .venv/bin/python tools/bench_idle.py --windows 5 --window-s 30 --busy-windows 0
    .venv/bin/python tools/bench_idle.py --profile /tmp/idle-prof   # + cProfile of the candidate

Starts two loopback deployments of the demo's shape side by side (7 emulated workers at
``--time-scale 0``, 7 agents, 3 edges, 2 maintenance units, no WAN relays): the *reference*
runs the plane's pacing as it was before issue 30 item 4 as far as flags and config reach it
(every agent reads its engine every 20 ms, ``--load-idle-poll-ms 20``; ``[idle] heartbeat_ms``
at the broadcast period, so unchanged load reports and queue vectors go out every period;
``engine_probe_max_ms`` 1000, an idle engine's replay socket probed every second), the
*candidate* at the defaults. The transport's keepalives and the agents' event decoding are
the code's own in both. After both are ready and have settled, it reads every process's CPU
time (``/proc/<pid>/stat``) at the start and end of each window and prints the machine's
load average at each window's end.

Idle: per role, the median over windows of the cores used, the plane (agents, edges,
maintenance units; the emulated workers are the GPU side) per worker, and candidate ÷
reference. Busy: a closed loop of ``--concurrency`` clients per deployment POSTs ``/generate``
to its ``us`` edge (one of 8 shared 1,500-character prefixes plus a unique 500-character
suffix, 8 new tokens) and it prints each role's CPU per served request (median over windows),
gross and net of the role's idle CPU, agents + maintenance ÷ the edges (issue 30's target: at
most 1) and candidate ÷ reference.
Both deployments run in the same windows, so load from other tenants of the machine falls on
both alike.

``--profile DIR`` runs the candidate's agents, edges and maintenance units under cProfile with a
CPU clock (``tools/profile_daemon.py``), over the idle windows (``DIR/<mode>.<id>.1.prof``) and
the busy ones (``.2.prof``, ``.1`` with ``--windows 0``); profiling slows them ~2-3x, so that run's figures are not
comparable with others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, load_average, median, quiet_logs  # noqa: E402

import aiohttp  # noqa: E402

from kvcompassd.core.config import IdleParams  # noqa: E402
from kvcompassd.launcher import DeploymentSpec, LocalDeployment  # noqa: E402

ROLES = ("emulate-worker", "agent", "edge", "maintenance")
PLANE = ("agent", "edge", "maintenance")  # the discovery plane; the emulated workers stand for GPUs


def profile_daemons(dep: LocalDeployment, out_dir: Path) -> None:
    """Make ``dep``'s plane daemons (not the emulated workers) start under tools/profile_daemon.py."""
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["KVC_PROFILE_DIR"] = str(out_dir)  # the daemons inherit it
    wrapper = str(Path(__file__).resolve().parent / "profile_daemon.py")
    make_node = dep._node

    def node(node_id, mode, region, config, extra=()):
        made = make_node(node_id, mode, region, config, extra)
        if mode in PLANE:
            made.argv[1:3] = [wrapper]  # [python, "-m", "kvcompassd", mode, ...] -> [python, wrapper, mode, ...]
        return made

    dep._node = node


def signal_profiled(dep: LocalDeployment | None, sig: int) -> None:
    """SIGUSR1 starts the profiled daemons' profiles, SIGUSR2 stops and writes them."""
    if dep is None:
        return
    for key, node in dep.nodes.items():
        if key.split(":", 1)[0] in PLANE and node.alive:
            node.proc.send_signal(sig)


def role_cpu(dep: LocalDeployment) -> dict[str, float]:
    """CPU seconds used so far by each role's processes in ``dep``."""
    used = dict.fromkeys(ROLES, 0.0)
    for key, node in dep.nodes.items():
        if node.alive:
            used[key.split(":", 1)[0]] += cpu_seconds(node.proc.pid)
    return used


class ClosedLoop:
    """``concurrency`` clients POSTing ``/generate`` to one edge until stopped; counts successes."""

    def __init__(self, url: str, concurrency: int, seed: int) -> None:
        self.url, self.concurrency, self.seed = url, concurrency, seed
        self.served = 0
        self.failed = 0
        self._stop = asyncio.Event()
        rnd = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz "
        self.prefixes = ["".join(rnd.choice(letters) for _ in range(1500)) for _ in range(8)]

    async def _client(self, session: aiohttp.ClientSession, k: int) -> None:
        rnd = random.Random(self.seed * 1000 + k)
        while not self._stop.is_set():
            text = rnd.choice(self.prefixes) + "".join(rnd.choice("abcdefghij ") for _ in range(500))
            try:
                async with session.post(self.url + "/generate",
                                        json={"text": text, "sampling_params": {"max_new_tokens": 8}}) as r:
                    await r.read()
                    if r.status == 200:
                        self.served += 1
                    else:
                        self.failed += 1
            except aiohttp.ClientError:
                self.failed += 1

    async def __aenter__(self) -> ClosedLoop:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._client(self._session, k)) for k in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


async def measure(deployments: dict[str, LocalDeployment], windows: int, window_s: float,
                  served=None) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[int]]]:
    """Per deployment and role, the CPU seconds of each window, and the requests served in it."""
    used: dict[str, dict[str, list[float]]] = {name: {r: [] for r in ROLES} for name in deployments}
    requests: dict[str, list[int]] = {name: [] for name in deployments}
    for window in range(1, windows + 1):
        start = {name: role_cpu(dep) for name, dep in deployments.items()}
        before = {name: served(name) for name in deployments} if served else {}
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        elapsed = time.monotonic() - t0
        for name, dep in deployments.items():
            end = role_cpu(dep)
            for role in ROLES:
                used[name][role].append((end[role] - start[name][role]) / elapsed)
            if served:
                requests[name].append(served(name) - before[name])
        done = {name: requests[name][-1] for name in deployments} if served else {}
        # The machine's other load in this window (both deployments' own share included).
        print(f"window {window}: {elapsed:.1f} s, load average {load_average()}"
              + (f", requests {done}" if served else ""), flush=True)
        if served:
            for name in deployments:  # cores -> CPU seconds per request below
                for role in ROLES:
                    used[name][role][-1] *= elapsed
    return used, requests


def print_idle(cores: dict[str, dict[str, list[float]]], windows: int, window_s: float, workers: int) -> None:
    names = list(cores)
    print(f"idle CPU, {windows} windows of {window_s:g} s, {workers} workers each")
    print(f"{'role':<22}" + "".join(f"{name:>30}" for name in names) + f"{'ratio':>8}")
    plane = {name: [sum(cores[name][r][i] for r in PLANE) for i in range(windows)] for name in names}
    total = {name: [sum(cores[name][r][i] for r in ROLES) for i in range(windows)] for name in names}
    rows = [(role, [median(cores[name][role]) for name in names]) for role in ROLES]
    rows.append(("plane (no workers)", [median(plane[name]) for name in names]))
    rows.append(("all", [median(total[name]) for name in names]))
    rows.append(("plane per worker", [median(plane[name]) / workers for name in names]))
    for role, (ref, cand) in rows:
        ratio = cand / ref if ref > 0 else float("nan")
        print(f"{role:<22}{ref:>25.4f} core{cand:>25.4f} core{ratio:>8.2f}")


def print_busy(cpu: dict[str, dict[str, list[float]]], requests: dict[str, list[int]], windows: int,
               window_s: float, idle: dict[str, dict[str, list[float]]] | None) -> None:
    """Each role's CPU per served request: gross (all it used in the window), and net of what
    it uses idle (the idle windows' median, when measured): what serving added."""
    names = list(cpu)
    print(f"CPU per served request, {windows} windows of {window_s:g} s (requests per window: "
          + ", ".join(f"{name} {requests[name]}" for name in names) + ")")
    print(f"{'role':<34}" + "".join(f"{name:>30}" for name in names) + f"{'ratio':>8}")

    def used(name: str, roles: tuple[str, ...], i: int, net: bool) -> float:
        base = sum(median(idle[name][r]) for r in roles) * window_s if net and idle else 0.0
        return max(0.0, sum(cpu[name][r][i] for r in roles) - base)

    def per_request(name: str, roles: tuple[str, ...], net: bool) -> float:
        return median([used(name, roles, i, net) / max(1, requests[name][i]) * 1e6 for i in range(windows)])

    kinds = (False, True) if idle else (False,)
    for net in kinds:
        for label, roles in (("emulate-worker", ("emulate-worker",)), ("agents", ("agent",)), ("edges", ("edge",)),
                             ("maintenance", ("maintenance",)), ("agents + maintenance", ("agent", "maintenance"))):
            ref, cand = (per_request(name, roles, net) for name in names)
            label = f"{label}{' (net of idle)' if net else ''}"
            print(f"{label:<34}{ref:>27.0f} us{cand:>27.0f} us{cand / ref if ref > 0 else float('nan'):>8.2f}")
        ratios = [median([used(name, ("agent", "maintenance"), i, net) / used(name, ("edge",), i, net)
                          for i in range(windows) if used(name, ("edge",), i, net) > 0]) for name in names]
        label = f"(agents+maint.) / edges{' net' if net else ''}"
        print(f"{label:<34}{ratios[0]:>30.2f}{ratios[1]:>30.2f}   target <= 1")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--busy-windows", type=int, default=3)
    ap.add_argument("--busy-window-s", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--settle-s", type=float, default=5.0, help="after readiness, before the first window")
    ap.add_argument("--profile", metavar="DIR", type=Path, help="cProfile the candidate's daemons (see above)")
    args = ap.parse_args()
    quiet_logs()
    spec = DeploymentSpec(wan=False)
    workers = sum(spec.workers.values())
    workdir = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    reference = LocalDeployment(spec, workdir / "reference", time_scale=0.0, node_args={
        f"agent:{w}": ("--load-idle-poll-ms", "20") for w in _worker_ids(spec)})
    reference.cfg = replace(reference.cfg, idle=IdleParams(heartbeat_ms=reference.cfg.score.broadcast_period_ms,
                                                           engine_probe_max_ms=1000.0))
    candidate = LocalDeployment(spec, workdir / "candidate", time_scale=0.0)
    profiled = None
    if args.profile:
        profile_daemons(candidate, args.profile.resolve())
        profiled = candidate
    deployments = {"reference (before 30.4)": reference, "candidate (defaults)": candidate}
    try:
        for dep in deployments.values():
            await dep.start(timeout=args.start_timeout_s)
        await asyncio.sleep(args.settle_s)
        cores = None
        if args.windows:
            signal_profiled(profiled, signal.SIGUSR1)
            cores, _ = await measure(deployments, args.windows, args.window_s)
            signal_profiled(profiled, signal.SIGUSR2)
            print_idle(cores, args.windows, args.window_s, workers)
        if args.busy_windows:
            loops = {name: ClosedLoop(dep.edge_url("us"), args.concurrency, seed=1) for name, dep in deployments.items()}
            async with contextlib.AsyncExitStack() as stack:
                for loop in loops.values():
                    await stack.enter_async_context(loop)
                await asyncio.sleep(args.settle_s)  # caches warm, prefixes indexed
                signal_profiled(profiled, signal.SIGUSR1)
                cpu, requests = await measure(deployments, args.busy_windows, args.busy_window_s,
                                              served=lambda name: loops[name].served)
                signal_profiled(profiled, signal.SIGUSR2)
            print_busy(cpu, requests, args.busy_windows, args.busy_window_s, cores)
            failed = {name: loop.failed for name, loop in loops.items() if loop.failed}
            if failed:
                print(f"failed requests: {failed}")
    finally:
        for dep in deployments.values():
            await dep.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _worker_ids(spec: DeploymentSpec) -> list[str]:
    from kvcompassd.launcher import build_cluster

    return [w.id for w in build_cluster(spec).workers]


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
