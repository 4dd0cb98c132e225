"""The decode worker of a disaggregated request: always of the prefill's region, least loaded or
uniformly random, and a worker that just failed is avoided while another can serve."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataclasses import replace

from clusters import make_cluster
from kvcompassd.core.config import DisaggregationParams
from kvcompassd.core.decode_choice import DecodeChooser, DecodeWorker, NoDecodeWorkerError

WORKERS = [DecodeWorker("us-d0", "us"), DecodeWorker("us-d1", "us"), DecodeWorker("us-d2", "us"),
           DecodeWorker("eu-d0", "eu")]


def test_least_loaded_picks_the_fewest_in_flight_and_spreads_ties():
    chooser = DecodeChooser(WORKERS, seed=1)
    picks = []
    for _ in range(6):
        w = chooser.choose("us", now=0.0)
        chooser.started(w)
        picks.append(w)
    assert Counter(picks) == {"us-d0": 2, "us-d1": 2, "us-d2": 2}
    chooser.finished("us-d1")
    assert chooser.choose("us", now=0.0) == "us-d1"
    # An agent's report counts when it says more than this edge's own requests.
    chooser.load_reported("us-d1", running=5, waiting=1)
    assert chooser.choose("us", now=0.0) in ("us-d0", "us-d2")
    assert chooser.load("us-d1") == 6
    chooser.load_reported("us-p0", running=9, waiting=9)  # not a decode worker: ignored
    assert chooser.describe()["workers"]["us-d0"] == {"inflight": 2, "reported": 0, "chosen": 2}


def test_random_draws_uniformly_whatever_the_load():
    chooser = DecodeChooser(WORKERS, policy="random", seed=3)
    for _ in range(50):
        chooser.started("us-d0")
    picks = Counter(chooser.choose("us", now=0.0) for _ in range(3000))
    assert set(picks) == {"us-d0", "us-d1", "us-d2"} and min(picks.values()) > 850


def test_decode_stays_in_the_prefills_region_and_a_failed_worker_is_avoided_for_a_while():
    chooser = DecodeChooser(WORKERS, seed=0, suspect_s=5.0)
    assert chooser.choose("eu", now=0.0) == "eu-d0"
    chooser.failed("us-d0", now=10.0)
    chooser.failed("us-d1", now=10.0)
    assert {chooser.choose("us", now=11.0) for _ in range(20)} == {"us-d2"}
    assert chooser.choose("us", now=11.0, exclude={"us-d2"}) in ("us-d0", "us-d1")  # all suspected: try anyway
    assert "us-d0" in {chooser.choose("us", now=15.1) for _ in range(30)}  # suspicion over
    chooser.failed("eu-d0", now=0.0)
    assert chooser.choose("eu", now=1.0) == "eu-d0"  # the region's only one
    with pytest.raises(NoDecodeWorkerError, match="asia"):
        chooser.choose("asia", now=0.0)
    with pytest.raises(NoDecodeWorkerError, match="eu"):
        chooser.choose("eu", now=0.0, exclude={"eu-d0"})
    with pytest.raises(ValueError, match="policy"):
        DecodeChooser(WORKERS, policy="round_robin")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "finish", "report"]), st.sampled_from(["us-d0", "us-d1", "us-d2"]),
                          st.integers(0, 5)), max_size=60))
def test_least_loaded_choice_is_always_a_minimum_and_counts_never_go_negative(ops):
    chooser = DecodeChooser(WORKERS, seed=0)
    for op, worker, n in ops:
        if op == "start":
            chooser.started(worker)
        elif op == "finish":
            chooser.finished(worker)
        else:
            chooser.load_reported(worker, running=n, waiting=0)
        picked = chooser.choose("us", now=0.0)
        assert chooser.load(picked) == min(chooser.load(w) for w in ("us-d0", "us-d1", "us-d2"))
        assert all(v["inflight"] >= 0 for v in chooser.describe()["workers"].values())


def test_from_config_reads_the_decode_workers_and_the_policy():
    cfg = make_cluster({"us": 2, "eu": 1})
    roles = {"us-0": "prefill", "us-1": "decode", "eu-0": "mixed"}
    cfg = replace(cfg, workers=tuple(replace(w, role=roles[w.id]) for w in cfg.workers),
                  disaggregation=DisaggregationParams(decode_policy="random"))
    chooser = DecodeChooser.from_config(cfg)
    assert chooser.policy == "random" and chooser.workers_in("us") == ("us-1",) and chooser.workers_in("eu") == ()
