"""Learned worker rates: service times from first tokens, the WAN taken out, robust medians."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusters import make_cluster
from kvcompassd.core.config import ConfigError
from kvcompassd.core import rates as rates_module
from kvcompassd.core.rates import LearnedRates, RateEstimator, RatesError, ReadRateEstimator
from kvcompassd.worker.workermodel import FirstTokenProduced, WorkerTiming
from worker_cache import CacheOwner

BETA = 0.1  # configured ms per token
DECODE = 10.0  # make_cluster's


def _cfg(**score):
    return make_cluster({"us": 2, "eu": 1}, one_way_ms=50.0, prefill_ms_per_token=BETA,
                        **score)


def _serve(rates, dispatch, worker, *, sent, first, end, uncached, output=5):
    rates.sent(dispatch, worker, now=sent)
    rates.first_token(dispatch, now=first)
    return rates.finished(dispatch, uncached_tokens=uncached, output_tokens=output, now=end)


def test_a_worker_five_times_faster_than_configured_is_learned():
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    us0 = cfg.worker_ids().index("us-0")
    rtt = cfg.rtt_ms("us", "us") / 1000.0  # within the region
    t = 0.0
    for n in range(10):
        # 1,000 uncached tokens in 20 ms (0.02 ms/token, a fifth of 0.1), one at a time.
        _serve(rates, n, us0, sent=t, first=t + rtt + 0.020, end=t + rtt + 0.020 + 4 * 0.002, uncached=1000)
        t += 1.0
    assert rates.prefill_ms_per_token(us0) == pytest.approx(BETA / 5)
    assert rates.decode_ms_per_token(us0) == pytest.approx(DECODE / 5)
    other = cfg.worker_ids().index("us-1")
    assert rates.prefill_ms_per_token(other) == pytest.approx(BETA / 5)  # no samples of its own: the fleet's
    assert len(rates) == 0  # every dispatch ended


def test_a_worker_with_samples_of_its_own_keeps_its_rate_and_the_others_take_the_fleets():
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t, n = 0.0, 0
    for _ in range(6):
        _serve(rates, n, 0, sent=t, first=t + rtt + 0.5, end=t + rtt + 0.5, uncached=1000, output=1)  # 5x slower
        _serve(rates, n + 1, 1, sent=t, first=t + rtt + 0.1, end=t + rtt + 0.1, uncached=1000, output=1)
        _serve(rates, n + 2, 1, sent=t + 0.5, first=t + 0.5 + rtt + 0.1, end=t + 0.6 + rtt, uncached=1000, output=1)
        t, n = t + 1.0, n + 3
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.5)
    assert rates.prefill_ms_per_token(1) == pytest.approx(0.1)
    assert rates.prefill_ms_per_token(2) == pytest.approx(0.1)  # the fleet's median: worker 1 sent more
    assert rates.prefill_rates().tolist() == pytest.approx([0.5, 0.1, 0.1])


def test_the_round_trip_to_a_remote_worker_is_not_counted_as_prefill():
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    eu0 = cfg.worker_ids().index("eu-0")
    rtt = cfg.rtt_ms("us", "eu") / 1000.0
    t = 0.0
    for n in range(10):
        _serve(rates, n, eu0, sent=t, first=t + rtt + 0.5, end=t + rtt + 0.6, uncached=1000)  # 0.5 ms/token
        t += 5.0
    assert rates.prefill_ms_per_token(eu0) == pytest.approx(0.5)


def test_a_request_queued_behind_the_previous_one_is_timed_from_its_first_token():
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n in range(0, 20, 2):
        # Two requests sent together: the second waits for the first's prefill (100 ms each at
        # 0.05 ms/token), so its first token comes 200 ms after sending, 100 ms after the first's.
        rates.sent(n, 0, now=t)
        rates.sent(n + 1, 0, now=t)
        rates.first_token(n, now=t + rtt + 0.1)
        rates.first_token(n + 1, now=t + rtt + 0.2)
        rates.finished(n, uncached_tokens=2000, output_tokens=1, now=t + rtt + 0.1)
        rates.finished(n + 1, uncached_tokens=2000, output_tokens=1, now=t + rtt + 0.2)
        t += 1.0
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.05)


def _serve_read_late(rates, n, worker, t, *, rtt, service, decode, lag, worker_latency):
    """A request served in ``service`` s then ``decode`` s at the worker, whose first token and
    end this edge reads ``lag`` s late (a busy event loop); ``worker_latency``: whether the
    worker says its own time for it (SGLang's e2e_latency)."""
    rates.sent(n, worker, now=t)
    rates.first_token(n, now=t + rtt + service + lag)
    return rates.finished(n, uncached_tokens=1000, output_tokens=5, now=t + rtt + service + decode + lag,
                          worker_latency_s=service + decode if worker_latency else None)


@pytest.mark.parametrize("worker_latency,learned", [(True, 0.02), (False, 0.05)])
def test_what_the_edge_saw_beyond_the_workers_own_time_is_not_learned_as_prefill(worker_latency, learned):
    # A worker prefilling 1,000 tokens in 20 ms (0.02 ms a token), one request at a time, and an
    # edge whose event loop reads every answer 30 ms late. Timed from the edge's side the lag is
    # prefill (0.05 ms a token: on zero-delay emulated workers the edge learned 0.019 whatever
    # the configured rate, issue 30). With the worker's own time for each request, what the edge
    # saw beyond it (the network and the lag) comes out.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    for n in range(10):
        _serve_read_late(rates, n, 0, n * 1.0, rtt=rtt, service=0.020, decode=0.008, lag=0.030,
                         worker_latency=worker_latency)
    assert rates.prefill_ms_per_token(0) == pytest.approx(learned)


def test_a_bunch_read_late_from_a_worker_that_serves_at_once_is_learned_as_the_workers_time():
    # Zero-delay workers: four requests sent together are served at once (1 ms each, prefill
    # and all), and the edge reads their answers in a bunch 50 ms later. Timed from the edge's
    # side, each one's share of the backlog is the lag's (a fifth of the configured rate here);
    # with the worker's own time it is the worker's, far below the learned rate's bound.
    cfg = _cfg()
    told, untold = LearnedRates(cfg, "us"), LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    for rates, latency in ((told, 0.001), (untold, None)):
        t = 0.0
        for n in range(0, 40, 4):
            for k in range(4):
                rates.sent(n + k, 0, now=t, ahead_ms=100.0 * k, work_ms=100.0)
            for k in range(4):
                rates.first_token(n + k, now=t + rtt + 0.051 + 0.0001 * k)
            for k in range(4):
                rates.finished(n + k, uncached_tokens=1000, output_tokens=1, now=t + rtt + 0.051 + 0.0001 * k,
                               worker_latency_s=latency)
            t += 1.0
        assert rates.snapshot()["prefill_samples"].tolist() == [31, 0, 0]
    assert told.prefill_ms_per_token(0) == pytest.approx(BETA / cfg.score.learned_rate_bound)
    assert untold.prefill_ms_per_token(0) > 3 * BETA / cfg.score.learned_rate_bound


def test_a_worker_time_longer_than_what_the_edge_saw_is_not_trusted():
    # A worker clock that reads more than the whole exchange took: the sample is timed from
    # the edge's side alone, as without the worker's account.
    cfg = _cfg()
    told, untold = LearnedRates(cfg, "us"), LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    for n in range(10):
        for rates, latency in ((told, 5.0), (untold, None)):
            rates.sent(n, 0, now=n * 1.0)
            rates.first_token(n, now=n * 1.0 + rtt + 0.05)
            rates.finished(n, uncached_tokens=1000, output_tokens=5, now=n * 1.0 + rtt + 0.06, worker_latency_s=latency)
    assert told.prefill_ms_per_token(0) == untold.prefill_ms_per_token(0) == pytest.approx(0.05)


def test_short_prompts_failures_and_unknown_dispatches_teach_nothing():
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    for n in range(10):
        assert not _serve(rates, n, 0, sent=n, first=n + 0.5, end=n + 0.5, uncached=10)  # under min_tokens
    assert rates.prefill_ms_per_token(0) == BETA
    rates.sent(100, 0, now=20.0)
    rates.first_token(100, now=20.001)
    rates.dropped(100)  # failed mid-response
    assert not rates.finished(100, uncached_tokens=1000, output_tokens=3, now=21.0)
    rates.first_token(999, now=1.0)  # never sent
    assert not rates.finished(999, uncached_tokens=1000, output_tokens=3, now=2.0)
    rates.sent(101, 0, now=30.0)
    assert not rates.finished(101, uncached_tokens=1000, output_tokens=3, now=31.0)  # no first token seen
    assert rates.snapshot()["prefill_samples"].tolist() == [0, 0, 0] and len(rates) == 0


def test_learning_can_be_turned_off_and_the_bound_is_validated():
    rates = LearnedRates(_cfg(learned_rate_bound=1.0), "us")
    for n in range(10):
        _serve(rates, n, 0, sent=n, first=n + 0.002, end=n + 0.003, uncached=1000)
    assert rates.prefill_ms_per_token(0) == BETA and len(rates) == 0
    for bad in (0.5, math.inf, "2"):
        with pytest.raises(ConfigError):
            _cfg(learned_rate_bound=bad)
    with pytest.raises(RatesError):
        LearnedRates(_cfg(), "mars")


def test_the_open_dispatches_are_bounded():
    rates = LearnedRates(_cfg(), "us", max_open=4)
    for n in range(10):
        rates.sent(n, 0, now=float(n))
    assert len(rates) == 4 and rates.worker_of(9) == 0 and rates.worker_of(0) == -1


def test_a_learned_rate_stays_within_the_bound():
    est = RateEstimator(bound=4.0, window=5, min_samples=1)
    for _ in range(5):
        est.observe(1e-6)
    assert est.factor == pytest.approx(0.25)
    for _ in range(5):
        est.observe(1e9)
    assert est.factor == pytest.approx(4.0)
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert not est.observe(bad)
    assert est.factor == pytest.approx(4.0)
    with pytest.raises(RatesError):
        RateEstimator(bound=0.5)
    with pytest.raises(RatesError):
        RateEstimator(bound=2.0, window=3, min_samples=4)


@settings(max_examples=200, deadline=None)
@given(
    true_log=st.floats(min_value=-math.log(5.0), max_value=math.log(5.0)),
    noise=st.lists(st.floats(min_value=-0.2, max_value=0.2), min_size=31, max_size=120),
    outlier_at=st.lists(st.integers(min_value=0, max_value=3), min_size=30, max_size=30),
    outlier_log=st.lists(st.floats(min_value=-20.0, max_value=20.0), min_size=30, max_size=30),
)
def test_the_learned_rate_converges_to_the_true_one_under_noise_and_outliers(true_log, noise, outlier_at,
                                                                             outlier_log):
    """Whatever the noise (up to +-0.2 in log, about +-22 %) and whatever the outliers (any value,
    one in every four samples at most), after a window of samples the estimate is within the
    noise of the true rate: fewer than half of any window are outliers, so the median lies
    between the least and the greatest of the good samples."""
    est = RateEstimator(bound=16.0)
    for n, e in enumerate(noise):
        block, slot = divmod(n, 4)
        if block < len(outlier_at) and slot == outlier_at[block]:
            est.observe(math.exp(outlier_log[block]))
        else:
            est.observe(math.exp(true_log + e))
    if len(noise) >= 31:
        assert abs(math.log(est.factor) - true_log) <= 0.2 + 1e-9


@settings(max_examples=50, deadline=None)
@given(before=st.floats(min_value=-1.5, max_value=1.5), after=st.floats(min_value=-1.5, max_value=1.5))
def test_the_learned_rate_follows_a_change_within_a_window(before, after):
    est = RateEstimator(bound=16.0, window=31)
    for _ in range(40):
        est.observe(math.exp(before))
    for _ in range(16):
        est.observe(math.exp(after))
    assert math.log(est.factor) == pytest.approx(after, abs=1e-9)


def test_a_wait_for_other_edges_work_is_not_learned_as_prefill():
    # us-0 prefills at the configured 0.1 ms/token, but other edges keep it 900 ms behind: each of
    # this edge's 1,000-token requests waits 900 ms, then prefills in 100 ms. The edge sent each
    # with that queue estimated ahead of it and none of its own work there: no prefill sample
    # (timed, each read 1 ms/token, ten times too slow). Requests that find it idle still teach.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n in range(10):
        rates.sent(n, 0, now=t, ahead_ms=900.0, work_ms=100.0)
        rates.first_token(n, now=t + rtt + 1.0)
        rates.finished(n, uncached_tokens=1000, output_tokens=1, now=t + rtt + 1.0)
        t += 5.0
    assert rates.prefill_ms_per_token(0) == BETA and rates.snapshot()["prefill_samples"].tolist() == [0, 0, 0]
    for n in range(10, 20):
        # 0.05 ms/token (twice as fast as configured) from requests that found it idle (a
        # queue estimate within a tenth of the request's own prefill counts as idle)
        _serve(rates, n, 0, sent=t, first=t + rtt + 0.05, end=t + rtt + 0.05, uncached=1000) if n % 2 else (
            rates.sent(n, 0, now=t, ahead_ms=9.0, work_ms=100.0), rates.first_token(n, now=t + rtt + 0.05),
            rates.finished(n, uncached_tokens=1000, output_tokens=1, now=t + rtt + 0.05))
        t += 5.0
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.05)


def test_the_edges_own_requests_ahead_still_time_a_backlog_from_first_token_to_first_token():
    # Two requests sent together, the second with the first's charge (100 ms) ahead of it and
    # nothing else: the worker (0.05 ms/token) serves them back to back, and the second is timed
    # from the first's first token. Once the first token came back, the charge is no longer
    # ahead: a third request sent then with 100 ms ahead waits for someone else's work.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n in range(0, 30, 3):
        rates.sent(n, 0, now=t, ahead_ms=0.0, work_ms=100.0)
        rates.sent(n + 1, 0, now=t, ahead_ms=100.0, work_ms=100.0)
        rates.first_token(n, now=t + rtt + 0.1)
        rates.first_token(n + 1, now=t + rtt + 0.2)
        rates.sent(n + 2, 0, now=t + rtt + 0.2, ahead_ms=100.0, work_ms=100.0)
        rates.first_token(n + 2, now=t + 2 * rtt + 0.5)  # behind 200 ms of others' work
        for k in range(3):
            rates.finished(n + k, uncached_tokens=2000, output_tokens=1, now=t + 1.0)
        t += 2.0
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.05)
    assert rates.snapshot()["prefill_samples"].tolist() == [20, 0, 0]  # two of every three


def test_a_backlog_whose_first_tokens_the_edge_reads_in_a_bunch_is_not_learned_as_nearly_free():
    # Four requests sent together to a worker serving each in 100 ms (2,000 tokens at 0.05 ms a
    # token): its first tokens come 100, 200, 300 and 400 ms after sending, but a busy edge
    # reads the last three in one bunch, 1 ms apart. Timed from first token to first token the
    # bunch's later two are 1 ms each, and the rate read an eighth of the true one (the learned
    # rate's bound; the worker the edge sends the most to then looks the cheapest). Floored at
    # each one's share of the backlog it waited for (its charge over the charges ahead plus its
    # own, all equal here) they are not.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n in range(0, 40, 4):
        for k in range(4):
            rates.sent(n + k, 0, now=t, ahead_ms=100.0 * k, work_ms=100.0)
        for k, read_at in enumerate((0.1, 0.4, 0.401, 0.402)):
            rates.first_token(n + k, now=t + rtt + read_at)
        for k in range(4):
            rates.finished(n + k, uncached_tokens=2000, output_tokens=1, now=t + 1.0)
        t += 2.0
    assert rates.snapshot()["prefill_samples"].tolist() == [31, 0, 0]  # a full window, all sampled
    # Samples per round: 100 ms, 300 (the bunch's first, timed from the first's), then their
    # shares of the backlog, 401 / 3 and 402 / 4 ms: the median lies between 100 and 134 ms.
    assert 0.05 <= rates.prefill_ms_per_token(0) <= 0.05 * 1.34


def test_a_short_prompt_read_in_a_bunch_behind_a_long_one_is_floored_at_its_own_share():
    # A 20,000-token prompt (1 s at 0.05 ms a token) and a 200-token one (10 ms) sent together,
    # charged in proportion; the edge reads their first tokens 1 ms apart. The short one's floor
    # is its share of the 1.01 s it waited, 10 / 1,010 of it: its own 10 ms, not half the wait.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n in range(0, 20, 2):
        rates.sent(n, 0, now=t, ahead_ms=0.0, work_ms=1000.0)
        rates.sent(n + 1, 0, now=t, ahead_ms=1000.0, work_ms=10.0)
        rates.first_token(n, now=t + rtt + 1.009)  # read late, with the next
        rates.first_token(n + 1, now=t + rtt + 1.010)
        rates.finished(n, uncached_tokens=20_000, output_tokens=1, now=t + 2.0)
        rates.finished(n + 1, uncached_tokens=200, output_tokens=1, now=t + 2.0)
        t += 3.0
    # Samples: 1,009 ms over 20,000 tokens and 10 ms over 200, both 0.05 ms a token.
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.05, rel=0.01)


def test_a_failed_or_evicted_dispatch_is_no_longer_ahead_of_the_next():
    rates = LearnedRates(_cfg(), "us", max_open=2)
    rates.sent(1, 0, now=0.0, work_ms=100.0)
    rates.dropped(1)
    rates.sent(2, 0, now=0.0, work_ms=100.0)
    rates.sent(3, 1, now=0.0, work_ms=50.0)
    rates.sent(4, 1, now=0.0, work_ms=50.0)  # the cap drops dispatch 2 (never answered)
    assert rates.worker_of(2) == -1
    rates.sent(5, 0, now=0.0, ahead_ms=100.0, work_ms=100.0)  # 100 ms ahead is nobody's of ours now
    rates.first_token(5, now=0.3)
    rates.finished(5, uncached_tokens=1000, output_tokens=1, now=0.3)
    assert rates.snapshot()["prefill_samples"].tolist() == [0, 0, 0]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(RatesError):
            rates.sent(9, 0, now=1.0, ahead_ms=bad)
        with pytest.raises(RatesError):
            rates.sent(9, 0, now=1.0, work_ms=bad)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["sent", "first", "end", "drop"]), st.integers(0, 7), st.integers(0, 2),
                              st.floats(min_value=0.0, max_value=5000.0)), max_size=80))
def test_the_own_work_ahead_is_what_is_open_and_not_yet_prefilled(ops):
    """Whatever the order of sends, first tokens, ends and failures (repeats and unknown
    dispatches included, the cap evicting the oldest), each worker's own work ahead is the
    charge of the dispatches there still awaiting their first token, and nothing once all end."""
    rates = LearnedRates(_cfg(), "us", max_open=5)
    opened: list[int] = []  # open dispatches, oldest first
    charge: dict[int, tuple[int, float]] = {}  # open, no first token yet: dispatch -> (worker, ms)
    t = 0.0
    for op, dispatch, worker, ms in ops:
        t += 0.01
        if op == "sent":
            if dispatch in opened:
                continue  # the shell never reuses an open dispatch's number
            if len(opened) == 5:  # the cap drops the oldest open dispatch
                charge.pop(opened.pop(0), None)
            rates.sent(dispatch, worker, now=t, ahead_ms=ms, work_ms=ms)
            opened.append(dispatch)
            charge[dispatch] = (worker, ms)
        elif op == "first":
            rates.first_token(dispatch, now=t)
            charge.pop(dispatch, None)
        else:
            if op == "end":
                rates.finished(dispatch, uncached_tokens=1000, output_tokens=2, now=t)
            else:
                rates.dropped(dispatch)
            charge.pop(dispatch, None)
            if dispatch in opened:
                opened.remove(dispatch)
        assert len(rates) == len(opened)
        for w in range(3):
            expected = sum(m for cw, m in charge.values() if cw == w)
            assert rates.own_work_ahead_ms(w) == pytest.approx(expected, abs=1e-6)
    for dispatch in opened:
        rates.dropped(dispatch)
    assert [rates.own_work_ahead_ms(w) for w in range(3)] == [0.0, 0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(served=st.lists(st.tuples(st.integers(min_value=0, max_value=2), st.floats(min_value=0.001, max_value=2.0),
                                 st.integers(min_value=0, max_value=3000)), max_size=40))
def test_the_rates_vector_is_exactly_each_workers_rate(served):
    """prefill_rates (what the scorer reads) is bit for bit prefill_ms_per_token of every worker,
    whichever workers have samples of their own and wherever the fleet's factor stands."""
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t = 0.0
    for n, (worker, prefill_s, uncached) in enumerate(served):
        _serve(rates, n, worker, sent=t, first=t + rtt + prefill_s, end=t + rtt + prefill_s, uncached=uncached,
               output=1)
        t += 3.0
        each = [rates.prefill_ms_per_token(w) for w in range(3)]
        assert rates.prefill_rates().tolist() == each  # a small fleet's, worker by worker
        small, rates_module.SMALL_FLEET = rates_module.SMALL_FLEET, 0
        try:
            assert rates.prefill_rates().tolist() == each  # a large fleet's, in numpy
        finally:
            rates_module.SMALL_FLEET = small


@settings(max_examples=200, deadline=None)
@given(ratios=st.lists(st.one_of(st.floats(1e-3, 1e3), st.sampled_from([0.5, 1.0, 2.0, 0.0, float("nan")])),
                       max_size=120),
       window=st.integers(1, 9), bound=st.sampled_from([1.0, 4.0, 100.0]))
def test_estimator_factor_is_the_median_of_its_window(ratios, window, bound):
    """The estimator keeps its window ordered as samples come and go: its factor after every
    sample is exp of the median of the last ``window`` clipped log-ratios, as sorting them gives."""
    estimator = RateEstimator(bound=bound, window=window, min_samples=1)
    kept: list[float] = []
    for ratio in ratios:
        estimator.observe(ratio)
        if ratio > 0.0 and math.isfinite(ratio):
            kept = (kept + [min(math.log(bound), max(-math.log(bound), math.log(ratio)))])[-window:]
        if kept:
            ordered = sorted(kept)
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
            assert estimator.factor == math.exp(median)
            assert len(estimator) == len(kept)


@settings(max_examples=200, deadline=None)
@given(ratios=st.lists(st.one_of(st.floats(1e-3, 1e3), st.sampled_from([0.5, 1.0, 2.0, 0.0, float("nan"), -1.0])),
                       max_size=120),
       window=st.integers(1, 9), min_samples=st.integers(1, 9), bound=st.sampled_from([1.0, 4.0, 100.0]))
def test_a_read_estimator_reads_what_the_ordered_one_holds(ratios, window, min_samples, bound):
    """The decode rates' estimator takes its median when read: after every sample its factor
    and length are the ordered estimator's, bit for bit."""
    min_samples = min(min_samples, window)
    ordered = RateEstimator(bound=bound, window=window, min_samples=min_samples)
    read = ReadRateEstimator(bound=bound, window=window, min_samples=min_samples)
    for ratio in ratios:
        ordered.observe(ratio)
        read.observe(ratio)
        assert read.factor == ordered.factor and len(read) == len(ordered)


def test_a_read_estimator_refuses_the_arguments_the_ordered_one_refuses():
    for args in ({"bound": 0.5}, {"bound": float("inf")}, {"bound": 2.0, "window": 0},
                 {"bound": 2.0, "window": 3, "min_samples": 4}):
        with pytest.raises(RatesError):
            ReadRateEstimator(**args)


# ---------------------------------------------------------------------------- waits for VRAM room


def _serve_on_a_model(rates, cfg, sends, *, counts_room: bool) -> None:
    """One worker (us-0: 0.1 ms/token, 2,048 tokens of VRAM in pages of 16, DRAM for the rest)
    modelled exactly with its prefix cache, sent ``sends`` = (edge time, id, tokens, output
    tokens, whether this edge sent it). This edge sends each of its own with the worker's queue
    report as the queue ahead and the prefill it expects as its charge, and sees the first
    tokens and ends one way after they happen; the other edge's requests it does not see."""
    one_way = cfg.rtt_ms("us", "us") / 2000.0
    owner = CacheOwner(vram_tokens=2048, block_size=16, dram_tokens=1 << 20)
    model = owner.model(WorkerTiming(prefill_ms_per_token=BETA, decode_ms_per_token=DECODE, decode_batch_slope=0.0),
                        counts_room=counts_room)
    seen: list[tuple[float, object]] = []  # (edge time, event)
    mine: dict[str, int] = {}
    outputs: dict[str, int] = {}

    def deliver(upto: float) -> None:
        seen.sort(key=lambda item: item[0])
        while seen and seen[0][0] <= upto:
            at, event = seen.pop(0)
            dispatch = mine.get(event.request_id)
            if dispatch is None:
                continue
            if isinstance(event, FirstTokenProduced):
                rates.first_token(dispatch, now=at)
            else:
                rates.finished(dispatch, uncached_tokens=owner.uncached[event.request_id],
                               output_tokens=outputs[event.request_id], now=at)

    for n, (t, rid, tokens, output, own) in enumerate(sends):
        seen.extend((e.at + one_way, e) for e in model.advance(now=t + one_way))
        deliver(t)
        if own:
            found = owner.cache.match(tokens)
            mine[rid] = n
            rates.sent(n, 0, now=t, ahead_ms=model.queue_ms(now=t + one_way),
                       work_ms=BETA * (len(tokens) - found.total_tokens) + 0.00524 * found.dram_tokens)
        outputs[rid] = output
        owner.admit(model, rid, tokens, output, t + one_way)
    while (due := model.next_event_time()) is not None:
        seen.extend((e.at + one_way, e) for e in model.advance(now=due))
    deliver(math.inf)


def _prompt(first: int, tokens: int) -> list[int]:
    return list(range(first, first + tokens))


def test_a_wait_for_vram_room_that_the_queue_report_counts_is_not_learned_as_prefill():
    # Every 2 s another edge sends a 960-token prompt that decodes for 300 ms (60 pages pinned),
    # then an 1,280-token one (80 pages) whose pages wait in DRAM: it reloads in 7 ms but must
    # wait for the first to finish, for 128 pages do not hold both. This edge's 1,000-token
    # request sent behind it waits too. Its queue report counts that wait, so the edge knows
    # others' work is ahead and takes no sample; every other cycle a request finds the worker
    # idle and teaches the true rate. A report that left the wait out (only the 7 ms reload
    # ahead, within a tenth of the request's own 100 ms) made each such request a sample 2.6x
    # too slow: the rate learned was theirs.
    sends = []
    for cycle in range(24):
        t = 2.0 * cycle
        sends += [(t, f"hold{cycle}", _prompt(1_000_000, 960), 31, False),
                  (t + 0.1, f"wait{cycle}", _prompt(2_000_000, 1280), 1, False),
                  (t + 0.15, f"behind{cycle}", _prompt(3_000_000 + 10_000 * cycle, 1000), 1, True)]
        if cycle % 2:
            sends.append((t + 1.0, f"idle{cycle}", _prompt(4_000_000 + 10_000 * cycle, 1000), 1, True))
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    _serve_on_a_model(rates, cfg, sends, counts_room=True)
    assert rates.prefill_ms_per_token(0) == pytest.approx(BETA, rel=0.02)
    blind = LearnedRates(cfg, "us")
    _serve_on_a_model(blind, cfg, sends, counts_room=False)
    assert blind.prefill_ms_per_token(0) > 2 * BETA


def test_a_request_that_waited_for_vram_room_is_timed_from_the_end_that_freed_it():
    # This edge sends both: a 960-token prompt that decodes for 300 ms, then a new 1,280-token
    # one that cannot start until the first frees its pages. No queue report can count that
    # wait (it is the request's own size that does not fit); the first one's end, seen one way
    # after it happened, is when the second's prefill started.
    sends = []
    for cycle in range(24):
        t = 2.0 * cycle
        sends += [(t, f"hold{cycle}", _prompt(1_000_000 + 10_000 * cycle, 960), 31, True),
                  (t + 0.1, f"wait{cycle}", _prompt(5_000_000 + 10_000 * cycle, 1280), 1, True)]
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    _serve_on_a_model(rates, cfg, sends, counts_room=True)
    assert rates.snapshot()["prefill_samples"][0] == 31
    assert rates.prefill_ms_per_token(0) == pytest.approx(BETA, rel=0.02)


def test_a_rate_learned_under_another_load_goes_stale_once_the_fleets_window_turns_over():
    # Every worker learned under a backlog (1.5x the configured rate); then the edge keeps
    # sending to worker 1 alone, and re-learns it idle (1.0x). Worker 0 would keep its backlog
    # rate and look 1.5x dearer for good; once the fleet's window (2 x 31 + 1 samples)
    # has turned over without a sample of its own, it takes the fleet's factor again.
    cfg = _cfg()
    rates = LearnedRates(cfg, "us")
    rtt = cfg.rtt_ms("us", "us") / 1000.0
    t, n = 0.0, 0
    for _ in range(5):
        for w in (0, 1):
            _serve(rates, n, w, sent=t, first=t + rtt + 0.15, end=t + rtt + 0.15, uncached=1000, output=1)
            t, n = t + 1.0, n + 1
    assert rates.prefill_rates().tolist()[:2] == pytest.approx([0.15, 0.15])
    changed = []
    for _ in range(2 * 31 + 1):
        changed.append(_serve(rates, n, 1, sent=t, first=t + rtt + 0.1, end=t + rtt + 0.1, uncached=1000, output=1))
        t, n = t + 1.0, n + 1
        assert rates.prefill_rates().tolist() == [rates.prefill_ms_per_token(w) for w in range(3)]
    assert rates.prefill_ms_per_token(0) == rates.prefill_ms_per_token(1) == pytest.approx(0.1)
    assert rates.prefill_rates().tolist()[:2] == pytest.approx([0.1, 0.1])
    assert changed[-1]  # the sample that made them stale says so: the score's rates are read again
    # One sample of its own and worker 0's learned rate is fresh again.
    _serve(rates, n, 0, sent=t, first=t + rtt + 0.15, end=t + rtt + 0.15, uncached=1000, output=1)
    assert rates.prefill_ms_per_token(0) == pytest.approx(0.15)
