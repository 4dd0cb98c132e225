"""``kvcompassd demo``: a three-region deployment on loopback, a bundled workload, one table.

Starts maintenance units, edges, agents and emulated SGLang workers as real processes with
QUIC between them (cross-region traffic through WAN-delaying UDP relays), replays a workload of
long shared documents asked about from every region, and prints TTFT, throughput, reused tokens
and cross-region forwards next to the same run with cross-region reuse switched off.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import numpy as np

from kvcompassd.core.fingerprints import fingerprint_choice_for_config
from kvcompassd.launcher import DeploymentSpec, LocalDeployment, build_cluster

WORDS = ("the", "model", "cache", "prefix", "region", "worker", "token", "edge", "shard", "query", "latency",
         "reuse", "prompt", "answer", "document", "section", "table", "figure", "result", "network", "request",
         "queue", "memory", "transfer", "compute")


@dataclass(frozen=True, slots=True)
class DemoRequest:
    region: str
    prompt: str
    max_tokens: int


def bundled_workload(n: int, regions: list[str], seed: int = 7) -> list[DemoRequest]:
    """Shared long documents (3-8 K tokens) asked about from all regions, Zipf popularity.

    Each document is first read in its home region; later questions come from anywhere, which
    is exactly when another region's cache is worth a WAN round trip.
    """
    rng = random.Random(seed)
    docs = []
    for d in range(16):
        length = rng.randint(3000, 8000)
        words = []
        while sum(len(w) + 1 for w in words) < length:
            words.append(rng.choice(WORDS))
        docs.append((f"[doc {d}] " + " ".join(words))[:length])
    weights = [1.0 / (i + 1) ** 0.9 for i in range(len(docs))]
    home = {d: regions[d % len(regions)] for d in range(len(docs))}
    seen: set[int] = set()
    out = []
    for i in range(n):
        d = rng.choices(range(len(docs)), weights)[0]
        region = home[d] if d not in seen else rng.choice(regions)
        seen.add(d)
        question = f"\nQuestion {i}: what does section {rng.randint(1, 50)} say about {rng.choice(WORDS)}?"
        out.append(DemoRequest(region, docs[d] + question, rng.randint(8, 24)))
    return out


@dataclass
class Outcome:
    region: str
    ttft: float
    total: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    worker_region: str
    ok: bool


async def _one(session: aiohttp.ClientSession, base: str, req: DemoRequest) -> Outcome:
    t0 = time.perf_counter()
    ttft = None
    final, usage = {}, {}
    body = {"model": "kvcompass-demo", "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # usage comes in a last chunk of its own
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Outcome(req.region, 0, 0, 0, 0, 0, "", False)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if "kvcompass" in chunk:
                    final = chunk
                usage = chunk.get("usage") or usage
    except (TimeoutError, aiohttp.ClientError):
        return Outcome(req.region, 0, 0, 0, 0, 0, "", False)
    total = time.perf_counter() - t0
    kvc = final.get("kvcompass", {})
    return Outcome(req.region, ttft or total, total, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                   kvc.get("cached_tokens", 0), kvc.get("region", ""), bool(final))


async def run_workload(dep: LocalDeployment, requests: list[DemoRequest], concurrency: int,
                       results: list[Outcome] | None = None) -> tuple[list[Outcome], float]:
    """Replay ``requests``; each outcome is appended to ``results`` as it completes, so a run
    cut short still has what it measured."""
    queue: asyncio.Queue[DemoRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results = [] if results is None else results

    async def client(session):
        while not queue.empty():
            req = queue.get_nowait()
            results.append(await _one(session, dep.edge_url(req.region), req))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarise(name: str, results: list[Outcome], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok]) * 1000 if ok else np.zeros(1)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "run": name,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "req_per_s": len(ok) / wall,
        "tokens_per_s": sum(r.prompt_tokens + r.completion_tokens for r in ok) / wall,
        "reused_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "cross_region": sum(1 for r in ok if r.worker_region and r.worker_region != r.region),
    }


def render_table(rows: list[dict]) -> str:
    cols = [("run", "run", "{}"), ("requests", "requests", "{}"), ("failed", "failed", "{}"),
            ("TTFT P50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT P99 ms", "ttft_p99_ms", "{:.0f}"),
            ("req/s", "req_per_s", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
            ("reused", "reused_share", "{:.1%}"), ("cross-region fwd", "cross_region", "{}")]
    cells = [[fmt.format(r[key]) for _, key, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    line = "  ".join(h.ljust(w) for (h, _, _), w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])


# The comparison runs first, so that the deployment --keep leaves running is KVCompass's.
RUNS = (("no cross-region reuse", ("--no-cross-region",)), ("KVCompass", ()))


def ctl_command() -> str:
    """How to call kvcompassctl from here: by name if that is the one beside this interpreter
    (or there is none), else its path — the README's first command runs ``.venv/bin/kvcompassd``
    with the venv's bin directory not on PATH, where a bare ``kvcompassctl`` is not found."""
    beside = Path(sys.executable).parent / "kvcompassctl"
    if not beside.is_file():
        return "kvcompassctl"
    found = shutil.which("kvcompassctl")
    return "kvcompassctl" if found and Path(found) == beside else str(beside)


def kept_running_note(dep: LocalDeployment) -> str:
    """Where an operator finds the kept deployment: front doors, configs, certificates, logs."""
    cfg = dep.cfg
    region = cfg.region_names()[0]
    lines = ["KVCompass deployment kept running (Ctrl-C or SIGTERM stops every node):"]
    lines += [f"  {e.id:<12} front door http://{e.http}/v1  (/health, /metrics)  admin QUIC {e.quic}" for e in cfg.edges]
    lines += [f"  {m.id:<12} admin QUIC {m.quic}" for m in cfg.maintenance]
    lines += [f"  {w.id:<12} emulated {'' if w.role == 'mixed' else w.role + ' '}worker {w.http}, agent QUIC {w.agent}"
              for w in cfg.workers]
    lines += [f"  configs      {', '.join(str(p) for p in dep.configs.values())}",
              f"  TLS          {dep.tls_dir} (admin certificate: admin.pem)",
              f"  logs         {dep.workdir / 'logs'} (one JSON log per node)",
              (f"  try          {ctl_command()} --config {dep.configs[region]} --tls-dir {dep.tls_dir} "
               f"{cfg.edges_in(region)[0].id} status")]
    return "\n".join(lines)


def _print_results(rows: list[dict], root: Path, kept: bool) -> None:
    print()
    print(render_table(rows) if rows else "(nothing measured)")
    by_run = {r["run"].removesuffix(" (P/D)"): r for r in rows}
    kvc, off = by_run.get("KVCompass"), by_run.get("no cross-region reuse")
    if kvc and off and kvc["ttft_p99_ms"]:
        print(f"\nP99 TTFT ratio (no cross-region / KVCompass): {off['ttft_p99_ms'] / kvc['ttft_p99_ms']:.2f}x")
    if kept:
        print(f"configs, certificates and logs under {root}")
    sys.stdout.flush()


def demo_spec(disaggregated: bool = False, decode_policy: str = "least_loaded") -> DeploymentSpec:
    """The demo's fleet: 7 workers serving whole requests, or, disaggregated, 2 prefill + 1
    decode workers per region (the edges play SGLang's prefill-decode router)."""
    if disaggregated:
        return DeploymentSpec.disaggregated(prefill=2, decode=1, decode_policy=decode_policy)
    return DeploymentSpec()


def fleet_note(spec: DeploymentSpec) -> str:
    decode = sum(spec.decode_workers.values())
    return f" ({sum(spec.workers.values()) - decode} prefill + {decode} decode)" if decode else ""


def _with_budget_fingerprints(spec: DeploymentSpec) -> DeploymentSpec:
    """The demo's cluster with the fingerprint bits its false-lookup budget needs, so its edges
    start without the too-few-bits warning (core/fingerprints.py)."""
    cfg = build_cluster(spec)
    return replace(spec, fingerprint_bits=fingerprint_choice_for_config(cfg).needed_bits)


async def _demo(args, stop_signal: list[int]) -> int:
    """Both runs, then the table; ``stop_signal`` receives the signal that cancelled us, if any.

    Cancellation (SIGINT, SIGTERM) unwinds through each deployment's ``async with``, which
    stops every node it started; what the cut-short run measured is still summarised."""
    disaggregated = getattr(args, "disaggregated", False)
    spec = _with_budget_fingerprints(demo_spec(disaggregated, getattr(args, "decode_policy", "least_loaded")))
    requests = bundled_workload(args.requests, list(spec.workers))
    keep_files = bool(args.workdir) or args.keep
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvcompass-demo-"))
    rows: list[dict] = []
    measuring = True
    try:
        for i, (name, edge_args) in enumerate(RUNS):
            if disaggregated:
                name += " (P/D)"
            print(f"[{i + 1}/{len(RUNS)}] starting {sum(spec.workers.values())} emulated workers{fleet_note(spec)}, "
                  f"{len(spec.workers)} edges, {spec.shards} maintenance units ({name}) ...", flush=True)
            dep = LocalDeployment(spec, root / f"run{i}", time_scale=args.time_scale, wan_scale=args.wan_scale,
                                  edge_args=edge_args)
            async with dep:
                print(f"      replaying {len(requests)} requests at concurrency {args.concurrency} ...", flush=True)
                results: list[Outcome] = []
                t0 = time.perf_counter()
                try:
                    await run_workload(dep, requests, args.concurrency, results)
                finally:
                    if results:
                        cut_short = len(results) < len(requests)
                        rows.append(summarise(name + (" (interrupted)" if cut_short else ""), results,
                                              time.perf_counter() - t0))
                if args.keep and i == len(RUNS) - 1:
                    measuring = False
                    _print_results(rows, root, kept=True)
                    print("\n" + kept_running_note(dep), flush=True)
                    await asyncio.Event().wait()
    except asyncio.CancelledError:
        if not stop_signal:
            raise  # not ours to swallow
        if measuring:
            print(f"\ninterrupted by {signal.Signals(stop_signal[0]).name}; every node stopped", flush=True)
            _print_results(rows, root, kept=keep_files)
            return 128 + stop_signal[0]
        print("\nstopped every node of the kept deployment", flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:  # a node that did not start, a port taken
        keep_files = True  # the logs say why
        print(f"kvcompassd demo: {exc}\nkvcompassd demo: every node stopped; configs and logs kept under {root}",
              file=sys.stderr, flush=True)
        _print_results(rows, root, kept=True)
        return 1
    finally:
        if not keep_files:
            shutil.rmtree(root, ignore_errors=True)
    _print_results(rows, root, kept=keep_files)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


async def _run_until_signalled(args) -> int:
    """Run the demo; the first SIGINT or SIGTERM cancels it (every node is stopped on the way
    out), later ones are ignored so that the stopping is not itself cut short."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    stop_signal: list[int] = []

    def on_signal(sig: int) -> None:
        if not stop_signal:
            stop_signal.append(sig)
            task.cancel()
        else:
            print(f"{signal.Signals(sig).name}: still stopping the nodes", file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _demo(args, stop_signal)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(args) -> int:
    from kvcompassd.daemon import install_uvloop

    if args.requests < 1 or args.concurrency < 1:
        print("kvcompassd demo: --requests and --concurrency must be at least 1", file=sys.stderr)
        return 2

    install_uvloop()
    return asyncio.run(_run_until_signalled(args))
