"""Deployment geography and the generated configs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvcompassd.core.config import load_config, parse_config
from kvcompassd.sim.geo import DEPLOYMENTS, SITES, derived_one_way_ms, great_circle_km, link_matrix, render_toml

CONFIG = Path(__file__).resolve().parents[1] / "config"


def test_great_circle_and_formula():
    london_paris = great_circle_km(51.5074, -0.1278, 48.8566, 2.3522)
    assert london_paris == pytest.approx(344, abs=3)
    a, b = SITES["de"], SITES["gb"]
    km = great_circle_km(a.latitude, a.longitude, b.latitude, b.longitude)
    assert derived_one_way_ms(a, b) == pytest.approx(km / 200 * 1.5 + 2)


@pytest.mark.parametrize("name, workers, regions", [
    ("census-64x8", 64, 8), ("census-128x16", 128, 16), ("northamerica-11", 11, 4), ("census-1024x64", 1024, 64)])
def test_committed_configs_match_the_generator_and_load(name, workers, regions):
    text = render_toml(DEPLOYMENTS[name])
    assert (CONFIG / f"{name}.toml").read_text() == text
    cfg = load_config(CONFIG / f"{name}.toml")
    assert len(cfg.worker_ids()) == workers and len(cfg.region_names()) == regions


def test_census_counts_follow_the_paper():
    cfg = load_config(CONFIG / "census-64x8.toml")
    counts = {r: len(cfg.workers_in(r)) for r in cfg.region_names()}
    assert counts["us"] == 30 and counts["cn"] == 13 and counts["de"] == 8
    assert all(2 <= counts[r] <= 3 for r in ("jp", "sg", "gb", "kr", "au"))
    big = load_config(CONFIG / "census-128x16.toml")
    counts = {r: len(big.workers_in(r)) for r in big.region_names()}
    assert (counts["us-east"], counts["us-west"], counts["cn"], counts["de"], counts["ie"]) == (26, 14, 12, 10, 10)
    assert all(2 <= counts[r] <= 7 for r in ("sg", "kr", "in", "au", "br", "ca", "it", "bh", "za"))


def test_north_america_links_span_the_measured_ranges():
    links = link_matrix(DEPLOYMENTS["northamerica-11"])
    east = [v for (a, b), v in links.items() if "calgary" not in (a, b)]
    west = [v for (a, b), v in links.items() if "calgary" in (a, b)]
    assert min(east) == pytest.approx(5.8) and max(east) == pytest.approx(16.6)
    assert min(west) == pytest.approx(24.9) and max(west) == pytest.approx(37.4)


def test_rendered_config_parses_through_the_shared_loader():
    import tomllib

    cfg = parse_config(tomllib.loads(render_toml(DEPLOYMENTS["census-64x8"])), "generated")
    assert cfg.one_way_ms("de", "gb") == pytest.approx(derived_one_way_ms(SITES["de"], SITES["gb"]), abs=0.01)


def test_the_testbeds_hold_an_rtx_5090s_kv_and_the_censuses_an_a100s():
    """The real-machine testbeds (paper 5.2, appendix B) run on 32 GiB cards, so their KV pools
    are far smaller than the simulated A100 fleets' 32 GiB of KV: DRAM pressure comes sooner."""
    from kvcompassd.sim.geo import (A100_DRAM_KV_TOKENS, A100_VRAM_KV_TOKENS, RTX5090_DRAM_KV_TOKENS,
                                    RTX5090_VRAM_KV_TOKENS)

    for name in ("testbed-3continent", "northamerica-11"):
        for worker in load_config(CONFIG / f"{name}.toml").workers:
            assert (worker.vram_kv_tokens, worker.dram_kv_tokens) == (RTX5090_VRAM_KV_TOKENS, RTX5090_DRAM_KV_TOKENS)
    for name in ("census-64x8", "census-128x16"):
        for worker in load_config(CONFIG / f"{name}.toml").workers:
            assert (worker.vram_kv_tokens, worker.dram_kv_tokens) == (A100_VRAM_KV_TOKENS, A100_DRAM_KV_TOKENS)
    # weights (15 GiB) + the KV pool (12 GiB) stay inside the card's 32 GiB
    assert 15 + RTX5090_VRAM_KV_TOKENS * 128 * 1024 / 2**30 < 32


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_the_generator_writes_the_bits_its_budget_needs_with_budget_and_cost(name):
    from kvcompassd.core.fingerprints import budget_shortfall, fingerprint_choice_for_config

    text = render_toml(DEPLOYMENTS[name])
    cfg = parse_config(tomllib.loads(text), "generated")
    choice = fingerprint_choice_for_config(cfg)
    # Exactly the least bits meeting the budget: the edge's start-up check stays quiet.
    assert cfg.index.fingerprint_bits == choice.needed_bits > 0
    assert budget_shortfall(choice) is None
    lines = text.splitlines()
    at = lines.index(f"fingerprint_bits = {choice.needed_bits}")
    comment = " ".join(lines[at - 2 : at])
    assert f"{choice.reads_at_risk} region groups" in comment
    assert f"budget {cfg.index.false_lookup_budget:g}" in comment
    assert f"+{choice.bits_per_entry:.1f} bits per entry" in comment


def test_more_region_groups_get_more_bits():
    from kvcompassd.sim.geo import DeploymentSpec

    def bits(workers):
        spec = DeploymentSpec(name="t", description="t", workers=workers, value_bits=32)
        return parse_config(tomllib.loads(render_toml(spec)), "generated").index.fingerprint_bits

    few = bits((("us", 4), ("de", 4)))  # 2 groups
    many = bits((("us", 64), ("de", 64), ("jp", 64), ("gb", 64)))  # 16 groups
    assert many == few + 3


def test_a_scaled_census_multiplies_counts_and_splits_sites_nearby():
    from kvcompassd.sim.geo import GeoError, scale_deployment

    base = DEPLOYMENTS["census-128x16"]
    spec = scale_deployment(base, factor=8, split=4)
    assert spec == DEPLOYMENTS["census-1024x64"]  # the shipped one is exactly this
    assert (spec.worker_count(), len(spec.workers), spec.shards, spec.value_bits) == (1024, 64, 64, 64)
    counts = dict(spec.workers)
    for region, n in base.workers:  # each site's count x 8, shared evenly over its four sub-sites
        subs = [counts[f"{region}-{c}"] for c in "abcd"]
        assert sum(subs) == 8 * n and max(subs) - min(subs) <= 1
    # sub-sites are near their site (150 km away) and far from the others
    us, sub = SITES["us-east"], spec.site("us-east-a")
    assert great_circle_km(us.latitude, us.longitude, sub.latitude, sub.longitude) == pytest.approx(150, abs=1)
    links = link_matrix(spec)
    assert links[("us-east-a", "us-east-b")] < 5 < links[("us-east-a", "cn-a")]
    # the header names the command that writes the file
    assert "--from census-128x16 --factor 8 --split 4" in render_toml(spec).splitlines()[1]
    with pytest.raises(GeoError):
        scale_deployment(base, factor=0, split=4)


def test_a_census_fleet_of_any_size_has_exactly_the_workers_and_regions_asked(tmp_path):
    from kvcompassd.sim.geo import census_fleet, main

    spec = census_fleet(DEPLOYMENTS["census-128x16"], workers=1000, regions=37, shards=8)
    assert (spec.worker_count(), len(spec.workers), spec.shards) == (1000, 37, 8)
    assert all(n >= 1 for _, n in spec.workers)
    assert main(["--out", str(tmp_path), "--from", "census-128x16", "--workers", "300", "--regions", "20"]) == 0
    cfg = load_config(tmp_path / "census-300x20.toml")
    assert (len(cfg.workers), len(cfg.region_names()), cfg.shards) == (300, 20, 20)
    assert "--workers 300 --regions 20" in (tmp_path / "census-300x20.toml").read_text().splitlines()[1]


def test_generated_long_growth_is_fine_only_where_a_length_costs_few_reads():
    # Each indexed length is a read in every region group at every decision.
    small = load_config(CONFIG / "census-64x8.toml")
    big = load_config(CONFIG / "census-1024x64.toml")
    assert small.index.long_growth == 1.1 and big.index.long_growth == 1.25
