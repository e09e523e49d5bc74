"""A step's logits turned into one token per sampled row: penalties, masks, bans, the draw, and its checks.

The engine decides what each row needs (`RowPlan`: which rows are sampled,
under which grammar mask, with which bans and penalties); `StepSampler`
applies it (on the device thread; on the CPU, on the event loop) in the order
the distribution is defined (logit bias, repetition penalty, presence and
frequency penalties, grammar mask, the padded LM head, EOS bans, then the draw
with logprobs where asked) and checks every
drawn token. Whatever goes wrong for one row fails that row alone: it comes
back as its exception.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from inference_svc.engine.masking import apply_masks
from inference_svc.engine.sampling import (RowLogprobs, RowSampler, add_at, adjust_rows, apply_occurrence_penalties,
                                           apply_repetition_penalty, ban_rows_unless_only, ban_unless_only, finite_at,
                                           numpy_fast, sample_with_logprobs)
from shared import errors
from shared.codec import SparseMask

log = logging.getLogger(__name__)

# A sampled row's token and, when its request asked, its logprobs.
Drawn = tuple[int, RowLogprobs | None]


@dataclass
class RowPlan:
    """What a step does with its logits rows (row = index into the step's sampled requests)."""

    sample: list[int] = field(default_factory=list)  # rows to sample
    masked: list[tuple[int, SparseMask | None]] = field(default_factory=list)  # constrained rows among them
    ban_eos: list[int] = field(default_factory=list)  # unconstrained rows with ignore_eos
    forced: dict[int, list[int]] = field(default_factory=dict)  # jump-forward rows: their forced tokens
    # From the sampled requests' options (`_sample`): (row, distinct ids of prompt + output, penalty) ...
    penalties: list[tuple[int, np.ndarray, float]] = field(default_factory=list)
    before_min_tokens: list[int] = field(default_factory=list)  # ... and rows whose EOS min_tokens bans
    # ... (row, token ids, biases) of logit_bias; (row, the output's distinct ids, their counts, presence,
    # frequency); rows of before_min_tokens with stop_token_ids: EOS and them, the ids min_tokens bans.
    bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    occurrences: list[tuple[int, np.ndarray, np.ndarray, float, float]] = field(default_factory=list)
    min_tokens_bans: dict[int, np.ndarray] = field(default_factory=dict)


class StepSampler:
    """Samples the engine's steps; holds the bitmask rows the grammar tier decodes masks into."""

    def __init__(self, vocab_size: int, eos_ids: Collection[int], bitmask_host: torch.Tensor,
                 bitmask_dev: torch.Tensor):
        self.vocab_size = vocab_size  # the tokenizer's: LM-head columns past it are padding
        self._bitmask_host = bitmask_host
        self._bitmask_np = bitmask_host.numpy()
        self._bitmask_dev = bitmask_dev
        self._eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=bitmask_dev.device)
        self._eos_np = np.array(sorted(eos_ids), dtype=np.int64)

    @torch.inference_mode()  # the logits are inference tensors: in-place masking needs the same mode
    def sample(self, logits: torch.Tensor, plan: RowPlan, samplers: list[RowSampler]) -> list[Drawn | Exception]:
        """One token (with its logprobs where asked) per planned row, or the exception that row failed with
        (the others are unaffected)."""
        vocab = self.vocab_size
        failed: dict[int, Exception] = {}
        if plan.bias or plan.penalties or plan.occurrences:
            self._adjust(logits, plan, failed)
        restrict = {}
        checked = self._greedy_checks(logits, plan, samplers) if plan.masked else {}
        if plan.masked:
            masked = [(i, form) for i, form in plan.masked if i not in checked] if checked else plan.masked
            restrict = apply_masks(logits, masked, self._bitmask_host, self._bitmask_dev, vocab)
        if logits.shape[1] > vocab:
            # A padded LM head: the padding is no token of the tokenizer, for any row.
            logits[:, vocab:] = float("-inf")
        if plan.ban_eos:
            idx = torch.tensor(plan.ban_eos, device=logits.device)
            logits[idx.unsqueeze(1), self._eos.unsqueeze(0)] = float("-inf")
        # No EOS before min_tokens, unless EOS is all the row allows: a grammar that has completed allows nothing
        # else, and the constraint wins (the proto: it "still ends the output where its grammar completes"); any
        # other token would break the constraint, and none would fail the request. Rows without an allowed-id
        # list are banned together (row by row, each would wait on the host: on a GPU, for the device).
        whole, bans = [], []
        for i in plan.before_min_tokens:
            banned = plan.min_tokens_bans.get(i, self._eos_np) if plan.min_tokens_bans else self._eos_np
            if i in restrict or not logits.is_contiguous():
                allowed = ban_unless_only(logits, i, banned, restrict.get(i))
                if allowed is not None:
                    restrict[i] = allowed
            else:
                whole.append(i)
                bans.append(banned)
        ban_rows_unless_only(logits, whole, bans)
        rows = plan.sample
        candidates = [restrict.get(i) for i in rows] if restrict else [None] * len(rows)
        out: list[int | Exception] = [0] * len(rows)
        logprobs: list[RowLogprobs | None] = [None] * len(rows)
        todo = []
        for k, c in enumerate(candidates):
            if rows[k] in failed:
                out[k] = failed[rows[k]]
            elif c is not None and c.size == 0:
                out[k] = no_token_error()
            elif rows[k] in checked:
                out[k] = self._argmax_checked(logits, rows[k], checked[rows[k]])
            else:
                todo.append(k)
        picked, picked_logprobs = self._sample_rows(logits, [samplers[k] for k in todo], [rows[k] for k in todo],
                                                    [candidates[k] for k in todo])
        for k, token, lp in zip(todo, picked, picked_logprobs):
            out[k] = token
            logprobs[k] = lp
        # A row with no finite logit left (everything masked, or a broken model) "samples" some index:
        # check the token exists and was drawable (one gather over the step's rows).
        good = [k for k in range(len(rows)) if isinstance(out[k], int)]
        for k in good:
            if not 0 <= out[k] < vocab:
                out[k] = no_token_error()
        good = [k for k in good if isinstance(out[k], int)]
        if good:
            for k, ok in zip(good, finite_at(logits, [rows[k] for k in good], [out[k] for k in good])):
                if not ok:
                    out[k] = no_token_error()
        return [token if isinstance(token, Exception) else (token, lp) for token, lp in zip(out, logprobs)]

    @staticmethod
    def _adjust(logits: torch.Tensor, plan: RowPlan, failed: dict[int, Exception]) -> None:
        """The rows' logit bias, then repetition, presence and frequency penalties (vLLM's order), in place:
        every row at once (`adjust_rows`), or row by row where the logits are not contiguous."""
        if logits.is_contiguous():
            for i in adjust_rows(logits, plan.bias, plan.penalties, plan.occurrences):
                failed[i] = IndexError(f"a token id of this row's logit bias or history is no column of the "
                                       f"logits (0 to {logits.shape[1] - 1})")
            return
        for i, ids, values in plan.bias:
            try:
                add_at(logits, i, ids, values)
            except Exception as e:  # noqa: BLE001 - this row's: it fails alone
                failed[i] = e
        for i, ids, penalty in plan.penalties:
            try:
                apply_repetition_penalty(logits, i, ids, penalty)
            except Exception as e:  # noqa: BLE001 - this row's history (an id the logits lack?): it fails alone
                failed[i] = e
        for i, ids, counts, presence, frequency in plan.occurrences:
            try:
                apply_occurrence_penalties(logits, i, ids, counts, presence, frequency)
            except Exception as e:  # noqa: BLE001 - as above
                failed[i] = e

    @staticmethod
    def _greedy_checks(logits: torch.Tensor, plan: RowPlan, samplers: list[RowSampler]) -> dict[int, SparseMask | None]:
        """Greedy rows without logprobs whose mask must otherwise be written into the row (a disallowed-id
        list, or a dense mask: None), on the CPU: their mask is checked at the row's argmax instead
        (_argmax_checked): writing tens of thousands of ids, or a dense mask unpacked over 129k columns, costs
        more than the argmax (`structd bench sampler`, string interiors: half the step). Rows whose EOS
        min_tokens bans keep the written mask (ban_unless_only reads it)."""
        if not numpy_fast(logits):
            return {}
        greedy = {i for i, s in zip(plan.sample, samplers) if s.argmax_only and not s.options.wants_logprobs}
        greedy.difference_update(plan.before_min_tokens)
        return {i: form for i, form in plan.masked if (form is None or not form.allow) and i in greedy}

    def _argmax_checked(self, logits: torch.Tensor, row: int, form: SparseMask | None) -> int:
        """The argmax of `row` under its mask (`form`: the disallowed ids; None: the dense mask in its bitmask
        row), as writing the mask first and taking the argmax would give: the row's own argmax (its first
        maximum, or first NaN) whenever the mask allows it, since then nothing before it is as large among
        the allowed; else the mask is written (apply_masks, as for any other row) and the row drawn again."""
        x = logits.detach().numpy()
        token = int(x[row].argmax())
        if form is not None:
            at = int(np.searchsorted(form.ids, token))
            allowed = at == form.ids.size or form.ids[at] != token
        else:
            allowed = bool((int(self._bitmask_np[row, token >> 5]) >> (token & 31)) & 1)
        if allowed:
            return token
        apply_masks(logits, [(row, form)], self._bitmask_host, self._bitmask_dev, self.vocab_size)
        return int(x[row].argmax())

    @staticmethod
    def _sample_rows(logits: torch.Tensor, samplers: list[RowSampler], rows: list[int],
                     candidates: list[np.ndarray | None]) -> tuple[list[int | Exception], list[RowLogprobs | None]]:
        if not rows:
            return [], []
        cands = candidates if any(c is not None for c in candidates) else None
        try:
            return sample_with_logprobs(logits, samplers, rows, cands)
        except Exception:  # noqa: BLE001 - some row's; find it by sampling each row alone, so only it fails
            # No input known raises here (rows with nothing drawable give a token the check below refuses); if
            # one does, rows the batch drew already draw again from generators that have moved on, so their
            # seeds no longer reproduce this step.
            log.exception("batched sampling failed; sampling row by row")
        out: list[int | Exception] = []
        logprobs: list[RowLogprobs | None] = []
        for s, row, c in zip(samplers, rows, candidates):
            try:
                (token,), (lp,) = sample_with_logprobs(logits, [s], [row], [c] if c is not None else None)
            except Exception as e:  # noqa: BLE001 - this row's alone
                token, lp = e, None
            out.append(token)
            logprobs.append(lp)
        return out, logprobs


def no_token_error() -> errors.NoAllowedTokenError:
    return errors.NoAllowedTokenError(
        "no token can be sampled here: every token the constraint allows has probability 0 (the constraint "
        "allows no token of this model's vocabulary at this point, or the model's logits are not finite)")
