"""Sweep points run in parallel processes, replaying one request stream per grid point, give
exactly the results of fresh serial runs."""

from __future__ import annotations

import numpy as np

from kvcompassd.core.config import load_config
from kvcompassd.sim import cli
from kvcompassd.sim.cli import grid_points, resolve_deployment, run_points
from kvcompassd.sim.engine import SimSettings, simulate
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import make_policy, make_workload, region_weights

WALL = ("wall_s", "sim_requests_per_wall_s", "cpu_s", "sim_requests_per_cpu_s")  # measured, not simulated


def _same(a: tuple[dict, object], b: tuple[dict, object]) -> None:
    (row_a, res_a), (row_b, res_b) = a, b
    # assert_equal: NaN (an untracked share) equals NaN
    np.testing.assert_equal({k: v for k, v in row_a.items() if k not in WALL},
                            {k: v for k, v in row_b.items() if k not in WALL})
    assert res_a.records.keys() == res_b.records.keys()
    for col in res_a.records:
        np.testing.assert_array_equal(res_a.records[col], res_b.records[col])
    np.testing.assert_array_equal(res_a.load_bins, res_b.load_bins)


def test_parallel_points_equal_serial_points():
    cfg = resolve_deployment("census-64x8")
    points = grid_points(cfg, "wildchat", ["load-balance-oracle", "kvcompass", "consistent-hash"], [150.0, 300.0], seed=3,
                         duration_s=0.4, warmup_s=0.1, settings=SimSettings(eviction="lru", seed=3), page_tokens=64)
    serial = run_points(points, jobs=1)
    cli._STREAM_CACHE.clear()  # forked workers must build their own streams, not inherit the parent's
    parallel = run_points(points, jobs=2)
    assert [r["scheme"] for r, _ in serial] == ["load-balance-oracle", "kvcompass", "consistent-hash"] * 2
    assert [r["rate"] for r, _ in serial] == [150.0] * 3 + [300.0] * 3
    for a, b in zip(serial, parallel, strict=True):
        _same(a, b)


def test_a_replayed_stream_equals_a_fresh_generator_run():
    cfg = resolve_deployment("census-64x8")
    (summary, result), = run_points(grid_points(cfg, "mixed", ["dynamo"], [400.0], seed=1, duration_s=0.5,
                                                settings=SimSettings(eviction="lfu", seed=1), page_tokens=64))
    topo = Topology.from_config(load_config(cfg), page_tokens=64)
    fresh = simulate(topo, make_policy("dynamo", topo, seed=1),
                     make_workload("mixed", 400.0, region_weights(topo), seed=1),
                     settings=SimSettings(eviction="lfu", seed=1), duration_s=0.5)
    assert summary["requests"] == fresh.completed > 0
    for col in result.records:
        np.testing.assert_array_equal(result.records[col], fresh.records[col])
