"""The decode worker's queue model and the KV hand-over time (kvcompassd/worker/decodemodel.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.worker.decodemodel import DecodeQueueModel, decode_steps, kv_transfer_ms
from kvcompassd.worker.workermodel import FirstTokenProduced, RequestFinished, WorkerModelError, WorkerTiming

TIMING = WorkerTiming(decode_ms_per_token=10.0, decode_batch_slope=0.1, max_running=2)


def drain(model: DecodeQueueModel, until: float = 1e9) -> list:
    events = []
    while (t := model.next_event_time()) is not None and t <= until:
        events += model.advance(now=t)
    return events


def test_kv_transfer_is_size_over_bandwidth():
    # 1000 tokens x 128 KiB = 131,072,000 bytes; at 100 Gbit/s that is 10.48576 ms.
    assert kv_transfer_ms(1000, 100.0) == pytest.approx(10.48576)
    assert kv_transfer_ms(1000, 25.0, bytes_per_token=64 * 1024) == pytest.approx(20.97152)
    assert kv_transfer_ms(0, 1.0) == 0.0
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(WorkerModelError):
            kv_transfer_ms(10, bad)
    with pytest.raises(WorkerModelError):
        kv_transfer_ms(-1, 10.0)


def test_a_lone_request_streams_after_one_step_and_finishes_after_output_minus_one():
    model = DecodeQueueModel(TIMING)
    model.admit("r", 5, now=1.0)
    events = drain(model)
    assert events == [FirstTokenProduced("r", pytest.approx(1.010)), RequestFinished("r", pytest.approx(1.040))]
    assert decode_steps(5) == 4 and decode_steps(1) == decode_steps(2) == 1
    assert model.next_event_time() is None and model.running == 0 and model.completed == 1


def test_a_request_joins_at_the_next_step_boundary_and_slows_the_batch():
    model = DecodeQueueModel(TIMING)
    model.admit("a", 4, now=0.0)          # steps of 10 ms while alone: ends at 0.010, 0.020, ...
    model.admit("b", 2, now=0.004)        # arrives mid-step: joins at 0.010
    events = drain(model)
    # From 0.010 the batch is two: 11 ms steps. b's one step ends at 0.021; a's 3 steps at 0.010, 0.021, 0.031.
    assert [(type(e).__name__, e.request_id, round(e.at, 6)) for e in events] == [
        ("FirstTokenProduced", "a", 0.010),
        ("FirstTokenProduced", "b", 0.021), ("RequestFinished", "b", 0.021),
        ("RequestFinished", "a", 0.031),
    ]


def test_without_a_free_slot_a_request_waits_fifo():
    model = DecodeQueueModel(TIMING)  # two slots
    for i, out in enumerate((3, 11, 2)):
        model.admit(f"r{i}", out, now=0.0)
    assert model.running == 2 and model.waiting == 1
    events = drain(model)
    first = {e.request_id: e.at for e in events if isinstance(e, FirstTokenProduced)}
    done = {e.request_id: e.at for e in events if isinstance(e, RequestFinished)}
    assert first["r2"] == pytest.approx(done["r0"] + 0.011)  # r0's slot, then one step of a batch of two


def test_misuse_is_refused():
    model = DecodeQueueModel(TIMING)
    model.admit("a", 3, now=1.0)
    with pytest.raises(WorkerModelError, match="already"):
        model.admit("a", 3, now=1.0)
    with pytest.raises(WorkerModelError, match="output_tokens"):
        model.admit("b", 0, now=1.0)
    with pytest.raises(WorkerModelError, match="backwards"):
        model.advance(now=0.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.2), st.integers(1, 30)), min_size=1, max_size=25),
       st.integers(1, 4))
def test_every_request_gets_its_steps_and_the_batch_never_overflows(arrivals, slots):
    timing = WorkerTiming(decode_ms_per_token=10.0, decode_batch_slope=0.05, max_running=slots)
    model = DecodeQueueModel(timing)
    events, admitted = [], {}
    for i, (gap, out) in enumerate(sorted(arrivals)):
        events += model.advance(now=gap)
        model.admit(f"r{i}", out, now=gap)
        admitted[f"r{i}"] = (gap, out)
        assert model.running <= slots
    events += drain(model)
    first = {e.request_id: e.at for e in events if isinstance(e, FirstTokenProduced)}
    done = {e.request_id: e.at for e in events if isinstance(e, RequestFinished)}
    assert set(first) == set(done) == set(admitted) and model.completed == len(admitted)
    assert [e.at for e in events] == sorted(e.at for e in events)
    batch_steps = [timing.decode_step_ms(n) / 1000 for n in range(1, slots + 1)]
    for rid, (at, out) in admitted.items():
        # At least one step after its KV arrived; each of its steps costs between a lone step and a full batch's.
        assert first[rid] >= at + batch_steps[0] - 1e-9
        steps = decode_steps(out)
        assert batch_steps[0] * (steps - 1) - 1e-9 <= done[rid] - first[rid] <= batch_steps[-1] * (steps - 1) + 1e-9
    # FIFO: requests get their first token in admission order.
    order = sorted(admitted, key=lambda r: (admitted[r][0], int(r[1:])))
    assert [first[r] for r in order] == sorted(first[r] for r in order)
