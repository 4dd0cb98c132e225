"""tools/bench_request_path.py: each ``--stage`` serves a real closed loop through the front door's
HTTP server to a real emulated worker, without errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_request_path.py"


@pytest.mark.parametrize("stage", ["relay", "route"])
def test_a_stage_serves_the_closed_loop_through_a_real_worker(stage, tmp_path):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(TOOL), "--stage", stage, "--windows", "1", "--seconds", "1",
                    "--concurrency", "4", "--json", str(out)],
                   check=True, cwd=tmp_path, timeout=120, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = json.loads(out.read_text())
    assert result["stage"] == stage
    assert result["served"][0] > 0 and result["errors"] == [0]
    assert len(result["us_per_request"]) == 1 and result["us_per_request"][0] > 0
