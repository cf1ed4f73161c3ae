"""The Grafana dashboard (deploy/helm/fleet/dashboards/fleet.json) only queries metrics Fleet exports, with their
real labels.

Dashboards rot silently when a metric is renamed: the panel just shows "No data". These tests read every PromQL
expression of the dashboard and check each ``fleet_*`` series against the collectors Fleet registers: the name,
the suffix its type gives it (``_total`` for counters; ``_bucket``, ``_sum``, ``_count`` for histograms; none for
gauges) and every label a selector or a ``by (...)`` uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_metrics import fleet_collectors

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "fleet" / "dashboards" / "fleet.json"
SERIES = re.compile(r"\b(fleet_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_]+)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert board["uid"] == "fleet-overview" and board["title"] == "Fleet"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["description"], panel["title"]
    assert len(expressions()) >= 20


@pytest.mark.parametrize(("title", "expr"), expressions())
def test_every_query_names_exported_series_and_labels(title: str, expr: str) -> None:
    known = fleet_collectors()
    used = SERIES.findall(expr)
    assert used, f"{title}: no fleet_* series in {expr!r}"
    labels_here: set[str] = set()
    for series, selector in used:
        assert series in known, f"{title}: {series} is not a series Fleet exports (known: {sorted(known)})"
        _, labels = known[series]
        labels_here |= labels
        for label in MATCHER.findall(selector or ""):
            assert label in labels, f"{title}: {series} has no label {label!r} (it has {sorted(labels)})"
    for group in BY.findall(expr):
        for label in (g.strip() for g in group.split(",")):
            assert label in labels_here, f"{title}: by ({label}) names no label of {[s for s, _ in used]}"


def test_every_fleet_metric_appears_on_the_dashboard() -> None:
    text = " ".join(expr for _, expr in expressions())
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in fleet_collectors()}
    missing = sorted(b for b in bases if not re.search(rf"\b{b}(_total|_bucket|_sum|_count)?\b", text))
    assert not missing, f"metrics without a panel: {missing}"
