"""Queue estimates: live local values, EWMA piggybacks, broadcasts and their suppression, idleness."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.config import load_config
from kvcompassd.core.messages import MessageError
from kvcompassd.core.messages import RoomVectorBroadcast
from kvcompassd.core.queues import QueueEstimateError, QueueEstimates, QueueVectorBroadcast, QueueVectorError

CFG = load_config(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml")
EU0 = CFG.worker_ids().index("eu-0")


def us_edge(now: float = 0.0) -> QueueEstimates:
    return QueueEstimates(CFG, "us", now=now)


def test_starts_unknown_at_zero() -> None:
    q = us_edge()
    assert q.queue_ms().tolist() == [0.0] * len(CFG.workers)
    assert np.isinf(q.ages(now=1.0)).all()
    assert q.last_heard_from("eu") == -math.inf


def test_local_values_are_live_and_checked() -> None:
    q = us_edge()
    q.set_local("us-3", 42.0, now=1.0)
    q.set_local("us-3", 7.0, now=2.0)
    assert q.get("us-3") == 7.0
    assert q.ages(now=2.5)[CFG.worker_ids().index("us-3")] == pytest.approx(0.5)
    with pytest.raises(QueueEstimateError, match="region 'eu'"):
        q.set_local("eu-0", 1.0, now=2.0)
    with pytest.raises(QueueEstimateError, match="unknown worker"):
        q.set_local("zz", 1.0, now=2.0)
    for bad in (-1.0, math.nan, math.inf, "3", True):
        with pytest.raises(QueueEstimateError):
            q.set_local("us-0", bad, now=2.0)  # type: ignore[arg-type]
    assert q.local_vector()[3] == ("us-3", 7.0) and len(q.local_vector()) == 8


def test_piggyback_is_folded_with_ewma_weight() -> None:
    q = us_edge()
    q.on_piggyback("eu", {"eu-0": 100.0, "eu-1": 10.0}, now=1.0)
    assert q.get("eu-0") == 100.0  # first report: nothing to average with
    q.on_piggyback("eu", {"eu-0": 200.0}, now=1.2)
    assert q.get("eu-0") == pytest.approx(0.5 * 200 + 0.5 * 100)
    assert q.get("eu-1") == 10.0
    assert q.last_heard_from("eu") == 1.2
    assert q.queue_ms(now=9.0)[EU0] == pytest.approx(150.0)  # no trend yet: remote values stay put


def test_local_readings_drain_one_ms_per_ms_and_dispatches_add_to_what_is_left() -> None:
    q = us_edge()
    q.set_local("us-0", 100.0, now=1.0)
    assert q.queue_ms()[0] == 100.0  # as set
    assert q.queue_ms(now=1.03)[0] == pytest.approx(70.0)
    assert q.queue_ms(now=2.0)[0] == 0.0
    assert q.queue_ms(now=1.03) is q.queue_ms(now=1.03)  # one snapshot per instant
    q.note_dispatched("us-0", 10.0, now=1.05)
    assert q.queue_ms(now=1.05)[0] == pytest.approx(60.0)
    assert q.queue_ms(now=1.06)[0] == pytest.approx(50.0)
    assert dict(q.local_vector(now=1.06))["us-0"] == pytest.approx(50.0)
    (to_eu, *_) = [b for b in q.due_broadcasts(now=1.06) if b.to_region == "eu"]
    assert dict(to_eu.vector)["us-0"] == pytest.approx(50.0)  # broadcasts carry the aged value
    q.note_dispatched("eu-0", 10.0, now=1.06)  # a remote worker: counted, never aged
    assert q.queue_ms(now=5.0)[EU0] == 10.0


def test_a_charge_goes_when_the_first_token_comes_back_not_at_the_next_reading() -> None:
    # A worker far faster than its configured beta: each dispatch is charged 150 ms of prefill
    # and its first token is back a millisecond later. Without retiring, a burst of 10 left a
    # phantom queue of ~1.5 s on the holder until the next reading.
    q = us_edge()
    q.set_local("us-0", 0.0, now=1.0)
    handles = [q.note_dispatched("us-0", 150.0, now=1.0) for _ in range(10)]
    assert q.queue_ms(now=1.0)[0] == pytest.approx(1500.0)
    for n, h in enumerate(handles):
        q.retire_prefill(h, now=1.001 + n * 0.001)
    assert q.queue_ms(now=1.011)[0] == 0.0
    assert q.is_persistently_idle("us-0", now=1.011 + CFG.score.idle_period_ms / 1000.0)
    for h in handles:
        q.retire(h, now=1.02)  # the ends: nothing left to take out
    assert q.queue_ms(now=1.02)[0] == 0.0 and q.open_charges() == 0


def test_what_is_left_of_a_charge_is_what_a_fifo_worker_has_not_drained() -> None:
    q = us_edge()
    q.set_local("us-0", 40.0, now=1.0)  # 40 ms ahead of the dispatch
    h = q.note_dispatched("us-0", 100.0, now=1.0)
    # 60 ms later the worker has drained the 40 ahead and 20 of ours: 80 are left of ours.
    assert q.retire_prefill(h, now=1.06) == pytest.approx(80.0)
    assert q.queue_ms(now=1.06)[0] == pytest.approx(0.0)
    assert q.retire_prefill(h, now=1.07) == 0.0  # once only
    # A worker slower than charged: past its charge, nothing is left to take out.
    h = q.note_dispatched("us-0", 10.0, now=2.0)
    assert q.retire_prefill(h, now=2.5) == 0.0


def test_a_reading_since_the_dispatch_speaks_for_the_worker() -> None:
    q = us_edge()
    h1 = q.note_dispatched("us-1", 100.0, now=1.0)
    h2 = q.note_dispatched("us-1", 100.0, now=1.0)
    q.set_local("us-1", 120.0, now=1.01)  # the engine's own queue, with our work in it
    q.retire(h1, now=1.02)  # failed before its first token: still nothing to take from the reading
    assert q.retire_prefill(h2, now=1.02) == 0.0
    assert q.queue_ms(now=1.02)[1] == pytest.approx(110.0)
    assert q.open_charges() == 1
    q.retire(h2, now=1.03)
    assert q.open_charges() == 0


def test_an_unfinished_charge_is_retired_whole_at_a_failure_and_remote_ones_do_not_drain() -> None:
    q = us_edge()
    h = q.note_dispatched("us-2", 100.0, now=1.0)
    q.retire(h, now=1.01)  # no first token: all that is left goes
    assert q.queue_ms(now=1.01)[2] == 0.0
    h = q.note_dispatched("eu-0", 100.0, now=1.0)  # remote values follow their trend (0 here)
    assert q.retire_prefill(h, now=1.5) == pytest.approx(100.0)
    assert q.queue_ms(now=1.5)[EU0] == 0.0
    q.retire(12345, now=2.0)  # unknown handles are ignored
    assert q.retire_prefill(12345, now=2.0) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=0.0, max_value=500.0), st.floats(min_value=0.0, max_value=0.2)),
                min_size=1, max_size=30))
def test_retiring_every_charge_never_leaves_more_than_the_reading(dispatches) -> None:
    """However charges and first tokens interleave, once every dispatch has ended the estimate
    is at most what the last reading said, aged: no phantom queue survives its requests."""
    q = us_edge()
    q.set_local("us-0", 50.0, now=1.0)
    t, handles = 1.0, []
    for ms, gap in dispatches:
        handles.append(q.note_dispatched("us-0", ms, now=t))
        t += gap
    for h in handles:
        q.retire(h, now=t)
    assert q.queue_ms(now=t)[0] <= max(0.0, 50.0 - (t - 1.0) * 1000.0) + 1e-6
    assert q.open_charges() == 0


def test_piggyback_from_a_peer_is_validated_before_anything_changes() -> None:
    q = us_edge()
    with pytest.raises(QueueVectorError, match="reported worker 'asia-0'"):
        q.on_piggyback("eu", {"eu-0": 5.0, "asia-0": 1.0}, now=1.0)
    assert q.get("eu-0") == 0.0
    with pytest.raises(QueueVectorError):
        q.on_piggyback("us", {"us-0": 1.0}, now=1.0)  # own region comes live, not piggybacked
    with pytest.raises(QueueVectorError):
        q.on_piggyback("eu", {"eu-0": -5.0}, now=1.0)
    with pytest.raises(QueueVectorError):
        q.on_piggyback("eu", {"nobody": 5.0}, now=1.0)


def test_broadcasts_every_period_and_suppressed_after_a_piggyback_was_sent() -> None:
    q = us_edge()
    q.set_local("us-0", 12.0, now=0.0)
    first = q.due_broadcasts(now=0.0)
    assert {(b.from_region, b.to_region) for b in first} == {("us", "eu"), ("us", "asia")}
    assert first[0].vector == q.local_vector() and first[0].sent_at == 0.0
    assert q.due_broadcasts(now=0.05) == ()
    assert q.next_deadline(now=0.05) == pytest.approx(0.1)
    # One of our agents answered a request from eu at 0.15: eu has our vector, asia does not.
    q.due_broadcasts(now=0.1)
    q.note_piggyback_sent("eu", now=0.15)
    assert [b.to_region for b in q.due_broadcasts(now=0.2)] == ["asia"]
    assert q.next_deadline(now=0.2) == pytest.approx(0.25)
    assert [b.to_region for b in q.due_broadcasts(now=0.25)] == ["eu"]
    assert q.next_deadline(now=1.0) == 1.0  # overdue: now
    with pytest.raises(QueueEstimateError):
        q.note_piggyback_sent("us", now=1.0)


def test_broadcast_replaces_and_ignores_reordered_datagrams() -> None:
    q = us_edge()
    q.on_piggyback("eu", {"eu-0": 100.0}, now=1.0)
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 50.0, (("eu-0", 10.0), ("eu-1", 0.0))), now=1.1)
    assert q.get("eu-0") == 10.0
    late = QueueVectorBroadcast("eu", "us", 49.9, (("eu-0", 999.0),))
    assert not q.on_broadcast(late, now=1.2)
    assert q.get("eu-0") == 10.0
    with pytest.raises(QueueVectorError, match="delivered to 'us'"):
        q.on_broadcast(QueueVectorBroadcast("eu", "asia", 60.0, (("eu-0", 1.0),)), now=1.3)
    with pytest.raises(QueueVectorError):
        q.on_broadcast(QueueVectorBroadcast("asia", "us", 60.0, (("eu-0", 1.0),)), now=1.3)


def test_a_broadcast_checked_by_another_edge_of_the_config_lands_as_one_checked_here() -> None:
    """``updates=`` from another edge's ``remote_updates`` (the same config) gives the state a
    broadcast checked by this edge gives, step after step; a bad vector raises in the check."""
    vectors = [(("eu-0", 10.0), ("eu-1", 0.0)), (("eu-0", 35.0), ("eu-1", 4.5)), (("eu-1", 1.0),)]
    own, given_checked = us_edge(), us_edge()
    other = QueueEstimates(CFG, "asia", now=0.0)
    for q in (own, given_checked):
        q.note_dispatched("eu-0", 30.0, now=0.5)
    for k, vector in enumerate(vectors):
        msg = QueueVectorBroadcast("eu", "us", 1.0 + k, vector)
        updates = other.remote_updates("eu", vector)
        assert own.on_broadcast(msg, now=1.1 + k) == given_checked.on_broadcast(msg, now=1.1 + k, updates=updates)
        assert updates == other.remote_updates("eu", vector)  # not changed by the receiver
        assert own.queue_ms(now=1.2 + k).tolist() == given_checked.queue_ms(now=1.2 + k).tolist()
        assert own.trends().tolist() == given_checked.trends().tolist()
    with pytest.raises(QueueVectorError):
        other.remote_updates("us", (("eu-0", 1.0),))  # us naming a worker of eu


def test_work_still_crossing_the_wan_survives_a_broadcast_and_a_piggyback() -> None:
    q = us_edge()  # us <-> eu: 160 ms one way, so a vector received now misses the last 320 ms
    q.note_dispatched("eu-0", 30.0, now=1.0)
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.0, (("eu-0", 10.0),)), now=1.1)
    assert q.get("eu-0") == pytest.approx(40.0)  # the snapshot plus the dispatch it cannot hold
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.3, (("eu-0", 25.0),)), now=1.4)
    assert q.get("eu-0") == 25.0  # 0.4 s on, the dispatch is in the worker's reading
    q.note_dispatched("eu-0", 20.0, now=1.45)
    assert q.get("eu-0") == pytest.approx(45.0)
    q.on_piggyback("eu", {"eu-0": 55.0}, now=1.5)
    # The sample is folded against the estimate without the in-flight 20 ms, which stays on top.
    assert q.get("eu-0") == pytest.approx(0.5 * 55.0 + 0.5 * 25.0 + 20.0)
    q.set_local("us-0", 0.0, now=1.5)
    q.note_dispatched("us-0", 5.0, now=1.5)
    q.set_local("us-0", 8.0, now=1.55)
    assert q.get("us-0") == 8.0  # own-region readings come straight from the agents


def test_remote_values_follow_the_trend_of_their_vectors() -> None:
    q = us_edge()  # trend window: 5 broadcast periods of 100 ms; us <-> eu 160 ms one way
    for k, ms in enumerate((0.0, 600.0, 1200.0)):  # a queue filling at 1 ms per ms
        vector = (("eu-0", ms), ("eu-1", 1200.0 - ms))
        assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 0.6 * k, vector), now=0.2 + 0.6 * k)
    # Slope samples 1 and 1 folded with weight 0.5: 0.75 ms per ms. The value was read 160 ms ago.
    assert q.get("eu-0") == pytest.approx(1200.0 + 0.75 * 160.0)
    assert q.queue_ms(now=1.5)[EU0] == pytest.approx(1200.0 + 0.75 * 260.0)
    assert q.queue_ms(now=1.5)[EU0 + 1] == 0.0  # the draining one projects to empty, never below
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.3, (("eu-0", 1300.0),)), now=1.6)
    assert q.get("eu-0") == pytest.approx(1300.0 + 0.75 * 160.0)  # inside the window: same trend


def test_the_herd_factor_charges_each_remote_send_at_the_work_that_arrived_per_ms_sent() -> None:
    q = us_edge()  # no trend inside the first 0.5 s; us <-> eu 320 ms round trip; 3 regions
    assert q.herd_factors(now=1.0) == {"eu": 1.0, "asia": 1.0}
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.0, (("eu-0", 100.0), ("eu-1", 100.0))), now=1.1)
    q.note_dispatched("eu-1", 100.0, now=1.15)
    assert q.get("eu-1") == pytest.approx(200.0)  # factor 1: our own work only
    # The next value reads 100 more than we believed for our 100 (200, plus our 100 still in
    # flight): two edges' worth arrived. k samples 1 + 100/100 = 2, folded with weight 0.25.
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.1, (("eu-1", 200.0),)), now=1.2)
    assert q.herd_factors(now=1.2) == {"eu": pytest.approx(1.25), "asia": 1.0}
    # A send to an eu worker is now charged at 1.25, in the estimate and in flight.
    q.note_dispatched("eu-1", 40.0, now=1.2)
    assert q.get("eu-1") == pytest.approx(300.0 + 50.0)
    # Exactly what we charged arrived: the factor holds (it only fades toward 1, 30 periods).
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.2, (("eu-1", 200.0),)), now=1.3)
    assert q.get("eu-1") == pytest.approx(200.0 + 100.0 + 50.0)  # both sends still in flight
    k = 1.0 + 0.25 * math.exp(-0.1 / 3.0)
    assert q.herd_factors(now=1.3)["eu"] == pytest.approx(k)
    # Never above the number of regions, and it fades toward 1 without new samples.
    q.note_dispatched("eu-1", 1.0, now=1.3)
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.3, (("eu-1", 1e6),)), now=1.4)
    k = 0.25 * 3.0 + 0.75 * (1.0 + (k - 1.0) * math.exp(-0.1 / 3.0))
    assert q.herd_factors(now=1.4)["eu"] == pytest.approx(k)
    assert q.herd_factors(now=4.4)["eu"] == pytest.approx(1.0 + (k - 1.0) / math.e)
    # A worker this edge did not send to since its last value moves no factor.
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.4, (("eu-0", 1e6),)), now=1.5)
    assert q.herd_factors(now=1.5)["eu"] == pytest.approx(1.0 + (k - 1.0) * math.exp(-0.1 / 3.0))
    # The own region's live readings are never charged more than the work sent.
    q.set_local("us-0", 0.0, now=1.5)
    q.note_dispatched("us-0", 30.0, now=1.5)
    assert q.get("us-0") == pytest.approx(30.0)


def test_chosen_remote_workers_surprises_correct_their_region_for_the_winners_curse() -> None:
    q = us_edge()  # no trend inside the first 0.5 s; us <-> eu 320 ms round trip
    ids = CFG.worker_ids()
    eu1, asia0, us0 = ids.index("eu-1"), ids.index("asia-0"), ids.index("us-0")
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.0, (("eu-0", 100.0), ("eu-1", 100.0))), now=1.1)
    # A worker this edge did not choose can surprise nobody: its jump corrects nothing.
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.1, (("eu-0", 400.0),)), now=1.2)
    assert q.surprises(now=1.2) == {"eu": 0.0, "asia": 0.0}
    q.note_dispatched("eu-1", 10.0, now=1.25)  # chosen at 110 ms (its 100 plus this dispatch)
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.2, (("eu-1", 500.0),)), now=1.3)
    # It reads 500 (plus the 10 still in flight): a 400 ms surprise, folded with weight 0.25.
    assert q.surprises(now=1.3)["eu"] == pytest.approx(100.0)
    now = q.queue_ms(now=1.3)
    assert now[EU0] == pytest.approx(500.0) and now[eu1] == pytest.approx(610.0)  # every eu worker
    assert now[asia0] == 0.0 and now[us0] == 0.0  # other regions, own region: untouched
    assert q.get("eu-1") == pytest.approx(510.0)  # the stored value holds no correction
    # Without new surprises it fades (30 broadcast periods), so eu is chosen again in time.
    assert q.surprises(now=4.3)["eu"] == pytest.approx(100.0 / math.e)
    # A chosen worker that reads lower than believed pulls the correction down, never below 0.
    q.note_dispatched("eu-1", 10.0, now=1.35)
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.35, (("eu-1", 0.0),)), now=1.4)
    assert q.surprises(now=1.4)["eu"] < 100.0
    for k in range(20):
        q.note_dispatched("eu-1", 10.0, now=1.41 + 0.01 * k)
        assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 1.41 + 0.01 * k, (("eu-1", 0.0),)), now=1.415 + 0.01 * k)
    assert q.surprises(now=1.7)["eu"] == 0.0
    assert q.queue_ms(now=1.7)[EU0] >= 0.0


def test_broadcast_message_validation() -> None:
    # The queue vector is the wire's message (core/messages.py): refused on construction.
    with pytest.raises(MessageError, match="twice"):
        QueueVectorBroadcast("eu", "us", 0.0, (("eu-0", 1.0), ("eu-0", 2.0)))
    with pytest.raises(MessageError):
        QueueVectorBroadcast("eu", "us", 0.0, (("eu-0", math.nan),))
    with pytest.raises(MessageError):
        QueueVectorBroadcast("eu", "us", 0.0, (("eu-0",),))  # type: ignore[arg-type]
    with pytest.raises(MessageError):
        QueueVectorBroadcast("eu", "us", math.inf, ())
    # An edge's vector for its own agents is a valid message, but never a broadcast to itself.
    own = QueueVectorBroadcast("us", "us", 0.0, (("us-0", 1.0),))
    with pytest.raises(QueueVectorError, match="own region"):
        us_edge().on_broadcast(own, now=0.1)


def test_persistent_idleness_needs_the_whole_idle_period() -> None:
    q = us_edge()
    assert not q.is_persistently_idle("us-0", now=5.0)  # never reported
    q.set_local("us-0", 0.0, now=0.0)
    q.set_local("us-0", 0.0, now=0.5)  # still idle: the period keeps running from 0.0
    assert not q.is_persistently_idle("us-0", now=0.9)
    assert q.is_persistently_idle("us-0", now=1.0)
    q.set_local("us-0", 3.0, now=1.1)
    assert not q.is_persistently_idle("us-0", now=1.5)
    q.set_local("us-0", 0.0, now=1.2)
    q.set_local("us-1", 0.0, now=0.2)
    assert not q.is_persistently_idle("us-0", now=2.1)
    assert q.persistently_idle_local(now=2.2) == ("us-1", "us-0")  # longest idle first
    assert q.idle_since("us-0") == 1.2


def test_snapshots_do_not_change_under_updates() -> None:
    q = us_edge()
    snapshot = q.queue_ms()
    q.set_local("us-0", 9.0, now=1.0)
    assert snapshot[0] == 0.0 and q.queue_ms()[0] == 9.0
    with pytest.raises(ValueError):
        snapshot[0] = 1.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 5000), min_size=1, max_size=30))
def test_piggyback_sequence_equals_reference_ewma(samples: list[float]) -> None:
    q = us_edge()
    expected = None
    for t, ms in enumerate(samples):
        q.on_piggyback("eu", {"eu-0": ms}, now=0.01 * t)  # inside one trend window
        expected = ms if expected is None else 0.5 * ms + 0.5 * expected
    assert q.queue_ms()[EU0] == pytest.approx(expected)
    assert min(samples) - 1e-9 <= q.get("eu-0") <= max(samples) + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 0.5), min_size=1, max_size=20), st.sampled_from(["eu", "asia"]))
def test_the_deadline_always_finds_a_broadcast_due(steps: list[float], piggy_region: str) -> None:
    q = us_edge()
    now = 0.0
    for step in steps:
        now += step
        q.note_piggyback_sent(piggy_region, now=now)
        q.due_broadcasts(now=now)
        deadline = q.next_deadline(now=now)
        assert deadline is not None and deadline >= now
        assert q.due_broadcasts(now=deadline) != ()


def test_dispatched_work_adds_up_until_the_next_reading_and_is_checked() -> None:
    q = us_edge()
    q.set_local("us-1", 0.0, now=0.0)
    before = q.queue_ms()
    q.note_dispatched("us-1", 12.5, now=0.1)
    q.note_dispatched("us-1", 2, now=0.1)  # ints and numpy numbers are accepted too
    q.note_dispatched("us-1", np.float32(0.5), now=0.1)
    assert q.get("us-1") == 15.0 and before.tolist() == [0.0] * len(CFG.workers)
    assert not q.is_persistently_idle("us-1", now=1e6)  # busy until a reading says 0 again
    unchanged = q.queue_ms()
    q.note_dispatched("us-1", 0.0, now=0.4)
    assert q.queue_ms() is unchanged
    for bad in (-1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(QueueEstimateError, match="worker 'us-1'"):
            q.note_dispatched("us-1", bad, now=0.5)
    with pytest.raises(QueueEstimateError, match="unknown worker"):
        q.note_dispatched("zz", 1.0, now=0.5)
    assert q.get("us-1") == 15.0
    q.set_local("us-1", 3.0, now=0.6)  # a live reading replaces the estimate
    assert q.get("us-1") == 3.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.012), st.booleans(), st.floats(0.0, 500.0)), min_size=1, max_size=40))
def test_a_broadcast_keeps_exactly_the_dispatches_of_the_last_round_trip(steps: list[tuple[float, bool, float]]) -> None:
    q = us_edge()  # at most 0.48 s of steps: one trend window, so no trend moves the values
    rtt_s = CFG.rtt_ms("us", "eu") / 1000.0
    now, sent = 0.0, []
    for step, is_broadcast, ms in steps:
        now += step
        if is_broadcast:
            if q.on_broadcast(QueueVectorBroadcast("eu", "us", now, (("eu-0", ms),)), now=now):
                expected = ms + sum(added for at, added in sent if at > now - rtt_s)
                assert q.get("eu-0") == pytest.approx(expected, abs=1e-6)
        else:
            charged = ms * q.herd_factors(now=now)["eu"]  # our send at the region's herd factor
            q.note_dispatched("eu-0", ms, now=now)
            sent.append((now, charged))


def test_own_region_occupancy_enters_the_score_only() -> None:
    q = us_edge()  # score.occupancy_ms_per_running: the config default, 0.25 ms per running request
    per = CFG.score.occupancy_ms_per_running
    ids = CFG.worker_ids()
    us0, us1 = ids.index("us-0"), ids.index("us-1")
    q.set_local("us-0", 0.0, now=1.0, running=40)
    q.set_local("us-1", 0.0, now=1.0, running=0)
    now = q.queue_ms(now=1.0)
    assert now[us0] == pytest.approx(40 * per) and now[us1] == 0.0
    # Idle both: the fuller batch scores higher; the stored value, what is broadcast and what
    # in-flight accounting ages stay the queue alone.
    assert q.get("us-0") == 0.0 and dict(q.local_vector(now=1.0))["us-0"] == 0.0
    q.note_dispatched("us-0", 10.0, now=1.0)
    assert q.get("us-0") == pytest.approx(10.0)
    assert q.queue_ms(now=1.0)[us0] == pytest.approx(10.0 + 40 * per)
    # The next reading replaces the count; it does not drain with time like the queue.
    assert q.queue_ms(now=1.5)[us0] == pytest.approx(40 * per)
    q.set_local("us-0", 0.0, now=2.0, running=np.int64(4))
    assert q.queue_ms(now=2.0)[us0] == pytest.approx(4 * per)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(QueueEstimateError, match="running"):
            q.set_local("us-0", 0.0, now=2.0, running=bad)
    assert q.queue_ms(now=2.0)[us0] == pytest.approx(4 * per)  # a refused reading changes nothing


# ---- idle suppression: due_broadcasts(heartbeat_s=...) and steady vectors --------------------


def test_an_unchanged_vector_goes_out_steady_twice_then_only_every_heartbeat() -> None:
    q = us_edge()
    q.set_local("us-0", 30.0, now=0.0)
    sent = {}
    for k in range(0, 31):  # every 100 ms period for 3 s
        now = k * 0.1
        for b in q.due_broadcasts(now=now, heartbeat_s=1.0):
            sent.setdefault(b.to_region, []).append((round(now, 1), b.steady))
    # The value drains to 0 by 0.03 s... after 0.0 each period is the same all-zero vector.
    for region in ("eu", "asia"):
        assert sent[region] == [(0.0, False), (0.1, False), (0.2, True), (0.3, True), (1.3, True), (2.3, True)]


def test_a_change_is_broadcast_within_one_period_even_while_quiet() -> None:
    q = us_edge()
    for k in range(11):
        q.due_broadcasts(now=k * 0.1, heartbeat_s=1.0)  # sent at 0.0, then steady at 0.1 and 0.2
    assert q.due_broadcasts(now=1.1, heartbeat_s=1.0) == ()  # quiet until 1.2
    q.set_local("us-1", 400.0, now=1.25)
    out = q.due_broadcasts(now=1.3, heartbeat_s=1.0)
    assert {b.to_region for b in out} == {"eu", "asia"} and not any(b.steady for b in out)
    assert dict(out[0].vector)["us-1"] == pytest.approx(350.0)


def test_without_a_heartbeat_every_period_is_sent_as_before() -> None:
    q = us_edge()
    counts = [len(q.due_broadcasts(now=k * 0.101)) for k in range(20)]
    assert counts == [2] * 20


def test_a_steady_vector_is_held_without_its_trend_until_the_next() -> None:
    q = us_edge()
    # eu-0 rose 0 -> 300 ms over a trend window: a rising trend.
    for k, ms in enumerate((0.0, 100.0, 200.0, 300.0)):
        assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 0.6 * k, (("eu-0", ms),)), now=0.2 + 0.6 * k)
    assert q.trends()[EU0] > 0
    moving = q.queue_ms(now=2.5)[EU0]
    assert moving > 300.0  # carried along the rise
    # Then it drained to 0 and stopped: the sender says steady and goes quiet.
    assert q.on_broadcast(QueueVectorBroadcast("eu", "us", 2.6, (("eu-0", 0.0),), steady=True), now=2.8)
    assert q.trends()[EU0] == 0.0
    assert q.queue_ms(now=3.8)[EU0] == 0.0  # a heartbeat later: still 0, not 0 plus a second of trend


def test_a_lost_steady_datagram_is_made_good_by_the_repeat() -> None:
    sender, receiver = us_edge(), QueueEstimates(CFG, "eu", now=0.0)
    sender.set_local("us-0", 500.0, now=0.0)
    got = []
    for k in range(15):
        for b in sender.due_broadcasts(now=k * 0.1, heartbeat_s=1.0):
            if b.to_region == "eu":
                got.append(b)
    assert [b.steady for b in got] == [False] * 6 + [True, True]  # drains until 0.5 s, then steady twice
    for b in got[:-2] + got[-1:]:  # the first steady one lost
        receiver.on_broadcast(b, now=b.sent_at + 0.05)
    us0 = CFG.worker_ids().index("us-0")
    assert receiver.trends()[us0] == 0.0 and receiver.queue_ms(now=5.0)[us0] == 0.0


def test_a_quiet_region_is_next_looked_at_in_a_period_not_at_once() -> None:
    q = us_edge()
    for k in range(3):
        q.due_broadcasts(now=k * 0.1, heartbeat_s=1.0)  # 0.0, then steady at 0.1 and 0.2
    # Without the heartbeat every region is overdue at once (a timer armed there spins);
    # with it, a quiet region is next checked one period on (a change may be due then).
    assert q.next_deadline(now=0.55) == 0.55
    assert q.next_deadline(now=0.55, heartbeat_s=1.0) == pytest.approx(0.65)
    assert q.next_deadline(now=1.15, heartbeat_s=1.0) == pytest.approx(1.2)  # its heartbeat comes first
    assert q.due_broadcasts(now=0.65, heartbeat_s=1.0) == ()
    assert len(q.due_broadcasts(now=1.2, heartbeat_s=1.0)) == 2


def test_an_idle_then_busy_then_idle_region_is_followed_by_the_others() -> None:
    # Two edges exchange vectors as the daemons do (heartbeat 1 s, a period 100 ms, us -> eu
    # one way 160 ms): idle, a few heartbeats cross; busy, every period carries the live value
    # and eu's estimate follows it; idle again, eu holds 0 and the sends stop.
    us, eu = us_edge(), QueueEstimates(CFG, "eu", now=0.0)
    us0 = CFG.worker_ids().index("us-0")
    one_way = CFG.one_way_ms("us", "eu") / 1000.0
    in_flight: list[tuple[float, QueueVectorBroadcast]] = []
    sent = []

    def step(now: float) -> None:
        for b in us.due_broadcasts(now=now, heartbeat_s=1.0):
            if b.to_region == "eu":
                in_flight.append((now + one_way, b))
                sent.append(now)
        while in_flight and in_flight[0][0] <= now:
            arrival, b = in_flight.pop(0)
            eu.on_broadcast(b, now=arrival)

    ticks = iter(k * 0.1001 for k in range(1000))
    for now in ticks:  # 10 s idle
        step(now)
        if now > 10.0:
            break
    assert len(sent) <= 3 + 10  # the first, two steady repeats, then a heartbeat a second
    assert eu.queue_ms(now=now)[us0] == 0.0
    busy_from = now
    for k, now in enumerate(ticks):  # 2 s busy: us-0 read at 300-380 ms of queue every period
        us.set_local("us-0", 300.0 + 20.0 * (k % 5), now=now)
        step(now)
        if now > busy_from + 2.0:
            break
        if now > busy_from + one_way + 0.11:  # one period and the crossing later, eu sees it
            assert 150.0 <= eu.queue_ms(now=now)[us0] <= 500.0
    assert len([t for t in sent if t > busy_from]) >= 19  # every period while it moves
    # A reading that stops moving (a backlog stuck at 400 ms) is held by eu, not re-sent.
    stuck_from = now
    for now in ticks:
        us.set_local("us-0", 400.0, now=now)
        step(now)
        if now > stuck_from + 2.0:
            break
    assert eu.queue_ms(now=now)[us0] == 400.0
    assert len([t for t in sent if t > stuck_from]) <= 5  # one change, two repeats, a heartbeat
    quiet_from = now
    for now in ticks:  # idle again: us-0 drains, the vector stops moving, eu holds 0
        step(now)
        if now > quiet_from + 10.0:
            break
    assert eu.queue_ms(now=now)[us0] == 0.0 and eu.queue_ms(now=now + 5.0)[us0] == 0.0
    assert eu.trends()[us0] == 0.0
    assert len([t for t in sent if t > quiet_from + 1.0]) <= 10  # heartbeats only


def test_the_wait_for_vram_room_depends_on_the_prompt_and_ages_from_the_reading() -> None:
    q = us_edge()
    us3 = CFG.worker_ids().index("us-3")
    assert q.room_floor == math.inf and q.room_wait_ms(us3, 50_000, now=0.0) == 0.0  # nothing reported
    q.set_room("us-3", ((0.0, 8_000), (900.0, 40_000), (2_500.0, 98_304)), now=1.0)
    assert q.room_floor == 8_000
    assert q.room_wait_ms(us3, 8_000, now=1.0) == 0.0  # fits now
    assert q.room_wait_ms(us3, 30_000, now=1.0) == pytest.approx(900.0)
    assert q.room_wait_ms(us3, 30_000, now=1.5) == pytest.approx(400.0)  # counted from the reading
    assert q.room_wait_ms(us3, 60_000, now=1.5) == pytest.approx(2_000.0)
    assert q.room_wait_ms(us3, 200_000, now=1.0) == pytest.approx(2_500.0)  # longer than VRAM: runs alone
    assert q.room_wait_ms(us3, 60_000, now=9.0) == 0.0
    assert q.room(us3, now=1.0) == ((0.0, 8_000), (900.0, 40_000), (2_500.0, 98_304))
    assert q.room(us3, now=2.0) == ((0.0, 40_000), (1_500.0, 98_304))  # the first step is past
    assert q.room(us3, now=9.0) == ((0.0, 98_304),) and q.room(0, now=1.0) is None
    q.set_room("us-3", (), now=2.0)  # everything released
    assert q.room_floor == math.inf and q.room_wait_ms(us3, 60_000, now=2.0) == 0.0
    with pytest.raises(QueueEstimateError, match="region 'eu'"):
        q.set_room("eu-0", ((0.0, 1),), now=2.0)
    with pytest.raises(QueueEstimateError, match="non-decreasing"):
        q.set_room("us-3", ((0.0, 9), (5.0, 3)), now=2.0)


def test_the_pinned_share_is_the_vram_free_now_against_what_is_free_once_every_request_ends() -> None:
    q = us_edge()
    us3 = CFG.worker_ids().index("us-3")
    assert q.pinned_share(us3, now=0.0) == 0.0  # nothing reported: nothing pinned
    q.set_room("us-3", ((0.0, 8_000), (900.0, 40_000), (2_500.0, 80_000)), now=1.0)
    assert q.pinned_share(us3, now=1.0) == pytest.approx(0.9)
    assert q.pinned_share(us3, now=2.0) == pytest.approx(0.5)  # the first step is past
    assert q.pinned_share(us3, now=9.0) == 0.0
    q.set_room("us-3", ((0.0, 0),), now=9.0)  # a worker whose VRAM is all pinned, for good
    assert q.pinned_share(us3, now=9.0) == 1.0
    q.set_room("us-3", (), now=10.0)
    assert q.pinned_share(us3, now=10.0) == 0.0


def test_a_pinned_share_an_engine_reports_stands_where_it_gives_no_room_steps() -> None:
    q = us_edge()
    us2, us3 = CFG.worker_ids().index("us-2"), CFG.worker_ids().index("us-3")
    q.set_pinned("us-2", 0.7)
    assert q.pinned_share(us2, now=0.0) == 0.7 and q.pinned_workers == (us2,)
    q.set_room("us-3", ((0.0, 8_000), (900.0, 80_000)), now=0.0)
    assert q.pinned_workers == (us2, us3)
    q.set_pinned("us-3", 0.2)  # room steps, where an engine gives them, win
    assert q.pinned_share(us3, now=0.0) == pytest.approx(0.9)
    q.set_pinned("us-2", 0.0)
    assert q.pinned_share(us2, now=0.0) == 0.0 and q.pinned_workers == (us3,)
    with pytest.raises(QueueEstimateError, match="region"):
        q.set_pinned("eu-0", 0.5)
    with pytest.raises(QueueEstimateError, match="within"):
        q.set_pinned("us-2", 1.5)


def test_an_edge_broadcasts_its_regions_room_and_the_others_read_it_one_way_ago() -> None:
    us, eu = us_edge(), QueueEstimates(CFG, "eu", now=0.0)
    us3 = CFG.worker_ids().index("us-3")
    assert us.room_broadcasts(["eu", "asia"], now=1.0) == ()  # nothing pinned: nothing to say
    us.set_room("us-3", ((0.0, 8_000), (900.0, 98_304)), now=1.0)
    sent = us.room_broadcasts(["eu", "asia"], now=1.2)
    assert [m.to_region for m in sent] == ["eu", "asia"]
    assert sent[0].rooms == (("us-3", ((0.0, 8_000), (pytest.approx(700.0), 98_304))),)
    one_way_s = CFG.one_way_ms("us", "eu") / 1000.0
    assert eu.on_room_broadcast(sent[0], now=1.2 + one_way_s)
    assert eu.room_floor == 8_000 and eu.room_workers == (us3,)
    assert eu.room_wait_ms(us3, 30_000, now=1.2 + one_way_s) == pytest.approx(700.0 - 1000.0 * one_way_s)
    assert not eu.on_room_broadcast(sent[0], now=1.5)  # a reordered or repeated datagram
    # All free again: the next broadcast says so once, and the receiver forgets the steps.
    us.set_room("us-3", (), now=2.0)
    cleared = us.room_broadcasts(["eu"], now=2.0)
    assert [m.rooms for m in cleared] == [()] and us.room_broadcasts(["eu"], now=2.1) == ()
    assert eu.on_room_broadcast(cleared[0], now=2.2)
    assert eu.room_floor == math.inf and eu.room_wait_ms(us3, 30_000, now=2.2) == 0.0
    with pytest.raises(QueueVectorError, match="not in region"):
        eu.on_room_broadcast(RoomVectorBroadcast("us", "eu", 3.0, (("asia-0", ((0.0, 1), (5.0, 9))),)), now=3.1)
    own = RoomVectorBroadcast("eu", "eu", 3.0, (("eu-0", ((0.0, 1), (5.0, 9))),))
    with pytest.raises(QueueVectorError, match="own region 'eu'"):  # checked by us's edge, still refused here
        eu.on_room_broadcast(own, now=3.1, updates=us.room_updates("eu", own.rooms))


def test_a_long_dispatch_to_an_own_worker_is_broadcast_at_once() -> None:
    # [score] urgent_broadcast_ms (1,000 ms by default): a long prompt's prefill is news the
    # other regions' edges must not wait Delta for.
    q = us_edge()
    q.due_broadcasts(now=0.0)
    assert q.next_deadline(now=0.01) == pytest.approx(0.1)
    q.note_dispatched("us-2", 999.0, now=0.01)  # below the threshold: the next Delta as before
    assert not q.urgent and q.due_broadcasts(now=0.02) == ()
    q.note_dispatched("us-2", 4_000.0, now=0.03)
    assert q.urgent and q.next_deadline(now=0.03) == 0.03
    out = q.due_broadcasts(now=0.03)
    assert {b.to_region for b in out} == {"eu", "asia"} and out[0].sent_at == 0.03
    assert dict(out[0].vector)["us-2"] == pytest.approx(999.0 - 20.0 + 4_000.0)  # drained 20 ms, then charged
    assert not q.urgent and q.due_broadcasts(now=0.04) == ()
    assert q.next_deadline(now=0.04) == pytest.approx(0.13)  # Delta counts from the urgent send
    # Quiet (heartbeat) mode too: the vector changed, so it goes out, not marked steady.
    for k in range(1, 12):
        q.due_broadcasts(now=0.03 + k * 0.1, heartbeat_s=1.0)
    q.note_dispatched("us-5", 2_500.0, now=1.2)
    out = q.due_broadcasts(now=1.2, heartbeat_s=1.0)
    assert {b.to_region for b in out} == {"eu", "asia"} and not any(b.steady for b in out)


def test_a_long_dispatch_abroad_or_with_urgency_off_waits_for_delta() -> None:
    q = us_edge()
    q.due_broadcasts(now=0.0)
    q.note_dispatched("eu-0", 50_000.0, now=0.01)  # another region's worker: its edges speak for it
    assert not q.urgent and q.due_broadcasts(now=0.02) == ()
    off = dataclasses.replace(CFG, score=dataclasses.replace(CFG.score, urgent_broadcast_ms=0.0))
    q = QueueEstimates(off, "us", now=0.0)
    q.due_broadcasts(now=0.0)
    q.note_dispatched("us-0", 50_000.0, now=0.01)
    assert not q.urgent and q.due_broadcasts(now=0.02) == ()
    with pytest.raises(ValueError, match="urgent_broadcast_ms"):
        dataclasses.replace(CFG.score, urgent_broadcast_ms=-1.0)



def _steps() -> st.SearchStrategy:
    """Room steps as the wire takes them: (ms, free tokens) pairs, both non-decreasing."""
    pairs = st.lists(st.tuples(st.integers(0, 3_000), st.integers(0, 100_000)), max_size=3)
    return pairs.map(lambda ps: tuple(zip(sorted(float(m) for m, _ in ps), sorted(f for _, f in ps))))


_ROOM_OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.sampled_from([w for w in CFG.worker_ids() if w.startswith("us-")]), _steps()),
    st.tuples(st.just("broadcast"), st.sampled_from(["eu", "asia"]), st.integers(0, 6),
              st.lists(st.tuples(st.integers(0, 3), _steps()), max_size=3))), max_size=25)


@settings(max_examples=150, deadline=None)
@given(_ROOM_OPS)
def test_the_rooms_kept_per_region_read_as_one_table_of_every_worker_would(ops) -> None:
    """Room steps are kept per region (a region's broadcast replaces only its own entries) and
    the floor and listed workers made when read: every read equals a plain table of every
    worker's steps, replaced as the broadcasts and readings come (stale broadcasts ignored); an
    edge given another edge's ``room_updates`` (``updates=``) ends in the same state."""
    ids = CFG.worker_ids()
    q, given_checked = us_edge(), us_edge()
    other = QueueEstimates(CFG, "eu", now=0.0)  # checks what asia sends for the one given them
    table: dict[int, tuple[float, tuple[float, ...], tuple[int, ...]]] = {}
    last = {"eu": -math.inf, "asia": -math.inf}
    for k, op in enumerate(ops):
        now = 1.0 + k
        if op[0] == "set":
            _, worker, steps = op
            for edge in (q, given_checked):
                edge.set_room(worker, steps, now=now)
            if steps:
                table[ids.index(worker)] = (now, tuple(m for m, _ in steps), tuple(f for _, f in steps))
            else:
                table.pop(ids.index(worker), None)
        else:
            _, region, sent_at, listed = op
            workers = [w for w in ids if w.startswith(region + "-")]
            rooms = tuple({workers[n % len(workers)]: steps for n, steps in listed}.items())
            msg = RoomVectorBroadcast(region, "us", float(sent_at), rooms)
            checker = other if region == "asia" else QueueEstimates(CFG, "asia", now=0.0)
            updates = checker.room_updates(region, msg.rooms)
            fresh = q.on_room_broadcast(msg, now=now)
            assert given_checked.on_room_broadcast(msg, now=now, updates=updates) == fresh
            assert fresh == (sent_at > last[region])
            if fresh:
                last[region] = sent_at
                read_at = now - CFG.one_way_ms("us", region) / 1000.0
                for i in [i for i in table if ids[i].startswith(region + "-")]:
                    del table[i]
                for worker, steps in rooms:
                    if steps:
                        table[ids.index(worker)] = (read_at, tuple(m for m, _ in steps), tuple(f for _, f in steps))
        for edge in (q, given_checked):
            assert edge.room_workers == tuple(sorted(table))
            assert edge.room_floor == min((r[2][0] for r in table.values()), default=math.inf)
            for i in range(len(ids)):
                expected = None if i not in table else table[i]
                got = edge.room(i, now=now)
                assert (got is None) == (expected is None)
                assert edge.room_wait_ms(i, 50_000, now=now) == q.room_wait_ms(i, 50_000, now=now)
            assert edge.local_rooms(now=now) == tuple(
                (ids[i], edge.room(i, now=now)) for i in sorted(table)
                if ids[i].startswith("us-") and len(edge.room(i, now=now)) > 1)
