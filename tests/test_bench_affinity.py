"""tools/bench_affinity.py: its command line keeps every ``--score`` setting."""

from __future__ import annotations

from tool_loader import load_tool


def test_repeated_score_settings_all_count():
    # (nargs="*" kept only the last --score: a run meant for two settings measured one)
    tool = load_tool("bench_affinity")
    want = [("copy_weight", 2.0), ("occupancy_ms_per_running", 2.0)]
    assert tool.parse_args(["--score", "copy_weight=2", "--score", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args(["--score", "copy_weight=2", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args([]).score == []
