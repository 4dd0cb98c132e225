"""An edge's metrics over its front-door processes: front doors write prometheus_client's
multiprocess files (real processes here), the edge process merges them with its own registry,
and a front door that died is counted once, before and after its files are folded away."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcompassd.metrics import EdgeMetrics
from kvcompassd.metrics_front_doors import EdgeWideRegistry, FrontDoorMetricsDirectory

ROOT = Path(__file__).resolve().parent.parent

# A front door's metrics in a process of its own (multiprocess mode is chosen at import).
FRONT_DOOR = textwrap.dedent("""
    import os, sys
    from kvcompassd.metrics import EdgeMetrics
    from kvcompassd.metrics_front_doors import FrontDoorPublisher
    m = EdgeMetrics()
    for _ in range(3):
        m.count_request("/generate", 200)
    m.request_seconds.observe(0.02)
    m.learned_prefill.labels("us-0").set_function(lambda: 0.5)
    m.watch_front_door(lambda: 100, lambda: 2)
    publisher = FrontDoorPublisher(m, lambda: {("queue", "planned"): 2})
    publisher.publish()
    publisher.publish()  # a second publication adds no hot misses twice
    print(os.getpid())
""")


def _front_door(directory: FrontDoorMetricsDirectory) -> int:
    env = {**os.environ, **directory.environment(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FRONT_DOOR], env=env, check=True, capture_output=True, text=True)
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
