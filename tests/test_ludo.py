"""Ludo table and view (kvcompassd.core.ludo) against a dict oracle.

The view must return the oracle's value for every present key whatever snapshot it started from,
as long as it was then fed every blob taken after that snapshot; bad input must raise a LudoError
subclass and leave the view exactly as it was.
"""

from __future__ import annotations

import gc
import itertools
import random
import struct
import zlib
from array import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompassd.core.ludo import (
    EDIT_CHANGED,
    EDIT_REFUSED,
    EDIT_UNCHANGED,
    KEY_LIMIT,
    LudoCorruptError,
    LudoDuplicateKeyError,
    LudoEpochError,
    LudoError,
    LudoForeignError,
    LudoKeyRangeError,
    LudoMissingKeyError,
    LudoTable,
    LudoValueRangeError,
    LudoVersionError,
    LudoView,
    RoutedTables,
    TablesEditor,
    apply_batch,
    blob_is_snapshot,
    peek_blob,
)
from kvcompassd.core.ludo import BatchApplyError, huge_page_view_stats, set_huge_page_views

HEADER = 72
KEYS = st.integers(0, KEY_LIMIT - 1)
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "insert", "insert", "update", "remove", "snapshot", "take"]), KEYS,
              st.integers(1, 2**32 - 1)),
    max_size=250,
)


def fill(table: LudoTable, n: int, rng: random.Random, value_bits: int = 32) -> dict[int, int]:
    oracle: dict[int, int] = {}
    while len(oracle) < n:
        key = rng.randrange(KEY_LIMIT)
        if key not in oracle:
            oracle[key] = rng.randrange(1, 1 << value_bits)
    table.insert_many(list(oracle), list(oracle.values()))
    return oracle


def view_matches(view: LudoView, oracle: dict[int, int]) -> bool:
    keys = np.array(list(oracle), dtype=np.uint64)
    want = np.array(list(oracle.values()), dtype=np.uint64)
    return bool(np.array_equal(view.lookup_many(keys), want))


def synced_view(table: LudoTable) -> LudoView:
    view = LudoView.from_snapshot(table.snapshot())
    table.take_updates()  # everything pending is already in the snapshot
    return view


def reseal(blob: bytes) -> bytes:
    """Recompute a blob's CRC-32 after deliberately editing it (bytes [0,64) + payload)."""
    crc = zlib.crc32(blob[64:64] + blob[:64] + blob[HEADER:])
    return blob[:64] + struct.pack("<I", crc) + blob[68:]


# ---------------------------------------------------------------------------- oracle properties


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, fingerprint_bits=st.sampled_from([0, 6]), value_bits=st.sampled_from([32, 64]))
def test_views_from_any_snapshot_follow_the_oracle(ops, fingerprint_bits, value_bits):
    table = LudoTable(8, value_bits=value_bits, fingerprint_bits=fingerprint_bits, seed=99)
    oracle: dict[int, int] = {}
    blobs: list[bytes] = []
    starts: list[tuple[bytes, int, dict[int, int]]] = [(table.snapshot(), 0, {})]  # (snapshot, blobs before it)
    for op, key, value in ops:
        present = list(oracle)
        if op == "insert":
            if key in oracle:
                with pytest.raises(LudoDuplicateKeyError):
                    table.insert(key, value)
            else:
                table.insert(key, value)
                oracle[key] = value
        elif op in ("update", "remove") and present:
            target = present[key % len(present)]
            if op == "update":
                table.update(target, value)
                oracle[target] = value
            else:
                table.remove(target)
                del oracle[target]
        elif op == "snapshot":
            starts.append((table.snapshot(), len(blobs), dict(oracle)))
        elif op == "take":
            blobs.extend(table.take_updates())
    blobs.extend(table.take_updates())

    assert len(table) == len(oracle)
    for key, value in oracle.items():
        assert table.get(key) == value and key in table
    for snapshot, first, oracle_then in starts:
        view = LudoView.from_snapshot(snapshot)
        assert view_matches(view, oracle_then)  # the snapshot alone is its moment's state
        for blob in blobs[first:]:
            view.apply(blob)
        assert view.epoch == table.epoch
        assert view_matches(view, oracle)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_reapplying_any_blob_is_harmless(ops):
    table = LudoTable(16, seed=5)
    view = synced_view(table)
    oracle: dict[int, int] = {}
    seen: list[bytes] = []
    for op, key, value in ops:
        if op == "insert" and key not in oracle:
            table.insert(key, value)
            oracle[key] = value
        elif op == "remove" and oracle:
            target = list(oracle)[key % len(oracle)]
            table.remove(target)
            del oracle[target]
        elif op == "update" and oracle:
            target = list(oracle)[key % len(oracle)]
            table.update(target, value)
            oracle[target] = value
        for blob in table.take_updates():
            view.apply(blob)
            view.apply(blob)  # twice in a row
            seen.append(blob)
        if seen and op == "take":  # an old blob of the current epoch again, then catch up
            current = [b for b in seen if peek_blob(b)[2] == view.epoch]
            view.apply(current[key % len(current)])
            for blob in current[current.index(current[key % len(current)]) + 1:]:
                view.apply(blob)
    assert view_matches(view, oracle)


@settings(max_examples=60, deadline=None)
@given(present=st.sets(KEYS, max_size=300), probes=st.lists(KEYS, max_size=100))
def test_get_is_exact_for_present_and_absent_keys(present, probes):
    table = LudoTable(4, seed=1)
    for key in present:
        table.insert(key, (key % 1000) + 1)
    for key in present:
        assert table.get(key) == (key % 1000) + 1
    for key in probes:
        assert table.get(key) == ((key % 1000) + 1 if key in present else None)
        assert (key in table) == (key in present)
    values, found = table.get_many(np.array(probes + sorted(present), dtype=np.uint64))
    assert found.tolist() == [k in present for k in probes + sorted(present)]
    assert [int(v) for v, f in zip(values, found) if f] == [(k % 1000) + 1 for k in probes + sorted(present) if k in present]


def test_batches_match_single_operations_and_lookup_many_matches_lookup():
    rng = random.Random(3)
    table = LudoTable(1000, seed=4)
    view = synced_view(table)
    oracle = fill(table, 3000, rng)
    keys = list(oracle)
    table.update_many(keys[:500], [7] * 500)
    table.remove_many(keys[500:1000])
    for key in keys[:500]:
        oracle[key] = 7
    for key in keys[500:1000]:
        del oracle[key]
    for blob in table.take_updates():
        view.apply(blob)
    assert view_matches(view, oracle)
    probe = np.array(keys + [rng.randrange(KEY_LIMIT) for _ in range(500)], dtype=np.uint64)
    assert view.lookup_many(probe).tolist() == [view.lookup(int(k)) for k in probe]
    assert view.lookup_many(np.zeros(0, dtype=np.uint64)).size == 0


def test_growth_bumps_epoch_ships_a_snapshot_and_old_epoch_records_are_refused():
    rng = random.Random(8)
    table = LudoTable(32, seed=12)
    view = synced_view(table)
    oracle = fill(table, 20, rng)
    (records,) = table.take_updates()
    assert peek_blob(records)[0] == "records"
    view.apply(records)
    epoch = table.epoch
    oracle.update(fill(table, 400, rng))  # far past capacity: grows
    assert table.epoch > epoch
    (snapshot,) = table.take_updates()
    assert peek_blob(snapshot) == ("snapshot", 12, table.epoch)
    view.apply(snapshot)
    assert view.epoch == table.epoch and view_matches(view, oracle)
    assert_rejected_unchanged(view, records, LudoEpochError)  # records of the epoch before the grow
    old_view_snapshot = snapshot
    oracle.update(fill(table, 2000, rng))
    for blob in table.take_updates():
        view.apply(blob)
    with pytest.raises(LudoEpochError):
        view.apply(old_view_snapshot)  # stale snapshot would roll the view back
    assert view_matches(view, oracle)


def test_overflow_map_grows_with_online_inserts():
    """Seeds above 30 live in the view's overflow map; it must grow, not lose entries."""
    rng = random.Random(21)
    table = LudoTable(40000, max_load=0.95, seed=77)
    view = synced_view(table)
    assert view.overflow_count == 0
    small_capacity = view.overflow_capacity
    memory_before = view.memory_bytes
    oracle = fill(table, 37000, rng)
    for blob in table.take_updates():
        view.apply(blob)
    assert view.epoch == 1  # no rebuild: the map grew through records alone
    assert table.overflow_buckets > small_capacity
    assert view.overflow_count == table.overflow_buckets
    assert view.overflow_capacity > small_capacity
    assert view.memory_bytes > memory_before
    assert view_matches(view, oracle)
    for _ in range(6):  # churn at high load: buckets enter and leave the map many times
        fresh = fill(LudoTable(1, seed=0), 3000, rng)  # just a source of new random keys
        table.insert_many(list(fresh), list(fresh.values()))
        oracle.update(fresh)
        gone = rng.sample(list(oracle), 3000)
        table.remove_many(gone)
        for key in gone:
            del oracle[key]
        for blob in table.take_updates():
            view.apply(blob)
        assert view.overflow_count == table.overflow_buckets
        assert view_matches(view, oracle)
    removed = list(oracle)[:20000]  # emptier buckets need smaller seeds: entries leave the map
    table.remove_many(removed)
    for key in removed:
        del oracle[key]
    for blob in table.take_updates():
        view.apply(blob)
    assert view.overflow_count == table.overflow_buckets
    assert view_matches(view, oracle)


def test_tables_side_by_side_do_not_interfere():
    rng = random.Random(2)
    a, b = LudoTable(100, seed=1), LudoTable(100, seed=2, value_bits=64)
    va, vb = synced_view(a), synced_view(b)
    oa, ob = fill(a, 300, rng), fill(b, 300, rng, value_bits=64)
    for blob in a.take_updates():
        va.apply(blob)
        with pytest.raises(LudoForeignError):
            vb.apply(blob)
    for blob in b.take_updates():
        vb.apply(blob)
    assert view_matches(va, oa) and view_matches(vb, ob)


# ---------------------------------------------------------------------------- fingerprints


def false_hit_rate(view: LudoView, present: set[int], rng: np.random.Generator, n: int) -> float:
    probes = rng.integers(0, KEY_LIMIT, size=n, dtype=np.uint64)
    probes = probes[~np.isin(probes, np.array(sorted(present), dtype=np.uint64))]
    return float(np.count_nonzero(view.lookup_many(probes))) / probes.size


def test_fingerprints_reject_absent_keys_at_about_two_to_the_minus_d():
    rates = {}
    for bits in (0, 4, 8):
        table = LudoTable(50000, fingerprint_bits=bits, max_load=0.95, seed=31)
        oracle = fill(table, 45000, random.Random(bits))
        view = synced_view(table)
        assert view_matches(view, oracle)  # fingerprints never reject a present key
        rates[bits] = false_hit_rate(view, set(oracle), np.random.default_rng(bits), 400_000)
    load = 45000 / table.slots
    assert 0.8 * load < rates[0] < 1.05 * load  # without fingerprints: any occupied slot answers
    for bits in (4, 8):
        expected = rates[0] * 2.0**-bits
        assert 0.5 * expected < rates[bits] < 2.0 * expected, (bits, rates)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("key", [KEY_LIMIT, 2**64, -1, 1.5, "7", None, True])
def test_out_of_range_keys_are_refused(key):
    table = LudoTable(10)
    table.insert(5, 1)
    view = synced_view(table)
    for call in (lambda: table.insert(key, 1), lambda: table.update(key, 1), lambda: table.remove(key),
                 lambda: table.get(key), lambda: view.lookup(key)):
        with pytest.raises(LudoKeyRangeError):
            call()
    assert key not in table and len(table) == 1


def test_bad_values_and_presence_errors():
    table = LudoTable(10, value_bits=32)
    table.insert(1, 2**32 - 1)
    for value in (0, 2**32, -3, 1.0):
        with pytest.raises(LudoValueRangeError):
            table.insert(2, value)
        with pytest.raises(LudoValueRangeError):
            table.update(1, value)
    with pytest.raises(LudoDuplicateKeyError):
        table.insert(1, 5)
    with pytest.raises(LudoMissingKeyError):
        table.update(2, 5)
    with pytest.raises(LudoMissingKeyError):
        table.remove(2)
    wide = LudoTable(10, value_bits=64)
    wide.insert(1, 2**64 - 1)
    assert wide.get(1) == 2**64 - 1 and table.get(1) == 2**32 - 1


def test_batches_validate_ranges_before_applying_anything():
    table = LudoTable(10)
    table.insert(1, 1)
    table.take_updates()
    for keys, values in (([2, 3, KEY_LIMIT], [1, 1, 1]), ([2, 3, -1], [1, 1, 1]), ([2, 3, 4], [1, 0, 1]),
                         ([2, 3, 4], [1, 1, 2**32]), ([2, 3], [1]), ([[2]], [[1]])):
        with pytest.raises(LudoError):
            table.insert_many(keys, values)
    assert len(table) == 1 and table.take_updates() == []
    with pytest.raises(LudoDuplicateKeyError, match="index 1"):
        table.insert_many([2, 1, 3], [1, 1, 1])
    assert 2 in table and 3 not in table  # applied in order up to the failure
    with pytest.raises(LudoMissingKeyError):
        table.remove_many([2, 2])
    with pytest.raises(LudoKeyRangeError):
        synced_view(table).lookup_many(np.array([1, 2**63], dtype=np.uint64))


@pytest.mark.parametrize("args", [dict(value_bits=16), dict(fingerprint_bits=17), dict(max_load=0.99),
                                  dict(max_load=0), dict(seed=-1)])
def test_bad_table_parameters(args):
    with pytest.raises(LudoError):
        LudoTable(100, **args)
    with pytest.raises(LudoError):
        LudoTable(0)


@pytest.fixture(scope="module")
def world():
    """A table, a view in sync with it, a snapshot and a record blob of the current epoch."""
    rng = random.Random(13)
    table = LudoTable(400, fingerprint_bits=5, seed=42)
    oracle = fill(table, 300, rng)
    snapshot = table.snapshot()
    table.take_updates()
    more = fill(table, 50, rng)
    (records,) = table.take_updates()
    oracle.update(more)
    return table, oracle, snapshot, records


def probe_answers(view: LudoView) -> np.ndarray:
    return view.lookup_many(np.random.default_rng(0).integers(0, KEY_LIMIT, 3000, dtype=np.uint64))


def assert_rejected_unchanged(view: LudoView, blob: object, error: type[Exception] = LudoError) -> None:
    before, epoch, memory = probe_answers(view), view.epoch, view.memory_bytes
    with pytest.raises(error):
        view.apply(blob)  # type: ignore[arg-type]
    assert np.array_equal(probe_answers(view), before)
    assert (view.epoch, view.memory_bytes) == (epoch, memory)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_or_truncated_blobs_are_refused_without_damage(world, data):
    table, oracle, snapshot, records = world
    view = LudoView.from_snapshot(snapshot)
    blob = data.draw(st.sampled_from([snapshot, records]))
    damage = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if damage == "flip":
        at = data.draw(st.integers(0, len(blob) - 1))
        bit = data.draw(st.integers(0, 7))
        bad = blob[:at] + bytes([blob[at] ^ (1 << bit)]) + blob[at + 1:]
    elif damage == "truncate":
        bad = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        bad = blob + data.draw(st.binary(min_size=1, max_size=16))
    assert_rejected_unchanged(view, bad)
    with pytest.raises(LudoError):
        LudoView.from_snapshot(bad)
    view.apply(records)
    assert view_matches(view, oracle)


def test_specific_bad_blobs_raise_clear_errors(world):
    table, oracle, snapshot, records = world
    view = LudoView.from_snapshot(snapshot)
    assert_rejected_unchanged(view, b"", LudoCorruptError)
    assert_rejected_unchanged(view, b"NOPE" + records[4:], LudoCorruptError)
    assert_rejected_unchanged(view, "not bytes", LudoCorruptError)
    assert_rejected_unchanged(view, records[:HEADER + 3], LudoCorruptError)
    version = bytearray(records)
    version[4] = 9
    assert_rejected_unchanged(view, reseal(bytes(version)), LudoVersionError)
    future = bytearray(records)
    future[16:24] = struct.pack("<Q", view.epoch + 1)
    assert_rejected_unchanged(view, reseal(bytes(future)), LudoEpochError)
    geometry = bytearray(records)
    geometry[24:28] = struct.pack("<I", struct.unpack("<I", records[24:28])[0] + 1)
    assert_rejected_unchanged(view, reseal(bytes(geometry)), LudoCorruptError)
    other = LudoTable(400, fingerprint_bits=5, seed=43)
    other.insert(1, 1)
    assert_rejected_unchanged(view, other.take_updates()[0], LudoForeignError)
    assert_rejected_unchanged(view, other.snapshot(), LudoForeignError)
    with pytest.raises(LudoCorruptError):
        LudoView.from_snapshot(records)  # a view starts from a snapshot only
    view.apply(records)
    assert view_matches(view, oracle)


def test_payload_errors_behind_a_valid_checksum_change_nothing(world):
    """A well-sealed blob whose LAST entry is bad must not have its earlier entries applied."""
    table, oracle, snapshot, records = world
    view = LudoView.from_snapshot(snapshot)
    nbk, nw = struct.unpack("<II", records[HEADER:HEADER + 8])
    assert nbk > 1
    entry = 4 + 2 + 16 + 8  # bucket index, seed, 4 x 32-bit values, 4 x 16-bit fingerprints
    last = HEADER + 8 + (nbk - 1) * entry
    bad_index = records[:last] + struct.pack("<I", 2**31) + records[last + 4:]
    assert_rejected_unchanged(view, reseal(bad_index), LudoCorruptError)
    bad_fp = bytearray(records)
    bad_fp[last + 22:last + 24] = struct.pack("<H", 1 << 5)  # wider than the 5 fingerprint bits
    assert_rejected_unchanged(view, reseal(bytes(bad_fp)), LudoCorruptError)
    if nw:
        words_at = HEADER + 8 + nbk * entry + (nw - 1) * 12
        bad_word = records[:words_at] + struct.pack("<I", 2**31) + records[words_at + 4:]
        assert_rejected_unchanged(view, reseal(bad_word), LudoCorruptError)
    short_count = records[:HEADER] + struct.pack("<II", nbk - 1, nw) + records[HEADER + 8:]
    assert_rejected_unchanged(view, reseal(short_count), LudoCorruptError)
    view.apply(records)
    assert view_matches(view, oracle)


def test_memory_accounting_counts_every_array():
    table = LudoTable(10000, seed=3)
    fill(table, 9000, random.Random(1))
    view = LudoView.from_snapshot(table.snapshot())
    assert view.snapshot_entries == 9000
    values_bytes = view.slots * 4
    assert values_bytes < view.memory_bytes < values_bytes * 1.3
    assert table.memory_bytes > view.memory_bytes + 9000 * 8  # the table also stores the keys


def test_items_export_and_view_snapshot_round_trip():
    """A table's items() is its exact content; a view's own snapshot builds an identical view."""
    rng = random.Random(17)
    table = LudoTable(3000, fingerprint_bits=4, seed=23)
    view = synced_view(table)
    oracle = fill(table, 2900, rng)
    for key in list(oracle)[:400]:
        table.remove(key)
        del oracle[key]
    for blob in table.take_updates():
        view.apply(blob)
    keys, values = table.items()
    assert dict(zip(keys.tolist(), values.tolist())) == oracle
    copy = LudoView.from_snapshot(view.snapshot())
    assert copy.snapshot_entries == len(oracle) and copy.epoch == view.epoch
    probes = np.random.default_rng(5).integers(0, KEY_LIMIT, 20000, dtype=np.uint64)
    assert np.array_equal(copy.lookup_many(probes), view.lookup_many(probes))
    oracle.update(fill(table, 50, rng))
    for blob in table.take_updates():
        copy.apply(blob)  # the copy keeps following the table's stream
    assert view_matches(copy, oracle)
    assert LudoTable(10).items()[0].size == 0


# ---------------------------------------------------------------------------- field edits

# Three ops on a 3-bit field: set it to 5, set it to 2 (only where it is non-zero), clear it
# (only where it is non-zero).
EDIT_FIELD, EDIT_NEEDS_HELD = bytes([5, 2, 0]), bytes([0, 1, 1])


@settings(max_examples=150, deadline=None)
@given(prior=st.dictionaries(st.integers(0, 30), st.integers(1, 2**32 - 1), max_size=20),
       edits=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2)), max_size=60),
       shift=st.sampled_from([0, 7, 29]))
def test_edit_fields_follows_the_oracle_in_order(prior, edits, shift):
    """Keys repeat within a batch: each edit sees the ones before it; the view follows too."""
    table = LudoTable(64, seed=3)
    if prior:
        table.insert_many(list(prior), list(prior.values()))
    view = synced_view(table)
    oracle, statuses = dict(prior), []
    mask = 7 << shift
    for key, op in edits:
        old = oracle.get(key, 0)
        field = (old & mask) >> shift
        if field == 0 and EDIT_NEEDS_HELD[op]:
            statuses.append(EDIT_REFUSED)
        elif field == EDIT_FIELD[op]:
            statuses.append(EDIT_UNCHANGED)
        else:
            statuses.append(EDIT_CHANGED)
            value = (old & ~mask) | (EDIT_FIELD[op] << shift)
            if value:
                oracle[key] = value
            else:
                oracle.pop(key, None)
    keys = np.array([k for k, _ in edits], dtype=np.uint64)
    ops = np.array([o for _, o in edits], dtype=np.uint8)
    status = table.edit_fields(keys, ops, EDIT_FIELD, EDIT_NEEDS_HELD, shift=shift, width=3)
    assert status.tolist() == statuses
    got_keys, got_values = table.items()
    assert dict(zip(got_keys.tolist(), got_values.tolist())) == oracle
    for blob in table.take_updates():
        view.apply(blob)
    assert view_matches(view, oracle)


def test_edit_fields_refuses_bad_arguments_before_editing():
    table = LudoTable(64, seed=3)
    keys, ops = np.array([1, 2], dtype=np.uint64), np.array([0, 3], dtype=np.uint8)
    with pytest.raises(LudoError, match="stopped at index 1"):
        table.edit_fields(keys, ops, EDIT_FIELD, EDIT_NEEDS_HELD, shift=0, width=3)
    assert len(table) == 1  # the edit before the bad op was applied, as the error says
    for shift, width, fields in ((30, 3, EDIT_FIELD), (0, 0, EDIT_FIELD), (0, 2, EDIT_FIELD)):
        with pytest.raises(LudoError, match="invalid argument"):
            table.edit_fields(keys[:1], ops[:1], fields, EDIT_NEEDS_HELD, shift=shift, width=width)
    with pytest.raises(LudoKeyRangeError):
        table.edit_fields(np.array([KEY_LIMIT], dtype=np.uint64), ops[:1], EDIT_FIELD, EDIT_NEEDS_HELD, shift=0, width=3)
    with pytest.raises(LudoError, match="uint64 keys"):
        table.edit_fields(keys.astype(np.int64), ops, EDIT_FIELD, EDIT_NEEDS_HELD, shift=0, width=3)


# ---------------------------------------------------------------------------- routed field edits


@settings(max_examples=80, deadline=None)
@given(streams=st.integers(0, 5),
       routes=st.dictionaries(st.integers(0, 6), st.sets(st.integers(0, 4)), max_size=6),
       edits=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(0, 7)), max_size=80),
       shift=st.sampled_from([0, 29]), seed=st.integers(0, 2**32 - 1))
def test_routed_edits_leave_every_table_as_its_own_edits_would(streams, routes, edits, shift, seed):
    """Each table (the full one, each stream) ends with the state, the statuses and the pending
    record blobs of ``edit_fields`` of just the events routed to it; unrouted lengths go nowhere."""
    routes = {n: {j for j in to if j < streams} for n, to in routes.items()}
    rng = random.Random(seed)
    prior = {rng.randrange(41): rng.randrange(1, 1 << 32) for _ in range(rng.randrange(15))}

    def tables():
        out = [LudoTable(16, seed=100 + t) for t in range(streams + 1)]  # small: they grow on the way
        for t in out:
            if prior:
                t.insert_many(list(prior), list(prior.values()))
            t.take_updates()
        return out

    routed_tables, alone = tables(), tables()
    keys = np.array([k for k, _, _ in edits], dtype=np.uint64)
    ops = np.array([o for _, o, _ in edits], dtype=np.uint8)
    lengths = np.array([n for _, _, n in edits], dtype=np.uint32)
    status, changed = RoutedTables(routed_tables[0], routed_tables[1:], routes).edit_fields(
        keys, ops, lengths, EDIT_FIELD, EDIT_NEEDS_HELD, shift=shift, width=3)
    expected_status = alone[0].edit_fields(keys, ops, EDIT_FIELD, EDIT_NEEDS_HELD, shift=shift, width=3)
    assert status.tolist() == expected_status.tolist()
    expected_changed = [int(np.count_nonzero(expected_status == EDIT_CHANGED))]
    for j in range(streams):
        mine = np.array([j in routes.get(n, ()) for n in lengths.tolist()], dtype=bool)
        st_j = alone[j + 1].edit_fields(keys[mine], ops[mine], EDIT_FIELD, EDIT_NEEDS_HELD, shift=shift, width=3)
        expected_changed.append(int(np.count_nonzero(st_j == EDIT_CHANGED)))
    assert changed.tolist() == expected_changed
    for got, want in zip(routed_tables, alone):
        assert got.take_updates() == want.take_updates()  # byte-identical records (or snapshot)
        assert got.snapshot() == want.snapshot()


def test_routed_edits_refuse_bad_arguments_before_any_table_changes():
    full, a, b = (LudoTable(64, seed=s) for s in (1, 2, 3))
    routed = RoutedTables(full, [a, b], {0: [0, 1], 32: [1]})
    assert routed.streams == 2
    keys, lengths = np.array([1, 2], dtype=np.uint64), np.array([0, 32], dtype=np.uint32)
    bad_calls = [
        (keys, np.array([0, 3], dtype=np.uint8), lengths, EDIT_FIELD, 0, 3),  # an op past the table
        (np.array([1, KEY_LIMIT], dtype=np.uint64), np.zeros(2, np.uint8), lengths, EDIT_FIELD, 0, 3),
        (keys, np.zeros(2, np.uint8), lengths, EDIT_FIELD, 30, 3),  # beyond 32 value bits
        (keys, np.zeros(2, np.uint8), lengths, EDIT_FIELD, 0, 0),
        (keys, np.zeros(2, np.uint8), lengths, EDIT_FIELD, 0, 2),  # op_field 5 wider than 2 bits
    ]
    for k, o, n, fields, shift, width in bad_calls:
        with pytest.raises(LudoError, match="no table changed"):
            routed.edit_fields(k, o, n, fields, EDIT_NEEDS_HELD, shift=shift, width=width)
    with pytest.raises(LudoError, match="uint32 lengths"):
        routed.edit_fields(keys, np.zeros(2, np.uint8), lengths.astype(np.int64), EDIT_FIELD, EDIT_NEEDS_HELD,
                           shift=0, width=3)
    with pytest.raises(LudoError, match="same length"):
        routed.edit_fields(keys, np.zeros(2, np.uint8), lengths[:1], EDIT_FIELD, EDIT_NEEDS_HELD, shift=0, width=3)
    assert (len(full), len(a), len(b)) == (0, 0, 0)
    with pytest.raises(LudoError, match="stream index"):
        RoutedTables(full, [a], {0: [1]})
    with pytest.raises(LudoError, match="lengths"):
        RoutedTables(full, [a], {1 << 32: [0]})
    with pytest.raises(LudoError, match="LudoTable"):
        RoutedTables(full, [object()], {})
    with pytest.raises(LudoError, match="value bits"):
        RoutedTables(full, [LudoTable(64, value_bits=64, seed=4)], {})
    status, changed = routed.edit_fields(keys, np.zeros(2, np.uint8), lengths, EDIT_FIELD, EDIT_NEEDS_HELD,
                                         shift=0, width=3)
    assert status.tolist() == [EDIT_CHANGED] * 2 and changed.tolist() == [2, 1, 2]
    assert (len(full), len(a), len(b)) == (2, 1, 2)


def test_a_blob_reads_as_a_snapshot_exactly_when_peek_blob_says_so():
    table = LudoTable(16, seed=5)
    blobs = [table.snapshot()]
    for k in range(1, 200):  # grows past its capacity: record blobs, and a snapshot at each rebuild
        table.insert(k, k)
        blobs += table.take_updates()
    kinds = [peek_blob(b)[0] for b in blobs]
    assert "records" in kinds and kinds.count("snapshot") > 1
    assert [blob_is_snapshot(b) for b in blobs] == [kind == "snapshot" for kind in kinds]
    with pytest.raises(LudoCorruptError):
        blob_is_snapshot(b"XXXX" + blobs[0][4:])


# ---------------------------------------------------------------------------- field edits over several tables


@settings(max_examples=120, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 2), st.sampled_from([0, 3, 29])),
                      max_size=80),
       seed=st.integers(0, 2**32 - 1))
def test_edits_over_several_tables_match_each_run_edited_alone(edits, seed):
    """Events of several tables and shifts interleaved: each table ends with the state, the
    statuses and the pending record blobs of ``edit_fields`` of its runs of one shift in turn."""
    rng = random.Random(seed)
    prior = {rng.randrange(41): rng.randrange(1, 1 << 32) for _ in range(rng.randrange(15))}

    def tables():
        out = [LudoTable(16, seed=200 + t) for t in range(3)]  # small: they grow on the way
        for t in out:
            if prior:
                t.insert_many(list(prior), list(prior.values()))
            t.take_updates()
        return out

    together, alone = tables(), tables()
    status = TablesEditor(together).edit_fields_each(
        array("I", [t << 8 | shift for t, _, _, shift in edits]), array("Q", [k for _, k, _, _ in edits]),
        bytes(o for _, _, o, _ in edits), EDIT_FIELD, EDIT_NEEDS_HELD, width=3)
    expected = []
    for (t, shift), run in itertools.groupby(edits, key=lambda e: (e[0], e[3])):
        run = list(run)
        expected += alone[t].edit_fields(np.array([k for _, k, _, _ in run], dtype=np.uint64),
                                         np.array([o for _, _, o, _ in run], dtype=np.uint8),
                                         EDIT_FIELD, EDIT_NEEDS_HELD, shift=shift, width=3).tolist()
    assert list(status) == expected
    for got, want in zip(together, alone):
        assert got.take_updates() == want.take_updates()  # byte-identical records (or snapshot)
        assert got.snapshot() == want.snapshot()


def test_edits_over_several_tables_refuse_bad_arguments_before_any_table_changes():
    tables = [LudoTable(64, seed=1), LudoTable(64, seed=2)]
    editor = TablesEditor(tables)
    keys, ops = array("Q", [1, 2]), bytes([0, 0])
    bad_calls = [
        (array("I", [0, 2 << 8]), keys, ops, EDIT_FIELD, 3),  # a table past the list
        (array("I", [0, 1 << 8]), keys, bytes([0, 3]), EDIT_FIELD, 3),  # an op past the table
        (array("I", [0, 1 << 8 | 30]), keys, ops, EDIT_FIELD, 3),  # beyond 32 value bits
        (array("I", [0, 1 << 8]), keys, ops, EDIT_FIELD, 0),
        (array("I", [0, 1 << 8]), keys, ops, EDIT_FIELD, 2),  # op_field 5 wider than 2 bits
    ]
    for places, k, o, fields, width in bad_calls:
        with pytest.raises(LudoError, match="invalid argument"):
            editor.edit_fields_each(places, k, o, fields, EDIT_NEEDS_HELD, width=width)
    with pytest.raises(LudoKeyRangeError):
        editor.edit_fields_each(array("I", [0, 1 << 8]), array("Q", [1, KEY_LIMIT]), ops, EDIT_FIELD, EDIT_NEEDS_HELD,
                                width=3)
    with pytest.raises(LudoError, match="one length"):
        editor.edit_fields_each(array("I", [0]), keys, ops, EDIT_FIELD, EDIT_NEEDS_HELD, width=3)
    with pytest.raises(LudoError, match="one length"):
        editor.edit_fields_each(array("I", [0, 1 << 8]), array("I", [1, 2]), ops, EDIT_FIELD, EDIT_NEEDS_HELD, width=3)
    assert (len(tables[0]), len(tables[1])) == (0, 0)
    assert list(editor.edit_fields_each(array("I", [0, 1 << 8]), keys, ops, EDIT_FIELD, EDIT_NEEDS_HELD,
                                        width=3)) == [EDIT_CHANGED] * 2
    assert (len(tables[0]), len(tables[1])) == (1, 1)


# ---------------------------------------------------------------------------- batch apply


@settings(max_examples=60, deadline=None)
@given(fingerprint_bits=st.sampled_from([0, 1, 7, 13, 15, 16]), value_bits=st.sampled_from([32, 64]),
       rounds=st.lists(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["insert", "remove", "update"]),
                                          st.integers(1, 60)), max_size=6), min_size=1, max_size=5),
       seed=st.integers(0, 2**32 - 1))
def test_batch_apply_keeps_views_byte_identical_to_their_tables(fingerprint_bits, value_bits, rounds, seed):
    """One ``apply_batch`` per round of edits over several tables (growths included: a snapshot
    among the blobs) leaves every view exporting its table's snapshot byte for byte, as applying
    the blobs one by one does (fingerprints of 15 and 16 bits spill past a 64-bit word)."""
    rng = random.Random(seed)
    tables = [LudoTable(rng.choice([8, 200]), value_bits=value_bits, fingerprint_bits=fingerprint_bits,
                        seed=100 + i) for i in range(4)]
    batched = [synced_view(t) for t in tables]
    single = [LudoView.from_snapshot(t.snapshot()) for t in tables]
    held: list[dict[int, int]] = [{} for _ in tables]
    for edits in rounds:
        for t, op, n in edits:
            table, oracle = tables[t], held[t]
            if op == "insert":
                oracle.update(fill(table, n, rng, value_bits) if not oracle else {})
                fresh = {rng.randrange(KEY_LIMIT): rng.randrange(1, 1 << value_bits) for _ in range(n)}
                fresh = {k: v for k, v in fresh.items() if k not in oracle}
                table.insert_many(list(fresh), list(fresh.values()))
                oracle.update(fresh)
            elif oracle:
                keys = rng.sample(list(oracle), min(n, len(oracle)))
                if op == "remove":
                    table.remove_many(keys)
                    for k in keys:
                        del oracle[k]
                else:
                    values = [rng.randrange(1, 1 << value_bits) for _ in keys]
                    table.update_many(keys, values)
                    oracle.update(zip(keys, values))
        pairs = [(i, blob) for i, table in enumerate(tables) for blob in table.take_updates()]
        rng.shuffle(pairs)  # distinct tables: their order in a batch does not matter
        apply_batch([batched[i] for i, _ in pairs], [blob for _, blob in pairs])
        for i, blob in pairs:
            single[i].apply(blob)
    for table, view, one, oracle in zip(tables, batched, single, held):
        assert view.snapshot() == table.snapshot() == one.snapshot()
        assert view_matches(view, oracle)


def test_batch_apply_refuses_a_bad_blob_before_changing_any_view():
    rng = random.Random(3)
    tables = [LudoTable(4000, fingerprint_bits=8, seed=10 + i) for i in range(3)]
    views = [synced_view(t) for t in tables]
    for t in tables:
        fill(t, 500, rng)
    blobs = [t.take_updates()[0] for t in tables]
    before = [v.snapshot() for v in views]
    damaged = bytearray(blobs[2])
    damaged[-1] ^= 0xFF
    for bad, error in ((bytes(damaged), LudoCorruptError), (blobs[0], LudoForeignError), (b"short", LudoCorruptError)):
        with pytest.raises(BatchApplyError) as caught:
            apply_batch(views, [blobs[0], blobs[1], bad])
        assert caught.value.index == 2 and isinstance(caught.value.cause, error)
        assert [v.snapshot() for v in views] == before  # validated first: nothing changed
    with pytest.raises(LudoError):
        apply_batch(views, blobs[:2])  # one blob per view
    apply_batch(views, blobs)
    assert [v.snapshot() for v in views] == [t.snapshot() for t in tables]
    apply_batch([], [])


def test_batch_apply_takes_a_view_named_twice_in_order():
    rng = random.Random(4)
    table = LudoTable(4000, seed=5)
    view = synced_view(table)
    fill(table, 300, rng)
    first = table.take_updates()[0]
    fill(table, 300, rng)
    second = table.take_updates()[0]
    apply_batch([view, view], [first, second])
    assert view.snapshot() == table.snapshot()


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(1, 3000), n=st.integers(0, 400), fingerprint_bits=st.sampled_from([0, 3, 15]),
       seed=st.integers(0, 2**32 - 1))
def test_blob_checksums_are_zlibs_crc32_at_every_length(capacity, n, fingerprint_bits, seed):
    """The C CRC-32 (carry-less multiplication where the CPU has it, tables elsewhere) is the
    IEEE one zlib computes, over the header's first 64 bytes and then the payload, for blobs of
    every length (snapshots and records, the tails past a multiple of 16 included)."""
    rng = random.Random(seed)
    table = LudoTable(capacity, fingerprint_bits=fingerprint_bits, seed=seed)
    blobs = [table.snapshot()]
    fill(table, min(n, capacity), rng)
    blobs += table.take_updates() + [table.snapshot()]
    for blob in blobs:
        want = zlib.crc32(blob[HEADER:], zlib.crc32(blob[:64]))
        assert struct.unpack_from("<I", blob, 64)[0] == want
    LudoView.from_snapshot(blobs[-1])  # and the reader's check agrees with the writer's


def test_batch_apply_refuses_an_old_epochs_records_and_a_payload_error_before_changing_any_view():
    rng = random.Random(8)
    grown = LudoTable(8, seed=31)
    steady = LudoTable(4000, seed=32)
    views = [synced_view(grown), synced_view(steady)]
    fill(grown, 4, rng)
    stale = grown.take_updates()[0]  # epoch 1 records
    fill(grown, 200, rng)  # grows: a new epoch, shipped as a snapshot
    views[0].apply(grown.take_updates()[0])
    fill(steady, 50, rng)
    good = steady.take_updates()[0]
    before = [v.snapshot() for v in views]
    with pytest.raises(BatchApplyError) as caught:
        apply_batch(views, [stale, good])
    assert caught.value.index == 0 and isinstance(caught.value.cause, LudoEpochError)
    bad = bytearray(good)
    bad[HEADER + 8:HEADER + 12] = struct.pack("<I", 0xFFFFFFFF)  # a bucket index past the table
    with pytest.raises(BatchApplyError) as caught:
        apply_batch(views, [grown.snapshot(), reseal(bytes(bad))])
    assert caught.value.index == 1 and isinstance(caught.value.cause, LudoCorruptError)
    assert views[1].snapshot() == before[1]
    apply_batch(views[1:], [good])
    assert views[1].snapshot() == steady.snapshot()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, fingerprint_bits=st.sampled_from([0, 6]), value_bits=st.sampled_from([32, 64]),
       copy_at=st.integers(0, 250))
def test_a_copied_view_is_its_snapshot_and_then_on_its_own(ops, fingerprint_bits, value_bits, copy_at):
    """copy() (the simulator's shared versions) answers every key as a view built from the
    original's snapshot, and after it each follows only the blobs applied to it."""
    table = LudoTable(8, value_bits=value_bits, fingerprint_bits=fingerprint_bits, seed=3)
    view = synced_view(table)
    oracle: dict[int, int] = {}
    copied, oracle_then, probes = None, {}, np.arange(1, 400, dtype=np.uint64) * 7919
    for n, (op, key, value) in enumerate(ops):
        if n == copy_at:
            copied, oracle_then = view.copy(), dict(oracle)
            rebuilt = LudoView.from_snapshot(view.snapshot())
            assert np.array_equal(copied.lookup_many(probes), rebuilt.lookup_many(probes))  # keyless answers too
            assert (copied.epoch, copied.slots, copied.overflow_count) == (rebuilt.epoch, rebuilt.slots,
                                                                             rebuilt.overflow_count)
        if op == "insert" and key not in oracle:
            table.insert(key, value)
            oracle[key] = value
        elif op == "remove" and oracle:
            target = list(oracle)[key % len(oracle)]
            table.remove(target)
            del oracle[target]
        for blob in table.take_updates():
            view.apply(blob)
    assert view_matches(view, oracle)
    if copied is not None:
        assert view_matches(copied, oracle_then)  # untouched by what the original applied since
        copied.apply(table.snapshot())
        assert view_matches(copied, oracle)


# ---------------------------------------------------------------------------- huge-page views


@pytest.fixture
def huge_page_views():
    was = set_huge_page_views(True)
    yield
    set_huge_page_views(was)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fingerprint_bits=st.sampled_from([0, 8, 16]), value_bits=st.sampled_from([32, 64]),
       sizes=st.lists(st.sampled_from([8, 200, 3000]), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_views_on_huge_pages_are_the_same_views(huge_page_views, fingerprint_bits, value_bits, sizes, seed):
    """Views made in the huge-page arena (from a snapshot, grown, copied, batch-applied) read and
    export exactly as their tables; freed, their blocks are kept and the next views of those
    sizes take them rather than new chunk space."""
    rng = random.Random(seed)
    tables = [LudoTable(n, value_bits=value_bits, fingerprint_bits=fingerprint_bits, seed=700 + i)
              for i, n in enumerate(sizes)]
    held = [fill(t, rng.randrange(1, 2 * n), rng, value_bits) for t, n in zip(tables, sizes)]  # past capacity: grown
    views = [synced_view(t) for t in tables]
    for table, view, oracle in zip(tables, views, held):
        assert view.snapshot() == table.snapshot() and view_matches(view, oracle)
        assert view.copy().snapshot() == table.snapshot()
    del view
    gc.collect()
    before = huge_page_view_stats()
    assert before["live"] > 0 and before["reserved"] >= before["live"] + before["kept"]
    snapshots = [t.snapshot() for t in tables]
    del views
    gc.collect()
    freed = huge_page_view_stats()
    assert freed["live"] < before["live"] and freed["kept"] > before["kept"]
    again = [LudoView.from_snapshot(b) for b in snapshots]
    rebuilt = huge_page_view_stats()
    assert rebuilt["reserved"] == freed["reserved"]  # the kept blocks, not new space
    assert rebuilt["live"] == before["live"] and rebuilt["kept"] == before["kept"]
    assert [v.snapshot() for v in again] == snapshots


def test_views_made_before_or_after_the_arena_are_freed_where_they_came_from():
    """A view from the ordinary allocator freed while the arena is on, and an arena view freed
    after it is turned off, each go back where they came from (no crash, the arena's counts
    right)."""
    table = LudoTable(500, fingerprint_bits=8, seed=9)
    fill(table, 300, random.Random(1))
    was = set_huge_page_views(False)
    try:
        ordinary = LudoView.from_snapshot(table.snapshot())
        set_huge_page_views(True)
        live = huge_page_view_stats()["live"]
        arena_view = LudoView.from_snapshot(table.snapshot())
        assert huge_page_view_stats()["live"] > live
        del ordinary
        gc.collect()
        assert huge_page_view_stats()["live"] > live
        set_huge_page_views(False)
        del arena_view
        gc.collect()
        assert huge_page_view_stats()["live"] == live
    finally:
        set_huge_page_views(was)
