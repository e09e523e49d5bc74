"""The kustomize base as a multi-tenant cluster's security review reads it.

The custom resources against the vendored schemas of their CRDs
(k8s/schemas: LeaderWorkerSet, cert-manager Certificate), mutual TLS wired
into every pod (cert-manager Certificates mounted, names that match what each
side dials, one CA), the NetworkPolicies of the inference pods and the
gateway (who may reach which port, and where they may go), the container
hardening beyond tests/test_deploy_k8s.py, the inference tier as a real
tensor-parallel group by default with the one-GPU overlay, and image tags that
agree between kustomize, docker-compose and docs/deploy.md.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib

import jsonschema
import pytest
import yaml

from tests.deploy_assets import (CRD_SCHEMAS, K8S, OVERLAYS, REPO, by_kind, kubectl_kustomize, kustomization,
                                 object_key, one, pod_specs, render, render_overlay, selects)

TLS_MOUNT = "/etc/structd/tls"
SCHEMA_FILES = {"LeaderWorkerSet": "leaderworkerset.x-k8s.io_v1_leaderworkerset.json",
                "Certificate": "cert-manager.io_v1_certificate.json"}


@pytest.fixture(scope="module")
def objs():
    return render()


def _schema(kind: str) -> dict:
    return json.loads((CRD_SCHEMAS / SCHEMA_FILES[kind]).read_text())


def _container(spec: dict) -> dict:
    return spec["containers"][0]


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _arg(container: dict, flag: str) -> str | None:
    return next((a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(flag + "=")), None)


def _pods(objs, app: str) -> list[tuple[str, dict, dict]]:
    return [(w, m, s) for w, m, s in pod_specs(objs) if m["labels"]["app.kubernetes.io/name"] == app]


def _labels(objs, app: str) -> list[dict]:
    return [m["labels"] for _, m, _ in _pods(objs, app)]


# --- custom resources against their CRD schemas ---------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SCHEMA_FILES))
def test_custom_resources_validate_against_their_vendored_schemas(objs, kind):
    found = by_kind(objs, kind)
    assert found, f"no {kind} in the base"
    for o in found:
        try:
            jsonschema.validate(o, _schema(kind))
        except jsonschema.ValidationError as e:
            pytest.fail(f"{kind}/{o['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: {e.message}")


@pytest.mark.parametrize("kind, path, value", [
    pytest.param("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "sizes"), 2, id="lws-misspelt-field"),
    pytest.param("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "Always", id="lws-bad-enum"),
    pytest.param("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "size"), 0, id="lws-empty-group"),
    pytest.param("Certificate", ("spec", "dnsName"), ["x"], id="certificate-misspelt-field"),
    pytest.param("Certificate", ("spec", "usages"), ["server-auth"], id="certificate-bad-usage"),
    pytest.param("Certificate", ("spec", "issuerRef", "nam"), "x", id="certificate-issuer-misspelt"),
])
def test_vendored_schemas_reject_what_the_api_server_would(objs, kind, path, value):
    """The schemas are strict: a misspelt field (the API server would prune it silently) or a bad value fails."""
    bad = copy.deepcopy(by_kind(objs, kind)[0])
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema(kind))


def test_leaderworkerset_pod_templates_are_left_to_the_core_schema():
    """The vendored LWS schema checks the templates' shape only; test_deploy_k8s validates them as core
    PodTemplateSpecs, so both halves of the object are checked."""
    tpl = _schema("LeaderWorkerSet")["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]
    assert tpl["leaderTemplate"]["properties"]["spec"] == {"type": "object"}


# --- mutual TLS --------------------------------------------------------------------------------------------


def _tls_secret(where: str, spec: dict) -> str:
    """The Secret a pod mounts at TLS_MOUNT (read-only, the whole directory: renewals reach the files)."""
    c = _container(spec)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == TLS_MOUNT]
    assert mount.get("readOnly") is True and "subPath" not in mount, where
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] & 0o007 == 0, f"{where}: the key is not world-readable"
    return volume["secret"]["secretName"]


def _certificate_for(objs, secret: str) -> dict:
    (cert,) = [c for c in by_kind(objs, "Certificate") if c["spec"]["secretName"] == secret]
    return cert


def _covers(cert: dict, host: str) -> bool:
    for name in cert["spec"]["dnsNames"]:
        if name == host or (name.startswith("*.") and host.split(".", 1)[-1] == name[2:] and "." in host):
            return True
    return False


def test_every_pod_mounts_a_cert_manager_certificate_and_uses_it(objs):
    for where, _meta, spec in pod_specs(objs):
        cert = _certificate_for(objs, _tls_secret(where, spec))
        c = _container(spec)
        files = {a.split("=", 1)[1] for a in c["args"]
                 if a.startswith("--") and "tls" in a.split("=")[0] and a.split("=")[0].endswith("-file")}
        assert files and all(f.startswith(TLS_MOUNT + "/") for f in files), f"{where}: TLS files from the Secret"
        assert "server auth" in cert["spec"]["usages"], where


def test_one_issuer_signs_every_certificate(objs):
    """Mutual TLS: each side trusts the CA that signed the other, so every certificate has the same issuer;
    the README names it for the cluster to provide."""
    issuers = {json.dumps(c["spec"]["issuerRef"], sort_keys=True) for c in by_kind(objs, "Certificate")}
    assert len(issuers) == 1
    issuer = json.loads(issuers.pop())
    assert f"`{issuer['name']}`" in (K8S / "README.md").read_text(), "k8s/README.md documents the Issuer"
    assert {c["metadata"]["name"] for c in by_kind(objs, "Certificate")} == {
        "structd-grammar", "structd-inference", "structd-gateway"}


def test_each_server_allows_only_its_clients_certificates(objs):
    """Authorisation: the grammar tier serves the inference pods' certificate only, the inference tier the
    gateway's; each allow-list names a SAN of that certificate (and no other tier's)."""
    def allowed(c: dict) -> set[str]:
        return set(_arg(c, "--tls-allowed-clients").split(","))

    grammar = _container(_pods(objs, "structd-grammar")[0][2])
    inference_names = set(_certificate_for(objs, "structd-inference-tls")["spec"]["dnsNames"])
    gateway_names = set(_certificate_for(objs, "structd-gateway-tls")["spec"]["dnsNames"])
    assert allowed(grammar) & inference_names and not allowed(grammar) & gateway_names
    for where, _meta, spec in _pods(objs, "structd-inference"):
        mine = allowed(_container(spec))
        assert mine & gateway_names and not mine & inference_names, where


def test_mutual_tls_on_both_hops(objs):
    """Servers require client certificates; each client presents its own and checks the server's name."""
    grammar = _container(_pods(objs, "structd-grammar")[0][2])
    assert _arg(grammar, "--tls-client-ca-file"), "the grammar tier requires client certificates"
    for where, _meta, spec in _pods(objs, "structd-inference"):
        c = _container(spec)
        assert _arg(c, "--tls-client-ca-file"), f"{where}: the inference tier requires client certificates"
        assert _arg(c, "--grammar-tls-cert-file") == _arg(c, "--tls-cert-file"), \
            f"{where}: its own certificate is its client identity towards the grammar tier"
        grammar_host = _arg(c, "--grammar-target").removeprefix("dns:///").rsplit(":", 1)[0]
        assert _covers(_certificate_for(objs, "structd-grammar-tls"), grammar_host)
        own = _certificate_for(objs, _tls_secret(where, spec))
        assert "client auth" in own["spec"]["usages"], where
    gw_where, _, gw_spec = _pods(objs, "structd-gateway")[0]
    gw = _container(gw_spec)
    assert _arg(gw, "--target-tls-cert-file") and _arg(gw, "--target-tls-ca-file"), gw_where
    target_host = _arg(gw, "--target").removeprefix("dns:///").rsplit(":", 1)[0]
    inference_cert = _certificate_for(objs, "structd-inference-tls")
    assert _covers(inference_cert, target_host), "the gateway checks the name it dials"
    assert _covers(inference_cert, one(objs, "Service", "structd-inference-leader")["metadata"]["name"])
    assert "client auth" in _certificate_for(objs, _tls_secret(gw_where, gw_spec))["spec"]["usages"]


def test_gateway_metrics_are_scraped_over_verified_https(objs):
    (endpoint,) = one(objs, "ServiceMonitor", "structd-gateway")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert "insecureSkipVerify" not in tls
    assert tls["ca"]["secret"] == {"name": "structd-gateway-tls", "key": "ca.crt"}
    assert _covers(_certificate_for(objs, "structd-gateway-tls"), tls["serverName"])


# --- network policies -------------------------------------------------------------------------------------


def _admits(peer: dict, labels: dict, namespace_labels: dict) -> bool:
    """Whether a NetworkPolicy peer admits a pod (its labels, its namespace's labels); pod-only peers are this
    namespace's."""
    assert "ipBlock" not in peer, "no address ranges: peers by label only"
    ns_ok = selects(peer["namespaceSelector"], namespace_labels) if "namespaceSelector" in peer else \
        namespace_labels.get("kubernetes.io/metadata.name") == "structd"
    return ns_ok and selects(peer.get("podSelector", {}), labels)


HERE = {"kubernetes.io/metadata.name": "structd"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
ELSEWHERE = {"kubernetes.io/metadata.name": "tenant-b"}


def _ports_open_to(policy: dict, container: dict, labels: dict, namespace_labels: dict) -> set[int | str]:
    """The ports a pod may reach under a policy's ingress rules ("all": a rule without ports)."""
    out: set[int | str] = set()
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits every source"
        if any(_admits(peer, labels, namespace_labels) for peer in rule["from"]):
            if "ports" not in rule:
                out.add("all")
            for p in rule.get("ports", []):
                out.add(_port(container, p["port"]) if isinstance(p["port"], str) else p["port"])
    return out


def test_inference_network_policy(objs):
    pol = one(objs, "NetworkPolicy", "structd-inference")
    assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    for labels in _labels(objs, "structd-inference"):
        assert selects(pol["spec"]["podSelector"], labels)
    c = _container(_pods(objs, "structd-inference")[0][2])
    grpc, metrics = _port(c, "grpc"), _port(c, "metrics")
    gateway = _labels(objs, "structd-gateway")[0]
    grammar = _labels(objs, "structd-grammar")[0]
    client = {"structd.io/inference-client": "true"}
    opted_in = {**ELSEWHERE, "structd.io/inference-clients": "true"}
    for who, labels, ns, expected in [
        ("the gateway", gateway, HERE, {grpc}),
        ("a labelled client here", client, HERE, {grpc}),
        ("a labelled client in an opted-in namespace", client, opted_in, {grpc}),
        ("a labelled client in another namespace", client, ELSEWHERE, set()),
        ("an unlabelled pod in an opted-in namespace", {"app": "x"}, opted_in, set()),
        ("an unlabelled pod here", {"app": "x"}, HERE, set()),
        ("the grammar tier", grammar, HERE, set()),
        ("the monitoring namespace", {"app": "prometheus"}, MONITORING, {metrics}),
        # torch.distributed (NCCL/gloo use ephemeral ports): only between the inference pods.
        *[("another rank", labels, HERE, {"all"}) for labels in _labels(objs, "structd-inference")],
    ]:
        assert _ports_open_to(pol, c, labels, ns) == expected, who


def test_inference_egress_reaches_only_grammar_its_group_and_dns(objs):
    pol = one(objs, "NetworkPolicy", "structd-inference")
    grammar_port = _port(_container(_pods(objs, "structd-grammar")[0][2]), "grpc")
    reached = []
    for rule in pol["spec"]["egress"]:
        assert rule.get("to"), "an egress rule without `to` reaches everywhere"
        ports = {p["port"] for p in rule.get("ports", [])}
        for peer in rule["to"]:
            if _admits(peer, _labels(objs, "structd-grammar")[0], HERE):
                reached.append("grammar")
                assert ports == {grammar_port}
            elif all(_admits(peer, labels, HERE) for labels in _labels(objs, "structd-inference")):
                reached.append("group")
                assert not _admits(peer, _labels(objs, "structd-gateway")[0], HERE)
            else:
                assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}
                assert ports == {53}
                reached.append("dns")
    assert sorted(reached) == ["dns", "grammar", "group"]


def test_gateway_network_policy(objs):
    pol = one(objs, "NetworkPolicy", "structd-gateway")
    assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert selects(pol["spec"]["podSelector"], _labels(objs, "structd-gateway")[0])
    c = _container(_pods(objs, "structd-gateway")[0][2])
    http = _port(c, "https")
    client = {"structd.io/gateway-client": "true"}
    for who, labels, ns, expected in [
        ("a labelled client here", client, HERE, {http}),
        ("a labelled client in an opted-in namespace", client, {**ELSEWHERE, "structd.io/gateway-clients": "true"},
         {http}),
        ("a labelled client elsewhere", client, ELSEWHERE, set()),
        ("an unlabelled pod here", {"app": "x"}, HERE, set()),
        ("the monitoring namespace", {"app": "prometheus"}, MONITORING, {http}),
    ]:
        assert _ports_open_to(pol, c, labels, ns) == expected, who
    leader = one(objs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    inference_grpc = _port(_container(leader["spec"]), "grpc")
    upstream = [r for r in pol["spec"]["egress"] if any(_admits(p, leader["metadata"]["labels"], HERE) for p in r["to"])]
    assert [[p["port"] for p in r["ports"]] for r in upstream] == [[inference_grpc]]


# --- pods -----------------------------------------------------------------------------------------------------


def test_no_container_gets_host_access_or_capabilities(objs):
    for where, _meta, spec in pod_specs(objs):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), f"{where}: {key}"
        assert all("hostPath" not in v for v in spec.get("volumes", [])), f"{where}: hostPath"
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert not sc.get("privileged") and not sc["capabilities"].get("add"), where
            assert sc.get("seccompProfile", spec["securityContext"]["seccompProfile"])["type"] == "RuntimeDefault"
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True, where


def test_inference_caches_are_writable_and_offline(objs):
    """The image's cache (the embedded model) is read-only: HF_HOME points at a writable emptyDir, and the
    hub is never asked (the model comes from the volume)."""
    for where, _meta, spec in _pods(objs, "structd-inference"):
        c = _container(spec)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HF_HUB_OFFLINE"] == "1", where
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        home = next(path for path in mounts if env["HF_HOME"].startswith(path + "/"))
        assert not mounts[home].get("readOnly"), where
        volume = next(v for v in spec["volumes"] if v["name"] == mounts[home]["name"])
        assert "emptyDir" in volume, where


def test_inference_serves_a_named_model(objs):
    """It loads /models/current: without --served-model-name clients would have to ask for "current"."""
    for where, _meta, spec in _pods(objs, "structd-inference"):
        name = _arg(_container(spec), "--served-model-name")
        assert name and name != "current", where


# --- tensor parallelism ----------------------------------------------------------------------------------------


def _lws_size(objs) -> int:
    return one(objs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]


def test_the_base_runs_a_real_tensor_parallel_group(objs):
    assert _lws_size(objs) == 2, "one replica = a 2-way TP group (2 pods, one GPU each)"
    for where, _meta, spec in _pods(objs, "structd-inference"):
        c = _container(spec)
        assert _arg(c, "--tp") == "$(LWS_GROUP_SIZE)", where
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", f"{where}: one GPU per rank"


def test_one_gpu_overlay():
    objs = render_overlay(OVERLAYS / "tp1")
    assert _lws_size(objs) == 1
    base = render()
    assert len(objs) == len(base), "the overlay changes the group size only"
    rendered = kubectl_kustomize(OVERLAYS / "tp1")
    if rendered is None:
        pytest.skip("kubectl is not installed (optional: the Python rendering is checked without it)")
    assert rendered == sorted(objs, key=object_key)


# --- what the cluster must provide, and which images --------------------------------------------------------


def test_readme_names_the_prerequisites():
    text = (K8S / "README.md").read_text()
    prerequisites = text.split("## ")[0]
    for needed in ("metrics-server", "cert-manager", "LeaderWorkerSet", "NetworkPolicy"):
        assert needed in prerequisites, needed
    assert "metrics-server" in kustomization_comment()


def kustomization_comment() -> str:
    return "\n".join(line for line in (K8S / "kustomization.yaml").read_text().splitlines() if line.startswith("#"))


def test_image_tags_agree_between_kustomize_compose_and_deploy_docs():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert {i["name"]: i["newTag"] for i in kustomization()["images"]} == {
        "structd-grammar": version, "structd-inference": version, "structd-gateway": version}
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    # Compose builds the inference image with CPU torch: the same version, marked.
    expected = {"grammar": f"structd-grammar:{version}", "inference": f"structd-inference:{version}-cpu",
                "gateway": f"structd-gateway:{version}"}
    assert {name: compose[name]["image"] for name in expected} == expected
    deploy_docs = (REPO / "docs" / "deploy.md").read_text()
    for image in [*expected.values(), f"structd-inference:{version}"]:
        assert re.search(rf"`{re.escape(image)}`", deploy_docs), f"docs/deploy.md does not name {image}"
