"""Dashboards and alerts against a real Prometheus scraping real services.

A Prometheus server (the Debian package's binary, on loopback, with a
temporary TSDB, stopped at teardown) scrapes the live services every second
and loads the alert rules. Once it has scraped them, the services get two
rounds of traffic, each followed by two scrapes: a labelled series appears
with its first increment, so only the second round shows up in rate(). Then
every panel query of their dashboards must return data with a finite value,
every alert expression must evaluate, and Prometheus' own rule evaluation
must report no rule in error. A query that names a metric no service
exports returns nothing, so it fails here. Every target is scraped twice,
as two installs in two namespaces (as prometheus-operator labels them): the
panels, asked for one namespace, must count each service once.

LIVE lists what is scraped: the job, the dashboard it must fill, and the
fixture that starts the service and sends its traffic. Each service's
/metrics is also read once right after it starts, before any traffic: every
counter a panel reads is there already, at 0, for its known label values.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from structd.bench.harness import free_port
from tests.conftest import require_tool, run, start_grammar_server
from tests.deploy_assets import REPO, RULES_FILE, Query, alert_rules, dashboards, grafana_to_promql, panel_queries, \
    promql_names, rule_queries

SCRAPE_SECONDS = 1
# Wide enough to hold every sample of this module's short-lived TSDB: Grafana's
# $__rate_interval is only a floor on the window in a real deployment.
RATE_INTERVAL = "5m"
# The dashboards' namespace variable, and a second install of the same targets on the same Prometheus.
NAMESPACE = "structd-live"
OTHER_NAMESPACE = "structd-other"


@dataclass(frozen=True)
class LiveService:
    job: str
    dashboard: str
    fixture: str  # yields an object with .metrics_address and .send_traffic(round_no)


LIVE = [
    LiveService("structd-grammar", "grammar.json", "live_grammar"),
    LiveService("structd-inference", "inference.json", "live_inference"),
    LiveService("structd-gateway", "gateway.json", "live_gateway"),
]


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean drain), SIGKILL if it takes longer than 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


# --- the services ------------------------------------------------------------------------------

NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


class GrammarLive:
    """A grammar replica with a /metrics port; traffic covers every grammar panel:
    compiles (miss, hit, failure), a step stream with jump-forward, and an output
    check that finds a violation. Each
    round compiles constraints of its own, so every round is a cache miss."""

    def __init__(self, tokenizer_desc, hf_tokenizer):
        self.server = start_grammar_server(metrics_port=free_port())
        self.metrics_address = f"127.0.0.1:{self.server.server.metrics_port}"
        self.fresh_exposition = _get(f"http://{self.metrics_address}/metrics").decode()
        self.desc = tokenizer_desc
        self.hf = hf_tokenizer

    def send_traffic(self, round_no: int) -> None:
        from shared.gen.grammar.v1 import grammar_service_pb2 as pb
        from shared.grammar_client import GrammarClient

        desc = self.desc
        value_tokens = self.hf.encode('Ada Lovelace"}', add_special_tokens=False)

        async def go():
            client = GrammarClient(self.server.target)
            try:
                await client.register_tokenizer(desc)
                schema = {**NAME_SCHEMA, "title": f"round {round_no}"}
                name = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps(schema)))
                gid = (await client.compile(desc.fingerprint, name)).grammar_id
                assert (await client.compile(desc.fingerprint, name)).cache_hit
                regex = pb.GrammarSpec(regex=f"[0-9]{{3}}-[0-9]{{{4 + round_no}}}")
                rid = (await client.compile(desc.fingerprint, regex)).grammar_id
                with pytest.raises(grpc.aio.AioRpcError):
                    bad = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=f"{{nope {round_no}"))
                    await client.compile(desc.fingerprint, bad)
                stream = client.open_stream(desc.vocab_size)
                resp = await stream.step([
                    pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=gid), jump_forward=True),
                    pb.SessionStep(session_id=2, open=pb.OpenSession(grammar_id=rid))])
                assert resp.results[0].jump_forward.forced_token_ids, "no jump-forward: the panel would stay flat"
                for t in value_tokens:
                    await stream.step([pb.SessionStep(session_id=1, accept_token_ids=[t], jump_forward=True),
                                       pb.SessionStep(session_id=2, accept_token_ids=self.hf.encode(
                                           "5", add_special_tokens=False))])
                await stream.step([pb.SessionStep(session_id=1, close=True), pb.SessionStep(session_id=2, close=True)])
                await stream.close()
                # A finished output that breaks its schema: the violations panel.
                unique = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps(
                    {"type": "array", "uniqueItems": True, "title": f"round {round_no}"})))
                uid = (await client.compile(desc.fingerprint, unique)).grammar_id
                report = await client.check_output(uid, self.hf.encode("[1,1]", add_special_tokens=False))
                assert [v.keyword for v in report.violations] == ["uniqueItems"]
            finally:
                await client.close()

        run(go())

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def live_grammar(tokenizer_desc, hf_tokenizer):
    svc = GrammarLive(tokenizer_desc, hf_tokenizer)
    yield svc
    svc.stop()


class InferenceLive:
    """`structd inference` (embedded model, CPU) wired to the live grammar replica;
    traffic mixes constrained and free requests, concurrently, so batches form."""

    def __init__(self, grammar: GrammarLive, workdir: Path):
        from shared.inference_client import InferenceClient

        self.port, metrics_port = free_port(), free_port()
        self.metrics_address = f"127.0.0.1:{metrics_port}"
        self.log = workdir / "inference.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "structd", "inference", "--host", "127.0.0.1", "--port", str(self.port),
                 "--metrics-port", str(metrics_port), "--grammar-target", grammar.server.target,
                 "--device", "cpu", "--num-threads", "1", "--default-max-tokens", "16"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.client = InferenceClient(f"127.0.0.1:{self.port}")
        try:
            self.client.wait_ready(180)
        except TimeoutError:
            self.stop()
            raise AssertionError("inference service did not become SERVING:\n" + self.log.read_text()[-4000:])
        self.fresh_exposition = _get(f"http://{self.metrics_address}/metrics").decode()

    def send_traffic(self, round_no: int) -> None:
        requests = [
            dict(json_schema={**NAME_SCHEMA, "title": f"round {round_no}"}, max_tokens=24),
            dict(regex="[0-9]{3}-[0-9]{4}", max_tokens=16),
            dict(max_tokens=8),
            dict(max_tokens=12, stop=["e"]),
        ]
        with ThreadPoolExecutor(len(requests)) as pool:
            done = list(pool.map(lambda r: self.client.complete(f"Round {round_no}:", timeout=120, **r), requests))
        assert all(c.finish_reason for c in done)

    def stop(self) -> None:
        self.client.close()
        terminate(self.proc)


@pytest.fixture(scope="module")
def live_inference(live_grammar, tmp_path_factory):
    svc = InferenceLive(live_grammar, tmp_path_factory.mktemp("inference"))
    yield svc
    svc.stop()


class GatewayLive:
    """`structd gateway` in front of the live inference service; traffic covers every gateway panel:
    chat and completions, streamed (time to first token) and not, and a request refused with a 404."""

    def __init__(self, inference: InferenceLive, workdir: Path):
        port = free_port()
        self.metrics_address = f"127.0.0.1:{port}"
        self.base = f"http://127.0.0.1:{port}"
        self.log = workdir / "gateway.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "structd", "gateway", "--host", "127.0.0.1", "--port", str(port),
                 "--target", f"127.0.0.1:{inference.port}"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(self.base + "/health", 2) is not None:
                    break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise AssertionError("gateway did not become ready:\n" + self.log.read_text()[-4000:])
            time.sleep(0.2)
        self.fresh_exposition = _get(f"http://{self.metrics_address}/metrics").decode()

    def _post(self, path: str, body: dict) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:  # a 4xx is part of the traffic
            return e.code, e.read()

    def send_traffic(self, round_no: int) -> None:
        model = json.loads(_get(self.base + "/v1/models"))["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": f"Round {round_no}"}], "max_tokens": 6}
        done = [self._post("/v1/chat/completions", chat),
                self._post("/v1/chat/completions", {**chat, "stream": True}),
                self._post("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4, "stream": True}),
                self._post("/v1/completions", {"model": "no-such-model", "prompt": "Hi"})]
        assert [status for status, _ in done] == [200, 200, 200, 404], done

    def stop(self) -> None:
        terminate(self.proc)


@pytest.fixture(scope="module")
def live_gateway(live_inference, tmp_path_factory):
    svc = GatewayLive(live_inference, tmp_path_factory.mktemp("gateway"))
    yield svc
    svc.stop()


# --- before any traffic -------------------------------------------------------------------------


def _samples(exposition: str) -> dict[str, list[dict[str, str]]]:
    """{sample name: [labels of each sample]} of a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


@pytest.mark.parametrize("service", LIVE, ids=lambda s: s.job)
def test_every_counter_a_panel_reads_is_exported_before_any_traffic(request, service):
    """A counter series appears with its first increment unless the service creates it at start: a panel over
    one that never counted shows "No data" instead of 0 (grammar_svc_cache_hits_total, say, while the
    inference leaders' memo answers every repeat)."""
    svc = request.getfixturevalue(service.fixture)
    samples = _samples(svc.fresh_exposition)
    read = {m for q in panel_queries(service.dashboard, dashboards()[service.dashboard])
            for m in promql_names(q.expr).metrics if m.endswith("_total")}
    assert read, service.dashboard
    missing = sorted(m for m in read if not samples.get(m))
    assert not missing, f"{service.job} exports no series of {missing} until they first count"


def _values(samples, series: str, label: str) -> set[str]:
    return {labels[label] for labels in samples.get(series, [])}


def test_grammar_counters_start_at_zero_for_every_known_label_value(live_grammar):
    from grammar_svc.metrics import BACKEND_CHOICES, COMPILE_FAILURE_REASONS, SESSION_EVENTS, VIOLATION_KEYWORDS
    from grammar_svc.types import Kind

    samples = _samples(live_grammar.fresh_exposition)
    kinds = {k.value for k in Kind}
    for series in ("grammar_svc_cache_hits_total", "grammar_svc_cache_misses_total"):
        assert _values(samples, series, "kind") == kinds, series
    failures = {(s["kind"], s["reason"]) for s in samples["grammar_svc_compile_failures_total"]}
    assert failures == {(k, r) for k in kinds for r in COMPILE_FAILURE_REASONS}
    assert _values(samples, "grammar_svc_session_events_total", "event") == set(SESSION_EVENTS)
    assert _values(samples, "grammar_svc_output_violations_total", "keyword") == set(VIOLATION_KEYWORDS)
    choices = {(s["backend"], s["reason"]) for s in samples["grammar_svc_backend_choices_total"]}
    assert choices == {(backend, reason) for backend, reasons in BACKEND_CHOICES.items() for reason in reasons}


# --- Prometheus --------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "scrape_timeout": f"{SCRAPE_SECONDS}s",
                       "evaluation_interval": f"{SCRAPE_SECONDS}s"},
            "rule_files": [str(RULES_FILE)],
            "scrape_configs": [{"job_name": job, "static_configs": [
                {"targets": [address], "labels": {"namespace": ns}} for ns in (NAMESPACE, OTHER_NAMESPACE)]}
                for job, address in targets.items()],
        }
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT)
        self.wait(lambda: _get(self.url + "/-/ready", 2) is not None, 30, "Prometheus ready")

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"Prometheus exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if predicate():
                    return
            except (OSError, ValueError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            return json.loads(_get(url))
        except urllib.error.HTTPError as e:  # 400 for a bad query carries the error as JSON
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def last_scrape(self, job: str) -> float:
        result = self.query(f'min(timestamp(up{{job="{job}"}}))')["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def prometheus(request, tmp_path_factory):
    binary = require_tool("prometheus")
    services = {s.job: request.getfixturevalue(s.fixture) for s in LIVE}
    prom = Prometheus(binary, tmp_path_factory.mktemp("prometheus"), {j: s.metrics_address for j, s in services.items()})
    try:
        def all_up():
            targets = prom.api("targets")["data"]["activeTargets"]
            return len(targets) == 2 * len(LIVE) and all(t["health"] == "up" for t in targets)

        prom.wait(all_up, 30, "every target scraped and up")
        for round_no in range(2):
            for svc in services.values():
                svc.send_traffic(round_no)
            sent = time.time()
            prom.wait(lambda: all(prom.last_scrape(j) >= sent + 2 * SCRAPE_SECONDS for j in services), 30,
                      f"two scrapes after traffic round {round_no}")
        yield prom
    finally:
        prom.stop()


# --- the checks ------------------------------------------------------------------------------


def live_panel_queries() -> list[Query]:
    all_dashboards = dashboards()
    return [q for s in LIVE for q in panel_queries(s.dashboard, all_dashboards[s.dashboard])]


def assert_has_data(where: str, expr: str, answer: dict) -> None:
    assert answer["status"] == "success", f"{where}: {answer.get('errorType')}: {answer.get('error')}\n{expr}"
    result = answer["data"]["result"]
    assert result, f"{where}: no data (does it name a metric or label no service exports?)\n{expr}"
    values = [float(r["value"][1]) for r in result] if answer["data"]["resultType"] == "vector" \
        else [float(result[1])]
    assert any(math.isfinite(v) for v in values), f"{where}: only NaN/Inf: {result}\n{expr}"


@pytest.mark.parametrize("query", live_panel_queries(), ids=lambda q: q.where)
def test_every_panel_returns_data(prometheus, query):
    expr = grafana_to_promql(query.expr, RATE_INTERVAL, namespace=NAMESPACE)
    assert_has_data(query.where, expr, prometheus.query(expr))


@pytest.mark.parametrize("service", LIVE, ids=lambda s: s.job)
def test_two_installs_on_one_prometheus_are_not_summed(prometheus, service):
    """Each service is scraped as two installs; its dashboard's "up" panel, for one namespace, counts one."""
    d = dashboards()[service.dashboard]
    (up,) = [q for q in panel_queries(service.dashboard, d) if q.expr.startswith("sum(up{")]
    for ns in (NAMESPACE, OTHER_NAMESPACE):
        answer = prometheus.query(grafana_to_promql(up.expr, RATE_INTERVAL, namespace=ns))
        assert [float(r["value"][1]) for r in answer["data"]["result"]] == [1.0], (ns, answer)
    everything = prometheus.query(f'sum(up{{job="{service.job}"}})')["data"]["result"]
    assert float(everything[0]["value"][1]) == 2.0, "the second install is not being scraped"


@pytest.mark.parametrize("query", rule_queries(), ids=lambda q: q.where)
def test_every_alert_expression_evaluates(prometheus, query):
    answer = prometheus.query(query.expr)
    assert answer["status"] == "success", f"{query.where}: {answer.get('error')}"


def test_prometheus_evaluates_every_rule_without_error(prometheus):
    def evaluated():
        rules = [r for g in prometheus.api("rules")["data"]["groups"] for r in g["rules"]]
        # Never-evaluated rules report Go's zero time.
        return len(rules) == len(alert_rules()) and not any(r["lastEvaluation"].startswith("0001") for r in rules)

    prometheus.wait(evaluated, 20, "every rule evaluated once")
    rules = [r for g in prometheus.api("rules")["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, broken


def test_a_query_for_a_metric_nobody_exports_fails(prometheus):
    expr = 'sum(rate(grammar_svc_no_such_metric_total[5m]))'
    with pytest.raises(AssertionError, match="no data"):
        assert_has_data("bogus panel", expr, prometheus.query(expr))
    with pytest.raises(AssertionError, match="bad_data"):
        assert_has_data("broken panel", "sum(rate(x[5m])", prometheus.query("sum(rate(x[5m])"))


@pytest.mark.parametrize("job", [s.job for s in LIVE])
def test_live_exposition_passes_promtool(prometheus, request, job):
    """After the traffic, so labelled series (by reason, encoding, event) are in the exposition."""
    promtool = require_tool("promtool")
    svc = request.getfixturevalue(next(s.fixture for s in LIVE if s.job == job))
    body = _get(f"http://{svc.metrics_address}/metrics")
    assert b"_bucket{" in body
    out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr).decode()
