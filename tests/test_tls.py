"""TLS and mutual TLS on every hop, over real gRPC on loopback with a throwaway CA.

Both hops (client -> inference service, inference service -> grammar
replica) refuse a client without a certificate, with one from another CA,
with an expired one, and a plaintext client, and serve the right one. The
grammar replica's certificate is rotated (its files rewritten) under a live
Step stream: the stream and the inference service's own stream stay up while
new connections get the new certificate; so are the inference service's own
certificate and client CA (new handshakes get the new ones, without a
restart), and the inference service's and the gateway's client
certificates, which new calls then present. `structd generate`, the gateway and
`structd up` speak TLS with their flags; the plaintext health port answers
health only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from shared.gen.grammar.v1 import grammar_service_pb2 as gpb
from shared.grammar_client import GrammarClient
from shared.inference_client import InferenceClient, InferenceError
from shared.ports import free_ports
from shared.tls import ClientTls, ServerTls, sync_channel
from structd import generate
from structd.bench.harness import ServiceThread, free_port
from tests.conftest import REPO, InferenceServerThread, run, start_grammar_server, wait_until
from tests.test_cli import PYTHON, Proc, children_of, clean_env, running
from tests.tls_material import Authority, Issued

SERVING = health_pb2.HealthCheckResponse.SERVING
GRAMMAR_SERVICE = "grammar.v1.GrammarService"
INFERENCE_SERVICE = "inference.v1.InferenceService"


class Pki:
    """The test session's CAs and certificates (files under one temporary directory)."""

    def __init__(self, directory: Path):
        self.ca = Authority(directory, "main")
        self.other_ca = Authority(directory, "other")
        self.server = self.ca.issue("server")
        self.rotated_server = self.ca.issue("server-rotated")
        self.client = self.ca.issue("client", server=False)
        self.rotated_client = self.ca.issue("client-rotated", server=False)
        self.foreign_client = self.other_ca.issue("foreign-client", server=False)
        self.expired_client = self.ca.issue("expired-client", server=False, expired=True)
        # From the main CA too, under other names: what an allow-list (--tls-allowed-clients) tells apart.
        self.other_client = self.ca.issue("other-client", server=False)
        self.gateway = self.ca.issue("gateway", server=False)

    def client_tls(self, issued: Issued | None) -> ClientTls:
        """Trusts the main CA; presents `issued` (None: no certificate)."""
        if issued is None:
            return ClientTls(ca_file=self.ca.cert_file)
        return ClientTls(self.ca.cert_file, issued.cert_file, issued.key_file)

    def server_tls(self, issued: Issued | None = None) -> ServerTls:
        issued = issued or self.server
        return ServerTls(issued.cert_file, issued.key_file, self.ca.cert_file)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


# Who knocks, and what it presents: every one but the right one must be refused.
REFUSED = [
    pytest.param("plaintext", id="plaintext"),
    pytest.param(None, id="no-certificate"),
    pytest.param("foreign_client", id="certificate-from-another-ca"),
    pytest.param("expired_client", id="expired-certificate"),
]


def _tls_for(pki: Pki, who: str | None) -> ClientTls | None:
    if who == "plaintext":
        return None
    return pki.client_tls(getattr(pki, who) if who else None)


def health(target: str, tls: ClientTls | None, service: str = "") -> int:
    """The health status, or raises grpc.RpcError (a refused handshake is UNAVAILABLE)."""
    with sync_channel(target, tls) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def served_certificate(port: int, pki: Pki) -> bytes:
    """The DER certificate a new TLS connection to the port is served (the handshake presents a client cert)."""
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert_file))
    ctx.load_cert_chain(pki.client.cert_file, pki.client.key_file)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


# ---------------------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def live_cert(pki, tmp_path_factory) -> Issued:
    """The grammar replica's certificate files, which the rotation test rewrites."""
    return _live_copy(pki.server, tmp_path_factory.mktemp("grammar-cert"))


@pytest.fixture(scope="module")
def tls_grammar(pki, live_cert):
    srv = start_grammar_server(compile_workers=1, fill_threads=1, tls=pki.server_tls(live_cert),
                               health_port=free_port())
    yield srv
    srv.stop()


def _live_copy(issued: Issued, directory: Path) -> Issued:
    directory.mkdir(parents=True, exist_ok=True)
    live = Issued(directory / "tls.crt", directory / "tls.key")
    issued.copy_to(live.cert_file, live.key_file)
    return live


@pytest.fixture(scope="module")
def grammar_client_cert(pki, tmp_path_factory) -> Issued:
    """The inference service's client certificate files for the grammar hop, which a rotation test rewrites."""
    return _live_copy(pki.client, tmp_path_factory.mktemp("inference-client-cert"))


@pytest.fixture(scope="module")
def inference_cert(pki, tmp_path_factory) -> Issued:
    """The inference service's own certificate files, which a rotation test rewrites."""
    return _live_copy(pki.server, tmp_path_factory.mktemp("inference-cert"))


@pytest.fixture(scope="module")
def inference_client_ca(pki, tmp_path_factory) -> Path:
    """The inference service's client CA file, which a rotation test rewrites."""
    path = tmp_path_factory.mktemp("inference-client-ca") / "ca.crt"
    path.write_bytes(pki.ca.cert_file.read_bytes())
    return path


@pytest.fixture(scope="module")
def tls_inference(pki, tls_grammar, grammar_client_cert, inference_cert, inference_client_ca):
    """The inference service (simulated runner) over mutual TLS, dialling the grammar replica over mutual TLS."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(tls_grammar.target,), simulate_step_ms=1.0,
        grace_seconds=1.0, tls=ServerTls(inference_cert.cert_file, inference_cert.key_file, inference_client_ca),
        grammar_tls=pki.client_tls(grammar_client_cert),
        engine=EngineConfig(max_num_seqs=4, default_max_tokens=16))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


# ---------------------------------------------------------------------------------------------- both hops


@pytest.mark.parametrize("who", REFUSED)
def test_grammar_hop_refuses_the_wrong_client(pki, tls_grammar, who):
    with pytest.raises(grpc.RpcError) as refused:
        health(tls_grammar.target, _tls_for(pki, who))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", REFUSED)
def test_inference_hop_refuses_the_wrong_client(pki, tls_inference, who):
    tls = _tls_for(pki, who)
    files = {} if tls is None else {"tls_ca_file": tls.ca_file, "tls_cert_file": tls.cert_file,
                                    "tls_key_file": tls.key_file}
    with InferenceClient(tls_inference.target, **files) as client, pytest.raises(InferenceError) as refused:
        client.complete("A colour:", choice=["red", "green"], timeout=30)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_both_hops_serve_the_right_client(pki, tls_grammar, tls_inference):
    """The inference service reached the grammar replica with its client certificate (it is SERVING, and the
    constraint is the grammar tier's), and answers a client with the right certificate."""
    assert health(tls_grammar.target, pki.client_tls(pki.client), GRAMMAR_SERVICE) == SERVING
    with InferenceClient(tls_inference.target, tls_ca_file=pki.ca.cert_file, tls_cert_file=pki.client.cert_file,
                         tls_key_file=pki.client.key_file) as client:
        done = client.complete("A colour:", choice=["red", "green"], timeout=60)
    assert done.text in ("red", "green") and done.finish_reason == "stop"


def test_client_credentials_object(pki, tls_inference):
    creds = grpc.ssl_channel_credentials(pki.ca.cert_file.read_bytes(), pki.client.key_file.read_bytes(),
                                         pki.client.cert_file.read_bytes())
    with InferenceClient(tls_inference.target, credentials=creds) as client:
        assert client.complete("Yes?", choice=["yes"], timeout=60).text == "yes"


# ---------------------------------------------------------------------------------------------- rotation


def test_rotation_keeps_live_streams_and_serves_the_new_certificate(pki, tls_grammar, tls_inference, live_cert,
                                                                  tokenizer_desc):
    tier = tls_inference.server.grammar
    streams_before = {r.id: r.stream for r in tier._replicas.values() if r.stream is not None}
    assert streams_before, "the inference service has a step stream open to the grammar replica"
    port = tls_grammar.server.port
    assert served_certificate(port, pki) == pki.server.der

    async def rotate_under_a_live_stream() -> None:
        client = GrammarClient(tls_grammar.target, tls=pki.client_tls(pki.client))
        try:
            await client.register_tokenizer(tokenizer_desc)
            grammar = await client.compile(tokenizer_desc.fingerprint, gpb.GrammarSpec(regex="[ab]{4}"))
            stream = client.open_stream(tokenizer_desc.vocab_size)
            first = await stream.step([gpb.SessionStep(session_id=1, open=gpb.OpenSession(
                grammar_id=grammar.grammar_id))])
            assert first.results[0].status == gpb.SESSION_STATUS_OK
            pki.rotated_server.copy_to(live_cert.cert_file, live_cert.key_file)
            # A new connection (here, the next handshake) gets the new certificate ...
            assert await asyncio.to_thread(served_certificate, port, pki) == pki.rotated_server.der
            # ... while the stream opened before goes on, on its connection.
            second = await stream.step([gpb.SessionStep(session_id=2, open=gpb.OpenSession(
                grammar_id=grammar.grammar_id))])
            assert second.results[0].status == gpb.SESSION_STATUS_OK
            await stream.close()
        finally:
            await client.close()

    run(rotate_under_a_live_stream())
    # The inference service's own stream to the replica is the one it had, still open, and still serves.
    streams_after = {r.id: r.stream for r in tier._replicas.values() if r.stream is not None}
    assert streams_after == streams_before
    with InferenceClient(tls_inference.target, tls_ca_file=pki.ca.cert_file, tls_cert_file=pki.client.cert_file,
                         tls_key_file=pki.client.key_file) as client:
        assert client.complete("Letters:", regex="[ab]{3}", timeout=60).finish_reason == "stop"
    assert {r.id: r.stream for r in tier._replicas.values() if r.stream is not None} == streams_before
    # A client that trusts the CA still connects anew: the new certificate is valid.
    assert health(tls_grammar.target, pki.client_tls(pki.client), GRAMMAR_SERVICE) == SERVING


def test_rotated_client_certificate_is_presented_by_new_calls_only(pki, tls_inference, grammar_client_cert):
    """The inference service's client certificate rotates: new calls to the grammar replica present the new
    one (a certificate the replica refuses is refused), the step stream opened before stays up throughout."""
    tier = tls_inference.server.grammar
    replica = next(r for r in tier._replicas.values() if r.stream is not None)
    stream = replica.stream

    async def compile_after_rotation():
        await tier.connect()  # what the tier's maintenance does every few seconds: notices the new files
        return await replica.client.compile(tier.tokenizer.fingerprint, gpb.GrammarSpec(regex="[ab]{5}"),
                                            rpc_timeout=30)

    pki.foreign_client.copy_to(grammar_client_cert.cert_file, grammar_client_cert.key_file)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            tls_inference.call(compile_after_rotation())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert replica.stream is stream
    finally:
        pki.rotated_client.copy_to(grammar_client_cert.cert_file, grammar_client_cert.key_file)
    assert tls_inference.call(compile_after_rotation()).grammar_id
    with InferenceClient(tls_inference.target, tls_ca_file=pki.ca.cert_file, tls_cert_file=pki.client.cert_file,
                         tls_key_file=pki.client.key_file) as client:
        assert client.complete("Letters:", regex="[ab]{2}", timeout=60).finish_reason == "stop"
    assert replica.stream is stream


def _completes(target: str, pki: Pki, issued: Issued) -> str:
    with InferenceClient(target, tls_ca_file=pki.ca.cert_file, tls_cert_file=issued.cert_file,
                         tls_key_file=issued.key_file) as client:
        return client.complete("Letters:", regex="[ab]{3}", timeout=60).finish_reason


def test_the_inference_services_own_certificate_rotates_without_a_restart(pki, tls_inference, inference_cert):
    """The inference service's server certificate files are rewritten: the next handshake is served the new
    certificate, and clients that trust the CA go on being served."""
    port = int(tls_inference.target.rsplit(":", 1)[1])
    assert served_certificate(port, pki) == pki.server.der
    pki.rotated_server.copy_to(inference_cert.cert_file, inference_cert.key_file)
    try:
        assert served_certificate(port, pki) == pki.rotated_server.der
        assert _completes(tls_inference.target, pki, pki.client) == "stop"
    finally:
        pki.server.copy_to(inference_cert.cert_file, inference_cert.key_file)
    assert served_certificate(port, pki) == pki.server.der


def test_the_inference_services_client_ca_rotates_without_a_restart(pki, tls_inference, inference_client_ca):
    """The client CA file now holds another CA: a client of the old one is refused at the handshake and one of
    the new one served, without a restart; back to the old CA, the old client is served again."""
    assert _completes(tls_inference.target, pki, pki.client) == "stop"
    inference_client_ca.write_bytes(pki.other_ca.cert_file.read_bytes())
    try:
        with pytest.raises(InferenceError) as refused:
            _completes(tls_inference.target, pki, pki.client)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert _completes(tls_inference.target, pki, pki.foreign_client) == "stop"
    finally:
        inference_client_ca.write_bytes(pki.ca.cert_file.read_bytes())
    assert _completes(tls_inference.target, pki, pki.client) == "stop"


def test_rotation_to_a_broken_pair_keeps_the_last_good_certificate(pki, tls_grammar, live_cert):
    before = served_certificate(tls_grammar.server.port, pki)
    # A certificate with another certificate's key (a half-finished swap, or a mistake).
    live_cert.cert_file.write_bytes(pki.server.cert_file.read_bytes())
    live_cert.key_file.write_bytes(pki.client.key_file.read_bytes())
    try:
        assert served_certificate(tls_grammar.server.port, pki) == before
        assert health(tls_grammar.target, pki.client_tls(pki.client)) == SERVING
    finally:
        pki.server.copy_to(live_cert.cert_file, live_cert.key_file)
    assert served_certificate(tls_grammar.server.port, pki) == pki.server.der


# ---------------------------------------------------------------------------------------------- health port


def test_plaintext_health_port_answers_health_only(tls_grammar):
    """Probes without a certificate read SERVING on the health port; nothing else is served there."""
    health_target = f"127.0.0.1:{tls_grammar.server.host.health_port}"
    assert health(health_target, None) == SERVING
    assert health(health_target, None, GRAMMAR_SERVICE) == SERVING
    with grpc.insecure_channel(health_target) as channel:
        compile_ = channel.unary_unary("/grammar.v1.GrammarService/Compile",
                                       request_serializer=gpb.CompileRequest.SerializeToString,
                                       response_deserializer=gpb.CompileResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            compile_(gpb.CompileRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---------------------------------------------------------------------------------------------- commands


def _generate_argv(pki: Pki, target: str, client: Issued | None) -> list[str]:
    argv = ["--target", target, "--tls-ca-file", str(pki.ca.cert_file)]
    if client is not None:
        argv += ["--tls-cert-file", str(client.cert_file), "--tls-key-file", str(client.key_file)]
    return argv + ["--json", "--timeout-seconds", "60", "--choice", "yes", "--choice", "no", "Well?"]


def test_structd_generate_with_tls_flags(pki, tls_inference, capsys):
    assert generate.main(_generate_argv(pki, tls_inference.target, pki.client)) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["text"] in ("yes", "no") and line["finish_reason"] == "stop"


def test_structd_generate_without_its_certificate_is_refused(pki, tls_inference, capsys):
    assert generate.main(_generate_argv(pki, tls_inference.target, None)) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err


def test_structd_generate_tls_flags_from_the_environment(pki, tls_inference, capsys, monkeypatch):
    monkeypatch.setenv("STRUCTD_GENERATE_TLS_CERT_FILE", str(pki.client.cert_file))
    monkeypatch.setenv("STRUCTD_GENERATE_TLS_KEY_FILE", str(pki.client.key_file))
    assert generate.main(_generate_argv(pki, tls_inference.target, None)) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "stop"


def test_gateway_over_https_in_front_of_a_tls_inference_service(pki, tls_inference, tmp_path):
    live = _live_copy(pki.server, tmp_path / "https")
    client = _live_copy(pki.client, tmp_path / "client")
    https = ServerTls(live.cert_file, live.key_file)
    good = ServiceThread(GatewayServer(GatewayConfig(
        host="127.0.0.1", port=0, target=tls_inference.target, tls=https,
        target_tls=pki.client_tls(client))), "gateway-tls", start_timeout=60.0)
    # Trusts the inference service's CA but has no client certificate: the inference service refuses it.
    anonymous = ServiceThread(GatewayServer(GatewayConfig(
        host="127.0.0.1", port=0, target=tls_inference.target, target_tls=pki.client_tls(None))),
        "gateway-anonymous", start_timeout=60.0)
    try:
        verify = ssl.create_default_context(cafile=str(pki.ca.cert_file))
        base = f"https://localhost:{good.server.port}"
        assert httpx2.get(base + "/health", verify=verify, timeout=30).status_code == 200
        reply = httpx2.post(base + "/v1/completions", verify=verify, timeout=60, json={
            "prompt": "Well?", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] in ("yes", "no")
        assert httpx2.get(f"http://127.0.0.1:{anonymous.server.port}/health", timeout=30).status_code == 503
        # The HTTPS certificate rotates too: its files are looked at every few seconds.
        pki.rotated_server.copy_to(live.cert_file, live.key_file)
        wait_until(lambda: served_certificate(good.server.port, pki) == pki.rotated_server.der,
                   "the gateway serves the rotated certificate", timeout=60)
        assert httpx2.get(base + "/health", verify=verify, timeout=30).status_code == 200
        # So does its client certificate: new calls to the inference service present the new one.
        pki.foreign_client.copy_to(client.cert_file, client.key_file)
        good.run_sync(good.server.upstream.renew_if_rotated)  # what its rotation loop does every few seconds
        assert httpx2.get(base + "/health", verify=verify, timeout=30).status_code == 503
        pki.rotated_client.copy_to(client.cert_file, client.key_file)
        good.run_sync(good.server.upstream.renew_if_rotated)
        assert httpx2.get(base + "/health", verify=verify, timeout=30).status_code == 200
    finally:
        good.stop()
        anonymous.stop()


def test_structd_up_with_mutual_tls_on_both_hops(pki):
    """`structd up --tls-*`: both gRPC services take only clients with a certificate from the CA, the gateway
    serves HTTPS and reaches the inference service with the certificate, and `structd generate` with its TLS
    flags gets an answer through both hops."""
    port, mport = free_ports(), free_ports()
    iport, imetrics, gport = free_ports(), free_ports(), free_ports()
    tls_flags = ["--tls-cert-file", str(pki.server.cert_file), "--tls-key-file", str(pki.server.key_file)]
    proc = Proc([PYTHON, "-m", "structd", "up", "--host", "127.0.0.1", "--grammar-port", str(port),
                 "--grammar-metrics-port", str(mport), "--port", str(iport), "--metrics-port", str(imetrics),
                 "--gateway-port", str(gport), "--log-level", "WARNING", *tls_flags,
                 "--tls-ca-file", str(pki.ca.cert_file)])
    services: set[int] = set()
    try:
        proc.wait_for_line("all services SERVING")
        services = children_of(proc.popen.pid)
        assert f"gateway (OpenAI API): https://127.0.0.1:{gport}/v1" in proc.output
        assert f"--tls-ca-file {pki.ca.cert_file}" in proc.output  # the "try:" line says how to dial it
        for target, service in ((f"127.0.0.1:{port}", GRAMMAR_SERVICE), (f"127.0.0.1:{iport}", INFERENCE_SERVICE)):
            assert health(target, pki.client_tls(pki.server), service) == SERVING
            with pytest.raises(grpc.RpcError) as refused:
                health(target, pki.client_tls(None), service)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        gen = subprocess.run([PYTHON, "-m", "structd", "generate", "--target", f"127.0.0.1:{iport}",
                              "--tls-ca-file", str(pki.ca.cert_file), *tls_flags,
                              "--json", "--choice", "yes", "--choice", "no", "Well?"],
                             cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout)["text"] in ("yes", "no")
        verify = ssl.create_default_context(cafile=str(pki.ca.cert_file))
        assert httpx2.get(f"https://127.0.0.1:{gport}/health", verify=verify, timeout=30).status_code == 200
        proc.popen.send_signal(signal.SIGINT)
        assert proc.wait() == 0, proc.output
    finally:
        proc.kill()
        for pid in services:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--tls-cert-file", "{cert}"], "--tls-cert-file and --tls-key-file go together",
                 id="certificate-without-key"),
    pytest.param(["--tls-client-ca-file", "{ca}"], "--tls-client-ca-file needs both", id="client-ca-alone"),
    pytest.param(["--tls-cert-file", "{cert}", "--tls-key-file", "{other_key}"], "not a PEM certificate and its",
                 id="key-of-another-certificate"),
    pytest.param(["--tls-cert-file", "{cert}", "--tls-key-file", "{key}", "--tls-client-ca-file", "/nonexistent"],
                 "--tls-client-ca-file /nonexistent: no such file", id="missing-client-ca"),
    pytest.param(["--grammar-tls-cert-file", "{cert}"], "--grammar-tls-cert-file and --grammar-tls-key-file go",
                 id="grammar-client-certificate-without-key"),
    pytest.param(["--grammar-tls-ca-file", "{key}"], "--grammar-tls-ca-file", id="grammar-ca-not-a-certificate"),
])
def test_inference_tls_flags_are_checked_before_anything_starts(pki, argv, message):
    from inference_svc import config

    files = {"cert": pki.server.cert_file, "key": pki.server.key_file, "other_key": pki.client.key_file,
             "ca": pki.ca.cert_file}
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {})
    with pytest.raises(SystemExit) as stopped:
        config.from_args(parser.parse_args([a.format(**files) for a in argv]))
    assert "invalid inference service configuration" in str(stopped.value) and message in str(stopped.value)


def test_grammar_tls_flags_come_from_the_environment(pki):
    """STRUCTD_GRAMMAR_TLS_* are the flags' twins: a key that is not the certificate's stops the replica."""
    from grammar_svc import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {"STRUCTD_GRAMMAR_TLS_CERT_FILE": str(pki.server.cert_file),
                                  "STRUCTD_GRAMMAR_TLS_KEY_FILE": str(pki.client.key_file)})
    with pytest.raises(SystemExit) as stopped:
        config.from_args(parser.parse_args([]))
    assert "--tls-cert-file" in str(stopped.value) and "not a PEM certificate and its private key" in str(stopped.value)


def test_gateway_tls_flags_are_checked(pki):
    proc = subprocess.run([PYTHON, "-m", "structd", "gateway", "--port", "0", "--target-tls-key-file",
                           str(pki.client.key_file)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "--target-tls-cert-file and --target-tls-key-file go together" in proc.stderr, proc.stderr


def test_up_tls_flags_go_together(pki):
    proc = subprocess.run([PYTHON, "-m", "structd", "up", "--tls-cert-file", str(pki.server.cert_file),
                           "--tls-key-file", str(pki.server.key_file)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tls-cert-file, --tls-key-file and --tls-ca-file go together" in proc.stderr, proc.stderr
