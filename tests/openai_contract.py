"""The gateway's OpenAI contract, checked on everything it answers in the test suite (issue 27, item 7).

A pytest plugin (conftest's `pytest_plugins`): every gateway a test starts
(GatewayApp.build) is wrapped in `ContractTap`, an ASGI layer that reads each
response as it goes out and validates it against the `openai` package's own
pydantic types, by route: ChatCompletion / ChatCompletionChunk, Completion,
Response / each Responses stream event's own type, Model and the model list,
and OpenAI's error object for every 4xx/5xx (404s and 401s included) and for
a stream's error event. The SDK itself constructs its objects leniently when it
parses, so a field that drifted (a wrong type, a missing required field, a
value outside a Literal) would pass every test that uses it; here it fails
the test during which it was answered, whatever client the test used (the
SDK, raw HTTP, a stream it left early: only complete events are checked).

Validation is pydantic's strict mode (no str->int coercion and the like), and
every object's fields must be ones its SDK type declares (the SDK keeps
unknown fields in `model_extra`; any there fails) except these, which the
README documents as structd's extensions:
  - `structd`: structd's own object (schema warnings, schema_check) on any
    response, chunk or choice;
  - `reasoning` and `reasoning_content` (its older name, as vLLM) on a chat
    message or delta and on a legacy completion choice.
Two deliberate deviations from the SDK's types, both OpenAI's own wire
behaviour the types do not express: a legacy completion stream chunk's
`finish_reason` is null until the choice's last chunk (the SDK reuses
`Completion`, whose finish_reason is required), and vLLM's /tokenize and
/detokenize (not in the SDK) are checked against vLLM's response shapes here.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

import pydantic
import pytest
from openai import BaseModel as SdkModel
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject

# Fields a type's objects may carry beyond what the SDK declares: structd's documented extensions.
EXTENSIONS: dict[type, frozenset[str]] = {
    ChatCompletion: frozenset({"structd"}),
    ChatCompletionChunk: frozenset({"structd"}),
    Completion: frozenset({"structd"}),
    ChatCompletionMessage: frozenset({"reasoning", "reasoning_content"}),
    ChoiceDelta: frozenset({"reasoning", "reasoning_content"}),
    CompletionChoice: frozenset({"reasoning", "reasoning_content", "structd"}),
    Model: frozenset({"max_model_len"}),
    Response: frozenset({"structd", "store"}),
}
# Chat choices (whole and streamed) carry their own schema check with n > 1.
for _model in (ChatCompletion, ChatCompletionChunk):
    EXTENSIONS[typing.get_args(_model.model_fields["choices"].annotation)[0]] = frozenset({"structd"})

# Each Responses event type's own model (the union's complaint would list every member's).
RESPONSES_EVENTS: dict[str, type[SdkModel]] = {
    typing.get_args(m.model_fields["type"].annotation)[0]: m
    for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


class CompletionChunkChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionChunk(Completion):
    """A legacy completion stream chunk: OpenAI's wire shape (finish_reason null until the last chunk)."""
    choices: list[CompletionChunkChoice]


EXTENSIONS[CompletionChunk] = EXTENSIONS[Completion]
EXTENSIONS[CompletionChunkChoice] = EXTENSIONS[CompletionChoice]


class ModelList(SdkModel):
    object: Literal["list"]
    data: list[Model]


class ErrorBody(SdkModel):
    error: ErrorObject


class TokenizeResponse(SdkModel):
    """vLLM's /tokenize answer."""
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(SdkModel):
    """vLLM's /detokenize answer."""
    prompt: str


BODIES: dict[str, type[SdkModel]] = {
    "/v1/chat/completions": ChatCompletion, "/v1/completions": Completion, "/v1/responses": Response,
    "/v1/models": ModelList, "/tokenize": TokenizeResponse, "/detokenize": DetokenizeResponse,
}
CHUNKS: dict[str, type[SdkModel]] = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": CompletionChunk}
# Not OpenAI objects: the probes' own shapes.
UNCHECKED = ("/health", "/metrics")

violations: list[str] = []


def unknown_fields(obj: Any, where: str = "$") -> list[str]:
    """Paths of the fields the SDK types do not declare, other than the EXTENSIONS allowed on that type."""
    out = []
    if isinstance(obj, pydantic.BaseModel):
        allowed = EXTENSIONS.get(type(obj), frozenset())
        out += [f"{where}.{k} (on {type(obj).__name__})" for k in (obj.model_extra or {}) if k not in allowed]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{where}.{name}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            out += unknown_fields(item, f"{where}[{i}]")
    return out


def check(model: type[SdkModel], data: Any) -> None:
    """data validates strictly as `model`, with no field the SDK does not know (bar EXTENSIONS)."""
    parsed = model.model_validate(data, strict=True)
    extra = unknown_fields(parsed)
    if extra:
        raise ValueError(f"fields {model.__name__} does not declare: {', '.join(extra)}")


def check_body(path: str, status: int, data: Any) -> None:
    if status >= 400:
        check(ErrorBody, data)
    elif path.startswith("/v1/models/"):
        check(Model, data)
    elif path in BODIES:
        check(BODIES[path], data)
    else:
        raise ValueError(f"a {status} answer on a path the contract does not know")


def check_event(path: str, name: str | None, data: str) -> None:
    """One server-sent event of a stream on `path` (name: its `event:` line, if any)."""
    if path == "/v1/responses":
        event = json.loads(data)
        if name != event.get("type"):
            raise ValueError(f"event line {name!r} differs from the data's type {event.get('type')!r}")
        model = RESPONSES_EVENTS.get(event["type"])
        if model is None:
            raise ValueError(f"{event['type']!r} is not a Responses stream event type")
        check(model, event)
        return
    if data == "[DONE]":
        return
    event = json.loads(data)
    check(ErrorBody if "error" in event else CHUNKS[path], event)


class ContractTap:
    """ASGI middleware: validates each response the app sends (see the module docstring); what it finds is
    appended to `violations`, which fails the test that was running."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        # A CORS preflight (OPTIONS) is the browser's protocol, answered in plain text by Starlette's CORS layer.
        if scope["type"] != "http" or scope["path"] in UNCHECKED or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path, state = scope["path"], {"status": 0, "stream": False, "buffer": b""}

        def violation(what: str, e: Exception) -> None:
            violations.append(f"{scope['method']} {path} ({state['status']}): {what}: {e}")

        async def tapped(message):
            try:
                if message["type"] == "http.response.start":
                    state["status"] = message["status"]
                    headers = dict((k.decode().lower(), v.decode()) for k, v in message.get("headers", []))
                    state["stream"] = headers.get("content-type", "").startswith("text/event-stream")
                elif message["type"] == "http.response.body":
                    state["buffer"] += message.get("body", b"")
                    if state["stream"]:
                        *events, state["buffer"] = state["buffer"].split(b"\n\n")
                        for raw in events:
                            self._event(path, raw.decode(), violation)
                    elif not message.get("more_body", False) and state["buffer"] and state["status"] != 499:
                        text = state["buffer"].decode()
                        try:
                            check_body(path, state["status"], json.loads(text))
                        except (ValueError, pydantic.ValidationError) as e:
                            violation(text[:600], e)
            except Exception as e:  # noqa: BLE001 - the tap's own failure must not change the answer
                violation("the contract tap failed", e)
            await send(message)

        await self.app(scope, receive, tapped)

    @staticmethod
    def _event(path: str, raw: str, violation) -> None:
        name, data = None, []
        for line in raw.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
            elif line:
                violation(raw[:600], ValueError(f"not a server-sent event line: {line!r}"))
                return
        try:
            check_event(path, name, "\n".join(data))
        except (ValueError, KeyError, pydantic.ValidationError) as e:
            violation(raw[:600], e)


def _tap_every_gateway() -> None:
    from gateway.app import GatewayApp

    build = GatewayApp.build
    if getattr(build, "tapped", False):
        return

    def tapped_build(self):
        return ContractTap(build(self))

    tapped_build.tapped = True
    GatewayApp.build = tapped_build


_tap_every_gateway()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    violations.clear()
    result = yield
    if violations:
        found, violations[:] = list(violations), []
        raise AssertionError("the gateway answered outside the OpenAI SDK's types (tests/openai_contract.py):\n"
                             + "\n".join(found))
    return result
