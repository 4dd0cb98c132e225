"""The index-sync protocol, sans-IO: how a shard's ordered update stream reaches every edge.

One ``ShardFollower`` per (edge, shard) decides what an edge does with each batch, snapshot and
timer; ``catch_up`` is the maintenance unit's answer to an edge that fell behind. The edge and
maintenance daemons and the simulator all drive these and keep no sync logic of their own: the
shells move the messages and arm the one timer ``EdgeSync.next_deadline`` names.

Rules and invariants:

- A position is ``(epoch, seq)``, ordered lexicographically. A maintenance unit keeps one epoch
  for its life, larger than any earlier life's (wall-clock ms at start), and numbers its batches
  1, 2, ... in it. A view at ``(e, s)`` holds exactly the shard's state after batch ``s`` of
  epoch ``e``; a view without state is at "nothing" (below every position).
- An edge applies batch ``(e, s + 1)`` only on top of ``(e, s)``. A batch or snapshot at or below
  the view's position is stale and ignored (duplicates, replays that arrive after the live
  batch, an older epoch's stragglers): it never triggers a request.
- Anything else above the position is a gap: a later seq of the same epoch (replay from
  ``s + 1``), a newer epoch or no state at all (snapshot), or a batch the view rejects
  (snapshot). The follower then needs the *target*, the highest position it has seen.
- At most one catch-up request is outstanding per (edge, shard). It is satisfied once the view
  reaches the target, whatever brought it there (the replay, a snapshot, late live batches);
  gaps found meanwhile only raise the target. If the target is not reached within the timeout,
  the request is sent again from the view's position, and the timeout doubles up to a cap; it
  returns to the base value once the target is reached. A (re)subscription is such a request.
- A catch-up answer is the missing batches when the unit's bounded replay log still holds them,
  else a snapshot; a request for another epoch, or from seq 0, always gets a snapshot. Edits
  applied but not yet published go out first (``CatchUp.published``, to every subscriber), so
  the answer reaches every position any edge can have seen.
- ``repair=False`` is the paper's prototype (simulator only): a later seq of the same epoch is
  applied on top of the gap, which is never repaired (Ludo records carry absolute state, so only
  the buckets the lost batches touched stay stale); a new epoch or a rejected batch still loads a
  snapshot.

So the number of requests an edge sends is at most one per gap episode plus one per timeout,
and a stream with any mix of loss, duplication, delay and reordering converges to the shard's
state once messages get through (``tests/test_sync.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .messages import ResyncRequested, ShardSnapshotSent, UpdateBatchPublished, UpdatesSubscribed

if TYPE_CHECKING:
    from .index import EdgeIndexView, MaintenanceShard

__all__ = ["CatchUp", "EdgeSync", "ShardFollower", "SyncSettings", "SyncStep", "catch_up"]

_NOTHING = (-1, -1)  # the position of a view without state: below every real one


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """How an edge follows the streams. Times in seconds."""

    resync_timeout_s: float = 2.0
    max_resync_timeout_s: float = 30.0
    repair: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.resync_timeout_s <= self.max_resync_timeout_s:
            raise ValueError(f"need 0 < resync_timeout_s <= max_resync_timeout_s, got "
                             f"{self.resync_timeout_s!r}, {self.max_resync_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class SyncStep:
    """What the edge did with one input: applied it or not (and why), and the request to send."""

    applied: bool
    send: ResyncRequested | None = None
    reason: str = ""


_APPLIED = SyncStep(True)


class ShardFollower:
    """The edge side of one shard's stream: position, gap detection, the outstanding request."""

    __slots__ = ("view", "shard", "edge", "settings", "_target", "_need_snapshot", "_deadline", "_timeout_s",
                 "gaps", "gaps_skipped", "requests", "snapshots_installed")

    def __init__(self, view: EdgeIndexView, shard: int, settings: SyncSettings):
        self.view = view
        self.shard = shard
        self.edge = view.edge
        self.settings = settings
        self._target: tuple[int, int] | None = None  # the position the outstanding request must reach
        self._need_snapshot = False  # the next (re)sent request asks for a snapshot
        self._deadline: float | None = None
        self._timeout_s = settings.resync_timeout_s
        self.gaps = 0  # inputs that found a gap (several may share one request)
        self.gaps_skipped = 0  # repair=False: gaps applied over
        self.requests = 0  # catch-up requests sent (subscriptions included)
        self.snapshots_installed = 0

    @property
    def position(self) -> tuple[int, int]:
        st = self.view.state[self.shard]
        return (st.epoch, st.seq) if st.ready else _NOTHING

    @property
    def outstanding(self) -> tuple[int, int] | None:
        """The target of the outstanding request, or None."""
        return self._target

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def subscription(self, *, now: float) -> UpdatesSubscribed:
        """What to send on every (re)connection to the shard's unit. It asks for everything
        after the view's position, so it stands for any request outstanding before."""
        epoch, seq = self.position
        self.requests += 1
        if self._target is None and seq < 0:
            self._target, self._need_snapshot = (0, 0), True
        if self._target is not None:
            self._deadline = now + self._timeout_s
        return UpdatesSubscribed(self.edge, self.shard, max(epoch, 0), seq)

    def on_batch(self, batch: UpdateBatchPublished, *, now: float) -> SyncStep:
        at = self.position
        got = (batch.epoch, batch.seq)
        if got <= at:
            return SyncStep(False, reason=f"stale or duplicate batch {got} <= {at}")
        if at == _NOTHING or batch.epoch != at[0]:
            why = "no state yet" if at == _NOTHING else f"new epoch {batch.epoch} (view at {at[0]})"
            return self._gap(got, True, why, now)
        if batch.seq > at[1] + 1:
            if not self.settings.repair:
                self.gaps_skipped += 1
                self.view.skip_to(batch.shard, batch.seq - 1)
            else:
                return self._gap(got, False, f"gap: got seq {batch.seq}, expected {at[1] + 1}", now)
        rejected = self.view.apply_next(batch)
        if rejected is not None:
            return self._gap(got, True, rejected, now)
        self._check_reached()
        return _APPLIED

    def on_snapshot(self, snap: ShardSnapshotSent, *, now: float) -> SyncStep:
        installed = self.view.install_snapshot(snap)  # refuses stale ones: a position never goes back
        if not installed.applied:
            # A view without state needs one; a bad or stale one on top of a good view costs nothing.
            if self.position == _NOTHING:
                return self._gap((0, 0), True, installed.reason, now)
            return SyncStep(False, reason=installed.reason)
        self.snapshots_installed += 1
        self._check_reached()
        return _APPLIED

    def on_timer(self, *, now: float) -> SyncStep:
        """Send the outstanding request again if its target was not reached in time."""
        if self._deadline is None or now < self._deadline:
            return SyncStep(False)
        self._timeout_s = min(2 * self._timeout_s, self.settings.max_resync_timeout_s)
        self._deadline = now + self._timeout_s
        return SyncStep(False, self._request(), f"catch-up toward {self._target} timed out; asked again")

    def _gap(self, target: tuple[int, int], snapshot: bool, reason: str, now: float) -> SyncStep:
        self.gaps += 1
        if self._target is not None:
            # The outstanding request covers it; a later gap only moves the target on.
            self._target = max(self._target, target)
            self._need_snapshot = self._need_snapshot or snapshot
            return SyncStep(False, reason=f"{reason} (catch-up already asked)")
        self._target, self._need_snapshot = target, snapshot
        self._deadline = now + self._timeout_s
        return SyncStep(False, self._request(), reason)

    def _request(self) -> ResyncRequested:
        epoch, seq = self.position
        snapshot = self._need_snapshot or seq < 0 or (self._target is not None and self._target[0] != epoch)
        self.requests += 1
        return ResyncRequested(self.edge, self.shard, max(epoch, 0), 0 if snapshot else seq + 1)

    def _check_reached(self) -> None:
        if self._target is not None and self.position >= self._target:
            self._target, self._need_snapshot, self._deadline = None, False, None
            self._timeout_s = self.settings.resync_timeout_s


class EdgeSync:
    """One edge's followers, one per shard, over its ``EdgeIndexView``."""

    def __init__(self, view: EdgeIndexView, settings: SyncSettings | None = None):
        self.view = view
        self.settings = settings or SyncSettings()
        self.followers = [ShardFollower(view, s, self.settings) for s in range(view.shards)]

    def _follower(self, shard: int) -> ShardFollower | None:
        return self.followers[shard] if 0 <= shard < len(self.followers) else None

    def on_batch(self, batch: UpdateBatchPublished, *, now: float) -> SyncStep:
        f = self._follower(batch.shard)
        return SyncStep(False, reason=f"batch for unknown shard {batch.shard}") if f is None else f.on_batch(batch, now=now)

    def on_snapshot(self, snap: ShardSnapshotSent, *, now: float) -> SyncStep:
        f = self._follower(snap.shard)
        return SyncStep(False, reason=f"snapshot for unknown shard {snap.shard}") if f is None else f.on_snapshot(snap, now=now)

    def subscription(self, shard: int, *, now: float) -> UpdatesSubscribed:
        return self.followers[shard].subscription(now=now)

    def on_timer(self, *, now: float) -> list[ResyncRequested]:
        """Requests due again at ``now`` (at most one per shard)."""
        return [step.send for f in self.followers if (step := f.on_timer(now=now)).send is not None]

    def next_deadline(self) -> float | None:
        deadlines = [f.deadline for f in self.followers if f.deadline is not None]
        return min(deadlines) if deadlines else None

    @property
    def requests(self) -> int:
        return sum(f.requests for f in self.followers)

    @property
    def gaps(self) -> int:
        return sum(f.gaps for f in self.followers)


@dataclass(frozen=True, slots=True)
class CatchUp:
    """A maintenance unit's answer to an edge behind it: ``published`` (edits pending until now,
    for every subscriber, sent first), then ``replay`` or ``snapshot`` for the requester."""

    published: UpdateBatchPublished | None
    replay: tuple[UpdateBatchPublished, ...] = ()
    snapshot: ShardSnapshotSent | None = None

    @property
    def messages(self) -> tuple[UpdateBatchPublished | ShardSnapshotSent, ...]:
        """What goes to the requester, in order."""
        return self.replay if self.snapshot is None else (self.snapshot,)


def catch_up(shard: MaintenanceShard, epoch: int, from_seq: int) -> CatchUp:
    """Everything an edge at ``(epoch, from_seq - 1)`` is missing: the replay log's batches
    from ``from_seq`` when it still holds them, else a snapshot (see the module rules)."""
    published = shard.flush()
    if epoch == shard.epoch and from_seq >= 1:
        replay = shard.replay_from(from_seq)
        if replay is not None:
            return CatchUp(published, replay=tuple(replay))
    return CatchUp(published, snapshot=shard.snapshot())
