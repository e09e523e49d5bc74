"""Sparse (id-list) masking on the CPU gives exactly what xgrammar's bitmask kernel gives."""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_svc.engine.masking import apply_masks
from shared.codec import MaskDecoder, MaskEncoder, words_for_vocab


@st.composite
def batches(draw):
    vocab = draw(st.integers(1, 300))
    extra = draw(st.sampled_from([0, 0, 5, 40]))  # logits wider than the tokenizer (padded vocabularies)
    n = draw(st.integers(1, 6))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["few", "most", "random", "none", "all"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        p = {"few": 0.03, "most": 0.97, "random": 0.5, "none": 0.0, "all": 1.0}[kind]
        rows.append(np.flatnonzero(rng.random(vocab) < p))
    constrained = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return vocab, extra, rows, constrained


@settings(max_examples=150, deadline=None)
@given(batches())
def test_sparse_masking_equals_the_bitmask_kernel(case):
    vocab, extra, allowed, constrained = case
    n, words = len(allowed), words_for_vocab(vocab + extra)
    enc, dec = MaskEncoder(vocab), MaskDecoder(vocab)
    bitmask = torch.zeros((n, words), dtype=torch.int32)
    masked = []
    for i, ids in enumerate(allowed):
        row = np.zeros(words_for_vocab(vocab), dtype=np.uint32)
        np.bitwise_or.at(row, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
        e = enc.encode_row(row.view(np.int32))
        form = dec.decode_into(e.field, e.value, bitmask[i].numpy(), [])
        if constrained[i]:
            masked.append((i, form))
    logits = torch.randn(n, vocab + extra, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    for i, _ in masked:
        # xgrammar's kernel one row at a time, on a row padded to whole words (see the test below).
        padded = torch.zeros(1, words * 32)
        padded[0, : vocab + extra] = expected[i]
        xgr.apply_token_bitmask_inplace(padded, bitmask[i:i + 1])
        expected[i] = padded[0, : vocab + extra]
    restrict = apply_masks(logits, masked, bitmask, bitmask, vocab)
    # Rows handed back to the sampler: it reads only their allowed ids, which is the kernel's masked row.
    assert set(restrict) == {i for i, form in masked if form is not None and form.allow}
    for i, ids in restrict.items():
        allowed_only = torch.full_like(logits[i], float("-inf"))
        allowed_only[torch.from_numpy(ids)] = logits[i, torch.from_numpy(ids)]
        logits[i] = allowed_only
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_xgrammar_cpu_kernel_writes_past_rows_of_partial_words():
    """Why apply_masks expands dense rows itself: xgrammar 0.2.8's CPU kernel masks row 1 of a 5-wide
    batch and also writes -inf into row 2. When this starts failing, the kernel is fixed."""
    logits = torch.zeros(3, 5)
    bitmask = torch.tensor([[0], [31], [0]], dtype=torch.int32)  # row 1: all five tokens allowed
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[1])
    assert torch.isinf(logits).sum(1).tolist() == [0, 0, 1]
    ours = torch.zeros(3, 5)
    apply_masks(ours, [(1, None)], bitmask, bitmask, 5)
    assert torch.isinf(ours).sum().item() == 0


def test_every_form_is_exercised():
    """The encoder picks allowed lists for sparse rows, disallowed lists for full ones, dense between."""
    vocab = 4000
    enc, dec = MaskEncoder(vocab), MaskDecoder(vocab)
    forms = []
    for ids in (np.arange(0, vocab, 997), np.arange(vocab)[np.arange(vocab) % 997 != 0], np.arange(0, vocab, 2)):
        row = np.zeros(words_for_vocab(vocab), dtype=np.uint32)
        np.bitwise_or.at(row, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
        e = enc.encode_row(row.view(np.int32))
        out = np.zeros(words_for_vocab(vocab), dtype=np.int32)
        form = dec.decode_into(e.field, e.value, out, [])
        forms.append(None if form is None else form.allow)
    assert forms == [True, False, None]


def test_unconstrained_rows_are_untouched():
    logits = torch.randn(3, 64)
    before = logits.clone()
    bitmask = torch.zeros((3, 2), dtype=torch.int32)
    apply_masks(logits, [(1, None)], bitmask, bitmask, 64)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).all()


def test_allowed_ids_past_the_tokenizer_are_never_handed_to_the_sampler():
    """A padded LM head (logits wider than the tokenizer): an allowed-id list that reaches past the tokenizer's
    vocabulary gives the sampler only the ids under it, and a disallowed list leaves the padding at -inf."""
    from shared.codec import SparseMask

    vocab = 40
    logits = torch.zeros(2, vocab + 24)
    bitmask = torch.zeros((2, words_for_vocab(vocab + 24)), dtype=torch.int32)
    allowed = SparseMask(allow=True, ids=np.array([3, 39, 40, 63], dtype=np.int64))
    disallowed = SparseMask(allow=False, ids=np.array([5], dtype=np.int64))
    restrict = apply_masks(logits, [(0, allowed), (1, disallowed)], bitmask, bitmask, vocab)
    assert list(restrict) == [0] and restrict[0].tolist() == [3, 39]
    assert torch.isinf(logits[1, vocab:]).all() and torch.isinf(logits[1, 5]) and not torch.isinf(logits[1, :5]).any()
