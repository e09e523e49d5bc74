"""What a client asks for, turned into what the engine runs.

A client sends a chat (or a prompt, or token ids), maybe tools and a
thinking preference; the engine runs a prompt under a constraint. In
between: the chat is rendered by the model's template (tools shown to the
model, thinking switched on or off), the tools become a structural tag in
the model family's tool-call format so every call's arguments are valid,
and each response gets a parser that cuts those calls out of its text.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
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
                     max_thinking_tokens: int = 0, tool_parser: ToolCallReader | None = None) -> SubmittedRequest:
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

    async def submit(self, r: ClientRequest) -> SubmittedRequest:
        given = [name for name, value in (("prompt", r.prompt), ("messages", r.messages),
                                          ("prompt_token_ids", r.prompt_token_ids)) if value]
        if len(given) != 1:
            raise errors.InvalidRequestError(
                f"give exactly one of prompt, messages and prompt_token_ids (got {' and '.join(given)})" if given
                else "the prompt is empty: give exactly one of prompt, messages and prompt_token_ids")
        # Tools turn schemas into grammar text (cached, but a big schema takes a while): off the event loop.
        constraint, parser = await asyncio.to_thread(self._tools, r) if r.tools else (r.constraint, self._no_tools(r))
        if r.messages:
            if self.template is None or not self.template.available:
                raise errors.InvalidRequestError(NO_TEMPLATE)
            # Rendering runs a (sandboxed) template over client data: off the event loop, like tokenizing.
            text = await asyncio.to_thread(self.template.render, list(r.messages), list(r.tools), r.reasoning)
            prompt = Prompt(text, templated=True)
        else:
            prompt = Prompt(r.prompt, tuple(r.prompt_token_ids))
        return await self.engine.submit(prompt, r.options, constraint=constraint, jump_forward=r.jump_forward,
                                        request_id=r.request_id, reasoning=r.reasoning,
                                        max_thinking_tokens=r.max_thinking_tokens, tool_parser=parser)

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
        tag = tool_call_structural_tag(family, r.tools, choice, r.constraint)
        constraint = r.constraint if tag is None else Constraint("structural_tag", json.dumps(tag))
        return constraint, (None if choice.mode == "none" else ToolCallParser(family, [t.name for t in r.tools]))
