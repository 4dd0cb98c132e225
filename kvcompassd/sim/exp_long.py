"""``fig_long`` (issue 28): every scheme on long-context sessions (``synthetic.LongContextWorkload``:
documents and coding agents of 32 K-128 K tokens) at 0.25, 0.5, 1 and 1.5 x the fleet's no-reuse
capacity, on the testbed and census-64x8.

    python -m kvcompassd.sim.experiments fig_long [--quick] [--seed 0] [--schemes ...] [--jobs N] [--paper-reach]

``--paper-reach`` adds ``kvcompass-paper-reach``: KVCompass with the paper's indexed lengths only
(to 16 K; ``KVCompassPolicy(context_tokens=...)``), on the same requests, for the before/after.

The no-reuse capacity is the one Fig. 9 uses, lambda0 = workers / (mean prompt x mean beta),
with the mean prompt of the workload as that fleet serves it (the testbed's prompts are capped
at what its 96 K-token VRAM holds; ``synthetic.servable_prompt_tokens``); decode adds ~1 % to a
long request's work and is left out. A point replays one request stream for every scheme: a
warm-up (``WARMUP_S``, 60 s: caches start empty, and a document or repository is asked for
again within tens of seconds) and then about ``REQUESTS_PER_POINT`` measured arrivals (1,200;
``--quick``: 120 after 20 s). Past capacity the backlog, and with it the P99, grows with the
window, so every table line says which window it measured.

Printed and written under ``--out/fig_long/``: per deployment and load, each scheme's P99 and
mean TTFT, throughput (every token of the run over its duration) and reuse by prompt length
(<8 K, 8-32 K, >=32 K) beside Dynamo's exact match (``metrics.reuse_by_length_table``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvcompassd.core.config import load_config

from .cli import grid_points, markdown_table, resolve_deployment, run_points
from .engine import SimSettings
from .metrics import reuse_by_length_table
from .policy import Topology
from .schemes import DEFAULT_EVICTION, PAPER_SCHEMES, region_weights
from .synthetic import LongContextParams, LongContextWorkload, servable_prompt_tokens

LOAD_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
DEPLOYMENTS = ("testbed-3continent", "census-64x8")
REQUESTS_PER_POINT = 1_200
WARMUP_S = 60.0
COLUMNS = (("load", "x lambda0", "{:g}"), ("window", "window (s)", "{}"), ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
           ("reuse_ge32k", ">=32K reuse", "{:.1%}"))


def no_reuse_capacity(deployment: str, *, seed: int = 0, sessions: int = 2000) -> float:
    """lambda0 (req/s): the fleet's workers over the mean no-reuse prefill of a long request."""
    cfg = load_config(resolve_deployment(deployment))
    topo = Topology.from_config(cfg)
    workload = LongContextWorkload(1.0, region_weights(topo), seed=seed,
                                   params=LongContextParams(max_prompt_tokens=servable_prompt_tokens(cfg)))
    service_s = workload.mean_prompt_tokens(sessions, seed=seed) * float(np.mean(topo.prefill_ms_per_token)) / 1000.0
    return topo.n_workers / service_s


def run_long(out: Path, *, deployments: Sequence[str] = DEPLOYMENTS, schemes: Sequence[str] = PAPER_SCHEMES,
             fractions: Sequence[float] = LOAD_FRACTIONS, requests_per_point: int = REQUESTS_PER_POINT,
             warmup_s: float = WARMUP_S, seed: int = 0, jobs: int = 1, progress: bool = False,
             page_tokens: int | None = None, capacity_sessions: int = 2000, paper_reach: bool = False) -> list[dict]:
    """Every (deployment, load, scheme) point; rows carry ``load`` (x lambda0), ``lambda0`` and
    ``window`` (the measured arrivals' seconds) besides the summary. ``paper_reach`` adds
    ``kvcompass-paper-reach``: KVCompass with the paper's indexed lengths only (no long lengths),
    on the same requests."""
    points, meta = [], []
    for deployment in deployments:
        lam0 = no_reuse_capacity(deployment, seed=seed, sessions=capacity_sessions)
        cfg_path = resolve_deployment(deployment)
        settings = SimSettings(eviction=DEFAULT_EVICTION["long"], seed=seed)
        for fraction in fractions:
            rate = round(fraction * lam0, 3)
            duration = warmup_s + requests_per_point / rate
            mine = grid_points(cfg_path, "long", schemes, [rate], seed=seed, duration_s=duration, warmup_s=warmup_s,
                               settings=settings, page_tokens=page_tokens, run_progress=progress and jobs <= 1)
            if paper_reach:
                block = load_config(cfg_path).index.block_size  # a context below every length adds none
                mine += [dataclasses.replace(p, scheme="kvcompass", policy_options={"context_tokens": block})
                         for p in grid_points(cfg_path, "long", ["kvcompass"], [rate], seed=seed, duration_s=duration,
                                              warmup_s=warmup_s, settings=settings, page_tokens=page_tokens)]
            points += mine
            meta += [(deployment, fraction, lam0, duration)] * len(mine)
    done = run_points(points, jobs=jobs, progress=progress, desc="fig_long", log=out / "points.jsonl")
    rows = []
    for point, (summary, _), (deployment, fraction, lam0, duration) in zip(points, done, meta):
        scheme = "kvcompass-paper-reach" if "context_tokens" in point.policy_options else summary["scheme"]
        rows.append(dict(summary, scheme=scheme, load=fraction, lambda0=lam0, window=f"{warmup_s:g}-{duration:.0f}",
                         workload=f"long@{deployment}"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown_table(rows, "fig_long: long-context sessions", COLUMNS))
    (out / "reuse_by_length.md").write_text(reuse_by_length_table(rows, "fig_long: reuse by prompt length"))
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=float))
    return rows


def report(rows: list[dict]) -> str:
    """The lines ``fig_long`` prints: per deployment and load, its window, then each scheme."""
    lines = []
    for key in dict.fromkeys((r["deployment"], r["load"]) for r in rows):
        mine = [r for r in rows if (r["deployment"], r["load"]) == key]
        first = mine[0]
        lines.append(f"{key[0]} at {key[1]:g} x lambda0 = {first['rate']:g} req/s (lambda0 {first['lambda0']:.2f}): "
                     f"arrivals {first['window']} s measured, {first['requests']} requests, seed {first['seed']}")
        for r in mine:
            lines.append(f"  {r['scheme']:<18} P99 TTFT {r['ttft_p99_ms']:>9.0f} ms  mean {r['ttft_mean_ms']:>8.0f} ms  "
                         f"{r['throughput_tok_s'] / 1e3:>7.1f} Ktok/s  reuse <8K {_pct(r, 'lt8k')}  "
                         f"8-32K {_pct(r, '8k_32k')}  >=32K {_pct(r, 'ge32k')}")
    return "\n".join(lines)


def _pct(row: dict, suffix: str) -> str:
    return f"{100 * row[f'reuse_{suffix}']:5.1f}%" if row[f"requests_{suffix}"] else "    -"


def fig_long(args) -> list[dict]:
    quick = args.quick
    rows = run_long(args.out / "fig_long", schemes=args.schemes or PAPER_SCHEMES, seed=args.seed, jobs=args.jobs,
                    progress=args.progress, requests_per_point=120 if quick else REQUESTS_PER_POINT,
                    warmup_s=20.0 if quick else WARMUP_S, paper_reach=args.paper_reach)
    print(report(rows))
    return rows
