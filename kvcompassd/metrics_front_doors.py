"""One edge's metrics over all its front-door processes (``edge --workers N``).

Front doors 1..N-1 keep their metric values in process memory, as process 0 does, and copy them
into per-process memory-mapped files (prometheus_client's multiprocess format) in a directory
of the edge's: the edge starts them with ``KVCOMPASS_FRONT_DOOR_METRICS_DIR`` naming it
(``FrontDoorMetricsDirectory``, new and empty at every edge start, removed at its stop), and
``BufferedMetricValues`` copies every value that changed into its file every
``PUBLISH_PERIOD_S``, before the front door answers ``/metrics``, and at a clean stop. An
increment or an observation is then a float added under a lock, the cost of process 0's
(prometheus_client's own multiprocess values call ``os.getpid()`` and write the file under a
lock on every one: ~18 calls a request). What a killed front door loses is what it counted
after its last publication: at most one publish period of counts (SIGKILL, a crash; a SIGTERM
stops it cleanly and publishes). A scrape of process 0 sees another front door's counts as of that
front door's last publication (at most ``PUBLISH_PERIOD_S`` old); counters stay monotone.

Process 0 (the edge daemon, which is a front door too) keeps its ordinary in-process registry;
``EdgeWideRegistry`` serves both, merged family by family: counters and histograms summed,
gauges by the mode each declares (``EdgeMetrics``: summed, the largest, or one series per
process with a ``pid`` label). Whatever the port an operator scrapes (the metrics port, or
``/metrics`` on the HTTP port at any process: a front door publishes, then asks process 0, see
``kvcompassd/edge_workers.py``), every front door's requests are counted.

Gauges a front door reads from a function (learned rates, open connections, held body bytes,
refuted credits) and its hot-prefix misses (a dict the router keeps) are not increments:
``FrontDoorPublisher`` sets them before each publication, so theirs are as old as the counts.

A front door that dies: its live gauges go (``mark_process_dead``), and its counters and
histograms are folded into one ``<type>_retired.db`` file, under the same lock as a scrape's
read, so a scrape never counts them twice (nor loses what it published), and a crash-looping
front door does not grow the directory by a file per life.
"""
from __future__ import annotations

import glob
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import values as prometheus_values
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

# Not prometheus_client's PROMETHEUS_MULTIPROC_DIR: with that set at import, the client's own
# multiprocess values (a getpid and a file write per increment) would be the default.
ENVIRONMENT = "KVCOMPASS_FRONT_DOOR_METRICS_DIR"
PUBLISH_PERIOD_S = 1.0
# Value files of a dead process folded into the retired ones (gauges are dropped instead).
_FOLDED_TYPES = ("counter", "histogram", "summary")
_RETIRED = "retired"


class FrontDoorMetricsDirectory:
    """Process 0's side: the directory the front doors write, read at every scrape."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        shutil.rmtree(self.path, ignore_errors=True)  # nothing of an earlier life is counted
        self.path.mkdir(mode=0o700, parents=True)
        self._lock = threading.Lock()  # a scrape (the metrics server's thread) against a retirement
        self.retired = 0

    def environment(self) -> dict[str, str]:
        """What a front door's environment needs to write here."""
        return {ENVIRONMENT: str(self.path)}

    def families(self) -> list[Metric]:
        """The front doors' families, merged over processes (prometheus_client's own merge)."""
        with self._lock:
            files = glob.glob(os.path.join(self.path, "*.db"))
            return list(MultiProcessCollector.merge(files, accumulate=True))

    def retire(self, pid: int) -> None:
        """A front door exited (reaped: it writes nothing more): drop its live gauges, fold its
        counters and histograms into the retired files."""
        with self._lock:
            mark_process_dead(pid, str(self.path))
            for dead in glob.glob(os.path.join(self.path, f"gauge_*_{pid}.db")):
                os.remove(dead)
            for kind in _FOLDED_TYPES:
                dead = self.path / f"{kind}_{pid}.db"
                if not dead.exists():
                    continue
                retired = MmapedDict(str(self.path / f"{kind}_{_RETIRED}.db"))
                try:
                    for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(str(dead)):
                        total, _ = retired.read_value(key)
                        retired.write_value(key, total + value, 0.0)
                finally:
                    retired.close()
                dead.unlink()
            self.retired += 1

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class EdgeWideRegistry(CollectorRegistry):
    """Process 0's registry plus the front doors' files, as one registry: what it serves.
    Collectors registered on it go to the wrapped registry (so ``EdgeMetrics`` adds its gauges
    as ever)."""

    def __init__(self, own: CollectorRegistry, front_doors: FrontDoorMetricsDirectory, *,
                 pid: int | None = None) -> None:
        super().__init__(auto_describe=False)
        self.own = own
        self.front_doors = front_doors
        self.pid = str(os.getpid() if pid is None else pid)

    def register(self, collector) -> None:
        self.own.register(collector)

    def unregister(self, collector) -> None:
        self.own.unregister(collector)

    def collect(self) -> Iterator[Metric]:
        yield from merge_families(self.own.collect(), self.front_doors.families(), own_pid=self.pid)

    def restricted_registry(self, names: Iterable[str]) -> _Restricted:
        # A scrape asking for some names (``?name[]=``): the merged families, filtered.
        return _Restricted(self, frozenset(names))


class _Restricted:
    def __init__(self, registry: EdgeWideRegistry, names: frozenset[str]) -> None:
        self._registry, self._names = registry, names

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            kept = metric._restricted_metric(self._names)
            if kept:
                yield kept


def _key(sample) -> tuple:
    return sample.name, tuple(sorted(sample.labels.items()))


def merge_families(own: Iterable[Metric], others: Iterable[Metric], *, own_pid: str) -> Iterator[Metric]:
    """``own`` (one process's families) with ``others`` (the other processes', merged by
    prometheus_client): counters, histograms and summaries summed sample by sample (a histogram's
    cumulative buckets add up as such); a gauge by the multiprocess mode the others' files carry.
    Samples only ``own`` has (a counter's ``_created``) are kept as they are."""
    by_name = {m.name: m for m in others}
    for mine in own:
        theirs = by_name.pop(mine.name, None)
        if theirs is None or theirs.type != mine.type:
            yield mine
            continue
        merged = Metric(mine.name, mine.documentation, mine.type, mine.unit)
        mode = getattr(theirs, "_multiprocess_mode", "") if mine.type == "gauge" else "sum"
        if mode in ("all", "liveall"):
            for s in mine.samples:
                merged.add_sample(s.name, {**s.labels, "pid": own_pid}, s.value, s.timestamp)
            for s in theirs.samples:
                merged.add_sample(s.name, s.labels, s.value, s.timestamp)
            yield merged
            continue
        combine = _COMBINE.get(mode.removeprefix("live"), _COMBINE["sum"])
        values = {_key(s): s for s in mine.samples}
        order = list(values)
        extra = {}
        for s in theirs.samples:
            k = _key(s)
            if k in values:
                values[k] = values[k]._replace(value=combine(values[k].value, s.value))
            else:
                extra[k] = s
                order.append(k)
        for k in order:
            s = values.get(k) or extra[k]
            merged.add_sample(s.name, s.labels, s.value, s.timestamp)
        yield merged
    yield from by_name.values()  # families only the other processes have


_COMBINE: dict[str, Callable[[float, float], float]] = {
    "sum": lambda a, b: a + b, "max": max, "min": min,
    "mostrecent": lambda a, b: a,  # this process's reading
}


class BufferedMetricValues:
    """A front door's metric values: in-process floats (as process 0's ``MutexValue``), copied
    into this process's multiprocess files by ``publish``.

    ``install`` makes every metric created after it in this process one of these (prometheus_client
    reads ``values.ValueClass`` when a metric or a labelled child is made): call it before the
    front door's ``EdgeMetrics``. Files are named as prometheus_client's own (``counter_<pid>.db``,
    ``gauge_<mode>_<pid>.db``...), so ``MultiProcessCollector`` merges them and
    ``FrontDoorMetricsDirectory.retire`` folds them. Not for a process that forks (a child would
    publish under its parent's pid)."""

    def __init__(self, directory: str | os.PathLike, *, pid: int | None = None) -> None:
        self.directory = str(directory)
        self.pid = os.getpid() if pid is None else pid
        self._files: dict[str, MmapedDict] = {}
        self._values: list = []
        self._lock = threading.Lock()  # registration against publication
        self.publications = 0
        self.value_class = self._value_class()

    @classmethod
    def from_environment(cls) -> BufferedMetricValues | None:
        """This process's values if the edge named a directory for them (``ENVIRONMENT``), installed."""
        directory = os.environ.get(ENVIRONMENT)
        if not directory:
            return None
        values = cls(directory)
        values.install()
        return values

    def install(self) -> None:
        prometheus_values.ValueClass = self.value_class

    def _file(self, prefix: str) -> MmapedDict:
        f = self._files.get(prefix)
        if f is None:
            f = self._files[prefix] = MmapedDict(os.path.join(self.directory, f"{prefix}_{self.pid}.db"))
        return f

    def _value_class(self) -> type:
        owner = self

        class BufferedValue:
            """A float under a lock; its file is written by ``BufferedMetricValues.publish``."""

            _multiprocess = True
            __slots__ = ("_value", "_timestamp", "_lock", "_file", "_key", "_published")

            def __init__(self, typ, metric_name, name, labelnames, labelvalues, help_text, multiprocess_mode="",
                         **_kwargs) -> None:
                self._lock = threading.Lock()
                self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
                with owner._lock:
                    self._file = owner._file(f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ)
                    # As prometheus_client's own: the series is in the file (at 0) once it exists,
                    # and a value already there (a reused pid not yet retired) is counted on from.
                    self._value, self._timestamp = self._file.read_value(self._key)
                    self._published = (self._value, self._timestamp)
                    owner._values.append(self)

            def inc(self, amount: float) -> None:
                with self._lock:
                    self._value += amount

            def set(self, value: float, timestamp: float | None = None) -> None:
                with self._lock:
                    self._value = value
                    self._timestamp = timestamp or 0.0

            def set_exemplar(self, exemplar) -> None:
                return  # as prometheus_client's multiprocess values: not kept

            def get(self) -> float:
                with self._lock:
                    return self._value

            def get_exemplar(self):
                return None

        return BufferedValue

    def publish(self) -> int:
        """Copy every value that changed since the last publication into its file; how many."""
        written = 0
        with self._lock:
            for v in self._values:
                with v._lock:
                    now = (v._value, v._timestamp)
                if now != v._published:
                    v._file.write_value(v._key, *now)
                    v._published = now
                    written += 1
            self.publications += 1
        return written

    def close(self) -> None:
        """Publish, then unmap the files (they stay for process 0 to read and fold)."""
        self.publish()
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._values.clear()


class FrontDoorPublisher:
    """A front door's side: sets what is not an increment (function gauges, the router's
    hot-prefix misses) into its metrics, then publishes its values (``BufferedMetricValues``,
    when the edge named a directory) into its multiprocess files."""

    def __init__(self, metrics, hot_misses: Callable[[], dict[tuple[str, str], int]],
                 values: BufferedMetricValues | None = None) -> None:
        self._metrics = metrics
        self.values = values
        self._hot_misses = hot_misses
        self._hot = Counter("kvcompass_hot_prefix_misses", "Local misses that found their prefix family hot",
                            ["trigger", "outcome"], registry=metrics.registry)
        self._hot_published: dict[tuple[str, str], int] = {}

    def publish(self) -> None:
        self._metrics.fold()  # the request path's held observations, into the values published below
        gauges = [g for g in vars(self._metrics).values() if isinstance(g, Gauge)]  # watch_front_door adds two later
        for gauge in gauges:
            for family in gauge.collect():  # a function gauge's value is computed here
                for s in family.samples:
                    (gauge.labels(**s.labels) if s.labels else gauge).set(s.value)
        for key, n in list(self._hot_misses().items()):
            delta = n - self._hot_published.get(key, 0)
            if delta > 0:
                self._hot.labels(*key).inc(delta)
                self._hot_published[key] = n
        if self.values is not None:
            self.values.publish()
