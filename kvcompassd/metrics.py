"""Prometheus metrics of each daemon mode, each on its own registry (several nodes may share a
process in tests and the demo), served by ``start_metrics_server``."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcompassd.pacing import READING_PERIOD_REASONS

# Decisions take tens of microseconds; requests take milliseconds to seconds.
_DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class MaintenanceMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.events = Counter("kvcompass_index_events", "Index events from agents, by outcome", ["outcome"], registry=r)
        self.batches = Counter("kvcompass_update_batches_published", "Update batches pushed to edges", registry=r)
        self.snapshots = Counter("kvcompass_snapshots_sent", "Shard snapshots sent to edges", registry=r)
        self.positions_announced = Counter("kvcompass_positions_announced", "Position announcements of idle streams "
                                           "sent to edges ([sync] position_heartbeat_ms)", registry=r)
        self.refused_messages = Counter("kvcompass_refused_messages", "Messages refused, by message type and "
                                        "reason (forbidden: the sender has no authority for it)",
                                        ["message", "reason"], registry=r)

    def watch_tables(self, table_stats: Callable[[], list[dict]]) -> None:
        """Export ``MaintenanceShard.table_stats()`` (entries and load per region group), read
        when scraped: nothing is added to the write path that flushes a batch every few ms."""
        self.registry.register(_ShardTablesCollector(table_stats))

    def watch_position(self, positions: Callable[[], list[tuple[int, str, int, int]]]) -> None:
        """Export each of the shard's streams' (shard, stream, epoch, seq), read when scraped
        (stream: "full" or an edge region's, kvcompassd.core.streams); an edge exports the same
        of its view, and the difference of the two seqs is how many batches the view is behind."""
        self.registry.register(_PositionCollector("kvcompass_shard", "this maintenance unit's shard", positions))


class _PositionCollector:
    """``<prefix>_epoch{shard, stream}`` and ``<prefix>_seq{shard, stream}``: where an index copy
    of a shard's stream stands."""

    def __init__(self, prefix: str, what: str, positions: Callable[[], list[tuple[int, str, int, int]]]) -> None:
        self._prefix, self._what, self._positions = prefix, what, positions

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily(f"{self._prefix}_epoch", f"Epoch of {self._what} (a new one per maintenance start)",
                                  labels=["shard", "stream"]),
                GaugeMetricFamily(f"{self._prefix}_seq", f"Last update batch (seq within the epoch) of {self._what}",
                                  labels=["shard", "stream"]))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        epoch, seq = self._families()
        for shard, stream, e, s in self._positions():
            epoch.add_metric([str(shard), stream], e)
            seq.add_metric([str(shard), stream], s)
        yield epoch
        yield seq


class _ShardTablesCollector:
    def __init__(self, table_stats: Callable[[], list[dict]]) -> None:
        self._table_stats = table_stats

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("kvcompass_shard_entries", "Entries in this shard's table of a region group",
                                  labels=["group", "region"]),
                GaugeMetricFamily("kvcompass_shard_table_load", "Share of the slots of a region group's table that "
                                  "hold an entry (a keyless edge view's false hits grow with it)",
                                  labels=["group", "region"]))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        entries, load = self._families()
        for table in self._table_stats():
            labels = [str(table["group"]), table["region"]]
            entries.add_metric(labels, table["entries"])
            load.add_metric(labels, table["load"])
        yield entries
        yield load


# The chosen worker's score terms observed per decision (ScoreTerms fields, in ms).
CHOSEN_SCORE_TERMS = ("wan_ms", "queue_ms", "prefill_ms", "reload_ms")

# Observations a BatchedObservations holds before it folds them in without waiting for a read.
BATCH_LIMIT = 512


class _HeldUpdates:
    """Updates of one metric held in a deque and folded into it (``fold``) whenever
    ``BATCH_LIMIT`` are held, and before every read."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: collections.deque[float] = collections.deque()

    def _hold(self, amount: float = 1) -> None:
        held = self._held
        held.append(amount)
        if len(held) >= BATCH_LIMIT:
            self.fold()

    def _take(self) -> list:
        """What is held, taken out (a fold in another thread may take part of it)."""
        held, taken = self._held, []
        pop = held.popleft
        try:
            for _ in range(len(held)):
                taken.append(pop())
        except IndexError:  # a fold in another thread took the rest
            pass
        return taken

    def fold(self) -> None:
        raise NotImplementedError


class BatchedObservations(_HeldUpdates):
    """A histogram's observations held and folded into it in one pass: per bucket, one increment
    for all of them, instead of prometheus_client's lock, bucket search and two increments per
    observation (a request observes seven; py-spy of the zero-delay gateway run, c = 16, at d60e101
    put the two call sites' observations at ~1.6 % of the edge's CPU). ``observe`` appends; ``fold`` counts them into ``histogram`` (a ``Histogram`` or
    one labelled child), which happens whenever ``BATCH_LIMIT`` are held and before every read of
    the metrics (``EdgeMetrics.fold``: a scrape, a front door's publication), so what is read is
    exact and what is held bounded. Buckets and sums equal per-observation ``observe``'s
    (``tests/test_metrics.py``). A scrape of the metrics port folds from prometheus_client's
    server thread while the event loop observes: the observations are a deque, whose append and
    popleft are atomic, so each is folded exactly once by whichever fold takes it."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, histogram) -> None:
        super().__init__()
        # prometheus_client's own fields of a Histogram (or a labelled child): its bounds (the
        # last +Inf) and a value per bucket and for the sum, incremented as its observe does.
        self._bounds, self._buckets, self._sum = histogram._upper_bounds, histogram._buckets, histogram._sum

    observe = _HeldUpdates._hold

    def fold(self) -> None:
        taken = self._take()
        if not taken:
            return
        bounds, buckets = self._bounds, self._buckets
        counts = [0] * len(bounds)
        total = 0.0
        for amount in taken:
            amount = float(amount)
            total += amount
            if amount == amount:  # NaN lands in no bucket, as observe's ``amount <= bound`` says
                # the first bound >= amount (bounds end with +Inf)
                counts[bisect.bisect_left(bounds, amount)] += 1
        self._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)


class BatchedCount(_HeldUpdates):
    """A counter's (or one labelled child's) increments held and added in one ``inc`` at each
    fold, as ``BatchedObservations`` holds a histogram's: prometheus_client's ``inc`` takes a lock
    per call, and a request made four or five of them (6 us each in the edge's request path,
    thread CPU timed in place at c = 1). Folded with the observations (``EdgeMetrics.fold``,
    before every read); the held increments are a deque for the same reason."""

    __slots__ = ("_counter",)

    def __init__(self, counter) -> None:
        super().__init__()
        self._counter = counter

    inc = _HeldUpdates._hold

    def fold(self) -> None:
        taken = self._take()
        if taken:
            self._counter.inc(sum(taken))


class _FoldBeforeRead:
    """Registered first in a registry, so that a scrape folds the held observations before the
    histograms after it are read."""

    def __init__(self, fold: Callable[[], None]) -> None:
        self._fold = fold

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self._fold()
        return []

class EdgeMetrics:
    # Gauges say how the front doors of ``edge --workers N`` add up (kvcompassd/metrics_front_doors.py):
    # livesum (a count over processes), livemax (process 0's reading; front doors hold copies),
    # liveall (per process, a pid label: what each one learned itself).
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_FoldBeforeRead(self.fold))
        self.requests = Counter("kvcompass_requests", "Requests at the front door, by route and status", ["route", "status"], registry=r)
        self.decisions = Counter("kvcompass_decisions", "Forwarding decisions by outcome (local_hit, remote_hit, recompute)", ["outcome"], registry=r)
        self.pending_credits = Counter("kvcompass_pending_credits", "Decisions whose winner was credited with a prompt the edge had just sent it, not yet in the view", registry=r)
        self.pending_refuted = Gauge("kvcompass_pending_refuted", "Pending-ledger credits ended by a response that "
                                     "reused fewer tokens than its worker was credited with (a count, read when scraped)",
                                     registry=r, multiprocess_mode="livesum")
        self.copy_charged = Gauge("kvcompass_copy_charged_decisions", "Decisions the copy price (score.copy_weight) "
                                  "was added to, by whether it moved them to another worker (a count, read when "
                                  "scraped)", ["outcome"], registry=r, multiprocess_mode="livesum")
        self.decision_seconds = Histogram("kvcompass_decision_seconds", "Lookup + score time per decision", buckets=_DECISION_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kvcompass_ttft_seconds", "Time to first token seen at the edge", buckets=_REQUEST_BUCKETS, registry=r)
        self.request_seconds = Histogram("kvcompass_request_seconds", "End-to-end request time at the edge", buckets=_REQUEST_BUCKETS, registry=r)
        self.score_terms = Histogram("kvcompass_chosen_score_ms", "Score terms of the chosen worker (ms)", ["term"], buckets=(0.1, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000), registry=r)
        self.batches = Counter("kvcompass_update_batches_applied", "Update batches applied to the views", registry=r)
        self.resyncs = Counter("kvcompass_resyncs_requested", "Resyncs asked of maintenance units", registry=r)
        self.position_gaps = Counter("kvcompass_position_gaps", "Catch-ups a unit's position announcement opened (an "
                                     "idle stream's last batches were lost: no later batch had shown the gap)", registry=r)
        self.queue_age = Gauge("kvcompass_queue_estimate_age_seconds", "Age of the oldest remote queue estimate", registry=r,
                               multiprocess_mode="livemax")
        self.queue_correction = Gauge("kvcompass_queue_correction_ms", "Selection correction added to a remote region's queue estimates (ms)", ["region"], registry=r,
                                      multiprocess_mode="livemax")
        self.herd_factor = Gauge("kvcompass_queue_herd_factor", "Multiple of each send to a remote region charged to its queue estimates", ["region"], registry=r,
                                 multiprocess_mode="livemax")
        self.false_lookups = Counter("kvcompass_false_lookups", "Responses that reused fewer tokens than the edge claimed", registry=r)
        self.claimed_tokens = Counter("kvcompass_claimed_tokens", "Prefix tokens the edge credited winners with", registry=r)
        self.reused_tokens = Counter("kvcompass_reused_tokens", "Prefix tokens workers reported reusing", registry=r)
        self.retries = Counter("kvcompass_retries", "Requests retried on the next best worker", registry=r)
        self.learned_prefill = Gauge("kvcompass_learned_prefill_ms_per_token", "Each worker's prefill rate as "
                                     "this edge learned it from the first tokens it saw (core/rates.py)",
                                     ["worker"], registry=r, multiprocess_mode="liveall")
        self.learned_decode = Gauge("kvcompass_learned_decode_ms_per_token", "Each worker's decode rate as this "
                                    "edge learned it from the ends it saw", ["worker"], registry=r,
                                    multiprocess_mode="liveall")
        self.migrations = Counter("kvcompass_migrations", "Hot-prefix migrations requested, by mode", ["mode"], registry=r)
        self.refused_messages = Counter("kvcompass_refused_messages", "Messages refused because their sender has no "
                                        "authority for them (a shard it does not own, a region it is not in), by "
                                        "message type", ["message"], registry=r)
        self.decode_choices = Counter("kvcompass_decode_choices", "Disaggregated requests handed to each decode "
                                      "worker (with the prefill worker the score chose)", ["worker"], registry=r)
        self.refusals = Counter("kvcompass_frontdoor_refusals", "Requests and connections the front door refused "
                                "for its limits, by reason (httplimits.REFUSAL_REASONS)", ["reason"], registry=r)
        # Labelled children looked up once: prometheus_client's labels() validates and hashes its
        # arguments under a lock on every call. Keys are bounded (routes and statuses are fixed sets).
        # The request path's counts are held and added at each fold (BatchedCount).
        self._request_counts: dict[tuple[str, int], BatchedCount] = {}
        self._decision_counts: dict[str, BatchedCount] = {}
        self._decode_choice_counts: dict[str, Counter] = {}  # decode workers: the config's, bounded
        self.pending_credit_counts = BatchedCount(self.pending_credits)
        self.claimed_token_counts = BatchedCount(self.claimed_tokens)
        self.reused_token_counts = BatchedCount(self.reused_tokens)
        self.false_lookup_counts = BatchedCount(self.false_lookups)
        # What the request path observes, held and folded in per bucket (BatchedObservations).
        self.decision_observations = BatchedObservations(self.decision_seconds)
        self.ttft_observations = BatchedObservations(self.ttft_seconds)
        self.request_observations = BatchedObservations(self.request_seconds)
        self.chosen_terms = tuple((term, BatchedObservations(self.score_terms.labels(term)))
                                  for term in CHOSEN_SCORE_TERMS)
        # (a list: count_request and count_decision add a child's BatchedCount when first used;
        # a fold in the scrape thread that iterates it meanwhile sees it or folds it next time)
        self._batched = [self.decision_observations, self.ttft_observations, self.request_observations,
                         *(batch for _, batch in self.chosen_terms), self.pending_credit_counts,
                         self.claimed_token_counts, self.reused_token_counts, self.false_lookup_counts]

    def fold(self) -> None:
        """Fold every held observation and count into its metric (before the metrics are read)."""
        for batch in self._batched:
            batch.fold()

    def _batched_child(self, children: dict, metric, key, *labels) -> BatchedCount:
        count = children.get(key)
        if count is None:
            count = children[key] = BatchedCount(metric.labels(*labels))
            self._batched.append(count)
        return count

    def count_decision(self, outcome: str) -> None:
        """``decisions{outcome}`` + 1 (outcomes are a fixed set: ForwardDecided.outcome)."""
        self._batched_child(self._decision_counts, self.decisions, outcome, outcome).inc()

    def count_decode_choice(self, worker: str) -> None:
        """``decode_choices{worker}`` + 1 (a disaggregated request handed to that decode worker)."""
        _child(self._decode_choice_counts, self.decode_choices, worker, worker).inc()

    def count_request(self, route: str, status: int) -> None:
        """``requests{route, status}`` + 1."""
        self._batched_child(self._request_counts, self.requests, (route, status), route, str(status)).inc()

    def watch_views(self, positions: Callable[[], list[tuple[int, str, int, int]]]) -> None:
        """Export each shard view's (shard, stream, epoch, seq), read when scraped (see
        ``MaintenanceMetrics.watch_position``: the seqs' difference is the view's lag in batches)."""
        self.registry.register(_PositionCollector("kvcompass_view", "this edge's view of the shard", positions))

    def watch_front_door(self, buffered_bytes: Callable[[], int], connections: Callable[[], int]) -> None:
        """Export the front door's held request-body bytes and open connections, read when scraped
        (a second front door on the same metrics takes the gauges over)."""
        if not hasattr(self, "buffered_body_bytes"):
            self.buffered_body_bytes = Gauge("kvcompass_frontdoor_buffered_body_bytes",
                                             "Request-body bytes the front door holds (its budget's use)", registry=self.registry,
                                             multiprocess_mode="livesum")
            self.frontdoor_connections = Gauge("kvcompass_frontdoor_connections", "HTTP connections open at the front door",
                                               registry=self.registry, multiprocess_mode="livesum")
        self.buffered_body_bytes.set_function(buffered_bytes)
        self.frontdoor_connections.set_function(connections)

    def watch_hot_prefixes(self, hot_misses: Callable[[], dict[tuple[str, str], int]]) -> None:
        """Export ``HotPrefixDetector.hot_misses`` (local misses of hot families by trigger and
        outcome), read when scraped: the decision path only increments a dict entry."""
        self.registry.register(_HotPrefixCollector(hot_misses))


class _HotPrefixCollector:
    def __init__(self, hot_misses: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._hot_misses = hot_misses

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kvcompass_hot_prefix_misses", "Local misses that found their prefix family hot, by migration trigger "
            "and outcome (planned, no_idle_worker, no_remote_match)", labels=["trigger", "outcome"])

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        for (trigger, outcome), n in self._hot_misses().items():
            family.add_metric([trigger, outcome], n)
        yield family


class AgentMetrics:
    def __init__(self, *, worker: str, region: str) -> None:
        self.registry = r = CollectorRegistry()
        self.engine_batches = Counter("kvcompass_engine_event_batches", "KV-event batches from the engine, by outcome", ["outcome"], registry=r)
        self.index_events = Counter("kvcompass_index_events_reported", "Index events sent to maintenance units", registry=r)
        self.requests = Counter("kvcompass_forwarded_requests", "Forwarded requests run on the engine, by status", ["status"], registry=r)
        # Labelled with the worker and its region (from the config), so that queues add up per
        # region without a label in the operator's scrape config.
        self.queue_ms = Gauge("kvcompass_engine_queue_ms", "Engine queueing delay estimate (ms)", ["worker", "region"],
                              registry=r).labels(worker, region)
        self.migrations = Counter("kvcompass_migrations_executed", "Migrations executed, by mode", ["mode"], registry=r)
        self.refused_messages = Counter("kvcompass_refused_messages", "Messages refused because their sender has no "
                                        "authority for them, by message type", ["message"], registry=r)
        readings = Counter("kvcompass_engine_load_readings", "Engine load readings, by whether they went to the edges "
                           "(sent) or were within [idle] load_tolerance of what the edges hold (held)", ["outcome"],
                           registry=r)
        self.load_readings_sent, self.load_readings_held = readings.labels("sent"), readings.labels("held")
        periods = Counter("kvcompass_engine_load_reading_periods", "Engine load readings, by why the next one is at "
                          "the fast period or at [idle] sole_edge_poll_ms (one_edge)", ["why"], registry=r)
        self.reading_periods = {why: periods.labels(why) for why in READING_PERIOD_REASONS}
        piggybacks = Counter("kvcompass_piggybacked_vectors", "Responses to other regions, by the queue vector they "
                             "carried: the region's (fresh), or the worker's own reading alone (none fresh held)",
                             ["vector"], registry=r)
        self.piggybacked_region, self.piggybacked_own = piggybacks.labels("region"), piggybacks.labels("own")


def start_metrics_server(address: str | None, registry: CollectorRegistry) -> None:
    """Serve ``registry`` on ``host:port`` in a background thread (prometheus-client's server)."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)


def _child(children: dict, metric, key, *labels):
    """``metric.labels(*labels)``, looked up once per ``key`` and kept in ``children``."""
    child = children.get(key)
    if child is None:
        child = children[key] = metric.labels(*labels)
    return child
