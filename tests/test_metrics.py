"""The edge's metrics: held observations (BatchedObservations) and counts (BatchedCount) read exactly as
observed and counted ones."""

from __future__ import annotations

import math
import sys
import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvcompassd.metrics import BATCH_LIMIT, CHOSEN_SCORE_TERMS, BatchedCount, BatchedObservations, EdgeMetrics

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


amounts = st.lists(st.one_of(st.floats(allow_nan=False, width=64), st.sampled_from(BUCKETS),
                             st.integers(-10, 100)), max_size=2 * BATCH_LIMIT + 3)


@settings(max_examples=200, deadline=None)
@given(amounts)
def test_folded_observations_read_as_observed_ones(values):
    direct_registry, batched_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("h", "h", buckets=BUCKETS, registry=direct_registry)
    batched = BatchedObservations(Histogram("h", "h", buckets=BUCKETS, registry=batched_registry))
    for value in values:
        direct.observe(value)
        batched.observe(value)
    batched.fold()
    want, got = _samples(direct_registry), _samples(batched_registry)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if math.isinf(value) or math.isnan(value):
            assert math.isnan(got[key]) if math.isnan(value) else got[key] == value
        else:
            assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-9), key


def test_held_observations_are_folded_at_the_limit_without_a_read():
    histogram = Histogram("h", "h", buckets=BUCKETS, registry=CollectorRegistry())
    batched = BatchedObservations(histogram)
    for _ in range(BATCH_LIMIT - 1):
        batched.observe(0.02)
    assert histogram._sum.get() == 0.0  # held
    batched.observe(0.02)
    assert math.isclose(histogram._sum.get(), 0.02 * BATCH_LIMIT)


def test_a_scrape_of_the_edge_metrics_sees_every_observation():
    metrics = EdgeMetrics()
    metrics.request_observations.observe(0.02)
    metrics.request_observations.observe(0.2)
    metrics.ttft_observations.observe(0.003)
    metrics.decision_observations.observe(2e-5)
    for _, batch in metrics.chosen_terms:
        batch.observe(7.0)
    got = _samples(metrics.registry)
    assert got[("kvcompass_request_seconds_count", ())] == 2
    assert got[("kvcompass_request_seconds_bucket", (("le", "0.025"),))] == 1
    assert math.isclose(got[("kvcompass_request_seconds_sum", ())], 0.22)
    assert got[("kvcompass_ttft_seconds_bucket", (("le", "0.005"),))] == 1
    assert got[("kvcompass_decision_seconds_bucket", (("le", "2e-05"),))] == 1
    for term in CHOSEN_SCORE_TERMS:
        assert got[("kvcompass_chosen_score_ms_bucket", (("le", "10.0"), ("term", term)))] == 1
    # A second scrape folds nothing twice.
    assert _samples(metrics.registry)[("kvcompass_request_seconds_count", ())] == 2


def _update_while_a_thread_folds(batched, update, times: int) -> None:
    """``update`` ``times`` times while another thread keeps folding ``batched``, then fold."""
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            batched.fold()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often
    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(times):
            update()
    finally:
        stop.set()
        scraper.join()
        sys.setswitchinterval(interval)
    batched.fold()


def test_a_scrape_thread_folding_while_the_loop_observes_counts_each_observation_once():
    """prometheus_client's metrics server scrapes (and so folds) from its own thread."""
    histogram = Histogram("h", "h", buckets=BUCKETS, registry=CollectorRegistry())
    batched = BatchedObservations(histogram)
    _update_while_a_thread_folds(batched, lambda: batched.observe(0.02), 50_000)
    assert histogram._buckets[2].get() == 50_000  # the 0.025 bucket: every one, none twice
    assert math.isclose(histogram._sum.get(), 0.02 * 50_000, rel_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 10_000), st.floats(0.0, 1e6)), max_size=2 * BATCH_LIMIT + 3))
def test_folded_counts_read_as_counted_ones(amounts):
    direct = Counter("c", "c", registry=CollectorRegistry())
    counter = Counter("c", "c", registry=CollectorRegistry())
    batched = BatchedCount(counter)
    for amount in amounts:
        direct.inc(amount)
        batched.inc(amount)
    held = len(amounts) % BATCH_LIMIT if amounts else 0
    assert math.isclose(counter._value.get(), sum(amounts[:len(amounts) - held]), rel_tol=1e-9, abs_tol=1e-9)
    batched.fold()
    assert math.isclose(counter._value.get(), direct._value.get(), rel_tol=1e-9, abs_tol=1e-9)
    batched.fold()  # nothing twice
    assert math.isclose(counter._value.get(), direct._value.get(), rel_tol=1e-9, abs_tol=1e-9)


def test_a_scrape_of_the_edge_metrics_sees_every_count():
    metrics = EdgeMetrics()
    for status in (200, 200, 400):
        metrics.count_request("/generate", status)
    metrics.count_decision("local_hit")
    metrics.count_decision("recompute")
    metrics.count_decision("local_hit")
    metrics.claimed_token_counts.inc(1500)
    metrics.reused_token_counts.inc(1488)
    metrics.false_lookup_counts.inc()
    metrics.pending_credit_counts.inc()
    got = _samples(metrics.registry)
    assert got[("kvcompass_requests_total", (("route", "/generate"), ("status", "200")))] == 2
    assert got[("kvcompass_requests_total", (("route", "/generate"), ("status", "400")))] == 1
    assert got[("kvcompass_decisions_total", (("outcome", "local_hit"),))] == 2
    assert got[("kvcompass_decisions_total", (("outcome", "recompute"),))] == 1
    assert got[("kvcompass_claimed_tokens_total", ())] == 1500
    assert got[("kvcompass_reused_tokens_total", ())] == 1488
    assert got[("kvcompass_false_lookups_total", ())] == 1
    assert got[("kvcompass_pending_credits_total", ())] == 1
    assert _samples(metrics.registry)[("kvcompass_decisions_total", (("outcome", "local_hit"),))] == 2


def test_a_scrape_thread_folding_while_the_loop_counts_counts_each_once():
    counter = Counter("c", "c", registry=CollectorRegistry())
    batched = BatchedCount(counter)
    _update_while_a_thread_folds(batched, batched.inc, 50_000)
    assert counter._value.get() == 50_000  # every one, none twice
