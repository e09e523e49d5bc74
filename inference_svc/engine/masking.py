"""Grammar masks onto logits, right before sampling: the one place that decides how each mask is honoured.

On a GPU one xgrammar bitmask kernel does every constrained row. On the CPU
that kernel expands 129k bits per row, which costs more than the rest of a
step's sampling (docs/benchmarks.md, "Hand-timed figures behind code choices",
"Dense masks on the CPU"); but almost every
mask arrives as an id list (the allowed tokens after `{"`, the few disallowed
ones inside a string: see shared/codec.SparseMask). So on the CPU a list of
allowed ids is not applied at all (the sampler reads just those logits), a
list of disallowed ids is written as -inf at its ids, and only the few dense
masks are expanded, with numpy (the sampler keeps both kinds back for greedy
rows and checks them at the row's argmax instead: step_sampler.py).

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
                bitmask_dev: torch.Tensor, vocab_size: int) -> dict[int, np.ndarray]:
    """Masks logits rows in place; returns {row: allowed ids} for rows left to the sampler to restrict.

    masked: (row, sparse form or None) per constrained row; every row's packed
    mask is also in bitmask_host (int32 [rows, words], decoded from the wire;
    on the CPU rows of id-list masks may be left unwritten, see
    MaskDecoder(write_sparse_rows=False)); bitmask_dev is the same on the
    logits' device (the same tensor on the CPU). vocab_size is the tokenizer's:
    logits columns past it (a padded model vocabulary) are never grammatical.
    """
    n = logits.shape[0]
    if logits.device.type != "cpu":
        bitmask_dev[:n].copy_(bitmask_host[:n], non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask_dev[:n], indices=[i for i, _ in masked])
        return {}
    dense = [i for i, form in masked if form is None]
    if dense:
        width = logits.shape[1]
        packed = bitmask_host[dense].numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little", count=width).view(np.bool_))
        rows = torch.tensor(dense)
        logits[rows] = logits[rows].masked_fill_(~allowed, NEG_INF)
    for i, form in masked:
        if form is not None and not form.allow:
            row = logits[i]
            row.index_fill_(0, torch.from_numpy(form.ids), NEG_INF)
            if row.shape[0] > vocab_size:
                row[vocab_size:] = NEG_INF
    return {i: _below(form.ids, vocab_size) for i, form in masked if form is not None and form.allow}


def _below(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The sorted ids under vocab_size (ids past the tokenizer, in a padded LM head, are never sampled)."""
    if ids.size and ids[-1] >= vocab_size:
        return ids[:np.searchsorted(ids, vocab_size)]
    return ids
