"""An edge's metrics over its front-door processes: front doors keep their values in process
memory and publish them to prometheus_client's multiprocess files (real processes here), the
edge process merges them with its own registry, and a front door that died is counted once (as
of its last publication), before and after its files are folded away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.parser import text_string_to_metric_families

from kvcompassd.metrics import EdgeMetrics
from kvcompassd.metrics_front_doors import BufferedMetricValues, EdgeWideRegistry, FrontDoorMetricsDirectory

ROOT = Path(__file__).resolve().parent.parent

# A front door's metrics in a process of its own (its buffered values installed before its metrics).
FRONT_DOOR = textwrap.dedent("""
    import os, sys
    from kvcompassd.metrics import EdgeMetrics
    from kvcompassd.metrics_front_doors import BufferedMetricValues, FrontDoorPublisher
    values = BufferedMetricValues.from_environment()  # before the metrics, as a front door does
    m = EdgeMetrics()
    for _ in range(3):
        m.count_request("/generate", 200)
    m.request_seconds.observe(0.02)
    m.learned_prefill.labels("us-0").set_function(lambda: 0.5)
    m.watch_front_door(lambda: 100, lambda: 2)
    publisher = FrontDoorPublisher(m, lambda: {("queue", "planned"): 2}, values)
    publisher.publish()
    publisher.publish()  # a second publication adds no hot misses twice
    print(os.getpid(), flush=True)
""")

# A front door killed (SIGKILL) after a publication, with 2 requests counted since.
KILLED_FRONT_DOOR = textwrap.dedent("""
    import os, signal
    from kvcompassd.metrics import EdgeMetrics
    from kvcompassd.metrics_front_doors import BufferedMetricValues, FrontDoorPublisher
    values = BufferedMetricValues.from_environment()
    m = EdgeMetrics()
    publisher = FrontDoorPublisher(m, lambda: {}, values)
    for _ in range(3):
        m.count_request("/generate", 200)
    m.request_seconds.observe(0.02)
    publisher.publish()
    for _ in range(2):
        m.count_request("/generate", 200)
    m.request_seconds.observe(0.02)
    print(os.getpid(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _front_door(directory: FrontDoorMetricsDirectory, script: str = FRONT_DOOR) -> int:
    env = {**os.environ, **directory.environment(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode in (0, -signal.SIGKILL), out.stderr
    return int(out.stdout.strip())


def _process0(directory: FrontDoorMetricsDirectory) -> EdgeMetrics:
    m = EdgeMetrics()
    m.count_request("/generate", 200)
    m.request_seconds.observe(0.2)
    m.learned_prefill.labels("us-0").set_function(lambda: 0.7)
    m.watch_hot_prefixes(lambda: {("queue", "planned"): 1})
    m.registry = EdgeWideRegistry(m.registry, directory, pid=1)
    m.watch_front_door(lambda: 50, lambda: 1)  # registered after the swap: on the wrapped registry
    return m


def _scrape(m: EdgeMetrics) -> dict[tuple[str, tuple], float]:
    """The served text, parsed by prometheus_client's own parser (a family twice would fail it)."""
    out = {}
    names = set()
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        assert family.name not in names, family.name
        names.add(family.name)
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


GENERATE = ("kvcompass_requests_total", (("route", "/generate"), ("status", "200")))


def test_the_edge_counts_every_front_doors_requests_once(tmp_path):
    directory = FrontDoorMetricsDirectory(tmp_path / "metrics")
    pids = [_front_door(directory), _front_door(directory)]
    m = _process0(directory)
    got = _scrape(m)
    assert got[GENERATE] == 1 + 3 + 3
    assert got[("kvcompass_request_seconds_count", ())] == 3
    assert got[("kvcompass_request_seconds_bucket", (("le", "0.025"),))] == 2  # the front doors' 0.02 s
    assert got[("kvcompass_request_seconds_bucket", (("le", "0.25"),))] == 3
    assert abs(got[("kvcompass_request_seconds_sum", ())] - 0.24) < 1e-9
    assert got[("kvcompass_frontdoor_connections", ())] == 1 + 2 + 2  # livesum
    assert got[("kvcompass_frontdoor_buffered_body_bytes", ())] == 50 + 100 + 100
    assert got[("kvcompass_hot_prefix_misses_total", (("outcome", "planned"), ("trigger", "queue")))] == 1 + 2 + 2
    learned = {dict(k[1])["pid"]: v for k, v in got.items() if k[0] == "kvcompass_learned_prefill_ms_per_token"}
    assert learned == {"1": 0.7, str(pids[0]): 0.5, str(pids[1]): 0.5}  # each process's own, by pid

    # A scrape that names what it wants (``?name[]=``) gets the merged samples too.
    text = generate_latest(m.registry.restricted_registry(["kvcompass_requests_total"])).decode()
    assert 'kvcompass_requests_total{route="/generate",status="200"} 7.0' in text.splitlines()

    for n, pid in enumerate(pids):  # each dies (it has exited): counted once, before and after
        directory.retire(pid)
        got = _scrape(m)
        assert got[GENERATE] == 7
        assert got[("kvcompass_request_seconds_count", ())] == 3
        assert got[("kvcompass_request_seconds_bucket", (("le", "0.025"),))] == 2
        assert got[("kvcompass_frontdoor_connections", ())] == 1 + 2 * (1 - n)  # its gauges went
        assert str(pid) not in {dict(k[1]).get("pid") for k in got}
        assert not list(directory.path.glob(f"*_{pid}.db"))
    assert sorted(p.name for p in directory.path.iterdir()) == ["counter_retired.db", "histogram_retired.db"]

    # A replacement (a new pid) adds to the retired counts.
    _front_door(directory)
    assert _scrape(m)[GENERATE] == 10
    directory.close()
    assert not directory.path.exists()


def test_a_new_directory_starts_empty(tmp_path):
    first = FrontDoorMetricsDirectory(tmp_path / "metrics")
    _front_door(first)
    again = FrontDoorMetricsDirectory(tmp_path / "metrics")  # the edge restarted: nothing of before
    assert again.families() == []
    m = _process0(again)
    assert _scrape(m)[GENERATE] == 1



def _in_process_front_door(directory: FrontDoorMetricsDirectory, monkeypatch, pid: int) -> tuple[EdgeMetrics, BufferedMetricValues]:
    """A front door's metrics made in this process (as pid ``pid``), with its buffered values
    installed for the rest of the test (prometheus_client reads ``ValueClass`` whenever a
    labelled child is made): make process 0's metrics and their children before."""
    values = BufferedMetricValues(directory.path, pid=pid)
    monkeypatch.setattr(prometheus_values, "ValueClass", values.value_class)
    return EdgeMetrics(), values


def test_a_front_doors_counts_reach_process_0s_scrape_when_it_publishes(tmp_path, monkeypatch):
    directory = FrontDoorMetricsDirectory(tmp_path / "metrics")
    m = _process0(directory)
    door, values = _in_process_front_door(directory, monkeypatch, pid=4242)
    for _ in range(3):
        door.count_request("/generate", 200)
    door.request_seconds.observe(0.02)
    got = _scrape(m)
    assert got[GENERATE] == 1  # counted in the front door's memory, not yet published
    assert got[("kvcompass_request_seconds_count", ())] == 1
    door.fold()  # (what FrontDoorPublisher.publish does first: the request path's counts are held)
    assert values.publish() > 0
    got = _scrape(m)
    assert got[GENERATE] == 1 + 3
    assert got[("kvcompass_request_seconds_count", ())] == 2
    assert got[("kvcompass_request_seconds_bucket", (("le", "0.025"),))] == 1
    assert values.publish() == 0  # nothing changed: nothing written
    door.count_request("/generate", 200)
    door.fold()
    values.close()  # a clean stop publishes what was counted since
    assert _scrape(m)[GENERATE] == 1 + 4
    directory.retire(4242)
    assert _scrape(m)[GENERATE] == 1 + 4


def test_a_front_door_killed_after_a_publication_is_counted_once_as_published(tmp_path):
    directory = FrontDoorMetricsDirectory(tmp_path / "metrics")
    pid = _front_door(directory, KILLED_FRONT_DOOR)
    m = _process0(directory)
    for _ in range(2):  # before and after its files are folded: its published counts, once
        got = _scrape(m)
        assert got[GENERATE] == 1 + 3  # the 2 counted after its publication are lost with it
        assert got[("kvcompass_request_seconds_count", ())] == 1 + 1
        directory.retire(pid)
    assert not list(directory.path.glob(f"*_{pid}.db"))
    assert {p.name for p in directory.path.iterdir()} >= {"counter_retired.db", "histogram_retired.db"}
    assert _scrape(m)[GENERATE] == 4


def _one_requests_updates(m: EdgeMetrics) -> None:
    """The counter and histogram updates of a forwarded request (frontdoor.py, forwarding.py)."""
    m.count_request("/generate", 200)
    m.count_decision("local_hit")
    m.decision_observations.observe(3e-5)  # held, folded in when read (BatchedObservations)
    m.ttft_observations.observe(0.004)
    m.request_observations.observe(0.006)
    for _term, held in m.chosen_terms:
        held.observe(2.0)
    m.claimed_token_counts.inc(1500)  # (counts held too, added when folded: BatchedCount)
    m.reused_token_counts.inc(1500)


def test_a_front_doors_updates_call_no_getpid(tmp_path, monkeypatch):
    calls = 0
    real_getpid = os.getpid

    def counted_getpid() -> int:
        nonlocal calls
        calls += 1
        return real_getpid()

    directory = FrontDoorMetricsDirectory(tmp_path / "metrics")
    m = _process0(directory)
    door, values = _in_process_front_door(directory, monkeypatch, pid=4242)
    monkeypatch.setattr(os, "getpid", counted_getpid)
    _one_requests_updates(door)  # its labelled children made (the one getpid-free lookup each)
    calls = 0
    for _ in range(100):
        _one_requests_updates(door)
    assert calls == 0
    door.fold()  # (FrontDoorPublisher.publish folds first)
    values.publish()
    assert calls == 0
    assert _scrape(m)[GENERATE] == 1 + 101

    # prometheus_client's own multiprocess values, as front doors had them: a call an update.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    monkeypatch.setattr(prometheus_values, "ValueClass",
                        prometheus_values.MultiProcessValue(process_identifier=os.getpid))
    theirs = EdgeMetrics()
    _one_requests_updates(theirs)
    calls = 0
    _one_requests_updates(theirs)
    theirs.fold()
    assert calls >= 4  # the four counters' (held, as the histograms' observations are, until folded) (the histograms' observations are held)
