"""What a deployment costs while it serves nothing: CPU of every daemon, per worker.

    .venv/bin/python tools/bench_idle.py                     # 3 windows of 20 s
    .venv/bin/python tools/bench_idle.py --windows 5 --window-s 30

Starts two loopback deployments of the demo's shape side by side (7 emulated workers, 7
agents, 3 edges, 2 maintenance units, no WAN relays): the *reference* runs every agent at the
fixed 20 ms load reading (``--load-idle-poll-ms 20``, the agents' behaviour before they backed
off while idle), the *candidate* at the defaults. After both are ready and have settled, it
reads every process's CPU time (``/proc/<pid>/stat``) at the start and end of each window (and
prints the machine's load average at each window's end) and
prints, per role and in all, the median over windows of the cores used, the cores per worker,
and the candidate ÷ reference ratio. Both run in the same windows, so load from other tenants
of the machine falls on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, load_average, median, quiet_logs  # noqa: E402

from kvcompassd.launcher import DeploymentSpec, LocalDeployment  # noqa: E402

ROLES = ("emulate-worker", "agent", "edge", "maintenance")


def role_cpu(dep: LocalDeployment) -> dict[str, float]:
    """CPU seconds used so far by each role's processes in ``dep``."""
    used = dict.fromkeys(ROLES, 0.0)
    for key, node in dep.nodes.items():
        if node.alive:
            used[key.split(":", 1)[0]] += cpu_seconds(node.proc.pid)
    return used


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--settle-s", type=float, default=5.0, help="after readiness, before the first window")
    args = ap.parse_args()
    quiet_logs()
    spec = DeploymentSpec(wan=False)
    workers = sum(spec.workers.values())
    workdir = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    reference = LocalDeployment(spec, workdir / "reference", node_args={
        f"agent:{w}": ("--load-idle-poll-ms", "20") for w in _worker_ids(spec)})
    candidate = LocalDeployment(spec, workdir / "candidate")
    deployments = {"reference (fixed 20 ms)": reference, "candidate (defaults)": candidate}
    try:
        for dep in deployments.values():
            await dep.start(timeout=args.start_timeout_s)
        await asyncio.sleep(args.settle_s)
        cores: dict[str, dict[str, list[float]]] = {name: {r: [] for r in ROLES} for name in deployments}
        for window in range(1, args.windows + 1):
            start = {name: role_cpu(dep) for name, dep in deployments.items()}
            t0 = time.monotonic()
            await asyncio.sleep(args.window_s)
            elapsed = time.monotonic() - t0
            # The machine's other load in this window (both deployments' own share included).
            print(f"window {window}: {elapsed:.1f} s, load average {load_average()}", flush=True)
            for name, dep in deployments.items():
                end = role_cpu(dep)
                for role in ROLES:
                    cores[name][role].append((end[role] - start[name][role]) / elapsed)
        print(f"idle CPU, {args.windows} windows of {args.window_s:g} s, {workers} workers each")
        print(f"{'role':<16}" + "".join(f"{name:>28}" for name in deployments) + f"{'ratio':>8}")
        totals = {name: [sum(cores[name][r][i] for r in ROLES) for i in range(args.windows)] for name in deployments}
        rows = [(role, [median(cores[name][role]) for name in deployments]) for role in ROLES]
        rows.append(("all", [median(totals[name]) for name in deployments]))
        for role, (ref, cand) in rows:
            ratio = cand / ref if ref > 0 else float("nan")
            print(f"{role:<16}{ref:>22.4f} core{cand:>23.4f} core{ratio:>8.2f}")
        ref, cand = (median(totals[name]) / workers for name in deployments)
        print(f"{'per worker':<16}{ref:>22.4f} core{cand:>23.4f} core{cand / ref:>8.2f}")
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
