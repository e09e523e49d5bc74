"""Mask application's edge that mutation testing found untested (docs/mutation.md).

An allowed-id list whose last id is exactly the tokenizer's size (the
first column of a padded LM head) must not reach the sampler: it is past
the vocabulary, and drawing it would be a token the tokenizer cannot
decode.
"""

from __future__ import annotations

import numpy as np
import torch

from inference_svc.engine.masking import apply_masks
from shared.codec import SparseMask, words_for_vocab


def test_an_allowed_id_equal_to_the_vocabulary_size_is_dropped():
    vocab = 40
    logits = torch.zeros(1, vocab + 24)
    bitmask = torch.zeros((1, words_for_vocab(vocab + 24)), dtype=torch.int32)
    allowed = SparseMask(allow=True, ids=np.array([3, 39, 40], dtype=np.int64))
    assert apply_masks(logits, [(0, allowed)], bitmask, bitmask, vocab)[0].tolist() == [3, 39]
