"""The Grafana dashboard (deploy/grafana): every panel queries the provisioned Prometheus, every
metric a query names is in docs/metrics.md, the panels operators look at are there, and the
compose monitoring profile mounts what Grafana reads."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
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
