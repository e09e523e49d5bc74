"""inference.v1.InferenceService: protobuf <-> engine translation only."""

from __future__ import annotations

from inference_svc.api.chat import ChatMessage, parse_template_kwargs
from inference_svc.config import EngineConfig
from inference_svc.api.frontend import ClientRequest, Frontend, ServingInfo, SubmittedRequest
from inference_svc.engine.request import FinishReason, Output
from inference_svc.engine.sampling import SamplingOptions
from inference_svc.api.tokenizing import Tokenization, TokenizeInput
from inference_svc.api.tool_calls import ToolChoice, ToolSpec, check_tool_bytes
from inference_svc.types import CheckResult, Constraint, JsonOptions, ParsedToolCall, SchemaWarning
from shared import errors
from shared.client_identity import acting_for
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.status import refuse

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
_WHITESPACE = {
    pb.JSON_WHITESPACE_UNSPECIFIED: "compact",
    pb.JSON_WHITESPACE_COMPACT: "compact",
    pb.JSON_WHITESPACE_FLEXIBLE: "flexible",
    pb.JSON_WHITESPACE_INDENTED: "indented",
}
_TOOL_CHOICE = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    pb.TOOL_CHOICE_MODE_AUTO: "auto",
    pb.TOOL_CHOICE_MODE_REQUIRED: "required",
    pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_NAMED: "named",
}
_JSON_KINDS = ("json_schema", "json_object")
_BACKEND = {
    pb.GRAMMAR_BACKEND_UNSPECIFIED: "",
    pb.GRAMMAR_BACKEND_AUTO: "auto",
    pb.GRAMMAR_BACKEND_XGRAMMAR: "xgrammar",
    pb.GRAMMAR_BACKEND_LLGUIDANCE: "llguidance",
}
_SCHEMA_CHECK = {
    CheckResult.VALID: pb.SCHEMA_CHECK_VALID,
    CheckResult.INVALID: pb.SCHEMA_CHECK_INVALID,
    CheckResult.UNCHECKED: pb.SCHEMA_CHECK_UNCHECKED,
}


def constraint(c: pb.Constraint) -> Constraint | None:
    """The engine's constraint for a client's (None: unconstrained)."""
    kind = c.WhichOneof("kind")
    if c.HasField("json_options") and kind not in _JSON_KINDS:
        raise errors.InvalidRequestError(
            f"constraint.json_options apply to json_schema and json_object only, not to {kind or 'no constraint'}")
    if c.strict_schema and kind != "json_schema":
        raise errors.InvalidRequestError(
            f"constraint.strict_schema applies to json_schema only, not to {kind or 'no constraint'}")
    if c.backend not in _BACKEND:
        raise errors.InvalidRequestError(f"constraint.backend: unknown value {c.backend}")
    backend = _BACKEND[c.backend]
    if kind is None:
        if backend:
            raise errors.InvalidRequestError("constraint.backend needs a constraint (json_schema, regex, ...)")
        return None
    if kind in ("json_schema", "regex", "ebnf", "structural_tag") and not getattr(c, kind).strip():
        raise errors.InvalidRequestError(f"constraint.{kind} is empty")
    if kind == "choice":
        if not c.choice.choices:
            raise errors.InvalidRequestError("constraint.choice needs at least one choice")
        return Constraint("choice", choices=tuple(c.choice.choices), backend=backend)
    options = json_options(c.json_options)
    if kind == "json_object":
        # json_object=false asks for nothing.
        return Constraint("json_object", json_options=options, backend=backend) if c.json_object else None
    if kind == "json_schema":
        return Constraint(kind, c.json_schema, json_options=options, strict_schema=c.strict_schema, backend=backend)
    return Constraint(kind, getattr(c, kind), backend=backend)


def json_options(o: pb.JsonOptions) -> JsonOptions:
    if o.whitespace not in _WHITESPACE:
        raise errors.InvalidRequestError(f"constraint.json_options.whitespace: unknown value {o.whitespace}")
    for name in ("max_whitespace_count", "indent"):
        if getattr(o, name) < 0:
            raise errors.InvalidRequestError(f"constraint.json_options.{name} must be >= 0 (0 = default)")
    return JsonOptions(whitespace=_WHITESPACE[o.whitespace], max_whitespace_count=o.max_whitespace_count,
                       indent=o.indent, lenient=o.lenient, any_key_order=o.any_key_order)


def tool_call(c: pb.ToolCall) -> ParsedToolCall:
    return ParsedToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json)


def chat_message(m: pb.ChatMessage) -> ChatMessage:
    return ChatMessage(role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
                       tool_calls=tuple(tool_call(c) for c in m.tool_calls), reasoning_content=m.reasoning_content)


def tool(t: pb.Tool) -> ToolSpec:
    return ToolSpec.from_json(t.name, t.description, t.parameters_json_schema)


def tool_choice(request: pb.GenerateRequest) -> ToolChoice | None:
    if not request.HasField("tool_choice"):
        return None
    c = request.tool_choice
    if c.mode not in _TOOL_CHOICE:
        raise errors.InvalidRequestError(f"tool_choice.mode: unknown value {c.mode}")
    mode = _TOOL_CHOICE[c.mode]
    if mode != "named" and c.name:
        raise errors.InvalidRequestError(f"tool_choice.name is for TOOL_CHOICE_MODE_NAMED, not {mode}")
    return ToolChoice(mode, c.name, tuple(c.allowed_tools))


def client_request(request: pb.GenerateRequest, config: EngineConfig, max_model_len: int,
                   end_client: str = "") -> ClientRequest:
    # Before any schema is parsed: a request past the limit costs its bytes only.
    check_tool_bytes([(t.name, t.parameters_json_schema) for t in request.tools], config.max_tool_bytes)
    if request.tools and request.constraint.strict_schema:
        raise errors.InvalidRequestError(
            "constraint.strict_schema cannot be combined with tools: the constraint then becomes part of the "
            "tool-call grammar, which is not checked keyword by keyword")
    if request.tools and request.constraint.backend == pb.GRAMMAR_BACKEND_LLGUIDANCE:
        raise errors.InvalidRequestError(
            "constraint.backend GRAMMAR_BACKEND_LLGUIDANCE cannot serve tools: their grammar is a structural tag, "
            "which only xgrammar compiles; drop the backend (or ask for auto or xgrammar)")
    return ClientRequest(
        options=sampling_options(request.sampling, config, max_model_len),
        constraint=constraint(request.constraint),
        jump_forward=not request.constraint.disable_jump_forward,
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=tuple(request.prompt_token_ids),
        messages=tuple(chat_message(m) for m in request.messages),
        tools=tuple(tool(t) for t in request.tools),
        tool_choice=tool_choice(request),
        reasoning=request.reasoning if request.HasField("reasoning") else None,
        max_thinking_tokens=request.max_thinking_tokens,
        template_kwargs=parse_template_kwargs(request.chat_template_kwargs_json),
        parallel_tool_calls=not request.HasField("parallel_tool_calls") or request.parallel_tool_calls,
        end_client=end_client,
    )


def sampling_options(s: pb.SamplingParams, config: EngineConfig, max_model_len: int) -> SamplingOptions:
    return SamplingOptions.validated(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop), ignore_eos=s.ignore_eos,
        default_max_tokens=config.default_max_tokens, max_max_tokens=max_model_len,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs, min_tokens=s.min_tokens,
        repetition_penalty=s.repetition_penalty, n=s.n, max_n=config.max_n,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias),
        min_p=s.min_p, stop_token_ids=tuple(s.stop_token_ids), include_stop_str_in_output=s.include_stop_str_in_output)


def response(out: Output, warnings: tuple[SchemaWarning, ...] = ()) -> pb.GenerateResponse:
    """`warnings`: the compile warnings, for the request's first response."""
    resp = pb.GenerateResponse(token_ids=out.token_ids, text=out.text, reasoning_text=out.reasoning_text,
                               index=out.index)
    resp.warnings.extend(pb.SchemaWarning(keyword=w.keyword, json_pointer=w.json_pointer, message=w.message)
                         for w in warnings)
    for c in out.tool_calls:
        resp.tool_calls.add(id=c.id, name=c.name, arguments_json=c.arguments_json)
    for d in out.tool_call_deltas:
        resp.tool_call_deltas.add(index=d.index, id=d.id, name=d.name, arguments_fragment=d.arguments_fragment)
    if out.logprobs:
        resp.logprobs.extend(
            pb.TokenLogprob(token_id=lp.token_id, token_bytes=lp.token_bytes, logprob=lp.logprob, forced=lp.forced,
                            top_logprobs=[pb.TopLogprob(token_id=t.token_id, token_bytes=t.token_bytes,
                                                        logprob=t.logprob) for t in lp.top])
            for lp in out.logprobs)
    if out.finish_reason is not None:
        resp.finish_reason = _FINISH[out.finish_reason]
        u = out.usage
        resp.usage.prompt_tokens = u.prompt_tokens
        resp.usage.completion_tokens = u.completion_tokens
        resp.usage.forced_tokens = u.forced_tokens
        resp.usage.reasoning_tokens = u.reasoning_tokens
        resp.usage.cached_prompt_tokens = u.cached_prompt_tokens
    if out.schema_check is not None:
        check = out.schema_check
        resp.schema_check = _SCHEMA_CHECK[check.result]
        resp.schema_check_detail = check.detail
        resp.schema_violations.extend(
            pb.SchemaViolation(keyword=v.keyword, instance_pointer=v.instance_pointer, message=v.message)
            for v in check.violations)
    return resp


def tokenize_input(request: pb.TokenizeRequest, max_tool_bytes: int) -> TokenizeInput:
    check_tool_bytes([(t.name, t.parameters_json_schema) for t in request.tools], max_tool_bytes)
    if request.tools and not request.messages:
        raise errors.InvalidRequestError("tools are shown to the chat template: give them with messages")
    return TokenizeInput(
        prompt=request.prompt, messages=tuple(chat_message(m) for m in request.messages),
        tools=tuple(tool(t) for t in request.tools),
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else True,
        reasoning=request.reasoning if request.HasField("reasoning") else None,
        template_kwargs=parse_template_kwargs(request.chat_template_kwargs_json))


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, frontend: Frontend, info: ServingInfo, tokenization: Tokenization):
        self.frontend = frontend
        self.info = info
        self.tokenization = tokenization

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            ids = await self.tokenization.tokenize(tokenize_input(request, self.frontend.engine.config.max_tool_bytes))
        except Exception as e:  # noqa: BLE001 - mapped to a status by the one table
            refuse(context, e)
            return pb.TokenizeResponse()
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.info.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            text = await self.tokenization.detokenize(request.token_ids)
        except Exception as e:  # noqa: BLE001 - mapped to a status by the one table
            refuse(context, e)
            return pb.DetokenizeResponse()
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        i = self.info
        return pb.GetModelInfoResponse(model_id=i.model_id, max_model_len=i.max_model_len, vocab_size=i.vocab_size,
                                       has_chat_template=i.has_chat_template, model_family=i.family,
                                       loaded_unix_seconds=i.loaded_unix_seconds)

    async def Generate(self, request: pb.GenerateRequest, context):
        engine = self.frontend.engine
        req = await self._submit(request, context)
        del request  # its bytes, up to the message limit, are not needed while the answer streams
        if req is None:
            return
        try:
            first = True
            while True:
                out = await req.outputs.get()
                if out.error is not None:
                    refuse(context, out.error)
                    return
                # The grammar has compiled before the first output, so its warnings are known by now.
                yield response(out, req.warnings if first else ())
                first = False
                # The last completion's finish (each of n completions sends its own finish reason).
                if out.ends_stream:
                    return
        finally:
            # The client cancelled, its deadline passed, or the stream broke: free KV and grammar state.
            engine.cancel(req)

    async def _submit(self, request: pb.GenerateRequest, context) -> SubmittedRequest | None:
        """The request as the engine accepted it; None when it was refused, the call's status then set to why
        (set, not raised: shared.status.refuse says why)."""
        engine = self.frontend.engine
        try:
            end_client = acting_for(context.auth_context(), context.invocation_metadata())
            return await self.frontend.submit(client_request(request, engine.config, engine.max_model_len, end_client))
        except Exception as e:  # noqa: BLE001 - mapped to a status by the one table
            refuse(context, e)
        return None
