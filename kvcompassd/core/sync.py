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
- A position announcement (``ShardPositionAnnounced``, ``on_position``) is a gap exactly as a
  later batch would be, without the batch: above the view's position it is a target (same epoch:
  a replay from ``s + 1``; a newer epoch or no state: a snapshot), under the same
  one-outstanding-request rule and timeout doubling; at or below it is ignored. While a
  transfer is in progress, a position of its epoch at or below its header is what the transfer
  brings; one beyond only raises the target (as a held batch does). A unit announces a
  stream's position only after ``[sync] position_heartbeat_ms`` without a batch on it, and
  again every such period while it stays idle (``PositionHeartbeats``): a lost *last* batch
  of a quiet stream is then repaired within one heartbeat and one request, where before it
  waited for the stream's next batch. On a busy stream every batch carries the position and
  no announcement is sent. With ``repair=False`` a position of the view's epoch is ignored
  (the prototype repairs no gap). An announcement that overtakes a batch still on its way (one
  relayed by another edge, a whole idle period late) costs one needless replay, never state.
- ``repair=False`` is the paper's prototype (simulator only): a later seq of the same epoch is
  applied on top of the gap, which is never repaired (Ludo records carry absolute state, so only
  the buckets the lost batches touched stay stale); a new epoch or a rejected batch still loads a
  snapshot.

- A snapshot of any size travels as a transfer (``kvcompassd.core.snapshots``): a header
  ``SnapshotTransferStarted`` naming its position ``(E, S)``, then chunks in order. A header at
  or below the view's position is stale; any other replaces the transfer in progress (a sender
  streams one at a time, in order, so its last header is the one it sends). One beyond the
  edge's bounds (``SyncSettings.max_snapshot_entries`` / ``max_snapshot_bytes``) is refused
  before anything is buffered, as a snapshot the view rejects is. While a transfer is in
  progress, batches of epoch ``E`` after ``S`` are held (up to ``max_buffered_bytes``; beyond
  that they are dropped and raise the target, so the replay brings them) and applied in order
  once the last chunk is installed: updates published while the chunks travel are not lost.
  Duplicate chunks are ignored; a chunk ahead of the next one asks to resume from the next
  (``SnapshotResumeRequested``, once per gap); a chunk failing its CRC or length abandons the
  transfer, and the outstanding request's timer asks again. Every chunk taken moves the
  deadline on (a long transfer is not a stall); a stalled one asks to resume, and so does the
  (re)subscription while a transfer is in progress. The view changes only when a whole,
  valid image is installed, so a refused or abandoned transfer never costs the current view.

So the number of requests an edge sends is at most one per gap episode plus one per timeout,
and a stream with any mix of loss, duplication, delay and reordering (announcements among the
batches) converges to the shard's state once messages get through (``tests/test_sync.py``,
``tests/test_snapshots.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .messages import (
    ResyncRequested,
    ShardPositionAnnounced,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotResumeRequested,
    SnapshotTransferStarted,
    UpdateBatchPublished,
    UpdatesSubscribed,
)
from .snapshots import SnapshotAssembly, SnapshotRefused

if TYPE_CHECKING:
    from .index import EdgeIndexView, MaintenanceShard

__all__ = ["SNAPSHOT_MESSAGES", "CatchUp", "EdgeSync", "PositionHeartbeats", "ShardFollower", "SyncSettings", "SyncStep",
           "catch_up"]

_NOTHING = (-1, -1)  # the position of a view without state: below every real one

# What brings an edge a snapshot: whole (it fits one frame, or in the simulator), or a transfer.
SNAPSHOT_MESSAGES = (ShardSnapshotSent, SnapshotTransferStarted, SnapshotChunkSent)
SnapshotMessage = Union[ShardSnapshotSent, SnapshotTransferStarted, SnapshotChunkSent]
Request = Union[ResyncRequested, SnapshotResumeRequested]


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """How an edge follows the streams. Times in seconds."""

    resync_timeout_s: float = 2.0
    max_resync_timeout_s: float = 30.0
    repair: bool = True
    # What an edge takes of one snapshot transfer (its header declares both before any chunk).
    max_snapshot_entries: int = 1 << 28
    max_snapshot_bytes: int = 4 << 30
    # Live batches held per shard while a transfer is in progress (beyond: replayed after it).
    max_buffered_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not 0 < self.resync_timeout_s <= self.max_resync_timeout_s:
            raise ValueError(f"need 0 < resync_timeout_s <= max_resync_timeout_s, got "
                             f"{self.resync_timeout_s!r}, {self.max_resync_timeout_s!r}")
        for name in ("max_snapshot_entries", "max_snapshot_bytes", "max_buffered_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class SyncStep:
    """What the edge did with one input: applied it or not (and why), and the request to send.
    A transfer's header or chunk counts as applied when it was taken; the last chunk, when the
    whole snapshot was installed."""

    applied: bool
    send: Request | None = None
    reason: str = ""


_APPLIED = SyncStep(True)


class ShardFollower:
    """The edge side of one shard's stream: position, gap detection, the outstanding request."""

    __slots__ = ("view", "shard", "edge", "settings", "_target", "_need_snapshot", "_deadline", "_timeout_s",
                 "_assembly", "_resume_from", "_buffered", "_buffered_bytes",
                 "gaps", "gaps_skipped", "position_gaps", "requests", "snapshots_installed", "transfers_started",
                 "transfers_abandoned", "chunks_taken", "batches_held", "batches_dropped")

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
        self.position_gaps = 0  # catch-ups a position announcement opened (no batch had shown the gap)
        self.requests = 0  # catch-up requests sent (subscriptions and resumes included)
        self.snapshots_installed = 0
        self._assembly: SnapshotAssembly | None = None  # the snapshot transfer in progress
        self._resume_from: int | None = None  # the chunk a resume request asked for, until it came
        self._buffered: dict[int, UpdateBatchPublished] = {}  # seq -> batch held during the transfer
        self._buffered_bytes = 0
        self.transfers_started = 0
        self.transfers_abandoned = 0
        self.chunks_taken = 0
        self.batches_held = 0
        self.batches_dropped = 0  # not held (the buffer was full): the replay brings them

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

    @property
    def transfer(self) -> SnapshotAssembly | None:
        """The snapshot transfer in progress, if any."""
        return self._assembly

    def subscription(self, *, now: float) -> UpdatesSubscribed | SnapshotResumeRequested:
        """What to send on every (re)connection to the shard's unit. It asks for everything
        after the view's position, so it stands for any request outstanding before; with a
        transfer in progress it asks to resume that one (which also subscribes)."""
        epoch, seq = self.position
        self.requests += 1
        if self._assembly is not None:
            self._resume_from = self._assembly.next_chunk
            self._deadline = now + self._timeout_s
            return self._resume()
        if self._target is None and seq < 0:
            self._target, self._need_snapshot = (0, 0), True
        if self._target is not None:
            self._deadline = now + self._timeout_s
        return UpdatesSubscribed(self.edge, self.shard, max(epoch, 0), seq)

    def on_batch(self, batch: UpdateBatchPublished, *, now: float) -> SyncStep:
        assembly = self._assembly
        if assembly is not None and batch.epoch == assembly.header.epoch and batch.seq > assembly.header.seq:
            return self._hold(batch, now)
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

    def on_position(self, announced: ShardPositionAnnounced, *, now: float) -> SyncStep:
        """The unit's stream stands at ``(epoch, seq)``: a gap if the view is below it (see the
        module rules); nothing is applied."""
        got = (announced.epoch, announced.seq)
        assembly = self._assembly
        if assembly is not None and announced.epoch == assembly.header.epoch:
            if got <= assembly.position:
                return SyncStep(False, reason=f"position {got}: the snapshot in transfer reaches it")
            # Batches after the snapshot are missing (or on their way): the catch-up is over once
            # the view holds them; the transfer's timer asks for them if they never come.
            self.gaps += 1
            self.position_gaps += self._target is None
            self._target = got if self._target is None else max(self._target, got)
            return SyncStep(False, reason=f"position {got} announced beyond the snapshot in transfer "
                                          f"{assembly.position}")
        at = self.position
        if got <= at:
            return SyncStep(False, reason=f"position {got} announced, view at {at}: nothing missing")
        snapshot = at == _NOTHING or announced.epoch != at[0]
        if snapshot:
            why = "no state yet" if at == _NOTHING else f"new epoch {announced.epoch} (view at {at[0]})"
            reason = f"position {got} announced: {why}"
        elif not self.settings.repair:
            return SyncStep(False, reason=f"position {got} announced, view at {at}: repair is off")
        else:
            reason = f"position {got} announced, view at {at}: the last batches were lost"
        self.position_gaps += self._target is None
        return self._gap(got, snapshot, reason, now)

    def on_snapshot(self, snap: ShardSnapshotSent, *, now: float) -> SyncStep:
        installed = self.view.install_snapshot(snap)  # refuses stale ones: a position never goes back
        if not installed.applied:
            return self._snapshot_failed(installed.reason, now)
        self.snapshots_installed += 1
        self._check_reached()
        return self._after_install(SyncStep(True), now)

    def on_transfer_started(self, header: SnapshotTransferStarted, *, now: float) -> SyncStep:
        """A snapshot transfer's header: start taking its chunks (see the module rules)."""
        got = (header.epoch, header.seq)
        at = self.position
        current = self._assembly
        if current is not None and current.snapshot_id == header.snapshot_id:
            self._progress(now)  # a resumed transfer announces itself again: keep what arrived
            return SyncStep(False, reason=f"snapshot {header.snapshot_id} already in transfer "
                                          f"(chunk {current.next_chunk} next)")
        if at != _NOTHING and got <= at:
            return SyncStep(False, reason=f"stale snapshot transfer {got} <= {at}")
        # Otherwise the last header wins, even one older than the transfer in progress: a sender
        # streams one transfer at a time on an ordered channel, so a new header means the
        # previous transfer is over (superseded, or gone from the sender, which answered a
        # resume with what it has now); the previous one's chunks are ignored from here on.
        try:
            assembly = SnapshotAssembly(header, max_entries=self.settings.max_snapshot_entries,
                                        max_bytes=self.settings.max_snapshot_bytes)
        except SnapshotRefused as exc:
            return self._snapshot_failed(f"snapshot transfer refused: {exc}", now)
        if current is not None:
            self.transfers_abandoned += 1
        self._assembly, self._resume_from = assembly, None
        for seq in [q for q, b in self._buffered.items() if b.epoch != header.epoch or b.seq <= header.seq]:
            self._buffered_bytes -= _batch_bytes(self._buffered.pop(seq))
        self.transfers_started += 1
        self._progress(now)
        return SyncStep(True, reason=f"snapshot {header.snapshot_id} at {got}: {header.chunks} chunks, "
                                     f"{header.total_bytes} bytes, {header.entries} entries")

    def on_chunk(self, chunk: SnapshotChunkSent, *, now: float) -> SyncStep:
        """One chunk of the transfer in progress; the last one installs the snapshot."""
        assembly = self._assembly
        if assembly is None:
            return SyncStep(False, reason=f"chunk {chunk.index} of snapshot {chunk.snapshot_id}: no transfer in progress")
        outcome = assembly.add(chunk)
        if outcome.kind in ("foreign", "duplicate"):
            return SyncStep(False, reason=outcome.reason)
        if outcome.kind == "gap":
            if self._resume_from == assembly.next_chunk:
                return SyncStep(False, reason=f"{outcome.reason} (resume already asked)")
            self._resume_from = assembly.next_chunk
            self.requests += 1
            self._progress(now)
            return SyncStep(False, self._resume(), outcome.reason)
        if outcome.kind == "corrupt":
            self.abandon_transfer()
            return self._snapshot_failed(f"snapshot {assembly.snapshot_id} abandoned: {outcome.reason}", now)
        self.chunks_taken += 1
        if self._resume_from is not None and assembly.next_chunk > self._resume_from:
            self._resume_from = None
        if not assembly.complete:
            self._progress(now)
            return SyncStep(True)
        self._assembly, self._resume_from = None, None
        h = assembly.header
        installed = self.view.install_tables(h.shard, h.epoch, h.seq, assembly.tables(), entries=h.entries)
        if installed.applied:
            self.snapshots_installed += 1
            self._check_reached()
            return self._after_install(SyncStep(True, reason=f"snapshot {h.snapshot_id} installed at "
                                                             f"{(h.epoch, h.seq)}"), now)
        if self.position >= (h.epoch, h.seq):
            # Batches took the view there meanwhile: the held ones may still be next.
            return self._after_install(SyncStep(False, reason=installed.reason), now)
        self._drop_held()
        return self._snapshot_failed(installed.reason, now)

    def abandon_transfer(self) -> None:
        """Forget the transfer in progress and the batches held for it (its sender went away
        for good, e.g. a peer edge's copy that ended part-way); the view is untouched."""
        if self._assembly is not None:
            self.transfers_abandoned += 1
        self._assembly, self._resume_from = None, None
        self._drop_held()
        if self._target is None:
            self._deadline = None

    def on_timer(self, *, now: float) -> SyncStep:
        """Send the outstanding request again if its target was not reached in time, or ask to
        resume a transfer that stopped making progress."""
        if self._deadline is None or now < self._deadline:
            return SyncStep(False)
        self._timeout_s = min(2 * self._timeout_s, self.settings.max_resync_timeout_s)
        self._deadline = now + self._timeout_s
        if self._assembly is not None:
            self._resume_from = self._assembly.next_chunk
            self.requests += 1
            return SyncStep(False, self._resume(), f"snapshot {self._assembly.snapshot_id} stalled at chunk "
                                                   f"{self._assembly.next_chunk}; asked to resume")
        if self._target is None:
            self._deadline = None
            return SyncStep(False)
        return SyncStep(False, self._request(), f"catch-up toward {self._target} timed out; asked again")

    # -- helpers ------------------------------------------------------------------------------

    def _snapshot_failed(self, reason: str, now: float) -> SyncStep:
        # A view without state needs one; a bad or stale one on top of a good view costs nothing.
        if self.position == _NOTHING:
            return self._gap((0, 0), True, reason, now)
        return SyncStep(False, reason=reason)

    def _progress(self, now: float) -> None:
        """A transfer moved: its deadline is one timeout from now (a long transfer is no stall)."""
        self._deadline = now + self._timeout_s

    def _resume(self) -> SnapshotResumeRequested:
        assembly = self._assembly
        return SnapshotResumeRequested(self.edge, self.shard, assembly.snapshot_id, assembly.next_chunk)

    def _hold(self, batch: UpdateBatchPublished, now: float) -> SyncStep:
        got = (batch.epoch, batch.seq)
        # Reaching the snapshot's position is not enough any more: the catch-up is over once
        # the view holds this batch too (the timer asks for a replay if it never comes).
        self._target = got if self._target is None else max(self._target, got)
        if batch.seq in self._buffered:
            return SyncStep(False, reason=f"duplicate batch {got} held during the snapshot transfer")
        size = _batch_bytes(batch)
        if self._buffered_bytes + size > self.settings.max_buffered_bytes:
            self.batches_dropped += 1
            return SyncStep(False, reason=f"batch {got} not held: {self._buffered_bytes} bytes already held "
                                          f"during the snapshot transfer; the replay will bring it")
        self._buffered[batch.seq] = batch
        self._buffered_bytes += size
        self.batches_held += 1
        return SyncStep(False, reason=f"batch {got} held until snapshot {self._assembly.position} is installed")

    def _drop_held(self) -> None:
        self._buffered.clear()
        self._buffered_bytes = 0

    def _after_install(self, step: SyncStep, now: float) -> SyncStep:
        """Apply the batches held during the transfer, in order; a gap among them asks as usual."""
        if step.applied:
            self._need_snapshot = False  # what is still missing (held or dropped batches) a replay brings
        assembly = self._assembly
        if assembly is not None and assembly.position <= self.position:
            self.abandon_transfer()  # a whole snapshot overtook it
        if not self._buffered or self._assembly is not None:
            if self._target is None and self._assembly is None:
                self._deadline = None
            return step
        held = [self._buffered[seq] for seq in sorted(self._buffered)]
        self._drop_held()
        send = step.send
        for batch in held:
            outcome = self.on_batch(batch, now=now)
            send = send or outcome.send
        if self._target is None:
            self._deadline = None
        return SyncStep(step.applied, send, step.reason)

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
            self._target, self._need_snapshot = None, False
            self._deadline = None if self._assembly is None else self._deadline
            self._timeout_s = self.settings.resync_timeout_s


def _batch_bytes(batch: UpdateBatchPublished) -> int:
    return sum(len(blob) for _, blob in batch.tables)


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

    def on_snapshot_message(self, message: SnapshotMessage, *, now: float) -> SyncStep:
        """A snapshot in any form (``SNAPSHOT_MESSAGES``): whole, or a transfer's header or chunk."""
        f = self._follower(message.shard)
        if f is None:
            return SyncStep(False, reason=f"snapshot for unknown shard {message.shard}")
        if isinstance(message, SnapshotChunkSent):
            return f.on_chunk(message, now=now)
        if isinstance(message, SnapshotTransferStarted):
            return f.on_transfer_started(message, now=now)
        return f.on_snapshot(message, now=now)

    def on_position(self, announced: ShardPositionAnnounced, *, now: float) -> SyncStep:
        f = self._follower(announced.shard)
        if f is None:
            return SyncStep(False, reason=f"position for unknown shard {announced.shard}")
        return f.on_position(announced, now=now)

    def subscription(self, shard: int, *, now: float) -> UpdatesSubscribed | SnapshotResumeRequested:
        return self.followers[shard].subscription(now=now)

    def on_timer(self, *, now: float) -> list[Request]:
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

    @property
    def position_gaps(self) -> int:
        """Catch-ups a position announcement opened (no batch had shown the gap)."""
        return sum(f.position_gaps for f in self.followers)


class PositionHeartbeats:
    """When a maintenance unit announces each of its streams' positions (sans-IO; see the
    module rules): ``period_s`` after the stream last published a batch or announced, so a busy
    stream announces nothing. One due time per stream; the shell arms one timer at
    ``next_deadline`` and calls ``due`` when it fires. ``published`` only ever moves a due time
    later, so a timer armed earlier is never late: at worst it fires once for nothing."""

    __slots__ = ("period_s", "_due")

    def __init__(self, period_s: float, streams: Iterable[Hashable], *, now: float):
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.period_s = float(period_s)
        self._due: dict[Hashable, float] = {stream: now + self.period_s for stream in streams}

    def published(self, stream: Hashable, *, now: float) -> None:
        """``stream`` published a batch at ``now`` (which carried its position)."""
        self._due[stream] = now + self.period_s

    def stop(self, stream: Hashable) -> None:
        """No announcement of ``stream`` until it publishes again (the simulator: every edge is at
        its position, so the announcements would change nothing and the run would never end)."""
        self._due.pop(stream, None)

    def due(self, *, now: float) -> list[Hashable]:
        """The streams to announce at ``now``; each is due again one period later."""
        out = [stream for stream, at in self._due.items() if at <= now]
        for stream in out:
            self._due[stream] = now + self.period_s
        return out

    def next_deadline(self) -> float | None:
        return min(self._due.values()) if self._due else None


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


def catch_up(shard: MaintenanceShard, epoch: int, from_seq: int, *,
             take_snapshot: Callable[[], ShardSnapshotSent] | None = None) -> CatchUp:
    """Everything an edge at ``(epoch, from_seq - 1)`` is missing: the replay log's batches
    from ``from_seq`` when it still holds them, else a snapshot (see the module rules), taken
    by ``take_snapshot`` (default ``shard.snapshot``; a daemon passes one that reuses a
    snapshot already taken at the same position: ``SnapshotSource``)."""
    published = shard.flush()
    if epoch == shard.epoch and from_seq >= 1:
        replay = shard.replay_from(from_seq)
        if replay is not None:
            return CatchUp(published, replay=tuple(replay))
    return CatchUp(published, snapshot=(take_snapshot or shard.snapshot)())
