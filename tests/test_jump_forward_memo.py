"""Jump-forward's per-tokenizer memo: the same answers as tokenizing every time, on the real tokenizer.

The forced tokens are a pure function of (tokenizer, last token, forced
string), which is what makes remembering them sound; these tests pin that a
remembered answer is exactly the tokenized one, that callers cannot corrupt
it, and that the memo stays bounded.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import xgrammar as xgr

from grammar_svc.compile.tokenizer_registry import ForcedTokensMemo, TokenizerRegistry
from grammar_svc.step.jump_forward import MEMO_MAX_CHARS, _tokenize_forced, forced_tokens

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                       "kind": {"enum": ["alpha", "beta"]}},
                     "required": ["name", "kind"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tok(tokenizer_desc):
    registry = TokenizerRegistry(2, set)
    registered, _, _ = registry.register(tokenizer_desc.fingerprint, tokenizer_desc.compressed_info(),
                                         tokenizer_desc.compressed_hf())
    return registered


@pytest.fixture(scope="module")
def compiler(tok):
    return xgr.GrammarCompiler(tok.info)


def _fresh(tok):
    """The tokenizer with an empty memo of its own (the module's tokenizer is shared by the tests)."""
    return dataclasses.replace(tok, forced_memo=ForcedTokensMemo())


def _walk(compiler, tok, text: str):
    """A matcher of SCHEMA that has accepted `text` token by token, and the last token."""
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":")))
    last = None
    for t in tok.hf_tokenizer.encode(text, add_special_tokens=False).ids:
        assert matcher.accept_token(t)
        last = t
    return matcher, last


@pytest.mark.parametrize("prefix", [pytest.param("", id="start"), pytest.param('{"name":"ab', id="in-string"),
                                    pytest.param('{"name":"ab"', id="after-string")])
def test_remembered_answer_is_the_tokenized_one(compiler, tok, prefix):
    tok = _fresh(tok)
    matcher, last = _walk(compiler, tok, prefix)
    forced = matcher.find_jump_forward_string()
    expected = _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, last, forced) if forced else ("", [])
    first = forced_tokens(matcher, tok, last)
    assert first == expected
    assert len(tok.forced_memo) == (1 if forced else 0)
    # A second session in the same state gets the remembered answer, equal to the first.
    again, last_again = _walk(compiler, tok, prefix)
    assert forced_tokens(again, tok, last_again) == expected


def test_callers_cannot_change_a_remembered_answer(compiler, tok):
    tok = _fresh(tok)
    matcher, last = _walk(compiler, tok, "")
    text, ids = forced_tokens(matcher, tok, last)
    assert ids, "the schema's start forces its first key"
    ids.append(-1)
    ids.clear()
    assert forced_tokens(matcher, tok, last) == (text, _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, last,
                                                                        matcher.find_jump_forward_string())[1])


def test_memo_starts_over_when_full():
    memo = ForcedTokensMemo(max_entries=2)
    for k in range(3):
        memo.put((k, "x"), ("x", (k,)))
    assert len(memo) == 1 and memo.get((2, "x")) == ("x", (2,)) and memo.get((0, "x")) is None


def test_long_forced_strings_are_tokenized_every_time(tok):
    tok = _fresh(tok)
    long_const = "ab, " * (MEMO_MAX_CHARS // 4 + 10)
    compiled = xgr.GrammarCompiler(tok.info).compile_regex(long_const)
    matcher = xgr.GrammarMatcher(compiled)
    text, ids = forced_tokens(matcher, tok, None)
    assert (text, ids) == _tokenize_forced(tok.hf_tokenizer, tok.token_bytes, None, long_const)
    assert ids and len(tok.forced_memo) == 0
