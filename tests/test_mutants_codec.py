"""The mask codec's edges that mutation testing found untested (docs/mutation.md).

A row with no bit set decodes to an empty id array of int64 (ids index
tensors: a float array there fails at the first index), and a dense mask of
the wrong length is refused naming the length it must have, in bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared.codec import DENSE, MaskDecodeError, MaskDecoder, _bits_to_ids


@pytest.mark.parametrize("words", [pytest.param(4, id="even-words"), pytest.param(5, id="odd-words")])
def test_no_bit_set_is_an_empty_int64_id_array(words):
    ids = _bits_to_ids(np.zeros(words, dtype=np.uint32))
    assert ids.shape == (0,) and ids.dtype == np.int64


def test_a_dense_mask_of_the_wrong_length_names_the_right_one_in_bytes():
    decoder = MaskDecoder(vocab_size=100)  # 4 words: 16 bytes
    row = np.zeros(4, dtype=np.int32)
    with pytest.raises(MaskDecodeError, match=r"^dense mask has 12 bytes, expected 16$"):
        decoder.decode_into(DENSE, b"\0" * 12, row, [])
