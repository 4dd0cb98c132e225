"""The agent's load-poll schedule (``kvcompassd.pacing.LoadPollSchedule``): fast while the
engine works, backing off to the heartbeat period while it sits idle, a reading at once on any
sign of work (and the fast period again only if that reading shows work)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd.pacing import LoadPollSchedule, LoadReports


def test_an_idle_unchanged_engine_is_read_ever_less_often_up_to_the_idle_period():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=0.1)
    delays = []
    for _ in range(5):
        schedule.observed(changed=False, busy=False)
        delays.append(schedule.delay_s)
    assert delays == [0.04, 0.08, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("event", ["changed", "busy", "failed"])
def test_a_reading_that_shows_work_or_trouble_brings_the_fast_period_back(event):
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=0.1)
    for _ in range(4):
        schedule.observed(changed=False, busy=False)
    assert schedule.delay_s == 0.1 and schedule.backed_off
    if event == "failed":
        schedule.failed()
    else:
        schedule.observed(changed=event == "changed", busy=event == "busy")
    assert schedule.delay_s == 0.02 and not schedule.backed_off


def test_a_sign_of_work_brings_a_reading_a_fast_period_after_the_previous_one_at_the_earliest():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=1.0)
    assert schedule.wake_delay(0.5) == 0.0  # long since the last reading: at once
    assert schedule.wake_delay(0.02) == 0.0
    assert schedule.wake_delay(0.005) == pytest.approx(0.015)  # right after one: a fast period after it


def test_nonsense_periods_are_refused():
    for busy, idle in ((0.0, 0.1), (0.2, 0.1), (-1.0, 1.0)):
        with pytest.raises(ValueError):
            LoadPollSchedule(busy_s=busy, idle_s=idle)


@given(st.floats(1e-3, 1.0), st.floats(1.0, 100.0),
       st.lists(st.sampled_from(["idle", "changed", "busy", "failed"]), max_size=60))
def test_the_delay_stays_between_the_two_periods(busy, factor, steps):
    schedule = LoadPollSchedule(busy_s=busy, idle_s=busy * factor)
    idle_run = 0
    for step in steps:
        if step == "failed":
            schedule.failed()
        else:
            schedule.observed(changed=step == "changed", busy=step == "busy")
        idle_run = idle_run + 1 if step == "idle" else 0
        assert busy <= schedule.delay_s <= busy * factor
        assert schedule.delay_s == pytest.approx(min(busy * factor, busy * 2 ** idle_run))


def _reports() -> LoadReports:
    return LoadReports(heartbeat_s=1.0, steady_repeats=2, stall_s=0.3)


def test_an_unchanged_reading_goes_twice_more_then_once_per_heartbeat():
    reports, sent = _reports(), []
    for i in range(40):  # one reading every 0.1 s, always the same
        now = i * 0.1
        changed, send, resumed = reports.reading((0.0, 0, 0), started=now - 0.001, now=now)
        assert changed == (i == 0) and not resumed
        if send:
            sent.append(round(now, 1))
    assert sent == [0.0, 0.1, 0.2, 1.2, 2.2, 3.2]


def test_a_changed_reading_goes_at_once():
    reports = _reports()
    for i in range(5):
        reports.reading((0.0, 0, 0), started=i * 0.1, now=i * 0.1)
    assert reports.reading((5.0, 1, 0), started=0.5, now=0.5) == (True, True, False)


def test_the_first_reading_after_a_stall_or_a_failure_goes_at_once_marked_resumed():
    # Idle, an agent reports once a second: a one-second freeze of its engine is no longer a
    # silence the edge can see, so the agent says so.
    reports = _reports()
    for i in range(5):
        reports.reading((0.0, 0, 0), started=i * 0.1, now=i * 0.1)
    assert reports.reading((0.0, 0, 0), started=0.5, now=0.5 + 1.2) == (False, True, True)  # it hung 1.2 s
    assert reports.reading((0.0, 0, 0), started=1.8, now=1.801)[2] is False  # answered promptly again
    reports.failed()
    assert reports.reading((0.0, 0, 0), started=2.0, now=2.001) == (False, True, True)
    assert reports.reading((0.0, 0, 0), started=2.1, now=2.101)[2] is False


def test_load_reports_refuse_nonsense_settings():
    for bad in ({"heartbeat_s": 0.0}, {"stall_s": -1.0}, {"steady_repeats": -1}):
        with pytest.raises(ValueError):
            LoadReports(**{"heartbeat_s": 1.0, "steady_repeats": 2, "stall_s": 0.3, **bad})


def test_the_first_reading_after_an_edge_joined_goes_even_unchanged():
    reports = _reports()
    for i in range(10):
        reports.reading((0.0, 0, 0), started=i * 0.1, now=i * 0.1)
    assert reports.reading((0.0, 0, 0), started=1.0, now=1.0)[1] is False  # steady, within the heartbeat
    reports.listener_joined()
    assert reports.reading((0.0, 0, 0), started=1.05, now=1.05) == (False, True, False)
    assert reports.reading((0.0, 0, 0), started=1.1, now=1.1)[1] is False


def test_a_sign_of_work_done_brings_a_reading_its_spacing_after_the_previous_one_at_the_earliest():
    """KV events (work the engine did) wake the reader no sooner than done_spacing_s after the
    previous reading; work arriving, a fast period after it; long after a reading, both at once."""
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=1.0, done_spacing_s=0.1)
    assert schedule.wake_delay(0.5, done=True) == 0.0  # the first sign after a quiet spell: at once
    assert schedule.wake_delay(0.03, done=True) == pytest.approx(0.07)
    assert schedule.wake_delay(0.03) == 0.0
    assert schedule.wake_delay(0.005) == pytest.approx(0.015)
    assert LoadPollSchedule(busy_s=0.02, idle_s=1.0).wake_delay(0.005, done=True) == pytest.approx(0.015)
    for busy, done, idle in ((0.02, 0.01, 1.0), (0.02, 2.0, 1.0)):
        with pytest.raises(ValueError):
            LoadPollSchedule(busy_s=busy, idle_s=idle, done_spacing_s=done)
