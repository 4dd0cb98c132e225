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
grew); then the blobs up to it are applied. Versions below every edge's are freed, with their
blobs. Every ``SWEEP_S`` of virtual time every table's edges that lag what the most delayed edge
has received by then move up to that version together (``compact``), so tables an edge has not
read lately do not pin old versions.

Loss, and the repair it needs, make an edge's state diverge from every other's: the policy keeps
per-edge views for ``update_loss > 0`` (kvcompass_policy.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.ludo import LudoView, blob_is_snapshot
from kvcompassd.core.lookup_plan import ViewPointers
from kvcompassd.core.messages import ShardSnapshotSent, UpdateBatchPublished

__all__ = ["SharedViews", "SWEEP_S"]

SWEEP_S = 1.0  # virtual seconds between compactions of every table's versions


class _Versions:
    """The live versions of one (shard, group) table and the blobs between them."""

    __slots__ = ("views", "refs", "at", "blobs", "snapshot", "blob_base", "latest", "seqs")

    def __init__(self, view: LudoView, edges: int) -> None:
        self.views: dict[int, LudoView] = {0: view}
        self.refs: dict[int, int] = {0: edges}
        self.at: list[int] = [0] * edges  # at[e]: the version edge e is at
        self.blobs: list[bytes] = []  # blobs[i] turns version blob_base + i into blob_base + i + 1
        self.snapshot: list[bool] = []  # blobs[i] is a snapshot (the table grew or was rebuilt)
        self.blob_base = 0
        self.latest = 0
        self.seqs: list[int] = []  # seqs[k - 1]: the shard's batch that made version k

    def add(self, blob: bytes, seq: int) -> int:
        self.seqs.append(seq)
        self.blobs.append(blob)
        self.snapshot.append(blob_is_snapshot(blob))
        self.latest += 1
        return self.latest

    def make(self, k: int) -> LudoView:
        """Version ``k`` (not live yet), from the highest live version below it."""
        base = max(v for v in self.views if v < k)
        off = self.blob_base
        start = base
        for v in range(k, base, -1):  # a snapshot blob in between: start from it, nothing to copy
            if self.snapshot[v - 1 - off]:
                start = v
                break
        if start > base:
            view = LudoView.from_snapshot(self.blobs[start - 1 - off])
        elif self.refs[base] == 0:
            view = self.views.pop(base)  # no edge is at it any more: move it on in place
            del self.refs[base]
        else:
            view = self.views[base].copy()
        for v in range(start + 1, k + 1):
            view.apply(self.blobs[v - 1 - off])
        return view

    def advance(self, base: int, k: int) -> LudoView | None:
        """Live version ``base`` moved on to version ``k`` in place (its edges' pointers stay
        valid: the view object is the same), or None, untouched, when a snapshot blob lies in
        between (a new table: the caller makes version ``k`` instead)."""
        off = self.blob_base
        if any(self.snapshot[v - 1 - off] for v in range(base + 1, k + 1)):
            return None
        view = self.views[base]
        for v in range(base + 1, k + 1):
            view.apply(self.blobs[v - 1 - off])
        return view

    def collect(self) -> None:
        """Free the versions no edge is at (an edge behind a version rebuilds from its own, so
        none is needed as a base), and the blobs below every edge's version."""
        for v in [v for v, r in self.refs.items() if r == 0]:
            del self.views[v], self.refs[v]
        lowest = min(self.refs)
        if lowest > self.blob_base:
            cut = lowest - self.blob_base
            del self.blobs[:cut], self.snapshot[:cut]
            self.blob_base = lowest


class SharedViews:
    """Every edge's view of every shard, as shared table versions (see the module docstring).

    ``edges`` are the edges' ``EdgeIndexView`` objects (their state dicts are kept pointing at
    the versions each edge is at, in place), ``pointers`` each edge's Router's ``ViewPointers``,
    ``readers[e][i]`` the groups edge ``e``'s lookup reads at its ``i``-th query length, and
    ``delays[s][e]`` the seconds from shard ``s`` publishing to edge ``e`` applying."""

    def __init__(self, edges: Sequence[EdgeIndexView], pointers: Sequence[ViewPointers],
                 readers: Sequence[Sequence[tuple[int, ...]]], delays: Sequence[Sequence[float]]) -> None:
        self.edges = list(edges)
        self.pointers = list(pointers)
        self.readers = [list(r) for r in readers]
        self.delays = delays  # the policy's own rows: a changed update delay applies here too
        n_shards = self.edges[0].shards if self.edges else 0
        self.shards = n_shards
        self._tables: list[dict[int, _Versions]] = [{} for _ in range(n_shards)]
        self._times: list[list[float]] = [[] for _ in range(n_shards)]  # publish time of each batch
        self._base_seq = [0] * n_shards  # the seq of the snapshot the edges started from
        # Each edge's views dict of each shard (the one install put in its state), and its
        # pointers' refresh: what a move writes, without looking them up per move.
        self._dicts: list[list[dict[int, LudoView]]] = [[{} for _ in range(n_shards)] for _ in self.edges]
        self._refresh = [p.refresh for p in self.pointers]
        self._next_sweep = SWEEP_S

    def install(self, snap: ShardSnapshotSent) -> None:
        """The shard's initial state, shared by every edge (version 0 of each of its tables)."""
        s, n = snap.shard, len(self.edges)
        tables = {g: _Versions(LudoView.from_snapshot(blob), n) for g, blob in snap.tables}
        self._tables[s] = tables
        for e, edge in enumerate(self.edges):
            st = edge.state[s]
            st.views = {g: t.views[0] for g, t in tables.items()}
            st.epoch, st.seq = snap.epoch, snap.seq
            self._dicts[e][s] = st.views
        self._base_seq[s] = snap.seq

    def publish(self, batch: UpdateBatchPublished, now: float) -> None:
        """A batch the shard published at ``now``: it reaches each edge ``delays[s][e]`` later."""
        s = batch.shard
        times = self._times[s]
        if batch.seq != self._base_seq[s] + len(times) + 1:
            raise ValueError(f"shard {s}: batch {batch.seq} published out of order")
        times.append(now)
        tables = self._tables[s]
        for g, blob in batch.tables:
            tables[g].add(blob, batch.seq)
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            self.compact(now)

    def position(self, e: int, s: int, now: float) -> int:
        """The seq of the last batch of shard ``s`` that edge ``e`` has by ``now``: those with
        ``publish time + delay <= now``, the sum the per-edge delivery events were due at."""
        times, d = self._times[s], self.delays[s][e]
        i = bisect_right(times, now - d)
        n = len(times)
        while i < n and times[i] + d <= now:
            i += 1
        while i > 0 and times[i - 1] + d > now:
            i -= 1
        seq = self._base_seq[s] + i
        self.edges[e].state[s].seq = seq
        return seq

    def prepare(self, e: int, keys: np.ndarray, now: float) -> None:
        """Bring the tables edge ``e`` reads for a prompt with these query keys to ``now``."""
        n = self.shards
        readers, tables = self.readers[e], self._tables
        positions: dict[int, int] = {}
        for i, key in enumerate(keys.tolist()):
            s = key % n
            shard_tables = tables[s]
            pos = None
            for g in readers[i]:
                t = shard_tables[g]
                cur = t.at[e]
                if cur == t.latest:
                    continue
                if pos is None:
                    pos = positions.get(s)
                    if pos is None:
                        pos = positions[s] = self.position(e, s, now)
                k = bisect_right(t.seqs, pos)
                if k != cur:
                    self._move(e, s, g, t, k)

    def _move(self, e: int, s: int, g: int, t: _Versions, k: int) -> None:
        j = t.at[e]
        t.refs[j] -= 1
        view = t.views.get(k)
        if view is None:
            view = t.make(k)
            t.views[k] = view
            t.refs[k] = 1
        else:
            t.refs[k] += 1
        t.at[e] = k
        self._dicts[e][s][g] = view
        self._refresh[e](s, g, view)
        if t.refs.get(j, 0) == 0:  # j is nobody's now (or was moved on in place)
            t.collect()

    def advance(self, e: int, now: float) -> None:
        """Every table of edge ``e`` to what it has received by ``now``."""
        for s in range(self.shards):
            pos = self.position(e, s, now)
            for g, t in self._tables[s].items():
                cur = t.at[e]
                if cur == t.latest:
                    continue
                k = bisect_right(t.seqs, pos)
                if k != cur:
                    self._move(e, s, g, t, k)

    def compact(self, now: float) -> None:
        """Free the versions no edge needs by ``now``: every edge behind what the most delayed
        edge has received by then moves up to that version, all of them together (one version
        per table, made in place when nobody else is at the one below; not one per edge, which
        cost a copy and its blobs per edge and table). The version most of them are at moves on
        in place to become it, when no snapshot blob lies between (its edges keep their pointers:
        the view object is the same). A read brings an edge on to its own position
        (``prepare``), and positions only grow, so no read sees anything else."""
        edges = range(len(self.edges))
        dicts, refresh = self._dicts, self._refresh
        for s in range(self.shards):
            times = self._times[s]
            if not times:
                continue
            low = min(self.position(e, s, now) for e in edges)
            for g, t in self._tables[s].items():
                k = bisect_right(t.seqs, low)
                if min(t.refs) >= k:  # nobody is behind it
                    continue
                at, refs = t.at, t.refs
                behind = [e for e in edges if at[e] < k]
                view = t.views.get(k)
                kept = -1  # the version whose view became version k in place: its edges need no new pointer
                if view is None:
                    # Most lagging edges of a table sit together at the version the last sweep
                    # moved them to: that version's view moves on in place, and only the others
                    # are pointed at it (not a copy and a pointer per edge).
                    base = max((v for v in refs if v < k), key=refs.__getitem__)
                    view = t.advance(base, k)
                    if view is None:
                        view = t.make(k)
                    else:
                        kept = base
                    t.views[k] = view
                    refs[k] = 0
                refs[k] += len(behind)
                for e in behind:
                    j = at[e]
                    refs[j] -= 1
                    at[e] = k
                    if j != kept:
                        dicts[e][s][g] = view
                        refresh[e](s, g, view)
                t.collect()  # (frees version ``kept``'s entry: its view is version k's now)

    def advance_all(self, now: float) -> None:
        for e in range(len(self.edges)):
            self.advance(e, now)

    @property
    def deliveries(self) -> int:
        """(batch, edge) deliveries so far, as the per-edge views would count them."""
        return sum(edge.state[s].seq - self._base_seq[s] for edge in self.edges for s in range(self.shards))

    def last_due(self) -> float:
        """When the last batch published so far reaches its last edge."""
        due = 0.0
        for s, times in enumerate(self._times):
            if times:
                due = max(due, times[-1] + max(self.delays[s], default=0.0))
        return due

    def live_versions(self) -> int:
        """Table versions held (a table every edge reads at one version counts once)."""
        return sum(len(t.views) for tables in self._tables for t in tables.values())

    def memory_bytes(self) -> int:
        return sum(v.memory_bytes for tables in self._tables for t in tables.values() for v in t.views.values())


def lookup_readers(group_lengths: np.ndarray, query_lengths: np.ndarray) -> list[tuple[int, ...]]:
    """For each query length (index), the groups whose lookup lengths include it."""
    index = {n: i for i, n in enumerate(query_lengths.tolist())}
    readers: list[list[int]] = [[] for _ in index]
    for g, row in enumerate(group_lengths.tolist()):
        for n in row:
            if n:
                readers[index[n]].append(g)
    return [tuple(r) for r in readers]
