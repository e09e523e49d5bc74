"""The LM head over the allowed ids only: the logits a step can sample, when the grammar says which before the head.

structd has the grammar's masks while the model body runs (engine.py), so a
step whose every sampled row is constrained to a short allowed-id list (or
forced, or finished) needs only those logits. `head_ids` decides from the
step's plan whether it qualifies and returns the union of the rows' allowed
ids; `SparseHead` computes the logits of just those columns (the LM head's
column form, lm_head.py: one gather of head-weight rows and one matmul,
bitwise the values the full head gives there) into a step-sized buffer that
is -inf everywhere else. Downstream (penalties, masks, bans, the draw,
logprobs) reads a constrained row only at its allowed ids (masking.py hands
allowed-id lists to the sampler as candidates), so the distribution drawn
from is exactly the full head's + mask; tests/test_sparse_head.py pins it.

Measured (docs/benchmarks.md, one thread, 256 x 129,280 fp32): the full
head takes 8-10 ms at 1 row and 22-30 ms at 32 rows; 1,000 columns take
0.1-0.5 ms, 8,192 1.3-2.5 ms, 20,000 10-13 ms, hence MAX_SPARSE_IDS.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from inference_svc.lm_head import LmHead
from shared.codec import SparseMask

# Union of the step's allowed ids above which the full head is computed instead: at 8,192 columns the
# gather + matmul costs about a quarter of the full head at one row (less at more rows).
MAX_SPARSE_IDS = 8192

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
    """An LM head (lm_head.py, with exact columns) computed over chosen columns into a reused -inf buffer.

    The buffer is handed out as the step's logits and reused next step: the
    columns written last time are set back to -inf first. Whatever the
    sampler writes in place elsewhere is -inf already (bans, padding) or
    stays -inf (a repetition penalty scales -inf to -inf), so the rest of the
    buffer never needs refilling.
    """

    def __init__(self, head: LmHead, max_rows: int):
        if not head.exact_columns:
            raise ValueError(f"the {head.name} LM head has no exact column form on this machine")
        self.head = head
        self.weight = head.kernel.weight
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
            out.index_copy_(1, at, self.head.columns(hidden, at))
            self._written = at
        return out
