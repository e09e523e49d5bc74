"""inference_svc/engine/sampling.py's batched draw against the row path it replaced (`_sample_row`).

The batch takes one uniform from each row's generator and inverts the CDF in
the row path's order, so with generators seeded alike the two draw the same
tokens (exact tests on fixed draws, every group: temperature only, top_k,
top_p, min_p, allowed-id lists, and rows whose cut reaches past the
candidates); the frequencies of many draws match a numpy reference of the
distribution (chi-square); masked ids are never drawn; logprobs are the row
path's; a seeded row's tokens do not depend on its neighbours, whatever
widths they make the batch use.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from inference_svc.engine import sampling
from inference_svc.engine.sampling import RowSampler, SamplingOptions, sample, sample_with_logprobs

NEG_INF = float("-inf")
REAL_VOCAB = 129_280
VOCAB = 32_000  # Llama 2's: wide enough for every path (blockwise top-k, cuts past 512 candidates), cheaper


def options(**overrides) -> SamplingOptions:
    fields = dict(max_tokens=0, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(), ignore_eos=False)
    fields.update(overrides)
    return SamplingOptions.validated(**fields, default_max_tokens=64, max_max_tokens=4096)


def model_like(rows: int, vocab: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    """Random logits whose nucleus holds tens to hundreds of tokens, as a model's often does."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def row_path(logits: torch.Tensor, samplers: list[RowSampler], cands=None) -> list[tuple[int, object]]:
    """The row path's tokens and logprobs, row by row (over the allowed ids where a row has a list)."""
    out = []
    for i, s in enumerate(samplers):
        if cands is None or cands[i] is None:
            out.append(sampling._sample_row(logits[i], s))
            continue
        ids = cands[i]
        pos, lp = sampling._sample_row(logits[i].index_select(0, torch.from_numpy(ids)), s)
        if lp is not None:
            lp = sampling.RowLogprobs(lp.logprob, tuple((int(ids[p]), v) for p, v in lp.top))
        out.append((int(ids[pos]), lp))
    return out


SPECS = [
    pytest.param(dict(temperature=0.8), id="temperature"),
    pytest.param(dict(temperature=1.3, top_k=50), id="top-k"),
    pytest.param(dict(temperature=0.8, top_p=0.9), id="top-p"),
    pytest.param(dict(temperature=0.7, min_p=0.05), id="min-p"),
    pytest.param(dict(temperature=0.9, top_k=40, top_p=0.8), id="top-k-top-p"),
    pytest.param(dict(temperature=1.0, top_p=0.95, min_p=0.02), id="top-p-min-p"),
    pytest.param(dict(temperature=1.0, top_k=2000, min_p=0.1), id="wide-top-k-min-p"),
    pytest.param(dict(temperature=3.0, min_p=0.001), id="min-p-keeping-most"),  # past the candidates
]


@pytest.mark.parametrize("candidates", [pytest.param(512, id="default-candidates"),
                                        pytest.param(8, id="cut-past-8-candidates")])
@pytest.mark.parametrize("spec", SPECS)
def test_batch_draws_the_row_paths_tokens_and_logprobs(spec, candidates, monkeypatch):
    """Seeded alike, the batch and the row path draw the same tokens with the same logprobs. With 8
    candidates most nuclei reach past them (those rows take the row path, or draw among the candidates when
    their cut stays inside: both must agree with the row path)."""
    monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", candidates)
    batch = [RowSampler(options(seed=s, top_logprobs=5, **spec)) for s in range(8)]
    rows = [RowSampler(options(seed=s, top_logprobs=5, **spec)) for s in range(8)]
    for step in range(4):
        x = model_like(8, VOCAB, seed=step)
        x[:, ::7] = NEG_INF
        tokens, logprobs = sample_with_logprobs(x, batch)
        want = row_path(x, rows)
        assert tokens == [t for t, _ in want]
        for got, (_, lp) in zip(logprobs, want):
            assert got.logprob == pytest.approx(lp.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in lp.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in lp.top], abs=1e-4)


@pytest.mark.parametrize("spec", [
    pytest.param(dict(temperature=0.8), id="temperature"),
    pytest.param(dict(temperature=1.2, top_k=3), id="top-k"),
    pytest.param(dict(temperature=0.8, top_p=0.7, logprobs=True), id="top-p"),
    pytest.param(dict(temperature=0.8, min_p=0.2), id="min-p"),
])
def test_allowed_lists_draw_the_row_paths_tokens(spec):
    """Rows with allowed-id lists of many lengths (one matrix, -inf padded) draw what the row path draws
    from each list."""
    rng = np.random.default_rng(3)
    cands = [np.sort(rng.choice(5000, size=n, replace=False)).astype(np.int64) for n in (4, 9, 40, 300, 700, 5)]
    batch = [RowSampler(options(seed=s, **spec)) for s in range(len(cands))]
    rows = [RowSampler(options(seed=s, **spec)) for s in range(len(cands))]
    for step in range(10):
        x = model_like(len(cands), 5000, seed=100 + step, scale=2.0)
        tokens, logprobs = sample_with_logprobs(x, batch, candidates=cands)
        want = row_path(x, rows, cands)
        assert tokens == [t for t, _ in want]
        assert all(t in ids for t, ids in zip(tokens, cands))
        for got, (_, lp) in zip(logprobs, want):
            assert (got is None) == (lp is None)
            if got is not None:
                assert got.logprob == pytest.approx(lp.logprob, abs=1e-4)


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution the row path draws from, in numpy: temperature, top_k, top_p (every token tied with
    the smallest kept), min_p, renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    if 0 < top_k < p.size:
        p[p < np.sort(p)[-top_k]] = 0.0
    if top_p < 1.0:
        asc = np.sort(p)
        cdf = np.cumsum(asc)
        p[p < asc[np.searchsorted(cdf, (1.0 - top_p) * cdf[-1], side="right")]] = 0.0
    if min_p > 0.0:
        p[p < min_p * p.max()] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("spec", [
    pytest.param(dict(temperature=1.0), id="t1"),
    pytest.param(dict(temperature=0.6, top_k=12), id="top-k"),
    pytest.param(dict(temperature=1.0, top_p=0.8), id="top-p"),
    pytest.param(dict(temperature=1.5, min_p=0.1), id="min-p"),
    pytest.param(dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02), id="all"),
])
def test_draw_frequencies_match_the_reference(spec, monkeypatch):
    """40,000 draws (unseeded rows: the batch's own randomness) against the reference distribution, with 6
    candidates so that nuclei reach past them and stay inside them in turn."""
    monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", 6)
    logits = np.random.default_rng(5).standard_normal(60) * 1.5
    want = reference(logits, spec["temperature"], spec.get("top_k", 0), spec.get("top_p", 1.0),
                     spec.get("min_p", 0.0))
    x = torch.tensor(np.tile(logits, (200, 1)), dtype=torch.float32)
    samplers = [RowSampler(options(**spec)) for _ in range(200)]
    counts: Counter = Counter()
    for _ in range(200):
        counts.update(sample(x, samplers))
    n = sum(counts.values())
    assert all(want[t] > 0 for t in counts)  # nothing outside the support
    # Cells expecting at least 20 draws, the rest lumped into one.
    big = [t for t in range(want.size) if want[t] * n >= 20]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [want[t] * n for t in big] + [n - sum(want[t] * n for t in big)]
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # A bound about 6 standard deviations above the mean: a failure means a wrong distribution.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_masked_ids_are_never_drawn_in_any_group():
    """Half the vocabulary at -inf, rows of every group in one step (and greedy ones among them)."""
    specs = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=2.0, top_k=80),
             dict(temperature=1.5, top_p=0.99), dict(temperature=3.0, min_p=0.001),
             dict(temperature=1.0, top_k=5, top_p=0.5, top_logprobs=4)]
    samplers = [RowSampler(options(seed=s, **spec)) for s, spec in enumerate(specs * 3)]
    gen = torch.Generator().manual_seed(8)
    for _ in range(10):
        x = torch.randn(len(samplers), REAL_VOCAB, generator=gen) * 2
        x[torch.rand(x.shape, generator=gen) < 0.5] = NEG_INF
        tokens, logprobs = sample_with_logprobs(x, samplers)
        assert all(torch.isfinite(x[i, t]) for i, t in enumerate(tokens))
        lp = logprobs[5]
        assert all(torch.isfinite(x[5, t]) for t, _ in lp.top) and len(lp.top) <= 4


def test_top_k_one_is_the_argmax_in_a_batch():
    x = model_like(6, REAL_VOCAB, seed=4)
    samplers = [RowSampler(options(seed=s, top_k=1, temperature=3.0)) for s in range(3)]
    samplers += [RowSampler(options(seed=s, top_k=2, temperature=0.01)) for s in range(3)]
    assert sample(x, samplers) == x.argmax(dim=1).tolist()


NEIGHBOURS = [dict(temperature=0.0), dict(temperature=1.0, top_k=3000), dict(temperature=0.9, min_p=0.001),
              dict(temperature=5.0, top_p=0.999), dict(temperature=1.0), dict(temperature=0.5, top_k=7)]


@pytest.mark.parametrize("spec", [
    pytest.param(dict(temperature=0.8, top_p=0.9), id="top-p"),
    pytest.param(dict(temperature=0.8, min_p=0.05), id="min-p"),
    pytest.param(dict(temperature=1.1, top_k=20, top_p=0.9), id="top-k-top-p"),
    pytest.param(dict(temperature=0.8), id="temperature"),
])
def test_a_seeded_row_does_not_depend_on_its_neighbours(spec):
    """Neighbours that widen the group's top-k (top_k 3000, a flat min_p or nucleus that takes the row path)
    or leave it narrow: the target row's tokens are those it draws alone."""
    def run(companions: list[dict], position: int) -> list[int]:
        target = RowSampler(options(seed=77, **spec))
        others = [RowSampler(options(seed=5 + k, **c)) for k, c in enumerate(companions)]
        tokens = []
        for step in range(8):
            samplers = others[:position] + [target] + others[position:]
            x = model_like(len(samplers), VOCAB, seed=1000 + step * 7 + len(companions))
            x[position] = model_like(1, VOCAB, seed=step)[0]
            tokens.append(sample(x, samplers)[position])
        return tokens

    alone = run([], 0)
    assert len(set(alone)) > 3
    assert run(NEIGHBOURS, 2) == alone
    assert run(NEIGHBOURS[::-1], 6) == alone


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device (scripts/device/check runs these on a GPU machine)")
def test_on_cuda_masked_ids_top_k_and_logprobs():
    """The batch on a CUDA device: masked ids never drawn, top_k respected, logprobs those of the numpy
    reference at the drawn token."""
    device = torch.device("cuda")
    specs = [dict(temperature=1.0), dict(temperature=0.8, top_k=20, logprobs=True),
             dict(temperature=0.8, top_p=0.9, logprobs=True), dict(temperature=0.7, min_p=0.05, logprobs=True)]
    samplers = [RowSampler(options(seed=s, **spec), device) for s, spec in enumerate(specs)]
    for step in range(10):
        x = model_like(len(specs), REAL_VOCAB, seed=step)
        x[:, ::3] = NEG_INF
        tokens, logprobs = sample_with_logprobs(x.to(device), samplers)
        for i, (token, lp, spec) in enumerate(zip(tokens, logprobs, specs)):
            assert torch.isfinite(x[i, token])
            want = reference(x[i].numpy(), spec["temperature"], spec.get("top_k", 0), spec.get("top_p", 1.0),
                             spec.get("min_p", 0.0))
            assert want[token] > 0
            if lp is not None:
                assert lp.logprob == pytest.approx(math.log(want[token]), abs=1e-3)


def test_adjustments_over_the_batch_equal_the_row_by_row_ones():
    """`adjust_rows` (bias, repetition, presence/frequency in one op each) writes exactly what the per-row
    functions write, -inf kept; a row with an id past the logits is reported and left out, the others exact."""
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    for trial in range(20):
        x = torch.randn(6, vocab, generator=gen) * 3
        x[:, ::9] = NEG_INF
        rng = np.random.default_rng(trial)
        bias = [(i, torch.from_numpy(np.sort(rng.choice(vocab, 5, replace=False))), torch.randn(5, generator=gen))
                for i in (0, 2, 5)]
        penalties = [(i, rng.choice(vocab, 30, replace=False).astype(np.int64), float(rng.uniform(0.5, 2)))
                     for i in (1, 2, 5)]
        occurrences = [(i, rng.choice(vocab, 20, replace=False).astype(np.int64),
                        rng.integers(1, 5, 20).astype(np.float32), float(rng.uniform(-2, 2)),
                        float(rng.uniform(-2, 2))) for i in (0, 3, 5)]
        with torch.inference_mode():
            by_row, at_once = x.clone(), x.clone()
            for i, ids, values in bias:
                sampling.add_at(by_row, i, ids, values)
            for i, ids, penalty in penalties:
                sampling.apply_repetition_penalty(by_row, i, ids, penalty)
            for i, ids, counts, presence, frequency in occurrences:
                sampling.apply_occurrence_penalties(by_row, i, ids, counts, presence, frequency)
            assert sampling.adjust_rows(at_once, bias, penalties, occurrences) == set()
        assert torch.equal(by_row, at_once)
    with torch.inference_mode():
        x = torch.zeros(3, vocab)
        bad = sampling.adjust_rows(x, [(0, torch.tensor([1, vocab]), torch.tensor([1.0, 2.0])),
                                       (1, torch.tensor([3]), torch.tensor([5.0]))],
                                   [(2, np.array([vocab + 5]), 1.5)], [])
    assert bad == {0, 2} and x[1, 3] == 5.0 and x[0].abs().sum() == 0


def test_greedy_logprobs_of_many_rows_at_once_are_the_row_by_rows():
    """Off the CPU's float32 path (a GPU; here float64 logits) the greedy rows' logprobs come from one
    log_softmax and one top-k over those rows: the same tokens, logprobs and alternatives as row by row."""
    x = model_like(6, 1000, seed=3).double()
    x[2, ::2] = NEG_INF
    tops = [5, 0, 3, 20, 1, 0]
    samplers = [RowSampler(options(temperature=0.0, top_logprobs=n, logprobs=True)) for n in tops]
    samplers[5] = RowSampler(options(temperature=0.0))  # no logprobs asked
    tokens, logprobs = sample_with_logprobs(x, samplers)
    assert tokens == x.argmax(1).tolist() and logprobs[5] is None
    for i in range(5):
        want = sampling._greedy_logprobs(x[i], tokens[i], tops[i])
        assert logprobs[i].logprob == pytest.approx(want.logprob, abs=1e-12)
        assert [t for t, _ in logprobs[i].top] == [t for t, _ in want.top]
        assert [v for _, v in logprobs[i].top] == pytest.approx([v for _, v in want.top], abs=1e-12)


BROKEN = [
    pytest.param("nan", id="one-nan"),
    pytest.param("all-nan", id="all-nan"),
    pytest.param("all-neg-inf", id="all-neg-inf"),
]


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("listed", [pytest.param(False, id="whole-row"), pytest.param(True, id="allowed-list")])
@pytest.mark.parametrize("spec", SPECS[:5])
def test_a_row_with_nothing_drawable_gives_a_token_the_step_refuses(spec, listed, broken):
    """A row whose drawable logits are NaN or all -inf (a broken model, every allowed id at -inf): its token
    is one whose logit is not finite (the step's check then reports NoAllowedTokenError for that row alone),
    and one of its allowed ids where it has a list (never a token the constraint forbids, however finite the
    rest of the row); the batch raises nothing, and the seeded neighbours draw what they draw alone."""
    x = model_like(3, VOCAB, seed=11)
    ids = np.array([3, 400, 5000, 31_000], dtype=np.int64)
    target = ids if listed else slice(None)
    if broken == "nan":
        x[1, ids[1] if listed else 123] = float("nan")
    else:
        x[1, target] = float("nan") if broken == "all-nan" else NEG_INF
    cands = [None, ids if listed else None, None]
    samplers = [RowSampler(options(seed=40 + k, logprobs=True, top_logprobs=2, **spec)) for k in range(3)]
    tokens, _ = sample_with_logprobs(x, samplers, candidates=cands)
    assert not math.isfinite(float(x[1, tokens[1]]))
    if listed:
        assert tokens[1] in ids.tolist()
    for k in (0, 2):
        alone = RowSampler(options(seed=40 + k, logprobs=True, top_logprobs=2, **spec))
        assert tokens[k] == sample(x[k:k + 1].clone(), [alone])[0]


@pytest.mark.parametrize("spec", SPECS[:5])
def test_allowed_ids_at_minus_infinity_never_yield_another_token(spec):
    """An allowed-id list whose logits are all -inf while the rest of the row is finite (a model that bans
    those tokens): the row path it falls back to draws among the list, not the whole row."""
    x = model_like(1, VOCAB, seed=12)
    ids = np.array([7, 70, 700], dtype=np.int64)
    x[0, ids] = NEG_INF
    for seed in range(5):
        (token,) = sample(x, [RowSampler(options(seed=seed, **spec))], candidates=[ids])
        assert token in ids.tolist()
