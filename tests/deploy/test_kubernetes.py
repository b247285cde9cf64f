"""The Kubernetes example (deploy/kubernetes): every document is valid for its kind, offline,
against Kubernetes' own JSON schemas (strict: an unknown field fails; vendored under schemas/,
see schemas/vendor.py), and the example holds together: the workers' and the planner's arguments
parse with the real command line, a drain ends within the grace period, no secret is on a
command line, the HPAs scale the Deployments on the planner's gauge that prometheus-adapter serves,
and every metric named is in docs/metrics.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema_rs
import promql_parser
import pytest
import yaml

from tests.deploy.compose import ROOT, parse_command
from tests.metrics_docs import documented

KUBERNETES = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
FILES = ("workers.yaml", "planner.yaml", "hpa.yaml", "prometheus-adapter.yaml")
SCHEMA_OF = {  # (apiVersion, kind) -> the vendored schema
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscaler-autoscaling-v2.json",
}
ROLES = ("prefill", "decode")
METRIC = re.compile(r"\bsplitbus_\w+")
SECRET_LIKE = re.compile(r"PASSWORD|URL|KEY|TOKEN")


def _documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc is not None]


def _all() -> list[dict]:
    return [doc for name in FILES for doc in _documents(name)]


def _by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in _all() if doc["kind"] == kind}


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_example_is_the_files_listed() -> None:
    assert sorted(path.name for path in KUBERNETES.glob("*.yaml")) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_every_document_is_valid_for_its_kind(name: str) -> None:
    for doc in _documents(name):
        schema = json.loads((SCHEMAS / SCHEMA_OF[doc["apiVersion"], doc["kind"]]).read_text())
        errors = [
            f"{'/'.join(map(str, e.instance_path))}: {e.message}"
            for e in jsonschema_rs.validator_for(schema).iter_errors(doc)
        ]
        assert errors == [], f"{name}: {doc['kind']} {doc['metadata']['name']}"


def test_the_schemas_refuse_what_kubernetes_refuses() -> None:
    """The check can fail: a misspelt field and a wrong type are errors under the strict schemas."""
    deployment = _by_kind("Deployment")["splitbus-prefill"]
    validator = jsonschema_rs.validator_for(json.loads((SCHEMAS / "deployment-apps-v1.json").read_text()))
    misspelt = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    assert [e.message for e in validator.iter_errors(misspelt)] == [
        "Additional properties are not allowed ('replica' was unexpected)"
    ]
    pod = {**deployment["spec"]["template"]["spec"], "terminationGracePeriodSeconds": "90"}
    mistyped = {**deployment, "spec": {**deployment["spec"], "template": {"spec": pod}}}
    assert [list(e.instance_path) for e in validator.iter_errors(mistyped)] == [
        ["spec", "template", "spec", "terminationGracePeriodSeconds"]
    ]


def test_every_metric_named_is_in_the_catalog() -> None:
    named = {name for file in FILES for name in METRIC.findall((KUBERNETES / file).read_text())}
    assert "splitbus_planner_desired_workers" in named
    assert sorted(named - set(documented())) == [], "named in deploy/kubernetes, not in docs/metrics.md"


@pytest.mark.parametrize("role", ROLES)
def test_the_workers_arguments_parse_and_a_drain_ends_within_the_grace_period(role: str) -> None:
    deployment = _by_kind("Deployment")[f"splitbus-{role}"]
    args = parse_command(_container(deployment)["args"])
    assert (args.command, args.role) == ("worker", role)
    assert args.drain_timeout == 60 and args.metrics_port == 9100
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout


def test_the_planners_arguments_parse() -> None:
    planner = _by_kind("Deployment")["splitbus-planner"]
    args = parse_command(_container(planner)["args"])
    assert args.command == "planner" and (args.metrics_port, args.metrics_host) == (9100, "0.0.0.0")
    (service,) = _by_kind("Service").values()
    assert service["spec"]["selector"] == planner["spec"]["template"]["metadata"]["labels"]
    assert [port["port"] for port in service["spec"]["ports"]] == [args.metrics_port]
    for hpa in _by_kind("HorizontalPodAutoscaler").values():  # the advice is what the HPAs can apply
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (args.min_workers, args.max_workers)


def test_no_secret_is_on_a_command_line_and_redis_comes_from_a_secret() -> None:
    for name, deployment in _by_kind("Deployment").items():
        container = _container(deployment)
        words = " ".join(container["args"])
        assert "--redis-url" not in words and "--api-key" not in words and "://" not in words, name
        env = {item["name"]: item for item in container["env"]}
        assert env["SPLITBUS_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "splitbus-redis", "key": "url"}
        assert not [key for key, item in env.items() if SECRET_LIKE.search(key) and "value" in item], name


def test_every_deployment_selects_its_own_pods() -> None:
    for name, deployment in _by_kind("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


@pytest.mark.parametrize("role", ROLES)
def test_each_hpa_scales_its_role_to_the_planners_count(role: str) -> None:
    hpa = _by_kind("HorizontalPodAutoscaler")[f"splitbus-{role}"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"splitbus-{role}"}
    assert f"splitbus-{role}" in _by_kind("Deployment")
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {
        "name": "splitbus_planner_desired_workers",
        "selector": {"matchLabels": {"role": role}},
    }
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = the count
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 0  # the planner stabilizes
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def test_prometheus_adapter_serves_the_metric_the_hpas_read() -> None:
    (config_map,) = _by_kind("ConfigMap").values()
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["externalRules"]
    served = {rule["name"]["as"]: rule for rule in rules}
    for hpa in _by_kind("HorizontalPodAutoscaler").values():
        (metric,) = hpa["spec"]["metrics"]
        rule = served[metric["external"]["metric"]["name"]]
        assert METRIC.findall(rule["seriesQuery"]) == [rule["name"]["as"]]
        assert "by (role)" in rule["metricsQuery"]  # the HPAs select by role
        promql_parser.parse(rule["seriesQuery"])
        # the adapter's template, filled in as it does for the prefill HPA's selector
        filled = rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"])
        promql_parser.parse(filled.replace("<<.LabelMatchers>>", 'role="prefill"'))
