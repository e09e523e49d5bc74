"""inference.v1 GenerateResponses -> OpenAI response objects and stream chunks.

A `ChatReply` / `CompletionReply` follows one call: `chunks(resp)` gives the
stream chunks for each response as it arrives (OpenAI's exact chunk shape:
the role first, then content / reasoning (and reasoning_content, its older
name) / tool_calls deltas, then
an empty delta with the finish reason, then the usage chunk when asked),
`add(resp)` collects it for the one response object `result()` returns.

With `n` > 1 the inference service streams the n completions interleaved,
each response naming its choice by index: each choice gets its own role
chunk, deltas and finish chunk (`choices[0].index` says which), the usage
chunk comes once every choice has finished, and the response object lists
the choices in index order. Usage counts the shared prompt once.

structd's own fields ride in a "structd" object on the response and on the
stream chunks (OpenAI's SDKs keep unknown fields): "warnings", the schema
keywords the grammar does not enforce (on the first chunk), and on the last
one "schema_check" ("valid", "invalid", "unchecked"), "schema_violations" and
"schema_check_detail", for a JSON Schema output that finished. With several
choices, a response object carries each choice's check in that choice's own
"structd" object (its stream, on its finish chunk, as with one).

Finish reasons: STOP and STOP_STRING are "stop", LENGTH "length",
TOOL_CALLS "tool_calls". A stream gives each tool call in pieces as the
inference service reads them (its tool_call_deltas: the id and name first,
then the arguments text), as OpenAI does; a call that came whole only (an
inference service without tool_call_deltas) goes out whole. A request the inference service cancels (it is
draining) did not finish: it is answered UNAVAILABLE (503, which the OpenAI
SDKs retry) rather than as a truncated completion.
"""

from __future__ import annotations

from typing import Any

from gateway.translation.logprobs import LegacyLogprobs, chat_logprobs
from gateway.translation.request import Translated
from shared import errors
from shared.gen.inference.v1 import inference_service_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_STOP_STRING: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}


class UpstreamCancelledError(errors.UnavailableError):
    """The inference service ended the request before it finished (a drain)."""


def finish_reason(resp: pb.GenerateResponse) -> str | None:
    if resp.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return None
    reason = FINISH.get(resp.finish_reason)
    if reason is None:
        raise UpstreamCancelledError(
            f"The inference service ended the request early ({pb.FinishReason.Name(resp.finish_reason)}; it is "
            "draining or restarting): retry it.")
    return reason


def usage(per_choice: list[pb.Usage]) -> dict[str, Any]:
    """The call's usage from each choice's: the prompt counted once (every choice shares it), completion
    and reasoning tokens summed; cached tokens are choice 0's (those found in the prefix cache at its
    admission: the others find the prompt it computed)."""
    prompt = per_choice[0].prompt_tokens
    completion = sum(u.completion_tokens for u in per_choice)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": per_choice[0].cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in per_choice)}}


def tool_call(call: pb.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


_SCHEMA_CHECKS = {pb.SCHEMA_CHECK_VALID: "valid", pb.SCHEMA_CHECK_INVALID: "invalid",
                  pb.SCHEMA_CHECK_UNCHECKED: "unchecked"}


def warnings(resp: pb.GenerateResponse) -> dict[str, Any]:
    """The "structd" fields of a first response (empty when the grammar enforces the whole schema)."""
    if not resp.warnings:
        return {}
    return {"warnings": [{"keyword": w.keyword, "json_pointer": w.json_pointer, "message": w.message}
                         for w in resp.warnings]}


def schema_check(resp: pb.GenerateResponse) -> dict[str, Any]:
    """The "structd" fields of a last response (empty when there was nothing to check)."""
    if resp.schema_check == pb.SCHEMA_CHECK_UNSPECIFIED:
        return {}
    return {"schema_check": _SCHEMA_CHECKS.get(resp.schema_check, "unchecked"),
            "schema_violations": [{"keyword": v.keyword, "instance_pointer": v.instance_pointer, "message": v.message}
                                  for v in resp.schema_violations],
            "schema_check_detail": resp.schema_check_detail}


def with_structd(out: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    if fields:
        out["structd"] = fields
    return out


def model_object(info: pb.GetModelInfoResponse) -> dict[str, Any]:
    return {"id": info.model_id, "object": "model", "created": info.loaded_unix_seconds, "owned_by": "structd",
            "max_model_len": info.max_model_len}


def model_list(info: pb.GetModelInfoResponse) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(info)]}


class _Choice:
    """One completion of the call (a choice), collected."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[pb.ToolCall] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self.finish: str | None = None
        self.usage: pb.Usage | None = None
        self.check: dict[str, Any] = {}  # its schema check's "structd" fields
        self.started = False  # chat streams: its role chunk has gone out
        self.calls_sent = 0  # chat streams: tool calls streamed so far
        self.calls_in_pieces: set[int] = set()  # chat streams: the calls (by index) streamed in pieces
        self.legacy = LegacyLogprobs()  # completion streams: text offsets run on across its chunks

    def add(self, resp: pb.GenerateResponse) -> None:
        self.text.append(resp.text)
        self.reasoning.append(resp.reasoning_text)
        self.tool_calls.extend(resp.tool_calls)
        self.logprobs.extend(resp.logprobs)

    def end(self, resp: pb.GenerateResponse) -> str | None:
        """Its finish reason, once resp carries it (None before)."""
        self.finish = finish_reason(resp)
        if self.finish is not None:
            self.usage = resp.usage
            self.check = schema_check(resp)
        return self.finish


class _Reply:
    """What both endpoints share: the envelope, the choices (SamplingParams.n of them, each response naming
    its own by index), usage, the finish."""

    object_name = ""
    chunk_name = ""

    def __init__(self, call: Translated, reply_id: str, created: int):
        self.call = call
        self.id = reply_id
        self.created = created
        self.n = max(call.grpc_request.sampling.n, 1)
        # By index, as their responses arrive: n is the client's (up to an int32) until the inference service
        # refuses one above its --max-n.
        self.choices: dict[int, _Choice] = {}
        self.finished = 0
        self.warnings: dict[str, Any] = {}  # the response object's "structd" warnings (one constraint for all)

    @property
    def wants_logprobs(self) -> bool:
        return self.call.top_logprobs is not None

    @property
    def done(self) -> bool:
        """Every choice has its finish reason."""
        return self.finished == self.n

    @property
    def usage(self) -> dict[str, Any] | None:
        if not self.done:
            return None
        return usage([self.choices[i].usage for i in sorted(self.choices)])

    def choice(self, resp: pb.GenerateResponse) -> _Choice:
        if not 0 <= resp.index < self.n:
            raise errors.UnavailableError(f"The inference service answered for choice {resp.index} of a request "
                                          f"for {self.n}: retry the request.")
        return self.choices.setdefault(resp.index, _Choice())

    def end(self, c: _Choice, resp: pb.GenerateResponse) -> str | None:
        """The choice's finish reason once resp carries it, counted (None before)."""
        ended = c.finish is not None
        finish = c.end(resp)
        if finish is not None and not ended:
            self.finished += 1
        return finish

    def structd(self) -> dict[str, Any]:
        """The response object's "structd" fields: the warnings, and with one choice its schema check (with
        several, each choice carries its own)."""
        return {**self.warnings, **(self.choices[0].check if self.n == 1 else {})}

    def with_check(self, out: dict[str, Any], c: _Choice) -> dict[str, Any]:
        """A whole choice object, with its own "structd" check when the call has several choices."""
        return with_structd(out, c.check) if self.n > 1 else out

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.call.model,
                "system_fingerprint": None, "choices": choices}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.chunk_name, [choice])
        if self.call.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has the key; only the last one a value
        return out

    def usage_chunk(self) -> list[dict[str, Any]]:
        if not self.call.include_usage or not self.done:
            return []
        out = self._envelope(self.chunk_name, [])
        out["usage"] = self.usage
        return [out]

    def add(self, resp: pb.GenerateResponse) -> bool:
        """Collects one response; True once the call is finished (every choice)."""
        c = self.choice(resp)
        c.add(resp)
        self.warnings.update(warnings(resp))
        self.end(c, resp)
        return self.done

    def result(self) -> dict[str, Any]:
        out = self._envelope(self.object_name, [self._whole(i, self.choices[i]) for i in sorted(self.choices)])
        out["usage"] = self.usage
        return with_structd(out, self.structd())

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatReply(_Reply):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    @staticmethod
    def _choice(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def chunks(self, resp: pb.GenerateResponse) -> list[dict[str, Any]]:
        out = []
        c, i = self.choice(resp), resp.index
        if not c.started:
            c.started = True
            # The call's first response is some choice's first: its role chunk carries the call's warnings.
            out.append(with_structd(self._chunk(self._choice(i, {"role": "assistant", "content": ""})),
                                    warnings(resp)))
        delta: dict[str, Any] = {}
        if resp.reasoning_text:
            delta["reasoning"] = delta["reasoning_content"] = resp.reasoning_text
        if resp.text:
            delta["content"] = resp.text
        entries = self._call_pieces(c, resp)
        logprobs = chat_logprobs(resp.logprobs) if self.wants_logprobs and resp.logprobs else None
        # As OpenAI streams them: one tool_calls entry per chunk (a call's head, then its arguments' pieces).
        if entries and not delta and not logprobs:
            delta["tool_calls"] = [entries.pop(0)]
        if delta or logprobs:
            out.append(self._chunk(self._choice(i, delta, logprobs)))
        out += [self._chunk(self._choice(i, {"tool_calls": [e]})) for e in entries]
        finish = self.end(c, resp)
        if finish is not None:
            out.append(with_structd(self._chunk(self._choice(i, {}, finish=finish)), c.check))
            out += self.usage_chunk()
        return out

    @staticmethod
    def _call_pieces(c: _Choice, resp: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The tool_calls delta entries of one response, in order: a call's head (id, type, name, arguments
        "") on its own, then its arguments (pieces of one call in a row joined); whole calls whose pieces went
        out already add nothing."""
        entries: list[dict[str, Any]] = []
        for d in resp.tool_call_deltas:
            c.calls_in_pieces.add(d.index)
            if d.id:
                entries.append({"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}})
            if not d.arguments_fragment:
                continue
            last = entries[-1] if entries else None
            if last is not None and last["index"] == d.index and "id" not in last:
                last["function"]["arguments"] += d.arguments_fragment
            else:
                entries.append({"index": d.index, "function": {"arguments": d.arguments_fragment}})
        for t in resp.tool_calls:
            index = c.calls_sent
            c.calls_sent += 1
            if index not in c.calls_in_pieces:
                entries.append({"index": index, **tool_call(t)})
        return entries

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not c.tool_calls else None}
        reasoning = "".join(c.reasoning)
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if c.tool_calls:
            message["tool_calls"] = [tool_call(t) for t in c.tool_calls]
        return self.with_check({"index": index, "message": message,
                                "logprobs": chat_logprobs(c.logprobs) if self.wants_logprobs else None,
                                "finish_reason": c.finish}, c)


class CompletionReply(_Reply):
    object_name = "text_completion"
    chunk_name = "text_completion"

    @staticmethod
    def _choice(index: int, text: str, logprobs: Any = None, finish: str | None = None,
                reasoning: str = "") -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if reasoning:  # the same two names as a chat message's (vLLM's current one and its older alias)
            choice["reasoning"] = choice["reasoning_content"] = reasoning
        return choice

    def chunks(self, resp: pb.GenerateResponse) -> list[dict[str, Any]]:
        out = []
        c, i = self.choice(resp), resp.index
        logprobs = c.legacy.build(resp.logprobs) if self.wants_logprobs and resp.logprobs else None
        first = warnings(resp)
        if resp.text or resp.reasoning_text or logprobs or first:
            out.append(with_structd(self._chunk(self._choice(i, resp.text, logprobs, reasoning=resp.reasoning_text)),
                                    first))
        finish = self.end(c, resp)
        if finish is not None:
            out.append(with_structd(self._chunk(self._choice(i, "", finish=finish)), c.check))
            out += self.usage_chunk()
        return out

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        logprobs = LegacyLogprobs().build(c.logprobs) if self.wants_logprobs else None
        return self.with_check(self._choice(index, "".join(c.text), logprobs, c.finish, "".join(c.reasoning)), c)
