"""The simulated edges' index views, held once: shared table versions, per-edge positions.

Without loss every edge applies the same batches of a shard in the same order; one edge differs
from another only by how far along it is (its staleness: the shard -> edge delay). So instead of a
full copy of every (shard, group) table per edge, and one delivery event per (batch, edge), this
keeps for each table the versions that some edge still reads (version k: after the table's k-th
blob), each shared by every edge at it, and works an edge's position on a shard out when the edge
is read: a batch published at ``t`` has reached edge ``e`` once ``t + d(s, e) <= now``, the same
float sum as the per-edge delivery events' due times, so every read sees exactly the state the
per-edge views had (tests/test_sim_shared_views.py runs both and compares every decision).

An edge's tables are brought to its position only where it reads: before a decision, the
(shard, group) tables its lookup plan reads for that prompt's keys (each key on shard
``key % N``, read by the groups whose lengths include it); the C lookup reads no other. A version
is made only when an edge moves to it: in place from the highest version below it that no edge is
at any more, else as a copy of it (its snapshot), or from a snapshot blob in between (a table that
grew); then the blobs up to it are applied. When every edge at the version below already has
the new batch by now, that version moves on in place with all of them instead (their next reads
move them at least that far, so none reads anything it has not received). Versions below every
edge's are freed, with their blobs. Every ``SWEEP_S`` of virtual time every table's edges that lag what the most delayed edge
has received by then move up to that version together (``compact``), so tables an edge has not
read lately do not pin old versions.

The versions, their blobs and every move are kept in C (``ludo_c/kvc_versions.c``, the same
rules step for step): a read touches ~100 tables and moves ~45 of them at 1,024 x 64, which in
Python per table was a fifth of the simulator's CPU. This class is its Python face.

Loss, and the repair it needs, make an edge's state diverge from every other's: the policy keeps
per-edge views for ``update_loss > 0`` (kvcompass_policy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.ludo import LudoView, _raise
from kvcompassd.core.lookup_plan import ViewPointers
from kvcompassd.core.messages import ShardSnapshotSent, UpdateBatchPublished

__all__ = ["SharedViews", "SWEEP_S"]

SWEEP_S = 1.0  # virtual seconds between compactions of every table's versions


class SharedViews:
    """Every edge's view of every shard, as shared table versions (see the module docstring).

    ``edges`` are the edges' ``EdgeIndexView`` objects (their state's positions are kept, and
    their views dicts filled with the versions each edge is at when ``advance_all`` settles
    them), ``pointers`` each edge's Router's ``ViewPointers`` (its array is kept current in C),
    ``readers[e][i]`` the groups edge ``e``'s lookup reads at its ``i``-th query length, and
    ``delays[s][e]`` the seconds from shard ``s`` publishing to edge ``e`` applying (read again
    by ``set_delays``)."""

    def __init__(self, edges: Sequence[EdgeIndexView], pointers: Sequence[ViewPointers],
                 readers: Sequence[Sequence[tuple[int, ...]]], delays: Sequence[Sequence[float]]) -> None:
        self.edges = list(edges)
        self.pointers = list(pointers)
        self.delays = delays  # the policy's own rows
        n_shards = self.edges[0].shards if self.edges else 0
        self.shards = n_shards
        arrays = [p.hand_over() for p in self.pointers]
        groups = arrays[0][1] if arrays else 1
        self.groups = groups
        out = ffi.new("kvc_vs **")
        rc = lib.kvc_vs_new(out, max(1, n_shards), groups, len(self.edges))
        if rc != lib.KVC_OK:
            _raise(rc, "creating the shared views")
        self._vs = ffi.gc(out[0], lib.kvc_vs_free)
        self._bound = []  # what the C side borrows: kept alive with it
        for e, (array, _) in enumerate(arrays):
            offsets = np.zeros(len(readers[e]) + 1, np.uint32)
            offsets[1:] = np.cumsum([len(r) for r in readers[e]])
            flat = np.array([g for r in readers[e] for g in r] or [0], np.uint32)
            rc = lib.kvc_vs_bind_edge(self._vs, e, array, ffi.from_buffer("uint32_t[]", offsets), len(readers[e]),
                                      ffi.from_buffer("uint32_t[]", flat))
            if rc != lib.KVC_OK:
                _raise(rc, f"binding edge {e} to the shared views")
            self._bound.append(array)
        self.set_delays()
        self._published = [0] * n_shards  # batches published since the snapshot, per shard
        self._last_time = [0.0] * n_shards  # when each shard published its last batch
        self._base_seq = [0] * n_shards  # the seq of the snapshot the edges started from
        self._next_sweep = SWEEP_S
        self._prepare = lib.kvc_vs_prepare

    def set_delays(self) -> None:
        """Read ``delays`` again (the policy changed its update delay before any event)."""
        for s, row in enumerate(self.delays):
            for e, d in enumerate(row):
                if lib.kvc_vs_set_delay(self._vs, s, e, float(d)) != lib.KVC_OK:
                    raise ValueError(f"delay {d!r} from shard {s} to edge {e}")

    def install(self, snap: ShardSnapshotSent) -> None:
        """The shard's initial state, shared by every edge (version 0 of each of its tables)."""
        s = snap.shard
        for g, blob in snap.tables:
            rc = lib.kvc_vs_install(self._vs, s, g, snap.seq, ffi.from_buffer("uint8_t[]", blob), len(blob))
            if rc != lib.KVC_OK:
                _raise(rc, f"installing shard {s} group {g}")
        for edge in self.edges:
            st = edge.state[s]
            st.views.clear()  # (in place: the pointer arrays' dicts; filled when settled)
            st.epoch, st.seq = snap.epoch, snap.seq
        self._base_seq[s] = snap.seq

    def publish(self, batch: UpdateBatchPublished, now: float) -> None:
        """A batch the shard published at ``now``: it reaches each edge ``delays[s][e]`` later."""
        s = batch.shard
        if batch.seq != self._base_seq[s] + self._published[s] + 1:
            raise ValueError(f"shard {s}: batch {batch.seq} published out of order")
        tables = batch.tables
        n = len(tables)
        blobs = [ffi.from_buffer("uint8_t[]", blob) for _, blob in tables]
        rc = lib.kvc_vs_publish(self._vs, s, batch.seq, now, n, [g for g, _ in tables], blobs,
                                [len(blob) for _, blob in tables])
        if rc != lib.KVC_OK:
            _raise(rc, f"shard {s}: publishing batch {batch.seq}")
        self._published[s] += 1
        self._last_time[s] = now
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            self.compact(now)

    def position(self, e: int, s: int, now: float) -> int:
        """The seq of the last batch of shard ``s`` that edge ``e`` has by ``now``: those with
        ``publish time + delay <= now``, the sum the per-edge delivery events were due at."""
        seq = lib.kvc_vs_position(self._vs, e, s, now)
        self.edges[e].state[s].seq = seq
        return seq

    def prepare(self, e: int, keys: np.ndarray, now: float) -> None:
        """Bring the tables edge ``e`` reads for a prompt with these query keys to ``now``."""
        rc = self._prepare(self._vs, e, ffi.from_buffer("uint64_t[]", keys), len(keys), now)
        if rc != lib.KVC_OK:
            _raise(rc, f"edge {e}: bringing its views to {now}")

    def advance(self, e: int, now: float) -> None:
        """Every table of edge ``e`` to what it has received by ``now``."""
        rc = lib.kvc_vs_advance(self._vs, e, now)
        if rc != lib.KVC_OK:
            _raise(rc, f"edge {e}: advancing its views to {now}")

    def compact(self, now: float) -> None:
        """Free the versions no edge needs by ``now``: every edge behind what the most delayed
        edge has received by then moves up to that version, all of them together (one version
        per table, made in place when nobody else is at the one below). A read brings an edge on
        to its own position (``prepare``), and positions only grow, so no read sees anything
        else."""
        rc = lib.kvc_vs_compact(self._vs, now)
        if rc != lib.KVC_OK:
            _raise(rc, f"compacting the shared views at {now}")

    def advance_all(self, now: float) -> None:
        """Every edge to ``now``, its positions and views dicts filled in: each version an edge
        is at as one ``LudoView`` copy, the same object for every edge at it."""
        copies: dict[Any, LudoView] = {}
        for e, edge in enumerate(self.edges):
            self.advance(e, now)
            for s, st in enumerate(edge.state):
                st.seq = lib.kvc_vs_edge_seq(self._vs, e, s)
                views = {}
                for g in range(self.groups):
                    ptr = lib.kvc_vs_view(self._vs, e, s, g)
                    if ptr == ffi.NULL:
                        continue
                    key = int(ffi.cast("uintptr_t", ptr))
                    view = copies.get(key)
                    if view is None:
                        view = copies[key] = LudoView.copy_of(ptr)
                    views[g] = view
                st.views.clear()
                st.views.update(views)

    @property
    def deliveries(self) -> int:
        """(batch, edge) deliveries so far, as the per-edge views would count them."""
        vs, base = self._vs, self._base_seq
        return sum(lib.kvc_vs_edge_seq(vs, e, s) - base[s] for e in range(len(self.edges)) for s in range(self.shards))

    def last_due(self) -> float:
        """When the last batch published so far reaches its last edge."""
        due = 0.0
        for s, n in enumerate(self._published):
            if n:
                due = max(due, self._last_time[s] + max(self.delays[s], default=0.0))
        return due

    def last_published(self) -> float:
        """When the last batch of any shard was published (0.0 before any)."""
        return max(self._last_time, default=0.0)

    def table_state(self, s: int, g: int) -> tuple[list[int], dict[int, int]]:
        """For inspection: the version each edge is at in table (``s``, ``g``), and each live
        version with the number of edges at it (in the order they were made)."""
        at = [int(lib.kvc_vs_edge_version(self._vs, e, s, g)) for e in range(len(self.edges))]
        cap = len(self.edges) + 2
        versions, refs = ffi.new("int64_t[]", cap), ffi.new("int64_t[]", cap)
        n = lib.kvc_vs_table_versions(self._vs, s, g, versions, refs, cap)
        return at, {int(versions[i]): int(refs[i]) for i in range(min(n, cap))}

    def version_at(self, s: int, g: int, seq: int) -> int:
        """The version of table (``s``, ``g``) an edge at the shard's batch ``seq`` reads."""
        return int(lib.kvc_vs_version_at(self._vs, s, g, seq))

    def view_pointer(self, e: int, s: int, g: int) -> Any:
        """Edge ``e``'s current version of the table as a ``kvc_view *`` (NULL if none)."""
        return lib.kvc_vs_view(self._vs, e, s, g)

    def live_versions(self) -> int:
        """Table versions held (a table every edge reads at one version counts once)."""
        return int(lib.kvc_vs_live_versions(self._vs))

    def memory_bytes(self) -> int:
        return int(lib.kvc_vs_memory_bytes(self._vs))


def lookup_readers(group_lengths: np.ndarray, query_lengths: np.ndarray) -> list[tuple[int, ...]]:
    """For each query length (index), the groups whose lookup lengths include it."""
    index = {n: i for i, n in enumerate(query_lengths.tolist())}
    readers: list[list[int]] = [[] for _ in index]
    for g, row in enumerate(group_lengths.tolist()):
        for n in row:
            if n:
                readers[index[n]].append(g)
    return [tuple(r) for r in readers]
