"""``kvcompassd demo`` interrupted while it measures: Ctrl-C (SIGINT) stops every node the demo
started and still prints what was measured."""

from __future__ import annotations

import signal
import time
import urllib.request

from demo_helpers import Demo
from kvcompassd.core.config import load_config
from kvcompassd.demo import RUNS


def test_ctrl_c_while_measuring_stops_every_node_and_prints_what_was_measured(tmp_path):
    concurrency = 2
    requests = 4000  # far more than are served before the interrupt
    demo = Demo("--requests", str(requests), "--concurrency", str(concurrency), "--time-scale", "1",
                "--workdir", str(tmp_path))
    try:
        demo.wait_for(r"replaying")
        # Interrupt once the demo's clients have results: with one request in flight per client,
        # more finished at the edges than there are clients means a client has one.
        edges = load_config(tmp_path / "run0" / "cluster-us.toml").edges
        deadline = time.monotonic() + 300
        while _requests_finished(edges) <= concurrency:
            assert time.monotonic() < deadline and demo.proc.poll() is None
            time.sleep(0.2)
    except BaseException:
        demo.proc.kill()
        raise
    code, out = demo.finish(signal.SIGINT)
    assert code == 128 + signal.SIGINT and "interrupted by SIGINT" in out
    row = next(line for line in out.splitlines() if line.startswith(f"{RUNS[0][0]} (interrupted)"))
    measured = int(row.split("(interrupted)")[1].split()[0])
    assert 0 < measured < requests
    assert "Traceback" not in demo.proc.stderr.read()


def _requests_finished(edges) -> int:
    total = 0
    for edge in edges:
        try:
            with urllib.request.urlopen(f"http://{edge.http}/metrics", timeout=30) as resp:
                text = resp.read().decode()
        except OSError:  # a busy edge: this poll counts nothing from it, the next one asks again
            continue
        for line in text.splitlines():
            if line.startswith("kvcompass_request_seconds_count"):
                total += int(float(line.split()[-1]))
    return total
