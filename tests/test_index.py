"""The maintenance shard and the edge's view: events to batches, the replay log, the views' data
operations, exact holders. The sync protocol over them is tests/test_sync.py's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from clusters import make_cluster
from kvcompassd.core.events import IndexEventColumns, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard, UpdateBatchPublished
from kvcompassd.core.layout import IndexLayout

SHARDS = 3


def _setup(regions=None, **kw):
    cfg = make_cluster(regions or {"a": 3, "b": 20}, shards=SHARDS, **kw)
    layout = IndexLayout.from_config(cfg)
    shards = [MaintenanceShard(layout, s, SHARDS, epoch=7, initial_capacity=cfg.index.initial_capacity,
                               fingerprint_bits=cfg.index.fingerprint_bits) for s in range(SHARDS)]
    view = EdgeIndexView(layout, SHARDS, edge="edge-a")
    for s in shards:
        assert view.install_snapshot(s.snapshot()).applied
    return cfg, layout, shards, view


def _route(shards, events):
    for e in events:
        shards[e.key % SHARDS].apply([e])
    return [b for s in shards if (b := s.flush()) is not None]


def _view_value(view, layout, key, worker):
    slot = layout.slot(worker)
    return Tier((view.view(key % SHARDS, slot.group).lookup(key) >> (2 * slot.field)) & 3)


def test_layout_splits_large_regions_into_groups():
    cfg = make_cluster({"a": 3, "b": 20})
    layout = IndexLayout.from_config(cfg)
    assert [(g.region, len(g.workers)) for g in layout.groups] == [("a", 3), ("b", 16), ("b", 4)]
    assert layout.slot("b-17").group == 2 and layout.slot("b-17").field == 1
    wide = IndexLayout.from_config(make_cluster({"a": 3, "b": 20}, value_bits=64))
    assert [len(g.workers) for g in wide.groups] == [3, 20]


def test_events_reach_the_view_and_holders_are_exact():
    cfg, layout, shards, view = _setup()
    keys = [11, 12, 13, 1 << 62]
    events = [PrefixCached("a-0", k, Tier.VRAM) for k in keys] + [PrefixCached("b-17", keys[0], Tier.DRAM)]
    for batch in _route(shards, events):
        assert view.apply_next(batch) is None
    assert shards[keys[0] % SHARDS].holders(keys[0]) == {"a-0": Tier.VRAM, "b-17": Tier.DRAM}
    for k in keys:
        assert _view_value(view, layout, k, "a-0") == Tier.VRAM
    assert _view_value(view, layout, keys[0], "b-17") == Tier.DRAM
    # Tier change and eviction are in-place field edits.
    for batch in _route(shards, [TierChanged("a-0", keys[0], Tier.DRAM), PrefixEvicted("b-17", keys[0])]):
        assert view.apply_next(batch) is None
    assert shards[keys[0] % SHARDS].holders(keys[0]) == {"a-0": Tier.DRAM}
    assert _view_value(view, layout, keys[0], "a-0") == Tier.DRAM


def test_bad_events_are_ignored_with_a_reason_and_change_nothing():
    cfg, layout, shards, view = _setup()
    s0 = shards[0]
    outcome = s0.apply([
        PrefixCached("nobody", 3, Tier.VRAM),          # unknown worker
        PrefixCached("a-0", 4, Tier.VRAM),             # key of shard 1
        TierChanged("a-0", 6, Tier.DRAM),              # never registered
        PrefixEvicted("a-1", 9, ),                     # never registered
    ])
    assert outcome.applied == 0 and len(outcome.ignored) == 4
    assert "unknown worker" in outcome.ignored[0] and "shard 1" in outcome.ignored[1]
    assert s0.flush() is None and s0.entries() == 0


def test_the_view_applies_only_the_next_batch_and_never_goes_back():
    # Which batch is next, and what to do about the others, is core/sync.py's (tests/test_sync.py);
    # the view refuses to be misused.
    cfg, layout, shards, view = _setup()
    s = shards[0]
    snapshot = s.snapshot()
    batches = []
    for k in range(0, 12, SHARDS):
        s.apply([PrefixCached("a-1", k, Tier.VRAM)])
        batches.append(s.flush())
    assert view.apply_next(batches[0]) is None
    for wrong in (batches[0], batches[2], UpdateBatchPublished(0, 8, 2, ())):
        with pytest.raises(ValueError, match="not next"):
            view.apply_next(wrong)
    stale = view.install_snapshot(snapshot)
    assert not stale.applied and "stale" in stale.reason and view.position(0) == (7, 1)
    view.skip_to(0, 3)
    assert view.position(0) == (7, 3)
    with pytest.raises(ValueError):
        view.skip_to(0, 2)


def test_the_replay_log_answers_from_a_seq_until_it_is_trimmed():
    cfg, layout, shards, view = _setup()
    s = MaintenanceShard(layout, 0, SHARDS, epoch=8, replay_batches=2, initial_capacity=64)
    for k in range(0, 30, SHARDS):
        s.apply([PrefixCached("b-3", k, Tier.DRAM)])
        s.flush()
    assert [b.seq for b in s.replay_from(s.seq - 1)] == [s.seq - 1, s.seq]
    assert s.replay_from(s.seq + 1) == []
    assert s.replay_from(1) is None and s.replay_from(0) is None  # trimmed; from nothing
    assert view.install_snapshot(s.snapshot()).applied
    assert view.position(0) == (8, s.seq)
    for k in range(0, 30, SHARDS):
        assert _view_value(view, layout, k, "b-3") == Tier.DRAM


def test_corrupt_batch_is_rejected_and_view_keeps_answering():
    cfg, layout, shards, view = _setup()
    for b in _route(shards, [PrefixCached("a-2", 30, Tier.VRAM)]):
        assert view.apply_next(b) is None
    s = shards[30 % SHARDS]
    s.apply([PrefixCached("a-2", 30 + SHARDS, Tier.VRAM)])
    good = s.flush()
    group, blob = good.tables[0]
    bad = UpdateBatchPublished(good.shard, good.epoch, good.seq, ((group, blob[:-3] + b"xyz"),))
    assert "rejected" in view.apply_next(bad)
    assert _view_value(view, layout, 30, "a-2") == Tier.VRAM
    assert view.apply_next(good) is None


def test_withdraw_worker_clears_only_its_fields():
    cfg, layout, shards, view = _setup()
    events = [PrefixCached(w, k, Tier.VRAM) for k in range(0, 90, SHARDS) for w in ("a-0", "a-1")]
    shards[0].apply(events)
    outcome = shards[0].withdraw_worker("a-0")
    assert outcome.applied == 30
    batch = shards[0].flush()
    assert view.apply_next(batch) is None
    for k in range(0, 90, SHARDS):
        assert shards[0].holders(k) == {"a-1": Tier.VRAM}


def test_peer_edge_copy_equals_the_original():
    cfg, layout, shards, view = _setup()
    for b in _route(shards, [PrefixCached("b-0", k, Tier.VRAM) for k in range(200)]):
        assert view.apply_next(b) is None
    other = EdgeIndexView(layout, SHARDS, edge="edge-b")
    for s in range(SHARDS):
        assert other.install_snapshot(view.snapshot(s)).applied
    keys = np.arange(200, dtype=np.uint64)
    for s in range(SHARDS):
        for g in layout.groups:
            a = view.view(s, g.group).lookup_many(keys)
            b = other.view(s, g.group).lookup_many(keys)
            assert np.array_equal(a, b)


# ---- columnar reports: the vectorised apply equals the one-by-one apply ---------------------

def _worker_events(worker: str, shard: int, *, foreign: bool, distinct: bool):
    """Events of one worker on a few keys, some for other shards if ``foreign``; keys repeat
    within a report (order matters) unless ``distinct`` (the vectorised case)."""
    own_keys = st.integers(0, 12).map(lambda i: i * SHARDS + shard)
    keys = (own_keys | st.integers(0, 40)) if foreign else own_keys
    tiers = st.sampled_from([Tier.VRAM, Tier.DRAM])
    event = (st.builds(PrefixCached, st.just(worker), keys, tiers) | st.builds(TierChanged, st.just(worker), keys, tiers)
             | st.builds(PrefixEvicted, st.just(worker), keys))
    return st.lists(event, max_size=30, unique_by=(lambda e: e.key) if distinct else None)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(["a-0", "a-2", "b-17", "zz-9"]), st.booleans(), st.booleans())
def test_apply_columns_matches_apply_event_by_event(data, worker, foreign, distinct):
    shard = 1
    cfg, layout, one_by_one, _ = _setup()
    _, _, columnar, _ = _setup()
    # A prior state with other workers' fields in the same values, so removes and updates mix.
    prior = [PrefixCached(w, k * SHARDS + shard, Tier.DRAM) for w in ("a-1", "b-16") for k in range(0, 12, 3)]
    prior += [PrefixCached(worker, k * SHARDS + shard, Tier.VRAM) for k in range(0, 12, 2)]
    for shards in (one_by_one, columnar):
        shards[shard].apply(prior)
        shards[shard].flush()
    for _ in range(data.draw(st.integers(1, 3), label="reports")):
        events = data.draw(_worker_events(worker, shard, foreign=foreign, distinct=distinct), label="events")
        expected = one_by_one[shard].apply(events)
        got = columnar[shard].apply_columns(worker, IndexEventColumns.from_events(events))
        assert got == expected
        assert (columnar[shard].flush() is None) == (one_by_one[shard].flush() is None)
    want = {g: dict(zip(k.tolist(), v.tolist())) for g, (k, v) in one_by_one[shard].group_items().items()}
    have = {g: dict(zip(k.tolist(), v.tolist())) for g, (k, v) in columnar[shard].group_items().items()}
    assert have == want


@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans())
def test_reports_applied_together_match_each_report_applied_in_turn(data, foreign):
    """Several workers' reports (some with another shard's keys, another worker's event or an
    unknown worker when ``foreign``) applied in one call leave the tables, the outcome and the
    next batch byte for byte as ``apply`` of each report in turn."""
    shard = 1
    _, _, one_by_one, _ = _setup()
    _, _, together, _ = _setup()
    prior = [PrefixCached(w, k * SHARDS + shard, Tier.DRAM) for w in ("a-1", "b-16") for k in range(0, 12, 3)]
    for shards in (one_by_one, together):
        shards[shard].apply(prior)
        shards[shard].flush()
    workers = ["a-0", "a-1", "a-2", "b-16", "b-17"] + (["zz-9"] if foreign else [])
    reports = []
    for _ in range(data.draw(st.integers(0, 6), label="reports")):
        worker = data.draw(st.sampled_from(workers), label="worker")
        events = data.draw(_worker_events(worker, shard, foreign=foreign, distinct=False), label="events")
        if foreign and events and data.draw(st.booleans(), label="another worker's event"):
            events.append(PrefixCached("b-16" if worker != "b-16" else "a-0", shard, Tier.VRAM))
        reports.append((worker, events))
    expected = [one_by_one[shard].apply(events) for _, events in reports]
    got = together[shard].apply_reports(reports)
    assert (got.applied, got.unchanged) == (sum(o.applied for o in expected), sum(o.unchanged for o in expected))
    assert got.ignored == tuple(reason for o in expected for reason in o.ignored)
    assert together[shard].flush() == one_by_one[shard].flush()  # the same records, byte for byte
    want = {g: dict(zip(k.tolist(), v.tolist())) for g, (k, v) in one_by_one[shard].group_items().items()}
    have = {g: dict(zip(k.tolist(), v.tolist())) for g, (k, v) in together[shard].group_items().items()}
    assert have == want


def test_columnar_batches_keep_the_view_exact():
    cfg, layout, shards, view = _setup()
    keys = [k * SHARDS for k in range(1, 200)]
    shards[0].apply_columns("b-17", IndexEventColumns.from_events([PrefixCached("b-17", k, Tier.VRAM) for k in keys]))
    assert view.apply_next(shards[0].flush()) is None
    moved = [TierChanged("b-17", k, Tier.DRAM) for k in keys[::2]] + [PrefixEvicted("b-17", k) for k in keys[1::2]]
    outcome = shards[0].apply_columns("b-17", IndexEventColumns.from_events(moved))
    assert (outcome.applied, outcome.unchanged, outcome.ignored) == (len(keys), 0, ())
    assert view.apply_next(shards[0].flush()) is None
    for k in keys[::2]:
        assert _view_value(view, layout, k, "b-17") == Tier.DRAM
    assert shards[0].entries() == len(keys[::2])


def test_unknown_worker_columns_are_ignored_with_a_reason():
    _, _, shards, _ = _setup()
    outcome = shards[0].apply_columns("zz-9", IndexEventColumns.from_events([PrefixEvicted("zz-9", 3)]))
    assert outcome.applied == 0 and len(outcome.ignored) == 1 and "zz-9" in outcome.ignored[0]
    assert shards[0].flush() is None
