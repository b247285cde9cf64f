"""docs/metrics.md lists every metric the code defines, and the naming rules hold."""

from __future__ import annotations

import re

import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

import splitbus.api.metrics
import splitbus.bus.core.metrics
import splitbus.placement.metrics
import splitbus.planner.metrics
import splitbus.scheduler.metrics
import splitbus.worker.metrics  # noqa: F401  (registers the worker's metrics)
from tests.metrics_docs import documented

UNBOUNDED_LABELS = re.compile(r"request|worker|entry|id$|key|model")


def _metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names), for every splitbus metric in this process."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in list(REGISTRY._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            found[_exposed(collector._name, collector._type)] = (collector._type, tuple(collector._labelnames))
        else:
            for family in collector.collect():  # a family built with labels keeps their names, samples or not
                found[_exposed(family.name, family.type)] = (family.type, tuple(getattr(family, "_labelnames", ())))
    return {name: kind for name, kind in found.items() if name.startswith("splitbus")}


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def test_every_metric_is_in_the_catalog_with_its_type_and_labels() -> None:
    assert _metrics() == documented()


@pytest.mark.parametrize("name", sorted(_metrics()))
def test_names_carry_units_and_labels_are_bounded(name: str) -> None:
    kind, labels = _metrics()[name]
    if kind == "histogram":
        assert name.endswith("_seconds"), "histograms measure time, in seconds"
    if kind == "gauge":
        assert not name.endswith("_total"), "_total is for counters"
    assert not [label for label in labels if UNBOUNDED_LABELS.search(label)], (
        f"{name}: labels {labels} may be unbounded"
    )
