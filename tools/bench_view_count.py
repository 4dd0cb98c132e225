"""What an edge's status/views query costs per view: counting a keyless view's entries.

    python tools/bench_view_count.py [--capacity 1048576] [--fill 0.85] [--repeat 9]

A keyless view knows its entry count only from the snapshot it started from (update records
carry no counts), so ``kvcompassd.inspect.current_entries`` exports the view and reads the count
its export writes. Prints the median milliseconds of that per view of the given table
capacity, next to one plain ``bytes`` copy of the same size (the reference: the export is a
copy of every slot); a running edge counts one view per event-loop turn, so this is the longest
an admin query holds its requests back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcompassd.core.ludo import LudoTable, LudoView
from kvcompassd.inspect import current_entries


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=1 << 20)
    ap.add_argument("--fill", type=float, default=0.85, help="entries as a share of the capacity")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    table = LudoTable(args.capacity, seed=1)
    n = int(args.capacity * args.fill)
    keys = np.unique(np.random.default_rng(0).integers(1, 1 << 62, n, dtype=np.uint64))
    table.insert_many(keys, np.ones_like(keys))
    view = LudoView.from_snapshot(table.snapshot())
    assert current_entries(view) == len(table)
    blob = view.snapshot()
    count = median_ms(lambda: current_entries(view), args.repeat)
    copy = median_ms(lambda: bytearray(blob), args.repeat)
    print(f"view: {view.slots} slots, {len(table)} entries, {view.memory_bytes / 2**20:.1f} MiB")
    print(f"count entries (export + read): {count:.2f} ms median of {args.repeat}")
    print(f"copy of the export's bytes:    {copy:.2f} ms (reference); ratio {count / copy:.1f}x")


if __name__ == "__main__":
    main()
