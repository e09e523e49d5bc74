"""Python client for the inference service (inference.v1.InferenceService), sync and asyncio.

Both clients take the same keyword arguments (see `build_request`) and speak
plain Python: a stream of `Chunk`s or one collected `Completion`, finish
reasons as lower-case strings, gRPC failures as `InferenceError`.

    with InferenceClient("127.0.0.1:50051") as client:
        for chunk in client.generate("Name a colour:", choice=["red", "green"]):
            print(chunk.text, end="", flush=True)

Several completions of one prompt (`n=`, OpenAI's n; the server computes
the prompt once): `complete_all(prompt, n=4, temperature=1)` returns the
four `Completion`s in index order; streamed, their chunks interleave, each
naming its completion in `Chunk.index`. `complete()` is for one completion.

Several replicas: `InferenceClient("ipv4:10.0.0.1:50051,10.0.0.2:50051",
retries=2)` (or a dns:/// name) spreads calls round robin, and a call
refused UNAVAILABLE before any output (a draining replica) is tried again on
the next, up to twice; a stream that has sent output is never retried.

Over TLS: `InferenceClient(target, tls_ca_file="ca.pem")`, plus
`tls_cert_file=` / `tls_key_file=` where the server requires a client
certificate (mutual TLS); or `credentials=` any grpc.ChannelCredentials.

Leaving a stream early (break, an exception, `close()` / `aclose()`) cancels
the RPC, so the server stops generating and frees the request at once. An
async stream is only closed promptly when closed explicitly, e.g. with
`contextlib.aclosing(client.generate(...))`; otherwise it is closed when
garbage collected.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncGenerator, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.grpc_options import CHANNEL_OPTIONS, service_config
from shared.tls import ClientTls, channel_credentials, client_tls

# Longest single health check while polling in wait_ready: a hung server must
# not eat the whole wait in one call.
_HEALTH_POLL_TIMEOUT = 1.0
_HEALTH_POLL_INTERVAL = 0.1

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
_FINISH_PREFIX = "FINISH_REASON_"
# "stop", "length", "stop_string", "cancelled", "error"; UNSPECIFIED (0) marks
# a response that is not the last one.
FINISH_REASONS: dict[int, str] = {
    value: name.removeprefix(_FINISH_PREFIX).lower()
    for name, value in pb.FinishReason.items()
    if value != pb.FINISH_REASON_UNSPECIFIED
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Completion tokens appended rather than sampled (jump-forward, a thinking budget's end).
    forced_tokens: int
    # Completion tokens spent thinking, the end-of-thinking token included.
    reasoning_tokens: int = 0
    # Prompt tokens the server found in its prefix cache instead of computing them (part of prompt_tokens).
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # valid against the tool's parameters schema

    @property
    def arguments(self) -> Any:
        return json.loads(self.arguments_json)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token_bytes: bytes  # raw: may be part of a UTF-8 character
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability, from the distribution it was drawn from."""

    token_id: int
    token_bytes: bytes
    logprob: float  # 0 for forced tokens
    forced: bool  # appended by jump-forward or a thinking budget, not sampled: no alternatives
    top_logprobs: list[TopLogprob]  # most likely first


@dataclass(frozen=True)
class SchemaWarning:
    """A schema keyword the grammar does not enforce (so the output may break it)."""

    keyword: str
    json_pointer: str  # where the schema uses it ("" = the root, or no place known)
    message: str


@dataclass(frozen=True)
class SchemaViolation:
    """One way a finished JSON output breaks its schema."""

    keyword: str  # the failing keyword; "json" when the output is not one JSON document
    instance_pointer: str  # JSON pointer of the offending value in the output ("" = the root)
    message: str


# GenerateResponse.schema_check -> the name Chunk and Completion carry.
SCHEMA_CHECKS = {pb.SCHEMA_CHECK_UNSPECIFIED: None, pb.SCHEMA_CHECK_VALID: "valid",
                 pb.SCHEMA_CHECK_INVALID: "invalid", pb.SCHEMA_CHECK_UNCHECKED: "unchecked"}


@dataclass(frozen=True)
class Chunk:
    """One streamed step of one completion: its tokens and their text delta.
    A completion's last chunk carries finish_reason and usage; on the others
    both are None. logprobs has one entry per token id when the request asked
    for them, else none. index: which of the request's n completions the
    chunk belongs to (0 when n is 1)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning_text: str = ""  # thinking text delta
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed in this step
    # First chunk: the keywords of a json_schema constraint the grammar does not enforce.
    warnings: list[SchemaWarning] = field(default_factory=list)
    # Last chunk of a json_schema request that finished its document: "valid", "invalid" (see
    # schema_violations) or "unchecked" (schema_check_detail says why); None otherwise.
    schema_check: str | None = None
    schema_violations: list[SchemaViolation] = field(default_factory=list)
    schema_check_detail: str = ""
    index: int = 0


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    warnings: list[SchemaWarning] = field(default_factory=list)
    schema_check: str | None = None  # as on Chunk
    schema_violations: list[SchemaViolation] = field(default_factory=list)
    schema_check_detail: str = ""
    index: int = 0  # which of the request's n completions this is


class InferenceError(Exception):
    """A failed RPC: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> InferenceError:
        # Sync and aio errors both implement code()/details(); details() may be None.
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else None
        return cls(code, details or str(error))


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of `build_request`, for the clients' generate/complete."""

    json_schema: str | dict[str, Any] | None
    regex: str | None
    ebnf: str | None
    choice: Sequence[str] | None
    json_object: bool
    structural_tag: str | dict[str, Any] | None
    disable_jump_forward: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    min_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float] | None
    min_p: float
    stop_token_ids: Sequence[int]
    include_stop_str_in_output: bool
    json_options: dict[str, Any] | None
    tools: Sequence[dict[str, Any]]
    tool_choice: str | None
    reasoning: bool | None
    max_thinking_tokens: int
    chat_template_kwargs: Mapping[str, Any] | None
    parallel_tool_calls: bool | None
    request_id: str
    strict_schema: bool
    grammar_backend: str
    n: int


# A prompt: text, chat messages ({"role", "content", ...} dicts, as OpenAI's), or token ids.
Prompt = str | Sequence[dict[str, Any]] | Sequence[int]
_WHITESPACE = {"compact": pb.JSON_WHITESPACE_COMPACT, "flexible": pb.JSON_WHITESPACE_FLEXIBLE,
               "indented": pb.JSON_WHITESPACE_INDENTED}
_GRAMMAR_BACKEND = {"auto": pb.GRAMMAR_BACKEND_AUTO, "xgrammar": pb.GRAMMAR_BACKEND_XGRAMMAR,
                    "llguidance": pb.GRAMMAR_BACKEND_LLGUIDANCE}
_TOOL_CHOICE = {"auto": pb.TOOL_CHOICE_MODE_AUTO, "required": pb.TOOL_CHOICE_MODE_REQUIRED,
                "none": pb.TOOL_CHOICE_MODE_NONE}


def build_request(prompt: Prompt, *,
                  json_schema: str | dict[str, Any] | None = None,
                  regex: str | None = None,
                  ebnf: str | None = None,
                  choice: Sequence[str] | None = None,
                  json_object: bool = False,
                  structural_tag: str | dict[str, Any] | None = None,
                  disable_jump_forward: bool = False,
                  max_tokens: int = 0,
                  temperature: float = 0.0,
                  top_p: float = 0.0,
                  top_k: int = 0,
                  seed: int | None = None,
                  stop: Sequence[str] | str = (),
                  ignore_eos: bool = False,
                  logprobs: bool = False,
                  top_logprobs: int = 0,
                  min_tokens: int = 0,
                  repetition_penalty: float = 0.0,
                  presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0,
                  logit_bias: Mapping[int, float] | None = None,
                  min_p: float = 0.0,
                  stop_token_ids: Sequence[int] = (),
                  include_stop_str_in_output: bool = False,
                  json_options: dict[str, Any] | None = None,
                  tools: Sequence[dict[str, Any]] = (),
                  tool_choice: str | None = None,
                  reasoning: bool | None = None,
                  max_thinking_tokens: int = 0,
                  chat_template_kwargs: Mapping[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None,
                  request_id: str = "",
                  strict_schema: bool = False,
                  grammar_backend: str = "",
                  n: int = 1) -> pb.GenerateRequest:
    """The GenerateRequest for these arguments.

    At most one constraint kind (json_schema, regex, ebnf, choice, json_object,
    structural_tag) may be given; none means unconstrained generation, and then
    disable_jump_forward has nothing to apply to and is ignored. dict schemas
    and structural tags are sent as JSON text. Zero sampling values mean the
    server default / disabled; seed None means a random seed, seed 0 is a seed,
    a negative seed (OpenAI's and vLLM's are int64) its 64-bit two's
    complement. top_logprobs (0 to 20 alternatives per token) implies logprobs.
    presence_penalty / frequency_penalty (-2 to 2), logit_bias ({token id:
    bias in [-100, 100]}, at most 300), min_p (0 to 1), stop_token_ids and
    include_stop_str_in_output are OpenAI's and vLLM's; the server checks them.

    prompt is text, chat messages (OpenAI-style dicts; an assistant's
    "tool_calls" as returned in Completion.tool_calls or OpenAI's shape) or
    token ids. json_options: {"whitespace": "compact"|"flexible"|"indented",
    "max_whitespace_count", "indent", "lenient", "any_key_order"}. tools:
    {"name", "description", "parameters"} dicts (or OpenAI's {"type":
    "function", "function": {...}}); tool_choice "auto", "required", "none"
    or a tool's name. reasoning None leaves thinking to the chat template.
    chat_template_kwargs (messages prompts only): extra chat template variables,
    vLLM's; a name the template uses itself is refused by the server.
    parallel_tool_calls False: one tool call at most (None: any number).
    strict_schema (json_schema only): refuse a schema with keywords the grammar
    does not enforce (INVALID_ARGUMENT naming each) instead of generating.
    grammar_backend (with a constraint): "auto", "xgrammar" or "llguidance",
    the library serving the grammar ("" = the grammar replica's
    --grammar-backend).
    n: completions of the prompt (0 = 1; the server refuses more than its
    --max-n), each with its own seed (seed + its index when seed is given).
    """
    if isinstance(choice, str):
        # A bare string would silently become one choice per character.
        raise TypeError("choice must be a sequence of strings, not a string")
    if isinstance(stop, str):
        stop = (stop,)
    kinds: dict[str, Any] = {
        "json_schema": _json_text(json_schema),
        "regex": regex,
        "ebnf": ebnf,
        "choice": None if choice is None else pb.ChoiceList(choices=choice),
        "json_object": True if json_object else None,
        "structural_tag": _json_text(structural_tag),
    }
    given = [name for name, value in kinds.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"at most one constraint kind may be given, got {', '.join(given)}")

    if seed is not None and -(2**63) <= seed < 0:
        seed %= 2**64  # the proto's seed is a uint64: -1 is 2**64 - 1, as the gateway maps it
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                   logprobs=logprobs, top_logprobs=top_logprobs, min_tokens=min_tokens,
                                   repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                   frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias or {}),
                                   min_p=min_p, stop_token_ids=stop_token_ids,
                                   include_stop_str_in_output=include_stop_str_in_output),
    )
    if n != 1:  # 1 is the proto's default (0): a request for one completion is what it was before n existed
        request.sampling.n = n
    _set_prompt(request, prompt)
    if given:
        request.constraint.CopyFrom(
            pb.Constraint(**{given[0]: kinds[given[0]]}, disable_jump_forward=disable_jump_forward))
    if strict_schema:
        request.constraint.strict_schema = True
    if grammar_backend:
        if grammar_backend not in _GRAMMAR_BACKEND:
            raise ValueError(f"grammar_backend must be one of {', '.join(_GRAMMAR_BACKEND)}, got {grammar_backend!r}")
        request.constraint.backend = _GRAMMAR_BACKEND[grammar_backend]
    if json_options is not None:
        o = dict(json_options)
        whitespace = o.pop("whitespace", "compact")
        if whitespace not in _WHITESPACE:
            raise ValueError(f"json_options whitespace must be one of {', '.join(_WHITESPACE)}, got {whitespace!r}")
        request.constraint.json_options.CopyFrom(pb.JsonOptions(whitespace=_WHITESPACE[whitespace], **o))
    for t in tools:
        f = t.get("function", t) if t.get("type", "function") == "function" else t
        request.tools.add(name=f["name"], description=f.get("description", ""),
                          parameters_json_schema=_json_text(f.get("parameters")) or "")
    if tool_choice is not None:
        mode = _TOOL_CHOICE.get(tool_choice, pb.TOOL_CHOICE_MODE_NAMED)
        request.tool_choice.CopyFrom(pb.ToolChoice(mode=mode, name=tool_choice if mode == pb.TOOL_CHOICE_MODE_NAMED
                                                   else ""))
    if reasoning is not None:
        request.reasoning = reasoning
    request.max_thinking_tokens = max_thinking_tokens
    if chat_template_kwargs:
        request.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request


def _set_prompt(request: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and all(isinstance(x, int) for x in prompt):
        request.prompt_token_ids.extend(prompt)
    else:
        for m in prompt:
            if not isinstance(m, dict):
                raise TypeError("a prompt is a string, a list of message dicts or a list of token ids")
            msg = request.messages.add(role=m.get("role", ""), content=m.get("content") or "",
                                       name=m.get("name", ""), tool_call_id=m.get("tool_call_id", ""),
                                       reasoning_content=m.get("reasoning_content", ""))
            for c in m.get("tool_calls", ()):
                if isinstance(c, ToolCall):
                    msg.tool_calls.add(id=c.id, name=c.name, arguments_json=c.arguments_json)
                else:  # OpenAI's shape
                    f = c.get("function", c)
                    msg.tool_calls.add(id=c.get("id", ""), name=f["name"],
                                       arguments_json=_json_text(f.get("arguments")) or "{}")


def _json_text(value: str | dict[str, Any] | None) -> str | None:
    return json.dumps(value) if isinstance(value, dict) else value


def finish_reason_name(value: int) -> str | None:
    """Lower-case name of a FinishReason value; None for UNSPECIFIED (not the last response)."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    # A reason added to the proto after this client was built is still an end.
    return FINISH_REASONS.get(value, f"unknown_{value}")


def _chunk(response: pb.GenerateResponse) -> Chunk:
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.forced_tokens, u.reasoning_tokens,
                      u.cached_prompt_tokens)
    logprobs = [TokenLogprob(lp.token_id, lp.token_bytes, lp.logprob, lp.forced,
                             [TopLogprob(t.token_id, t.token_bytes, t.logprob) for t in lp.top_logprobs])
                for lp in response.logprobs]
    return Chunk(list(response.token_ids), response.text, finish_reason_name(response.finish_reason), usage,
                 logprobs, response.reasoning_text,
                 [ToolCall(c.id, c.name, c.arguments_json) for c in response.tool_calls],
                 [SchemaWarning(w.keyword, w.json_pointer, w.message) for w in response.warnings],
                 SCHEMA_CHECKS.get(response.schema_check, f"unknown_{response.schema_check}"),
                 [SchemaViolation(v.keyword, v.instance_pointer, v.message) for v in response.schema_violations],
                 response.schema_check_detail, response.index)


class _Collected:
    """One completion's chunks, gathered into its Completion."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.thoughts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls: list[ToolCall] = []
        self.last: Chunk | None = None  # the chunk with the finish reason

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        self.thoughts.append(chunk.reasoning_text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.calls.extend(chunk.tool_calls)
        if chunk.finish_reason is not None:
            self.last = chunk

    def completion(self, index: int, warnings: list[SchemaWarning]) -> Completion:
        last = self.last
        assert last is not None and last.finish_reason is not None
        return Completion("".join(self.texts), self.token_ids, last.finish_reason, last.usage or Usage(0, 0, 0),
                          self.logprobs, "".join(self.thoughts), self.calls, list(warnings), last.schema_check,
                          last.schema_violations, last.schema_check_detail, index)


def _completions(chunks: Iterable[Chunk], n: int) -> list[Completion]:
    """The n completions of a whole stream, in index order; each has the call's warnings (one constraint)."""
    count = max(n, 1)
    collected: dict[int, _Collected] = {}  # by index, as they arrive: n is the caller's, bounded by the server
    warnings: list[SchemaWarning] = []
    for chunk in chunks:
        warnings.extend(chunk.warnings)
        if not 0 <= chunk.index < count:
            raise InferenceError(grpc.StatusCode.UNKNOWN, f"the server sent completion {chunk.index} of a request "
                                                          f"for {count}")
        collected.setdefault(chunk.index, _Collected()).add(chunk)
    finished = sorted(i for i, c in collected.items() if c.last is not None)
    if len(finished) != count:
        raise InferenceError(grpc.StatusCode.UNKNOWN, f"the server ended the stream with {len(finished)} of "
                                                      f"{count} completions finished")
    return [collected[i].completion(i, warnings) for i in finished]


def _one(options: RequestOptions) -> None:
    if options.get("n", 1) not in (0, 1):
        raise ValueError("complete() returns one completion: use complete_all() for n > 1")


PathLike = str | os.PathLike[str]


def _client_tls(tls_ca_file: PathLike | None, tls_cert_file: PathLike | None,
                tls_key_file: PathLike | None) -> ClientTls | None:
    """The keyword arguments as a ClientTls (None: none given); ValueError naming what is wrong."""
    tls = client_tls(*(Path(p) if p is not None else None for p in (tls_ca_file, tls_cert_file, tls_key_file)),
                     flag_prefix="tls_")
    if tls is not None and (problems := tls.problems()):
        raise ValueError("; ".join(problems))
    return tls


def _credentials(tls: ClientTls | None, credentials: grpc.ChannelCredentials | None) -> grpc.ChannelCredentials | None:
    if tls is not None and credentials is not None:
        raise ValueError("give credentials or tls_* files, not both")
    return channel_credentials(tls) if tls is not None else credentials


def channel_options(retries: int) -> tuple:
    """The channel's options; retries > 0 adds gRPC's retry policy (shared.grpc_options.service_config: a call
    refused UNAVAILABLE before any response is tried again, round robin over the target's addresses)."""
    if not retries:
        return CHANNEL_OPTIONS
    config = service_config(SERVICE_NAME, retries=retries, round_robin=True)
    return CHANNEL_OPTIONS + (("grpc.service_config", config),)


class InferenceClient:
    """Blocking client. Use as a context manager or call close().

    TLS: tls_ca_file (the CA the server's certificate must come from; omitted with a client certificate: the
    system's roots), tls_cert_file + tls_key_file (the client certificate a mutual-TLS server requires), or
    credentials (any grpc.ChannelCredentials). None of them: plaintext.
    """

    def __init__(self, target: str, channel: grpc.Channel | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, tls_ca_file: PathLike | None = None,
                 tls_cert_file: PathLike | None = None, tls_key_file: PathLike | None = None, retries: int = 0):
        self.target = target
        creds = _credentials(_client_tls(tls_ca_file, tls_cert_file, tls_key_file), credentials)
        options = channel_options(retries)
        self.channel = channel or (grpc.secure_channel(target, creds, options=options) if creds
                                   else grpc.insecure_channel(target, options=options))
        self.stub = pb_grpc.InferenceServiceStub(self.channel)

    def generate(self, prompt: Prompt, *, timeout: float | None = None,
                 **options: Unpack[RequestOptions]) -> Generator[Chunk, None, None]:
        """Streams the completion. Arguments are checked here; the RPC starts
        on the first next(). timeout bounds the whole stream (seconds)."""
        return self._stream(build_request(prompt, **options), timeout)

    def complete(self, prompt: Prompt, *, timeout: float | None = None,
                 **options: Unpack[RequestOptions]) -> Completion:
        """The whole completion at once (collects generate()); n must be 1."""
        _one(options)
        return _completions(self.generate(prompt, timeout=timeout, **options), 1)[0]

    def complete_all(self, prompt: Prompt, *, timeout: float | None = None,
                     **options: Unpack[RequestOptions]) -> list[Completion]:
        """The request's n completions (options' n, default 1), whole, in index order."""
        return _completions(self.generate(prompt, timeout=timeout, **options), options.get("n", 1))

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Generator[Chunk, None, None]:
        call = self.stub.Generate(request, timeout=timeout)
        try:
            for response in call:
                yield _chunk(response)
        except grpc.RpcError as e:
            raise InferenceError.from_rpc_error(e) from e
        finally:
            # No-op once the stream has ended; otherwise the server frees the request.
            call.cancel()

    def wait_ready(self, timeout: float, service: str = "") -> None:
        """Blocks until grpc.health.v1 reports SERVING; TimeoutError after timeout seconds."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                   timeout=min(left, _HEALTH_POLL_TIMEOUT))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not up yet (UNAVAILABLE) or still starting
            time.sleep(min(_HEALTH_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"{self.target} did not become SERVING within {timeout:g} s")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncInferenceClient:
    """asyncio client. Use as an async context manager or await close(). TLS: as InferenceClient's."""

    def __init__(self, target: str, channel: grpc.aio.Channel | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, tls_ca_file: PathLike | None = None,
                 tls_cert_file: PathLike | None = None, tls_key_file: PathLike | None = None, retries: int = 0):
        self.target = target
        creds = _credentials(_client_tls(tls_ca_file, tls_cert_file, tls_key_file), credentials)
        options = channel_options(retries)
        self.channel = channel or (grpc.aio.secure_channel(target, creds, options=options) if creds
                                   else grpc.aio.insecure_channel(target, options=options))
        self.stub = pb_grpc.InferenceServiceStub(self.channel)

    def generate(self, prompt: Prompt, *, timeout: float | None = None,
                 **options: Unpack[RequestOptions]) -> AsyncGenerator[Chunk, None]:
        """Streams the completion (use with `async for`). Arguments are checked
        here; the RPC starts on the first iteration. timeout bounds the whole stream."""
        return self._stream(build_request(prompt, **options), timeout)

    async def complete(self, prompt: Prompt, *, timeout: float | None = None,
                       **options: Unpack[RequestOptions]) -> Completion:
        """The whole completion at once (collects generate()); n must be 1."""
        _one(options)
        return (await self.complete_all(prompt, timeout=timeout, **options))[0]

    async def complete_all(self, prompt: Prompt, *, timeout: float | None = None,
                           **options: Unpack[RequestOptions]) -> list[Completion]:
        """The request's n completions (options' n, default 1), whole, in index order."""
        stream = self.generate(prompt, timeout=timeout, **options)
        try:
            return _completions([chunk async for chunk in stream], options.get("n", 1))
        finally:
            await stream.aclose()

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[Chunk, None]:
        call = self.stub.Generate(request, timeout=timeout)
        try:
            async for response in call:
                yield _chunk(response)
        except grpc.RpcError as e:
            raise InferenceError.from_rpc_error(e) from e
        finally:
            # No-op once the stream has ended; otherwise the server frees the request.
            call.cancel()

    async def wait_ready(self, timeout: float, service: str = "") -> None:
        """Waits until grpc.health.v1 reports SERVING; TimeoutError after timeout seconds."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := deadline - loop.time()) > 0:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=min(left, _HEALTH_POLL_TIMEOUT))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not up yet (UNAVAILABLE) or still starting
            await asyncio.sleep(min(_HEALTH_POLL_INTERVAL, max(0.0, deadline - loop.time())))
        raise TimeoutError(f"{self.target} did not become SERVING within {timeout:g} s")

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
