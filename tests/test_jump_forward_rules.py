"""Jump-forward's boundary rules (grammar_svc/step/jump_forward.py), each on a tokenizer where only it decides.

On the served DeepSeek tokenizer (byte-level BPE, no normaliser, no two
tokens with the same bytes) the front rule and the bytes check reject the
same (last token, forced text) pairs, so a test there cannot tell whether
either rule is still in place. These tiny real tokenizers (the `tokenizers`
library, as the service loads tokenizer.json) each break one assumption:
two tokens spelling the same text (a byte-fallback token beside its
character, as in Llama's tokenizers), and a normaliser that changes the
text (lowercasing) so a token's bytes differ from what it stands for.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from grammar_svc.step.jump_forward import _tokenize_forced

# "<0x61>" is the byte-fallback spelling of "a": the same bytes as token 0.
VOCAB = {"a": 0, "b": 1, ",": 2, "<0x61>": 3, "ab": 4}
A, B, COMMA, A_BYTE, AB = range(5)


def tiny(normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[("a", "b")], byte_fallback=True))
    # Each comma its own pre-tokenizer segment: the tail rule holds back only the last one.
    tok.pre_tokenizer = pre_tokenizers.Split(",", "isolated")
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


TOKEN_BYTES = [b"a", b"b", b",", b"a", b"ab"]


@pytest.mark.parametrize("last, forced, expected", [
    pytest.param(A, ",b,", (",b", [COMMA, B]), id="clean-boundary-jumps-up-to-the-tail"),
    pytest.param(None, "b,a,", ("b,a", [B, COMMA, A]), id="no-last-token"),
    pytest.param(A, "b,", ("", []), id="merges-with-the-last-token"),
    # "a,b," tokenizes as [a , b ,]: it starts with token 0, not with the byte-fallback token the model wrote.
    # The kept tokens would still spell the forced text, so the bytes check alone would jump here.
    pytest.param(A_BYTE, ",b,", ("", []), id="starts-with-another-token-of-the-same-text"),
])
def test_front_rule(last, forced, expected):
    assert _tokenize_forced(tiny(), TOKEN_BYTES, last, forced) == expected


def test_bytes_check_refuses_tokens_that_spell_other_text():
    """Lowercased, ",B," is [, b ,] starting cleanly after the last token (the front rule passes), but those
    tokens spell ",b": jumping would tell the client ",B" while the model sees ",b"."""
    lower = tiny(normalizers.Lowercase())
    assert _tokenize_forced(lower, TOKEN_BYTES, A, ",B,") == ("", [])
    assert _tokenize_forced(lower, TOKEN_BYTES, A, ",b,") == (",b", [COMMA, B])
