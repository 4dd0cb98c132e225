"""Worker timing model: exact event times, FIFO and slots, prefill-first, batch-dependent decode."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_cache import CacheOwner
from kvcompassd.worker.workermodel import (
    FirstTokenProduced,
    PinnedPaths,
    RequestFinished,
    WorkerModelError,
    WorkerQueueModel,
    WorkerTiming,
)

SIMPLE = WorkerTiming(prefill_ms_per_token=0.1, reload_ms_per_token=0.01, decode_ms_per_token=10.0,
                      decode_batch_slope=0.0, max_running=4)


def drain(model: WorkerQueueModel) -> list:
    """Drive the model only at the times it asks for."""
    out = []
    while (t := model.next_event_time()) is not None:
        out += model.advance(now=t)
    return out


def test_calibration_defaults() -> None:
    timing = WorkerTiming()
    assert timing.prefill_ms(1000) == pytest.approx(85.0)
    assert timing.reload_ms_per_token == pytest.approx(131072 / 25e9 * 1000, rel=1e-3)
    assert timing.decode_step_ms(1) == 12.0
    assert 19.0 < timing.decode_step_ms(64) < 20.0


def test_single_request_times_with_cache_tiers() -> None:
    model = WorkerQueueModel(SIMPLE)
    model.admit("a", 1000, cached_vram=400, cached_dram=100, output_tokens=3, now=0.0)
    assert model.running == 1 and model.pending_prefill_tokens == 500
    events = drain(model)
    prefill = (500 * 0.1 + 100 * 0.01) / 1000
    assert events == [FirstTokenProduced("a", pytest.approx(prefill)), RequestFinished("a", pytest.approx(prefill + 0.020))]
    assert model.running == 0 and model.next_event_time() is None


def test_fifo_and_slot_limit() -> None:
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=1)
    model = WorkerQueueModel(timing)
    model.admit("a", 10, 0, 0, 2, now=0.0)
    model.admit("b", 10, 0, 0, 1, now=0.0)
    assert (model.running, model.waiting) == (1, 1)
    assert model.queue_ms(now=0.0) == pytest.approx(30.0)  # a: 10 ms prefill + 10 ms decode, then b 10 ms
    events = drain(model)
    assert [(type(e).__name__, e.request_id, round(e.at, 6)) for e in events] == [
        ("FirstTokenProduced", "a", 0.01), ("RequestFinished", "a", 0.02),
        ("FirstTokenProduced", "b", 0.03), ("RequestFinished", "b", 0.03),
    ]


def test_prefill_pauses_decoding_and_batch_slows_steps() -> None:
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.5, max_running=8)
    model = WorkerQueueModel(timing)
    model.admit("a", 5, 0, 0, 11, now=0.0)     # first token at 5 ms, then 10 steps
    model.advance(now=0.025)                   # 2 tokens decoded alone (10 ms each)
    model.admit("b", 5, 0, 0, 2, now=0.025)    # prefill 25..30 ms pauses a
    events = drain(model)
    # from 30 ms both decode with 15 ms steps; b needs 1 token -> 45 ms; a had 8 left, 1 done by 45
    # then alone again: 7 tokens * 10 ms -> 115 ms
    times = {(type(e).__name__, e.request_id): round(e.at * 1000, 6) for e in events}
    assert times[("FirstTokenProduced", "b")] == 30.0
    assert times[("RequestFinished", "b")] == 45.0
    assert times[("RequestFinished", "a")] == 115.0


def test_errors() -> None:
    model = WorkerQueueModel(SIMPLE)
    model.admit("a", 10, 0, 0, 1, now=1.0)
    with pytest.raises(WorkerModelError, match="already"):
        model.admit("a", 10, 0, 0, 1, now=1.0)
    with pytest.raises(WorkerModelError, match="backwards"):
        model.advance(now=0.5)
    with pytest.raises(WorkerModelError):
        model.admit("b", 10, 8, 8, 1, now=1.0)
    with pytest.raises(WorkerModelError):
        model.admit("c", 10, 0, 0, 0, now=1.0)
    with pytest.raises(WorkerModelError):
        WorkerTiming(max_running=0)
    with pytest.raises(WorkerModelError):
        WorkerTiming(prefill_ms_per_token=float("nan"))


arrivals = st.lists(
    st.tuples(st.floats(0, 0.5), st.integers(1, 3000), st.integers(0, 100), st.integers(1, 30)),
    min_size=1, max_size=25,
)


@settings(max_examples=80, deadline=None)
@given(arrivals, st.integers(1, 5), st.lists(st.floats(0, 2.0), max_size=20))
def test_results_do_not_depend_on_how_often_the_shell_looks(reqs, max_running, probes) -> None:
    timing = WorkerTiming(max_running=max_running)

    def run(probe_times: list[float]) -> list:
        model = WorkerQueueModel(timing)
        schedule = sorted([(t, 0, i) for i, (t, *_rest) in enumerate(sorted(reqs))] + [(p, 1, -1) for p in probe_times])
        out = []
        for t, kind, i in schedule:
            if kind == 0:
                _, prompt, cached, output = sorted(reqs)[i]
                model.admit(f"r{i}", prompt, min(cached, prompt), 0, output, now=t)
            else:
                out += model.advance(now=t)
                model.queue_ms(now=t)
        return out + drain(model)

    baseline = run([])
    probed = run(probes)
    assert [(type(e), e.request_id) for e in baseline] == [(type(e), e.request_id) for e in probed]
    assert [e.at for e in baseline] == pytest.approx([e.at for e in probed], abs=1e-9)
    firsts = {e.request_id: e.at for e in baseline if isinstance(e, FirstTokenProduced)}
    finished = {e.request_id: e.at for e in baseline if isinstance(e, RequestFinished)}
    assert firsts.keys() == finished.keys() == {f"r{i}" for i in range(len(reqs))}
    assert all(finished[r] >= firsts[r] for r in firsts)
    assert [e.at for e in baseline] == sorted(e.at for e in baseline)
    # FIFO: first tokens come in arrival order (prefills are serial)
    order = [e.request_id for e in baseline if isinstance(e, FirstTokenProduced)]
    assert order == [f"r{i}" for i in range(len(reqs))]


@settings(max_examples=80, deadline=None)
@given(arrivals, st.integers(1, 4), st.floats(0, 0.6), st.integers(1, 2000))
def test_queue_ms_is_the_exact_wait_of_the_next_arrival(reqs, max_running, at, prompt) -> None:
    model = WorkerQueueModel(WorkerTiming(max_running=max_running))
    for i, (t, p, cached, output) in enumerate(sorted(reqs)):
        model.admit(f"r{i}", p, min(cached, p), 0, output, now=t)
    now = max(at, model.now)
    wait_ms = model.queue_ms(now=now)
    model.admit("new", prompt, 0, 0, 1, now=now)
    first = next(e.at for e in drain(model) if e.request_id == "new")
    assert first == pytest.approx(now + wait_ms / 1000 + WorkerTiming().prefill_ms(prompt) / 1000, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.2), st.integers(1, 3000), st.integers(0, 3000), st.integers(1, 40)),
                min_size=1, max_size=40))
def test_pending_prefill_tokens_matches_a_recount_of_the_queues(arrivals) -> None:
    """The running counter equals summing the queued requests, however they move."""
    model = WorkerQueueModel(SIMPLE)
    now = 0.0

    def recount() -> int:
        total = sum(r.uncached for r in model._waiting) + sum(r.uncached for r in model._admitted)
        p = model._prefill
        if p is not None:
            span = p.ends - p.started
            total += math.ceil(p.request.uncached * (1.0 if span <= 0 else max(0.0, (p.ends - model.now) / span)))
        return total

    for i, (gap, prompt, cached, out) in enumerate(arrivals):
        now += gap
        model.advance(now=now)
        assert model.pending_prefill_tokens == recount()
        model.admit(f"r{i}", prompt, min(cached, prompt), 0, out, now=now)
        assert model.pending_prefill_tokens == recount()
        model.queue_ms(now=now)  # the probe copy must leave the original untouched
        assert model.pending_prefill_tokens == recount()
    drain(model)
    assert model.pending_prefill_tokens == recount() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.3), st.integers(1, 500), st.integers(0, 500), st.integers(1, 60)),
                min_size=1, max_size=40), st.integers(1, 6))
def test_the_kept_fewest_tokens_left_equals_a_recount_of_the_decode_batch(arrivals, max_running) -> None:
    """The model keeps min(remaining) across steps instead of scanning the batch per event:
    whenever it holds a value, that value is exactly the batch's minimum."""
    model = WorkerQueueModel(WorkerTiming(max_running=max_running))
    now = 0.0

    def check() -> None:
        kept = model._fewest_left
        if kept is not None:
            assert model._decoding and kept == min(r.remaining for r in model._decoding.values())

    for i, (gap, prompt, cached, out) in enumerate(arrivals):
        now += gap
        model.advance(now=now)
        check()
        model.admit(f"r{i}", prompt, min(cached, prompt), 0, out, now=now)
        check()
        model.queue_ms(now=now)
        check()
    while (t := model.next_event_time()) is not None:
        model.advance(now=t)
        check()
    assert model.completed == len(arrivals)


def replayed_queue_ms(model: WorkerQueueModel, now: float) -> float:
    """The reference: copy the model, add a fully cached one-token request at ``now`` and run
    the copy until it produces its first token."""
    probe = model._copy()
    probe.admit("\x00replay", 0, 0, 0, 1, now=now)
    while True:
        due = probe.next_event_time()
        for event in probe.advance(now=due):
            if event.request_id == "\x00replay":
                return 1000.0 * (event.at - now)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.08), st.integers(0, 3000), st.integers(0, 3000), st.integers(1, 30),
                          st.booleans()), min_size=1, max_size=60),
       st.integers(1, 6))
def test_queue_ms_from_the_shadow_equals_a_replay_however_it_is_extended(steps, max_running) -> None:
    """The shadow is built once per busy spell and extended by every arrival; at each step its
    answer is the wait a full replay of the backlog gives."""
    model = WorkerQueueModel(WorkerTiming(prefill_ms_per_token=0.1, decode_ms_per_token=10.0,
                                          decode_batch_slope=0.05, max_running=max_running))
    now = 0.0
    for i, (gap, prompt, cached, output, look) in enumerate(steps):
        now += gap
        model.advance(now=now)
        model.admit(f"r{i}", prompt, min(cached, prompt), 0, output, now=now)
        if look:
            assert model.queue_ms(now=now) == pytest.approx(replayed_queue_ms(model, now), abs=1e-6)
    assert model.queue_ms(now=now) == pytest.approx(replayed_queue_ms(model, now), abs=1e-6)


def test_a_full_worker_keeps_its_shadow_and_drops_it_once_a_slot_frees():
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=2)
    model = WorkerQueueModel(timing)
    model.admit("a", 8, 8, 0, 11, now=0.0)    # fully cached: decoding at once, 10 tokens left
    model.admit("b", 100, 0, 0, 31, now=0.0)  # in prefill for 100 ms, then 30 tokens
    model.admit("c", 8, 0, 0, 5, now=0.0)     # waits for a slot
    # Decoding pauses during b's prefill, so a finishes at 100 + 10 x 10 = 200 ms; c then
    # prefills for 8 ms, and the next slot frees when c (4 tokens left; b has 20) finishes:
    # 208 + 4 x 10 = 248 ms.
    assert model.queue_ms(now=0.0) == pytest.approx(248.0)
    assert model._shadow is not None
    model.advance(now=0.3)  # a, c done; b decoding alone
    assert model.queue_ms(now=0.3) == pytest.approx(0.0)
    assert model._shadow is None


# -- abort: a client that went away ------------------------------------------------------------

ONE_SLOT = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=1)


def test_an_aborted_waiting_request_changes_nothing_for_the_others() -> None:
    with_abort, without = WorkerQueueModel(ONE_SLOT), WorkerQueueModel(ONE_SLOT)
    for model in (with_abort, without):
        model.admit("a", 10, 0, 0, 3, now=0.0)
    with_abort.admit("gone", 50, 0, 0, 5, now=0.0)
    for model in (with_abort, without):
        model.admit("c", 10, 0, 0, 2, now=0.001)
    with_abort.advance(now=0.002)
    pending = with_abort.pending_prefill_tokens
    assert with_abort.waiting == 2
    assert with_abort.abort("gone", now=0.002)
    assert with_abort.waiting == 1 and with_abort.pending_prefill_tokens == pending - 50
    assert drain(with_abort) == drain(without)


def test_an_aborted_decoding_request_frees_its_slot_for_the_next_at_once() -> None:
    model = WorkerQueueModel(ONE_SLOT)
    model.admit("gone", 10, 0, 0, 100, now=0.0)  # first token at 10 ms, then 990 ms of decoding
    model.admit("b", 10, 0, 0, 1, now=0.0)
    assert model.advance(now=0.05) == [FirstTokenProduced("gone", pytest.approx(0.01))]
    assert model.abort("gone", now=0.05)
    assert (model.running, model.waiting) == (1, 0)
    assert drain(model) == [FirstTokenProduced("b", pytest.approx(0.06)), RequestFinished("b", pytest.approx(0.06))]
    assert model.next_event_time() is None


def test_an_aborted_prefill_stops_and_reports_nothing() -> None:
    model = WorkerQueueModel(ONE_SLOT)
    model.admit("gone", 100, 0, 0, 2, now=0.0)  # prefill until 100 ms
    model.advance(now=0.03)
    assert model.abort("gone", now=0.03)
    assert model.running == 0 and model.pending_prefill_tokens == 0 and drain(model) == []


def test_abort_of_a_finished_or_unknown_request_is_a_no_op() -> None:
    model = WorkerQueueModel(ONE_SLOT)
    model.admit("a", 10, 0, 0, 1, now=0.0)
    events = drain(model)
    assert not model.abort("a", now=1.0) and not model.abort("never", now=1.0)
    assert [type(e) for e in events] == [FirstTokenProduced, RequestFinished]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.2), st.integers(1, 3000), st.integers(1, 40), st.booleans()),
                min_size=1, max_size=30), st.integers(1, 4), st.data())
def test_aborts_anywhere_leave_a_consistent_model_that_serves_everyone_else(arrivals, max_running, data) -> None:
    """Requests aborted in any state at any time never report again, the queue counters match
    a recount, and every other request still gets its first token and its end, in order."""
    model = WorkerQueueModel(WorkerTiming(max_running=max_running))
    now, events, live, aborted = 0.0, [], [], set()
    for i, (gap, prompt, out, abort_one) in enumerate(arrivals):
        now += gap
        events += model.advance(now=now)
        model.admit(f"r{i}", prompt, 0, 0, out, now=now)
        live.append(f"r{i}")
        if abort_one:
            victim = data.draw(st.sampled_from(live))
            if model.abort(victim, now=now):
                aborted.add(victim)
            live.remove(victim)
        queued = sum(r.uncached for r in (*model._waiting, *model._admitted))
        assert model._queued_uncached == queued
        assert model.running <= max_running and model.running + model.waiting == len(model._ids)
    events += drain(model)
    after_abort = [e for e in events if e.request_id in aborted]
    assert all(isinstance(e, FirstTokenProduced) for e in after_abort)  # never a finish
    for request_id in live:
        kinds = [type(e) for e in events if e.request_id == request_id]
        assert kinds == [FirstTokenProduced, RequestFinished]
    assert model.running == model.waiting == model.pending_prefill_tokens == 0


def test_the_cache_is_asked_at_the_prefill_start_and_told_its_end_and_finish() -> None:
    calls: list[tuple] = []
    reuse = {"a": (0, 0), "b": (600, 100)}  # b's prompt was cached by a while b waited

    def starts(rid: str, now: float) -> tuple[int, int]:
        calls.append(("starts", rid, now))
        return reuse[rid]

    model = WorkerQueueModel(SIMPLE, prefill_starts=starts,
                             prefill_ends=lambda rid, now: calls.append(("ends", rid, now)),
                             finished=lambda rid, now: calls.append(("finished", rid, now)))
    model.admit("a", 1000, 0, 0, output_tokens=1, now=0.0)
    model.admit("b", 1000, 0, 0, output_tokens=1, now=0.0)  # estimated: nothing cached
    assert model.pending_prefill_tokens == 2000
    events = drain(model)
    a_done = 1000 * 0.1 / 1000
    b_done = a_done + (300 * 0.1 + 100 * 0.01) / 1000  # what was reused when its prefill started
    assert calls == [("starts", "a", 0.0), ("ends", "a", pytest.approx(a_done)),
                     ("finished", "a", pytest.approx(a_done)), ("starts", "b", pytest.approx(a_done)),
                     ("ends", "b", pytest.approx(b_done)), ("finished", "b", pytest.approx(b_done))]
    assert [e.at for e in events if isinstance(e, FirstTokenProduced)] == [pytest.approx(a_done), pytest.approx(b_done)]


def test_a_reuse_that_differs_from_the_estimate_renews_the_queue_estimate() -> None:
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=1)
    model = WorkerQueueModel(timing, prefill_starts=lambda rid, now: (90, 0) if rid == "b" else (0, 0))
    model.admit("a", 10, 0, 0, output_tokens=5, now=0.0)
    model.admit("b", 100, 0, 0, output_tokens=1, now=0.0)  # estimate: 100 ms of prefill
    # a: 10 ms prefill + 4 steps; then b, estimated at 100 ms of prefill
    assert model.queue_ms(now=0.0) == pytest.approx(10 + 40 + 100)
    model.advance(now=0.051)  # b started at 50 ms, and reuses 90 tokens: 10 ms of prefill
    assert model.queue_ms(now=0.051) == pytest.approx(9.0)


def test_a_cache_answer_that_does_not_fit_the_prompt_is_refused() -> None:
    model = WorkerQueueModel(SIMPLE, prefill_starts=lambda rid, now: (80, 30))
    with pytest.raises(WorkerModelError, match="at the prefill's start"):
        model.admit("a", 100, 0, 0, output_tokens=1, now=0.0)


def test_a_head_with_no_room_waits_for_a_finish_and_blocks_those_behind_it() -> None:
    running: set[str] = set()

    def starts(rid: str, now: float) -> tuple[int, int] | None:
        if rid == "b" and "a" in running:
            return None  # b's KV does not fit beside a's
        running.add(rid)
        return (0, 0)

    model = WorkerQueueModel(SIMPLE, prefill_starts=starts, finished=lambda rid, now: running.discard(rid))
    model.admit("a", 100, 0, 0, output_tokens=3, now=0.0)  # prefill 10 ms, then 2 steps of 10 ms
    model.admit("b", 100, 0, 0, output_tokens=1, now=0.0)
    model.admit("c", 100, 0, 0, output_tokens=1, now=0.0)  # would fit, but FIFO: behind b
    events = drain(model)
    first = {e.request_id: e.at for e in events if isinstance(e, FirstTokenProduced)}
    assert first == {"a": pytest.approx(0.010), "b": pytest.approx(0.040), "c": pytest.approx(0.050)}


# ---------------------------------------------------------------------------- the wait for VRAM room


def replayed_with_cache(owner: CacheOwner, model: WorkerQueueModel, now: float, *,
                        missed: list[bool] | None = None) -> float:
    """The reference for a model with a cache: copy both, add an empty one-token request (it
    needs no pages) at ``now`` and run the copies until it produces its first token.
    ``missed`` gets whether a prefill in the replay reused other than its arrival estimate."""
    owner, model = copy.deepcopy((owner, model))
    owner.estimate_missed = False
    owner.admit(model, "\x00replay", [], 1, now)
    while True:
        for event in model.advance(now=model.next_event_time()):
            if event.request_id == "\x00replay":
                if missed is not None:
                    missed.append(owner.estimate_missed)
                return 1000.0 * (event.at - now)


ROOMY = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=8)


def test_a_head_waiting_for_vram_room_shows_in_the_queue_report() -> None:
    owner = CacheOwner(vram_tokens=40)  # 10 pages of 4 tokens
    model = owner.model(ROOMY)
    owner.admit(model, "a", list(range(32)), 6, now=0.0)  # 8 pages; 32 ms prefill, then 5 steps
    owner.admit(model, "b", list(range(100, 132)), 1, now=0.0)  # 8 more pages: no room beside a's
    model.advance(now=0.040)
    assert model.head_blocked and model.waiting == 0  # a slot is free: only VRAM holds b back
    # b starts when a finishes (32 + 50 ms) and prefills for 32 ms: a new arrival waits for both
    assert model.queue_ms(now=0.040) == pytest.approx(82 + 32 - 40)
    assert model.queue_ms(now=0.040) == pytest.approx(replayed_with_cache(owner, model, 0.040))
    # without the pages the report sees only b's prefill, as if it could start now
    blind_owner = CacheOwner(vram_tokens=40)
    blind = blind_owner.model(ROOMY, counts_room=False)
    blind_owner.admit(blind, "a", list(range(32)), 6, now=0.0)
    blind_owner.admit(blind, "b", list(range(100, 132)), 1, now=0.0)
    blind.advance(now=0.040)
    assert blind.head_blocked and blind.queue_ms(now=0.040) == pytest.approx(32)


def test_a_head_that_fits_adds_only_its_prefill() -> None:
    owner = CacheOwner(vram_tokens=80)  # 20 pages: a's and b's fit together
    model = owner.model(ROOMY)
    owner.admit(model, "a", list(range(32)), 6, now=0.0)
    owner.admit(model, "b", list(range(100, 132)), 1, now=0.0)
    assert not model.head_blocked
    assert model.queue_ms(now=0.010) == pytest.approx(22 + 32)  # a's prefill left, then b's
    model.advance(now=0.040)
    assert not model.head_blocked and model.queue_ms(now=0.040) == pytest.approx(24)  # b prefilling


def test_a_head_sharing_pinned_pages_needs_only_its_new_ones() -> None:
    owner = CacheOwner(vram_tokens=40)
    model = owner.model(ROOMY)
    owner.admit(model, "a", list(range(32)), 6, now=0.0)
    owner.admit(model, "b", list(range(24)) + list(range(500, 508)), 1, now=0.0)  # 6 pages shared with a
    model.advance(now=0.040)
    assert not model.head_blocked  # 2 new pages beside a's 8
    assert model.queue_ms(now=0.040) == pytest.approx(replayed_with_cache(owner, model, 0.040))


def first_token_ms(owner: CacheOwner, model: WorkerQueueModel, rid: str, tokens: list[int], now: float) -> float:
    """A replay: copies of model and cache, ``tokens`` arriving at ``now`` as ``rid`` (one
    output token); ms until its first token."""
    owner, model = copy.deepcopy((owner, model))
    owner.admit(model, rid, tokens, 1, now)
    while True:
        for event in model.advance(now=model.next_event_time()):
            if event.request_id == rid and isinstance(event, FirstTokenProduced):
                return 1000.0 * (event.at - now)


def test_room_steps_say_when_a_long_prompt_fits_though_the_queue_is_empty() -> None:
    owner = CacheOwner(vram_tokens=40)  # 10 pages of 4 tokens
    model = owner.model(ROOMY)
    assert model.room_steps(now=0.0) == ()  # nothing held: every page free
    owner.admit(model, "a", list(range(32)), 6, now=0.0)  # 8 pages; 32 ms prefill, then 5 steps of 10 ms
    model.advance(now=0.040)
    # a decodes until 82 ms: the queue is empty, 2 pages are free until then and all 10 after
    assert model.queue_ms(now=0.040) == pytest.approx(0.0)
    steps = model.room_steps(now=0.040)
    assert [s[1] for s in steps] == [2, 10] and steps[0][0] == 0.0 and steps[1][0] == pytest.approx(42.0)
    # the replay agrees: a 2-page prompt starts at once, an 8-page one when a finishes
    assert first_token_ms(owner, model, "short", list(range(200, 208)), 0.040) == pytest.approx(8.0)
    assert first_token_ms(owner, model, "long", list(range(300, 332)), 0.040) == pytest.approx(42.0 + 32.0)
    # a queued request pins its pages from now, and its prefill (4 ms) pauses a's decode: b
    # finishes after 2 steps, a after its 4.2 left
    owner.admit(model, "b", list(range(100, 104)), 3, now=0.040)
    steps = model.room_steps(now=0.040)
    assert [s[1] for s in steps] == [1, 2, 10]
    assert [s[0] for s in steps] == pytest.approx([0.0, 4.0 + 20.0, 4.0 + 42.0])


def test_room_steps_read_empty_while_the_longest_prompt_fits() -> None:
    """With ``enough_pages`` (the pages the longest prompt needs) the steps read empty while at
    least that many are free now (then at every step), and are the full steps otherwise: both
    when the paths' sum settles it, and when only their union does (shared pages)."""
    owner = CacheOwner(vram_tokens=40)  # 10 pages of 4 tokens
    model = owner.model(ROOMY)
    owner.admit(model, "a", list(range(16)), 6, now=0.0)  # 4 pages
    model.advance(now=0.020)
    owner.admit(model, "b", list(range(12)) + [500, 501, 502, 503], 3, now=0.020)  # 3 of a's pages, 1 more
    full = model.room_steps(now=0.020)
    assert full[0][1] == 5  # 4 + 1 pinned, though the paths' sum is 8
    for enough in range(0, 12):
        got = model.room_steps(now=0.020, enough_pages=enough)
        assert got == (() if enough <= 5 else full), enough


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(0, 44), st.integers(0, 3), st.integers(1, 12),
                          st.booleans()), min_size=1, max_size=30),
       st.integers(1, 5))
def test_queue_ms_with_vram_room_equals_a_replay(steps, max_running) -> None:
    """Prompts share prefixes (one of four stems) and VRAM holds ten pages: heads block often;
    at each look the report is the wait a replay of model and cache gives a request needing
    no pages. The report runs ahead on the reuse each request was estimated at on arrival: a
    look where a later prefill reuses otherwise (a stem cached or evicted meanwhile; the model
    renews its run-ahead when that happens, tested above) is not compared."""
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.05,
                          max_running=max_running)
    owner = CacheOwner(vram_tokens=40)
    model = owner.model(timing)
    now = 0.0
    for i, (gap, length, stem, output, look) in enumerate(steps):
        now += gap
        model.advance(now=now)
        tokens = [stem * 10_000 + k for k in range(8)] + [i * 100 + 1_000_000 + k for k in range(length)]
        owner.admit(model, f"r{i}", tokens, output, now)
        if look:
            missed: list[bool] = []
            replayed = replayed_with_cache(owner, model, now, missed=missed)
            if not missed[0]:
                assert model.queue_ms(now=now) == pytest.approx(replayed, abs=1e-6)
    drain(model)
    assert model.running == model.waiting == 0 and owner.cache.pinned_vram_pages == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.lists(st.integers(0, 2), max_size=6)),
                max_size=40))
def test_pinned_paths_count_the_union_of_the_paths(ops) -> None:
    """Adding and removing root paths of a small tree keeps the size of their union, and the
    pages a new path adds, equal to a recount with sets."""
    pinned = PinnedPaths(capacity=20)
    held: dict[str, tuple[int, ...]] = {}

    def nodes(path: tuple[int, ...]) -> set[tuple[int, ...]]:
        return {path[: k + 1] for k in range(len(path))}

    for n, (add, which, digits) in enumerate(ops):
        path = tuple(digits)
        union = set().union(*map(nodes, held.values())) if held else set()
        assert pinned.added_pages(path) == len(nodes(path) - union)
        if add or not held:
            pinned.add(f"q{n}", path)
            held[f"q{n}"] = path
        else:
            rid = sorted(held)[which % len(held)]
            pinned.discard(rid)
            del held[rid]
        union = set().union(*map(nodes, held.values())) if held else set()
        assert pinned.size == len(union) and len(pinned) == len(held)
