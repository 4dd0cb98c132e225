"""The agent's load-poll schedule (``kvcompassd.pacing.LoadPollSchedule``): fast while the
engine works, backing off to the heartbeat period while it sits idle, a reading at once on any
sign of work (and the fast period again only if that reading shows work)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.agent import load_tolerance
from kvcompassd.core.config import load_config
from kvcompassd.core.queues import QueueEstimates
from kvcompassd.engine.client import EngineLoad, parse_loads
from kvcompassd.pacing import (READING_PERIOD_REASONS, TIGHT_POOL_SHARE, LoadPollSchedule, LoadReports,
                               LoadTolerance, ReadingCadence, VectorInterest)

CFG = load_config(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml")


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
    assert schedule.delay_s == 0.1 and schedule.hastens()
    if event == "failed":
        schedule.failed()
    else:
        schedule.observed(changed=event == "changed", busy=event == "busy")
    assert schedule.delay_s == 0.02 and not schedule.hastens()


def test_a_sign_of_work_brings_a_reading_a_fast_period_after_the_previous_one_at_the_earliest():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=1.0)
    assert schedule.wake_delay(0.5) == 0.0  # long since the last reading: at once
    assert schedule.wake_delay(0.02) == 0.0
    assert schedule.wake_delay(0.005) == pytest.approx(0.015)  # right after one: a fast period after it


def test_a_busy_engine_is_read_at_the_period_its_reading_asks_for_within_the_two_periods():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=1.0)
    schedule.observed(changed=True, busy=True, period_s=0.1)
    assert schedule.delay_s == 0.1 and schedule.hastens()  # (a sign of work still brings a reading sooner)
    schedule.observed(changed=False, busy=True, period_s=5.0)
    assert schedule.delay_s == 1.0
    schedule.observed(changed=False, busy=True, period_s=0.0)
    assert schedule.delay_s == 0.02
    schedule.observed(changed=False, busy=False, period_s=0.1)  # idle: the doubling, whatever the period
    assert schedule.delay_s == 0.04


def test_a_sign_of_work_done_wakes_the_reader_only_if_it_can_bring_the_reading_sooner():
    schedule = LoadPollSchedule(busy_s=0.02, idle_s=1.0, done_spacing_s=0.1)
    schedule.observed(changed=True, busy=True)
    assert not schedule.hastens() and not schedule.hastens(done=True)  # fast: the next reading is due anyway
    schedule.observed(changed=True, busy=True, period_s=0.1)  # the sole-edge period
    assert schedule.hastens() and not schedule.hastens(done=True)
    for _ in range(3):
        schedule.observed(changed=False, busy=False)
    assert schedule.delay_s == 0.8 and schedule.hastens() and schedule.hastens(done=True)


@pytest.mark.parametrize(("edges", "remote", "share", "decode", "why"), [
    (1, False, 0.2, False, "one_edge"),
    (0, False, 0.2, False, "one_edge"),  # (no edge connected: nobody reads the reports anyway)
    (2, False, 0.2, False, "several_edges"),
    (1, True, 0.2, False, "other_regions"),
    (1, False, None, False, "pool_unreported"),
    (1, False, TIGHT_POOL_SHARE, False, "memory_bound"),
    (1, False, 0.2, True, "decode_worker"),
])
def test_readings_are_slow_only_while_one_edge_sends_all_the_work_and_its_model_is_enough(
        edges, remote, share, decode, why):
    cadence = ReadingCadence(fast_s=0.02, sole_s=0.1)
    period, reason = cadence.period(edges=edges, remote=remote, pool_share=share, decode=decode)
    assert reason == why
    assert period == (0.1 if why == "one_edge" else 0.02)


@pytest.mark.parametrize(("answer", "why"), [("sglang-two-ranks.json", "one_edge"),
                                             ("sglang-memory-bound.json", "memory_bound")])
def test_what_sglangs_own_load_answers_say_of_its_pool_sets_the_period(answer, why):
    """The pool's share as SGLang's /v1/loads handler gives it (tests/data/engine_loads: 80,000
    of 200,000 tokens held over two ranks; 90,000 of 100,000 on one), through the agent's parser."""
    data = json.loads((Path(__file__).parent / "data" / "engine_loads" / answer).read_bytes())
    load = parse_loads(data, prefill_ms_per_token=0.085)
    assert load.running > 0  # (busy: the period applies)
    assert ReadingCadence(fast_s=0.02, sole_s=0.1).period(edges=1, remote=False, pool_share=load.pinned_share)[1] == why


@given(st.integers(0, 5), st.booleans(), st.one_of(st.none(), st.floats(0.0, 1.0)), st.booleans())
def test_the_sole_period_needs_every_condition(edges, remote, share, decode):
    period, why = ReadingCadence(fast_s=0.02, sole_s=0.1).period(edges=edges, remote=remote, pool_share=share,
                                                                 decode=decode)
    assert why in READING_PERIOD_REASONS  # (the agent's metric has a child for each, made at start)
    sole = edges <= 1 and not remote and share is not None and share < TIGHT_POOL_SHARE and not decode
    assert period == (0.1 if sole else 0.02)


def test_a_cadence_whose_sole_period_is_below_the_fast_one_or_endless_is_refused():
    for fast, sole in ((0.0, 0.1), (0.1, 0.02), (0.02, math.inf)):
        with pytest.raises(ValueError):
            ReadingCadence(fast_s=fast, sole_s=sole)


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


def _measured(**others) -> LoadTolerance:
    """The tolerance measured in issue 30's gateway runs (off by default): 2 ms or 2 %."""
    return LoadTolerance(queue_ms=2.0, queue_share=0.02, **others)


def _reports(tolerance: LoadTolerance = _measured()) -> LoadReports:
    return LoadReports(heartbeat_s=1.0, steady_repeats=2, stall_s=0.3, tolerance=tolerance)


def _load(queue_ms: float = 0.0, running: int = 0, waiting: int = 0, room=None, pinned=None) -> EngineLoad:
    return EngineLoad(running, waiting, 0, queue_ms, room, pinned)


IDLE = _load()


def test_an_unchanged_reading_goes_twice_more_then_once_per_heartbeat():
    reports, sent = _reports(), []
    for i in range(40):  # one reading every 0.1 s, always the same
        now = i * 0.1
        changed, send, resumed = reports.reading(IDLE, started=now - 0.001, now=now)
        assert changed == (i == 0) and not resumed
        if send:
            sent.append(round(now, 1))
    assert sent == [0.0, 0.1, 0.2, 1.2, 2.2, 3.2]


def test_a_changed_reading_goes_at_once():
    reports = _reports()
    for i in range(5):
        reports.reading(IDLE, started=i * 0.1, now=i * 0.1)
    assert reports.reading(_load(5.0, 1), started=0.5, now=0.5) == (True, True, False)


def test_the_first_reading_after_a_stall_or_a_failure_goes_at_once_marked_resumed():
    # Idle, an agent reports once a second: a one-second freeze of its engine is no longer a
    # silence the edge can see, so the agent says so.
    reports = _reports()
    for i in range(5):
        reports.reading(IDLE, started=i * 0.1, now=i * 0.1)
    assert reports.reading(IDLE, started=0.5, now=0.5 + 1.2) == (False, True, True)  # it hung 1.2 s
    assert reports.reading(IDLE, started=1.8, now=1.801)[2] is False  # answered promptly again
    reports.failed()
    assert reports.reading(IDLE, started=2.0, now=2.001) == (False, True, True)
    assert reports.reading(IDLE, started=2.1, now=2.101)[2] is False


def test_load_reports_refuse_nonsense_settings():
    for bad in ({"heartbeat_s": 0.0}, {"stall_s": -1.0}, {"steady_repeats": -1}):
        with pytest.raises(ValueError):
            LoadReports(**{"heartbeat_s": 1.0, "steady_repeats": 2, "stall_s": 0.3, **bad})


def test_the_first_reading_after_an_edge_joined_goes_even_unchanged():
    reports = _reports()
    for i in range(10):
        reports.reading(IDLE, started=i * 0.1, now=i * 0.1)
    assert reports.reading(IDLE, started=1.0, now=1.0)[1] is False  # steady, within the heartbeat
    reports.listener_joined()
    assert reports.reading(IDLE, started=1.05, now=1.05) == (False, True, False)
    assert reports.reading(IDLE, started=1.1, now=1.1)[1] is False


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


# -- what a busy engine's readings are worth sending ------------------------------------------


def test_a_draining_queue_is_not_sent_again_until_work_arrives_or_a_heartbeat_passes():
    """Read every 20 ms, a queue that drains at one ms per ms (as the edges age it) tells them
    nothing new: only the reading after an arrival goes, and one per heartbeat."""
    reports, sent = _reports(), []
    for i in range(120):
        now = i * 0.02
        arrived = 40.0 if i >= 30 else 0.0
        queue = max(0.0, 2000.0 - 1000.0 * now + arrived + (0.5 if i % 2 else -0.5))  # half a ms of noise
        if reports.reading(_load(queue, 17), started=now - 0.001, now=now)[1]:
            sent.append(i)
    # The first, the arrival, a heartbeat after it; the queue reaching zero, and twice more.
    assert sent == [0, 30, 80, 102, 103, 104]


def test_a_queue_or_a_running_count_reaching_zero_goes_at_once():
    """An edge tells an idle worker by the zeros it is sent (persistent idleness picks where hot
    prefixes migrate to), so reaching zero goes even where aging predicted it."""
    tolerance = _measured(occupancy_ms_per_running=0.25)
    assert tolerance.material(_load(30.0, 3), _load(0.0, 3), 40.0)  # aged to 0 too: still news
    assert tolerance.material(_load(0.0, 1), _load(0.0, 0), 20.0)  # 0.25 ms of occupancy: still news
    assert not tolerance.material(_load(0.0, 0), _load(1.0, 1), 20.0)  # leaving zero: by the tolerance


def test_the_running_count_matters_as_much_as_the_score_charges_for_it():
    occupancy = _measured(occupancy_ms_per_running=0.25)
    sent = _load(0.0, 17)
    assert not occupancy.material(sent, _load(0.0, 20), 20.0)  # 0.75 ms of occupancy
    assert occupancy.material(sent, _load(0.0, 26), 20.0)  # 2.25 ms
    stalls = _measured(occupancy_ms_per_running=0.25, stall_weight=0.25)
    assert stalls.material(_load(0.0, 1), _load(0.0, 2), 20.0)  # the prefill's price: x1.25 -> x1.5
    assert not stalls.material(_load(0.0, 10), _load(0.0, 11), 20.0)  # x2 either way
    decode = _measured(occupancy_ms_per_running=0.25, counts_exact=True)  # edges compare the counts
    assert decode.material(sent, _load(0.0, 18), 20.0) and decode.material(sent, _load(0.0, 17, 1), 20.0)
    assert not decode.material(sent, _load(0.0, 17), 20.0)


def test_room_steps_and_the_pinned_share_go_when_a_prompts_wait_for_room_moves():
    tolerance = _measured()
    sent = _load(100.0, 2, room=((0.0, 1000), (50.0, 4000)))

    def moved(room, elapsed=20.0):
        return tolerance.material(sent, _load(100.0 - elapsed, 2, room=room), elapsed)

    assert not moved(((0.0, 1000), (30.0, 4000)))  # aged as the edge ages it
    assert not moved(((0.0, 1000), (31.0, 4000)))  # within 2 ms
    assert moved(((0.0, 1000), (60.0, 4000)))  # the decode ahead slowed down
    assert moved(((0.0, 900), (30.0, 4000)))  # an arrival pinned 100 tokens: they now wait 30 ms
    assert moved(((0.0, 1000), (30.0, 4000), (80.0, 8000)))  # a larger prompt now waits 80 ms, not 30
    assert moved(None) and moved(())  # the engine stopped telling, or nothing is pinned any more
    assert moved(((0.0, 1000), (50.0, 4000)))  # unchanged for 20 ms: it did not drain
    pinned = _load(0.0, 0, pinned=0.5)
    assert not tolerance.material(pinned, _load(0.0, 0, pinned=0.51), 20.0)
    assert tolerance.material(pinned, _load(0.0, 0, pinned=0.53), 20.0)
    assert tolerance.material(pinned, _load(0.0, 0), 20.0)


def test_load_tolerances_refuse_nonsense():
    for bad in ({"queue_ms": -1.0}, {"queue_share": 1.0}, {"occupancy_ms_per_running": float("nan")},
                {"stall_weight": float("inf")}, {"queue_ms": True}, {"queue_share": "0.1"}):
        with pytest.raises(ValueError):
            LoadTolerance(**bad)


def _wait_for_room(room, need: float) -> float:
    """What a prompt needing ``need`` tokens waits by room steps: the first with room, else the last."""
    if not room or need <= room[0][1]:
        return 0.0
    return next((ms for ms, free in room if free >= need), room[-1][0])


def _room_steps(draw, base=None, gap_ms=0.0):
    """Room steps (first at 0 ms, both non-decreasing): fresh, or ``base`` aged ``gap_ms`` and nudged."""
    if base is None or draw(st.booleans()):
        k = draw(st.integers(0, 5))
        ms = [0.0] + [draw(st.floats(0.0, 300.0)) for _ in range(k - 1)]
        free = [draw(st.integers(0, 8000)) for _ in range(k)]
    else:
        ms = [max(0.0, m - gap_ms) + draw(st.floats(-3.0, 3.0)) for m, _ in base]
        free = [f for _, f in base]
        if ms:
            ms[0] = 0.0
    ms = [max(0.0, m) for m in ms]
    for i in range(1, len(ms)):
        ms[i] = max(ms[i], ms[i - 1])
    return tuple(zip(ms, sorted(free)))


@st.composite
def _busy_readings(draw):
    """Readings of a busy engine: mostly the last one drained (what the edges predict) with
    noise, sometimes a jump."""
    readings, queue, running, room = [], 0.0, 0, ()
    for _ in range(draw(st.integers(1, 40))):
        gap_ms = draw(st.floats(1.0, 60.0))
        if draw(st.booleans()):
            queue = max(0.0, queue - gap_ms + draw(st.floats(-4.0, 4.0)))
            running = max(0, running + draw(st.integers(-3, 3)))
            room = _room_steps(draw, room, gap_ms)
        else:
            queue, running, room = draw(st.floats(0.0, 3000.0)), draw(st.integers(0, 64)), _room_steps(draw)
        readings.append((gap_ms, queue, running, room))
    return readings


@settings(max_examples=300, deadline=None)
@given(_busy_readings())
def test_what_an_edge_holds_of_a_reading_not_sent_is_within_the_tolerance(readings):
    """The edge's own aging (``QueueEstimates``, as the daemons run it) of the last reading sent
    stays within the tolerance of every reading the agent kept back: its queue (plus the score's
    occupancy term) and a prompt's wait for room at every size."""
    worker = next(w for w in CFG.workers if w.region == "us")
    cfg = dataclasses.replace(CFG, idle=dataclasses.replace(CFG.idle, load_tolerance_ms=2.0, load_tolerance_share=0.02))
    tolerance = load_tolerance(cfg, worker)
    assert tolerance.occupancy_ms_per_running == CFG.score.occupancy_ms_per_running > 0
    index = CFG.worker_ids().index(worker.id)
    queues = QueueEstimates(CFG, "us", now=0.0)
    reports = LoadReports(heartbeat_s=1.0, steady_repeats=2, tolerance=tolerance)
    now, kept_back = 0.0, 0
    for gap_ms, queue, running, room in readings:
        now += gap_ms / 1000.0
        if reports.reading(_load(queue, running, room=room), started=now, now=now)[1]:
            queues.set_local(worker.id, queue, now=now, running=running)
            queues.set_room(worker.id, room, now=now)
            continue
        kept_back += 1

        def bound(a: float, b: float) -> float:
            return max(tolerance.queue_ms, tolerance.queue_share * max(a, b)) + 1e-9

        held = queues.queue_ms(now=now).item(index)
        occupancy = tolerance.occupancy_ms_per_running
        truth = queue + occupancy * running
        assert abs(held - truth) <= bound(held - occupancy * queues.running.item(index), queue) + tolerance.queue_ms
        for need in (1, 500, 1000, 2500, 4000, 8000, 10**6, *(free for _, free in room)):
            edge_wait, wait = queues.room_wait_ms(index, need, now=now), _wait_for_room(room, need)
            assert abs(edge_wait - wait) <= bound(edge_wait, wait)


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 5.0]), st.integers(0, 2)), min_size=1, max_size=30))
def test_without_tolerance_every_change_goes_as_before(steps):
    """Both tolerances 0: a reading goes when it differs from the last one sent, an unchanged one
    twice more, then once a heartbeat (the behaviour before tolerances)."""
    reports, last, unchanged, last_sent, now = _reports(LoadTolerance(queue_ms=0.0, queue_share=0.0)), None, 0, -1e9, 0.0
    for gap, queue, running in steps:
        now += gap * 0.4
        reading = (queue, running, 0)
        changed = reading != last
        unchanged = 0 if changed else unchanged + 1
        expected = changed or unchanged <= 2 or now - last_sent >= 1.0
        assert reports.reading(_load(queue, running), started=now, now=now)[1] == expected
        if expected:
            last, last_sent = reading, now


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_room_steps_of_the_same_levels_are_compared_as_at_every_size(data):
    """Steps with the free levels of the ones sent (the usual reading) take a shortcut: it
    answers as comparing the waits at every prompt size does."""
    sent = data.draw(st.builds(lambda k: k, st.integers(1, 6)).flatmap(
        lambda k: st.tuples(*[st.tuples(st.floats(0.0, 300.0), st.sampled_from([0, 1000, 2000]) | st.integers(0, 3000))] * k)))
    sent = tuple(zip(sorted(ms for ms, _ in sent), sorted(free for _, free in sent)))
    steps = tuple((max(0.0, ms + data.draw(st.floats(-10.0, 10.0))), free) for ms, free in sent)
    steps = tuple((max(ms, max((m for m, _ in steps[:i]), default=0.0)), free) for i, (ms, free) in enumerate(steps))
    elapsed = data.draw(st.floats(0.0, 50.0))
    tolerance = _measured()

    def moved_at_some_size() -> bool:
        for need in (*(free for _, free in sent), 10**9):
            was, now = _wait_for_room(sent, need), _wait_for_room(steps, need)
            if abs(max(0.0, was - elapsed) - now) > max(tolerance.queue_ms,
                                                        tolerance.queue_share * max(max(0.0, was - elapsed), now)):
                return True
        return False

    assert tolerance._room_moved(sent, steps, elapsed) == moved_at_some_size()


def test_an_agent_wants_the_queue_vector_from_its_first_remote_request_until_they_have_lingered_out():
    interest = VectorInterest(linger_s=10.0, fresh_s=1.2)
    assert not interest.wanted and not interest.lapsed(now=0.0)
    assert interest.remote_started(now=1.0)  # say "wanted", once
    assert not interest.remote_started(now=2.0) and interest.wanted
    interest.remote_ended(now=3.0)
    assert not interest.lapsed(now=100.0)  # one still runs: however long, it still wants it
    interest.remote_ended(now=104.0)
    assert not interest.lapsed(now=113.9)
    assert interest.lapsed(now=114.0) and not interest.wanted  # say "not wanted", once
    assert not interest.lapsed(now=200.0)
    assert interest.remote_started(now=201.0)
    interest.remote_ended(now=201.5)
    interest.remote_ended(now=201.6)  # (an extra end does not go below none in flight)
    assert interest.remote_started(now=202.0) is False and interest.wanted


def test_a_queue_vector_is_fresh_for_its_window_and_never_before_one_arrived():
    interest = VectorInterest(linger_s=10.0, fresh_s=1.2)
    assert not interest.fresh(now=0.0) and interest.age_s(now=0.0) is None
    interest.vector_received(now=5.0)
    assert interest.fresh(now=6.1) and not interest.fresh(now=6.3)
    assert interest.age_s(now=6.0) == 1.0
    interest.vector_received(now=4.0)  # (an older arrival time never moves it back)
    assert interest.age_s(now=6.0) == 1.0
    for bad in ({"linger_s": 0.0, "fresh_s": 1.0}, {"linger_s": 1.0, "fresh_s": float("inf")}):
        with pytest.raises(ValueError):
            VectorInterest(**bad)
