"""Fingerprint bits from a false-lookup budget (core/fingerprints.py), and the edge's check."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import CapturingLogger

from kvcompassd.core.config import ConfigError, load_config, parse_config
from kvcompassd.core.fingerprints import (MAX_FINGERPRINT_BITS, budget_shortfall, expected_false_claims,
                                          fingerprint_bits_for, fingerprint_choice_for_config)
from kvcompassd.core.layout import IndexLayout
from clusters import make_cluster

CONFIG = Path(__file__).resolve().parents[1] / "config"

groups_st = st.integers(1, 4096)
levels_st = st.integers(1, 64)
load_st = st.floats(0.01, 1.0)
budget_st = st.floats(1e-6, 1.0)


@given(groups_st, levels_st, load_st, budget_st, st.booleans())
def test_the_chosen_bits_meet_the_budget_and_one_bit_fewer_would_not(groups, levels, load, budget, consistency):
    choice = fingerprint_bits_for(groups=groups, levels=levels, load=load, budget=budget, consistency=consistency)
    reads = groups if consistency else groups * levels
    assert choice.reads_at_risk == reads
    assert choice.expected_with_needed <= budget
    assert choice.expected_with_needed == pytest.approx(reads * load * 2.0**-choice.needed_bits)
    if choice.needed_bits > 0:
        assert reads * load * 2.0 ** -(choice.needed_bits - 1) > budget
    assert choice.bits_per_entry == pytest.approx(choice.needed_bits / load)


@given(groups_st, groups_st, levels_st, levels_st, load_st, load_st, budget_st, st.booleans())
def test_the_bits_never_fall_as_groups_levels_or_load_grow(g1, g2, l1, l2, a, b, budget, consistency):
    def bits(groups, levels, load):
        return fingerprint_bits_for(groups=groups, levels=levels, load=load, budget=budget,
                                    consistency=consistency).needed_bits

    (g1, g2), (l1, l2), (a, b) = sorted((g1, g2)), sorted((l1, l2)), sorted((a, b))
    assert bits(g1, l1, a) <= bits(g2, l1, a)
    assert bits(g1, l1, a) <= bits(g1, l2, a)
    assert bits(g1, l1, a) <= bits(g1, l1, b)
    # A tighter budget never needs fewer bits.
    tighter = fingerprint_bits_for(groups=g1, levels=l1, load=a, budget=budget / 2, consistency=consistency)
    assert tighter.needed_bits >= bits(g1, l1, a)


@given(groups_st, levels_st, load_st, budget_st, st.integers(0, 24))
def test_configured_bits_meet_the_budget_exactly_when_they_reach_the_needed_bits(groups, levels, load, budget, bits):
    choice = fingerprint_bits_for(groups=groups, levels=levels, load=load, budget=budget, configured_bits=bits)
    assert choice.meets_budget == (bits >= choice.needed_bits)
    assert (budget_shortfall(choice) is None) == choice.meets_budget
    assert choice.expected_with_configured == pytest.approx(
        expected_false_claims(groups=groups, levels=levels, load=load, bits=bits))


@given(groups_st, levels_st, load_st)
def test_without_consistency_every_level_is_at_risk(groups, levels, load):
    with_c = fingerprint_bits_for(groups=groups, levels=levels, load=load, budget=0.002)
    without = fingerprint_bits_for(groups=groups, levels=levels, load=load, budget=0.002, consistency=False)
    assert without.needed_bits >= with_c.needed_bits
    assert expected_false_claims(groups=groups, levels=levels, load=load, bits=8, consistency=False) == \
        pytest.approx(levels * expected_false_claims(groups=groups, levels=levels, load=load, bits=8))


def test_known_values():
    # 8 groups at 0.95: 7.6 / 2^12 = 0.00186 <= 0.002 < 7.6 / 2^11.
    choice = fingerprint_bits_for(groups=8, levels=6, load=0.95, budget=0.002)
    assert choice.needed_bits == 12 and choice.bits_per_entry == pytest.approx(12 / 0.95)
    # The issue's 1,024 x 64 fleet reads 68 groups: 15 bits.
    assert fingerprint_bits_for(groups=68, levels=6, load=0.95, budget=0.002).needed_bits == 15
    # A budget the table already meets needs none.
    assert fingerprint_bits_for(groups=1, levels=1, load=0.5, budget=0.5).needed_bits == 0
    # Past what the index stores: not achievable, and the shortfall says so.
    huge = fingerprint_bits_for(groups=4096, levels=6, load=0.95, budget=1e-6)
    assert huge.needed_bits > MAX_FINGERPRINT_BITS and not huge.achievable
    assert "more than the index stores" in budget_shortfall(huge)


@pytest.mark.parametrize("kwargs", [
    dict(groups=0, levels=6, load=0.9, budget=0.002), dict(groups=1, levels=0, load=0.9, budget=0.002),
    dict(groups=1, levels=6, load=0.0, budget=0.002), dict(groups=1, levels=6, load=1.5, budget=0.002),
    dict(groups=1, levels=6, load=0.9, budget=0.0), dict(groups=1, levels=6, load=0.9, budget=math.nan),
    dict(groups=True, levels=6, load=0.9, budget=0.002),
    dict(groups=1, levels=6, load=0.9, budget=0.002, configured_bits=-1)])
def test_bad_inputs_are_refused(kwargs):
    with pytest.raises(ValueError):
        fingerprint_bits_for(**kwargs)


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, "0.1", True, math.inf])
def test_the_config_validates_the_budget(budget):
    cfg = make_cluster({"us": 2})
    data = {"cluster": {"name": "t", "model": "m", "tenant": "", "shards": 1},
            "index": {"false_lookup_budget": budget}, "regions": [{"name": "us"}],
            "workers": [dataclasses.asdict(w) for w in cfg.workers]}
    with pytest.raises(ConfigError, match="false_lookup_budget"):
        parse_config(data, "<test>")


def test_the_choice_for_a_config_counts_its_region_groups():
    cfg = make_cluster({"us": 20, "eu": 3}, value_bits=32, fingerprint_bits=4)  # us splits into 2 groups
    choice = fingerprint_choice_for_config(cfg)
    assert len(IndexLayout.from_config(cfg).groups) == 3 == choice.reads_at_risk
    assert choice.budget == cfg.index.false_lookup_budget == 0.002
    assert choice.load == cfg.index.max_load and choice.configured_bits == 4
    assert choice.expected_with_configured == pytest.approx(3 * 0.95 / 16)


@pytest.mark.parametrize("path", sorted(CONFIG.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_meets_its_budget(path):
    choice = fingerprint_choice_for_config(load_config(path))
    assert choice.meets_budget, budget_shortfall(choice)
    assert budget_shortfall(choice) is None


def test_the_shortfall_names_the_bits_needed_and_their_cost():
    cfg = make_cluster({"us": 2, "eu": 2, "ap": 2}, fingerprint_bits=0)
    text = budget_shortfall(fingerprint_choice_for_config(cfg))
    assert text is not None
    assert "index.fingerprint_bits = 0" in text and "set index.fingerprint_bits = 11" in text
    assert "+11.6 bits per entry" in text and "false_lookup_budget = 0.002" in text


def test_the_edge_warns_once_at_start_up_when_the_bits_fall_short(tmp_path, monkeypatch):
    from kvcompassd.certs import Role, init_ca, issue
    from kvcompassd import edge as edge_module
    from kvcompassd.edge import EdgeNode

    cfg = load_config(CONFIG / "testbed-3continent.toml")
    # The byte tokenizer (no [tokenizer] path here) serves emulated workers only.
    cfg = dataclasses.replace(cfg, workers=tuple(dataclasses.replace(w, emulated=True) for w in cfg.workers))
    init_ca(tmp_path / "ca", cluster_name=cfg.name)
    me = cfg.edges[0]
    tls = issue(tmp_path / "ca", tmp_path / "edge", role=Role.EDGE, node_id=me.id)

    def warnings(bits: int) -> list[dict]:
        # The edge module's own logger, replaced: a logger structlog already cached (any earlier
        # test that configured logging) would not see capture_logs' processors.
        captured = CapturingLogger()
        monkeypatch.setattr(edge_module, "log", captured)
        short = dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, fingerprint_bits=bits))
        EdgeNode(short, me, tls)
        return [{"event": call.args[0], **call.kwargs} for call in captured.calls if call.method_name == "warning"]

    (warned,) = warnings(4)
    assert warned["event"] == "fingerprint bits below the false-lookup budget" and warned["edge"] == me.id
    assert "set index.fingerprint_bits = 11" in warned["detail"]
    assert warnings(cfg.index.fingerprint_bits) == []
