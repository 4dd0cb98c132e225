"""The agent's report coalescing (kvcompassd.reports) and the pacer it shares with the
maintenance unit's batches (kvcompassd.pacing). No test depends on timing: the delays are long
(1 s) where a test needs a flush *not* to have happened yet."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from kvcompassd.core.events import IndexEventColumns, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.pacing import FlushPacer
from kvcompassd.reports import ReportCoalescer
from kvcompassd.wire import PrefixEventsReported, decode, encode

WORKER = "us-0"


# ---- FlushPacer -----------------------------------------------------------------------------


async def test_a_lone_item_is_flushed_within_the_window():
    """The first item of a window arms one timer due ``delay_s`` later, and nothing sooner: a
    lone item waits at most the window (no later: its flush precedes anything due after it)."""
    flushes = []
    loop = asyncio.get_running_loop()
    pacer = FlushPacer(lambda: flushes.append(loop.time()), delay_s=0.02, max_pending=100)
    added_at = loop.time()
    pacer.added(1)
    returned_at = loop.time()
    assert pacer.scheduled and added_at + 0.02 <= pacer._timer.when() <= returned_at + 0.02
    await asyncio.sleep(0)
    assert flushes == []  # not with the next loop turn: the window gathers
    await asyncio.sleep(0.05)  # due after the flush's timer, so it runs after it
    assert len(flushes) == 1 and flushes[0] - added_at >= 0.02 - 1e-3 and not pacer.scheduled


async def test_a_burst_within_the_window_is_flushed_once():
    flushes = []
    pacer = FlushPacer(lambda: flushes.append(1), delay_s=1.0, max_pending=100)
    pacer.added(1)
    timer = pacer._timer
    for _ in range(5):
        await asyncio.sleep(0)
        pacer.added(2)
    assert flushes == [] and pacer._timer is timer  # later items never re-arm the window's timer
    pacer.flush_now()  # stands for the timer firing
    assert flushes == [1] and not pacer.scheduled
    pacer.added(1)  # the next item opens a new window
    assert pacer.scheduled and pacer._timer is not timer


async def test_zero_delay_flushes_with_the_next_loop_turn():
    flushes = []
    pacer = FlushPacer(lambda: flushes.append(1), delay_s=0.0, max_pending=100)
    pacer.added(3)
    pacer.added(1)
    assert flushes == [] and pacer.scheduled
    await asyncio.sleep(0)
    assert flushes == [1] and not pacer.scheduled


async def test_max_pending_flushes_at_once_and_cancel_forgets_the_timer():
    flushes = []
    pacer = FlushPacer(lambda: flushes.append(1), delay_s=1.0, max_pending=5)
    pacer.added(4)
    assert flushes == []
    pacer.added(1)
    assert flushes == [1] and not pacer.scheduled
    pacer.added(1)
    pacer.cancel()
    await asyncio.sleep(0)
    assert flushes == [1] and not pacer.scheduled


@pytest.mark.parametrize("delay, limit", [(-0.1, 1), (1.5, 1), (0.001, 0)])
def test_pacer_rejects_bad_settings(delay, limit):
    with pytest.raises(ValueError):
        FlushPacer(lambda: None, delay_s=delay, max_pending=limit)


# ---- ReportCoalescer ------------------------------------------------------------------------


class Recorder:
    def __init__(self, accept: int | None = None):
        self.sent: list[tuple[int, PrefixEventsReported]] = []
        self.accept = accept  # refuse every report after this many

    def __call__(self, shard: int, report: PrefixEventsReported) -> bool:
        if self.accept is not None and len(self.sent) >= self.accept:
            return False
        # What goes on the wire must decode to the same report.
        assert decode(encode(report)) == report
        self.sent.append((shard, report))
        return True


def events_strategy():
    kinds = st.sampled_from(["cached-vram", "cached-dram", "moved-vram", "moved-dram", "evicted"])
    return st.lists(st.tuples(kinds, st.integers(0, (1 << 63) - 1)), max_size=300)


def make_event(kind: str, key: int):
    if kind == "evicted":
        return PrefixEvicted(WORKER, key)
    cls = PrefixCached if kind.startswith("cached") else TierChanged
    return cls(WORKER, key, Tier.VRAM if kind.endswith("vram") else Tier.DRAM)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(events_strategy(), max_size=6), shards=st.integers(1, 4), max_events=st.integers(1, 50))
def test_reports_carry_each_shards_events_in_order(batches, shards, max_events):
    """Whatever the batching, each shard receives exactly its events, in order, with each one's
    indexed length, in reports of at most max_events numbered in increasing order."""

    def length_of(key: int) -> int:  # any function of the key will do
        return key % 4093 + 1

    async def run():
        sent = Recorder()
        reports = ReportCoalescer(WORKER, shards, sent, delay_s=1.0, max_events=max_events)
        for batch in batches:
            reports.add_events([make_event(k, key) for k, key in batch], [length_of(key) for _, key in batch])
        reports.flush()
        return sent.sent

    sent = asyncio.run(run())
    everything = [make_event(k, key) for batch in batches for k, key in batch]
    for shard in range(shards):
        expected = tuple(e for e in everything if e.key % shards == shard)
        got = tuple(e for s, r in sent if s == shard for e in r.events.as_events(WORKER))
        assert got == expected
        lengths = [n for s, r in sent if s == shard for n in r.events.length_array().tolist()]
        assert lengths == [length_of(e.key) for e in expected]
    assert all(0 < len(r.events) <= max_events for _, r in sent)
    seqs = [r.seq for _, r in sent]
    assert seqs == sorted(set(seqs))


async def test_batches_within_the_window_leave_as_one_report_per_shard():
    sent = Recorder()
    reports = ReportCoalescer(WORKER, 2, sent, delay_s=1.0)
    reports.add_events([PrefixCached(WORKER, 10, Tier.VRAM)])
    await asyncio.sleep(0)  # the window gathers: nothing sent with the next loop turn
    reports.add_events([PrefixCached(WORKER, k, Tier.VRAM) for k in (2, 3, 4)])
    reports.add_events([PrefixCached(WORKER, k, Tier.DRAM) for k in (5, 6)])
    await asyncio.sleep(0)
    assert sent.sent == []
    reports.flush()  # stands for the window's timer
    by_shard = {s: r.events.key_array().tolist() for s, r in sent.sent}
    assert by_shard == {0: [10, 2, 4, 6], 1: [3, 5]} and len(sent.sent) == 2


async def test_a_lone_batch_is_reported_within_the_window():
    sent = Recorder()
    reports = ReportCoalescer(WORKER, 1, sent, delay_s=0.01)
    reports.add_events([PrefixCached(WORKER, 7, Tier.VRAM)])
    assert sent.sent == []
    await asyncio.sleep(0.05)  # due after the window's timer, so it runs after it
    assert [r.events.key_array().tolist() for _, r in sent.sent] == [[7]]


async def test_a_cancelled_window_sends_nothing_when_it_would_have_ended():
    sent = Recorder()
    reports = ReportCoalescer(WORKER, 1, sent, delay_s=0.01)
    reports.add_events([PrefixCached(WORKER, 7, Tier.VRAM)])
    reports.cancel()  # a stopping agent
    await asyncio.sleep(0.05)
    assert sent.sent == []


async def test_a_refused_send_drops_the_rest_of_that_report_and_discard_forgets_a_shard():
    sent = Recorder(accept=1)
    reports = ReportCoalescer(WORKER, 1, sent, max_events=2)
    reports.report(0, IndexEventColumns.from_events([PrefixCached(WORKER, k, Tier.VRAM) for k in range(5)]))
    assert [r.events.key_array().tolist() for _, r in sent.sent] == [[0, 1]]
    ok = Recorder()
    reports = ReportCoalescer(WORKER, 2, ok, delay_s=1.0)
    reports.add(1, IndexEventColumns.from_events([PrefixCached(WORKER, 7, Tier.VRAM)]))
    reports.discard(1)
    reports.flush()
    assert ok.sent == []


def test_add_refuses_a_shard_out_of_range():
    reports = ReportCoalescer(WORKER, 2, Recorder())
    with pytest.raises(ValueError):
        reports.add(2, IndexEventColumns(b"", b""))
    with pytest.raises(ValueError):
        ReportCoalescer(WORKER, 0, Recorder())
