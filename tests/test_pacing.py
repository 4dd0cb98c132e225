"""The agent's load-poll schedule (``kvcompassd.pacing.LoadPollSchedule``): fast while the
engine works, backing off to the heartbeat period while it sits idle, fast again at once on
any sign of work."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd.pacing import LoadPollSchedule


def test_an_idle_unchanged_engine_is_read_ever_less_often_up_to_the_idle_period():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=0.1)
    delays = []
    for _ in range(5):
        schedule.observed(changed=False, busy=False)
        delays.append(schedule.delay_s)
    assert delays == [0.04, 0.08, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("event", ["changed", "busy", "woken", "failed"])
def test_any_sign_of_work_or_trouble_brings_the_fast_period_back(event):
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=0.1)
    for _ in range(4):
        schedule.observed(changed=False, busy=False)
    assert schedule.delay_s == 0.1
    if event == "woken":
        schedule.woken()
    elif event == "failed":
        schedule.failed()
    else:
        schedule.observed(changed=event == "changed", busy=event == "busy")
    assert schedule.delay_s == 0.02


def test_nonsense_periods_are_refused():
    for busy, idle in ((0.0, 0.1), (0.2, 0.1), (-1.0, 1.0)):
        with pytest.raises(ValueError):
            LoadPollSchedule(busy_s=busy, idle_s=idle)


@given(st.floats(1e-3, 1.0), st.floats(1.0, 100.0),
       st.lists(st.sampled_from(["idle", "changed", "busy", "woken", "failed"]), max_size=60))
def test_the_delay_stays_between_the_two_periods(busy, factor, steps):
    schedule = LoadPollSchedule(busy_s=busy, idle_s=busy * factor)
    idle_run = 0
    for step in steps:
        if step == "woken":
            schedule.woken()
        elif step == "failed":
            schedule.failed()
        else:
            schedule.observed(changed=step == "changed", busy=step == "busy")
        idle_run = idle_run + 1 if step == "idle" else 0
        assert busy <= schedule.delay_s <= busy * factor
        assert schedule.delay_s == pytest.approx(min(busy * factor, busy * 2 ** idle_run))
