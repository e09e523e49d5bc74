"""Grafana dashboards and alert expressions, checked against what the services export.

Static checks: the JSON loads, every panel uses the dashboard's `datasource`
variable (no datasource uid written into a dashboard), every query reads one
install (`namespace` variable, a single value) and the chosen pods
(`instance`), every metric and label a query or alert names is one the grammar or
inference service or the gateway exports (read from their metric classes), every quantile
is histogram_quantile over rate(..._bucket), and the panels the operators
asked for are there. tests/test_observability_live.py runs the same queries
through a real Prometheus.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy_assets import (DASHBOARD_JOBS, DASHBOARDS, DATASOURCE_UID, DATASOURCE_VARIABLE, INSTALL_MATCHERS, OBS,
                                 alert_rules, dashboards, exported_series, panel_queries, panels, promql_names,
                                 quantile_uses, rule_queries, vector_selectors)

DASHBOARD_FILES = {"grammar.json", "inference.json", "gateway.json"}


@pytest.fixture(scope="module")
def exported():
    return exported_series()


def all_queries():
    out = []
    for name, d in dashboards().items():
        out.extend(panel_queries(name, d))
    return out + rule_queries()


def test_dashboard_files_are_the_expected_json():
    assert {p.name for p in DASHBOARDS.glob("*.json")} == DASHBOARD_FILES
    uids = set()
    for name, d in dashboards().items():
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 36, name
        uids.add(d["uid"])
        assert panels(d), f"{name} has no panels"
    assert len(uids) == len(DASHBOARD_FILES), "dashboard uids must be unique"


@pytest.mark.parametrize("name", sorted(DASHBOARD_FILES))
def test_every_panel_uses_the_datasource_variable(name):
    d = dashboards()[name]
    for p in panels(d):
        assert p["datasource"] == DATASOURCE_VARIABLE, p["title"]
        assert p.get("targets"), f"{name}: panel {p['title']!r} has no queries"
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"]) == DATASOURCE_VARIABLE, p["title"]
            assert t["expr"].strip(), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{name}: duplicate refIds in {p['title']!r}"


@pytest.mark.parametrize("name", sorted(DASHBOARD_FILES))
def test_no_query_is_on_two_panels(name):
    """A query copied into a panel it does not belong to (a panel's worth once rode along under the schema
    checks) shows up as the same expression twice."""
    seen = {}
    for p in panels(dashboards()[name]):
        for t in p["targets"]:
            assert t["expr"] not in seen, f"{name}: {p['title']!r} repeats a query of {seen[t['expr']]!r}"
            seen[t["expr"]] = p["title"]


@pytest.mark.parametrize("name", sorted(DASHBOARD_FILES))
def test_panels_have_unique_ids_and_do_not_overlap(name):
    d = dashboards()[name]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = {}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def _datasource_uids(node):
    """Every datasource uid anywhere in a dashboard (panels, targets, variables, annotations)."""
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield ds["uid"]
        for v in node.values():
            yield from _datasource_uids(v)
    elif isinstance(node, list):
        for v in node:
            yield from _datasource_uids(v)


@pytest.mark.parametrize("name", sorted(DASHBOARD_FILES))
def test_no_datasource_uid_is_hard_coded(name):
    """A Grafana whose Prometheus datasource has another uid still shows every panel: the uid comes from the
    `datasource` variable (Grafana's built-in annotation source is no Prometheus)."""
    uids = set(_datasource_uids(dashboards()[name]))
    assert uids <= {"${datasource}", "-- Grafana --"}, uids
    assert DATASOURCE_UID not in json.dumps(dashboards()[name])


@pytest.mark.parametrize("name", sorted(DASHBOARD_FILES))
def test_template_variables_pick_the_datasource_one_install_and_its_pods(name):
    job = DASHBOARD_JOBS[name]
    variables = {v["name"]: v for v in dashboards()[name]["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "instance"], "namespace and instance need the datasource first"
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    ns, inst = variables["namespace"], variables["instance"]
    for v in (ns, inst):
        assert v["type"] == "query" and v["datasource"] == DATASOURCE_VARIABLE, v["name"]
        assert v["definition"] == v["query"]["query"], v["name"]
        assert v["refresh"] == 2, f"{v['name']}: values refreshed with the time range (pods come and go)"
    # One namespace at a time: two installs scraped by one Prometheus are never summed into one panel.
    assert not ns["multi"] and not ns["includeAll"]
    assert ns["query"]["query"] == f'label_values(up{{job=~".*{job}"}}, namespace)'
    assert inst["multi"] and inst["includeAll"] and inst["allValue"] == ".*"
    assert inst["query"]["query"] == f'label_values(up{{job=~".*{job}", namespace="$namespace"}}, instance)'


def _selector_queries():
    return [q for name, d in dashboards().items() for q in panel_queries(name, d)]


@pytest.mark.parametrize("query", _selector_queries(), ids=lambda q: q.where)
def test_every_series_selector_reads_one_install_and_the_chosen_pods(query):
    selectors = vector_selectors(query.expr)
    assert selectors, query.expr
    for metric, matchers in selectors:
        for label, matcher in INSTALL_MATCHERS.items():
            assert matchers.get(label) == matcher, f"{query.where}: {metric} needs {label}{matcher}"


def test_the_selector_reader_sees_every_selector():
    expr = 'sum by (le) (rate(a_bucket{x="1"}[5m])) / scalar(sum(b)) or vector(0) + max by (instance) (c{y=~"z"})'
    assert vector_selectors(expr) == [("a_bucket", {"x": '="1"'}), ("b", {}), ("c", {"y": '=~"z"'})]


def test_compose_prometheus_labels_every_structd_target_with_its_namespace():
    """The dashboards read no series without a namespace: docker-compose's Prometheus sets it as the operator's
    monitors do on Kubernetes."""
    doc = yaml.safe_load((OBS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"] if j["job_name"].startswith("structd-")}
    assert set(jobs) == set(DASHBOARD_JOBS.values())
    for name, job in jobs.items():
        assert {"target_label": "namespace", "replacement": "structd"} in job.get("relabel_configs", []), name


def test_provisioned_datasources_are_prometheus():
    for f in ("datasources.yml", "datasources-k8s.yml"):
        doc = yaml.safe_load((OBS / "grafana" / f).read_text())
        assert [ds["uid"] for ds in doc["datasources"]] == [DATASOURCE_UID], f
        assert doc["datasources"][0]["type"] == "prometheus"


@pytest.mark.parametrize("query", all_queries(), ids=lambda q: q.where)
def test_query_names_only_exported_metrics_and_their_labels(query, exported):
    names = promql_names(query.expr)
    assert names.metrics, f"{query.where}: no metric found in {query.expr!r}"
    unknown = sorted(names.metrics - exported.keys())
    assert not unknown, f"{query.where}: metrics not exported by any structd service: {unknown}"
    known_labels = set().union(*(exported[m] for m in names.metrics))
    bad_labels = sorted(names.labels - known_labels)
    assert not bad_labels, f"{query.where}: labels {bad_labels} are not on {sorted(names.metrics)}"


@pytest.mark.parametrize("query", all_queries(), ids=lambda q: q.where)
def test_quantiles_are_histogram_quantile_over_bucket_rates(query):
    expr = query.expr
    n_quantile = expr.count("histogram_quantile")
    uses = quantile_uses(expr)
    assert len(uses) == n_quantile, (
        f"{query.where}: histogram_quantile must read sum by (le, ...) (rate(<histogram>_bucket[...])): {expr!r}")
    for q, metric, by in uses:
        assert 0 < q < 1, query.where
        assert "le" in by, f"{query.where}: the sum must keep le"
    buckets = {m for m in promql_names(expr).metrics if m.endswith("_bucket")}
    assert buckets <= {m for _, m, _ in uses}, f"{query.where}: _bucket series read outside histogram_quantile"


def _dashboard_index(name):
    """[(panel title, expr, metrics, quantile uses)] of one dashboard."""
    d = dashboards()[name]
    return [(p["title"], t["expr"], promql_names(t["expr"]).metrics, quantile_uses(t["expr"]))
            for p in panels(d) for t in p["targets"]]


def _quantiles_of(index, bucket, by_label=None):
    return {q for _, _, _, uses in index for q, m, by in uses
            if m == bucket and (by_label is None or by_label in by)}


def _uses(index, metric, label=None):
    return any(metric in metrics and (label is None or label in promql_names(expr).labels)
               for _, expr, metrics, _ in index)


def test_grammar_dashboard_has_the_panels_operators_asked_for():
    ix = _dashboard_index("grammar.json")
    g = "grammar_svc_"
    assert {0.5, 0.99} <= _quantiles_of(ix, g + "compile_duration_seconds_bucket"), "compile latency quantiles"
    assert any({g + "cache_hits_total", g + "cache_misses_total"} <= m for _, _, m, _ in ix), "cache hit ratio"
    assert _uses(ix, g + "cache_bytes"), "cache bytes"
    assert _uses(ix, g + "compile_failures_total", "reason"), "compile failures by reason"
    assert _uses(ix, g + "active_sessions"), "active sessions"
    assert {0.5, 0.99} <= _quantiles_of(ix, g + "mask_fill_duration_seconds_bucket"), "mask fill p50/p99"
    assert _quantiles_of(ix, g + "step_duration_seconds_bucket"), "step duration"
    assert _uses(ix, g + "mask_bytes_sum") and _uses(ix, g + "mask_bytes_count"), "wire bytes per mask"
    assert any(g + "jump_forward_tokens_total" in m and "rate(" in e for _, e, m, _ in ix), "jump-forward tokens/s"


def test_inference_dashboard_has_the_panels_operators_asked_for():
    ix = _dashboard_index("inference.json")
    i = "inference_svc_"
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert {0.5, 0.99} <= _quantiles_of(ix, i + h + "_bucket", by_label="constrained"), f"{h} by constrained"
    assert any({i + "mask_wait_seconds_sum", i + "forward_duration_seconds_sum"} <= m for _, _, m, _ in ix), \
        "mask-wait share of forward time"
    assert _quantiles_of(ix, i + "grammar_rpc_duration_seconds_bucket"), "grammar RPC latency"
    assert _quantiles_of(ix, i + "grammar_wait_seconds_bucket"), "grammar wait"
    assert _uses(ix, i + "num_requests_running") and _uses(ix, i + "num_requests_waiting"), "running/waiting"
    assert _uses(ix, i + "kv_cache_usage_ratio"), "KV cache usage"
    assert _quantiles_of(ix, i + "batch_size_bucket"), "batch size"
    assert _uses(ix, i + "generation_tokens_total"), "tokens/s"
    assert _uses(ix, i + "forced_tokens_total"), "forced tokens/s"
    assert _uses(ix, i + "requests_total", "finish_reason"), "requests by finish reason"


def test_every_exported_metric_is_on_a_dashboard(exported):
    """A metric nobody graphs is a metric nobody watches: new metrics need a panel."""
    shown = set()
    for name, d in dashboards().items():
        for q in panel_queries(name, d):
            shown |= promql_names(q.expr).metrics
    families = {n.removesuffix(s) for n in exported for s in ("_bucket", "_sum", "_count") if n.endswith(s)}
    missing = []
    for series in exported:
        family = next((f for f in families if series in (f + "_bucket", f + "_sum", f + "_count")), None)
        if family is not None:
            if not any(s.startswith(family + "_") for s in shown):
                missing.append(family)
        elif series not in shown:
            missing.append(series)
    assert not sorted(set(missing)), f"exported but on no dashboard: {sorted(set(missing))}"


def test_alert_rules_are_complete():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r.get("for"), f"{r['alert']}: alerts without `for` page on a single bad scrape"
        for key in ("summary", "description", "runbook_url"):
            assert r["annotations"].get(key), f"{r['alert']}: annotation {key} missing"
        assert "runbook" not in r["annotations"], f"{r['alert']}: the conventional name is runbook_url"
    required = {"StructdMaskWaitShareHigh", "StructdGrammarCompileFailuresRising", "StructdGrammarTierDown",
                "StructdKVCacheSaturated", "StructdInferenceQueueGrowing"}
    assert required <= set(names)


def test_dashboards_are_stored_formatted():
    """Two-space JSON as Grafana exports it: diffs of dashboard edits stay readable."""
    for p in DASHBOARDS.glob("*.json"):
        assert p.read_text() == json.dumps(json.loads(p.read_text()), indent=2) + "\n", p.name


def test_gateway_dashboard_has_the_panels_operators_asked_for():
    ix = _dashboard_index("gateway.json")
    g = "gateway_"
    assert _uses(ix, g + "requests_total", "route") and _uses(ix, g + "requests_total", "status_class"), \
        "request rate by route and status"
    assert {0.5, 0.99} <= _quantiles_of(ix, g + "request_duration_seconds_bucket", by_label="route"), "latency"
    assert {0.5, 0.99} <= _quantiles_of(ix, g + "time_to_first_token_seconds_bucket"), "TTFT of streams"
    assert _uses(ix, g + "upstream_errors_total", "code"), "upstream errors by gRPC code"
    assert _uses(ix, g + "client_disconnects_total"), "client disconnects"
    assert _uses(ix, g + "requests_in_flight"), "in flight"
