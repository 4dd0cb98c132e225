"""Run ``python -m kvcompassd ARGS...`` under cProfile with a CPU clock, profiling only between
SIGUSR1 (start) and SIGUSR2 (stop, and write the profile): a benchmark profiles its measured
windows, not the start-up. The n-th SIGUSR2 writes ``$KVC_PROFILE_DIR/<mode>.<node-id>.<n>.prof``.

    KVC_PROFILE_DIR=/tmp/prof python tools/profile_daemon.py agent --config c.toml --id us-0 ...

(``tools/bench_idle.py --profile DIR`` runs its candidate's daemons this way.)
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time


def main() -> None:
    out_dir = os.environ["KVC_PROFILE_DIR"]
    args = sys.argv[1:]
    name = f"{args[0]}.{args[args.index('--id') + 1]}" if "--id" in args else args[0]
    profiler = cProfile.Profile(time.process_time)
    dumps = 0

    def start(*_: object) -> None:
        profiler.enable()

    def stop(*_: object) -> None:
        nonlocal dumps
        profiler.disable()
        dumps += 1
        profiler.dump_stats(os.path.join(out_dir, f"{name}.{dumps}.prof"))
        profiler.clear()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["kvcompassd", *args]
    runpy.run_module("kvcompassd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
