"""What a running node tells ``kvcompassctl``: an edge's views, levels, queues, beliefs,
holders and migrations; which queries each role answers.

Read-only: a holders query scores the prompt as a decision would (view and pending ledger)
without feeding the hot-prefix detector or changing the ledger.
"""

from __future__ import annotations

import asyncio

import numpy as np

from kvcompassd.core.events import Tier
from kvcompassd.core.ludo import LudoView, huge_page_view_stats

QUERIES = ("status", "views", "levels", "queues", "beliefs", "holders", "migrations", "lookup", "digest")
# What the other roles answer; anything else is refused, not answered with their status.
MAINTENANCE_QUERIES = ("status", "holders", "entries", "digest")
AGENT_QUERIES = ("status",)


def refusal(role: str, what: str, answered: tuple[str, ...]) -> dict:
    """The answer to a query this role does not answer (kvcompassctl reports it as an error)."""
    return {"error": f"unknown query {what!r} for {role}; it answers {', '.join(answered)}"}


def describe_edge(edge, what: str, args: dict) -> dict:
    if what not in QUERIES:
        raise ValueError(f"unknown query {what!r}; one of {', '.join(QUERIES)}")
    return _QUERIES[what](edge, args)


async def describe_edge_paced(edge, what: str, args: dict) -> dict:
    """``describe_edge`` as a running edge answers it: status and views count one view's
    entries per event-loop turn. Counting exports the view (O(slots), tens of ms per million
    slots: tools/bench_view_count.py), and an edge with a dozen large views must not hold its
    requests back for all of them at once."""
    if what not in ("status", "views"):
        return describe_edge(edge, what, args)
    rows = []
    for shard, group in _view_keys(edge):
        row = _view_row(edge, shard, group)  # read whole within one turn: a consistent row
        if row is not None:
            rows.append(row)
        await asyncio.sleep(0)
    if what == "views":
        return {"views": rows}
    return {**_status_head(edge), "views": rows}


def _status_head(edge) -> dict:
    pending = edge.router.pending
    head = {"mode": "edge", **edge.health(), "batches_applied": edge.view.batches_applied,
            # [sync] relay: the unit's batches this edge forwarded to its region's other edges
            "batches_relayed": getattr(edge, "batches_relayed", 0),
            "resyncs": edge.sync.requests,
            # gaps an idle stream's position announcement showed ([sync] position_heartbeat_ms)
            "position_gaps": getattr(edge.sync, "position_gaps", 0), "pending_keys": None if pending is None else len(pending),
            # the views' huge-page arena (kvcompassd edge --no-huge-page-views turns it off)
            "huge_page_views": huge_page_view_stats()}
    chooser = getattr(getattr(edge, "forwarder", None), "decode_chooser", None)
    if chooser is not None:  # a disaggregated fleet: where this edge sends the decodes
        head["decode"] = chooser.describe()
    return head


def _status(edge, args) -> dict:
    return {**_status_head(edge), "views": _views(edge, args)["views"]}


def _view_keys(edge) -> list[tuple[int, int]]:
    return [(shard, group) for shard, st in enumerate(edge.view.state) for group in sorted(st.views)]


def _view_row(edge, shard: int, group: int) -> dict | None:
    view = edge.view.view(shard, group)
    if view is None:  # replaced by a snapshot without that group meanwhile
        return None
    st = edge.view.state[shard]
    g = edge.layout.groups[group]
    entries = current_entries(view)
    return {
        "shard": shard,
        "group": group,
        "region": g.region,
        "workers": len(g.workers),
        "epoch": st.epoch,
        "seq": st.seq,
        "slots": view.slots,
        "entries": entries,
        "load": round(entries / view.slots, 4) if view.slots else None,
        "memory_bytes": view.memory_bytes,
        "bits_per_entry": round(8 * view.memory_bytes / entries, 1) if entries else None,
        "table_epoch": view.epoch,
    }


def _views(edge, args) -> dict:
    return {"views": [row for shard, group in _view_keys(edge) if (row := _view_row(edge, shard, group))]}


def current_entries(view: LudoView) -> int:
    """Occupied slots of a keyless view now. The view counts entries only in the snapshot it
    started from (update records carry no counts); its export counts the non-zero slots, as the
    maintenance unit's table would report them. O(slots): for inspection, not decisions."""
    return LudoView.from_snapshot(view.snapshot()).snapshot_entries


def _levels(edge, args) -> dict:
    plan = edge.router.plan
    return {"origin": edge.me.region,
            "toward": {g: list(plan.lengths_toward(edge.me.region, g)) for g in edge.cfg.region_names()},
            "registration": list(plan.registration_lengths())}


def _queues(edge, args) -> dict:
    now = edge.clock()
    q = edge.router.queues
    ages = q.ages(now=now)
    current = q.queue_ms(now=now)  # what the score uses now: values carried to now at their trend
    trends = q.trends()
    rates = edge.router.rates  # the rates the score and the charges use (core/rates.py)
    return {"workers": [{"worker": w, "region": edge.cfg.worker(w).region, "queue_ms": float(current[i]),
                         "reported_ms": float(q.queue_ms()[i]), "trend_ms_per_ms": round(float(trends[i]), 4),
                         "age_s": None if not np.isfinite(ages[i]) else round(float(ages[i]), 3),
                         "prefill_ms_per_token": round(rates.prefill_ms_per_token(i), 6),
                         "decode_ms_per_token": round(rates.decode_ms_per_token(i), 6),
                         # when VRAM frees up, [ms from now, free KV tokens] (None: nothing pinned
                         # or not reported; own region: its agents, others: their edges' broadcasts)
                         "room": None if (room := q.room(i, now=now)) is None
                         else [[round(ms, 3), free] for ms, free in room],
                         # the share of its VRAM its requests pin (from room, else as its engine
                         # said: a real SGLang's load report), which prices a copy there
                         "pinned_share": round(q.pinned_share(i, now=now), 4),
                         # requests it was running at its latest reading (own region; 0 for the
                         # others), and the prefill's price for the decodes it pauses
                         # (as the latest decision scored it; 1 when off)
                         "running": int(q.running[i]),
                         "prefill_price": round(edge.router.prefill_price(i), 4),
                         # own region: whether its agent is sent the region's queue vector (it
                         # wants it while serving other regions; None for the other regions')
                         "vector_wanted": edge.vector_wanted(w)}
                        for i, w in enumerate(edge.layout.worker_ids)],
            # Per remote region, the selection correction queue_ms includes (QueueEstimates docstring).
            "correction_ms": {r: round(ms, 3) for r, ms in q.surprises(now=now).items()},
            # ... and the multiple of each send to that region it charges (the herd factor).
            "herd_factor": {r: round(k, 3) for r, k in q.herd_factors(now=now).items()}}


def _beliefs(edge, args) -> dict:
    values = edge.router.belief.values
    return {"workers": [{"worker": w, "belief": round(float(values[i]), 4)} for i, w in enumerate(edge.layout.worker_ids)]}


def _holders(edge, args) -> dict:
    if "tokens" in args:
        tokens = args["tokens"]
        if isinstance(tokens, bytes):  # little-endian uint32s: a long prompt in one wire value
            if len(tokens) % 4:
                raise ValueError("packed tokens must be a multiple of 4 bytes (little-endian uint32)")
            tokens = np.frombuffer(tokens, dtype="<u4").tolist()
        elif not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise ValueError("tokens must be a list of token ids, or packed little-endian uint32")
    elif isinstance(args.get("text"), str):
        tokens = edge.tokenizer.encode(args["text"])
    else:
        raise ValueError("holders needs 'tokens' or 'text'")
    if not tokens:
        raise ValueError("empty prompt")
    router = edge.router
    now = edge.clock()
    found = router.lookup.lookup(np.asarray(tokens, dtype=np.uint32))
    # Prompts this edge just sent, credited until the view shows them, as a decision would.
    matched, tier = found.matched.copy(), found.tier.copy()
    shown = router.pending_matches(tokens, matched, tier, now=now)
    if shown is None:
        shown = found.matched
    result = router.scorer.score(found.prompt_len, matched, tier, router.queues.queue_ms(now=now),
                                 router.belief.values, ablation=router.ablation)
    # Holders are what the view shows; pending, what the ledger adds beyond it (kept apart: the
    # view is what the rest of the fleet's edges read too).
    holders = [{"worker": w, "region": edge.cfg.worker(w).region, "matched": int(found.matched[i]),
                "tier": Tier(int(found.tier[i])).name}
               for i, w in enumerate(edge.layout.worker_ids) if found.matched[i] > 0]
    pending = [{"worker": w, "region": edge.cfg.worker(w).region, "matched": int(matched[i]),
                "view_matched": int(shown[i])}
               for i, w in enumerate(edge.layout.worker_ids) if matched[i] > shown[i]]
    top = [{"worker": t.worker, "total_ms": round(t.total, 3), "wan_ms": round(t.wan_ms, 3), "queue_ms": round(t.queue_ms, 3),
            "prefill_ms": round(t.prefill_ms, 3), "reload_ms": round(t.reload_ms, 3), "matched": t.matched,
            "tier": Tier(int(t.tier)).name, "belief": round(t.belief, 4)} for t in result.top(int(args.get("top", 5)))]
    return {"prompt_tokens": found.prompt_len, "lambda": result.lam, "chosen": result.worker,
            "holders": holders, "pending": pending, "candidates": top}


def _lookup(edge, args) -> dict:
    """Raw view values for given keys of one (shard, group): for consistency checks."""
    shard, group = int(args.get("shard", -1)), int(args.get("group", -1))
    view = edge.view.view(shard, group) if 0 <= shard < edge.cfg.shards else None
    if view is None:
        raise ValueError(f"no view for shard {shard} group {group}")
    keys = args.get("keys", [])
    return {"shard": shard, "group": group, "position": list(edge.view.position(shard)),
            "values": view.lookup_many(np.asarray(keys, dtype=np.uint64)).tolist()}


def _digest(edge, args) -> dict:
    """A shard's position and the CRC-32 of each group's view as a snapshot blob: equal to the
    maintenance unit's ``digest`` answer exactly when the view equals the shard (any size)."""
    shard = int(args.get("shard", -1))
    if not 0 <= shard < edge.cfg.shards:
        raise ValueError(f"no shard {shard}")
    return {"shard": shard, "position": list(edge.view.position(shard)),
            "groups": {str(g): crc for g, crc in edge.view.digests(shard).items()}}


def _migrations(edge, args) -> dict:
    hot = [{"trigger": trigger, "outcome": outcome, "misses": n}
           for (trigger, outcome), n in edge.router.hot.hot_misses.items()]
    return {"migrations": list(edge.forwarder.migrations[-50:]), "hot_prefix_misses": hot}


_QUERIES = {
    "status": _status,
    "views": _views,
    "levels": _levels,
    "queues": _queues,
    "beliefs": _beliefs,
    "holders": _holders,
    "migrations": _migrations,
    "lookup": _lookup,
    "digest": _digest,
}
