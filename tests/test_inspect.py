"""What an edge tells kvcompassctl: a prompt's holders and the pending ledger, and each view's entries."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router import PROMPT, _register, _world

from kvcompassd.core.ludo import LudoTable, LudoView
from kvcompassd.core.router import Router
from kvcompassd.inspect import current_entries, describe_edge, describe_edge_paced


def _edge(router, cfg, layout, clock):
    # (an edge not told otherwise sends its own region's agents the queue vector)
    return SimpleNamespace(router=router, cfg=cfg, layout=layout, clock=lambda: clock[0],
                           vector_wanted=lambda w: True if cfg.worker(w).region == router.region else None)


def test_holders_shows_the_view_and_apart_from_it_what_the_edge_just_sent_without_changing_either():
    cfg, layout, shards, view = _world(pending_hold_ms=1000.0)
    _register(cfg, shards, view, "us-2", PROMPT, 64)  # a shared first 64 tokens
    router = Router(cfg, "us", view, now=0.0)
    clock = [0.0]
    edge = _edge(router, cfg, layout, clock)
    tokens = [int(t) for t in PROMPT[:1500]]
    before = describe_edge(edge, "holders", {"tokens": tokens})
    assert [h["worker"] for h in before["holders"]] == ["us-2"] and before["pending"] == []
    sent = router.decide(PROMPT[:1500], now=0.0)
    assert sent.worker == "us-2" and sent.claimed_tokens == 64
    router.on_first_token(sent.dispatch, now=0.3)  # credited from its first token
    clock[0] = 0.5
    after = describe_edge(edge, "holders", {"tokens": tokens})
    assert after["holders"] == before["holders"]
    # The pending ledger credits the longest own-region length <= 1500: 1280 (the long lengths
    # go on from the plan's longest, 1024, in steps of 1.25).
    assert after["pending"] == [{"worker": "us-2", "region": "us", "matched": 1280, "view_matched": 64}]
    assert after["chosen"] == sent.worker  # scored as the next decision would be
    held = len(router.pending)
    assert describe_edge(edge, "holders", {"tokens": tokens})["pending"] == after["pending"] and len(router.pending) == held
    # kvcompassctl sends long prompts packed as little-endian uint32: the same answer.
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    assert describe_edge(edge, "holders", {"tokens": packed}) == describe_edge(edge, "holders", {"tokens": tokens})
    with pytest.raises(ValueError, match="multiple of 4"):
        describe_edge(edge, "holders", {"tokens": packed[:-1]})


def test_queues_shows_each_workers_running_count_and_the_price_its_prefill_was_scored_at():
    cfg, layout, shards, view = _world({"us": 2, "eu": 1}, decode_stall_weight=0.25)
    router = Router(cfg, "us", view, now=0.0)
    edge = _edge(router, cfg, layout, [0.0])
    router.queues.set_local("us-0", 0.0, now=0.0, running=6)
    router.queues.set_local("us-1", 0.0, now=0.0, running=2)
    router.decide(PROMPT, now=0.0)
    workers = {w["worker"]: w for w in describe_edge(edge, "queues", {})["workers"]}
    assert {w: (q["running"], q["prefill_price"]) for w, q in workers.items()} == {
        "us-0": (6, 2.0), "us-1": (2, 1.5), "eu-0": (0, 1.5)}  # (eu-0: priced as us's least busy)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 400)), max_size=300))
def test_a_view_counts_the_entries_its_table_holds_after_records_not_only_its_first_snapshot(ops):
    table = LudoTable(64, seed=3)
    view = LudoView.from_snapshot(table.snapshot())  # an edge's view starts from an empty shard
    for insert, key in ops:
        if insert and table.get(key) is None:
            table.insert(key, key)
        elif not insert and table.get(key) is not None:
            table.remove(key)
        for blob in table.take_updates():  # records, or a snapshot after the table grew
            view.apply(blob)
    assert current_entries(view) == len(table)
    assert view.lookup_many(table.items()[0]).tolist() == table.items()[1].tolist()  # still the same view


async def test_a_running_edge_counts_one_view_per_event_loop_turn_with_the_same_answer():
    cfg, layout, shards, view = _world()
    _register(cfg, shards, view, "us-1", PROMPT, 1024)
    _register(cfg, shards, view, "eu-0", PROMPT[500:], 512)
    router = Router(cfg, "us", view, now=0.0)
    edge = SimpleNamespace(router=router, cfg=cfg, layout=layout, view=view, clock=lambda: 0.0,
                           sync=SimpleNamespace(requests=0), health=lambda: {"edge": "edge-us", "ready": True})
    turns = 0

    async def other_work():  # what the edge's requests would be doing meanwhile
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    paced = await describe_edge_paced(edge, "views", {})
    ticker.cancel()
    rows = paced["views"]
    assert rows == describe_edge(edge, "views", {})["views"]
    assert len(rows) == len(shards) * len(layout.groups) and turns >= len(rows)
    per_group = {}
    for row in rows:
        per_group[row["group"]] = per_group.get(row["group"], 0) + row["entries"]
    assert per_group == {t["group"]: t["entries"] for t in _merged_tables(shards)}
    status = await describe_edge_paced(edge, "status", {})
    assert status["views"] == rows and status["ready"] is True


def _merged_tables(shards):
    merged = {}
    for shard in shards:
        for t in shard.table_stats():
            merged.setdefault(t["group"], {"group": t["group"], "entries": 0})["entries"] += t["entries"]
    return list(merged.values())
