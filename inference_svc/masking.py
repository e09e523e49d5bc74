"""Grammar masks onto logits: disallowed tokens to -inf, right before sampling.

On a GPU one xgrammar bitmask kernel does every constrained row. On the CPU
that kernel expands 129k bits per row (~0.2 ms a row, measured here: 6.5 ms
for 32 rows), more than the rest of a step's sampling; but almost every mask
arrives as an id list (the allowed tokens after `{"`, the few disallowed ones
inside a string: see shared/codec.SparseMask), and writing -inf at those ids
costs microseconds. So on the CPU id lists are written directly, and the few
dense masks are expanded with numpy.

Not xgrammar's CPU kernel even for those: in 0.2.8 it writes one element
past each masked row when the row width is not a multiple of 32 (the first
element of the next row, or past the end of the tensor for the last one);
tests/test_inference_masking.py pins that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from shared.codec import SparseMask

NEG_INF = float("-inf")


def apply_masks(logits: torch.Tensor, masked: Sequence[tuple[int, SparseMask | None]], bitmask_host: torch.Tensor,
                bitmask_dev: torch.Tensor, vocab_size: int) -> None:
    """Masks logits rows in place.

    masked: (row, sparse form or None) per constrained row; every row's packed
    mask is also in bitmask_host (int32 [rows, words], decoded from the wire);
    bitmask_dev is the same on the logits' device (the same tensor on the CPU).
    vocab_size is the tokenizer's: logits columns past it (a padded model
    vocabulary) are never grammatical.
    """
    n = logits.shape[0]
    if logits.device.type != "cpu":
        bitmask_dev[:n].copy_(bitmask_host[:n], non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask_dev[:n], indices=[i for i, _ in masked])
        return
    dense = [i for i, form in masked if form is None]
    if dense:
        width = logits.shape[1]
        packed = bitmask_host[dense].numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little", count=width).view(np.bool_))
        rows = torch.tensor(dense)
        logits[rows] = logits[rows].masked_fill_(~allowed, NEG_INF)
    for i, form in masked:
        if form is None:
            continue
        row = logits[i]
        ids = torch.from_numpy(form.ids)
        if form.allow:
            kept = row.index_select(0, ids)
            row.fill_(NEG_INF)
            row.index_copy_(0, ids, kept)
        else:
            row.index_fill_(0, ids, NEG_INF)
            if row.shape[0] > vocab_size:
                row[vocab_size:] = NEG_INF
