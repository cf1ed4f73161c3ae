"""The shipped Prometheus rules (deploy/prometheus/fleet-alerts.yaml, the chart's rules/fleet-alerts.yaml): valid
for ``promtool check rules``, unit-tested by ``promtool test rules`` on synthetic series (tests/alerts/*.yaml),
with a firing and a quiet case for every alert, a summary, a description and a runbook section each, and only
series Fleet exports. promtool comes with Debian's ``prometheus`` package (scripts/services.sh installs it).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.settings import FleetSettings
from tests.fleet_metrics import fleet_collectors
from tests.services import require_binary

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "fleet-alerts.yaml"
CHART_RULES = ROOT / "deploy" / "helm" / "fleet" / "rules" / "fleet-alerts.yaml"
UNIT_TESTS = sorted((ROOT / "tests" / "alerts").glob("*.yaml"))
RUNBOOKS = ROOT / "docs" / "operations" / "runbooks.md"
SERIES = re.compile(r"\b(fleet_[a-z0-9_]+)(\{[^}]*\})?")
RECORDED = re.compile(r"\bfleet:[a-z0-9_:]+")
MATCHER = re.compile(r"([a-zA-Z_]+)\s*(?:=~|!~|!=|=)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool", "prometheus", "promtool (Prometheus)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def unit_cases() -> list[tuple[str, bool]]:
    """(alert name, expects it firing) of every alert_rule_test case in tests/alerts."""
    cases = []
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.append((case["alertname"], bool(case.get("exp_alerts"))))
    return cases


def test_the_rules_pass_promtool_check() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    assert UNIT_TESTS, "no unit tests in tests/alerts"
    proc = promtool("test", "rules", *map(str, UNIT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """A rule that fires too eagerly fails its quiet case: the unit tests are not vacuous."""
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    eager = RULES.read_text().replace('fleet_service_up{service="redis"} == 0', 'fleet_service_up{service="redis"} < 2')
    (tmp_path / "deploy" / "prometheus" / "fleet-alerts.yaml").write_text(eager)
    (tmp_path / "tests" / "alerts").mkdir(parents=True)
    copy = tmp_path / "tests" / "alerts" / "infrastructure.yaml"
    copy.write_text((ROOT / "tests" / "alerts" / "infrastructure.yaml").read_text())
    proc = promtool("test", "rules", str(copy))
    assert proc.returncode != 0 and "FleetStoreUnreachable" in proc.stdout + proc.stderr


@pytest.mark.parametrize("alert", sorted(alerts()))
def test_every_alert_has_a_firing_and_a_quiet_unit_test(alert: str) -> None:
    cases = unit_cases()
    assert (alert, True) in cases, f"{alert}: no promtool case in tests/alerts where it fires"
    assert (alert, False) in cases, f"{alert}: no promtool case in tests/alerts where it stays quiet"


def test_unit_tests_name_only_alerts_that_exist() -> None:
    assert {name for name, _ in unit_cases()} <= set(alerts())


def runbook_anchors() -> set[str]:
    """The anchors mkdocs' toc gives the runbook page's headings (lower case, spaces to dashes)."""
    headings = re.findall(r"^#{2,4}\s+(.+?)\s*$", RUNBOOKS.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


@pytest.mark.parametrize("alert", sorted(alerts()))
def test_every_alert_has_a_summary_a_description_a_severity_and_a_runbook_section(alert: str) -> None:
    rule = alerts()[alert]
    annotations = rule["annotations"]
    assert annotations.get("summary") and annotations.get("description")
    assert rule["labels"]["severity"] in {"critical", "warning"}
    page, _, anchor = annotations["runbook_url"].partition("#")
    assert page == "docs/operations/runbooks.md", "the chart's runbookBaseUrl replaces exactly this path"
    assert anchor in runbook_anchors(), f"{alert}: no heading in {RUNBOOKS.name} gives the anchor #{anchor}"


def test_every_series_the_rules_read_is_one_fleet_exports_with_those_labels() -> None:
    known = fleet_collectors()
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        expr = rule["expr"]
        for series, selector in SERIES.findall(expr):
            assert series in known, f"{series} is not a series Fleet exports (known: {sorted(known)})"
            _, labels = known[series]
            for label in MATCHER.findall(selector):
                assert label in labels, f"{series} has no label {label!r} (it has {sorted(labels)})"
        for name in RECORDED.findall(expr):
            assert name in recorded, f"{name} is read but recorded by no rule"


def test_the_file_for_prometheus_is_the_charts_rules_file() -> None:
    assert RULES.resolve() == CHART_RULES.resolve(), "one source: deploy/prometheus links to the chart's file"


def test_slo_settings_off_the_histogram_or_out_of_range_are_refused_naming_the_setting() -> None:
    assert FleetSettings(slo_latency_s=2.5).slo_latency_s == 2.5
    with pytest.raises(ConfigError, match=r"FLEET_SLO_LATENCY_S=2 is not a bucket .* use one of .*2\.5"):
        FleetSettings(slo_latency_s=2)
    for field, value in (("slo_latency_target", 1.0), ("slo_error_target", 0.0), ("slo_error_target", 99.9)):
        with pytest.raises(ValidationError, match=field):
            FleetSettings.model_validate({field: value})
