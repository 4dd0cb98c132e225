#!/usr/bin/env python3
"""Benchmark of the Ludo C core (issue 2, item 7): the paper's Tables 2, 3 and 5 (left).

Table 2  lookup / insert / update / remove at 85, 90 and 95 % occupancy: P50 and P99 of single
         operations (timed inside C, each write including the shipping of its records into a
         view) and single-thread rates of the batch API with the view kept in sync
         (ops + take_updates + view.apply), next to dict.get over the same keys in the same run.
Table 3  view bits per entry at 95 % occupancy (everything it allocates), the maintenance table's,
         and a Python dict directory holding the same key -> value mappings (tracemalloc).
Table 5  (left) rate at which never-inserted keys return a non-zero value, at 20..95 % load,
         without and with fingerprint bits.

Every figure is the median of --runs runs. Example: python tools/bench_ludo.py --entries 200000
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin and steal the other core

import argparse
import gc
import statistics
import sys
import time
import tracemalloc

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.ludo import KEY_LIMIT, LudoTable, LudoView

OCCUPANCIES = (0.85, 0.90, 0.95)
FALSE_HIT_LOADS = (0.20, 0.40, 0.60, 0.80, 0.95)
PAPER_TABLE2 = {  # Table 2 of the paper (its C++ on a dual 96-core host)
    "lookup": ("310 ns", "590 ns", "5.4 M/s"),
    "insert": ("1.2-1.4 us", "4.4-6.1 us", "0.6-0.7 M/s"),
    "update": ("170 ns", "1.0-1.8 us", "4.8-5.8 M/s"),
    "remove": ("0.8-0.9 us", "4.8-5.9 us", "0.8-0.9 M/s"),
}


def unique_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    keys = np.unique(rng.integers(0, KEY_LIMIT, size=n + n // 1000 + 16, dtype=np.uint64))
    while keys.size < n:  # astronomically rare: too many collisions
        keys = np.unique(np.concatenate([keys, rng.integers(0, KEY_LIMIT, size=n, dtype=np.uint64)]))
    return rng.permutation(keys[:n])


def values_for(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 1 << 32, size=n, dtype=np.uint64)


def sync(table: LudoTable, view: LudoView) -> None:
    for blob in table.take_updates():
        view.apply(blob)


def u64(arr: np.ndarray):
    return ffi.cast("uint64_t *", arr.ctypes.data)


def c_op_latencies(table: LudoTable, view: LudoView, op: int, keys: np.ndarray, values: np.ndarray | None) -> np.ndarray:
    """Nanoseconds of each single op + shipping its records into the view (timed in C)."""
    ns = np.empty(keys.size, dtype=np.uint64)
    vals = values if values is not None else keys
    # bench-only access to the C handles: the public wrapper has no per-op timing entry point
    rc = lib.kvc_bench_table_ops(table._ptr, view._ptr, op, u64(keys), u64(vals), keys.size, u64(ns))
    if rc != lib.KVC_OK:
        raise RuntimeError(f"benchmark op {op} failed with code {rc}")
    return ns


def c_lookup_latencies(view: LudoView, keys: np.ndarray) -> np.ndarray:
    ns = np.empty(keys.size, dtype=np.uint64)
    sink = ffi.new("uint64_t *")
    lib.kvc_bench_view_lookups(view._ptr, u64(keys), keys.size, u64(ns), sink)
    return ns


class Clock:
    """Wall time and this thread's CPU time of the calls it times, so that a rate can be quoted
    both ways: on a shared machine the CPU-time rate is what the code costs, the wall-time rate
    what it got."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def rate(self, name: str, count: int, fn) -> None:
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        w1, c1 = time.perf_counter(), time.thread_time()
        self.wall.setdefault(name, []).append(count / (w1 - w0))
        self.cpu.setdefault(name, []).append(count / max(c1 - c0, 1e-9))

    def median(self, name: str) -> tuple[float, float]:
        return statistics.median(self.cpu[name]), statistics.median(self.wall[name])


def fill(table: LudoTable, keys: np.ndarray, values: np.ndarray, chunk: int = 1 << 20) -> float:
    t0 = time.perf_counter()
    for lo in range(0, keys.size, chunk):
        table.insert_many(keys[lo : lo + chunk], values[lo : lo + chunk])
    return time.perf_counter() - t0


def fmt_ns(ns: float) -> str:
    return f"{ns:.0f} ns" if ns < 1000 else f"{ns / 1000:.2f} us"


def fmt_rate(per_s: float) -> str:
    return f"{per_s / 1e6:.2f} M/s" if per_s >= 1e5 else f"{per_s / 1e3:.1f} K/s"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(line)
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(line, flush=True)


# ---------------------------------------------------------------------------------- Table 2


def table2(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[list[str]], dict[str, float]]:
    n = args.entries
    ops = args.ops
    single = args.single_ops
    rows: list[list[str]] = []
    extra: dict[str, float] = {}
    keys = unique_keys(rng, n + args.runs * (ops + single) + 1)
    present, spare = keys[:n], keys[n:]
    values = values_for(rng, keys.size)
    probe_n = min(n, args.lookup_batch)
    for occ in OCCUPANCIES:
        table = LudoTable(n, max_load=occ, seed=1000 + int(occ * 100))
        fill_s = fill(table, present, values[:n])
        table.take_updates()
        view = LudoView.from_snapshot(table.snapshot())
        live = present.copy()  # keys present now, in random order
        live_vals = values[:n].copy()
        res: dict[str, list[float]] = {k: [] for k in ("lk_p50", "lk_p99", "in_p50", "in_p99", "up_p50",
                                                      "up_p99", "rm_p50", "rm_p99")}
        clock = Clock()
        ref = None
        if occ == OCCUPANCIES[-1]:
            ref = dict(zip(present[:probe_n].tolist(), values[:probe_n].tolist()))
        for run in range(args.runs):
            order = rng.permutation(n)
            probe = live[order[:probe_n]]
            out = np.empty(0)

            def batch() -> None:
                nonlocal out
                out = view.lookup_many(probe)

            clock.rate("lk_batch", probe_n, batch)
            assert np.array_equal(out, live_vals[order[:probe_n]]), "view disagrees with the table"
            lat = c_lookup_latencies(view, probe[:single])
            res["lk_p50"].append(float(np.percentile(lat, 50)))
            res["lk_p99"].append(float(np.percentile(lat, 99)))
            few = probe[:single].tolist()
            lookup = view.lookup
            clock.rate("lk_single", len(few), lambda: [lookup(k) for k in few])
            if ref is not None:
                ref_keys = present[rng.permutation(probe_n)].tolist()
                get = ref.get
                clock.rate("dict", len(ref_keys), lambda: [get(k) for k in ref_keys])

            # update: batch rate, then single-op latencies on other keys
            upd = live[order[:ops]]
            new_vals = values_for(rng, ops)
            clock.rate("up", ops, lambda: (table.update_many(upd, new_vals), sync(table, view)))
            live_vals[order[:ops]] = new_vals
            upd1 = live[order[ops : ops + single]]
            new_vals1 = values_for(rng, single)
            lat = c_op_latencies(table, view, 2, upd1, new_vals1)
            live_vals[order[ops : ops + single]] = new_vals1
            res["up_p50"].append(float(np.percentile(lat, 50)))
            res["up_p99"].append(float(np.percentile(lat, 99)))

            # remove ops + single keys, then insert as many fresh ones: occupancy returns to occ
            gone = live[order[-(ops + single) :]]
            clock.rate("rm", ops, lambda: (table.remove_many(gone[:ops]), sync(table, view)))
            lat = c_op_latencies(table, view, 3, gone[ops:], None)
            res["rm_p50"].append(float(np.percentile(lat, 50)))
            res["rm_p99"].append(float(np.percentile(lat, 99)))
            fresh = spare[run * (ops + single) : (run + 1) * (ops + single)]
            fresh_vals = values_for(rng, fresh.size)
            epoch = table.epoch
            clock.rate("in", ops, lambda: (table.insert_many(fresh[:ops], fresh_vals[:ops]), sync(table, view)))
            lat = c_op_latencies(table, view, 1, fresh[ops:], fresh_vals[ops:])
            res["in_p50"].append(float(np.percentile(lat, 50)))
            res["in_p99"].append(float(np.percentile(lat, 99)))
            extra[f"rebuilds_{occ}"] = extra.get(f"rebuilds_{occ}", 0) + table.epoch - epoch
            keep = np.ones(n, dtype=bool)
            keep[order[-(ops + single) :]] = False
            live = np.concatenate([live[keep], fresh])
            live_vals = np.concatenate([live_vals[keep], fresh_vals])
        med = {k: statistics.median(v) for k, v in res.items() if v}
        pct = f"{occ:.0%}"

        def rate(name: str) -> str:
            cpu, wall = clock.median(name)
            return f"{fmt_rate(cpu)} ({fmt_rate(wall)})"

        rows.append(["lookup (batch, prefetch)", pct, "", "", rate("lk_batch"), PAPER_TABLE2["lookup"][2]])
        rows.append(["lookup (single)", pct, fmt_ns(med["lk_p50"]), fmt_ns(med["lk_p99"]),
                     rate("lk_single") + " wrapper", " / ".join(PAPER_TABLE2["lookup"])])
        for name, key in (("insert", "in"), ("update", "up"), ("remove", "rm")):
            rows.append([f"{name} (view in sync)", pct, fmt_ns(med[f"{key}_p50"]), fmt_ns(med[f"{key}_p99"]),
                         rate(key), " / ".join(PAPER_TABLE2[name])])
        if "dict" in clock.cpu:
            extra["dict_get"] = clock.median("dict")
            extra["batch_vs_dict"] = clock.median("lk_batch")[0] / clock.median("dict")[0]
            extra["batch_vs_dict_wall"] = clock.median("lk_batch")[1] / clock.median("dict")[1]
            extra["single_vs_dict"] = clock.median("lk_single")[0] / clock.median("dict")[0]
        extra[f"fill_rate_{occ}"] = n / fill_s
        extra[f"load_{occ}"] = len(table) / table.slots
        table = view = ref = None  # freed before the next occupancy builds its table
        gc.collect()
    return rows, extra


# ---------------------------------------------------------------------------------- Table 3


def table3(args: argparse.Namespace, rng: np.random.Generator) -> list[list[str]]:
    n = args.entries
    keys = unique_keys(rng, n)
    values = values_for(rng, n)
    table = LudoTable(n, max_load=0.95, seed=3)
    fill(table, keys, values)
    view = LudoView.from_snapshot(table.snapshot())
    table.take_updates()
    view_bits = view.memory_bytes * 8 / n
    table_bits = table.memory_bytes * 8 / n
    overflow = view.overflow_count
    load = len(table) / table.slots
    del view, table
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    directory = dict(zip(keys.tolist(), values.tolist()))
    dict_bits = (tracemalloc.get_traced_memory()[0] - base) * 8 / n
    tracemalloc.stop()
    del directory
    gc.collect()
    return [
        ["Ludo view (keyless, all-in)", f"{load:.1%}", f"{view_bits:.1f}", f"{dict_bits / view_bits:.1f}x smaller",
         f"overflow map holds {overflow} buckets"],
        ["Ludo maintenance table (keys)", f"{load:.1%}", f"{table_bits:.1f}", f"{dict_bits / table_bits:.1f}x smaller", ""],
        ["Python dict directory", "-", f"{dict_bits:.1f}", "1.0x", "int keys -> int values, tracemalloc"],
        ["paper: view theory / measured", "95%", "37.4 / 48", "", "reference C++: 38 core, 58 all-in"],
    ]


# ---------------------------------------------------------------------------------- Table 5


def table5(args: argparse.Namespace, rng: np.random.Generator) -> list[list[str]]:
    n = args.entries
    keys = unique_keys(rng, n)
    values = values_for(rng, n)
    rows = []
    for bits in (0, args.fingerprint_bits):
        table = LudoTable(n, max_load=0.95, fingerprint_bits=bits, seed=50 + bits)
        view = LudoView.from_snapshot(table.snapshot())
        done = 0
        rates = []
        for load in FALSE_HIT_LOADS:
            target = min(n, int(round(load * table.slots)))
            fill(table, keys[done:target], values[done:target])
            done = target
            sync(table, view)
            per_run = []
            for _ in range(args.runs):
                # a random 63-bit key is one of the n inserted with probability n / 2^63: never
                probes = rng.integers(0, KEY_LIMIT, size=args.probes, dtype=np.uint64)
                per_run.append(np.count_nonzero(view.lookup_many(probes)) / probes.size)
            rates.append(statistics.median(per_run))
        rows.append([f"{bits} fingerprint bits"] + [f"{r:.3%}" for r in rates])
        del table, view
        gc.collect()
    rows.append(["paper (0 bits)", "", "", "", "", "45.3%"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000, help="entries per table (default 10^7)")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure; medians are printed (>= 3)")
    ap.add_argument("--quick", action="store_true", help="fewer timed operations per run (a smoke run)")
    ap.add_argument("--fingerprint-bits", type=int, default=8, help="d for Table 5's fingerprint row")
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args(argv)
    if args.entries < 1000 or args.runs < 1:
        ap.error("--entries must be >= 1000 and --runs >= 1")
    # timed phases remove and re-insert at most ~1.2 % of the entries, so occupancy stays put
    args.ops = max(100, min(20_000 if args.quick else 100_000, args.entries // 100))  # batch ops
    args.single_ops = max(100, min(5_000 if args.quick else 20_000, args.entries // 500))  # C-timed
    args.lookup_batch = min(args.entries, 2_000_000 if args.quick else 4_000_000)
    args.probes = 200_000 if args.quick else 1_000_000
    rng = np.random.default_rng(args.seed)
    print(f"Ludo benchmark: {args.entries:,} entries, {args.runs} runs (medians), 32-bit values, "
          f"{args.ops:,} batch ops and {args.single_ops:,} single ops per phase", flush=True)
    t0 = time.perf_counter()

    rows, extra = table2(args, rng)
    print_table("Table 2: operation cost (writes include shipping their records into a view)",
                ["operation", "occupancy", "P50", "P99", "rate: CPU (wall)", "paper P50 / P99 / rate"], rows)
    print("P50/P99: single operations timed in C (clock_gettime around each op; writes include draining\n"
          "their records and applying them to a view). Rates: batch API from Python, one thread, ops per\n"
          "second of this thread's CPU time (and of wall time); writes include take_updates + view.apply.")
    print(f"dict.get over the same keys (95 % table's keys): {fmt_rate(extra['dict_get'][0])} CPU "
          f"({fmt_rate(extra['dict_get'][1])} wall); batch lookup = {extra['batch_vs_dict']:.1f}x dict.get "
          f"({extra['batch_vs_dict_wall']:.1f}x by wall time); single-key wrapper call = {extra['single_vs_dict']:.2f}x")
    print("fill rates (insert_many from empty): " + ", ".join(
        f"{occ:.0%}: {fmt_rate(extra[f'fill_rate_{occ}'])}" for occ in OCCUPANCIES))
    print("rebuilds (new epoch) during timed inserts: " + ", ".join(
        f"{occ:.0%}: {int(extra.get(f'rebuilds_{occ}', 0))}" for occ in OCCUPANCIES))

    print_table("Table 3: memory per entry (bits), 32-bit values, no fingerprints",
                ["structure", "load", "bits/entry", "vs dict", "note"], table3(args, rng))

    print_table(f"Table 5 (left): never-inserted keys returning a non-zero value, {args.probes:,} probes",
                ["variant"] + [f"{x:.0%} load" for x in FALSE_HIT_LOADS], table5(args, rng))
    print(f"expected with d bits: about 2^-d = {2.0 ** -args.fingerprint_bits:.4%} of the 0-bit rate")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
