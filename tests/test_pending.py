"""The edge's ledger of prompts it sent to workers, credited until its view shows them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.events import Tier
from kvcompassd.core.pending import PendingHoldings, PendingHoldingsError

# Two worker groups: group 0 (workers 0, 1) is read at 32, 64, 128; group 1 (worker 2) at 64, 96.
GROUP_LENGTHS = np.array([[32, 64, 128], [64, 96, 0]], dtype=np.int64)
QUERY_LENGTHS = np.array([32, 64, 96, 128], dtype=np.int64)
WORKER_GROUP = np.array([0, 0, 1])
KEYS = np.array([1001, 1002, 1003, 1004], dtype=np.uint64)  # a prompt's keys at QUERY_LENGTHS


def _ledger(hold_s=1.0):
    return PendingHoldings(GROUP_LENGTHS, QUERY_LENGTHS, WORKER_GROUP, hold_s=hold_s)


def _view(matched=(0, 0, 0)):
    return np.array(matched, dtype=np.int64), np.array([Tier.VRAM if m else 0 for m in matched], dtype=np.uint8)


def test_a_sent_prompt_is_credited_at_its_workers_lengths_once_ready():
    ledger = _ledger()
    assert ledger.note_sent(1, KEYS, 130, 0, ready_at=0.2, now=0.0) == 3  # 32, 64, 128: group 0's lengths
    matched, tier = _view()
    assert None is ledger.overlay(KEYS.tolist(), matched, tier, now=0.1)  # still being computed
    assert matched.tolist() == [0, 0, 0]
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.3) is not None
    assert matched.tolist() == [0, 128, 0] and tier.tolist() == [0, Tier.VRAM, 0]
    # A follow-up sharing only the first 64 tokens is credited 64.
    matched, tier = _view()
    assert ledger.overlay([1001, 1002, 7777, 8888], matched, tier, now=0.3) is not None
    assert matched.tolist() == [0, 64, 0]



def test_a_prompt_is_credited_from_its_prefills_start_until_hold_s_after_its_end():
    """Prefills run in admission order and match at their start: a request sent to the worker
    once the prompt's prefill has started waits for it and finds it; before, others may come
    between and evict it."""
    ledger = _ledger(hold_s=1.0)
    assert ledger.note_sent(1, KEYS, 130, 0, starts_at=0.3, ready_at=0.45, now=0.0) == 3
    matched, tier = _view()
    assert None is ledger.overlay(KEYS.tolist(), matched, tier, now=0.2)  # the queue ahead of it
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.35) is not None  # being computed
    assert matched.tolist() == [0, 128, 0]
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=1.4) is not None  # within hold_s of 0.45
    matched, tier = _view()
    assert None is ledger.overlay(KEYS.tolist(), matched, tier, now=1.46) and len(ledger) == 0
    for starts_at in (-0.1, 0.5):  # before now, after ready_at
        with pytest.raises(PendingHoldingsError, match="starts_at"):
            ledger.note_sent(1, KEYS, 130, 0, starts_at=starts_at, ready_at=0.45, now=0.0)


def test_only_lengths_beyond_the_views_match_and_within_the_prompt_are_noted():
    ledger = _ledger()
    assert ledger.note_sent(2, KEYS[:3], 100, 64, ready_at=0.0, now=0.0) == 1  # 96 only: 64 is shown
    assert ledger.note_sent(0, KEYS[:2], 64, 0, ready_at=0.0, now=0.0) == 2
    assert len(ledger) == 3


def test_an_entry_ends_once_the_view_shows_it():
    ledger = _ledger()
    ledger.note_sent(0, KEYS, 128, 0, ready_at=0.0, now=0.0)
    matched, tier = _view((64, 0, 0))  # the view caught up to 64: the 32 and 64 entries end
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.1) is not None
    assert matched.tolist() == [128, 0, 0] and len(ledger) == 1
    matched, tier = _view((128, 0, 0))
    assert None is ledger.overlay(KEYS.tolist(), matched, tier, now=0.2)
    assert len(ledger) == 0


def test_an_entry_expires_hold_s_after_it_was_ready_and_a_later_dispatch_refreshes_it():
    ledger = _ledger(hold_s=1.0)
    other = KEYS + np.uint64(100)
    ledger.note_sent(0, other, 128, 0, ready_at=0.5, now=0.0)
    ledger.note_sent(1, KEYS, 128, 0, ready_at=0.5, now=0.0)
    ledger.note_sent(1, KEYS, 128, 0, ready_at=1.2, now=1.0)  # the same prompt again: held anew
    matched, tier = _view()
    assert ledger.overlay(other.tolist(), matched, tier, now=1.6) is None  # held until 1.5 only
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=1.6) is not None
    assert matched.tolist() == [0, 128, 0] and len(ledger) == 3
    matched, tier = _view()
    assert None is ledger.overlay(KEYS.tolist(), matched, tier, now=2.2)
    assert len(ledger) == 0


def test_a_prefix_sent_to_two_workers_is_credited_to_the_later():
    ledger = _ledger()
    ledger.note_sent(0, KEYS, 128, 0, ready_at=0.0, now=0.0)
    ledger.note_sent(1, KEYS[:2], 64, 0, ready_at=0.1, now=0.1)  # shares the first 64 tokens
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.2) is not None
    assert matched.tolist() == [128, 64, 0]
    assert ledger.held_by(0) == 1 and ledger.held_by(1) == 2


def test_bad_arguments_are_refused():
    for hold in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(PendingHoldingsError):
            PendingHoldings(GROUP_LENGTHS, QUERY_LENGTHS, WORKER_GROUP, hold_s=hold)
    with pytest.raises(PendingHoldingsError):
        _ledger().note_sent(0, KEYS, 128, 0, ready_at=0.5, now=1.0)


# -- against a reference model ----------------------------------------------------------------

_note = st.tuples(st.just("note"), st.integers(0, 2), st.lists(st.integers(0, 5), min_size=4, max_size=4),
                  st.integers(1, 140), st.sampled_from([0, 32, 64, 96, 128]), st.floats(0, 0.5))
_look = st.tuples(st.just("look"), st.lists(st.integers(0, 5), min_size=4, max_size=4),
                  st.lists(st.sampled_from([0, 32, 64, 96, 128]), min_size=3, max_size=3))
_fail = st.tuples(st.just("fail"), st.integers(0, 2))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.floats(0, 0.4), st.one_of(_note, _look, _fail)), max_size=30))
def test_the_ledger_matches_a_map_of_latest_dispatches(ops):
    """Credited = for each of the request's keys whose latest dispatch is ready and unexpired
    and not yet shown by the view, that dispatch's worker at the key's length, if longer than
    the view's match. Keys are tagged by length, so that one key never names two lengths."""
    hold = 0.6
    ledger = _ledger(hold_s=hold)
    query = QUERY_LENGTHS.tolist()
    latest: dict[int, tuple[int, float, float]] = {}  # key -> (worker, ready, expires)
    now = 0.0
    for step, op in ops:
        now += step
        if op[0] == "note":
            _, worker, ids, prompt_len, shown, delay = op
            keys = np.array([1000 * n + i for n, i in zip(query, ids)], dtype=np.uint64)
            ledger.note_sent(worker, keys, prompt_len, shown, ready_at=now + delay, now=now)
            for n in GROUP_LENGTHS[WORKER_GROUP[worker]].tolist():
                if shown < n <= prompt_len:
                    latest[int(keys[query.index(n)])] = (worker, now + delay, now + delay + hold)
        elif op[0] == "fail":
            ledger.forget(op[1])
            latest = {k: v for k, v in latest.items() if v[0] != op[1]}
        else:
            _, ids, view = op
            keys = [1000 * n + i for n, i in zip(query, ids)]
            matched = np.array(view, dtype=np.int64)
            tier = np.where(matched > 0, Tier.DRAM, 0).astype(np.uint8)
            expected = matched.copy()
            for at, key in enumerate(keys):
                if key not in latest:
                    continue
                worker, ready, expires = latest[key]
                if ready > now or expires <= now:
                    continue
                if view[worker] >= query[at]:
                    del latest[key]
                else:
                    expected[worker] = max(expected[worker], query[at])
            # holds_any (which the Router asks first, to spare the arrays) is False only where
            # overlay raises nothing and ends nothing.
            held, before = ledger.holds_any(keys, now=now), len(ledger)
            shown = ledger.overlay(keys, matched, tier, now=now)
            assert held or (shown is None and expected.tolist() == list(view) and len(ledger) == before)
            assert matched.tolist() == expected.tolist()
            assert (shown is not None) == bool((expected > np.array(view)).any())
            assert shown is None or shown.tolist() == list(view)
            assert all(tier[w] == (Tier.VRAM if expected[w] > view[w] else (Tier.DRAM if view[w] else 0))
                       for w in range(3))
        live = sum(expires > now for _, _, expires in latest.values())
        assert live <= len(ledger) <= len(latest)
    # Memory: once every dispatch has expired, the next call leaves nothing behind.
    matched, tier = _view()
    ledger.overlay([], matched, tier, now=now + 0.5 + hold)
    assert len(ledger) == 0


def test_a_failed_worker_is_forgotten():
    ledger = _ledger()
    ledger.note_sent(0, KEYS + np.uint64(100), 128, 0, ready_at=0.0, now=0.0)
    ledger.note_sent(1, KEYS, 128, 0, ready_at=0.0, now=0.0)
    assert ledger.forget(0) == 3 and len(ledger) == 3
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.1) is not None
    assert matched.tolist() == [0, 128, 0]
    assert ledger.forget(2) == 0


def test_a_first_token_credits_the_prompt_from_then_when_sooner_than_estimated():
    ledger = _ledger(hold_s=1.0)
    # Estimated ready in 2 s (a long modelled queue); the worker was faster: first token at 0.01.
    ledger.note_sent(1, KEYS, 130, 0, ready_at=2.0, now=0.0, dispatch=7)
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.05) is None
    assert ledger.mark_ready(7, now=0.01)
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.05) is not None
    assert matched.tolist() == [0, 128, 0]
    # It holds for hold_s from the first token, not from the estimate.
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=1.02) is None
    assert not ledger.mark_ready(7, now=0.02)  # once


def test_mark_ready_leaves_keys_a_later_dispatch_took_and_estimates_already_past():
    ledger = _ledger(hold_s=1.0)
    ledger.note_sent(0, KEYS, 130, 0, ready_at=2.0, now=0.0, dispatch=1)
    ledger.note_sent(1, KEYS, 130, 0, ready_at=3.0, now=0.0, dispatch=2)  # the same prompt, later
    assert not ledger.mark_ready(1, now=0.01)  # worker 1 owns those keys now
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.5) is None
    ledger.note_sent(2, KEYS, 130, 0, ready_at=0.1, now=0.0, dispatch=3)
    assert not ledger.mark_ready(3, now=0.2)  # already credited from its estimate
    ledger.drop_dispatch(2)
    assert not ledger.mark_ready(2, now=0.3)
    assert ledger.forget(2) == 2


# -- from_first_token: credit what the edge observed ------------------------------------------

def _observed(hold_s=1.0, **kw):
    return PendingHoldings(GROUP_LENGTHS, QUERY_LENGTHS, WORKER_GROUP, hold_s=hold_s, from_first_token=True,
                           refute_misses=True, **kw)


def test_a_dispatch_is_credited_from_its_first_token_not_from_the_estimate():
    ledger = _observed()
    ledger.note_sent(1, KEYS, 130, 0, ready_at=0.2, now=0.0, dispatch=7)
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.5) is None  # past the estimate: still nothing
    assert ledger.mark_ready(7, now=0.6)
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=0.6) is not None
    assert matched.tolist() == [0, 128, 0]
    matched, tier = _view()
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=1.6) is None  # hold_s from the first token
    # Without an id there is nothing to wait for: the estimate speaks, as before.
    ledger.note_sent(0, KEYS, 64, 0, ready_at=2.0, now=2.0)
    assert ledger.overlay(KEYS.tolist(), matched, tier, now=2.0) is not None and matched.tolist() == [64, 0, 0]


def test_a_dispatch_that_ends_without_a_first_token_is_never_credited_and_leaves_nothing():
    ledger = _observed()
    ledger.note_sent(1, KEYS, 130, 0, ready_at=0.0, now=0.0, dispatch=1)
    ledger.note_sent(0, KEYS[:1], 32, 0, ready_at=0.0, now=0.0, dispatch=2)  # takes the 32 key
    ledger.drop_dispatch(1)
    assert len(ledger) == 1  # worker 0's 32, still awaiting dispatch 2
    assert not ledger.mark_ready(1, now=0.1)
    assert ledger.refute(2, 0) == 0 and len(ledger) == 0


def test_refute_ends_the_credits_beyond_what_was_reused_that_started_before_the_send():
    ledger = _observed()
    ledger.note_sent(0, KEYS, 128, 0, ready_at=0.0, now=0.0, dispatch=1)
    ledger.mark_ready(1, now=0.1)  # worker 0 credited 32, 64, 128 from 0.1
    matched, tier = _view()
    ledger.overlay(KEYS.tolist(), matched, tier, now=0.2)
    assert matched.tolist() == [128, 0, 0]
    # Dispatch 2 goes to worker 0 on that credit (128) and finds only 32 there.
    ledger.note_sent(0, KEYS, 128, 128, ready_at=0.2, now=0.2, dispatch=2)
    assert ledger.refute(2, 32) == 2  # 64 and 128 end; 32 was reused
    matched, tier = _view()
    ledger.overlay(KEYS.tolist(), matched, tier, now=0.3)
    assert matched.tolist() == [32, 0, 0]
    assert ledger.refuted == 2 and ledger.refute(2, 0) == 0  # once


def test_refute_leaves_full_hits_later_first_tokens_and_other_workers_credits():
    ledger = _observed()
    ledger.note_sent(0, KEYS, 128, 0, ready_at=0.0, now=0.0, dispatch=1)
    ledger.mark_ready(1, now=0.1)
    ledger.note_sent(0, KEYS, 128, 128, ready_at=0.2, now=0.2, dispatch=2)
    assert ledger.refute(2, 128) == 0  # a full hit: the worker keeps its credit (and its group)
    # Dispatch 3 is sent on the credit; meanwhile dispatch 4 recomputes the prompt there and its
    # first token comes back before dispatch 3's response: that credit is newer than the miss.
    ledger.note_sent(0, KEYS, 128, 128, ready_at=0.3, now=0.3, dispatch=3)
    ledger.forget(0)
    ledger.note_sent(0, KEYS, 128, 0, ready_at=0.3, now=0.3, dispatch=4)
    ledger.mark_ready(4, now=0.35)
    assert ledger.refute(3, 0) == 0
    # Credits are per worker: a miss on worker 2 says nothing about worker 0's for the same keys.
    ledger.note_sent(2, KEYS, 128, 64, ready_at=0.4, now=0.4, dispatch=5)
    assert ledger.refute(5, 0) == 0
    matched, tier = _view()
    ledger.overlay(KEYS.tolist(), matched, tier, now=0.5)
    assert matched[0] == 128


def test_open_dispatches_are_bounded():
    ledger = _observed(max_open=2)
    for d in range(5):
        ledger.note_sent(d % 3, KEYS + np.uint64(10 * d), 128, 32, ready_at=0.0, now=0.0, dispatch=d)
    assert len(ledger._by_dispatch) == 2 and len(ledger._claims) == 2
    assert len(ledger) <= 2 * 3  # the forgotten dispatches' awaiting keys went with them
    with pytest.raises(PendingHoldingsError):
        _observed(max_open=0)
    with pytest.raises(PendingHoldingsError):
        PendingHoldings(GROUP_LENGTHS, QUERY_LENGTHS, WORKER_GROUP, hold_s=1.0, from_first_token=1)


_onote = st.tuples(st.just("note"), st.integers(0, 2), st.lists(st.integers(0, 3), min_size=4, max_size=4),
                   st.integers(1, 140), st.sampled_from([0, 32, 64, 96, 128]))
_omark = st.tuples(st.just("mark"), st.integers(0, 12))
_orefute = st.tuples(st.just("refute"), st.integers(0, 12), st.sampled_from([0, 32, 64, 96, 128]))
_odrop = st.tuples(st.just("drop"), st.integers(0, 12))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.floats(0, 0.3), st.one_of(_onote, _omark, _orefute, _odrop, _look, _fail)),
                    max_size=40))
def test_the_observed_ledger_matches_a_reference_model(ops):
    """With from_first_token: a dispatch's keys are credited from its first token for hold_s,
    each key to its latest dispatch; a dispatch ending without a first token releases the keys
    it still owns; ``refute`` ends the dispatch's worker's credits beyond the reused length that
    started no later than the dispatch was sent."""
    hold = 0.6
    ledger = _observed(hold_s=hold)
    query = QUERY_LENGTHS.tolist()
    inf = float("inf")
    latest: dict[int, tuple] = {}  # key -> (worker, ready, expires, tag)
    awaiting: dict[int, int] = {}  # dispatch -> worker, until its first token or end
    claims: dict[int, tuple] = {}  # dispatch -> (worker, sent, [(length, key)])
    now, next_dispatch = 0.0, 0

    def release(d):
        for key in [k for k, v in latest.items() if v[3] == ("await", d)]:
            del latest[key]

    for step, op in ops:
        now += step
        if op[0] == "note":
            _, worker, ids, prompt_len, shown = op
            d, next_dispatch = next_dispatch, next_dispatch + 1
            keys = np.array([1000 * n + i for n, i in zip(query, ids)], dtype=np.uint64)
            ledger.note_sent(worker, keys, prompt_len, shown, ready_at=now, now=now, dispatch=d)
            reads = [n for n in GROUP_LENGTHS[WORKER_GROUP[worker]].tolist() if n > 0]
            if shown > 0:
                claims[d] = (worker, now, [(n, int(keys[query.index(n)])) for n in reads if n <= shown])
            noted = [n for n in reads if shown < n <= prompt_len]
            for n in noted:
                latest[int(keys[query.index(n)])] = (worker, inf, inf, ("await", d))
            if noted:
                awaiting[d] = worker
        elif op[0] == "mark":
            d = op[1]
            ledger.mark_ready(d, now=now)
            if awaiting.pop(d, None) is not None:
                for key, v in list(latest.items()):
                    if v[3] == ("await", d):
                        latest[key] = (v[0], now, now + hold, ("ready", d))
        elif op[0] == "refute":
            _, d, reused = op
            ledger.refute(d, reused)
            if awaiting.pop(d, None) is not None:
                release(d)
            claim = claims.pop(d, None)
            if claim is not None:
                worker, sent, credited = claim
                for n, key in credited:
                    v = latest.get(key)
                    if n > reused and v is not None and v[0] == worker and v[1] <= sent:
                        del latest[key]
        elif op[0] == "drop":
            ledger.drop_dispatch(op[1])
            claims.pop(op[1], None)
            if awaiting.pop(op[1], None) is not None:
                release(op[1])
        elif op[0] == "fail":
            ledger.forget(op[1])
            latest = {k: v for k, v in latest.items() if v[0] != op[1]}
            awaiting = {d: w for d, w in awaiting.items() if w != op[1]}
            claims = {d: c for d, c in claims.items() if c[0] != op[1]}
        else:
            _, ids, view = op
            keys = [1000 * n + i for n, i in zip(query, ids)]
            matched = np.array(view, dtype=np.int64)
            tier = np.where(matched > 0, Tier.DRAM, 0).astype(np.uint8)
            expected = matched.copy()
            for at, key in enumerate(keys):
                v = latest.get(key)
                if v is None or v[1] > now or v[2] <= now:
                    continue
                if view[v[0]] >= query[at]:
                    del latest[key]
                else:
                    expected[v[0]] = max(expected[v[0]], query[at])
            ledger.overlay(keys, matched, tier, now=now)
            assert matched.tolist() == expected.tolist()
        live = sum(v[2] > now for v in latest.values())
        assert live <= len(ledger) <= len(latest)
