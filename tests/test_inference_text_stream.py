"""inference_svc/engine/text_stream.py: whole-character deltas, stop strings, special tokens, real tokenizer.

The reference is the tokenizer's own `decode(ids, skip_special_tokens=True)`
on the real 129,280-token DeepSeek tokenizer; a small hand-made vocabulary pins
down exactly what is held back and when.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_svc.engine.text_stream import Delta, TextStream, special_token_ids, token_bytes_for

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
REPLACEMENT = "\ufffd"

TEXTS = [
    pytest.param("Hello, world! 42 + 1", id="ascii"),
    pytest.param("中文字符测试，我们今天去北京。", id="cjk"),
    pytest.param("ありがとう、カタカナ、한국어 텍스트", id="kana-hangul"),
    pytest.param("party 🎉👍🏽 time 🦄🧪", id="emoji"),
    pytest.param("family 👨‍👩‍👧‍👦 flag 🇯🇵🇫🇷", id="zwj-and-flags"),
    pytest.param("naïve café, Ångström, Øresund, Dvořák, façade", id="accented-latin"),
    pytest.param("Ελληνικά, русский, नमस्ते, العربية", id="greek-cyrillic-devanagari-arabic"),
    pytest.param('{"k": "v\\u00e9", "n": [1, 2.5e-3]}\n\tdef f(x):  return x  # 注释', id="code"),
]


@pytest.fixture(scope="module")
def vocab(hf_tokenizer):
    return token_bytes_for(hf_tokenizer)


@pytest.fixture(scope="module")
def skip(hf_tokenizer):
    return special_token_ids(hf_tokenizer)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream_all(vocab, skip, chunks, stop=()) -> tuple[list[Delta], str, TextStream]:
    s = TextStream(vocab, skip, stop)
    deltas = []
    for chunk in chunks:
        deltas.append(s.push(chunk))
        if deltas[-1].stopped:
            break
    return deltas, s.finish(), s


def joined(deltas, tail: str) -> str:
    return "".join(d.text for d in deltas) + tail


def first_stop_cut(text: str, stop) -> int | None:
    """Reference: where the stop string that ends first starts (ties: the longest)."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    return min(found)[1] if found else None


# ---------------------------------------------------------------- helpers over the real tokenizer


def test_token_bytes_are_plain_bytes_and_cached(hf_tokenizer, vocab):
    assert len(vocab) == len(hf_tokenizer) == 129_280
    assert all(type(b) is bytes for b in vocab)
    assert token_bytes_for(hf_tokenizer) is vocab
    (bang,) = encode(hf_tokenizer, "!")
    assert vocab[bang] == b"!"


def test_token_bytes_read_from_the_grammar_description_are_the_tokenizer_s(hf_tokenizer, tokenizer_desc, vocab):
    """The inference service reads them from the handshake's description instead of describing the vocabulary
    twice."""
    assert token_bytes_for(hf_tokenizer, tokenizer_desc.info_json) == vocab


@pytest.mark.parametrize("extra_ids", [pytest.param(64, id="padded-model-vocabulary"),
                                       pytest.param(-8, id="model-vocabulary-smaller-than-the-tokenizer-s")])
def test_a_description_of_another_width_gives_the_tokenizer_s_token_bytes(extra_ids):
    from shared.tokenizer import describe
    from tests.test_tokenizer_cache import tiny_tokenizer

    tok = tiny_tokenizer()
    got = token_bytes_for(tok, describe(tok, len(tok) + extra_ids).info_json)
    assert len(got) == len(tok) and got == token_bytes_for(tok)


def test_special_ids_are_what_decode_skips(hf_tokenizer, skip):
    # all_special_ids is only bos/eos here; pad and the placeholders are special added tokens too.
    assert {0, 1, 2, 128000, 128799} <= skip and len(skip) > len(hf_tokenizer.all_special_ids)
    think = hf_tokenizer.convert_tokens_to_ids("<think>")
    assert think not in skip  # an added token that is not special: decode keeps its text
    for i in sorted(skip)[::50] + [think, 3, 5000]:
        assert (hf_tokenizer.decode([i], skip_special_tokens=True) == "") == (i in skip)


# ---------------------------------------------------------------- whole characters, no stop strings


def test_the_corpus_splits_characters_across_tokens(hf_tokenizer, vocab):
    """The tests below are only meaningful if some tokens hold part of a character."""
    split = set()
    for p in TEXTS:
        for t in encode(hf_tokenizer, p.values[0]):
            try:
                vocab[t].decode("utf-8")
            except UnicodeDecodeError:
                split.add(t)
    assert len(split) >= 10


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_decode_and_never_splits_a_character(hf_tokenizer, vocab, skip, text):
    ids = encode(hf_tokenizer, text)
    deltas, tail, s = stream_all(vocab, skip, [[t] for t in ids])
    assert joined(deltas, tail) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT not in d.text for d in deltas) and tail == ""
    assert not any(d.stopped for d in deltas) and s.text == text


@SETTINGS
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 80), max_size=12))
def test_any_text_any_chunking_equals_decode(hf_tokenizer, vocab, skip, text, cuts):
    ids = encode(hf_tokenizer, text)
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:])] + [[]]
    deltas, tail, _ = stream_all(vocab, skip, chunks)
    assert joined(deltas, tail) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in d.text for d in deltas) and tail == ""


@SETTINGS
@given(ids=st.lists(st.integers(0, 129_279), max_size=12))
def test_arbitrary_ids_match_decode_replacement_characters_included(hf_tokenizer, vocab, skip, ids):
    """Random ids: stray continuation bytes, truncated characters, special tokens."""
    deltas, tail, _ = stream_all(vocab, skip, [[t] for t in ids])
    assert joined(deltas, tail) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped_added_tokens_kept(hf_tokenizer, vocab, skip):
    think = hf_tokenizer.convert_tokens_to_ids("<think>")
    ids = [0, *encode(hf_tokenizer, "🎉"), 2, think, 128000, *encode(hf_tokenizer, "ok"), 1]
    deltas, tail, _ = stream_all(vocab, skip, [[t] for t in ids])
    assert joined(deltas, tail) == hf_tokenizer.decode(ids, skip_special_tokens=True) == "🎉<think>ok"


def test_an_unfinished_character_is_held_then_flushed_as_replacement(hf_tokenizer, vocab, skip):
    ids = encode(hf_tokenizer, "ok 🎉")
    partial = ids[:-1]  # the emoji's last byte never comes
    s = TextStream(vocab, skip, ())
    assert "".join(s.push([t]).text for t in partial) == "ok "
    assert s.finish() == REPLACEMENT
    assert s.text == hf_tokenizer.decode(partial) == "ok " + REPLACEMENT


# ---------------------------------------------------------------- stop strings, hand-made vocabulary

TOY = [b"Hello", b" <", b"b", b"/", b"answer", b">", b" tail", b"\xf0\x9f", b"\x8e\x89", b"<", b"\xe2\x9c", b"abcd"]
H, LT_SP, B, SLASH, ANSWER, GT, TAIL, EMOJI_HEAD, EMOJI_REST, LT, CHECK_HEAD, ABCD = range(len(TOY))


@pytest.mark.parametrize(
    "pushes, stop, deltas",
    [
        pytest.param([[H], [LT_SP], [B]], ["</answer>"], ["Hello", " ", "<b"], id="prefix-held-then-released"),
        pytest.param([[H], [LT_SP], [SLASH], [ANSWER], [GT], [TAIL]], ["</answer>"],
                     ["Hello", " ", "", "", ""], id="stop-across-tokens"),
        pytest.param([[H, LT_SP, SLASH, ANSWER, GT, TAIL]], ["</answer>"], ["Hello "], id="stop-in-one-push"),
        pytest.param([[H], [TAIL]], ["xyz"], ["Hello", " tail"], id="nothing-held-without-a-prefix"),
        pytest.param([[H], [EMOJI_HEAD], [EMOJI_REST], [TAIL]], ["🎉"], ["Hello", "", ""],
                     id="multibyte-stop-split-over-tokens"),
        pytest.param([[EMOJI_HEAD], [EMOJI_REST], [H]], ["🎉H"], ["", "", ""], id="held-multibyte-then-stop"),
        pytest.param([[H], [LT], [LT], [SLASH], [B]], ["</b"], ["Hello", "", "<", "", ""],
                     id="longest-prefix-moves-on"),
        # "bc" ends before "abcd" can: whether "abcd" arrives in one push or several.
        pytest.param([[ABCD]], ["abcd", "bc"], ["a"], id="ends-first-wins"),
        pytest.param([[H, TAIL]], ["l", "Hello"], ["He"], id="earliest-end-not-earliest-start"),
        pytest.param([[H, TAIL]], ["llo", "Hello"], [""], id="same-end-longest"),
    ],
)
def test_stop_deltas(pushes, stop, deltas):
    s = TextStream(TOY, set(), stop)
    got = []
    for p in pushes:
        d = s.push(p)
        got.append(d.text)
        if d.stopped:
            break
    assert got == deltas
    assert s.stopped == (len(got) < len(pushes) or d.stopped)


def test_stop_ends_the_stream():
    s = TextStream(TOY, set(), ["/"])
    assert s.push([H, SLASH, TAIL]) == Delta("Hello", True)
    assert s.stopped and s.text == "Hello"
    with pytest.raises(ValueError, match="stop string"):
        s.push([H])
    assert s.finish() == "" and s.text == "Hello"


def test_finish_flushes_held_text_once():
    s = TextStream(TOY, set(), ["</answer>"])
    assert s.push([H, LT_SP, SLASH]) == Delta("Hello ", False)
    assert s.finish() == "</"
    assert s.finish() == "" and s.text == "Hello </" and not s.stopped
    with pytest.raises(ValueError, match="finished"):
        s.push([H])


def test_finish_replaces_an_unfinished_character_and_can_still_stop():
    s = TextStream(TOY, set(), ["\ufffd"])
    assert s.push([H, CHECK_HEAD]) == Delta("Hello", False)
    assert s.finish() == "" and s.stopped and s.text == "Hello"


# ---------------------------------------------------------------- stop strings, real tokenizer

ALPHABET = "ab <>/é中🎉\n"


@SETTINGS
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(0, 50), max_size=10),
)
def test_stop_strings_cut_like_the_reference_under_any_chunking(hf_tokenizer, vocab, skip, text, stop, cuts):
    ids = encode(hf_tokenizer, text)
    full = hf_tokenizer.decode(ids, skip_special_tokens=True)
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    deltas, tail, s = stream_all(vocab, skip, [ids[a:b] for a, b in zip(bounds, bounds[1:])], stop)
    cut = first_stop_cut(full, stop)
    assert joined(deltas, tail) == (full if cut is None else full[:cut])
    assert s.stopped == (cut is not None) and s.text == joined(deltas, tail)
    assert all(REPLACEMENT not in d.text for d in deltas)


@pytest.mark.parametrize(
    "text, stop, want",
    [
        pytest.param("The answer is 42.</answer> more", ["</answer>"], "The answer is 42.", id="tag"),
        pytest.param("中文字符测试，我们今天去北京。", ["北京"], "中文字符测试，我们今天去", id="cjk"),
        pytest.param("party 🎉👍🏽 time", ["👍"], "party 🎉", id="emoji-split-over-tokens"),
        pytest.param("family 👨‍👩‍👧‍👦 flag", ["\u200d👧"], "family 👨\u200d👩", id="zwj"),
        pytest.param("café au lait", ["é"], "caf", id="accent"),
        pytest.param("no stop here", ["zzz", "\n\n"], "no stop here", id="no-match"),
        pytest.param("line one\n\nline two", ["\n\n", "one"], "line ", id="earliest-end"),
    ],
)
def test_stop_on_real_text_token_by_token(hf_tokenizer, vocab, skip, text, stop, want):
    ids = encode(hf_tokenizer, text)
    deltas, tail, s = stream_all(vocab, skip, [[t] for t in ids], stop)
    assert joined(deltas, tail) == want
    assert all(REPLACEMENT not in d.text for d in deltas)
    assert s.stopped == (want != text)


@pytest.mark.parametrize("stop, early, late, expected_text, stopped", [
    # "ab" is held back (it may grow into "abc") while matching is off; the "b" inside it came too early.
    pytest.param(("b", "abc"), "ab", "x", "abx", False, id="short-stop-inside-held-early-text"),
    pytest.param(("b", "abc"), "ab", "xb", "abx", True, id="a-later-match-still-stops"),
    pytest.param(("abc",), "ab", "c!", "", True, id="a-match-completed-after-min-tokens-stops"),
    pytest.param(("b",), "bb", "b", "bb", True, id="matches-only-past-the-early-text"),
])
def test_stop_strings_never_match_text_pushed_before_min_tokens(hf_tokenizer, vocab, skip, stop, early, late,
                                                                expected_text, stopped):
    s = TextStream(vocab, skip, stop)
    first = s.push(encode(hf_tokenizer, early), match_stop=False)
    second = s.push(encode(hf_tokenizer, late))
    assert not first.stopped and second.stopped is stopped
    assert first.text + second.text + s.finish() == expected_text
