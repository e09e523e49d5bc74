"""inference_svc/engine/step_sampler.py: greedy rows with a disallowed-id list or a dense mask draw what the written mask
would give.

On the CPU such a row's mask is checked at the row's argmax instead of
written as -inf first (step_sampler._greedy_checks). Every case here is
drawn both ways, the rows in one step, and must give the same token (or the
same failure): the unmasked winner allowed or not, ties across the list,
NaN and -inf on either side, and rows that must keep the written mask
(logprobs, temperature, min_tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference_svc.engine.sampling import RowSampler, SamplingOptions
from inference_svc.engine.step_sampler import RowPlan, StepSampler
from shared.codec import SparseMask, words_for_vocab
from shared.errors import NoAllowedTokenError

VOCAB = 1000
EOS = 999
NEG_INF = float("-inf")
NAN = float("nan")
EXCLUDED = np.array([3, 10, 11, 500, 998], dtype=np.int64)


def options(**kw) -> SamplingOptions:
    base = dict(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=7, stop=(), ignore_eos=False,
                default_max_tokens=16, max_max_tokens=64)
    base.update(kw)
    return SamplingOptions.validated(**base)


def sampler() -> StepSampler:
    """Its bitmask rows hold, densely, the mask that allows everything but EXCLUDED."""
    bits = np.ones(words_for_vocab(VOCAB) * 32, dtype=np.uint8)
    bits[EXCLUDED] = 0
    row = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
    bitmask = row.repeat(8, 1)
    return StepSampler(VOCAB, [EOS], bitmask, bitmask)


# The same mask as it may arrive: the ids it disallows, or dense (None: the bitmask row).
FORMS = [pytest.param(SparseMask(False, EXCLUDED), id="disallowed-list"), pytest.param(None, id="dense")]


def written(row: torch.Tensor) -> int | type:
    """The token (or the failure) of drawing greedily after writing -inf at EXCLUDED."""
    masked = row.clone()
    masked[torch.from_numpy(EXCLUDED)] = NEG_INF
    token = int(masked.numpy().argmax())
    return token if np.isfinite(masked[token].item()) else NoAllowedTokenError


def setting(**values) -> torch.Tensor:
    """A row of small random logits with `values` ({id: logit}) set."""
    row = torch.from_numpy(np.random.default_rng(len(values)).standard_normal(VOCAB).astype(np.float32))
    for token, value in values.items():
        row[int(token.lstrip("t"))] = value
    return row


ROWS = [
    pytest.param(setting(t42=9.0), id="winner-allowed"),
    pytest.param(setting(t500=9.0, t42=8.0), id="winner-excluded"),
    pytest.param(setting(t10=9.0, t700=9.0), id="tie-excluded-first"),
    pytest.param(setting(t2=9.0, t11=9.0), id="tie-allowed-first"),
    pytest.param(setting(t3=NAN, t42=9.0), id="nan-excluded"),
    pytest.param(setting(t42=NAN, t500=9.0), id="nan-allowed"),
    pytest.param(torch.cat([torch.full((998,), NEG_INF), torch.tensor([5.0, NEG_INF])]), id="only-excluded-finite"),
    pytest.param(torch.full((VOCAB,), NEG_INF), id="all-minus-inf"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("opts", [
    pytest.param(dict(), id="greedy-checked"),
    pytest.param(dict(logprobs=True), id="greedy-logprobs-written"),
    pytest.param(dict(temperature=1e-4, seed=3), id="near-greedy-sampled-written"),
])
def test_a_checked_mask_gives_the_written_masks_token(form, row, opts):
    logits = torch.stack([setting(t1=20.0), row, setting(t7=20.0)])
    plan = RowPlan(sample=[0, 1, 2], masked=[(1, form), (2, form)])
    got = sampler().sample(logits.clone(), plan, [RowSampler(options(**opts)) for _ in range(3)])
    for i, drawn in ((1, got[1]), (2, got[2])):
        want = written(logits[i])
        if want is NoAllowedTokenError:
            assert isinstance(drawn, NoAllowedTokenError), drawn
        else:
            # At temperature 1e-4 the draw is the argmax unless the top two are within ~1e-3: never here.
            assert drawn[0] == want
    assert got[0][0] == 1  # an unconstrained row beside them is untouched


@pytest.mark.parametrize("form", FORMS)
def test_greedy_rows_are_checked_not_written(form):
    """The point of the check: a greedy row whose winner is allowed is never written to."""
    logits = torch.stack([setting(t42=9.0), setting(t42=9.0)])
    before = logits.clone()
    plan = RowPlan(sample=[0, 1], masked=[(0, form), (1, form)])
    got = sampler().sample(logits, plan, [RowSampler(options()), RowSampler(options(logprobs=True))])
    assert [g[0] for g in got] == [42, 42]
    assert torch.equal(logits[0], before[0])
    assert torch.isneginf(logits[1, torch.from_numpy(EXCLUDED)]).all()  # logprobs: the mask written


def test_a_row_before_min_tokens_keeps_the_written_mask():
    """ban_unless_only reads the masked row: EOS is the one allowed token, so it is drawn despite the ban."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 9.0
    everything_but_eos = np.array([t for t in range(VOCAB) if t != EOS], dtype=np.int64)
    plan = RowPlan(sample=[0], masked=[(0, SparseMask(False, everything_but_eos))], before_min_tokens=[0])
    (drawn,) = sampler().sample(logits, plan, [RowSampler(options(min_tokens=4))])
    assert drawn[0] == EOS


@pytest.mark.parametrize("opts", [
    pytest.param(dict(temperature=1.0), id="temperature"),
    pytest.param(dict(temperature=1.0, top_k=50), id="top-k"),
    pytest.param(dict(temperature=1.0, top_p=0.9), id="top-p"),
])
@pytest.mark.parametrize("value", [pytest.param(NEG_INF, id="minus-inf"), pytest.param(NAN, id="nan")])
def test_an_allowed_list_with_nothing_drawable_fails_that_row_alone(opts, value):
    """Every id of a sampled row's allowed list at -inf or NaN while the rest of its row is finite: that row
    gets NoAllowedTokenError (never a token outside its list), and its neighbours draw as without it."""
    allowed = np.array([5, 42, 700], dtype=np.int64)
    logits = torch.stack([setting(t1=20.0), setting(), setting(t7=20.0)])
    logits[1, torch.from_numpy(allowed)] = value
    plan = RowPlan(sample=[0, 1, 2], masked=[(1, SparseMask(True, allowed))])
    got = sampler().sample(logits.clone(), plan, [RowSampler(options(**opts)) for _ in range(3)])
    assert isinstance(got[1], NoAllowedTokenError), got[1]
    alone = sampler().sample(logits[[0, 2]].clone(), RowPlan(sample=[0, 1]),
                             [RowSampler(options(**opts)) for _ in range(2)])
    assert [got[0][0], got[2][0]] == [alone[0][0], alone[1][0]]
