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


def test_the_view_holds_the_clients_prefixes_where_the_router_looks_them_up():
    """The tool's view (``hold_prefixes``, through ``benchlib.hold_prompt``) credits the worker
    with each group's prefix, under the keys the edge's Router looks a client prompt up with."""
    import time

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_request_path as tool
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
    from kvcompassd.core.layout import IndexLayout
    from kvcompassd.core.levels import LevelPlan
    from kvcompassd.core.router import Router
    from kvcompassd.launcher import DeploymentSpec, build_cluster
    from kvcompassd.tokenizer import ByteTokenizer

    cfg = build_cluster(DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=1, wan=False))
    layout = IndexLayout.from_config(cfg)
    worker = cfg.workers[1].id
    longest = LevelPlan.from_config(cfg).registration_lengths_upto(1500)[-1]
    for held in (True, False):
        shard = MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=cfg.index.initial_capacity)
        if held:
            tool.hold_prefixes(cfg, shard, worker, 1500)
        view = EdgeIndexView(layout, 1, edge=cfg.edges[0].id)
        view.install_snapshot(shard.snapshot())
        router = Router(cfg, "us", view, now=time.monotonic())
        for prefix in tool.group_prefixes(1500):
            tokens = ByteTokenizer().encode_array(prefix + " 0-1 " + "x" * 500)
            decision = router.decide(tokens, now=time.monotonic())
            if held:
                assert (decision.worker, decision.claimed_tokens) == (worker, longest)
            else:
                assert decision.claimed_tokens == 0
            router.on_aborted(decision.dispatch, now=time.monotonic())
