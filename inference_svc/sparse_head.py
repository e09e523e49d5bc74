"""The LM head over the allowed ids only: the logits a step can sample, when the grammar says which before the head.

structd has the grammar's masks while the model body runs (engine.py), so a
step whose every sampled row is constrained to a short allowed-id list (or
forced, or finished) needs only those logits. `head_ids` decides from the
step's plan whether it qualifies and returns the union of the rows' allowed
ids; `SparseHead` computes the logits of just those columns (one gather of
head-weight rows, one matmul, padded to a multiple of 64 columns: bitwise the
values the full head gives there) into a step-sized buffer
that is -inf everywhere else. Downstream (penalties, masks, bans, the draw,
logprobs) reads a constrained row only at its allowed ids (masking.py hands
allowed-id lists to the sampler as candidates), so the distribution drawn
from is exactly the full head's + mask; tests/test_sparse_head.py pins it.

Measured (docs/benchmarks.md, one thread, 256 x 129,280 fp32): the full
head takes 16 ms at 1 row and 30-55 ms at 32 rows; 1,000 columns take
0.1-0.5 ms, 5,000 about 2.5 ms, 20,000 10-13 ms, hence MAX_SPARSE_IDS.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared.codec import SparseMask

# Union of the step's allowed ids above which the full head is computed instead: at 8,192 columns the
# gather + matmul costs about a quarter of the full head at one row (less at more rows).
MAX_SPARSE_IDS = 8192

# Columns computed in multiples of this: with MKL (torch's CPU BLAS here) a matmul over 1-3, 7, 9, 15, 17,
# 31, 33, ... columns rounds some logits 1 ulp away from the full head's; over multiples of 64 it matched
# the full head bitwise for every width and row count tried (tests/test_sparse_head.py pins it).
COLUMN_QUANTUM = 64

# (row, mask as it came: SparseMask or None when dense) per constrained row, as RowPlan.masked holds them.
Masked = Sequence[tuple[int, SparseMask | None]]


def head_ids(sample: Sequence[int], masked: Masked, vocab_size: int,
             max_ids: int = MAX_SPARSE_IDS) -> np.ndarray | None:
    """The sorted union of the allowed ids of the rows to sample, or None when some row needs the full head.

    A row needs the full head when it is unconstrained, or its mask came
    dense or as a list of disallowed ids; the step does when the union
    exceeds max_ids. No rows to sample: an empty union (no head at all).
    """
    forms = dict(masked)
    hit = None
    for row in sample:
        form = forms.get(row)
        if form is None or not form.allow:
            return None
        if hit is None:
            hit = np.zeros(vocab_size, dtype=np.bool_)
        hit[form.ids[form.ids < vocab_size]] = True
    if hit is None:
        return np.empty(0, dtype=np.int64)
    union = np.flatnonzero(hit)
    return union if union.size <= max_ids else None


class SparseHead:
    """An LM head (weight [V, H], optional bias) computed over chosen columns into a reused -inf buffer.

    The buffer is handed out as the step's logits and reused next step: the
    columns written last time are set back to -inf first. Whatever the
    sampler writes in place elsewhere is -inf already (bans, padding) or
    stays -inf (a repetition penalty scales -inf to -inf), so the rest of the
    buffer never needs refilling.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int):
        self.weight = weight
        self.bias = bias
        self._rows = max_rows
        self._buffer: torch.Tensor | None = None  # allocated on first use: a server that never qualifies pays nothing
        self._written: torch.Tensor | None = None  # the columns last written

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
        """float32 logits [rows, V]: the head's values at `ids` (sorted int64), -inf elsewhere."""
        rows = hidden.shape[0]
        if self._buffer is None or rows > self._buffer.shape[0]:
            self._buffer = torch.full((max(rows, self._rows), self.weight.shape[0]), float("-inf"),
                                      dtype=torch.float32, device=self.weight.device)
            self._written = None
        if self._written is not None:
            self._buffer.index_fill_(1, self._written, float("-inf"))
            self._written = None
        out = self._buffer[:rows]
        if ids.size:
            at = torch.from_numpy(ids).to(self.weight.device)
            # Padded to a multiple of COLUMN_QUANTUM columns (with id 0, dropped after): MKL computes a
            # handful of columns with other kernels whose sums round differently (1 ulp) from the full head's.
            pad = -ids.size % COLUMN_QUANTUM
            cols = torch.cat([at, at.new_zeros(pad)]) if pad else at
            bias = self.bias.index_select(0, cols) if self.bias is not None else None
            values = torch.nn.functional.linear(hidden, self.weight.index_select(0, cols), bias)
            out.index_copy_(1, at, values[:, :ids.size].float())
            self._written = at
        return out
