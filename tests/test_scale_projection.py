"""tools/scale_projection.py at a small size: it measures, prints its formulas and names the first
resource to break; and its projection arithmetic, checked by hand."""

from __future__ import annotations

import math

import pytest
from tool_loader import load_tool



@pytest.fixture(scope="module")
def tool():
    return load_tool("scale_projection")


def _units(tool, **kw):
    base = dict(lambda0_w=10.0, blocks_per_request=20.0, reg_per_block=0.5, updates_per_reg=3.0, edge_us=0.5,
                shard_us=1.0, bytes_raw=60.0, bytes_zlib=20.0, view_bytes_per_entry=10.0, cache_blocks_w=1000.0,
                decision_a_us=30.0, decision_b_us=0.02, broadcast_bytes_per_worker=20.0,
                broadcast_overhead_bytes=30.0, period_s=0.1)
    base.update(kw)
    return tool.Units(**base)


def test_the_projection_is_the_printed_formulas(tool):
    u = _units(tool)
    p = tool.project(u, 1000, 10, 5, 2, 0.5)
    u_w = 0.5 * 10.0 * 20.0 * 0.5 * 3.0  # lambda_w x blocks_per_req x reg_blk x updates_per_reg
    assert p["updates_per_worker_s"] == pytest.approx(u_w)
    assert p["edge_apply_cores"] == pytest.approx(1000 * u_w * 0.5e-6)
    assert p["edge_inbound_gbps"] == pytest.approx(1000 * u_w * 60 * 8 / 1e9)
    assert p["shard_apply_cores"] == pytest.approx(1000 * u_w / 5 * 1e-6)
    assert p["shard_egress_gbps"] == pytest.approx(1000 * u_w / 5 * 60 * 8 * 10 * 2 / 1e9)
    assert p["view_gib"] == pytest.approx(1000 * 1000 * 0.5 * 10 / 2**30)
    assert p["decision_cores"] == pytest.approx(1000 * 5.0 / 20 * (30 + 0.02 * 1000) / 1e6)
    assert p["broadcast_mbps"] == pytest.approx(9 * (30 + 20 * 100) * 8 / 0.1 / 1e6)
    # The edge's apply grows with the fleet: it reaches one core where W x U_w x t_edge = 1.
    at = tool.breaking_point(u, "edge_apply_cores", 1.0, 10, 5, 2, 0.5, 1000)
    assert at == pytest.approx(1 / (u_w * 0.5e-6), rel=1e-6)
    assert math.isinf(tool.breaking_point(_units(tool, shard_us=0.0), "shard_apply_cores", 1.0, 10, 5, 2, 0.5, 1000))


def test_the_per_region_projection_is_its_printed_formulas(tool):
    u = _units(tool, share_edge=0.05, share_regions_sum=2.0, t_batch_us=4.0, bytes_per_batch=300.0, zlib_per_batch=110.0,
               flush_s=0.01)
    p = tool.project(u, 1000, 10, 5, 2, 0.5)
    u_w = 0.5 * 10.0 * 20.0 * 0.5 * 3.0
    fleet = 1000 * u_w
    u_e = fleet * 0.05
    b_e = 5 * min(1 / 0.01, u_e / 5)  # one batch per shard per flush at most
    assert p["edge_updates_s"] == pytest.approx(u_e) and p["edge_batches_s"] == pytest.approx(b_e)
    assert p["edge_apply_cores"] == pytest.approx((u_e * 0.5 + b_e * 4.0) / 1e6)
    assert p["edge_inbound_gbps"] == pytest.approx((u_e * 60 + b_e * 300) * 8 / 1e9)
    assert p["edge_inbound_zlib_gbps"] == pytest.approx((u_e * 20 + b_e * 110) * 8 / 1e9)
    assert p["shard_apply_cores"] == pytest.approx(fleet / 5 * 1.0 * (1 + 2.0) / 1e6)
    assert p["shard_egress_gbps"] == pytest.approx((fleet / 5 * 2.0 * 60 + min(100, fleet / 5) * 10 * 300) * 8 * 2 / 1e9)
    assert p["shard_egress_zlib_gbps"] == pytest.approx((fleet / 5 * 2.0 * 20 + min(100, fleet / 5) * 10 * 110) * 8 * 2 / 1e9)
    assert p["view_gib"] == pytest.approx(1000 * 1000 * 0.5 * 0.05 * 10 / 2**30)
    measured = tool.project(tool.dataclasses.replace(u, shard_us_all_streams=7.0), 1000, 10, 5, 2, 0.5)
    assert measured["shard_apply_cores"] == pytest.approx(fleet / 5 * 7.0 / 1e6)


def test_a_small_run_measures_prints_its_formulas_and_names_what_breaks_first(tool, capsys):
    assert tool.main(["--quick", "--workers", "400", "--regions", "20", "--sim-workers", "16", "--sim-regions", "16",
                      "--sim-seconds", "1.5", "--apply-entries", "40000", "--batches", "10", "--decision-sizes", "32",
                      "--decision-entries", "5000", "--decisions", "20", "--prompt-sample", "200"]) == 0
    out = capsys.readouterr().out
    for text in ("t_edge  =", "bytes_per_update =", "blocks_per_req  =", "updates_per_reg =", "len_target =",
                 "fit: decision_us =", "U_w = lambda_w x blocks_per_req x reg_blk x updates_per_reg",
                 "edge apply        = U x t_edge", "shard egress      = U / S x bytes_per_update x 8 x R x E",
                 "400 workers x 20 regions, 20 shards", "first resource to break:",
                 "per-edge-region streams (kvcompassd.core.streams", "edge apply        = U_e x t_update + B_e x t_batch",
                 "t_batch =", "zlib_batch =", "compression of update batches", "t_unit_streams ="):
        assert text in out, text
