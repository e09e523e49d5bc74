"""Bounded patterns and long bounds change no mask (grammar_svc/schema/bounded_patterns.py, grammar_svc/schema/bounded_strings.py).

One-class bounded `pattern` strings are printed as bounded strings and put in
tail form; strings of more than 128 optional characters take the blocked
form. Every mask of seeded random walks (short tokens preferred, so every
length is visited; closing quotes and escapes now and then) through the
rewritten grammar must equal the mask of the grammar the service compiled
before (`rewrite=False`: xgrammar's own forms), on the real tokenizer. The
blocked form is also walked with small blocks, so that walks of a few dozen
tokens cross many block boundaries and reach the bound.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc.schema.bounded_patterns import patterns_as_bounded_strings
from grammar_svc.schema.bounded_strings import rewrite_bounded_strings
from grammar_svc.schema.json_grammar import compile_json_schema, json_schema_ebnf
from grammar_svc.types import JsonOptions


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info, max_threads=2, cache_enabled=False)


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def ebnf(schema: dict) -> str:
    return json_schema_ebnf(json.dumps(schema), JsonOptions())


def allowed(bitmask, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.numpy()[0].view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


_VOCAB_TABLES: dict[int, tuple] = {}


def vocab_tables(info) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, each token's length, whether it holds a quote or a backslash, the stop ids) of a tokenizer,
    built once per tokenizer: decoded_vocab is read through one FFI call per token."""
    if id(info) not in _VOCAB_TABLES:
        vocab = [bytes(t) for t in info.decoded_vocab]
        _VOCAB_TABLES[id(info)] = (info, len(vocab), np.array([len(t) for t in vocab]),
                                   np.array([b'"' in t or b"\\" in t for t in vocab]),
                                   np.array(sorted(info.stop_token_ids), dtype=np.int64))
    return _VOCAB_TABLES[id(info)][1:]


def same_masks_on_walks(reference, rewritten, info, seeds, max_steps=400) -> int:
    """Walks `reference`'s masks; asserts `rewritten` gives the same mask at every step. Returns rows compared."""
    tokens, short, special, stop = vocab_tables(info)
    buf, buf2 = xgr.allocate_token_bitmask(1, info.vocab_size), xgr.allocate_token_bitmask(1, info.vocab_size)
    rows = 0
    for seed in seeds:
        rng = random.Random(seed)
        a, b = xgr.GrammarMatcher(reference), xgr.GrammarMatcher(rewritten)
        for step in range(max_steps):
            a.fill_next_token_bitmask(buf)
            b.fill_next_token_bitmask(buf2)
            rows += 1
            assert np.array_equal(buf.numpy(), buf2.numpy()), f"seed {seed}: masks differ at step {step}"
            ids = allowed(buf, info.vocab_size)
            ids = ids[ids < tokens]
            ids = ids[~np.isin(ids, stop)]
            if not len(ids):
                break
            plain = ids[~special[ids]]
            if len(plain) and rng.random() < 0.97:
                # Mostly the shortest of a few: one character at a time reaches every length, up to the bound.
                cands = [int(rng.choice(plain)) for _ in range(8)]
                token = min(cands, key=lambda t: short[t]) if rng.random() < 0.8 else cands[0]
            else:
                token = int(rng.choice(ids))
            assert a.accept_token(token) and b.accept_token(token)
    return rows


# --------------------------------------------------------------------------- which patterns are converted

@pytest.mark.parametrize("pattern, expected", [
    pytest.param("^[a-z0-9_-]{1,255}$", ("[\\-0-9_a-z]", 1, 255), id="class-range"),
    pytest.param("^[0-9a-fA-F]{24}$", ("[0-9A-Fa-f]", 24, 24), id="exact-count"),
    pytest.param("^\\d{1,2}$", ("[0-9]", 1, 2), id="digit-shorthand"),
    pytest.param("^[\\w.\\-]{2,40}$", ("[\\-.0-9A-Z_a-z]", 2, 40), id="word-shorthand-in-class"),
    pytest.param("^[a-z]+$", None, id="unbounded-plus"),
    pytest.param("[a-z]{3}", None, id="unanchored"),
    pytest.param("^[^ ]{1,5}$", None, id="negated-class"),
    pytest.param("^[a-z\"]{2}$", None, id="quote-needs-json-escape"),
    pytest.param("^[\\s]{3}$", None, id="whitespace-shorthand"),
    pytest.param("^[a-z]{2}[0-9]{2}$", None, id="two-parts"),
    pytest.param("^[a-zé]{1,3}$", None, id="non-ascii"),
    pytest.param("^[a-z]{200}$", None, id="more-required-than-expanded"),
])
def test_which_patterns_become_bounded_strings(pattern, expected):
    text = ebnf(obj(a={"type": "string", "pattern": pattern}))
    out, converted = patterns_as_bounded_strings(text, max_required=128, max_bound=4096)
    if expected is None:
        assert (out, converted) == (text if text.endswith("\n") else text + "\n", 0)
        return
    cls, lo, hi = expected
    assert converted == 1
    assert f'root_prop_0 ::= (("\\"" root_prop_0_1{{{lo}, {hi}}} "\\""))' in out
    assert f"root_prop_0_1 ::= (({cls}))" in out


def test_a_pattern_rule_used_twice_is_left_alone():
    text = 'root ::= (("\\"" p "\\"" p))\np ::= Regex("^[a-z]{1,3}$", json_string=true)\n'
    assert patterns_as_bounded_strings(text, max_required=128, max_bound=4096) == (text, 0)


# --------------------------------------------------------------------------- masks, real tokenizer

PATTERNS = [
    pytest.param(obj(a={"type": "string", "pattern": "^[a-z0-9_-]{1,255}$"}), id="class-1-255-blocked"),
    pytest.param(obj(a={"type": "string", "pattern": "^[0-9a-zA-Z_-]{1,64}$"},
                     b={"type": "string", "pattern": "^\\d{1,2}$"}), id="tail-form-two-patterns"),
    pytest.param(obj(a={"type": "string", "pattern": "^[0-9a-fA-F]{24}$"}), id="exact-24"),
    pytest.param(obj(a={"type": "string", "pattern": "^[a-z]+$", "maxLength": 300}), id="folded-maxLength-300"),
]


@pytest.mark.parametrize("schema", PATTERNS)
def test_bounded_patterns_mask_like_xgrammar(compiler, xgr_tokenizer_info, schema):
    """Real block size (64) for the long ones: the small class compiles in well under a second."""
    text = json.dumps(schema)
    reference = compile_json_schema(compiler, text, JsonOptions(), rewrite=False)
    rewritten = compile_json_schema(compiler, text, JsonOptions())
    assert "Regex(" not in str(rewritten.grammar)
    assert same_masks_on_walks(reference, rewritten, xgr_tokenizer_info, seeds=[0, 1], max_steps=350) > 25


LONG = [
    pytest.param(obj(s={"type": "string", "maxLength": 37}), id="json-chars-0-37"),
    pytest.param(obj(s={"type": "string", "minLength": 3, "maxLength": 29}), id="json-chars-3-29"),
    pytest.param(obj(s={"type": "string", "maxLength": 30}, t={"type": "string", "maxLength": 19}),
                 id="json-chars-two-strings"),
    pytest.param(obj(s={"type": "string", "pattern": "^[a-f0-9-]{2,33}$"}), id="pattern-2-33"),
]


@pytest.mark.parametrize("schema", LONG)
def test_blocked_form_masks_like_xgrammar_with_small_blocks(compiler, xgr_tokenizer_info, schema):
    """Blocks of 4 characters and the blocked form from 9 optional characters on: the same construction
    as the service's (blocks of 64 past 128), short enough that a walk crosses many block boundaries."""
    text = ebnf(schema)
    small, rewritten_rules = rewrite_bounded_strings(text, max_expanded=8, block=4)
    assert rewritten_rules == len(schema["properties"]) and "_long_a" in small
    reference = compiler.compile_grammar(text)
    rewritten = compiler.compile_grammar(small)
    assert same_masks_on_walks(reference, rewritten, xgr_tokenizer_info, seeds=[0, 1], max_steps=120) > 20


def test_long_strings_of_one_class_share_their_chains():
    """Blocks and tails depend only on the class: three long strings pay for them once."""
    text = ebnf(obj(s={"type": "string", "maxLength": 300}, t={"type": "string", "maxLength": 1000},
                    u={"type": "string", "minLength": 1, "maxLength": 1000}))
    out, rules = rewrite_bounded_strings(text)
    assert rules == 3
    names = [line.split(" ::= ", 1)[0] for line in out.splitlines() if " ::= " in line]
    assert sum(n.startswith("bounded_string_block_") for n in names) == 64
    assert sum(n.startswith("bounded_string_tail_") for n in names) == 128
