"""One command per paper experiment. ``--quick`` shrinks durations for a smoke run.

    python -m kvcompassd.sim.experiments fig12 [--quick] [--out out/experiments]
    python -m kvcompassd.sim.experiments {fig9,fig11,fig12,fig14,fig15,fig16,fig18,table4,table5,fig19,fig_long,all}
    python -m kvcompassd.sim.experiments scale [--quick]   (1,024 x 64; not part of "all": sim/exp_scale.py)

Each writes its table (CSV/JSON/Markdown) and PNG plots under ``--out/<name>/`` and prints every
point's figures beside the window it measured: seed, warm-up and measured seconds, measured
requests (``seed``, ``warmup_s``, ``measured_s``, ``requests``, ``arrivals``, ``arrivals_s`` in
the JSON; the same line under each table and plot).

Cost: points run in ``--jobs`` processes (default one per core; results identical to a serial
run, tests/test_sim_parallel.py), and the schemes of one (workload, rate) replay one generated
request stream. See tools/sim_bench.py for simulated requests per CPU second.

Sweep sizes (fig12, fig16): a point keeps the paper-sized window's warm-up (5 s of 20 s for
Fig. 12) and then measures about ``--requests-per-point`` arrivals (default 7,500), never past the
full window; ``--requests-per-point 0`` restores the full window at every rate. Only the 200 req/s
point keeps the full 20 s; the 1000 req/s point lasts 12.5 s, 3000 req/s 7.5 s (2.5 s measured),
6000 req/s 6.25 s (the whole sweep: ~2.6x fewer arrivals). Every table, plot and printed row
names the window it measured (seed, warm-up and measured seconds, measured requests; ``cli.
measured_window``), so a sweep point's figure is never mistaken for a full-window run's. What
the shortening keeps and what it changes:
- P99 samples: ~7,500 measured requests, ~75 above the P99; the rank of the empirical P99 has a
  binomial s.d. of sqrt(n p (1-p)) ~ 8.6, so its 95 % interval is about P98.8-P99.2. Every
  scheme replays the same requests (common random numbers).
- Warm caches and sessions: the warm-up is the same 5 s as an unshortened point, not a share of
  the window. Shared prefixes warm with arrivals, but a follow-up turn reuses its own history
  only if its previous turn was simulated, which takes seconds (think times average 3 s). (A
  first version scaled the warm-up with the window, 0.4 s at 6000 req/s; its hit rates fell with
  the rate for that reason alone.)
- Overload: past capacity a backlog grows with time, so every overloaded scheme's P99 grows
  with the measured window, each at its own pace: the ratios between schemes are the window's,
  and they move with it; nothing makes the short window favour one side. Measured on Mixed at
  3000 req/s (census-64x8, seed 0), the sweep's 7.5 s point (5 s warm-up + 2.5 s measured) gave
  the baselines' P99 over KVCompass's as 1.48 (central directory), 2.08 (PlanetServe), 1.47
  (SkyWalker), 1.67 (consistent hashing), 3.59 (Chord), 1.32 (Dynamo); the full 20 s point
  (``python -m kvcompassd.sim.cli --deployment census-64x8 --workload mixed --rates 3000
  --duration 20 --warmup 5``, 5 s + 15 s) gave 1.18, 1.45, 1.31, 1.41, 2.93 and 1.16: the short
  window inflated every one of KVCompass's six leads there (Dynamo at seeds 1 and 2: 1.45 and
  1.31 short, 1.17 and 1.16 full). A ratio quoted from a sweep point
  is that point's window's; ``tools/sim_seeds.py --durations 7.5,20 --warmup 5`` gives a
  ratio's spread over seeds and windows (docs/simulator-measurements.md has it for this
  point, with the seeds). Throughput counts every token of the run over its duration (first arrival to last
  completion, as vLLM's and SGLang's serving benchmarks do); past capacity that is the rate at
  which the pool works off the backlog.

Rates: the paper's simulated rates are used for the census deployments (Fig. 12: 200-6000
req/s; Fig. 16: 400-18000). The testbed experiments (Fig. 11, 15) ran full-size prompts on RTX
5090s at 4-40 req/s with the datasets' full-size prompts; ours follow the paper's simulator
(see ``synthetic``), so the testbed sweep covers the same fractions of the pool's no-reuse
capacity (~0.15-1.6 x lambda0, lambda0 =
workers / (mean prompt x beta)) instead of the same absolute rates.

Capacity at the paper's census rates: Mixed is calibrated to the paper's own simulator (see
``synthetic``): lambda0 = 668 req/s on the 64x8 census (``fig9``'s estimate: the first 20,000
Mixed requests of seed 0 at the config's beta; ``synthetic``'s 662 is the first 30,000 at
beta = 0.085 ms/token) against the paper's ~667 (Fig. 9), and
the paper's knee for KVCompass is ~1.65 lambda0 (§3.5), i.e. ~1,100 req/s. So the paper's own
sweep is past capacity from ~1,100 req/s on, and 3000 req/s is ~4.5 lambda0; its text calls
6000 "sustained overload". With decode included (a request costs its GPU the uncached prefill,
beta per token, plus its share of decode, (output - 1) steps of a full batch of 64 at 19.6 ms,
divided by 64: 29 ms on Mixed, 58 ms on WildChat, 68 ms on LMSYS) the 64x8 fleet serves at
most ~510 req/s on Mixed without reuse, ~830 at 50 % reuse and ~1,320 at 80 %. Past capacity
TTFT is the backlog accumulated over the window, so P99s there grow with the window's length
(the paper's distributions use far longer runs, ~500 K requests) and the schemes differ mostly
by the throughput they sustain. The paper's throughput panels (e.g. 7.43 Mtok/s at 2750 req/s,
~116 Ktok/s per A100) are not reachable by any A100 model consistent with its Fig. 9 capacity;
our throughputs are every token of a run over its duration (``kvcompassd.sim.metrics``; the
tokens finished inside the short measured window are kept as ``window_tok_s``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import exp_fig18, exp_long, plots
from .cli import (WINDOW_COLUMNS, grid_points, markdown_table, resolve_deployment, run_grid, run_points, window_text,
                  write_outputs)
from .engine import SimSettings
from .geo import NORTH_AMERICA_16, population_weights
from .schemes import DEFAULT_EVICTION, PAPER_SCHEMES, traces_dir
from .workloads import MOONCAKE_BLOCK_TOKENS, WorkloadError, read_mooncake, session_regions

WORKLOADS3 = ("mixed", "wildchat", "lmsys")
FIG12_RATES = (200, 1000, 2000, 2750, 3000, 4000, 6000)  # the paper's Fig. 12 axis, req/s
FIG12_FULL_S = 20.0  # virtual seconds of a full Fig. 12 point (its warm-up: a quarter, see _sizes)
REQUESTS_PER_POINT = 7_500  # measured arrivals per fig12/fig16 sweep point; see "Sweep sizes" above
PAGE_TOKENS: list[int | None] = [None]  # set from --page-tokens
KVCOMPASS_OPTIONS: dict = {}  # KVCompassPolicy options from the command line (--fingerprint-bits)
ABLATIONS = ("kvcompass", "kvcompass-no-load", "kvcompass-no-xregion", "kvcompass-tier-blind",
             "kvcompass-no-migration")


def _sizes(quick: bool, full_s: float, quick_s: float) -> tuple[float, float]:
    d = quick_s if quick else full_s
    return d, d / 4.0


def _save(rows: list[dict], out: Path, title: str, extra_columns: Sequence[tuple[str, str, str]] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "summary.md").write_text(markdown_table(rows, title, extra_columns))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    import csv

    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _window_header() -> str:
    return " | ".join(header for _, header, _ in WINDOW_COLUMNS)


def _window_cells(row: dict) -> str:
    return " | ".join(fmt.format(row[key]) for key, _, fmt in WINDOW_COLUMNS)


def point_duration(rate: float, full_s: float, warmup_s: float, requests_per_point: int | None) -> float:
    """Virtual seconds of arrivals at one sweep point: the warm-up, then about
    ``requests_per_point`` measured arrivals, at most ``full_s`` (see "Sweep sizes" above)."""
    if not requests_per_point:
        return full_s
    return min(full_s, warmup_s + requests_per_point / rate)


def sweep(name: str, deployment: str, workloads: Sequence[str], schemes: Sequence[str], rates: Sequence[float],
          out: Path, *, duration: float, warmup: float, seed: int, progress: bool, jobs: int = 1,
          requests_per_point: int | None = None, **settings) -> list[dict]:
    """Every (workload, rate, scheme) point of one experiment, in ``jobs`` processes. With
    ``requests_per_point`` a point lasts ``point_duration`` after the same warm-up."""
    cfg = resolve_deployment(deployment)
    points = []
    for wl in workloads:
        s = SimSettings(eviction=DEFAULT_EVICTION[wl], seed=seed, **settings)
        for rate in rates:
            d = point_duration(rate, duration, warmup, requests_per_point)
            points += grid_points(cfg, wl, schemes, [rate], seed=seed, duration_s=d, warmup_s=warmup,
                                  settings=s, page_tokens=PAGE_TOKENS[0], policy_options=KVCOMPASS_OPTIONS,
                                  run_progress=progress and jobs <= 1)
    done = run_points(points, jobs=jobs, progress=progress, desc=f"{name}@{deployment}",
                      log=out / name / "points.jsonl")
    all_rows: list[dict] = []
    for wl in workloads:
        mine = [(p, d) for p, d in zip(points, done) if p.workload == wl]
        rows = [summary for _, (summary, _) in mine]
        results = {(p.scheme, p.rate): result for p, (_, result) in mine}
        write_outputs(rows, results, out / name / wl, title=f"{name}: {wl} on {deployment}",
                      warmup_s=warmup)
        all_rows += rows
    _save(all_rows, out / name, f"{name} on {deployment}")
    return all_rows


def fig12(args) -> list[dict]:
    d, w = _sizes(args.quick, FIG12_FULL_S, 2.0)
    rates = list(FIG12_RATES) if not args.quick else [200, 1000, 3000]
    return sweep("fig12", "census-64x8", WORKLOADS3, args.schemes or PAPER_SCHEMES, args.rates or rates, args.out,
                 duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs,
                 requests_per_point=args.requests_per_point)


def fig16(args) -> list[dict]:
    d, w = _sizes(args.quick, 10.0, 1.0)
    rates = [400, 2000, 5500, 12000, 18000] if not args.quick else [400, 5500]
    return sweep("fig16", "census-128x16", WORKLOADS3, args.schemes or PAPER_SCHEMES, args.rates or rates, args.out,
                 duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs,
                 requests_per_point=args.requests_per_point)


def fig11(args) -> list[dict]:
    d, w = _sizes(args.quick, 60.0, 6.0)
    rates = [25, 50, 100, 150, 200, 250] if not args.quick else [25, 100, 200]
    return sweep("fig11", "testbed-3continent", WORKLOADS3, args.schemes or PAPER_SCHEMES, args.rates or rates,
                 args.out, duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs)


def fig14(args) -> list[dict]:
    d, w = _sizes(args.quick, 30.0, 3.0)
    schemes = args.schemes or (*PAPER_SCHEMES, "load-balance-oracle")
    return sweep("fig14", "census-64x8", ("mixed",), schemes, args.rates or [2750], args.out,
                 duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs)


# What moves each ablation: the share of reuse served from DRAM (tier-blind) and what came of the
# local misses that found their family hot (no-migration: a replica needs an idle worker).
FIG15_COLUMNS = (("throughput_vs_full", "vs full", "{:.3f}"), ("dram_share_of_reuse", "DRAM % of reuse", "{:.1%}"),
                 ("migrations", "migrations", "{}"), ("hot_misses_no_idle_worker", "hot, no idle worker", "{}"),
                 ("hot_misses_no_remote_match", "hot, no remote match", "{}"))


def fig15(args) -> list[dict]:
    """Closed-loop service throughput with one mechanism removed at a time (paper Fig. 15): the
    same Mixed requests, sent by ``--clients-per-worker`` x workers clients that each wait for
    their answer before sending the next. The stream is scheduled past capacity, so every client
    stays busy and a variant's throughput is what the pool sustains with it.

    The table adds what moves the last two ablations. Tier-blind: the DRAM share of reuse (the
    testbed's RTX 5090s hold 12 GiB of KV in VRAM) priced at gamma, 6 % of the prefill it saves.
    No-migration: a replica goes only to a worker whose queue stayed 0 for idle_period_ms, which a
    saturated closed loop never has, so its hot families are counted under "no idle worker"."""
    from kvcompassd.core.config import load_config

    d, w = _sizes(args.quick, 60.0, 6.0)
    deployment = "testbed-3continent"
    clients = args.clients_per_worker * len(load_config(resolve_deployment(deployment)).workers)
    rows = sweep("fig15", deployment, ("mixed",), args.schemes or ABLATIONS, args.rates or [200], args.out,
                 duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs, clients=clients)
    full = next((r["throughput_tok_s"] for r in rows if r["scheme"] == "kvcompass"), None)
    for r in rows:
        r["clients"] = clients
        r["throughput_vs_full"] = r["throughput_tok_s"] / full if full else float("nan")
    _save(rows, args.out / "fig15", f"fig15 on {deployment}: closed loop, {clients} clients", FIG15_COLUMNS)
    plots.bars({r["scheme"]: 100 * r["throughput_vs_full"] if full else r["throughput_tok_s"] / 1e3 for r in rows},
               args.out / "fig15" / "ablation.png",
               ylabel="Throughput (% of full)" if full else "Throughput (Ktok/s)",
               title=f"Ablation (Mixed, testbed, closed loop, {clients} clients)", fmt="{:.1f}",
               window=window_text(rows))
    return rows


def table4(args) -> list[dict]:
    d, w = _sizes(args.quick, 20.0, 2.0)
    cfg = resolve_deployment("census-64x8")
    rate = (args.rates or [3000])[0]
    variants = [("base", {})] + [(f"jitter {j}%", {"wan_jitter": j / 100}) for j in (25, 50, 100)] \
        + [(f"loss {p}%", {"update_loss": p / 100}) for p in (10, 20, 30)] \
        + [(f"delay {m} ms", {"update_delay_ms": float(m)}) for m in (100, 200, 300)]
    points, labels = [], []
    for label, extra in variants:
        s = SimSettings(eviction="lfu", seed=args.seed, **extra)
        # The paper's prototype does not retransmit lost update batches (§5.7): repair=False.
        mine = grid_points(cfg, "mixed", args.schemes or ["kvcompass"], [rate], seed=args.seed, duration_s=d,
                           warmup_s=w, settings=s, policy_options={"repair": False}, page_tokens=PAGE_TOKENS[0],
                           run_progress=args.progress and args.jobs <= 1)
        points += mine
        labels += [label] * len(mine)
    out = args.out / "table4"
    # All variants in one pool: each is a single long point, so run one by one they used one core.
    done = run_points(points, jobs=args.jobs, progress=args.progress, desc="table4", log=out / "points.jsonl")
    rows = [dict(summary, variant=label) for (summary, _), label in zip(done, labels)]
    _save(rows, out, f"Table 4: sensitivity (Mixed, {rate:g} req/s)")
    lines = [f"| variant | scheme | {_window_header()} | P99 TTFT (ms) | hit rate (%) |", "|---" * 8 + "|"]
    lines += [f"| {r['variant']} | {r['scheme']} | {_window_cells(r)} | {r['ttft_p99_ms']:.0f} | "
              f"{100 * r['hit_rate']:.1f} |" for r in rows]
    (out / "table4.md").write_text("\n".join([*lines, "", f"Window: {window_text(rows)}."]) + "\n")
    return rows


def table5(args) -> list[dict]:
    d, w = _sizes(args.quick, 20.0, 2.0)
    # The exact cache map (track_truth) tells why each claim was false (policy.FALSE_*): lost
    # between the decision and the request's arrival, a prompt diverging inside the page that
    # holds the claimed length, or already wrong in the edge's view (or still held, in DRAM, with
    # no VRAM free to reload it into: FALSE_NO_VRAM_ROOM). 1000 req/s is
    # near the fleet's capacity, 3000 (the paper's operating point) far past it.
    rows = sweep("table5", "census-64x8", WORKLOADS3, args.schemes or ["kvcompass"], args.rates or [1000, 3000],
                 args.out, duration=d, warmup=w, seed=args.seed, progress=args.progress, jobs=args.jobs,
                 track_truth=True)
    lines = [f"| workload | req/s | scheme | {_window_header()} | end-to-end false-lookup rate (%) | among claimed (%) "
             "| lost in flight (%) | no VRAM to reload (%) | within a page (%) | view ahead of the worker (%) "
             "| of which: index behind the worker (%) | view behind the index (%) | keyless false hit (%) "
             "| edge's pending credit (%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['rate']:g} | {r['scheme']} | {_window_cells(r)} | "
              f"{100 * r['false_lookup_rate']:.2f} | "
              f"{100 * r['false_lookup_rate_claimed']:.2f} | {100 * r['false_lost_in_flight']:.2f} | "
              f"{100 * r['false_no_vram_room']:.2f} | "
              f"{100 * r['false_within_page']:.2f} | {100 * r['false_view_ahead']:.2f} | "
              f"{100 * r['false_index_behind']:.2f} | {100 * r['false_view_behind']:.2f} | "
              f"{100 * r['false_keyless']:.2f} | {100 * r['false_pending']:.2f} |" for r in rows]
    (args.out / "table5" / "table5.md").write_text("\n".join([*lines, "", f"Window: {window_text(rows)}."]) + "\n")
    return rows


def fig9(args) -> list[dict]:
    """M/G/1 check: mean queueing delay vs offered load for random forwarding (against the
    Pollaczek-Khinchine prediction), least-loaded forwarding without reuse, and KVCompass."""
    cfg_path = resolve_deployment("census-64x8")
    from kvcompassd.core.config import load_config

    from .policy import Topology
    from .schemes import prompt_lengths, region_weights

    topo = Topology.from_config(load_config(cfg_path))
    weights = region_weights(topo)
    sample = list(itertools.islice(prompt_lengths("mixed", 1000.0, weights, seed=args.seed), 20_000))
    beta = float(np.mean(topo.prefill_ms_per_token))
    service = np.array([n * beta for n in sample]) / 1000.0  # seconds, no reuse
    es, es2 = service.mean(), (service ** 2).mean()
    lam0 = topo.n_workers / es  # no-reuse capacity, req/s
    fractions = [0.1, 0.3, 0.5, 0.7, 0.9, 1.2, 1.5] if not args.quick else [0.3, 0.7, 1.2]
    d, w = _sizes(args.quick, 20.0, 3.0)
    rows, _ = run_grid(cfg_path, "mixed", args.schemes or ["random", "load-balance-oracle", "kvcompass"],
                       [round(f * lam0, 1) for f in fractions], seed=args.seed, duration_s=d, warmup_s=w,
                       settings=SimSettings(eviction="lfu", seed=args.seed), progress=args.progress,
                       page_tokens=PAGE_TOKENS[0], jobs=args.jobs)
    for r in rows:
        a = r["rate"] / topo.n_workers
        rho = a * es
        r["rho"] = rho
        r["pk_mean_queue_ms"] = 1000.0 * a * es2 / (2 * (1 - rho)) if rho < 1 else float("inf")
        r["lambda0"] = lam0
        r["service_cv2"] = float(es2 / es ** 2 - 1)
    out = args.out / "fig9"
    _save(rows, out, f"Fig. 9: M/G/1 check (Mixed, 64x8, lambda0 = {lam0:.0f} req/s)")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = sorted((r["rate"], r["queue_mean_ms"]) for r in rows if r["scheme"] == scheme)
        ax.plot(*zip(*pts), marker="o", markersize=3, label=scheme)
    pk = sorted((r["rate"], r["pk_mean_queue_ms"]) for r in rows if r["scheme"] == rows[0]["scheme"] and r["rho"] < 1)
    if pk:
        ax.plot(*zip(*pk), "k--", label="M/G/1 (P-K)")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("mean queueing delay (ms)")
    ax.axvline(lam0, color="gray", lw=0.8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.text(0.5, 0.0, window_text(rows), ha="center", va="top", fontsize=5.5, color="dimgray")
    fig.savefig(out / "mg1.png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    return rows


def fig19(args) -> list[dict]:
    """Appendix D: share of reusable >=1024-token prefixes cached only in another region, on
    the Mooncake trace, first turns replayed in arrival order, root sessions assigned to 16
    North-American regions by population, unlimited per-region caches, over 20 seeds."""
    block = args.trace_block_tokens
    path = Path(args.trace) if args.trace else traces_dir(args.traces) / "mooncake" / "synthetic_trace.jsonl"
    weights = population_weights(NORTH_AMERICA_16)
    recs = read_mooncake(path, block_tokens=block)
    from .workloads import mooncake_sessions

    sessions = mooncake_sessions(recs, block_tokens=block)
    first = set()
    seen_sessions = set()
    for i, s in enumerate(sessions):
        if s not in seen_sessions:
            seen_sessions.add(s)
            first.add(i)
    min_blocks = max(1, -(-1024 // block))  # blocks covering the 1024-token threshold
    seeds = range(args.seed, args.seed + (3 if args.quick else 20))
    rows = []
    for seed in seeds:
        cached: dict[tuple[int, ...], set[str]] = {}
        local = remote_only = cold = 0
        for i, region in enumerate(session_regions(sessions, weights, seed=seed)):
            if i not in first:
                continue
            ids = recs[i].hash_ids
            best_local = best_any = 0
            for n in range(len(ids), min_blocks - 1, -1):
                holders = cached.get(ids[:n])
                if holders:
                    best_any = max(best_any, n)
                    if region in holders:
                        best_local = n
                        break
            if best_any < min_blocks:
                cold += 1
            elif best_local >= min_blocks:
                local += 1
            else:
                remote_only += 1
            for n in range(min_blocks, len(ids) + 1):
                cached.setdefault(ids[:n], set()).add(region)
        hits = local + remote_only
        rows.append({"seed": seed, "first_turns": local + remote_only + cold, "hits": hits, "local": local,
                     "remote_only": remote_only, "remote_only_share": remote_only / hits if hits else float("nan")})
    share = float(np.mean([r["remote_only_share"] for r in rows]))
    # Not timed: the window is the whole trace (its first turns, no warm-up) under each seed.
    window = {"trace": path.name, "records": len(recs), "first_turns": len(first), "seeds": [r["seed"] for r in rows]}
    window_line = (f"whole trace {path.name} ({len(recs):,} records, {len(first):,} first turns, no warm-up); "
                   f"seeds {rows[0]['seed']}-{rows[-1]['seed']} ({len(rows)})")
    for r in rows:
        r["window"] = window_line
    out = args.out / "fig19"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"mean_remote_only_share": share, "window": window, "runs": rows},
                                                 indent=1))
    (out / "summary.md").write_text(
        f"# Fig. 19-style cross-region-only hits ({path.name}, 16 NA regions)\n\n"
        f"Mean share of >=1024-token hits cached only in another region over {len(rows)} seeds: "
        f"**{100 * share:.1f} %** (paper, Fig. 19: Mooncake-Conv 78.4 %, Mooncake-Tool 20.2 %; "
        f"the four Qwen-Bailian traces 9.8-26.4 %).\n\nWindow: {window_line}.\n")
    plots.bars({path.stem: 100 * share}, out / "fig19.png", ylabel="% of cross-region hit only",
               title="Cross-region-only hits (>=1024 tokens)", fmt="{:.1f}%", window=window_line)
    return rows


def scale(args) -> list[dict]:
    """1,024 workers x 64 regions (issue 31): sim/exp_scale.py."""
    from .exp_scale import scale as run_scale

    return run_scale(args)


EXPERIMENTS = {"fig9": fig9, "fig11": fig11, "fig12": fig12, "fig14": fig14, "fig15": fig15, "fig16": fig16,
               "table4": table4, "table5": table5, "fig19": fig19, "scale": scale}
NOT_IN_ALL = ("scale",)  # not a paper experiment, and the costliest: run it by name
EXPERIMENTS["fig_long"] = exp_long.fig_long  # long-context sessions (issue 28), its own module
EXPERIMENTS["fig18"] = exp_fig18.fig18  # prefill-decode disaggregation (App. C), its own module


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcompassd.sim.experiments", description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=(*EXPERIMENTS, "all"))
    ap.add_argument("--quick", action="store_true", help="short runs for a smoke test")
    ap.add_argument("--out", type=Path, default=Path("out/experiments"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", type=lambda s: [x for x in s.split(",") if x], default=None)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=None)
    ap.add_argument("--traces", default=None, help="override the traces the package ships (mooncake/, azure_llm_2023/)")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="fig19: this Mooncake-format JSONL file instead of the bundled synthetic trace")
    ap.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                    help=f"tokens per hash id of --trace (default {MOONCAKE_BLOCK_TOKENS})")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--requests-per-point", type=int, default=REQUESTS_PER_POINT,
                    help="fig12/fig16: measure about this many arrivals after the warm-up (0: the full "
                         "duration at every rate); see 'Sweep sizes' in the module docstring")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="simulations run in parallel processes (default: one per core; results unchanged)")
    ap.add_argument("--clients-per-worker", type=int, default=64,
                    help="fig15: closed-loop clients per worker (each waits for its answer before sending "
                         "again); the default, one per decode slot (max_running), lets the pool saturate")
    ap.add_argument("--page-tokens", type=int, default=None,
                    help="engine page size of the simulated caches (e.g. 64 runs faster; default: index block size)")
    ap.add_argument("--fingerprint-bits", type=int, default=None,
                    help="KVCompass: fingerprint bits per entry of the index tables (default: the deployment's; "
                         "the paper's keyless views have none), e.g. table5 --fingerprint-bits 8")
    ap.add_argument("--paper-reach", action="store_true",
                    help="fig_long: also run KVCompass with the paper's indexed lengths only (to 16 K tokens)")
    ap.add_argument("--deployment", default=None,
                    help="scale: this deployment (config name or TOML path) instead of census-1024x64")
    args = ap.parse_args(argv)
    try:  # the files the experiments replay, checked before any run: a bad one names its line
        if args.trace is not None:
            read_mooncake(args.trace, block_tokens=args.trace_block_tokens)
        elif args.traces is not None:
            traces_dir(args.traces)
    except WorkloadError as exc:
        raise SystemExit(f"kvcompassd.sim.experiments: {exc}") from None
    PAGE_TOKENS[0] = args.page_tokens
    KVCOMPASS_OPTIONS.clear()
    if args.fingerprint_bits is not None:
        KVCOMPASS_OPTIONS["fingerprint_bits"] = args.fingerprint_bits
    names = [n for n in EXPERIMENTS if n not in NOT_IN_ALL] if args.experiment == "all" else [args.experiment]
    for name in names:
        rows = EXPERIMENTS[name](args)
        sys.stdout.write(report(name, rows))
        print(f"{name}: {len(rows)} rows -> {args.out / name}")
    return 0


# Columns an experiment's printed table adds to cli.COLUMNS (which carry each point's window).
REPORT_COLUMNS = {"table4": (("variant", "variant", "{}"),), "fig15": FIG15_COLUMNS,
                  "fig9": (("rho", "rho", "{:.2f}"), ("queue_mean_ms", "queue ms", "{:.1f}"),
                           ("pk_mean_queue_ms", "P-K queue ms", "{:.1f}"))}


def report(name: str, rows: list[dict]) -> str:
    """What an experiment prints: every point's figures with the window it measured beside them
    (seed, warm-up and measured seconds, measured requests), so a figure quoted from the output
    carries its window."""
    if name == "fig19":  # one row per seed over the whole trace
        lines = [f"{name}: seed {r['seed']}: remote-only share {100 * r['remote_only_share']:.1f} % of "
                 f"{r['hits']:,} hits ({r['first_turns']:,} first turns)" for r in rows]
        return "\n".join([*lines, f"{name} window: {rows[0]['window']}", ""])
    tables = []
    for workload, deployment in dict.fromkeys((r.get("workload"), r.get("deployment")) for r in rows):
        mine = [r for r in rows if (r.get("workload"), r.get("deployment")) == (workload, deployment)]
        tables.append(markdown_table(mine, f"{name}: {workload} on {deployment}", REPORT_COLUMNS.get(name, ())))
    return "\n".join(tables)


if __name__ == "__main__":
    sys.exit(main())
