"""Jump-forward's edges that mutation testing found untested (docs/mutation.md), on the real tokenizer.

The memo is keyed by (last token, forced string) and holds the tokenized
answer; a forced string of exactly MEMO_MAX_CHARS is remembered; the long
path keeps the last token's boundary rule; a tokenizer without its
Hugging Face side, a last token that ends inside a character, forced bytes
that end inside one, and a forced string that is all tail jump nothing.
"""

from __future__ import annotations

import dataclasses

import xgrammar as xgr

from grammar_svc.step.jump_forward import MEMO_MAX_CHARS, _tokenize_forced, forced_tokens
from tests.test_jump_forward_memo import _fresh, _walk, compiler, tok  # noqa: F401 - the module's fixtures


def test_the_memo_keeps_each_state_apart_and_holds_the_answer(compiler, tok):  # noqa: F811
    tok = _fresh(tok)
    answers = {}
    for prefix in ("", '{"name":"ab"'):
        matcher, last = _walk(compiler, tok, prefix)
        forced = matcher.find_jump_forward_string()
        answers[prefix] = forced_tokens(matcher, tok, last)
        assert answers[prefix] == _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, last, forced)
        text, ids = answers[prefix]
        assert tok.forced_memo.get((last, forced)) == (text, tuple(ids))
    assert answers[""] != answers['{"name":"ab"'] and len(tok.forced_memo) == 2


def test_a_forced_string_of_exactly_the_memo_limit_is_remembered(tok):  # noqa: F811
    tok = _fresh(tok)
    const = ("ab, " * MEMO_MAX_CHARS)[:MEMO_MAX_CHARS]
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(tok.info).compile_regex(const))
    assert forced_tokens(matcher, tok, None)[1] and len(tok.forced_memo) == 1


def test_a_long_forced_string_keeps_the_last_tokens_boundary(tok):  # noqa: F811
    """After the token "a" of a constant "ab, ab, ...", "ab" would be one token: jumping would re-split what the
    model wrote, so nothing is jumped (the same rule as a short string's)."""
    tok = _fresh(tok)
    hf = tok.hf_tokenizer
    const = "ab, " * (MEMO_MAX_CHARS // 4 + 10)
    (a,) = hf.encode("a", add_special_tokens=False).ids
    assert hf.encode("ab", add_special_tokens=False).ids != [a], "the premise: 'ab' is not the token 'a' + more"
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(tok.info).compile_regex(const))
    assert matcher.accept_token(a)
    forced = matcher.find_jump_forward_string()
    assert forced_tokens(matcher, tok, a) == _tokenize_forced(hf, tok.token_bytes, a, forced) == ("", [])
    assert _tokenize_forced(hf, tok.token_bytes, None, forced)[1]  # without the last token it would jump


def test_no_hugging_face_tokenizer_jumps_nothing(compiler, tok):  # noqa: F811
    matcher, last = _walk(compiler, tok, "")
    assert forced_tokens(matcher, dataclasses.replace(tok, hf_tokenizer=None), last) == ("", [])


def test_a_forced_string_that_is_all_tail_jumps_nothing(tok):  # noqa: F811
    """The last pre-tokenizer segment may still merge with what follows: a string that is only that jumps
    nothing."""
    assert _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, None, "abc") == ("", [])


def test_a_last_token_ending_inside_a_character_jumps_nothing(tok):  # noqa: F811
    partial = next(i for i, b in enumerate(tok.token_bytes) if b and b[-1] >= 0xC0)
    assert _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, partial, ', "x"') == ("", [])
