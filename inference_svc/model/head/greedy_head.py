"""The greedy head: which logits can be the argmax, from a bfloat16 screen, so only those are computed exactly.

A greedy row without logprobs needs one thing of its 129k logits: the
largest (the first, on ties). On the CPU the float32 head is most of a step
(lm_head.py), while oneDNN computes the same head in bfloat16 (AMX) much
faster, the exact columns after it included (docs/benchmarks.md, "The greedy
head", has the figures). The screen computes that approximate head, and a bound on how far it
can be from the float32 head's values keeps every id that could be the
argmax; the float32 head is then computed at those candidate ids only (its
column form, bitwise its values there), the rest of the row is -inf, and the
argmax of that row is the float32 head's argmax.

The bound, for row h and head row w_j (the float32 head computes z_j; the
screen a_j): rounding h and w to bfloat16 changes each product by at most
(2u + u^2)|h_i w_ij| with u = 2^-8; float32 accumulation (the screen's and
the float32 head's own, in any order, over K = 256 terms) adds at most
~2 * K * 2^-24 of sum |h_i w_ij|; rounding a_j to bfloat16 adds at most 2u|a_j|
(even truncating). With sum |h_i w_ij| <= ||h||_2 ||w_j||_2 (Cauchy-Schwarz)
that is |a_j - z_j| < 0.016 ||h||_2 max_j ||w_j||_2; the screen uses twice
that (SCREEN_MARGIN). Then with m = max_j a_j and B the bound, every id with
a_j < m - 2B has z_j < m - B <= z of the screen's maximum: strictly below
the float32 maximum, never the argmax nor tied with it. Ids a row may not
take (its disallowed ids, banned EOS, padding columns) are left out before
the maximum. Rows whose hidden state is not finite, or whose screen keeps
more than MAX_CANDIDATES ids, get the full head instead. `GreedyScreen.create`
also checks the property on random rows at start-up and refuses to screen
if it ever failed (tests/test_greedy_head.py checks it on many more).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

# B = SCREEN_MARGIN * ||h||_2 * max_j ||w_j||_2: twice the worst case derived in the module doc.
SCREEN_MARGIN = 2 ** -5
# A row whose screen keeps more ids than this gets the full head (its candidates would cost as much).
MAX_CANDIDATES = 4096
# What an id a row may not take is set to in the screen: the bits of a negative NaN, negative as an int16
# and the lowest of all keys (_keys), so below every threshold either way.
EXCLUDED_BITS = np.int16(-1)
# The start-up check: random rows at a few scales, the screen must keep each row's float32 argmax.
CHECK_ROWS = 64


def _keys(bf16_bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (int16) -> int16 keys in the same order as the values (a monotonic map,
    its own inverse): negative values have their magnitude bits flipped."""
    keys = bf16_bits >> 15
    keys &= np.int16(0x7FFF)
    keys ^= bf16_bits
    return keys


def _key_values(keys: np.ndarray) -> np.ndarray:
    return torch.from_numpy(_keys(keys).astype(np.int16)).view(torch.bfloat16).float().numpy().astype(np.float64)


def _value_keys(values: np.ndarray) -> np.ndarray:
    bits = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return _keys(bits)


class GreedyScreen:
    """The bfloat16 screen over an LM head's float32 weight [V, H] (no bias: a biased head is not screened)."""

    def __init__(self, weight: torch.Tensor):
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), 32)
        self.vocab, self.width = weight.shape
        self._max_row_norm = float(weight.detach().double().norm(dim=1).max())

    @staticmethod
    def available(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return (bias is None and weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and bool(torch.isfinite(weight).all()))

    @classmethod
    def create(cls, weight: torch.Tensor, full) -> "GreedyScreen | None":
        """A screen for the head whose float32 logits `full(hidden)` computes, or None when this machine
        cannot screen it (no bfloat16 oneDNN, a bias) or the start-up check failed."""
        if not cls.available(weight, None):
            return None
        try:
            screen = cls(weight)
        except RuntimeError as e:  # this torch build's oneDNN cannot take the weight in bfloat16
            log.warning("greedy head: oneDNN cannot reorder the head in bfloat16 (%s); not screening", e)
            return None
        if not screen._check(full):
            log.warning("greedy head: the bfloat16 screen missed a float32 argmax on this machine; not screening")
            return None
        return screen

    @torch.inference_mode()
    def _check(self, full) -> bool:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(CHECK_ROWS, self.width, generator=g)
        hidden *= torch.logspace(-2, 2, CHECK_ROWS).unsqueeze(1)
        want = full(hidden).argmax(dim=1).numpy()
        cand, fallback = self.candidates(hidden, [None] * CHECK_ROWS)
        return all(r in fallback or want[r] in cand[r] for r in range(CHECK_ROWS))

    @torch.inference_mode()
    def candidates(self, hidden: torch.Tensor, exclude: Sequence[np.ndarray | None],
                   vocab_limit: int | None = None) -> tuple[list[np.ndarray | None], set[int]]:
        """Per row of `hidden` (float32 [k, H]), the sorted ids that may be its float32 head's argmax among
        the ids it may take (all but `exclude[r]` and those at or past vocab_limit), and the rows the
        screen cannot answer for (their entry is None): they need the full head."""
        k = hidden.shape[0]
        fallback: set[int] = set()
        norms = hidden.double().norm(dim=1).numpy()
        bound = SCREEN_MARGIN * norms * self._max_row_norm
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self._packed, None, "none", [], "")
        bits = approx.view(torch.int16).numpy()
        if vocab_limit is not None and vocab_limit < bits.shape[1]:
            bits[:, vocab_limit:] = EXCLUDED_BITS
        for r, ids in enumerate(exclude):
            if ids is not None and ids.size:
                bits[r, ids[ids < bits.shape[1]]] = EXCLUDED_BITS
        low = np.iinfo(np.int16).min
        keys, threshold = self._raw_thresholds(bits, bound)
        if keys is None:
            keys = _keys(bits)  # the excluded ids become the lowest key
            top = keys.max(axis=1)
            threshold = _value_keys(_key_values(top) - 2 * bound) - 1  # one bfloat16 step below: never above
            for r in range(k):
                if not np.isfinite(bound[r]) or top[r] == low:
                    fallback.add(r)
                    threshold[r] = np.iinfo(np.int16).max  # keeps nothing: this row gets the full head
        flat = np.flatnonzero(keys >= threshold[:, None])
        rows, cols = np.divmod(flat, keys.shape[1])
        starts = np.searchsorted(rows, np.arange(k + 1))
        out: list[np.ndarray | None] = []
        for r in range(k):
            ids = cols[starts[r]:starts[r + 1]]
            if r in fallback or ids.size > MAX_CANDIDATES:
                fallback.add(r)
                out.append(None)
            else:
                out.append(ids.astype(np.int64))
        return out, fallback

    @staticmethod
    def _raw_thresholds(bits: np.ndarray, bound: np.ndarray):
        """(bits, thresholds) when every row's maximum and threshold are positive: non-negative bfloat16
        values order like their bit patterns, and every negative one (the excluded ids too) lies below a
        positive threshold, so the bits are compared as they are (no pass over the whole matrix to transform
        them). (None, None) otherwise."""
        top = bits.max(axis=1)
        if not (top >= 0).all() or not np.isfinite(bound).all():
            return None, None
        wanted = torch.from_numpy(top).view(torch.bfloat16).double().numpy() - 2 * bound
        if not (wanted > 0).all():
            return None, None
        below = torch.from_numpy(wanted.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy() - 1
        return bits, np.maximum(below, 0)  # never -1: that is EXCLUDED_BITS
