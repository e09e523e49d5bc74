"""The deployment and observability assets as data, for the deploy tests.

Loads the kustomize base (rendered in Python: kustomize is no Debian package,
so CI cannot count on it), the Grafana dashboards and the alert rules, and
knows which metrics the services and the gateway export, straight from
their metric classes. The PromQL reading here is deliberately small: enough to name the
metrics and labels a query uses, which Prometheus itself then checks in
tests/test_observability_live.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
# Overlays live beside the base: kustomize refuses an overlay inside its base's directory.
OVERLAYS = REPO / "k8s-overlays"
# JSON Schemas of the custom resources whose CRDs ship no schema here (k8s/schemas/README.md).
CRD_SCHEMAS = K8S / "schemas"
OBS = K8S / "observability"
DASHBOARDS = OBS / "dashboards"
RULES_FILE = OBS / "alerts.rules.yml"
RULES_TEST_FILE = OBS / "alerts.test.yml"
# The uid the provisioned datasources carry; dashboards name none (their `datasource` variable picks one).
DATASOURCE_UID = "structd-prometheus"
# What every panel's queries and targets name: the dashboard's `datasource` template variable.
DATASOURCE_VARIABLE = {"type": "prometheus", "uid": "${datasource}"}
# The matchers every series selector of a panel query carries: one install (namespace) at a time, the chosen pods.
INSTALL_MATCHERS = {"namespace": '="$namespace"', "instance": '=~"$instance"'}
# The job each dashboard's namespace and instance variables list the values of.
DASHBOARD_JOBS = {"grammar.json": "structd-grammar", "inference.json": "structd-inference",
                  "gateway.json": "structd-gateway"}

# Kinds that are custom resources (no schema in kubernetes-validate).
CUSTOM_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PodMonitor", "PrometheusRule", "Certificate"}
CLUSTER_SCOPED_KINDS = {"Namespace"}


# --- Kubernetes ------------------------------------------------------------------------------


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _set_images(node, images: dict[str, dict]) -> None:
    """kustomize's image transformer: every container's image, wherever the containers list is."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, _, _tag = c["image"].partition(":")
                    if name in images:
                        img = images[name]
                        c["image"] = f"{img.get('newName', name)}:{img.get('newTag', _tag)}"
            else:
                _set_images(value, images)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, images)


def render() -> list[dict]:
    """The objects `kubectl kustomize k8s/` produces for this base (resources, namespace,
    images, configMapGenerator with generatorOptions); the kustomize features used here only."""
    k = kustomization()
    ns = k.get("namespace")
    objs: list[dict] = []
    for rel in k["resources"]:
        objs.extend(load_yaml_docs(K8S / rel))
    gen_opts = k.get("generatorOptions", {})
    for g in k.get("configMapGenerator", []):
        opts = g.get("options", {})
        data = {}
        for spec in g.get("files", []):
            key, _, rel = spec.rpartition("=")
            rel_path = K8S / rel
            data[key or rel_path.name] = rel_path.read_text()
        meta = {"name": g["name"]}
        labels = {**gen_opts.get("labels", {}), **opts.get("labels", {})}
        annotations = {**gen_opts.get("annotations", {}), **opts.get("annotations", {})}
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    images = {i["name"]: i for i in k.get("images", [])}
    for o in objs:
        if ns and o["kind"] not in CLUSTER_SCOPED_KINDS:
            o["metadata"]["namespace"] = ns
        _set_images(o, images)
    _set_labels(objs, k.get("labels", []))
    return objs


# Where kustomize's `labels` with includeTemplates puts them besides metadata: the pod templates of the
# built-in workload kinds (not of custom resources such as the LeaderWorkerSet).
_TEMPLATE_PATHS = {kind: ("spec", "template") for kind in
                   ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController")}
_TEMPLATE_PATHS["CronJob"] = ("spec", "jobTemplate", "spec", "template")


def _set_labels(objs: list[dict], entries: list[dict]) -> None:
    """kustomize's `labels` transformer, for entries that leave selectors alone."""
    for entry in entries:
        assert not entry.get("includeSelectors"), "labels in selectors: not rendered here"
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
            path = _TEMPLATE_PATHS.get(o["kind"])
            if entry.get("includeTemplates") and path:
                node = o
                for key in path:
                    node = node[key]
                node.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])


def render_namespace() -> list[dict]:
    """The namespace kustomization (k8s-overlays/namespace): the Namespace, kept out of the base."""
    directory = OVERLAYS / "namespace"
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objs = [d for rel in k["resources"] for d in load_yaml_docs(directory / rel)]
    _set_labels(objs, k.get("labels", []))
    return objs


def render_overlay(directory: Path) -> list[dict]:
    """An overlay of the base: its resources (the base) with its JSON 6902 patches applied (the ops used here)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert [(directory / r).resolve() for r in k["resources"]] == [K8S.resolve()], "overlays build on the base"
    objs = render()
    for patch in k.get("patches", []):
        t = patch["target"]
        for o in objs:
            if o["kind"] == t["kind"] and o["metadata"]["name"] == t["name"]:
                for op in yaml.safe_load(patch["patch"]):
                    assert op["op"] == "replace", op
                    *parents, last = op["path"].strip("/").split("/")
                    node = o
                    for key in parents:
                        node = node[key]
                    assert last in node, f"{op['path']} replaces nothing"
                    node[last] = op["value"]
    return objs


def kubectl_kustomize(directory: Path) -> list[dict] | None:
    """What `kubectl kustomize` renders for a directory (the reference), or None without kubectl (there is no
    usable Debian package, so CI may lack it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=object_key)


def object_key(o: dict) -> tuple[str, str]:
    return (o["kind"], o["metadata"]["name"])


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels / matchExpressions, or a Service's plain map) matches labels."""
    match = selector.get("matchLabels", selector) if ("matchLabels" in selector or "matchExpressions" in selector) \
        else selector
    if any(labels.get(k) != v for k, v in match.items() if k != "matchExpressions"):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_specs(objs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, pod template metadata, pod spec) for every pod template in the base."""
    out = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = o["spec"]["template"]
            out.append((name, t.get("metadata", {}), t["spec"]))
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                if role in lwt:
                    out.append((f"{name} {role}", lwt[role].get("metadata", {}), lwt[role]["spec"]))
    return out


# --- dashboards and rules --------------------------------------------------------------------


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, including those nested in collapsed rows."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class Query:
    where: str  # "grammar.json: Compile latency [A]"
    expr: str


def panel_queries(name: str, dashboard: dict) -> list[Query]:
    return [Query(f"{name}: {p['title']} [{t['refId']}]", t["expr"])
            for p in panels(dashboard) for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(RULES_FILE.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def rule_queries() -> list[Query]:
    return [Query(f"alert {r.get('alert') or r.get('record')}", r["expr"]) for r in alert_rules()]


def grafana_to_promql(expr: str, rate_interval: str = "1m", namespace: str = "structd", instance: str = ".*") -> str:
    """What Grafana sends Prometheus: its interval variables and the dashboards' template variables replaced
    (instance ".*" is the variable's All)."""
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}"):
        expr = expr.replace(var, rate_interval)
    for var, value in (("namespace", namespace), ("instance", instance)):
        expr = expr.replace("${" + var + "}", value).replace("$" + var, value)
    return expr


# --- what the services export ------------------------------------------------------------------

# Synthesized by Prometheus for every target.
PROMETHEUS_SERIES = {"up": {"job", "instance"}}
# Labels every target carries: job and instance from Prometheus, namespace from prometheus-operator's monitors
# (and from the relabelling in the compose prometheus.yml and the live test's scrape config).
TARGET_LABELS = {"job", "instance", "namespace"}


def _metric_series(metrics_obj) -> dict[str, set[str]]:
    """{series name: label names} for every metric a service's metrics class defines."""
    from prometheus_client.metrics import MetricWrapperBase

    from shared.metrics import BatchHistogram

    out: dict[str, set[str]] = {}
    for m in vars(metrics_obj).values():
        if isinstance(m, BatchHistogram):
            name, kind, labels = m.name, "histogram", set(m.labelnames)
        elif isinstance(m, MetricWrapperBase):
            name, kind, labels = m._name, m._type, set(m._labelnames)
        else:
            continue
        if kind == "histogram":
            out[name + "_bucket"] = labels | {"le"}
            out[name + "_sum"] = set(labels)
            out[name + "_count"] = set(labels)
        elif kind == "counter":
            out[name + "_total"] = set(labels)
        else:
            out[name] = set(labels)
    return out


def exported_series() -> dict[str, set[str]]:
    """Every series name the grammar and inference services and the gateway export, with its labels
    (target labels job/instance included), plus Prometheus' own `up`."""
    from gateway.metrics import GatewayMetrics
    from grammar_svc.metrics import GrammarMetrics
    from inference_svc.metrics import InferenceMetrics

    out = {k: v | TARGET_LABELS for k, v in PROMETHEUS_SERIES.items()}
    for obj in (GrammarMetrics(), InferenceMetrics(), GatewayMetrics()):
        for name, labels in _metric_series(obj).items():
            out[name] = labels | TARGET_LABELS
    return out


# --- a small PromQL reader ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?!\w)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2"}


@dataclass(frozen=True)
class PromqlNames:
    metrics: frozenset[str]
    labels: frozenset[str]  # label names in matchers and grouping clauses


def promql_names(expr: str) -> PromqlNames:
    """Metric and label names an expression uses (functions and keywords excluded)."""
    labels: set[str] = set()
    text = _STRING.sub('""', grafana_to_promql(expr))
    for m in _MATCHERS.finditer(text):
        labels.update(_MATCHER_LABEL.findall(m.group(1)))
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    for m in _GROUPING.finditer(text):
        labels.update(x.strip() for x in m.group(2).split(",") if x.strip())
    text = _GROUPING.sub(" ", text)
    metrics = set()
    for m in _IDENT.finditer(text):
        word = m.group(1)
        if word.lower() in _KEYWORDS or re.match(r"\s*\(", text[m.end():]):
            continue  # keyword or function / aggregation call
        metrics.add(word)
    return PromqlNames(frozenset(metrics), frozenset(labels))


_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                 "count_values", "group"}
_SELECTOR = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")


def vector_selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: operator and quoted value}) for each series selector in expr, as written."""
    text = _RANGE.sub(" ", expr)
    text = _GROUPING.sub(" ", text)
    out = []
    for m in _SELECTOR.finditer(text):
        name, matchers = m.group(1), m.group(2) or "{}"
        if name.lower() in _KEYWORDS | _AGGREGATIONS or re.match(r"\s*\(", text[m.end(1):]):
            continue
        if re.fullmatch(r"[0-9.e]+", name) or text[m.start() - 1:m.start()] in ('"', "'"):
            continue
        parsed = {}
        for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")', matchers):
            parsed[lm.group(1)] = lm.group(2) + lm.group(3)
        out.append((name, parsed))
    return out


_QUANTILE = re.compile(
    r"histogram_quantile\(\s*(?P<q>[0-9.]+)\s*,\s*sum\s+by\s*\((?P<by>[^)]*)\)\s*"
    r"\(\s*rate\(\s*(?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*_bucket)(?:\{[^}]*\})?\[[^\]]+\]\s*\)\s*\)\s*\)")


def quantile_uses(expr: str) -> list[tuple[float, str, set[str]]]:
    """(quantile, bucket series, by-labels) for each well-formed histogram_quantile in expr."""
    return [(float(m["q"]), m["metric"], {x.strip() for x in m["by"].split(",")}) for m in _QUANTILE.finditer(expr)]
