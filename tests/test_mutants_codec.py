"""The mask codec's edges that mutation testing found untested (docs/mutation.md).

A row with no bit set decodes to an empty id array of int64 (ids index
tensors: a float array there fails at the first index), and a dense mask of
the wrong length is refused naming the length it must have, in bytes. An
id list too long to be remembered still decodes as the kind it came as (the
engine masks by `allow`), the vocabulary's limit is inclusive, a decoder
made without a cache refuses a cached slot, `padding` says whether the last
word has bits past the vocabulary (the grammar service's filler clears them
only then), and malformed id lists are refused saying how.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared.codec import (ALLOWED, CACHED, DECODE_MEMO_MAX_BYTES, DENSE, DISALLOWED, MAX_VOCAB_SIZE,
                          MaskDecodeError, MaskDecoder, MaskEncoder, _bits_to_ids, encode_ids)


@pytest.mark.parametrize("words", [pytest.param(4, id="even-words"), pytest.param(5, id="odd-words")])
def test_no_bit_set_is_an_empty_int64_id_array(words):
    ids = _bits_to_ids(np.zeros(words, dtype=np.uint32))
    assert ids.shape == (0,) and ids.dtype == np.int64


def test_a_dense_mask_of_the_wrong_length_names_the_right_one_in_bytes():
    decoder = MaskDecoder(vocab_size=100)  # 4 words: 16 bytes
    row = np.zeros(4, dtype=np.int32)
    with pytest.raises(MaskDecodeError, match=r"^dense mask has 12 bytes, expected 16$"):
        decoder.decode_into(DENSE, b"\0" * 12, row, [])


@pytest.mark.parametrize("field, allow", [pytest.param(ALLOWED, True, id="allowed"),
                                          pytest.param(DISALLOWED, False, id="disallowed")])
def test_an_id_list_past_the_memo_limit_keeps_its_kind(field, allow):
    ids = np.arange(0, 3 * DECODE_MEMO_MAX_BYTES, 2, dtype=np.int64)  # one byte per id: past the limit
    value = encode_ids(ids)
    assert len(value) > DECODE_MEMO_MAX_BYTES
    decoder = MaskDecoder(vocab_size=129_280)
    row = np.zeros(decoder.num_words, dtype=np.int32)
    sparse = decoder.decode_into(field, value, row, [])
    assert sparse.allow is allow and np.array_equal(sparse.ids, ids)
    assert np.array_equal(_bits_to_ids(row.view(np.uint32)), ids) == allow


def test_the_vocabulary_limit_is_inclusive():
    assert MaskEncoder(MAX_VOCAB_SIZE).vocab_size == MAX_VOCAB_SIZE
    with pytest.raises(ValueError, match=rf"^vocab_size must be in 1\.\.{MAX_VOCAB_SIZE}, got {MAX_VOCAB_SIZE + 1}$"):
        MaskEncoder(MAX_VOCAB_SIZE + 1)


@pytest.mark.parametrize("vocab, padding", [pytest.param(64, False, id="whole-words"),
                                            pytest.param(65, True, id="one-bit-past")])
def test_padding_says_whether_the_last_word_has_bits_past_the_vocabulary(vocab, padding):
    assert MaskEncoder(vocab).padding is padding


def test_a_decoder_without_a_cache_refuses_a_cached_slot():
    decoder = MaskDecoder(vocab_size=100)
    with pytest.raises(MaskDecodeError, match=r"^cached_slot 0 is outside this stream's 0 slots$"):
        decoder.decode_into(CACHED, 0, np.zeros(4, dtype=np.int32), [])


@pytest.mark.parametrize("value, message", [
    pytest.param(b"\x05\x85", "truncated varint in token id list", id="truncated"),
    pytest.param(b"\x80\x80\x80\x01", "token id delta longer than 3 bytes", id="four-byte-delta"),
])
def test_a_malformed_id_list_is_refused_saying_how(value, message):
    with pytest.raises(MaskDecodeError, match=f"^{message}$"):
        MaskDecoder(vocab_size=129_280).decode_into(ALLOWED, value, np.zeros(4040, dtype=np.int32), [])
