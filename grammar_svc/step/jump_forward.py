"""Jump-forward: the text the grammar forces next, tokenized canonically.

Token boundaries are the hard part (SGLang's compressed-FSM post): the token
just sampled and the forced text can merge into a different tokenization, and
the end of the forced text can merge with whatever the model writes next.
Rules, so the model never sees a sequence the tokenizer would not produce:

- front: tokenize (last token's text + forced text); jump only if that
  tokenization still starts with the last token, i.e. nothing merges across
  the boundary (otherwise the model samples the next token itself);
- tail: hold back the tokens of the last pre-tokenizer segment, which the
  next free text could extend; they are sampled normally under the mask;
- check: the kept tokens' bytes must spell a prefix of the forced text.

Those rules make the answer a pure function of (tokenizer, last token, forced
string), and the same pairs come back all the time (every key and separator
of a schema, every step of every session on it), so each tokenizer keeps a
memo of them: a lookup costs far less than tokenizing (docs/benchmarks.md,
"Host path at simulated steps", item 4).
"""

from __future__ import annotations

# Longer forced strings (a long const) are rare and would make the memo's memory unbounded in practice.
MEMO_MAX_CHARS = 256


def forced_tokens(matcher, tokenizer, last_token: int | None) -> tuple[str, list[int]]:
    """(forced text, token ids) that are safe to append; ("", []) when none."""
    hf = tokenizer.hf_tokenizer
    if hf is None:
        return "", []
    try:
        forced = matcher.find_jump_forward_string()
    except UnicodeDecodeError:
        # xgrammar returns the forced bytes as str: inside a multi-byte character
        # (a token ended mid-character) they are not valid UTF-8. Sample instead.
        return "", []
    if not forced:
        return "", []
    if len(forced) > MEMO_MAX_CHARS:
        return _tokenize_forced(hf, tokenizer.token_bytes, last_token, forced)
    memo = tokenizer.forced_memo
    key = (last_token, forced)
    hit = memo.get(key)
    if hit is None:
        text, ids = _tokenize_forced(hf, tokenizer.token_bytes, last_token, forced)
        hit = (text, tuple(ids))
        memo.put(key, hit)
    return hit[0], list(hit[1])


def _tokenize_forced(hf, token_bytes, last_token: int | None, forced: str) -> tuple[str, list[int]]:
    """The rules above, applied to one (last token, forced string)."""
    prefix = ""
    if last_token is not None:
        try:
            prefix = token_bytes[last_token].decode("utf-8")
        except UnicodeDecodeError:
            # The last token ends inside a multi-byte character: the boundary
            # cannot be checked on text, so do not jump this step.
            return "", []
    text = prefix + forced
    enc = hf.encode(text, add_special_tokens=False)
    ids, offsets = list(enc.ids), list(enc.offsets)
    if prefix:
        if not ids or ids[0] != last_token or offsets[0][1] != len(prefix):
            return "", []
        ids, offsets = ids[1:], offsets[1:]
    segments = hf.pre_tokenizer.pre_tokenize_str(text) if hf.pre_tokenizer is not None else [(text, (0, len(text)))]
    tail_start = max(segments[-1][1][0], len(prefix))
    keep: list[int] = []
    end = len(prefix)
    for tok, (_, stop) in zip(ids, offsets):
        if stop > tail_start:
            break
        keep.append(tok)
        end = stop
    if not keep:
        return "", []
    forced_text = text[len(prefix):end]
    if b"".join(token_bytes[t] for t in keep) != forced_text.encode("utf-8"):
        return "", []
    return forced_text, keep
