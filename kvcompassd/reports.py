"""An agent's index events on their way to the maintenance units: routed by shard and coalesced
into ``PrefixEventsReported`` reports.

An engine publishes its KV events in small batches (often one per request it serves). Sent one
report each, every batch would cost a QUIC packet at the agent, its acknowledgement back, and a
receive, a report and a C call at the maintenance unit; that fixed cost, not the events,
dominated the agent's CPU per served request. So events gather per shard for ``delay_s``
(``[sync] report_delay_ms``, default 20 ms) after the first of a window, or until
``max_events`` wait, and leave as one report per shard (see
:class:`kvcompassd.pacing.FlushPacer`): a lone event leaves within the window, a burst as one
report.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvcompassd.core.config import SyncParams
from kvcompassd.core.events import IndexEvent, IndexEventColumns
from kvcompassd.pacing import FlushPacer
from kvcompassd.wire import PrefixEventsReported

DEFAULT_REPORT_DELAY_S = SyncParams().report_delay_ms / 1000.0
EVENTS_PER_REPORT = 4096
# Up to this many events, add_events splits them by shard in Python (numpy's per-call cost is
# more than the work for an engine batch's few index events); above, with array operations.
SPLIT_IN_PYTHON_MAX = 64

# send(shard, report) -> whether the report went out (False: the shard's unit is unreachable;
# the agent re-registers everything when it reconnects, so the rest of this flush is dropped).
SendReport = Callable[[int, PrefixEventsReported], bool]


class ReportCoalescer:
    """One worker's pending index events per shard, and its report numbering."""

    def __init__(self, worker: str, shards: int, send: SendReport, *, delay_s: float = DEFAULT_REPORT_DELAY_S,
                 max_events: int = EVENTS_PER_REPORT):
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards!r}")
        self.worker = worker
        self.shards = shards
        self.max_events = max_events
        self.seq = 0
        self._send = send
        self._pending: dict[int, list[IndexEventColumns]] = {}
        self._pacer = FlushPacer(self._send_pending, delay_s=delay_s, max_pending=max_events)

    def add_events(self, events: Sequence[IndexEvent], lengths: Sequence[int] | None = None) -> None:
        """Queue events of this worker for any shards (a key's shard is ``key % shards``), with
        each one's indexed length if known (the unit sends each edge region only the lengths it
        looks up)."""
        if not events:
            return
        shards = self.shards
        if shards == 1:
            self.add(0, IndexEventColumns.from_events(events, lengths))
            return
        if len(events) <= SPLIT_IN_PYTHON_MAX:  # the usual few events of an engine batch: no numpy
            by_shard: dict[int, list[int]] = {}
            for i, event in enumerate(events):
                by_shard.setdefault(event.key % shards, []).append(i)
            for shard in sorted(by_shard):
                picked = by_shard[shard]
                self.add(shard, IndexEventColumns.from_events([events[i] for i in picked],
                                                              None if lengths is None else [lengths[i] for i in picked]))
            return
        columns = IndexEventColumns.from_events(events, lengths)
        owners = columns.key_array() % np.uint64(self.shards)
        for shard in np.unique(owners).tolist():
            self.add(shard, columns.select(owners == shard))

    def add(self, shard: int, columns: IndexEventColumns) -> None:
        """Queue events that all belong to ``shard``."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} out of range for {self.shards} shards")
        if len(columns):
            self._pending.setdefault(shard, []).append(columns)
            self._pacer.added(len(columns))

    def discard(self, shard: int) -> None:
        """Forget what waits for ``shard`` (a re-registration is about to send its whole state)."""
        self._pending.pop(shard, None)

    def flush(self) -> None:
        """Send everything pending now."""
        self._pacer.flush_now()

    def cancel(self) -> None:
        """Forget the window's scheduled report (a stopping agent: its peers are closing)."""
        self._pacer.cancel()

    def report(self, shard: int, columns: IndexEventColumns) -> None:
        """Send ``columns`` to ``shard`` now, in reports of at most ``max_events``."""
        n, step = len(columns), self.max_events
        for i in range(0, n, step):
            chunk = columns if n <= step else columns.slice(i, i + step)
            self.seq += 1
            if not self._send(shard, PrefixEventsReported(self.worker, self.seq, chunk)):
                return

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for shard, parts in pending.items():
            self.report(shard, IndexEventColumns.concat(parts))
