"""The Grafana dashboard, deploy/grafana/gpufleet.json (docs/deploy.md, "Prometheus and
Grafana"): Grafana's JSON with panels that each query Prometheus through the dashboard's
data source variable, and metric names read from its queries.

That every metric it queries is one a running fleet's `/metrics` serves is checked against
a real fleet in tests/test_tenants_fleet.py, with `missing_from` below.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "gpufleet.json"
#: A gpufleet metric in a PromQL expression: never part of a longer name, and never a
#: label (no label of the fleet's starts so) nor a function (none does).
METRIC = re.compile(r"(?<![A-Za-z0-9_:])gpufleet_[a-z0-9_]+")
#: A sample's name at the start of an exposition line (`name{labels} value` or `name value`).
SAMPLE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
#: The model cache's metrics (issue 78), declared by the fleet at start.
CACHE_METRICS = {
    "gpufleet_load_duration_seconds_bucket",
    "gpufleet_restore_duration_seconds_bucket",
    "gpufleet_miss_latency_seconds_bucket",
    "gpufleet_eviction_age_seconds_bucket",
    "gpufleet_lru_age_seconds",
}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL the dashboard sends: its panels' targets and its query variables'."""
    found = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def metric_names(expr: str) -> set[str]:
    """The gpufleet metrics one PromQL expression reads."""
    return set(METRIC.findall(expr))


def served_names(page: str) -> set[str]:
    """The names of the samples a /metrics page holds (a family with no sample, only its
    HELP and TYPE lines, serves nothing a query could read)."""
    names = set()
    for line in page.splitlines():
        if line and not line.startswith("#") and (match := SAMPLE.match(line)):
            names.add(match.group())
    return names


def missing_from(page: str) -> list[str]:
    """The metrics the dashboard queries that the /metrics `page` holds no sample of."""
    used = set().union(*(metric_names(q) for q in queries(dashboard())))
    return sorted(used - served_names(page))


def test_the_dashboard_is_grafana_json_whose_every_panel_has_a_query() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] == "gpufleet"
    panels = board["panels"]
    assert len(panels) >= 20
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat", "bargauge"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert all(t["expr"].strip() and t["refId"] for t in panel["targets"]), panel["title"]
        place = panel["gridPos"]
        assert place["x"] + place["w"] <= 24 and place["h"] > 0, panel["title"]


def test_every_query_reaches_prometheus_through_the_data_source_variable_not_a_uid() -> None:
    board = dashboard()
    variables = board["templating"]["list"]
    [source] = [v for v in variables if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    ours = {"type": "prometheus", "uid": "${" + source["name"] + "}"}
    for panel in board["panels"]:
        assert panel["datasource"] == ours, panel["title"]
        assert all(t["datasource"] == ours for t in panel["targets"]), panel["title"]
    assert all(v["datasource"] == ours for v in variables if v["type"] == "query")
    assert "__inputs" not in board  # nothing to fill in on import, so provisioning loads it


def test_the_model_variable_lists_the_models_of_the_request_counters() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    query = variables["model"]["query"]["query"]
    assert query.startswith("label_values(gpufleet_requests_total") and query.endswith(", model)")
    assert variables["model"]["multi"] and variables["model"]["includeAll"]


def test_the_dashboard_charts_the_model_cache_and_the_generation_histograms() -> None:
    used = set().union(*(metric_names(q) for q in queries(dashboard())))
    assert used >= CACHE_METRICS
    assert "gpufleet_time_to_first_token_seconds_bucket" in used
    assert "gpufleet_inter_token_seconds_bucket" in used
    assert {n for n in used if n.startswith("gpufleet_tenant_")}  # the tenants' shares


def test_the_names_read_from_a_query_are_its_metrics_not_its_functions_labels_or_values() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (model, le) (max without (instance) (rate("
        'gpufleet_time_to_first_token_seconds_bucket{job="$job", queue="gpufleet.h.gpu0"}'
        "[$__rate_interval])))) / on (model) gpufleet_kv_cache_tokens"
    )
    assert metric_names(expr) == {
        "gpufleet_time_to_first_token_seconds_bucket",
        "gpufleet_kv_cache_tokens",
    }
    assert metric_names('label_values(gpufleet_requests_total{job="$job"}, model)') == {
        "gpufleet_requests_total"
    }


def test_a_metrics_page_serves_prometheus_client_s_sample_names_not_bare_families() -> None:
    registry = CollectorRegistry()
    Counter("gpufleet_x_requests", "counted", ["model"], registry=registry).labels("a").inc()
    Histogram("gpufleet_x_seconds", "timed", ["model"], registry=registry).labels("a").observe(1)
    Gauge("gpufleet_x_age_seconds", "aged", ["gpu"], registry=registry)  # no sample yet
    page = generate_latest(registry).decode()
    served = served_names(page)
    assert {"gpufleet_x_requests_total", "gpufleet_x_seconds_bucket"} <= served
    assert {"gpufleet_x_seconds_sum", "gpufleet_x_seconds_count"} <= served
    assert "gpufleet_x_requests" not in served  # the family's name, in HELP and TYPE only
    assert "gpufleet_x_age_seconds" not in served  # declared, with no label set yet


def test_the_deploy_guide_names_the_dashboard_s_file() -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    assert str(DASHBOARD.relative_to(REPO)) in guide
