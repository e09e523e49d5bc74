"""Authorisation on top of mutual TLS (issue 24, items 13 and 5), with real certificates from test_tls's CA.

An allow-list of certificate names (`--tls-allowed-clients`) lets the grammar
tier serve only the inference replicas and the inference service only the
gateway and named clients: another certificate from the same CA is refused
PERMISSION_DENIED, naming itself and the flag. A client CA removed from the
file stops being trusted by new connections without a restart, on the gRPC
servers and on the gateway's HTTPS context. The inference service passes the
end client (its caller's certificate, and the x-structd-end-client the
gateway names) to the grammar tier, whose per-caller compile limit then
counts each end client apart: one client's burst of slow schemas does not
fail another's.
"""

from __future__ import annotations

import json
import ssl
import threading

import grpc
import pytest

from shared.client_identity import END_CLIENT_METADATA
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.inference_client import InferenceClient, InferenceError
from shared.tls import ServerTls, SslContextRotation, server_ssl_context, sync_channel
from tests.conftest import SLOW_SCHEMA, InferenceServerThread, start_grammar_server, wait_until
from tests.test_tls import GRAMMAR_SERVICE, SERVING, Pki, health, pki  # noqa: F401 - pki is a fixture
from tests.tls_material import Issued

CLIENT = "structd test client"  # the CN of pki.client: the inference replicas' certificate, and a named client
GATEWAY = "structd test gateway"


@pytest.fixture(scope="module")
def allowed_grammar(pki):
    """A grammar replica that serves the inference replicas' certificate only, one uncached compile each."""
    srv = start_grammar_server(compile_workers=2, fill_threads=1, max_compiles_per_caller=1,
                               tls=ServerTls(pki.server.cert_file, pki.server.key_file, pki.ca.cert_file,
                                             allowed_clients=(CLIENT,)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def allowed_inference(pki, allowed_grammar):
    """An inference service that serves the gateway and the named client only."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(allowed_grammar.target,), simulate_step_ms=1.0,
        grace_seconds=1.0, grammar_tls=pki.client_tls(pki.client),
        tls=ServerTls(pki.server.cert_file, pki.server.key_file, pki.ca.cert_file, allowed_clients=(CLIENT, GATEWAY)),
        engine=EngineConfig(max_num_seqs=4, default_max_tokens=16, compile_timeout_seconds=30.0))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


def _inference(pki: Pki, target: str, issued: Issued) -> InferenceClient:
    return InferenceClient(target, tls_ca_file=pki.ca.cert_file, tls_cert_file=issued.cert_file,
                           tls_key_file=issued.key_file)


def test_grammar_tier_refuses_a_certificate_not_allowed(pki, allowed_grammar):
    with pytest.raises(grpc.RpcError) as refused:
        health(allowed_grammar.target, pki.client_tls(pki.other_client), GRAMMAR_SERVICE)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'structd test other-client'" in refused.value.details()
    assert "--tls-allowed-clients" in refused.value.details()
    assert health(allowed_grammar.target, pki.client_tls(pki.client), GRAMMAR_SERVICE) == SERVING


@pytest.mark.parametrize("who", ["other_client", "rotated_client"])
def test_inference_service_refuses_a_certificate_not_allowed(pki, allowed_inference, who):
    """Certificates from the right CA under names the list lacks: refused before the request runs."""
    with _inference(pki, allowed_inference.target, getattr(pki, who)) as client, \
            pytest.raises(InferenceError) as refused:
        client.complete("A colour:", choice=["red", "green"], timeout=30)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "--tls-allowed-clients" in refused.value.message


@pytest.mark.parametrize("who", ["client", "gateway"])
def test_inference_service_serves_the_allowed_clients(pki, allowed_inference, who):
    """The allowed names are served, and the inference replica (allowed there) reached the grammar tier."""
    with _inference(pki, allowed_inference.target, getattr(pki, who)) as client:
        done = client.complete("A colour:", choice=["red", "green"], timeout=60)
    assert done.text in ("red", "green")


def test_a_client_ca_removed_from_the_file_is_no_longer_trusted(pki, tmp_path):
    """The gRPC server re-reads its client CA file on new handshakes: once the file holds another CA, a client
    of the old one is refused and one of the new one served, without a restart."""
    ca_file = tmp_path / "client-ca.crt"
    ca_file.write_bytes(pki.ca.cert_file.read_bytes())
    srv = start_grammar_server(compile_workers=1, fill_threads=1,
                               tls=ServerTls(pki.server.cert_file, pki.server.key_file, ca_file))
    try:
        assert health(srv.target, pki.client_tls(pki.client)) == SERVING
        ca_file.write_bytes(pki.other_ca.cert_file.read_bytes())
        with pytest.raises(grpc.RpcError) as refused:
            health(srv.target, pki.client_tls(pki.client))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health(srv.target, pki.client_tls(pki.foreign_client)) == SERVING
    finally:
        srv.stop()


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> bool:
    """Whether the server side of one TLS handshake (over memory buffers) accepts the client."""
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(bios[0], bios[1], server_side=True)
    client = client_ctx.wrap_bio(bios[2], bios[3], server_hostname="localhost")
    for _ in range(20):
        for side, out, into in ((client, bios[3], bios[0]), (server, bios[1], bios[2])):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                if side is server:
                    return False
            if out.pending:
                into.write(out.read())
        try:
            server.do_handshake()
            return True
        except ssl.SSLWantReadError:
            continue
        except ssl.SSLError:
            return False
    raise AssertionError("the handshake went on and on")


def _client_context(pki: Pki, issued: Issued) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert_file))
    ctx.load_cert_chain(issued.cert_file, issued.key_file)
    return ctx


def test_the_gateway_https_context_forgets_a_removed_client_ca(pki, tmp_path):
    """load_verify_locations only adds CAs; the rotation serves new handshakes a fresh context instead."""
    ca_file = tmp_path / "client-ca.crt"
    ca_file.write_bytes(pki.ca.cert_file.read_bytes())
    tls = ServerTls(pki.server.cert_file, pki.server.key_file, ca_file)
    ctx = server_ssl_context(tls)
    rotation = SslContextRotation(ctx, tls)
    old, new = _client_context(pki, pki.client), _client_context(pki, pki.foreign_client)
    assert _handshake(ctx, old) and not _handshake(ctx, new)
    ca_file.write_bytes(pki.other_ca.cert_file.read_bytes())
    assert rotation.check()
    assert not _handshake(ctx, old) and _handshake(ctx, new)


def test_each_end_client_has_its_own_compile_budget(pki, allowed_inference, allowed_grammar):
    """The grammar replica allows one uncached compile per caller. Every request reaches it from the one
    inference replica certificate, yet the end clients count apart: while the gateway's key-1 waits on a slow
    compile, key-1's next distinct schema is refused RESOURCE_EXHAUSTED (its own budget), and key-2's and
    the directly connected client's are served."""
    callers = allowed_grammar.server.backend.callers
    channel = sync_channel(allowed_inference.target, pki.client_tls(pki.gateway))
    stub = pb_grpc.InferenceServiceStub(channel)

    def generate(key: str, schema: dict) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(prompt="Fill in:", constraint=pb.Constraint(json_schema=json.dumps(schema)),
                                     sampling=pb.SamplingParams(max_tokens=8))
        return list(stub.Generate(request, timeout=120, metadata=((END_CLIENT_METADATA, key),)))

    first: dict = {}
    slow = threading.Thread(target=lambda: first.setdefault("out", generate("key-1", SLOW_SCHEMA)), daemon=True)
    try:
        slow.start()
        key1 = f"certificate {CLIENT} for {GATEWAY}/key-1"
        wait_until(lambda: allowed_grammar.run_sync(lambda: callers.waiting(key1)) == 1, "key-1's slow compile")
        other = {**SLOW_SCHEMA, "title": "another"}
        with pytest.raises(grpc.RpcError) as refused:
            generate("key-1", other)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-compiles-per-caller" in refused.value.details()
        assert generate("key-2", {"type": "integer"})[-1].finish_reason
        with _inference(pki, allowed_inference.target, pki.client) as client:
            assert client.complete("n:", json_schema={"type": "boolean"}, timeout=60).finish_reason
        slow.join(120)
        assert first["out"][-1].finish_reason
    finally:
        channel.close()
