"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat translation.

A Responses request is a chat completion in another shape: `input` (a
string, or message / function_call / function_call_output / reasoning
items) and `instructions` become `messages`, `text.format` becomes
`response_format`, the flat function tools and `tool_choice` become chat's
nested ones, `max_output_tokens` `max_completion_tokens` and
`reasoning.effort` `reasoning_effort`. `responses_request` reshapes the body
and hands it to `chat_request`, so both endpoints make the same
GenerateRequest from the same rules; a 400 the chat translation raises names
the Responses parameter (`text.format.schema`, `input[2].content`), not the
chat one it was checked as.

structd keeps no conversation state: `previous_response_id`, `store: true`,
`background` and `conversation` are refused with a 400 rather than
ignored, and so is what it cannot produce (hosted tools, logprobs).

`ResponsesReply` shapes the answer: the Response object (reasoning item,
message with output_text, function_call items, usage) and, streamed, the
Responses events with their sequence numbers, from response.created to
response.completed (response.incomplete when max_output_tokens cut it).
docs/openai.md, "Responses API", documents every decision made here.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.body import Fields
from gateway.errors import ApiError, InvalidParameterError
from gateway.translation.request import Translated, _json_text, chat_request
from gateway.translation.response import _Choice, _Reply, usage, warnings, with_structd
from shared.gen.inference.v1 import inference_service_pb2 as pb

# Chat fields a Responses body may carry with the same meaning (OpenAI's sampling ones and vLLM's extensions).
PASSTHROUGH = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "seed", "stop", "top_k", "min_p",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
               "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "structured_outputs",
               "chat_template_kwargs", "thinking_token_budget")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# Stateless: what would need a stored response or conversation.
STATEFUL = {"previous_response_id": "'previous_response_id' is not supported: structd stores no responses. Send "
                                    "the whole conversation in 'input' (the earlier output items included).",
            "conversation": "'conversation' is not supported: structd stores no conversations. Send the whole "
                            "conversation in 'input'.",
            "prompt": "'prompt' (a stored prompt template) is not supported: send 'instructions' and 'input'."}
# Where the chat translation's parameter names point in a Responses body (the messages, by index, apart).
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"^response_format\.json_schema\b", "text.format"), (r"^response_format\b", "text.format"),
    (r"^tools\[(\d+)\]\.function\b", r"tools[\1]"),
    (r"^tool_choice\.allowed_tools\.tools\[(\d+)\]\.function\b", r"tool_choice.tools[\1]"),
    (r"^tool_choice\.allowed_tools\b", "tool_choice"), (r"^tool_choice\.function\b", "tool_choice"),
    (r"^max_completion_tokens\b", "max_output_tokens"), (r"^reasoning_effort\b", "reasoning.effort"))]


@dataclass(frozen=True)
class ResponsesCall(Translated):
    """A chat translation plus the request fields a Response object repeats back."""

    echo: dict[str, Any] = field(default_factory=dict)


class _Chat:
    """The chat body being built, and which Responses path each of its messages came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []
        self.reasoning = ""  # a reasoning item's text, waiting for the assistant message it precedes

    def add(self, message: dict[str, Any], origin: str) -> None:
        if message["role"] == "assistant" and self.reasoning:
            message["reasoning_content"], self.reasoning = self.reasoning, ""
        self.messages.append(message)
        self.origins.append(origin)

    def renamed(self, e: InvalidParameterError) -> InvalidParameterError:
        """e with the chat body's parameter names replaced by the Responses body's."""
        def rename(text: str, anchored: bool) -> str:
            def one(m: re.Match) -> str:
                return self.origins[int(m.group(1))] if int(m.group(1)) < len(self.origins) else m.group(0)
            text = re.sub(r"^messages\[(\d+)\]" if anchored else r"messages\[(\d+)\]", one, text)
            for pattern, replacement in _RENAMES:
                text = (pattern if anchored else re.compile(pattern.pattern.lstrip("^"))).sub(replacement, text)
            return text
        return InvalidParameterError(rename(e.param, True) if e.param else e.param, rename(str(e), False))


def _text(item: Fields, key: str) -> str:
    """A content given as a string or as text parts (input_text, output_text), as one string."""
    value = item.raw(key)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise item.fail(key, f"'{item.name(key)}' must be a string or an array of input_text parts.")
    texts = []
    for part in item.objects(key):
        kind = part.string("type")
        if kind not in TEXT_PARTS:
            raise part.fail("type", f"'{part.name('type')}': only text parts (input_text, output_text) are "
                                    f"supported, not {kind!r}.")
        texts.append(part.string("text", ""))
    return "\n".join(texts)


def _input(body: Fields, chat: _Chat) -> None:
    instructions = body.string("instructions")
    if instructions:
        chat.add({"role": "system", "content": instructions}, "instructions")
    value = body.raw("input")
    if isinstance(value, str):
        if not value:
            raise body.fail("input", "'input' is empty.")
        chat.add({"role": "user", "content": value}, "input")
        return
    if not isinstance(value, list) or not value:
        raise body.fail("input", "'input' must be a string or a non-empty array of input items.")
    for item in body.objects("input"):
        _item(item, chat)


def _item(item: Fields, chat: _Chat) -> None:
    kind = item.string("type", "message")
    if kind == "message":
        role = item.string("role")
        if role not in ROLES:
            raise item.fail("role", f"'{item.name('role')}' must be one of {', '.join(ROLES)}, not {role!r}.")
        if not item.has("content"):
            raise item.fail("content", f"'{item.name('content')}' is required.")
        chat.add({"role": role, "content": _text(item, "content")}, item.path)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not item.string(key):
                raise item.fail(key, f"'{item.name(key)}' is required for a function_call item.")
        call = {"id": item.string("call_id"), "type": "function",
                "function": {"name": item.string("name"), "arguments": item.string("arguments")}}
        last = chat.messages[-1] if chat.messages else None
        if last is not None and last["role"] == "assistant" and not chat.reasoning:
            last.setdefault("tool_calls", []).append(call)  # the calls of one turn: one assistant message
        else:
            chat.add({"role": "assistant", "content": None, "tool_calls": [call]}, item.path)
    elif kind == "function_call_output":
        if not item.string("call_id"):
            raise item.fail("call_id", f"'{item.name('call_id')}' is required for a function_call_output item.")
        if not item.has("output"):
            raise item.fail("output", f"'{item.name('output')}' is required for a function_call_output item.")
        chat.add({"role": "tool", "tool_call_id": item.string("call_id"), "content": _text(item, "output")},
                 item.path)
    elif kind == "reasoning":
        parts = item.objects("content") or item.objects("summary") or []
        chat.reasoning += "".join(p.string("text", "") for p in parts)
    else:
        raise item.fail("type", f"'{item.name('type')}' must be message, function_call, function_call_output or "
                                f"reasoning, not {kind!r}.")


def _tools(body: Fields, chat: dict[str, Any], echo: dict[str, Any]) -> None:
    tools, echoed = [], []
    for t in body.objects("tools") or []:
        if t.string("type") != "function":
            raise t.fail("type", f"'{t.name('type')}': only function tools are supported (structd runs no "
                                 f"hosted tools), not {t.raw('type')!r}.")
        if not t.string("name"):
            raise t.fail("name", f"'{t.name('name')}' is required.")
        params = _json_text(t, "parameters") if t.has("parameters") else None
        t.boolean("strict")  # typed, not used: structd always decodes tool arguments to the schema
        tools.append({"type": "function", "function": {"name": t.string("name"),
                                                       "description": t.string("description", ""),
                                                       "parameters": params}})
        echoed.append({"type": "function", "name": t.string("name"), "description": t.string("description"),
                       "parameters": json.loads(params) if params else None, "strict": t.boolean("strict", True)})
    chat["tools"], echo["tools"] = tools, echoed
    choice = body.raw("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind == "allowed_tools":
            tools_ = choice.get("tools")
            listed = [{"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                      for t in tools_] if isinstance(tools_, list) else tools_
            choice = {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": listed}}
        else:
            raise body.fail("tool_choice", f"'tool_choice.type' must be function or allowed_tools, not {kind!r}: "
                                           "structd runs no hosted tools.")
    chat["tool_choice"] = choice
    echo["tool_choice"] = body.raw("tool_choice") if body.has("tool_choice") else "auto"


def _format(body: Fields, chat: dict[str, Any], echo: dict[str, Any]) -> None:
    text = body.object("text")
    fmt = text.object("format") if text is not None else None
    echo["text"] = {"format": fmt.obj if fmt is not None else {"type": "text"}}
    if fmt is None:
        return
    if fmt.string("type") == "json_schema":
        if not fmt.has("schema"):
            raise fmt.fail("schema", f"'{fmt.name('schema')}' is required with type json_schema.")
        spec = {k: fmt.raw(k) for k in ("name", "schema", "strict", "description") if fmt.has(k)}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        chat["response_format"] = {"type": fmt.raw("type")}


def _refuse(body: Fields) -> None:
    for key, message in STATEFUL.items():
        if body.has(key):
            raise body.fail(key, message)
    if body.boolean("store", False):
        raise body.fail("store", "'store': true is not supported: structd stores no responses (send store: false, "
                                 "or leave it out).")
    if body.boolean("background", False):
        raise body.fail("background", "'background': true is not supported: structd answers while you wait (use "
                                      "'stream' for partial output).")
    if body.string("truncation", "disabled") != "disabled":
        raise body.fail("truncation", "'truncation' must be disabled: structd does not drop input to fit the "
                                      "context; a request too long for it is refused.")
    if body.has("top_logprobs") or "message.output_text.logprobs" in (body.array("include") or []):
        key = "top_logprobs" if body.has("top_logprobs") else "include"
        raise body.fail(key, f"'{key}': logprobs are not supported on /v1/responses; /v1/chat/completions "
                             "gives them ('logprobs': true).")
    if body.has("max_tool_calls"):
        raise body.fail("max_tool_calls", "'max_tool_calls' is not supported: use 'parallel_tool_calls': false "
                                          "for one call at most.")


def responses_request(body: Fields, served_model: str, request_id: str) -> ResponsesCall:
    """The Responses body as the chat completion it asks for (the same GenerateRequest)."""
    _refuse(body)
    chat_msgs = _Chat()
    _input(body, chat_msgs)
    chat: dict[str, Any] = {k: body.raw(k) for k in PASSTHROUGH if body.has(k)}
    chat["messages"] = chat_msgs.messages
    echo: dict[str, Any] = {"instructions": body.string("instructions"),
                            "temperature": body.number("temperature", 1.0),
                            "top_p": body.number("top_p", 1.0),
                            "max_output_tokens": body.integer("max_output_tokens", None, minimum=1),
                            "parallel_tool_calls": body.boolean("parallel_tool_calls", True)}
    if echo["max_output_tokens"] is not None:
        chat["max_completion_tokens"] = echo["max_output_tokens"]
    _tools(body, chat, echo)
    _format(body, chat, echo)
    reasoning = body.object("reasoning")
    if reasoning is not None and reasoning.has("effort"):
        chat["reasoning_effort"] = reasoning.string("effort")
    echo["reasoning"] = {"effort": chat.get("reasoning_effort"), "summary": None}
    try:
        call = chat_request(Fields(chat), served_model, request_id)
    except InvalidParameterError as e:  # the client's: named as its Responses parameter
        raise chat_msgs.renamed(e) from None
    return ResponsesCall(**vars(call), echo=echo)


# --------------------------------------------------------------------------- the answer


class ResponsesReply(_Reply):
    """One call's Response object and, streamed, its events (one completion: Responses has no `n`)."""

    object_name = "response"

    def __init__(self, call: ResponsesCall, reply_id: str, created: int):
        super().__init__(call, reply_id, created)
        self.hex = reply_id.split("_", 1)[-1]
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # streams: the output items so far, in output_index order
        self.open: dict[str, Any] | None = None  # streams: the reasoning or message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # streams: the function_call items, by call index
        self.calls_done = 0

    # ------------------------------------------------------------------ the Response object

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": f"rs_{self.hex}", "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []}

    def _message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"id": f"msg_{self.hex}", "type": "message", "role": "assistant", "status": status,
                "content": content}

    def _call_item(self, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"id": f"fc_{self.hex}_{index}", "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    @property
    def status(self) -> str:
        c = self.choices.get(0)
        if c is None or c.finish is None:
            return "in_progress"
        return "incomplete" if c.finish == "length" else "completed"

    def _output(self, c: _Choice) -> list[dict[str, Any]]:
        item_status = "incomplete" if self.status == "incomplete" else "completed"
        out = []
        reasoning = "".join(c.reasoning)
        if reasoning:
            out.append(self._reasoning_item(reasoning, item_status))
        text = "".join(c.text)
        if text or not c.tool_calls:
            out.append(self._message_item(text, item_status))
        out += [self._call_item(i, t.id, t.name, t.arguments_json, "completed") for i, t in enumerate(c.tool_calls)]
        return out

    def _usage(self) -> dict[str, Any] | None:
        if not self.done:
            return None
        u = usage([self.choices[0].usage])
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                # cache_write_tokens: OpenAI's explicit prompt-cache writes; structd's prefix cache is implicit.
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]}}

    def result(self) -> dict[str, Any]:
        echo = self.call.echo
        status = self.status
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "completed_at": int(time.time()) if status == "completed" else None, "model": self.call.model,
               "output": self._output(self.choices[0]) if self.done else [],
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               **echo, "store": False, "previous_response_id": None, "truncation": "disabled", "metadata": {},
               "usage": self._usage()}
        return with_structd(out, self.structd() if self.done else self.warnings)

    # ------------------------------------------------------------------ the stream

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def error_event(self, error: ApiError) -> dict[str, Any]:
        """The event a stream ends with when the call fails after its headers went out."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _add_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _close(self) -> list[dict[str, Any]]:
        """The events that finish the reasoning or message item being written."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, text = len(self.items) - 1, "".join(item.pop("parts"))
        status = "incomplete" if self.status == "incomplete" else "completed"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = [self._event("response.reasoning_text.done", **where, text=text)]
            whole = self._reasoning_item(text, status)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            done = [self._event("response.output_text.done", **where, text=text, logprobs=[])]
            whole = self._message_item(text, status)
        self.items[index] = whole
        return done + [self._event("response.content_part.done", **where, part=part),
                       self._event("response.output_item.done", output_index=index, item=whole)]

    def _write(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                item, part = self._reasoning_item("", "in_progress"), {"type": "reasoning_text", "text": ""}
            else:
                item, part = self._message_item(None, "in_progress"), {"type": "output_text", "text": "",
                                                                       "annotations": []}
            out += self._add_item(item)
            self.open = {**item, "parts": []}
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.items) - 1, content_index=0, part=part))
        self.open["parts"].append(delta)
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **where, delta=delta))
        else:
            out.append(self._event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return out

    def _call_start(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        out = self._close()
        item = self._call_item(index, call_id, name, "", "in_progress")
        self.calls[index] = {**item, "output_index": len(self.items)}
        return out + self._add_item(item)

    def _call_piece(self, d: pb.ToolCallDelta) -> list[dict[str, Any]]:
        out = [] if d.index in self.calls else self._call_start(d.index, d.id, d.name)
        if d.arguments_fragment:
            call = self.calls[d.index]
            call["arguments"] += d.arguments_fragment
            out.append(self._event("response.function_call_arguments.delta", item_id=call["id"],
                                   output_index=call["output_index"], delta=d.arguments_fragment))
        return out

    def _call_whole(self, t: pb.ToolCall) -> list[dict[str, Any]]:
        index = self.calls_done
        self.calls_done += 1
        out = []
        if index not in self.calls:  # it came whole only: its arguments in one delta
            out += self._call_start(index, t.id, t.name)
            call = self.calls[index]
            out.append(self._event("response.function_call_arguments.delta", item_id=call["id"],
                                   output_index=call["output_index"], delta=t.arguments_json))
        call = self.calls[index]
        whole = self._call_item(index, t.id, t.name, t.arguments_json, "completed")
        self.items[call["output_index"]] = whole
        return out + [self._event("response.function_call_arguments.done", item_id=call["id"],
                                  output_index=call["output_index"], arguments=t.arguments_json),
                      self._event("response.output_item.done", output_index=call["output_index"], item=whole)]

    def chunks(self, resp: pb.GenerateResponse) -> list[dict[str, Any]]:
        out = []
        if self.seq == 0:
            self.warnings.update(warnings(resp))
            snapshot = self.result()
            out += [self._event("response.created", response=snapshot),
                    self._event("response.in_progress", response=snapshot)]
        c = self.choice(resp)
        c.add(resp)
        if resp.reasoning_text:
            out += self._write("reasoning", resp.reasoning_text)
        if resp.text:
            out += self._write("message", resp.text)
        for d in resp.tool_call_deltas:
            out += self._call_piece(d)
        for t in resp.tool_calls:
            out += self._call_whole(t)
        if self.end(c, resp) is not None:
            if not c.tool_calls and not any(i["type"] == "message" for i in self.items):
                # no text and no call: the Response's empty message, streamed too
                out += self._write("message", "")[:-1]
            out += self._close()
            final = self.result()
            out.append(self._event(f"response.{self.status}", response=final))
        return out
