"""Chat messages and the chat template that turns a conversation into the model's prompt text.

The template is the model's own (its tokenizer's `chat_template`) unless the
server is given one (`--chat-template FILE`). Rendering goes through
transformers' `apply_chat_template`, whose Jinja environment is sandboxed:
a template cannot reach the server's objects, and message text is data,
never evaluated as template code. Tools and past tool calls are handed to
the template in the OpenAI function format, which templates expect. A
request's own template variables (vLLM's `chat_template_kwargs`) reach the
template too, except under a name the template already uses for something
else (messages, tools, add_generation_prompt, a special token such as
bos_token, or one of apply_chat_template's own parameters, which would
change how it renders rather than what).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from inference_svc.api.tool_calls import ToolSpec
from inference_svc.types import ParsedToolCall
from shared.errors import InvalidRequestError, RequestTooLargeError
from shared.json_nesting import check_nesting

ROLES = ("system", "user", "assistant", "tool")
NO_TEMPLATE = ("this model has no chat template; send prompt or prompt_token_ids, or start the server with "
               "--chat-template FILE")


# chat_template_kwargs: a request-shape bound (a few flags and short strings is what templates read).
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# The names transformers' renderer itself gives the template (beyond apply_chat_template's parameters and
# the tokenizer's special tokens, found at run time).
_TEMPLATE_GLOBALS = frozenset({"messages", "raise_exception", "strftime_now", "dict", "namespace"})


def parse_template_kwargs(text: str) -> dict:
    """chat_template_kwargs' JSON text (one object) as a dict; empty text: none."""
    if not text:
        return {}
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise RequestTooLargeError(f"chat_template_kwargs is {size} bytes; at most {MAX_TEMPLATE_KWARGS_BYTES} "
                                   "are accepted")
    check_nesting(text, "chat_template_kwargs")  # before json.loads recurses into it
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:  # the client's text
        raise InvalidRequestError(
            f"chat_template_kwargs is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"chat_template_kwargs must be a JSON object, got {type(value).__name__}")
    for key in value:
        if not _KWARG_NAME.fullmatch(key):
            raise InvalidRequestError(f"chat_template_kwargs: {key!r} is not a template variable name (use 1 to 64 "
                                      "letters, digits and '_', not starting with a digit)")
    return value


class ChatTemplateError(ValueError):
    """A --chat-template file that cannot be used (the server's configuration, not a request)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str = ""
    name: str = ""
    tool_call_id: str = ""  # role "tool": the call it answers
    tool_calls: tuple[ParsedToolCall, ...] = ()  # role "assistant": the calls it made
    reasoning_content: str = ""  # role "assistant": its thinking

    def text_bytes(self) -> int:
        """UTF-8 bytes of the client's text in it: what the rendered prompt holds at least."""
        texts = [self.content, self.name, self.tool_call_id, self.reasoning_content]
        texts += [t for c in self.tool_calls for t in (c.id, c.name, c.arguments_json)]
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    def as_template_dict(self) -> dict:
        """The message as chat templates read it (OpenAI's shape; unset fields left out)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}}
                                 for c in self.tool_calls]
        if self.reasoning_content:
            # Templates read either name (vLLM's current one, or the older one).
            out["reasoning"] = out["reasoning_content"] = self.reasoning_content
        return out


def tool_as_template_dict(tool: ToolSpec) -> dict:
    """A tool in the OpenAI function format."""
    parameters = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": parameters}}


class ChatTemplate:
    """A tokenizer's chat template, or the server's override of it."""

    def __init__(self, tokenizer, source: str | dict | None, origin: str):
        self._tokenizer = tokenizer
        self._source = source  # template text, or transformers' dict of named templates
        self.origin = origin  # where the template came from, for logs: a path or "the tokenizer"
        self._reserved: frozenset[str] | None = None

    @property
    def reserved_names(self) -> frozenset[str]:
        """Variable names a request's chat_template_kwargs may not use."""
        if self._reserved is None:
            from transformers.utils.chat_template_utils import render_jinja_template

            names = set(_TEMPLATE_GLOBALS)
            for fn in (self._tokenizer.apply_chat_template, render_jinja_template):
                names.update(p.name for p in inspect.signature(fn).parameters.values()
                             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
            names.update(getattr(self._tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()))
            names.update(getattr(self._tokenizer, "special_tokens_map", {}) or {})
            self._reserved = frozenset(names)
        return self._reserved

    @staticmethod
    def load(tokenizer, override_path: str | Path | None = None) -> ChatTemplate:
        """The override file's template when given (checked for syntax here), else the tokenizer's own."""
        if override_path is None:
            return ChatTemplate(tokenizer, getattr(tokenizer, "chat_template", None), "the tokenizer")
        path = Path(override_path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:  # the operator's file
            raise ChatTemplateError(f"--chat-template {path}: cannot read it: {e}") from None
        if not text.strip():
            raise ChatTemplateError(f"--chat-template {path}: the file is empty")
        template = ChatTemplate(tokenizer, text, str(path))
        template._check_syntax()
        return template

    @property
    def available(self) -> bool:
        return bool(self._source)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (),
               reasoning: bool | None = None, *, add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, object] | None = None) -> str:
        """The prompt text for `messages`, ending with the generation prompt (the assistant's turn) unless
        add_generation_prompt is false (Tokenize's choice).

        `reasoning` (when not None) reaches the template as both `thinking`
        and `enable_thinking`, the names templates read, over any
        `template_kwargs` of those names (the request's own variables).
        """
        if not self.available:
            raise InvalidRequestError(NO_TEMPLATE)
        if not messages:
            raise InvalidRequestError("messages is empty: give at least one message")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidRequestError(f"messages[{i}]: unknown role {m.role!r} (use one of {', '.join(ROLES)})")
            if m.tool_calls and m.role != "assistant":
                raise InvalidRequestError(f"messages[{i}]: only assistant messages carry tool_calls, not {m.role}")
        kwargs = dict(template_kwargs or {})
        clash = sorted(set(kwargs) & self.reserved_names)
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs: {clash[0]!r} is one of the chat template's own "
                                      "variables and cannot be set by a request; rename it")
        if reasoning is not None:
            kwargs.update(thinking=reasoning, enable_thinking=reasoning)
        return self._apply([m.as_template_dict() for m in messages],
                           [tool_as_template_dict(t) for t in tools] or None, kwargs, add_generation_prompt)

    def _template_text(self, with_tools: bool) -> str:
        source = self._source
        if isinstance(source, dict):
            # Named templates (transformers' convention): "tool_use" serves requests with tools when there is one.
            name = "tool_use" if with_tools and "tool_use" in source else "default"
            if name not in source:
                raise InvalidRequestError(f"this model's chat templates ({', '.join(sorted(source))}) include no "
                                          "default one; start the server with --chat-template FILE")
            return source[name]
        return source

    def _apply(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
               add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._render(messages, tools, kwargs, add_generation_prompt)
        except jinja2.TemplateError as e:  # the template refused this conversation (raise_exception) or failed on it
            raise InvalidRequestError(f"the chat template cannot render these messages: {e.message or e}") from None
        except (TypeError, ValueError, LookupError) as e:  # the template's code failed on this conversation's data
            raise InvalidRequestError(
                f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def _render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                add_generation_prompt: bool = True) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self._template_text(tools is not None), tokenize=False,
            add_generation_prompt=add_generation_prompt, **kwargs)

    def _check_syntax(self) -> None:
        """Renders a one-message conversation: a template that does not parse fails the server's start."""
        import jinja2

        try:
            self._render([{"role": "user", "content": "hello"}], None, {})
        except jinja2.TemplateSyntaxError as e:  # the operator's template does not parse
            raise ChatTemplateError(f"--chat-template {self.origin}: line {e.lineno}: {e.message}") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError):
            # The template's own rule for this sample conversation (it may want a system message, say), not a
            # broken template: the requests it refuses get its message.
            pass
