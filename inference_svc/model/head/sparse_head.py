"""The LM head over the allowed ids only: the logits a step can sample, when the grammar says which before the head.

structd has the grammar's masks while the model body runs (engine.py), so a
step whose every sampled row is constrained to a short allowed-id list (or
forced, or finished) needs only those logits. `head_plan` decides from the
step's plan whether it qualifies and returns the union of the rows' allowed
ids; `SparseHead` computes the logits of just those columns (the LM head's
column form, lm_head.py: one gather of head-weight rows and one matmul,
bitwise the values the full head gives there) into a step-sized buffer that
is -inf everywhere else. Downstream (penalties, masks, bans, the draw,
logprobs) reads a constrained row only at its allowed ids (masking.py hands
allowed-id lists to the sampler as candidates), so the distribution drawn
from is exactly the full head's + mask; tests/test_sparse_head.py pins it.

The partial head: where the head's rows are independent of each other (the
oneDNN head, lm_head.py), a step with a few rows that need every logit
(unconstrained, inside a JSON string, a dense mask) computes the full head
for those rows only and columns for the rest: at N = 32 most constrained
steps have such a row, so the sparse head alone rarely applied there.

Screened rows: a greedy row without logprobs needs only its argmax, so it
gets the columns a bfloat16 screen of the head keeps (greedy_head.py) instead
of every column, whether it is unconstrained or its mask is a disallowed list
or dense.

The column form costs in proportion to its columns, so past some union size
the full head is cheaper: hence MAX_SPARSE_IDS (docs/benchmarks.md, "The
column form's cost", has the figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inference_svc.model.head.lm_head import LmHead
from shared.codec import SparseMask

# Union of the step's allowed ids above which the full head is computed instead. Set from the first,
# hand-timed measurement; at this limit the gather + matmul is a small share of the full head, and the limit
# stays until an end-to-end run shows steps gaining from a wider union (docs/benchmarks.md, "The column
# form's cost").
MAX_SPARSE_IDS = 8192

# (row, mask as it came: SparseMask or None when dense) per constrained row, as RowPlan.masked holds them.
Masked = Sequence[tuple[int, SparseMask | None]]


@dataclass(frozen=True)
class HeadPlan:
    """What a step's head computes: every column for `full_rows` (logit rows, sorted); for `screened` rows
    (greedy rows without logprobs, with the ids each may not take) the ids a bfloat16 screen keeps
    (greedy_head.py); and the columns `ids` (sorted union of the other sampled rows' allowed ids) for the
    rest. `vocab_limit`: ids at or past it are no token (a padded head)."""

    ids: np.ndarray
    full_rows: np.ndarray
    screened: tuple[tuple[int, np.ndarray | None], ...] = ()
    vocab_limit: int | None = None


def head_plan(sample: Sequence[int], masked: Masked, vocab_size: int, *, partial: bool = False,
              greedy: Mapping[int, np.ndarray | None] | None = None,
              max_ids: int = MAX_SPARSE_IDS) -> HeadPlan | None:
    """The step's head plan, or None when it is the full head over every row.

    A row needs every column when it is unconstrained, or its mask came
    dense or as a list of disallowed ids, unless it is in `greedy` (row ->
    ids it may not take besides its disallowed ones, e.g. a banned EOS; for a
    dense mask, every id it disallows; None: none, and a dense row with None
    is not screened): then it is screened instead, unless some other row
    needs the float32 head in full (then they join it). Without `partial` (a head whose rows are not
    independent) a row needing every column means the full head; with it,
    those rows get the full head and the rest their columns, as long as they
    are at most half the rows to sample (a full head over k rows costs about
    as much as over 2k at these sizes: docs/benchmarks.md, "The partial head"). A union of
    allowed ids over max_ids means the full head. No rows to sample: an
    empty plan (no head at all).
    """
    forms = dict(masked)
    greedy = greedy or {}
    hit = None
    full = []
    screened = []
    for row in sample:
        form = forms.get(row, _UNCONSTRAINED)
        if form is None or not form.allow:  # dense, unconstrained (no allow) or a disallowed list
            if row in greedy and partial and (form is not None or greedy[row] is not None):
                extra = greedy[row]
                banned = form.ids if form is not None and form is not _UNCONSTRAINED else None
                if banned is not None and extra is not None:
                    banned = np.union1d(banned, extra)
                screened.append((row, banned if banned is not None else extra))
                continue
            if not partial:
                return None
            full.append(row)
            continue
        if hit is None:
            hit = np.zeros(vocab_size, dtype=np.bool_)
        hit[form.ids[form.ids < vocab_size]] = True
    if full and screened:
        # The float32 head runs for the full rows anyway, and a few more rows cost it little (docs/benchmarks.md,
        # "The LM head's kernel": the packed head's time barely grows from 1 to 4 rows): the screen would only
        # add its own cost.
        full += [row for row, _ in screened]
        screened = []
    if full and 2 * len(full) > len(sample):
        return None
    union = np.flatnonzero(hit) if hit is not None else np.empty(0, dtype=np.int64)
    if union.size > max_ids:
        return None
    return HeadPlan(union, np.array(sorted(full), dtype=np.int64), tuple(screened), vocab_size)


def disallowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids a packed int32 bitmask row (bit j of word w: id 32w + j allowed) disallows, below vocab_size."""
    allowed = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(allowed == 0)


# A sampled row with no entry in `masked`.
_UNCONSTRAINED = SparseMask(False, np.empty(0, dtype=np.int64))


class SparseHead:
    """An LM head (lm_head.py, with exact columns) computed over chosen columns into a reused -inf buffer.

    The buffer is handed out as the step's logits and reused next step: the
    columns and the full rows written last time are set back to -inf first.
    Whatever the sampler writes in place elsewhere is -inf already (bans,
    padding) or stays -inf (a repetition penalty scales -inf to -inf), so the
    rest of the buffer never needs refilling.
    """

    def __init__(self, head: LmHead, max_rows: int):
        if not head.exact_columns:
            raise ValueError(f"the {head.name} LM head has no exact column form on this machine")
        self.head = head
        self.weight = head.kernel.weight
        self._rows = max_rows
        self._buffer: torch.Tensor | None = None  # allocated on first use: a server that never qualifies pays nothing
        self._written: torch.Tensor | None = None  # the columns last written
        self._written_rows: torch.Tensor | None = None  # the rows last written in full
        self._used = 0  # rows of the buffer the last step handed out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, ids: np.ndarray, full_rows: np.ndarray | None = None,
               screened: Sequence[tuple[int, np.ndarray | None]] = (), vocab_limit: int | None = None) -> torch.Tensor:
        """float32 logits [rows, V]: the head's values at `ids` (sorted int64), -inf elsewhere; the rows
        `full_rows` (sorted logit-row indices) in full, when the head's rows are independent; the `screened`
        rows (row, ids it may not take) at the ids the greedy screen keeps (greedy_head.py), or in full
        where it cannot answer."""
        rows = hidden.shape[0]
        if screened:
            ids, full_rows = self._screen(hidden, ids, full_rows, screened, vocab_limit)
        if self._buffer is None or rows > self._buffer.shape[0]:
            self._buffer = torch.full((max(rows, self._rows), self.weight.shape[0]), float("-inf"),
                                      dtype=torch.float32, device=self.weight.device)
            self._written = self._written_rows = None
        if self._written is not None:
            # Only the rows the last step used: a column reset is a scattered write in every row it covers.
            self._buffer[:self._used].index_fill_(1, self._written, float("-inf"))
            self._written = None
        if self._written_rows is not None:
            self._buffer.index_fill_(0, self._written_rows, float("-inf"))
            self._written_rows = None
        out = self._buffer[:rows]
        self._used = rows
        if ids.size:
            at = torch.from_numpy(ids).to(self.weight.device)
            out.index_copy_(1, at, self.head.columns(hidden, at))
            self._written = at
        if full_rows is not None and full_rows.size:
            if not self.head.rows_independent:
                raise ValueError(f"the {self.head.name} LM head's rows depend on each other: no partial head")
            picked = torch.from_numpy(full_rows).to(self.weight.device)
            out.index_copy_(0, picked, self.head.full(hidden.index_select(0, picked)))
            self._written_rows = picked
        return out

    def _screen(self, hidden, ids, full_rows, screened, vocab_limit) -> tuple[np.ndarray, np.ndarray | None]:
        """The screened rows' candidate ids joined to `ids` (every row gets the union's exact values: an id
        another row kept is never above this row's maximum among the ids it may take, and the sampler keeps
        a row's excluded ids out as before: it writes -inf at a banned EOS and padding, and checks a greedy
        winner against the row's mask), and the rows the screen could not answer for joined to `full_rows`."""
        screen = self.head.screen
        if screen is None or not self.head.rows_independent:
            raise ValueError(f"the {self.head.name} LM head has no greedy screen on this machine")
        rows = np.array([r for r, _ in screened], dtype=np.int64)
        found, fallback = screen.candidates(hidden.index_select(0, torch.from_numpy(rows)),
                                            [banned for _, banned in screened], vocab_limit)
        kept = [c for c in found if c is not None]
        union = np.union1d(ids, np.concatenate(kept)) if kept else ids
        late = [int(rows[k]) for k in sorted(fallback)]
        if union.size > MAX_SPARSE_IDS:
            union, late = ids, rows.tolist()  # too many candidates together: the screened rows in full
        if late:
            full_rows = np.union1d(full_rows if full_rows is not None else np.empty(0, np.int64), late)
        return union.astype(np.int64), full_rows
