"""A grammar replica whose image lacks llguidance, over real gRPC (the first GPU device check ran one: auto answered
INTERNAL for every compile and session that reached llguidance, ModuleNotFoundError on a thread).

The server is started as the service starts, its availability probe given an importer that fails as a missing
package does (GrammarServer's `llguidance` seam; the service passes its probe of the real import):
- auto serves from xgrammar what it would otherwise give llguidance (a feature only llguidance enforces, a pattern
  xgrammar refuses: its INVALID_ARGUMENT, not INTERNAL; a schema asked for while the one worker is busy:
  xgrammar's grammar, waited for within the deadline), its sessions step, and no llguidance tokenizer is built;
- a request naming llguidance is UNIMPLEMENTED, naming the package and how to install it; through the
  inference service's grammar tier, with no other replica to try, the client hears that message (UNAVAILABLE);
- grammar_svc_backend_available says llguidance 0, xgrammar 1, and no compile is counted as llguidance's or as an
  error; one WARNING at start says so;
- a replica configured for llguidance alone refuses to start, saying why.
"""

from __future__ import annotations

import importlib.metadata
import logging

import grpc
import pytest

from grammar_svc.compile.llguidance_backend import probe_llguidance
from grammar_svc.config import GrammarServiceConfig
from grammar_svc.server import GrammarServer
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.status import status_for
from structd.bench.harness import ServiceThread
from tests.conftest import run
from tests.test_grammar_backends import behind_a_held_worker
from tests.test_grammar_rpcs import call, json_schema, prober, salt  # noqa: F401 - prober is a fixture

XGRAMMAR, LLGUIDANCE = pb.GRAMMAR_BACKEND_XGRAMMAR, pb.GRAMMAR_BACKEND_LLGUIDANCE


def not_installed(name: str):
    """An importer as Python's is where the package is not installed."""
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def config(**overrides) -> GrammarServiceConfig:
    cfg = dict(host="127.0.0.1", port=0, metrics_port=0, compile_workers=1, fill_threads=1,
               grammar_backend="auto", fallback_after_seconds=0.5)
    return GrammarServiceConfig(**{**cfg, **overrides})


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def bare(tokenizer_desc):
    """An auto replica without llguidance, the tokenizer registered, and what its start logged."""
    logger, records = logging.getLogger("grammar_svc"), Records()
    logger.addHandler(records)
    try:
        srv = ServiceThread(GrammarServer(config(), llguidance=probe_llguidance(not_installed)), "grammar-server",
                            start_timeout=120.0)
    finally:
        logger.removeHandler(records)
    srv.start_logs = records.records
    call(srv.target, lambda client: client.register_tokenizer(tokenizer_desc))
    yield srv
    srv.stop()


def compile_auto(srv, fingerprint: str, spec: pb.GrammarSpec, backend: int = pb.GRAMMAR_BACKEND_UNSPECIFIED):
    return call(srv.target, lambda client: client.compile(fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120,
                                                          backend=backend))


def sample(srv, name: str, **labels) -> float:
    return srv.server.metrics.registry.get_sample_value(name, labels) or 0.0


def test_the_probe_finds_the_installed_llguidance():
    found = probe_llguidance()
    assert found.available and found.version == importlib.metadata.version("llguidance")
    missing = probe_llguidance(not_installed)
    assert not missing.available and "No module named 'llguidance'" in missing.why_missing()


def test_start_warns_once_naming_the_package_and_how_to_install_it(bare):
    warnings = [r.getMessage() for r in bare.start_logs if r.levelno >= logging.WARNING and "llguidance" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "llguidance does not import" in warnings[0] and "pip install 'llguidance==" in warnings[0]
    assert "auto serves every constraint from xgrammar" in warnings[0]


@pytest.mark.parametrize("schema", [
    pytest.param({"type": "number", "multipleOf": 0.25}, id="what-only-llguidance-enforces"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, id="plain"),
])
def test_auto_serves_json_schemas_from_xgrammar_and_its_sessions_step(bare, tokenizer_desc, prober, schema):
    spec = json_schema({"title": salt(), **schema})
    out = compile_auto(bare, tokenizer_desc.fingerprint, spec)
    assert (out.backend, out.backend_reason) == (XGRAMMAR, "default")
    valid, invalid = ((["0.25"], ['"x"']) if schema["type"] == "number" else (['{"a":"b"}'], ['{"b":"a"}']))
    call(bare.target, lambda client: prober.assert_constrains(client, out.grammar_id, valid, invalid))


def test_a_pattern_xgrammar_refuses_keeps_xgrammars_refusal(bare, tokenizer_desc):
    with pytest.raises(grpc.RpcError) as info:
        compile_auto(bare, tokenizer_desc.fingerprint, json_schema({"title": salt(), "type": "string",
                                                                    "pattern": r"\p{L}+"}))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_a_schema_asked_for_while_the_worker_is_busy_waits_for_xgrammar(bare, tokenizer_desc):
    """With llguidance, auto answers it from llguidance at once (xgrammar_busy: test_grammar_backends.py)."""
    spec = json_schema({"title": salt(), "type": "integer"})
    out = run(behind_a_held_worker(bare, tokenizer_desc.fingerprint, lambda client: client.compile(
        tokenizer_desc.fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120)))
    assert (out.backend, out.backend_reason) == (XGRAMMAR, "default")


def test_a_request_naming_llguidance_is_unimplemented_saying_what_to_do(bare, tokenizer_desc):
    with pytest.raises(grpc.RpcError) as info:
        compile_auto(bare, tokenizer_desc.fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"), backend=LLGUIDANCE)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = info.value.details()
    assert "llguidance does not import on this grammar replica" in details
    assert "backend auto or xgrammar" in details and "pip install 'llguidance==" in details


def test_the_grammar_tier_passes_the_replicas_answer_on_and_keeps_the_replica(bare, tokenizer_desc):
    """The client hears the replica's answer as INVALID_ARGUMENT (HTTP 400: not UNAVAILABLE nor a 501, which
    SDKs retry to the same answer), and the replica, fine for everything else, stays registered with its
    compiles remembered (FAILED_PRECONDITION had it re-register the 129k tokenizer at every such request)."""
    from inference_svc.grammar.grammar_link import GrammarLink
    from inference_svc.grammar.grammar_tier import GrammarTier
    from inference_svc.types import Constraint
    from shared import errors

    async def go():
        tier = GrammarTier((bare.target,), tokenizer_desc)
        try:
            await tier.connect()
            await tier.compile(GrammarLink(Constraint("regex", f"{salt()}[a-z]+")))
            (replica,) = tier._replicas.values()
            remembered = len(replica.compiled)
            with pytest.raises(errors.InvalidRequestError, match="llguidance does not import") as info:
                await tier.compile(GrammarLink(Constraint("regex", f"{salt()}[0-9]+", backend="llguidance")))
            return info.value, replica.registered, len(replica.compiled) == remembered > 0
        finally:
            await tier.close()

    error, registered, memo_kept = run(go())
    assert status_for(error)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert registered and memo_kept


def test_the_metrics_say_llguidance_is_missing_and_nothing_reached_it(bare, tokenizer_desc):
    compile_auto(bare, tokenizer_desc.fingerprint, pb.GrammarSpec(regex=f"{salt()}[a-z]+"))
    assert sample(bare, "grammar_svc_backend_available", backend="llguidance") == 0
    assert sample(bare, "grammar_svc_backend_available", backend="xgrammar") == 1
    for reason in ("requested", "configured", "feature", "xgrammar_refused", "xgrammar_slow", "xgrammar_crashed",
                   "xgrammar_busy"):
        assert sample(bare, "grammar_svc_backend_choices_total", backend="llguidance", reason=reason) == 0, reason
    assert sample(bare, "grammar_svc_backend_choices_total", backend="xgrammar", reason="default") >= 1
    for kind in ("json_schema", "regex"):
        assert sample(bare, "grammar_svc_compile_failures_total", kind=kind, reason="error") == 0, kind
    # Registration built no llguidance tokenizer (the import it needs would have failed on a thread).
    assert bare.server.backend.tokenizers.get(tokenizer_desc.fingerprint).llguidance == {}


def test_a_replica_configured_for_llguidance_alone_refuses_to_start():
    with pytest.raises(SystemExit) as info:
        GrammarServer(config(grammar_backend="llguidance"), llguidance=probe_llguidance(not_installed))
    message = str(info.value)
    assert "cannot start with --grammar-backend llguidance" in message
    assert "No module named 'llguidance'" in message and "pip install 'llguidance==" in message
