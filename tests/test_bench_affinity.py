"""tools/bench_affinity.py: its command line keeps every ``--score`` setting, and it reads the
copy price's counts off what an edge's metrics registry really prints."""

from __future__ import annotations

import collections

from prometheus_client import generate_latest
from tool_loader import load_tool

from kvcompassd.metrics import EdgeMetrics


def test_repeated_score_settings_all_count():
    # (nargs="*" kept only the last --score: a run meant for two settings measured one)
    tool = load_tool("bench_affinity")
    want = [("copy_weight", 2.0), ("occupancy_ms_per_running", 2.0)]
    assert tool.parse_args(["--score", "copy_weight=2", "--score", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args(["--score", "copy_weight=2", "occupancy_ms_per_running=2"]).score == want
    assert tool.parse_args([]).score == []


def test_the_copy_counts_are_read_off_an_edges_metrics_text():
    tool = load_tool("bench_affinity")
    metrics = EdgeMetrics()
    assert tool.copy_counts(generate_latest(metrics.registry).decode()) == {"moved": 0, "kept": 0, "decisions": 0}
    counts = {"moved": 4, "kept": 7}
    for outcome in counts:
        metrics.copy_charged.labels(outcome).set_function(lambda o=outcome: counts[o])
    metrics.decisions.labels("local_hit").inc(30)
    metrics.decisions.labels("recompute").inc(12)
    text = generate_latest(metrics.registry).decode()
    assert tool.copy_counts(text) == {"moved": 4, "kept": 7, "decisions": 42}


def test_worker_balance_reads_shares_and_group_homes_busiest_first():
    tool = load_tool("bench_edge")
    per_group = {
        0: collections.Counter({"w1": 6, "w2": 2}),
        1: collections.Counter({"w1": 4, None: 3}),  # unattributed requests count for no worker
        2: collections.Counter({"w3": 8}),
        3: collections.Counter({None: 2}),  # a group never attributed is home to no worker
    }
    shares, homes = tool.worker_balance(per_group)
    assert shares == [0.5, 0.4, 0.1]
    assert homes == [2, 1, 0]
    assert tool.worker_balance({}) == ([], [])
