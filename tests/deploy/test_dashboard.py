"""The Grafana dashboard (deploy/grafana): every panel queries the provisioned Prometheus, every
metric a query names is in docs/metrics.md, and so is every label a query or its legend names (read
off the query's PromQL syntax tree), the panels operators look at are there, and the compose
monitoring profile mounts what Grafana reads."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.deploy.compose import ROOT, bind_mounts, compose_config
from tests.metrics_docs import documented

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "splitbus.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "splitbus.yml"
METRIC = re.compile(r"\bsplitbus_\w+")
GRAFANA_INTERVALS = re.compile(
    r"\$__(rate_interval|interval|range)\b"
)  # Grafana fills them in before Prometheus sees the query
SERIES_SUFFIX = re.compile(r"_(bucket|sum|count)$")  # a histogram's series, named in the catalog by its family
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SCRAPE_LABELS = frozenset({"instance", "job"})
"""What Prometheus adds to every series it scrapes."""
WORKER_PREFIX = "splitbus_worker_"
"""deploy/prometheus.yml labels the worker job's targets with ``role``."""
# What operators look at (issue 39): every one is a panel, by title.
PANELS = (
    "Requests by outcome",
    "Refusals by reason",
    "TTFT p50 / p90 / p99",
    "ITL p50 / p90 / p99",
    "Queue depth per role",
    "KV use per worker",
    "Prefix hit ratio",
    "P->D transfer time p50 / p90 / p99",
    "P->D transfer failures",
    "Migrations",
    "DP idle forwards",
    "Planner: desired vs actual vs draining workers",
)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> Iterator[dict]:
    """Every panel that shows data, rows' own (a collapsed row holds its panels) included."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from _panels(panel.get("panels", []))
        else:
            yield panel


def _exprs() -> list[str]:
    return [target["expr"] for panel in _panels(_dashboard()["panels"]) for target in panel["targets"]]


def _provisioned_uid() -> str:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    return str(source["uid"])


def test_every_panel_queries_the_provisioned_prometheus() -> None:
    uid = _provisioned_uid()
    panels = list(_panels(_dashboard()["panels"]))
    assert len(panels) >= len(PANELS)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert isinstance(target.get("expr"), str) and METRIC.search(target["expr"]), (panel["title"], target)
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"


@pytest.mark.parametrize("expr", _exprs())
def test_every_query_is_promql(expr: str) -> None:
    promql_parser.parse(GRAFANA_INTERVALS.sub("1m", expr))  # raises ValueError on a syntax error


def test_the_promql_check_can_fail() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse(
            GRAFANA_INTERVALS.sub("1m", 'sum by (outcome) (rate(x{outcome!="admitted"}[$__rate_interval])')
        )


def test_every_metric_a_query_names_is_in_the_catalog() -> None:
    named = {SERIES_SUFFIX.sub("", name) for expr in _exprs() for name in METRIC.findall(expr)}
    assert sorted(named - set(documented())) == [], "named by a query, not in docs/metrics.md"


def _targets() -> list[tuple[str, str]]:
    """Each query and its legend."""
    panels = _panels(_dashboard()["panels"])
    return [(target["expr"], target.get("legendFormat", "")) for panel in panels for target in panel["targets"]]


def _series_labels(name: str) -> frozenset[str]:
    """The labels a series of ``name`` carries once scraped: its family's in the catalog, ``le`` for
    a histogram's buckets, the scrape's own, and ``role`` on a worker's (deploy/prometheus.yml)."""
    family = SERIES_SUFFIX.sub("", name)
    labels = set(documented().get(family, ("", ()))[1]) | SCRAPE_LABELS
    if name.endswith("_bucket"):
        labels.add("le")
    if name.startswith(WORKER_PREFIX):
        labels.add("role")
    return frozenset(labels)


Labels = frozenset[str] | None
"""The labels an expression's result carries; None: a number or a string, which carries none."""


class LabelCheck:
    """Walks a query's syntax tree: each node gives the labels its result carries, and every label
    a node names (a matcher, ``by``/``without``, ``on``/``ignoring``/``group_*``) must be one its
    input carries; ``wrong`` collects the others."""

    def __init__(self) -> None:
        self.wrong: list[str] = []
        self.walks: dict[type, Callable[[object], Labels]] = {
            promql_parser.VectorSelector: self.selector,
            promql_parser.MatrixSelector: lambda node: self.labels(node.vector_selector),
            promql_parser.Call: self.call,
            promql_parser.AggregateExpr: self.aggregate,
            promql_parser.BinaryExpr: self.binary,
        }

    def labels(self, node: object) -> Labels:
        if walk := self.walks.get(type(node)):
            return walk(node)
        if isinstance(node, promql_parser.NumberLiteral | promql_parser.StringLiteral):
            return None
        return self.labels(node.expr)  # parentheses, unary minus, a subquery

    def need(self, names: list[str], carried: Labels, where: str) -> None:
        self.wrong += [f"{where}: {name}" for name in names if name not in (carried or ())]

    def selector(self, node: promql_parser.VectorSelector) -> Labels:
        matchers = node.matchers.matchers
        name = node.name or next(m.value for m in matchers if m.name == "__name__")
        carried = _series_labels(name)
        self.need([m.name for m in matchers if m.name != "__name__"], carried, f"{name}{{}}")
        return carried

    def call(self, node: promql_parser.Call) -> Labels:
        inputs = [carried for arg in node.args if (carried := self.labels(arg)) is not None]
        if node.func.name == "histogram_quantile":
            self.need(["le"], inputs[0], "histogram_quantile")
            return inputs[0] - {"le"}
        return inputs[0] if inputs and node.func.return_type != promql_parser.ValueType.Scalar else None

    def aggregate(self, node: promql_parser.AggregateExpr) -> Labels:
        carried = self.labels(node.expr)
        if node.modifier is None:
            return frozenset()
        self.need(node.modifier.labels, carried, str(node.modifier))
        if node.modifier.type == promql_parser.AggModifierType.By:
            return frozenset(node.modifier.labels)
        return (carried or frozenset()) - set(node.modifier.labels)

    def binary(self, node: promql_parser.BinaryExpr) -> Labels:
        left, right = self.labels(node.lhs), self.labels(node.rhs)
        if left is None or right is None:
            return left if right is None else right
        modifier = node.modifier
        if modifier is not None and modifier.matching is not None:
            self.need(modifier.matching.labels, left & right, str(modifier.matching))
        if modifier is not None and modifier.group_labels:
            self.need(modifier.group_labels, left | right, "group labels")
        return left & right  # a one-to-one match: the labels both sides carry


def wrong_labels(expr: str, legend: str) -> list[str]:
    """The labels ``expr`` or its ``legend`` names that the series it reads do not carry."""
    check = LabelCheck()
    carried = check.labels(promql_parser.parse(GRAFANA_INTERVALS.sub("1m", expr)))
    check.need(LEGEND_LABEL.findall(legend), carried, "legend")
    return check.wrong


@pytest.mark.parametrize(("expr", "legend"), _targets())
def test_every_label_a_query_or_its_legend_names_is_one_its_series_carry(expr: str, legend: str) -> None:
    assert wrong_labels(expr, legend) == []


@pytest.mark.parametrize(
    ("expr", "legend", "wrong"),
    [
        (
            'sum(rate(splitbus_api_tenant_requests_total{reason="x"}[5m]))',
            "",
            "splitbus_api_tenant_requests_total{}: reason",
        ),
        ("sum by (outcome) (rate(splitbus_api_time_to_first_token_seconds_count[5m]))", "", "by (outcome): outcome"),
        (
            "histogram_quantile(0.9, sum by (role) (rate(splitbus_worker_kv_transfer_seconds_bucket[5m])))",
            "",
            "histogram_quantile: le",
        ),
        ("sum by (le) (rate(splitbus_api_tenant_requests_total[5m]))", "", "by (le): le"),  # no bucket
        ("splitbus_planner_unplaced_requests", "{{role}}", "legend: role"),  # the scrape adds role to workers only
        ("sum(splitbus_worker_draining)", "{{instance}}", "legend: instance"),  # summed away
        (
            "sum by (role) (splitbus_worker_draining) / ignoring(tenant) splitbus_worker_draining",
            "",
            "ignoring (tenant): tenant",
        ),
    ],
)
def test_a_label_the_series_do_not_carry_is_refused(expr: str, legend: str, wrong: str) -> None:
    assert wrong_labels(expr, legend) == [wrong]


def test_the_labels_the_scrape_adds_are_accepted() -> None:
    legend = "{{role}} {{instance}} {{job}}"
    assert wrong_labels('splitbus_worker_draining{role="decode",job!=""}', legend) == []
    assert wrong_labels("sum without (instance) (rate(splitbus_planner_decisions_total[5m]))", "{{direction}}") == []


@pytest.mark.parametrize("title", PANELS)
def test_the_panels_operators_look_at_are_there(title: str) -> None:
    assert title in {panel["title"] for panel in _panels(_dashboard()["panels"])}


def test_the_dashboard_is_a_current_grafana_model() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "splitbus" and dashboard["schemaVersion"] >= 41  # Grafana 12's classic model
    assert dashboard["templating"] == {"list": []}  # no datasource variable: the uid is fixed by provisioning


def test_compose_mounts_what_grafana_reads() -> None:
    services = compose_config("monitoring")["services"]
    grafana = bind_mounts(services["grafana"])
    for target, source in {**grafana, **bind_mounts(services["prometheus"])}.items():
        assert source.exists() and source.resolve().is_relative_to(ROOT), (target, source)
    assert grafana["/etc/grafana/provisioning"].resolve() == (GRAFANA / "provisioning").resolve()
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    loaded = Path(provider["options"]["path"])
    assert grafana[str(loaded)].resolve() == DASHBOARD.parent.resolve()
    home = Path(services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (grafana[str(home.parent)] / home.name).resolve() == DASHBOARD.resolve()


def test_prometheus_scrapes_the_planner_and_labels_workers_by_role() -> None:
    jobs = {
        job["job_name"]: job
        for job in yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    }
    assert [c["targets"] for c in jobs["splitbus-planner"]["static_configs"]] == [["planner:9100"]]
    roles = {c["labels"]["role"]: c["targets"] for c in jobs["splitbus-worker"]["static_configs"]}
    assert roles == {"prefill": ["prefill:9100"], "decode": ["decode:9100"]}
    services = compose_config("monitoring")["services"]
    for job in jobs.values():
        for config in job["static_configs"]:
            for target in config["targets"]:
                assert target.split(":")[0] in services, target
