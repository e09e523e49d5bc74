"""What a client asks for, turned into what the engine runs.

A client sends a chat (or a prompt, or token ids), maybe tools and a
thinking preference; the engine runs a prompt under a constraint. In
between: the chat is rendered by the model's template (tools shown to the
model, thinking switched on or off), the tools become a structural tag in
the model family's tool-call format so every call's arguments are valid,
and each response gets a parser that cuts those calls out of its text.

Admission comes first, before any of that work: a request whose messages
alone pass --max-prompt-bytes is refused by its size, and requests being
prepared (tools converted, template rendered) count against --max-waiting,
so a flood of large chats is refused at the door instead of queueing
renders. Tool conversion runs on a few threads of its own under a deadline
(the compile timeout): a hostile schema holds one of them, never the
event loop or the renders of other requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from inference_svc.api.chat import NO_TEMPLATE, ChatMessage, ChatTemplate
from inference_svc.api.model_family import ModelFamily
from inference_svc.api.tool_calls import ToolCallParser, ToolChoice, ToolSpec, tool_call_structural_tag, validate_tools
from inference_svc.config import EngineConfig
from inference_svc.engine.engine import Prompt
from inference_svc.engine.request import Output
from inference_svc.engine.sampling import SamplingOptions
from inference_svc.types import Constraint, SchemaWarning, ToolCallReader
from shared import errors

# Threads converting tools' schemas to grammar text: CPU work under the GIL, so a few at most.
TOOL_CONVERSION_THREADS = 2
# The conversion's deadline when the server sets no --compile-timeout-seconds (the grammar tier's default).
DEFAULT_TOOL_CONVERSION_SECONDS = 30.0


class SubmittedRequest(Protocol):
    """A request the engine accepted, as the API layer reads it: its outputs, and its compile warnings
    (known by its first output)."""

    @property
    def outputs(self) -> asyncio.Queue[Output]: ...

    @property
    def warnings(self) -> tuple[SchemaWarning, ...]: ...


class ServingEngine(Protocol):
    """The engine as the API layer talks to it, wherever it runs (vLLM's EngineClient protocol).

    engine.Engine in this process; core.engine_client.EngineClient, which
    forwards each call to the engine core process, with `--engine-process on`.
    """

    @property
    def config(self) -> EngineConfig: ...

    @property
    def max_model_len(self) -> int: ...

    async def submit(self, prompt: Prompt | str, options: SamplingOptions, *, constraint: Constraint | None = None,
                     jump_forward: bool = True, request_id: str = "", reasoning: bool | None = None,
                     max_thinking_tokens: int = 0, tool_parser: ToolCallReader | None = None,
                     end_client: str = "") -> SubmittedRequest:
        ...

    def cancel(self, req: SubmittedRequest) -> None:
        """The client went away (or its stream ended): the request's KV blocks and grammar session are freed."""


@dataclass(frozen=True)
class ClientRequest:
    """One Generate call in domain terms (the servicer builds it from protobuf)."""

    options: SamplingOptions
    constraint: Constraint | None = None
    jump_forward: bool = True
    request_id: str = ""
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None  # None: auto
    reasoning: bool | None = None  # None: the template's default
    max_thinking_tokens: int = 0
    template_kwargs: Mapping[str, object] = field(default_factory=dict)  # the request's own template variables
    parallel_tool_calls: bool = True  # false: at most one tool call
    # Who the request is for, as the caller's certificate (and the gateway's API key) says; counted apart by
    # the grammar tier's per-caller compile limit ("": the caller itself).
    end_client: str = ""


@dataclass(frozen=True)
class ServingInfo:
    """What a replica serves, as GetModelInfo reports it."""

    model_id: str
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    family: str
    loaded_unix_seconds: int


class Frontend:
    def __init__(self, engine: ServingEngine, template: ChatTemplate | None, family: ModelFamily | None):
        self.engine = engine
        self.template = template
        self.family = family
        self.preparing = 0  # requests admitted and not yet handed to the engine
        self._conversions = ThreadPoolExecutor(TOOL_CONVERSION_THREADS, thread_name_prefix="structd-tools")

    async def submit(self, r: ClientRequest) -> SubmittedRequest:
        given = [name for name, value in (("prompt", r.prompt), ("messages", r.messages),
                                          ("prompt_token_ids", r.prompt_token_ids)) if value]
        if len(given) != 1:
            raise errors.InvalidRequestError(
                f"give exactly one of prompt, messages and prompt_token_ids (got {' and '.join(given)})" if given
                else "the prompt is empty: give exactly one of prompt, messages and prompt_token_ids")
        self._admit(r)
        self.preparing += 1
        try:
            constraint, parser = await self._with_tools(r) if r.tools else (r.constraint, self._no_tools(r))
            if r.messages:
                if self.template is None or not self.template.available:
                    raise errors.InvalidRequestError(NO_TEMPLATE)
                # Rendering runs a (sandboxed) template over client data: off the event loop, like tokenizing.
                text = await asyncio.to_thread(self.template.render, list(r.messages), list(r.tools), r.reasoning,
                                               template_kwargs=r.template_kwargs)
                prompt = Prompt(text, templated=True)
            else:
                prompt = Prompt(r.prompt, tuple(r.prompt_token_ids))
            return await self.engine.submit(prompt, r.options, constraint=constraint, jump_forward=r.jump_forward,
                                            request_id=r.request_id, reasoning=r.reasoning,
                                            max_thinking_tokens=r.max_thinking_tokens, tool_parser=parser,
                                            end_client=r.end_client)
        finally:
            self.preparing -= 1

    def _admit(self, r: ClientRequest) -> None:
        """Refuses, before any rendering or conversion, a request too large to ever pass or one past the queue."""
        config = self.engine.config
        if r.messages:
            size = sum(m.text_bytes() for m in r.messages)
            if size > config.max_prompt_bytes:
                raise errors.RequestTooLargeError(
                    f"messages hold {size} bytes of text; this server accepts prompts of at most "
                    f"{config.max_prompt_bytes} bytes (--max-prompt-bytes)")
        if self.preparing >= config.max_waiting:
            raise errors.LimitExceededError(
                f"{self.preparing} requests are already being prepared (tools, chat template), this server's "
                "--max-waiting; retry later or on another replica")

    async def _with_tools(self, r: ClientRequest) -> tuple[Constraint | None, ToolCallParser | None]:
        """_tools on a conversion thread, within the compile deadline (the thread finishes its schema
        regardless: the request does not wait for it)."""
        seconds = self.engine.config.compile_timeout_seconds or DEFAULT_TOOL_CONVERSION_SECONDS
        work = asyncio.get_running_loop().run_in_executor(self._conversions, self._tools, r)
        try:
            return await asyncio.wait_for(work, seconds)
        except TimeoutError:
            raise errors.CompileTimeoutError(
                f"the tools' parameters schemas did not become a grammar within {seconds:g} s (the compile "
                "deadline, --compile-timeout-seconds): simplify them") from None

    def close(self) -> None:
        self._conversions.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _no_tools(r: ClientRequest) -> None:
        if r.tool_choice is not None and r.tool_choice.mode in ("required", "named"):
            raise errors.InvalidRequestError(f"tool_choice {r.tool_choice.mode} needs tools")

    def _tools(self, r: ClientRequest) -> tuple[Constraint | None, ToolCallParser | None]:
        """The answer's constraint with the tools folded in, and the parser for their calls."""
        if not r.messages:
            raise errors.InvalidRequestError("tools need messages: only a chat template can show them to the model")
        family = self.family
        if family is None or family.tool_calls is None:
            raise errors.InvalidRequestError(
                "this server knows no tool-call format for its model; start it with --model-family NAME|FILE")
        choice = r.tool_choice or ToolChoice("auto")
        validate_tools(r.tools, choice)
        tag = tool_call_structural_tag(family, r.tools, choice, r.constraint, parallel=r.parallel_tool_calls)
        constraint = r.constraint if tag is None else Constraint(
            "structural_tag", json.dumps(tag), backend=r.constraint.backend if r.constraint else "")
        if choice.mode == "none":
            return constraint, None
        callable_tools = choice.callable_tools(r.tools)
        return constraint, ToolCallParser(family, [t.name for t in callable_tools],
                                          {t.name: t.arguments_schema() for t in callable_tools})
