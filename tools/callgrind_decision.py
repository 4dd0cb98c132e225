"""Instructions per forwarding decision, counted by callgrind (deterministic, unlike a clock).

    valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=OUT \\
        python tools/callgrind_decision.py [--configs testbed-3continent] [--entries 200000]
        [--decisions 200] [--tokens 4096] [--in-flight 64] [--running 0]
    python tools/callgrind_decision.py --summarize OUT.1 [OUT.2 ...] --decisions 200

Builds the view and the daemon's Router as ``tools/bench_forward.py`` does (same fill, same
prompt, every own-region worker reported idle, each running ``--running`` requests), warms it
up, then switches callgrind's collection on around each ``Router.decide`` only
(``CALLGRIND_TOGGLE_COLLECT`` from a tiny C helper compiled into a temporary directory and
loaded with ctypes), so the counts hold the decisions and nothing else: the view's build, the
warm-up and each request's end (``Router.on_aborted``, ``--in-flight`` decisions later, as in
bench_forward) are not counted.
Divide the totals by ``--decisions``. Outside valgrind the toggles do nothing and the script
prints the decisions' wall time instead (for a dry run).

With several configs, each is counted in its own dump (``CALLGRIND_DUMP_STATS_AT``, named after
the config); ``--summarize`` reads the parts (through ``callgrind_annotate --inclusive=yes``) and
prints instructions per decision: in all, in the fused C call (any ``_cffi_f_kvc_forward_decide*``
wrapper), hashing (``kvc_prefix_keys*``, which under valgrind is the portable SHA-256: valgrind
hides SHA-NI), the rest of the call and the Python around it, and the functions behind them. Instruction counts of the view
reads barely depend on ``--entries`` (cache misses are not instructions), so a small fill keeps the
run short under valgrind.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_forward import InFlight, build_view, named_config, with_levels  # noqa: E402
from benchlib import callgrind_helper  # noqa: E402

from kvcompassd.core.ludo import set_huge_page_views  # noqa: E402
from kvcompassd.core.router import Router  # noqa: E402

def count_config(name: str, args: argparse.Namespace, helper: ctypes.CDLL) -> None:
    cfg = with_levels(named_config(name), args.levels)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, 128_256, size=args.tokens, dtype=np.uint32)
    set_huge_page_views(True)
    view, _, total = build_view(cfg, args.entries, prompt, args.seed)
    region = cfg.region_names()[0]
    router = Router(cfg, region, view, now=0.0)  # the edge daemon's settings
    for w in cfg.workers_in(region):  # idle; with --running, each running that many requests (occupancy on)
        router.queues.set_local(w.id, 0.0, now=0.0, running=args.running)
    clock = itertools.count(0.0, 0.01)
    last = [0.0]
    end = InFlight(router, lambda: last[0], args.in_flight) if args.in_flight else None
    for _ in range(args.warmup):
        last[0] = next(clock)
        decision = router.decide(prompt, now=last[0])
        if end is not None:
            end(decision)
    toggle, decide = helper.kvc_bench_toggle, router.decide
    helper.kvc_bench_zero()
    t0 = time.perf_counter()
    for _ in range(args.decisions):
        now = last[0] = next(clock)
        toggle()
        decision = decide(prompt, now=now)
        toggle()
        if end is not None:
            end(decision)
    elapsed = time.perf_counter() - t0
    helper.kvc_bench_dump(name.encode())
    print(f"{name}: {len(cfg.workers)} workers, {total:,} entries, {args.decisions} decisions counted "
          f"({elapsed / args.decisions * 1e6:.1f} µs each with the toggles, outside valgrind)", flush=True)


# Functions whose inclusive counts the summary shows (regex on callgrind_annotate's names).
_SHOWN = (
    ("fused C call (cffi wrapper)", r"_cffi_f_kvc_forward_decide\w*$"),
    ("  hashing", r"kvc_prefix_keys_paired$"),
    ("  lookup (kvc_lookup_sparse)", r"kvc_lookup_sparse(_masked)?$"),
    ("  score (kvc_score_choose_pruned)", r"kvc_score_choose_pruned$"),
    ("  queue aging (kvc_queue_aged)", r"kvc_queue_aged$"),
    ("  miss summary", r"kvc_miss_summary_holders$"),
    ("ffi.from_buffer", r"ffi_from_buffer$"),
    ("np.empty", r"array_empty$"),
    ("ndarray.copy", r"array_copy$"),
    ("setflags", r"array_setflags$"),
    ("Python __init__ (slot_tp_init)", r"slot_tp_init$"),
    ("builtins.all", r"builtin_all$"),
    ("memset", r"__memset_\w+$"),
    ("memcpy", r"__memcpy_\w+$"),
    ("the collection toggles (ctypes)", r"PyCFuncPtr_call$"),
)


def summarize(path: str, decisions: int) -> None:
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path], check=True,
                         capture_output=True, text=True).stdout
    trigger = re.search(r"^Trigger: Client Request: (.*)$", out, re.M)
    counts: dict[str, int] = {}
    total = 0
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*)$", line)
        if not m:
            continue
        ir = int(m.group(1).replace(",", ""))
        name = m.group(2)
        if name == "PROGRAM TOTALS":
            total = ir
            continue
        function = name.split(" [")[0].rsplit(":", 1)[-1]
        # The first (largest) count of each function: its inclusive cost at its outermost call.
        counts.setdefault(function, ir)
    print(f"\n{path} ({trigger.group(1) if trigger else '?'}): instructions per decision, {decisions} decisions")
    rows = [("in all", total)]
    for label, pattern in _SHOWN:
        rows.append((label, sum(ir for f, ir in counts.items() if re.match(pattern, f))))
    fused = rows[1][1]
    hashing = rows[2][1]
    rows.insert(3, ("  the call less hashing", fused - hashing))
    rows.insert(1, ("in all less hashing", total - hashing))
    rows.append(("Python around the C call (in all - the call)", total - fused))
    for label, ir in rows:
        print(f"  {label:<46} {ir / decisions:>12,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="testbed-3continent")
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--levels", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--running", type=int, default=0,
                        help="each own-region worker reports this many running requests (the score adds their "
                             "occupancy, as on a busy edge: tools/bench_forward.py --running)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", nargs="+", metavar="OUT",
                        help="print the instructions per decision of these callgrind outputs instead")
    args = parser.parse_args()
    if args.summarize:
        for path in args.summarize:
            summarize(path, args.decisions)
        return
    with tempfile.TemporaryDirectory() as tmp:
        helper = callgrind_helper(Path(tmp))
        for name in args.configs.split(","):
            count_config(name.strip(), args, helper)


if __name__ == "__main__":
    main()
