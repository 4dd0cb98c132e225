"""tools/bench_tail.py: the window summary's latency and first-token percentiles by hand, and where its
``--score`` settings go."""

from __future__ import annotations

import asyncio

import pytest

from tool_loader import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_tail")


def test_the_summary_splits_latency_from_time_to_first_token(tool):
    # 100 requests: first token 10 ms after sending, the end 10 + i ms later (i = 0..99).
    records = [{"group": i % 2, "worker": "us-0", "cached": 16, "claimed": 16, "pending": False,
                "sent": float(i), "first": i + 0.010, "latency_ms": 10.0 + i} for i in range(100)]
    out = tool.summarize(records, elapsed=10.0, shared=16, tail_percent=5.0)
    assert out["rps"] == pytest.approx(10.0)
    assert out["p50_ms"] == pytest.approx(59.0) and out["p99_ms"] == pytest.approx(109.0)
    assert out["ttft_p50_ms"] == pytest.approx(10.0) and out["ttft_p99_ms"] == pytest.approx(10.0)
    assert out["reuse"] == 1.0 and out["affinity"] == 1.0


def test_score_settings_reach_every_edge_variant_and_not_direct(tool, monkeypatch):
    seen = []

    async def start(args, beta_error, *, score=None, workers_only=False):
        seen.append((score, workers_only))
        raise RuntimeError("not started")  # measure() stops here; what start() was given is the point

    monkeypatch.setattr(tool, "start", start)
    args = type("Args", (), {"score": [("copy_weight", 2.0)]})()

    for variant in ("direct", "refute"):
        with pytest.raises(RuntimeError):
            asyncio.run(tool.measure(args, variant, 0))
    assert seen[0] == (None, True)
    assert seen[1] == ({**tool.VARIANTS["refute"], "copy_weight": 2.0}, False)


def test_repeated_score_settings_all_count(tool):
    # (nargs="*" kept only the last --score: a run meant for two settings measured one)
    want = [("copy_weight", 2.0), ("occupancy_ms_per_running", 2.0)]
    assert tool.parse_args(["--score", "copy_weight=2", "--score", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args(["--score", "copy_weight=2", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args([]).score == []
