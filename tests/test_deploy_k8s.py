"""The kustomize base in k8s/: core kinds against the Kubernetes OpenAPI
schemas (kubernetes-validate, offline, strict), the custom resources
(LeaderWorkerSet, ServiceMonitor, PodMonitor, PrometheusRule) structurally,
and the wiring between objects: selectors, named ports, probes, the
NetworkPolicy, security contexts, and container args parsed by the real
`structd` command line.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tomllib

import pytest
import yaml

from tests.deploy_assets import (CUSTOM_KINDS, K8S, OVERLAYS, REPO, RULES_FILE, by_kind, kubectl_kustomize,
                                 kustomization, load_yaml_docs, object_key, one, pod_specs, render, render_namespace,
                                 selects)

# Where every pod mounts its cert-manager Secret (tls.crt, tls.key, ca.crt).
TLS_MOUNT = "/etc/structd/tls"
# Seconds a process needs to exit after its drain, within terminationGracePeriodSeconds.
GRACE_MARGIN_SECONDS = 5
# Oldest Kubernetes the base supports (grpc probes GA in 1.27, LWS needs >= 1.26) and the newest schemas shipped.
K8S_VERSIONS = ("1.29.0", "1.37.0")
NAMESPACE = "structd"


@pytest.fixture(scope="module")
def objs():
    return render()


def _container(spec: dict, name: str | None = None) -> dict:
    cs = spec["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _lws(objs):
    return one(objs, "LeaderWorkerSet", "structd-inference")


def _lws_template(objs, role: str) -> dict:
    return _lws(objs)["spec"]["leaderWorkerTemplate"][role]


# --- the kustomization itself ------------------------------------------------------------


def test_every_manifest_is_listed_and_every_listed_file_exists():
    k = kustomization()
    listed = set(k["resources"])
    for rel in listed:
        assert (K8S / rel).is_file(), rel
    manifests = {str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests == listed, f"manifests not in kustomization.yaml: {sorted(manifests - listed)}"
    for g in k["configMapGenerator"]:
        for spec in g["files"]:
            assert (K8S / spec.rpartition("=")[2]).is_file(), spec


def test_everything_lands_in_the_namespace(objs):
    assert kustomization()["namespace"] == NAMESPACE
    for o in objs:
        assert o["metadata"]["namespace"] == NAMESPACE, object_key(o)


def test_the_namespace_is_not_in_the_base_so_delete_k_leaves_it(objs):
    """`kubectl delete -k k8s/` deletes what the base renders: a Namespace there would take everything else in
    it along. It has its own kustomization, applied once before the base."""
    assert not by_kind(objs, "Namespace")
    (ns,) = render_namespace()
    assert (ns["kind"], ns["metadata"]["name"]) == ("Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    rendered = kubectl_kustomize(OVERLAYS / "namespace")
    if rendered is not None:
        assert rendered == [ns]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_namespace_validates_against_kubernetes_schemas(version):
    import kubernetes_validate

    for o in render_namespace():
        kubernetes_validate.validate(o, version, strict=True)


RECOMMENDED_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/version")


def _selectors(node):
    """Every label selector in an object (workload, Service, PDB, NetworkPolicy, monitor, HPA target...)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("selector", "podSelector", "namespaceSelector") and isinstance(value, dict):
                yield value
            yield from _selectors(value)
    elif isinstance(node, list):
        for v in node:
            yield from _selectors(v)


def test_instance_and_version_labels_on_every_object_and_pod_but_in_no_selector(objs):
    """app.kubernetes.io/instance and /version (Kubernetes' recommended labels) on every object of the base and of
    the namespace kustomization and on every pod template; never in a selector, which cannot change once created
    (the version changes with each release). version is the package version."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    expected = {"app.kubernetes.io/instance": "structd", "app.kubernetes.io/version": version}
    (entry,) = kustomization()["labels"]
    assert entry["pairs"] == expected and entry["includeTemplates"] and not entry.get("includeSelectors")
    for o in [*objs, *render_namespace()]:
        labels = o["metadata"]["labels"]
        assert {k: labels.get(k) for k in expected} == expected, object_key(o)
    for where, meta, _ in pod_specs(objs):
        assert {k: meta["labels"].get(k) for k in expected} == expected, where
    for o in objs:
        for sel in _selectors(o):
            text = repr(sel)
            assert not any(label in text for label in RECOMMENDED_LABELS), f"{object_key(o)} selects by {sel}"


def test_names_are_unique_per_kind(objs):
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys))


# --- schemas --------------------------------------------------------------------------------


def _core(objs):
    return [o for o in objs if o["kind"] not in CUSTOM_KINDS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_kinds_validate_against_kubernetes_schemas(objs, version):
    import kubernetes_validate

    kinds = set()
    for o in _core(objs):
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            pytest.fail(f"{o['kind']}/{o['metadata']['name']} (k8s {version}): {path}: {e.message}")
        kinds.add(o["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_leaderworkerset_pod_templates_validate_as_pod_templates(objs, version):
    """The LWS CRD embeds core PodTemplateSpecs: check them with the core schema."""
    import kubernetes_validate

    for role in ("leaderTemplate", "workerTemplate"):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"lws-{role.lower()}", "namespace": NAMESPACE},
                   "template": copy.deepcopy(_lws_template(objs, role))}
        try:
            kubernetes_validate.validate(wrapped, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"LeaderWorkerSet {role} (k8s {version}): {'/'.join(map(str, e.path))}: {e.message}")


def test_kubernetes_validate_rejects_a_broken_manifest(objs):
    """The validator is strict: an unknown field is an error, not a silent pass."""
    import kubernetes_validate

    bad = copy.deepcopy(one(objs, "Deployment", "structd-grammar"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# --- grammar tier ---------------------------------------------------------------------------


def test_grammar_deployment_service_hpa_pdb_fit_together(objs):
    dep = one(objs, "Deployment", "structd-grammar")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"], pod_labels)
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    c = _container(dep["spec"]["template"]["spec"])
    assert c["image"].startswith("structd-grammar:")

    svc = one(objs, "Service", "structd-grammar")
    assert svc["spec"]["clusterIP"] == "None", "headless: clients balance per stream over DNS"
    assert selects(svc["spec"]["selector"], pod_labels)
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"}
    for name, p in ports.items():
        assert p["targetPort"] == name and p["port"] == _port(c, name)

    hpa = one(objs, "HorizontalPodAutoscaler", "structd-grammar")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "structd-grammar")
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "cpu" in c["resources"]["requests"], "CPU utilization targets need a CPU request"

    pdb = one(objs, "PodDisruptionBudget", "structd-grammar")
    assert selects(pdb["spec"]["selector"], pod_labels)
    budget = pdb["spec"]
    assert budget.get("maxUnavailable", 0) >= 1 or budget.get("minAvailable", 1 << 30) < hpa["spec"]["minReplicas"], \
        "the PDB must still allow a drain"


def test_grpc_probes_everywhere(objs):
    """On the plaintext health port (--health-port): the gRPC port requires a client certificate, which
    the kubelet's probes do not present."""
    for where, _meta, spec in pod_specs(objs):
        for c in spec["containers"]:
            if c["name"] == "gateway":
                continue  # HTTP: test_gateway_probes
            health_port = _port(c, "health")
            assert f"--health-port={health_port}" in c["args"], where
            assert health_port != _port(c, "grpc")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == health_port, f"{where}: {probe} must be a grpc probe"
            assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120, \
                f"{where}: start-up (model load, preload) needs minutes before liveness applies"


def test_network_policy_lets_only_inference_leaders_reach_the_grammar_tier(objs):
    pol = one(objs, "NetworkPolicy", "structd-grammar")
    spec = pol["spec"]
    grammar_pods = one(objs, "Deployment", "structd-grammar")["spec"]["template"]["metadata"]["labels"]
    grammar_container = _container(one(objs, "Deployment", "structd-grammar")["spec"]["template"]["spec"])
    assert selects(spec["podSelector"], grammar_pods)
    assert "Ingress" in spec["policyTypes"]
    # Only rank 0 dials the grammar tier.
    leaders = [_lws_template(objs, "leaderTemplate")["metadata"]["labels"]]
    workers = [_lws_template(objs, "workerTemplate")["metadata"]["labels"]]
    assert not selects(spec["podSelector"], leaders[0])

    grpc_rules = []
    for rule in spec["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits every source"
        ports = rule.get("ports")
        assert ports, "an ingress rule without ports opens every port"
        port_numbers = {_port(grammar_container, p["port"]) if isinstance(p["port"], str) else p["port"]
                        for p in ports}
        if _port(grammar_container, "grpc") in port_numbers:
            grpc_rules.append(rule)
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, "gRPC only from pods in this namespace, no ipBlock/namespace"
                assert all(selects(peer["podSelector"], labels) for labels in leaders)
                assert not any(selects(peer["podSelector"], labels) for labels in workers + [grammar_pods])
        else:
            assert port_numbers == {_port(grammar_container, "metrics")}, "only /metrics besides gRPC"
    assert grpc_rules, "no rule admits the inference pods"
    assert "Egress" in spec["policyTypes"] and spec["egress"] == [], "a grammar replica calls nothing"


def test_grammar_env_names_config_fields(objs):
    from grammar_svc.config import ENV_PREFIX, GrammarServiceConfig

    fields = {f.name for f in dataclasses.fields(GrammarServiceConfig)}
    c = _container(one(objs, "Deployment", "structd-grammar")["spec"]["template"]["spec"])
    for e in c.get("env", []):
        if e["name"].startswith(ENV_PREFIX):
            assert e["name"][len(ENV_PREFIX):].lower() in fields, f"{e['name']} configures nothing"


# --- gateway ----------------------------------------------------------------------------------


def _gateway(objs) -> tuple[dict, dict]:
    dep = one(objs, "Deployment", "structd-gateway")
    return dep, _container(dep["spec"]["template"]["spec"])


def test_gateway_deployment_service_hpa_pdb_fit_together(objs):
    dep, c = _gateway(objs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"], pod_labels)
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    assert c["image"].startswith("structd-gateway:")
    svc = one(objs, "Service", "structd-gateway")
    assert selects(svc["spec"]["selector"], pod_labels)
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == "https" and port["port"] == _port(c, "https")
    hpa = one(objs, "HorizontalPodAutoscaler", "structd-gateway")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "structd-gateway")
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "cpu" in c["resources"]["requests"], "CPU utilization targets need a CPU request"
    pdb = one(objs, "PodDisruptionBudget", "structd-gateway")
    assert selects(pdb["spec"]["selector"], pod_labels) and pdb["spec"]["maxUnavailable"] >= 1


def test_gateway_probes(objs):
    """Ready while the inference service serves (/health); alive while the gateway itself answers (/metrics),
    so an inference outage does not restart every gateway."""
    _, c = _gateway(objs)
    probes = {p: c[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(g["port"] == "https" and g["scheme"] == "HTTPS" for g in probes.values())
    assert probes["readinessProbe"]["path"] == "/health"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/metrics"


def test_gateway_balances_over_the_inference_leaders(objs):
    """It dials a headless Service of the leaders (dns:///, round_robin per request), not the ClusterIP."""
    _, c = _gateway(objs)
    target = next(a for a in c["args"] if a.startswith("--target=")).split("=", 1)[1]
    name, _, port = target.removeprefix("dns:///").partition(":")
    assert target.startswith("dns:///")
    svc = one(objs, "Service", name)
    assert svc["spec"]["clusterIP"] == "None"
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    leader = _lws_template(objs, "leaderTemplate")
    assert selects(svc["spec"]["selector"], leader["metadata"]["labels"])
    assert not selects(svc["spec"]["selector"], _lws_template(objs, "workerTemplate")["metadata"]["labels"])
    assert int(port) == _port(_container(leader["spec"], "inference"), "grpc")


def test_service_monitor_scrapes_the_gateway(objs):
    sm = one(objs, "ServiceMonitor", "structd-gateway")
    svc = one(objs, "Service", "structd-gateway")
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert not selects(sm["spec"]["selector"], one(objs, "Service", "structd-grammar")["metadata"]["labels"])
    assert [(e["port"], e.get("path", "/metrics")) for e in sm["spec"]["endpoints"]] == [("https", "/metrics")]


def test_gateway_ports_are_named_for_the_https_they_serve(objs):
    """The gateway serves HTTPS only: a port named http (or no appProtocol) makes ingress controllers and meshes
    that go by the name speak plaintext to it."""
    _, c = _gateway(objs)
    assert [p["name"] for p in c["ports"]] == ["https"]
    (port,) = one(objs, "Service", "structd-gateway")["spec"]["ports"]
    assert (port["name"], port["appProtocol"], port["targetPort"]) == ("https", "https", "https")
    assert one(objs, "ServiceMonitor", "structd-gateway")["spec"]["endpoints"][0]["scheme"] == "https"


# --- inference tier -------------------------------------------------------------------------


# Fields of the LeaderWorkerSet v1 API (leaderworkerset_types.go): a misspelt
# field would be pruned by the API server without a word.
LWS_SPEC_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                       "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
LWS_ROLLING_UPDATE_FIELDS = {"partition", "maxUnavailable", "maxSurge"}


def test_leaderworkerset_structure(objs):
    lws = _lws(objs)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert set(lws["spec"]) <= LWS_SPEC_FIELDS
    assert lws["spec"].get("startupPolicy", "LeaderCreated") in {"LeaderCreated", "LeaderReady"}
    rollout = lws["spec"].get("rolloutStrategy", {})
    assert rollout.get("type", "RollingUpdate") == "RollingUpdate"
    assert set(rollout.get("rollingUpdateConfiguration", {})) <= LWS_ROLLING_UPDATE_FIELDS
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert set(lwt) <= LWS_TEMPLATE_FIELDS
    assert isinstance(lwt["size"], int) and lwt["size"] >= 1
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert isinstance(lws["spec"]["replicas"], int) and lws["spec"]["replicas"] >= 1
    roles = {}
    for role in ("leaderTemplate", "workerTemplate"):
        t = lwt[role]
        roles[role] = t["metadata"]["labels"]["structd.io/role"]
        spec = t["spec"]
        c = _container(spec, "inference")
        assert c["image"].startswith("structd-inference:")
        res = c["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) >= 1, role
        assert res["requests"].get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"]) == res["limits"]["nvidia.com/gpu"]

        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory", f"{role}: /dev/shm must be a memory emptyDir"
        models = volumes[mounts["/models"]["name"]]
        assert "persistentVolumeClaim" in models and mounts["/models"]["readOnly"] is True
        args = c["args"]
        model_arg = next(a for a in args if a.startswith("--model="))
        assert model_arg.split("=", 1)[1].startswith("/models/"), "the model comes from the volume"

        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["RANK"] == "$(LWS_WORKER_INDEX)"
        assert env["WORLD_SIZE"] == "$(LWS_GROUP_SIZE)"
        assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"
        assert "--tp=$(LWS_GROUP_SIZE)" in args, "TP degree follows the group size"
    assert roles == {"leaderTemplate": "leader", "workerTemplate": "worker"}


def test_models_claim_exists(objs):
    for where, _meta, spec in pod_specs(objs):
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                one(objs, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])


def test_leader_service_selects_leaders_only(objs):
    svc = one(objs, "Service", "structd-inference-leader")
    leader = _lws_template(objs, "leaderTemplate")
    worker = _lws_template(objs, "workerTemplate")
    assert selects(svc["spec"]["selector"], leader["metadata"]["labels"])
    assert not selects(svc["spec"]["selector"], worker["metadata"]["labels"])
    c = _container(leader["spec"], "inference")
    for p in svc["spec"]["ports"]:
        assert p["port"] == _port(c, p["targetPort"])
    # The LWS controller creates a headless Service named after the LWS itself.
    assert svc["metadata"]["name"] != _lws(objs)["metadata"]["name"]


def test_inference_reaches_the_grammar_service_by_dns(objs):
    grammar_svc = one(objs, "Service", "structd-grammar")
    grpc_port = next(p["port"] for p in grammar_svc["spec"]["ports"] if p["name"] == "grpc")
    for role in ("leaderTemplate", "workerTemplate"):
        args = _container(_lws_template(objs, role)["spec"], "inference")["args"]
        target = next(a for a in args if a.startswith("--grammar-target=")).split("=", 1)[1]
        assert target == f"dns:///{grammar_svc['metadata']['name']}:{grpc_port}"


# --- pods in general --------------------------------------------------------------------------


def _dockerfile_user(path) -> str:
    users = re.findall(r"^USER\s+(\S+)", path.read_text(), re.M)
    return users[-1].split(":")[0]


def test_pods_run_non_root_with_read_only_root_filesystems(objs):
    image_user = {"structd-grammar": _dockerfile_user(REPO / "grammar_svc" / "Dockerfile"),
                  "structd-inference": _dockerfile_user(REPO / "inference_svc" / "Dockerfile"),
                  "structd-gateway": _dockerfile_user(REPO / "gateway" / "Dockerfile")}
    for where, _meta, spec in pod_specs(objs):
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, where
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, f"{where}: no API access needed"
        writable = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])
                    if not m.get("readOnly")}
        assert "/tmp" in writable, f"{where}: a read-only root filesystem needs a writable /tmp (HOME)"
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "memory" in c["resources"]["limits"], f"{where}: unbounded memory"
            image = c["image"].split(":")[0]
            assert str(psc["runAsUser"]) == image_user[image], f"{where}: runAsUser differs from the image's USER"


def test_container_args_parse_with_the_real_cli(objs, tmp_path):
    """Each container's ENTRYPOINT + args, as `structd` parses and validates them.
    $(VAR) stands for what Kubernetes substitutes; the model path exists only in the cluster, and the
    mounted certificate Secret is stood in for by a throwaway CA's files (the services check them at start)."""
    from tests.tls_material import Authority

    ca = Authority(tmp_path, "structd")
    pod = ca.issue("pod")
    secret_files = {f"{TLS_MOUNT}/tls.crt": str(pod.cert_file), f"{TLS_MOUNT}/tls.key": str(pod.key_file),
                    f"{TLS_MOUNT}/ca.crt": str(ca.cert_file)}
    from gateway import config as gwconfig
    from grammar_svc import config as gconfig
    from inference_svc import config as iconfig
    from structd.cli import build_parser

    lws_env = {"LWS_GROUP_SIZE": str(_lws(objs)["spec"]["leaderWorkerTemplate"]["size"]),
               "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "structd-inference-0.structd-inference"}

    def expand(s: str) -> str:
        s = re.sub(r"\$\((\w+)\)", lambda m: lws_env[m.group(1)], s)
        return re.sub(f"{re.escape(TLS_MOUNT)}/[a-z.]+", lambda m: secret_files[m.group(0)], s)

    def entrypoint(dockerfile) -> list[str]:
        return yaml.safe_load(re.search(r"^ENTRYPOINT\s+(\[.*\])", dockerfile.read_text(), re.M).group(1))

    for where, _meta, spec in pod_specs(objs):
        c = spec["containers"][0]
        env = {e["name"]: expand(e["value"]) for e in c.get("env", []) if "value" in e}
        service = c["image"].split(":")[0].removeprefix("structd-")
        argv = entrypoint(REPO / ("gateway" if service == "gateway" else f"{service}_svc") / "Dockerfile")
        assert argv[:2] == ["structd", service]
        args = build_parser(env).parse_args(argv[1:] + [expand(a) for a in c.get("args", [])])
        if service == "gateway":
            cfg = gwconfig.from_args(args)
            assert (cfg.host, cfg.port) == ("0.0.0.0", _port(c, "https")), where
            assert cfg.tls is not None and cfg.target_tls is not None and cfg.target_tls.cert_file, \
                f"{where}: HTTPS, and a client certificate towards the inference tier"
        elif service == "grammar":
            cfg = gconfig.from_args(args)
            assert cfg.host == "0.0.0.0", where
            assert (cfg.port, cfg.metrics_port) == (_port(c, "grpc"), _port(c, "metrics")), where
            assert cfg.tls is not None and cfg.tls.client_ca_file, f"{where}: mutual TLS"
        else:
            args.model = None
            cfg = iconfig.from_args(args)
            assert cfg.host == "0.0.0.0", where
            assert (cfg.port, cfg.metrics_port) == (_port(c, "grpc"), _port(c, "metrics")), where
            assert cfg.device == "cuda"
            assert cfg.tls is not None and cfg.tls.client_ca_file, f"{where}: mutual TLS towards clients"
            assert cfg.grammar_tls is not None and cfg.grammar_tls.cert_file, f"{where}: mutual TLS to the grammar tier"
        # The drain fits the pod's grace period: preStop, then --grace-seconds, then a margin to exit.
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1]) if "lifecycle" in c else 0
        assert pre_stop + cfg.grace_seconds + GRACE_MARGIN_SECONDS <= spec["terminationGracePeriodSeconds"], where
        assert "--grace-seconds" in " ".join(c["args"]), f"{where}: the drain grace is passed explicitly"


# --- monitoring -------------------------------------------------------------------------------


# Fields of prometheus-operator's monitoring.coreos.com/v1 monitors used or likely here.
MONITOR_SPEC_FIELDS = {"selector", "namespaceSelector", "endpoints", "podMetricsEndpoints", "jobLabel",
                       "targetLabels", "podTargetLabels", "sampleLimit", "attachMetadata"}
ENDPOINT_FIELDS = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                   "relabelings", "metricRelabelings", "params", "tlsConfig"}


def test_monitor_fields_are_known(objs):
    for kind, endpoints in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        for m in by_kind(objs, kind):
            assert set(m["spec"]) <= MONITOR_SPEC_FIELDS, m["metadata"]["name"]
            for e in m["spec"][endpoints]:
                assert set(e) <= ENDPOINT_FIELDS, e


def test_service_monitor_scrapes_the_grammar_metrics_port(objs):
    sm = one(objs, "ServiceMonitor", "structd-grammar")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = one(objs, "Service", "structd-grammar")
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert not selects(sm["spec"]["selector"], one(objs, "Service", "structd-inference-leader")["metadata"]["labels"])
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in svc_ports
    for e in sm["spec"]["endpoints"]:
        assert e.get("path", "/metrics") == "/metrics"


def test_pod_monitor_scrapes_the_inference_leaders(objs):
    pm = one(objs, "PodMonitor", "structd-inference")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    leader = _lws_template(objs, "leaderTemplate")
    assert selects(pm["spec"]["selector"], leader["metadata"]["labels"])
    assert not selects(pm["spec"]["selector"], _lws_template(objs, "workerTemplate")["metadata"]["labels"])
    c = _container(leader["spec"], "inference")
    for e in pm["spec"]["podMetricsEndpoints"]:
        assert e["port"] == "metrics" and _port(c, "metrics")


def test_alert_rule_job_selectors_match_the_monitors_job_labels(objs):
    """A ServiceMonitor's job label is the Service name; a PodMonitor's is namespace/name."""
    jobs = {"grammar": one(objs, "Service", "structd-grammar")["metadata"]["name"],
            "inference": f"{NAMESPACE}/{one(objs, 'PodMonitor')['metadata']['name']}",
            "gateway": one(objs, "Service", "structd-gateway")["metadata"]["name"]}
    text = RULES_FILE.read_text()
    patterns = set(re.findall(r'job=~"([^"]+)"', text))
    assert patterns
    for pattern in patterns:
        assert any(re.fullmatch(pattern, j) for j in jobs.values()), f"job=~{pattern!r} matches no monitor's job"
    for kind, job in jobs.items():
        assert any(re.fullmatch(p, job) for p in patterns), f"no alert watches the {kind} job {job!r}"


# --- generated config maps -------------------------------------------------------------------


def test_config_maps_are_generated_from_the_same_files(objs):
    dash = one(objs, "ConfigMap", "structd-grafana-dashboards")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash_dir = K8S / "observability" / "dashboards"
    assert dash["data"] == {p.name: p.read_text() for p in sorted(dash_dir.glob("*.json"))}
    rules = one(objs, "ConfigMap", "structd-alert-rules")
    assert list(rules["data"].values()) == [RULES_FILE.read_text()]
    ds = one(objs, "ConfigMap", "structd-grafana-datasource")
    assert ds["metadata"]["labels"]["grafana_datasource"] == "1"


def test_prometheus_rule_is_the_rule_file(objs):
    pr = one(objs, "PrometheusRule", "structd")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"], \
        "k8s/observability/prometheusrule.yaml is stale: copy alerts.rules.yml's groups into it"


def test_kubectl_kustomize_renders_what_the_tests_check(objs):
    """Where kubectl is installed (its kustomize is the reference), the base renders to exactly the objects
    checked above."""
    rendered = kubectl_kustomize(K8S)
    if rendered is None:
        pytest.skip("kubectl is not installed (optional: the Python rendering is checked without it)")
    assert rendered == sorted(objs, key=object_key)


def test_manifests_parse_as_single_objects():
    for p in K8S.rglob("*.yaml"):
        if p.name != "kustomization.yaml":
            assert len(load_yaml_docs(p)) == 1, f"{p}: one object per file keeps kustomization.yaml the index"
    assert not by_kind(render(), "Secret"), "no secrets in the base"
