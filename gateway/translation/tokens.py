"""vLLM's /tokenize and /detokenize bodies <-> inference.v1 Tokenize and Detokenize.

`POST /tokenize` takes `{"model", "prompt"}` (with `add_special_tokens`,
default true) or `{"model", "messages", "add_generation_prompt"}` (default
true; `tools` and the thinking switches as in chat completions) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; `POST /detokenize` takes
`{"model", "tokens"}` and answers `{"prompt"}`, as vLLM does. The gateway
has no tokenizer: the inference service tokenizes, with the template and
tokenizer that Generate uses, so the counts are what a completion charges.
"""

from __future__ import annotations

from typing import Any

from gateway.body import Fields
from gateway.translation.request import check_model, messages, reasoning, tools
from shared.gen.inference.v1 import inference_service_pb2 as pb

INT32_MAX = 2**31 - 1


def tokenize_request(body: Fields, served_model: str, request_id: str) -> pb.TokenizeRequest:
    check_model(body, served_model)
    if body.boolean("return_token_strs", False):
        raise body.fail("return_token_strs", "'return_token_strs' is not supported: the answer holds token ids.")
    if body.has("messages") == body.has("prompt"):
        raise body.fail(None, "Give exactly one of 'prompt' and 'messages'.")
    req = pb.TokenizeRequest()
    if body.has("prompt"):
        prompt = body.string("prompt")
        if not prompt:
            raise body.fail("prompt", "'prompt' is empty.")
        req.prompt = prompt
        req.add_special_tokens = body.boolean("add_special_tokens", True)
        return req
    # The chat fields as chat completions reads them, so both render the same prompt.
    chat = pb.GenerateRequest()
    chat.messages.extend(messages(body))
    tools(body, chat)
    reasoning(body, chat)
    req.messages.extend(chat.messages)
    req.tools.extend(chat.tools)
    if chat.HasField("reasoning"):
        req.reasoning = chat.reasoning
    req.chat_template_kwargs_json = chat.chat_template_kwargs_json
    req.add_generation_prompt = body.boolean("add_generation_prompt", True)
    return req


def tokenize_reply(resp: pb.TokenizeResponse) -> dict[str, Any]:
    return {"count": len(resp.token_ids), "max_model_len": resp.max_model_len, "tokens": list(resp.token_ids),
            "token_strs": None}


def detokenize_request(body: Fields, served_model: str, request_id: str) -> pb.DetokenizeRequest:
    check_model(body, served_model)
    tokens = body.array("tokens")
    if tokens is None:
        raise body.fail("tokens", "'tokens' is required: an array of token ids.")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in tokens):
        raise body.fail("tokens", "'tokens' must be an array of non-negative 32-bit integers (token ids).")
    return pb.DetokenizeRequest(token_ids=tokens)


def detokenize_reply(resp: pb.DetokenizeResponse) -> dict[str, Any]:
    return {"prompt": resp.text}
