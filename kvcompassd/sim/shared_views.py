"""The simulated edges' index views, held once: shared table versions, per-edge positions.

Without loss every edge applies the same batches of a shard in the same order; one edge differs
from another only by how far along it is (its staleness: the shard -> edge delay). So instead of a
full copy of every (shard, group) table per edge, and one delivery event per (batch, edge), this
keeps for each table the versions that some edge still reads (version k: after the table's k-th
blob), each shared by every edge at it, and works an edge's position on a shard out when the edge
is read: a batch published at ``t`` has reached edge ``e`` once ``t + d(s, e) <= now``, the same
float sum as the per-edge delivery events' due times, so every read sees exactly the state the
per-edge views had (tests/test_sim_shared_views.py runs both and compares every decision).

A version is made only when an edge moves to it: in place from the highest version below it that
no edge is at any more, else as a copy of it (its snapshot), or from a snapshot blob in between (a
table that grew); then the blobs up to it are applied. Versions below every edge's are freed, with
their blobs. Every ``SWEEP_S`` of virtual time all edges are brought up to date, so an edge that
reads rarely does not pin old versions and batches.

Loss, and the repair it needs, make an edge's state diverge from every other's: the policy keeps
per-edge views for ``update_loss > 0`` (kvcompass_policy.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcompassd.core.index import EdgeIndexView
from kvcompassd.core.ludo import LudoView, peek_blob
from kvcompassd.core.lookup_plan import ViewPointers
from kvcompassd.core.messages import ShardSnapshotSent, UpdateBatchPublished

__all__ = ["SharedViews", "SWEEP_S"]

SWEEP_S = 0.25  # virtual seconds between bringing every edge up to date


class _Versions:
    """The live versions of one (shard, group) table and the blobs between them."""

    __slots__ = ("views", "refs", "blobs", "snapshot", "blob_base", "latest")

    def __init__(self, view: LudoView, edges: int) -> None:
        self.views: dict[int, LudoView] = {0: view}
        self.refs: dict[int, int] = {0: edges}
        self.blobs: list[bytes] = []  # blobs[i] turns version blob_base + i into blob_base + i + 1
        self.snapshot: list[bool] = []  # blobs[i] is a snapshot (the table grew or was rebuilt)
        self.blob_base = 0
        self.latest = 0

    def add(self, blob: bytes) -> int:
        self.blobs.append(blob)
        self.snapshot.append(peek_blob(blob)[0] == "snapshot")
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
            view = LudoView.from_snapshot(self.views[base].snapshot())
        for v in range(start + 1, k + 1):
            view.apply(self.blobs[v - 1 - off])
        return view

    def collect(self) -> None:
        """Free the versions below every edge's, and the blobs only they needed."""
        lowest = min(v for v, r in self.refs.items() if r > 0)
        for v in [v for v in self.views if v < lowest]:
            del self.views[v], self.refs[v]
        if lowest > self.blob_base:
            cut = lowest - self.blob_base
            del self.blobs[:cut], self.snapshot[:cut]
            self.blob_base = lowest


class SharedViews:
    """Every edge's view of every shard, as shared table versions (see the module docstring).

    ``edges`` are the edges' ``EdgeIndexView`` objects (their state dicts are kept pointing at
    the versions each edge is at, in place), ``pointers`` each edge's Router's ``ViewPointers``
    and ``delays[s][e]`` the seconds from shard ``s`` publishing to edge ``e`` applying."""

    def __init__(self, edges: Sequence[EdgeIndexView], pointers: Sequence[ViewPointers],
                 delays: Sequence[Sequence[float]]) -> None:
        self.edges = list(edges)
        self.pointers = list(pointers)
        self.delays = delays  # the policy's own rows: a changed update delay applies here too
        n_shards = self.edges[0].shards if self.edges else 0
        self.shards = n_shards
        self._tables: list[dict[int, _Versions]] = [{} for _ in range(n_shards)]
        # Per shard: (publish time, ((group, version), ...)) of each batch from _batch_base[s] + 1 on.
        self._batches: list[list[tuple[float, tuple[tuple[int, int], ...]]]] = [[] for _ in range(n_shards)]
        self._batch_base = [0] * n_shards
        self._position = [[0] * n_shards for _ in self.edges]  # batches of each shard each edge applied
        self._version = [[{} for _ in range(n_shards)] for _ in self.edges]  # edge -> shard -> group -> version
        self._next_sweep = SWEEP_S
        self.deliveries = 0  # (batch, edge) applications, as the per-edge views would count them

    def install(self, snap: ShardSnapshotSent) -> None:
        """The shard's initial state, shared by every edge (version 0 of each of its tables)."""
        s, n = snap.shard, len(self.edges)
        tables = {g: _Versions(LudoView.from_snapshot(blob), n) for g, blob in snap.tables}
        self._tables[s] = tables
        for e, edge in enumerate(self.edges):
            st = edge.state[s]
            st.views = {g: t.views[0] for g, t in tables.items()}
            st.epoch, st.seq = snap.epoch, snap.seq
            self._version[e][s] = dict.fromkeys(tables, 0)
            self._position[e][s] = snap.seq
        self._batch_base[s] = snap.seq

    def publish(self, batch: UpdateBatchPublished, now: float) -> None:
        """A batch the shard published at ``now``: it reaches each edge ``delays[s][e]`` later."""
        s = batch.shard
        if batch.seq != self._batch_base[s] + len(self._batches[s]) + 1:
            raise ValueError(f"shard {s}: batch {batch.seq} published out of order")
        tables = self._tables[s]
        self._batches[s].append((now, tuple((g, tables[g].add(blob)) for g, blob in batch.tables)))
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            self.advance_all(now)

    def advance(self, e: int, now: float) -> None:
        """Bring edge ``e`` to what it has received by ``now``."""
        positions, versions, edge = self._position[e], self._version[e], self.edges[e]
        delays = self.delays
        for s in range(self.shards):
            batches = self._batches[s]
            i = positions[s] - self._batch_base[s]
            d = delays[s][e]
            if i >= len(batches) or batches[i][0] + d > now:
                continue
            target: dict[int, int] = {}
            n = len(batches)
            while i < n and batches[i][0] + d <= now:
                for g, v in batches[i][1]:
                    target[g] = v
                i += 1
            moved = i + self._batch_base[s] - positions[s]
            self.deliveries += moved
            positions[s] += moved
            edge.state[s].seq = positions[s]
            mine = versions[s]
            for g, k in target.items():
                self._move(e, s, g, mine, k)

    def _move(self, e: int, s: int, g: int, mine: dict[int, int], k: int) -> None:
        t = self._tables[s][g]
        j = mine[g]
        t.refs[j] -= 1
        view = t.views.get(k)
        if view is None:
            view = t.make(k)
            t.views[k] = view
            t.refs[k] = 1
        else:
            t.refs[k] += 1
        mine[g] = k
        self.edges[e].state[s].views[g] = view
        self.pointers[e].refresh(s, g)
        if t.refs.get(j, 0) == 0:  # j is nobody's now (or was moved on in place)
            t.collect()

    def advance_all(self, now: float) -> None:
        """Every edge up to ``now``; then drop the batches every edge has applied."""
        for e in range(len(self.edges)):
            self.advance(e, now)
        for s in range(self.shards):
            low = min((p[s] for p in self._position), default=self._batch_base[s])
            cut = low - self._batch_base[s]
            if cut > 0:
                del self._batches[s][:cut]
                self._batch_base[s] = low

    def last_due(self) -> float:
        """When the last batch published so far reaches its last edge."""
        due = 0.0
        for s, batches in enumerate(self._batches):
            if batches:
                due = max(due, batches[-1][0] + max(self.delays[s], default=0.0))
        return due

    def lagging(self, now: float) -> bool:
        """Whether some edge has a batch still on its way at ``now``."""
        for s, batches in enumerate(self._batches):
            if batches and batches[-1][0] + max(self.delays[s], default=0.0) > now:
                return True
        return False

    def live_versions(self) -> int:
        """Table versions held (a table every edge reads at one version counts once)."""
        return sum(len(t.views) for tables in self._tables for t in tables.values())

    def memory_bytes(self) -> int:
        return sum(v.memory_bytes for tables in self._tables for t in tables.values() for v in t.views.values())
