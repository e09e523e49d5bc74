"""Alert rules with Prometheus' own tool: syntax (`promtool check rules`) and
behaviour (`promtool test rules` on k8s/observability/alerts.test.yml)."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.conftest import require_tool
from tests.deploy_assets import OBS, REPO, RULES_FILE, RULES_TEST_FILE, alert_rules

RUNBOOK = REPO / "docs" / "runbook.md"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=OBS)


def test_promtool_check_rules():
    out = promtool("check", "rules", RULES_FILE.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_promtool_test_rules():
    out = promtool("test", "rules", RULES_TEST_FILE.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_unit_test_where_it_fires():
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())
    assert tests["rule_files"] == [RULES_FILE.name]
    fired = {c["alertname"] for t in tests["tests"] for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    quiet = {c["alertname"] for t in tests["tests"] for c in t.get("alert_rule_test", []) if not c.get("exp_alerts")}
    names = {r["alert"] for r in alert_rules()}
    assert names - fired == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


def test_promtool_check_config_of_the_compose_prometheus():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def _markdown_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to dashes)."""
    return {re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def test_every_alert_links_its_runbook_section():
    """runbook_url (the name Alertmanager and Grafana templates look for) is the alert's own section of
    docs/runbook.md, and that section exists."""
    anchors = _markdown_anchors(RUNBOOK.read_text())
    for r in alert_rules():
        url = r["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert (REPO / path).resolve() == RUNBOOK.resolve(), f"{r['alert']}: {url}"
        assert anchor == r["alert"].lower(), f"{r['alert']}: {url} is not its own section"
        assert anchor in anchors, f"{r['alert']}: docs/runbook.md has no section #{anchor}"


def test_the_runbook_has_no_section_for_an_alert_that_does_not_exist():
    sections = set(re.findall(r"^### (Structd\w+)$", RUNBOOK.read_text(), re.M))
    assert sections == {r["alert"] for r in alert_rules()}


_AGGREGATION = re.compile(r"\b(sum|count|avg|min|max|group|stddev|stdvar|topk|bottomk|quantile)\s*(by|without)?\s*\(")


def test_every_aggregation_keeps_the_namespace():
    """Two installs on one Prometheus alert apart: an aggregation without namespace would sum them, so one
    install's outage or failure share is hidden by another's replicas or traffic."""
    for r in alert_rules():
        expr = r["expr"]
        for m in _AGGREGATION.finditer(expr):
            assert m.group(2) == "by", f"{r['alert']}: {m.group(0)!r} must say by (namespace, ...)"
            labels = {x.strip() for x in expr[m.end():expr.index(")", m.end())].split(",")}
            assert "namespace" in labels, f"{r['alert']}: {m.group(0)}{sorted(labels)} drops the namespace"
