"""Tokenize and Detokenize: the token ids Generate would feed the model, and the text of token ids.

A prompt is encoded as the engine encodes one (the tokenizer's special
tokens added unless asked not to); a conversation is rendered by the same
chat template as Generate's (tools and the thinking switch included) and
encoded without added special tokens, since a rendered template spells out
its own. The counts a client gets here are then the ones Generate charges.
Both run on a worker thread (tokenizing and rendering take CPU time in
proportion to the input) and refuse input past --max-prompt-bytes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from inference_svc.api.chat import NO_TEMPLATE, ChatMessage, ChatTemplate
from inference_svc.api.tool_calls import ToolSpec
from shared import errors


@dataclass(frozen=True)
class TokenizeInput:
    """One Tokenize call in domain terms: a prompt or a conversation."""

    prompt: str = ""
    messages: tuple[ChatMessage, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    reasoning: bool | None = None
    template_kwargs: Mapping[str, object] = field(default_factory=dict)  # as ClientRequest's


class Tokenization:
    """The API process's tokenizer and chat template, for Tokenize and Detokenize."""

    def __init__(self, tokenizer, template: ChatTemplate | None, *, vocab_size: int, max_prompt_bytes: int):
        self.tokenizer = tokenizer
        self.template = template
        self.vocab_size = vocab_size
        self.max_prompt_bytes = max_prompt_bytes

    async def tokenize(self, r: TokenizeInput) -> list[int]:
        if bool(r.prompt) == bool(r.messages):
            raise errors.InvalidRequestError("give exactly one of prompt and messages" if r.prompt
                                             else "the prompt is empty: give exactly one of prompt and messages")
        if r.prompt:
            self._check_size(len(r.prompt.encode("utf-8", "surrogatepass")), "prompt is")
            return await asyncio.to_thread(self._encode, r.prompt, r.add_special_tokens)
        self._check_size(sum(m.text_bytes() for m in r.messages), "messages hold")
        if self.template is None or not self.template.available:
            raise errors.InvalidRequestError(NO_TEMPLATE)
        return await asyncio.to_thread(self._render_and_encode, r.messages, r.tools, r.reasoning,
                                       r.add_generation_prompt, r.template_kwargs)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise errors.InvalidRequestError(
                f"token_ids: {bad[0]} is not a token id of this model (0 to {self.vocab_size - 1})"
                + (f", and {len(bad) - 1} more" if len(bad) > 1 else ""))
        # Prompt-sized at most: a longer list is not the text of anything this server would take.
        if len(token_ids) > self.max_prompt_bytes:
            raise errors.RequestTooLargeError(
                f"{len(token_ids)} token ids; this server takes at most {self.max_prompt_bytes} (--max-prompt-bytes)")
        return await asyncio.to_thread(self.tokenizer.decode, list(token_ids))

    def _check_size(self, size: int, what: str) -> None:
        if size > self.max_prompt_bytes:
            raise errors.RequestTooLargeError(
                f"{what} {size} bytes of text; this server accepts prompts of at most {self.max_prompt_bytes} "
                "bytes (--max-prompt-bytes)")

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _render_and_encode(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], reasoning: bool | None,
                           add_generation_prompt: bool, template_kwargs: Mapping[str, object]) -> list[int]:
        text = self.template.render(list(messages), list(tools), reasoning,
                                    add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        return self._encode(text, False)
