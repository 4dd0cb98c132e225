"""The soak tool's short variant, as CI runs it: a steady request rate through the demo
deployment (real daemons, QUIC through WAN relays) with no failed request, no daemon lost, every
edge's views converging to the shards' exact state, and no RSS growth past the tool's threshold.
The 10-minute run (``python tools/soak.py``) is the long variant; its figures go into notes."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


@pytest.mark.slow
def test_short_soak_serves_every_request_and_converges(tmp_path):
    run = subprocess.run([sys.executable, str(TOOL), "--minutes", "0.2", "--rate", "4", "--sample-s", "1",
                          "--time-scale", "0", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=420)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "verdict: OK" in report and " 0 failed" in report, report
    assert "edge views equal the shards' state" in report and "NOT within" not in report, report
