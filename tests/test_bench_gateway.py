"""tools/bench_gateway.py: its arithmetic checked by hand, attribution against the emulator's own
output tokens, the routers' command lines, and a short run of the kvcompassd arm on real daemons."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompassd.emulator.server import output_tokens
from tool_loader import load_tool

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_gateway.py"


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_gateway")


def test_affinity_is_the_top_workers_share_of_each_group(tool):
    served = [(0, "a"), (0, "a"), (0, "b"), (1, "c"), (1, "c"), (1, "c"), (1, None)]
    # group 0: a served 2 of 3; group 1: c served 3 of 4 (the unattributed one counts against it)
    assert tool.prefix_affinity(served) == pytest.approx(5 / 7)
    assert tool.prefix_affinity([(0, None), (0, None)]) == 0.0
    assert math.isnan(tool.prefix_affinity([]))
    round_robin = [(g, f"w{i % 4}") for i, g in enumerate([0, 0, 0, 0, 1, 1, 1, 1])]
    assert tool.prefix_affinity(round_robin) == pytest.approx(0.25)


def test_reuse_counts_requests_with_the_whole_prefix_cached(tool):
    assert tool.reuse_share([1488, 1500, 1487, 0], 1488) == pytest.approx(0.5)
    assert math.isnan(tool.reuse_share([], 1488))


def test_window_stats(tool):
    latencies = [0.001 * i for i in range(200, 0, -1)]  # 1..200 ms
    stats = tool.window_stats(latencies, 2.0, [(0, "a")] * 200, [32] * 200, 32, errors=3)
    assert stats["requests"] == 200 and stats["errors"] == 3
    assert stats["rps"] == pytest.approx(100.0)
    assert stats["p50_ms"] == pytest.approx(100.0) and stats["p99_ms"] == pytest.approx(198.0)  # nearest rank
    assert stats["mean_ms"] == pytest.approx(100.5)
    assert stats["affinity"] == 1.0 and stats["reuse"] == 1.0 and stats["unattributed"] == 0
    assert stats["elapsed_s"] == 2.0


def _w(rps, p50, p99, mean, requests=100, cpu=None, affinity=0.25, reuse=0.5):
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99, "mean_ms": mean, "requests": requests, "affinity": affinity,
            "reuse": reuse, "errors": 0, "unattributed": 0, "cpu_s": cpu or {}}


def test_compare_takes_means_of_the_abba_windows_and_cpu_per_request(tool):
    direct = [_w(1000, 1.0, 3.0, 1.2), _w(800, 1.2, 3.4, 1.4)]
    routed = [_w(500, 2.0, 5.0, 2.5, requests=400, cpu={"edge": 0.2, "agents": 0.1}, affinity=1.0, reuse=1.0),
              _w(400, 2.4, 5.4, 2.7, requests=600, cpu={"edge": 0.3, "agents": 0.3}, affinity=0.9, reuse=1.0)]
    x = tool.compare(direct, routed)
    assert x["direct_rps"] == 900 and x["rps"] == 450 and x["ratio"] == pytest.approx(0.5)
    assert x["added_p50_ms"] == pytest.approx(2.2 - 1.1) and x["added_p99_ms"] == pytest.approx(5.2 - 3.2)
    assert x["mean_ms"] == pytest.approx(2.6) and x["direct_mean_ms"] == pytest.approx(1.3)
    # CPU over both windows / requests over both windows: 0.5 s / 1000 and 0.4 s / 1000
    assert x["cpu_us.edge"] == pytest.approx(500.0) and x["cpu_us.agents"] == pytest.approx(400.0)
    assert x["affinity"] == pytest.approx(0.95) and x["direct_affinity"] == pytest.approx(0.25)
    assert not any(k.startswith("cpu_net_us.") for k in x)
    # Idle, the edge burns 0.05 cores: over the windows' 2 s, 0.1 s of its 0.5 s is not the requests'.
    for w in routed:
        w["elapsed_s"] = 1.0
    net = tool.compare(direct, routed, idle={"edge": 0.05, "workers": 0.01})
    assert net["cpu_net_us.edge"] == pytest.approx(400.0) and "cpu_net_us.agents" not in net
    assert net["cpu_us.edge"] == pytest.approx(500.0)


def test_the_edges_retries_are_read_off_its_metrics_and_summed_over_the_router_windows(tool):
    page = ("# HELP kvcompass_retries_total Attempts moved to another worker\n"
            "# TYPE kvcompass_retries_total counter\n"
            "kvcompass_retries_total 7.0\n"
            "kvcompass_retries_created 1.7e+09\n"
            "kvcompass_retries_totally_other 3.0\n")
    assert tool.retries_in_metrics(page) == 7.0  # the counter itself, not its _created nor a longer name
    assert tool.retries_in_metrics("") == 0.0
    direct = [_w(1000, 1.0, 3.0, 1.2), _w(800, 1.2, 3.4, 1.4)]
    routed = [dict(_w(500, 2.0, 5.0, 2.5), retries=2.0), dict(_w(400, 2.4, 5.4, 2.7), retries=3.0)]
    assert tool.compare(direct, routed)["retries"] == 5.0
    assert tool.compare(direct, [_w(500, 2.0, 5.0, 2.5)])["retries"] == 0  # a router without the metric


def test_who_served_is_read_off_the_emulators_output_tokens(tool):
    seeds = {"us-0": 1, "us-1": 2, "us-2": 3}
    text = "a shared prefix and a unique suffix q7 abc"
    for worker, seed in seeds.items():
        ids = output_tokens(list(text.encode()), 8, seed)  # what that worker answers
        assert tool.served_by(text, ids, seeds, 8) == worker
    assert tool.served_by(text, output_tokens(list(text.encode()), 8, 99), seeds, 8) is None
    assert tool.served_by(text, [], seeds, 8) is None


def test_prompts_share_prefixes_and_never_repeat(tool):
    prompts = tool.Prompts(groups=3, prefix_chars=100, suffix_chars=20, seed=5)
    seen = [prompts.next() for _ in range(50)]
    assert len({text for _, text in seen}) == 50
    for group, text in seen:
        assert text.startswith(prompts.prefixes[group]) and len(text) == 120 and text.isascii()
    assert prompts.shared_tokens == 96
    again = tool.Prompts(groups=3, prefix_chars=100, suffix_chars=20, seed=5)
    assert [again.next() for _ in range(50)] == seen  # every arm gets the same stream


def test_the_plane_is_quiet_only_after_enough_quiet_slices_in_a_row(tool):
    # A replay that starts after a quiet second (an agent's probe of its idle engine) is not idling.
    assert not tool.quiet_for([0.05], 0.1, 3)
    assert not tool.quiet_for([0.05, 0.9, 0.05, 0.05], 0.1, 3)
    assert tool.quiet_for([0.9, 0.05, 0.05, 0.05], 0.1, 3)
    assert tool.quiet_for([0.05], 0.1, 1)


def test_router_command_lines(tool):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    smg = tool.router_argv("smg", "/v/bin/smg", 9000, urls)
    assert smg[:2] == ["/v/bin/smg", "launch"] and smg[-3:] == ["--worker-urls", *urls]
    assert smg[smg.index("--policy") + 1] == "cache_aware" and smg[smg.index("--port") + 1] == "9000"
    assert tool.router_argv("sglang-router", "sr", 9000, urls)[1] == "launch"
    vllm = tool.router_argv("vllm-router", "vr", 9000, urls)
    assert "launch" not in vllm and vllm[vllm.index("--policy") + 1] == "cache_aware"
    with pytest.raises(ValueError):
        tool.router_argv("nginx", "x", 1, urls)


def test_quick_mode_is_zero_delay_with_short_windows(tool):
    args = tool.parse_args(["--quick"])
    assert args.modes == ["zero-delay"] and args.seconds <= 1.0 and args.routers == list(tool.ARMS)


@pytest.mark.slow
def test_sync_settings_reach_the_planes_config(tool):
    args = tool.parse_args(["--sync", "report_delay_ms=50", "--sync", "batch_delay_ms=0"])
    assert args.sync == [("report_delay_ms", 50.0), ("batch_delay_ms", 0.0)]
    assert tool.parse_args([]).sync == []
    for bad in ("report_delay_ms", "=5", "report_delay_ms=soon"):
        with pytest.raises(SystemExit):
            tool.parse_args(["--sync", bad])


def test_score_settings_reach_the_planes_config(tool):
    from kvcompassd.launcher import build_cluster

    args = tool.parse_args(["--score", "copy_weight=2", "--score", "occupancy_ms_per_running=1"])
    assert args.score == [("copy_weight", 2.0), ("occupancy_ms_per_running", 1.0)]
    cfg = build_cluster(tool.deployment_spec(args, 8192))
    assert cfg.score.copy_weight == 2.0 and cfg.score.occupancy_ms_per_running == 1.0
    assert build_cluster(tool.deployment_spec(tool.parse_args([]), 8192)).score.copy_weight == 0.0
    for bad in ("copy_weight", "=5", "copy_weight=heavy"):
        with pytest.raises(SystemExit):
            tool.parse_args(["--score", bad])


def test_idle_settings_edges_and_the_agents_poll_period_reach_the_plane(tool, tmp_path):
    from kvcompassd.launcher import build_cluster

    args = tool.parse_args(["--idle", "load_tolerance_ms=0", "--edges", "2", "--load-poll-ms", "40"])
    assert args.idle == [("load_tolerance_ms", 0.0)] and args.edges == 2 and args.load_poll_ms == 40.0
    cfg = build_cluster(tool.deployment_spec(args, 8192))
    assert cfg.idle.load_tolerance_ms == 0.0 and len(cfg.edges_in("us")) == 2
    defaults = tool.parse_args([])
    assert defaults.edges == 1 and defaults.load_poll_ms is None
    assert len(build_cluster(tool.deployment_spec(defaults, 8192)).edges_in("us")) == 1
    for bad in (["--idle", "load_tolerance_ms"], ["--edges", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)


def test_kvcompassd_arm_runs_on_real_daemons(tmp_path):
    """The whole plane against direct with tiny windows: every request served and attributed,
    the edges', agents' and maintenance unit's CPU measured, the plane gone during direct; two
    edges, the requests taken round robin over them."""
    out = tmp_path / "results.json"
    argv = [sys.executable, str(TOOL), "--routers", "kvcompassd", "--modes", "zero-delay", "--workers", "2",
            "--concurrency", "2", "--seconds", "0.5", "--warmup", "0.2", "--idle-seconds", "0.2",
            "--idle-settle", "0", "--quiet-limit", "3", "--settle", "0.1", "--groups", "2", "--prefix-chars", "64",
            "--suffix-chars", "16", "--edges", "2", "--load-poll-ms", "30", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results,) = json.loads(out.read_text()).values()
    arm = results["kvcompassd"]
    x = arm["by_c"]["2"]
    assert x["errors"] == 0 and x["unattributed"] == 0
    assert x["rps"] > 0 and x["direct_rps"] > 0 and x["ratio"] > 0
    assert x["cpu_us.edge"] > 0 and x["cpu_us.agents"] > 0 and x["cpu_us.maintenance"] >= 0
    assert "cpu_net_us.edge" in x
    assert x["retries"] >= 0  # read off the edges' metrics in each router window
    assert arm["edges"] == 2  # and both served: each edge's own requests, summing to all of them
    assert len(x["requests_per_url"]) == 2 and min(x["requests_per_url"]) > 0
    assert sum(x["requests_per_url"]) == x["requests"]
    assert 0 <= x["affinity"] <= 1 and 0 <= x["reuse"] <= 1
    # the machine's load at the end of every window: two direct (before and after), two routed
    assert {k: len(v) for k, v in x["window_loads"].items()} == {"direct": 2, "router": 2}
    assert all(len(load.split()) == 3 for v in x["window_loads"].values() for load in v)
    assert set(arm["idle"]) == {"edge", "agents", "maintenance", "workers"}
    assert 0 <= arm["idle_after_s"] <= 3 + 2  # the quiet wait is bounded (1 s slices)
    assert "kvcompassd" in run.stdout and "÷direct" in run.stdout
