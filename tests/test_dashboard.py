"""The Grafana dashboard (deploy/grafana/kvcompassd.json) reads only metrics and labels the
daemons export: renaming a metric or a label in kvcompassd/metrics.py fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvcompassd.metrics import AgentMetrics, EdgeMetrics, MaintenanceMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "kvcompassd.json"

# Labels Prometheus adds to every scraped series (instance, job); le is every histogram bucket's.
# Nothing else: a panel must not depend on a label the operator's scrape config has to add.
TARGET_LABELS = {"instance", "job", "le"}
# PromQL words that are not metric names: functions are recognised by their "(", these not
# (an aggregation may put its "by (...)" clause before its parenthesis).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
            "count_values", "bottomk", "topk", "quantile"}
# Each metric type's exposed sample names, as prometheus_client emits them.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count", "")}


def exported() -> dict[str, set[str]]:
    """Every sample name the three daemon modes export -> its label names. The scrape-time
    collectors are fed one row each so that their families show their labels."""
    edge, maintenance, agent = EdgeMetrics(), MaintenanceMetrics(), AgentMetrics(worker="us-0", region="us")
    edge.watch_hot_prefixes(lambda: {("recompute", "planned"): 1})
    edge.watch_views(lambda: [(0, "us", 1, 2)])
    maintenance.watch_tables(lambda: [{"group": 0, "region": "us", "entries": 1, "load": 0.1}])
    maintenance.watch_position(lambda: [(0, "us", 1, 2)])
    for metrics in (edge, maintenance, agent):  # one child per labelled metric, so its labels show
        for metric in vars(metrics).values():
            # (a child whose labels the daemon fixed at start, like an agent's region, shows them)
            if isinstance(metric, MetricWrapperBase) and metric._labelnames and not metric._labelvalues:
                metric.labels(*("x" for _ in metric._labelnames))
    names: dict[str, set[str]] = {}
    for registry in (edge.registry, maintenance.registry, agent.registry):
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            labels = {label for sample in family.samples for label in sample.labels}
            for suffix in SUFFIXES[family.type]:
                names.setdefault(family.name + suffix, set()).update(labels)
    return names


def expressions(dashboard: dict) -> list[str]:
    found = []
    for panel in dashboard["panels"]:
        found += [target["expr"] for target in panel.get("targets", [])]
        for inner in panel.get("panels", []):
            found += [target["expr"] for target in inner.get("targets", [])]
    return found


def parse(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression reads."""
    labels: set[str] = set()
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(name.strip() for name in clause.split(",") if name.strip())
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range selectors, $__rate_interval included
    metrics = set()
    for match in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        word, is_call = match.group(1), match.group(2)
        if not is_call and word.lower() not in KEYWORDS:
            metrics.add(word)
    return metrics, labels


def test_the_parser_finds_metrics_and_labels_and_skips_functions_and_clauses():
    metrics, labels = parse('max by (shard) (kvcompass_shard_seq{shard!="9"}) - on (shard) group_right '
                            'kvcompass_view_seq + histogram_quantile(0.99, sum by (le, instance) '
                            '(rate(kvcompass_ttft_seconds_bucket[$__rate_interval]))) > bool 1e-3')
    assert metrics == {"kvcompass_shard_seq", "kvcompass_view_seq", "kvcompass_ttft_seconds_bucket"}
    assert labels == {"shard", "le", "instance"}


def test_the_dashboard_reads_only_exported_metrics_and_their_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    exprs = expressions(dashboard)
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        metrics, labels = parse(expr)
        assert metrics, expr
        unknown = metrics - set(names)
        assert not unknown, f"{expr}: not exported by any daemon: {sorted(unknown)}"
        known_labels = set().union(*(names[m] for m in metrics)) | TARGET_LABELS
        assert labels <= known_labels, f"{expr}: labels {sorted(labels - known_labels)} on none of {sorted(metrics)}"
        used |= metrics
    # What issue 24 asked the dashboard to show is there.
    for wanted in ("kvcompass_decisions_total", "kvcompass_ttft_seconds_bucket", "kvcompass_reused_tokens_total",
                   "kvcompass_false_lookups_total", "kvcompass_view_seq", "kvcompass_shard_seq",
                   "kvcompass_queue_correction_ms", "kvcompass_engine_queue_ms"):
        assert wanted in used, wanted


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    # One Prometheus data source, chosen on import.
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24


def test_queries_have_promql_shape_rate_over_counters_quantiles_over_buckets():
    """rate() only over counters' samples (_total) or histograms' (_bucket/_sum/_count), never a
    gauge; histogram_quantile() only over a rate of _bucket summed by (le, ...); a gauge read
    as is. Names are checked against what the daemons export, not their suffixes alone."""
    names = exported()
    counters = {n for n in names if n.endswith(("_total", "_bucket", "_sum", "_count"))}
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        for inner in re.findall(r"\brate\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expr):
            assert inner in counters, f"{expr}: rate() over {inner}, not a counter"
        for quantile in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,(.*)", expr):
            phi, rest = float(quantile.group(1)), quantile.group(2)
            assert 0 < phi < 1, expr
            assert re.search(r"sum by \(([^)]*\ble\b[^)]*)\)\s*\(\s*rate\([a-z_]+_bucket\[", rest), \
                f"{expr}: histogram_quantile must read sum by (le, ...) (rate(..._bucket[...]))"
        metrics, _ = parse(expr)
        for name in metrics - counters:  # gauges: never under rate()
            assert not re.search(rf"\brate\(\s*{name}\b", expr), expr
        assert expr.count("(") == expr.count(")"), f"{expr}: unbalanced parentheses"
