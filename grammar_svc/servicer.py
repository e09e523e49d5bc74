"""gRPC servicer: translates grammar.v1 messages to domain calls and back.

The decisions are the domain's (the backend compiles, the stepper applies a
step and chooses where it runs); here protobuf becomes domain objects, the
client's gRPC deadline becomes a compile deadline, and errors become
statuses through shared.status.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor


from grammar_svc.compile.backend import GrammarBackend
from grammar_svc.schema import schema_warnings
from grammar_svc.step.mask_filler import MaskFiller
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.output_check import OutputChecks
from grammar_svc.step.sessions import SessionLimiter, StreamSessions
from grammar_svc.compile.spec import GrammarSpec
from grammar_svc.step.stepper import SessionOp, Status, Stepper
from grammar_svc.types import JsonOptions, Kind, Whitespace
from shared import status as status_map
from shared.client_identity import certificate_identity, end_client
from shared.errors import InvalidGrammarError
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.gen.grammar.v1 import grammar_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_WHITESPACE = {
    pb.WHITESPACE_STYLE_UNSPECIFIED: Whitespace.COMPACT,
    pb.WHITESPACE_STYLE_COMPACT: Whitespace.COMPACT,
    pb.WHITESPACE_STYLE_INDENTED: Whitespace.INDENTED,
    pb.WHITESPACE_STYLE_FLEXIBLE: Whitespace.FLEXIBLE,
}

# CompileRequest.backend -> the backend's choice name ("": the replica's --grammar-backend), and back.
_BACKEND = {
    pb.GRAMMAR_BACKEND_UNSPECIFIED: "",
    pb.GRAMMAR_BACKEND_AUTO: "auto",
    pb.GRAMMAR_BACKEND_XGRAMMAR: "xgrammar",
    pb.GRAMMAR_BACKEND_LLGUIDANCE: "llguidance",
}
_BACKEND_PB = {name: value for value, name in _BACKEND.items() if name}

_STATUS = {
    Status.OK: pb.SESSION_STATUS_OK,
    Status.TERMINATED: pb.SESSION_STATUS_TERMINATED,
    Status.REJECTED: pb.SESSION_STATUS_REJECTED,
    Status.CLOSED: pb.SESSION_STATUS_CLOSED,
    Status.ERROR: pb.SESSION_STATUS_ERROR,
}


def json_options_from_proto(o: pb.JsonSchemaOptions) -> JsonOptions:
    if o.whitespace not in _WHITESPACE:
        raise InvalidGrammarError(f"unknown whitespace style {o.whitespace}")
    d = JsonOptions()
    return JsonOptions(
        whitespace=_WHITESPACE[o.whitespace],
        indent=o.indent or d.indent,
        max_whitespace_count=o.max_whitespace_count or d.max_whitespace_count,
        any_key_order=o.any_key_order,
        lenient=o.lenient,
    )


def spec_from_proto(spec: pb.GrammarSpec) -> GrammarSpec:
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise InvalidGrammarError("spec has no kind set: set one of json_schema, regex, ebnf, choice, json_object, structural_tag")
    if kind == "json_schema":
        return GrammarSpec(Kind.JSON_SCHEMA, spec.json_schema.schema, json_options_from_proto(spec.json_schema.options))
    if kind == "json_object":
        return GrammarSpec(Kind.JSON_OBJECT, "", json_options_from_proto(spec.json_object.options))
    if kind == "regex":
        return GrammarSpec(Kind.REGEX, spec.regex)
    if kind == "ebnf":
        return GrammarSpec(Kind.EBNF, spec.ebnf.grammar, root_rule=spec.ebnf.root_rule or "root")
    if kind == "choice":
        return GrammarSpec.choice(list(spec.choice.choices))
    return GrammarSpec(Kind.STRUCTURAL_TAG, spec.structural_tag)


def op_from_proto(s: pb.SessionStep) -> SessionOp:
    # Positional, and `open` read only when present: this runs for every session of every step
    # (keywords and the extra reads cost measurably more: docs/benchmarks.md, "The grammar replica's step path").
    if s.HasField("open"):
        o = s.open
        return SessionOp(s.session_id, o.grammar_id, o.terminate_without_stop_token, s.rollback_tokens,
                         s.accept_token_ids, s.jump_forward, s.skip_mask, s.close)
    return SessionOp(s.session_id, None, False, s.rollback_tokens, s.accept_token_ids, s.jump_forward,
                     s.skip_mask, s.close)


class GrammarServicer(pb_grpc.GrammarServiceServicer):
    def __init__(self, *, backend: GrammarBackend, limiter: SessionLimiter, filler: MaskFiller,
                 metrics: GrammarMetrics, max_tokens_per_step: int, max_mask_cache_slots: int,
                 checks: OutputChecks):
        self.backend = backend
        self.checks = checks
        self.limiter = limiter
        self.filler = filler
        self.metrics = metrics
        self.max_tokens_per_step = max_tokens_per_step
        self.max_mask_cache_slots = max_mask_cache_slots
        # Steps of different streams run concurrently; one stream's steps run in order.
        self._step_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="structd-step")

    async def RegisterTokenizer(self, request: pb.RegisterTokenizerRequest, context):
        try:
            tok, already = await self.backend.register_tokenizer(
                request.tokenizer_fingerprint, request.tokenizer_info_json_zlib, request.hf_tokenizer_json_zlib)
        except Exception as e:  # noqa: BLE001 - mapped by the one status table
            return status_map.refuse(context, e)
        return pb.RegisterTokenizerResponse(
            tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size,
            already_registered=already, jump_forward_supported=tok.hf_tokenizer is not None)

    async def Compile(self, request: pb.CompileRequest, context):
        try:
            if request.timeout_seconds < 0:
                raise InvalidGrammarError("timeout_seconds must not be negative")
            timeout = request.timeout_seconds
            remaining = context.time_remaining()
            if remaining is not None:
                timeout = min(timeout, remaining) if timeout > 0 else min(remaining, self.backend.default_timeout_seconds)
            if request.backend not in _BACKEND:
                raise InvalidGrammarError(f"unknown grammar backend {request.backend}; use GRAMMAR_BACKEND_AUTO, "
                                          "GRAMMAR_BACKEND_XGRAMMAR or GRAMMAR_BACKEND_LLGUIDANCE")
            result = await self.backend.compile(request.tokenizer_fingerprint, spec_from_proto(request.spec), timeout,
                                                caller=caller_of(context), backend=_BACKEND[request.backend])
        except Exception as e:  # noqa: BLE001 - mapped by the one status table
            # Set, not raised (shared.status.refuse says why): a refused spec is up to the message limit.
            return status_map.refuse(context, e)
        entry = result.entry
        return pb.CompileResponse(
            grammar_id=entry.grammar_id, warnings=entry.warnings, cache_hit=result.cache_hit,
            compile_duration_seconds=entry.duration_seconds, memory_bytes=entry.memory_bytes,
            warning_details=[compile_warning(w) for w in entry.warnings], backend=_BACKEND_PB[result.backend],
            backend_reason=result.reason)

    async def CheckOutput(self, request: pb.CheckOutputRequest, context):
        try:
            report = await self.checks.check(request.grammar_id, request.token_ids, context.time_remaining())
        except Exception as e:  # noqa: BLE001 - mapped by the one status table
            return status_map.refuse(context, e)
        return pb.CheckOutputResponse(
            violations=[pb.OutputViolation(keyword=v.keyword, instance_pointer=v.instance_pointer, message=v.message)
                        for v in report.violations],
            total_violations=report.total, check_duration_seconds=report.seconds)

    async def Step(self, request_iterator, context):
        sessions = StreamSessions(self.limiter)
        stepper = Stepper(backend=self.backend, sessions=sessions, filler=self.filler, metrics=self.metrics,
                          max_tokens_per_step=self.max_tokens_per_step)
        self.metrics.active_streams.inc()
        try:
            first = True
            async for request in request_iterator:
                if first:
                    stepper.enable_mask_cache(min(request.mask_cache_slots, self.max_mask_cache_slots))
                    first = False
                outcome = await stepper.run([op_from_proto(s) for s in request.sessions], self._step_pool)
                yield step_response(request.step_id, outcome)
                stepper.observe(outcome)
        except Exception as e:  # noqa: BLE001 - per-session errors never get here; this is a bug
            status_map.refuse(context, e)
        finally:
            self.metrics.active_streams.dec()
            sessions.close_all()

    def close(self) -> None:
        self._step_pool.shutdown(wait=False, cancel_futures=True)


def caller_of(context) -> str:
    """Who a call counts against for per-caller limits: the client certificate's identity under mutual
    TLS (its subject's CN, else its first SAN: one tenant however many connections it opens; SANs come
    first only without a CN, since replicas of different tenants may share host names), with the end
    client it names (x-structd-end-client: every inference replica presents one certificate, and each of
    their clients counts apart), else the peer's IP address without the port (one pod)."""
    identity = certificate_identity(context.auth_context())
    if identity is not None:
        forwarded = end_client(context.invocation_metadata())
        return f"certificate {identity}" + (f" for {forwarded}" if forwarded else "")
    peer = context.peer() or "unknown"
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = address.rpartition(":")[0]
        return f"peer {host.strip('[]')}"
    return f"peer {peer}"


def compile_warning(line: str) -> pb.CompileWarning:
    w = schema_warnings.parse(line)
    return pb.CompileWarning(keyword=w.keyword, json_pointer=w.json_pointer, message=w.message)


def step_response(step_id: int, outcome) -> pb.StepResponse:
    resp = pb.StepResponse(step_id=step_id, server_duration_seconds=outcome.server_seconds,
                           fill_duration_seconds=outcome.fill_seconds)
    add = resp.results.add
    for r in outcome.results:
        msg = add(session_id=r.session_id, status=_STATUS[r.status], accepted_count=r.accepted_count)
        if r.mask is not None:
            setattr(msg.mask, r.mask.field, r.mask.value)
            if r.mask.store_slot is not None:
                msg.mask.store_slot = r.mask.store_slot
        if r.forced_token_ids:
            msg.jump_forward.forced_text = r.forced_text
            msg.jump_forward.forced_token_ids.extend(r.forced_token_ids)
        if r.error is not None:
            code, message = status_map.status_for(r.error)
            msg.error_code = code.value[0]
            msg.error_message = message
    return resp
