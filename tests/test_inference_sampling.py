"""inference_svc/engine/sampling.py: option validation, greedy/top_k/top_p support, masks, per-request seeds, distribution.

Draw-based checks use fixed seeds, so they are deterministic; their bounds are
still loose enough that any correct sampler passes with any seed.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_svc.engine.sampling import (RowSampler, SamplingOptions, SeenTokens, apply_repetition_penalty, ban_unless_only,
                                    sample, sample_with_logprobs)
from shared.errors import InvalidRequestError

NEG_INF = float("-inf")
REAL_VOCAB = 129_280
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def options(**overrides) -> SamplingOptions:
    fields = dict(max_tokens=0, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(), ignore_eos=False)
    fields.update(overrides)
    return SamplingOptions.validated(**fields, default_max_tokens=64, max_max_tokens=4096)


def row(**overrides) -> RowSampler:
    return RowSampler(options(**overrides))


def draws(logits: list[float], n: int, seed: int = 0, **overrides) -> Counter:
    """Counts of n draws from one distribution: 100 rows per step, each with its own seed."""
    batch = 100
    x = torch.tensor([logits] * batch, dtype=torch.float32)
    rows = [row(seed=seed * 1000 + i, **overrides) for i in range(batch)]
    counts: Counter = Counter()
    for _ in range(n // batch):
        counts.update(sample(x, rows))
    return counts


def log_probs(*p: float) -> list[float]:
    return [math.log(v) if v > 0 else NEG_INF for v in p]


# ---------------------------------------------------------------- validation


def test_defaults_are_applied():
    o = options(max_tokens=0, top_p=0.0, top_k=0, stop=["a", "bc"])
    assert o.max_tokens == 64 and o.top_p == 1.0 and o.top_k == 0 and o.stop == ("a", "bc")
    assert options(top_p=1.0).top_p == 1.0 and options(top_p=0.5).top_p == 0.5
    assert options(max_tokens=4096).max_tokens == 4096
    assert options(temperature=0.0).greedy and not options(temperature=1e-6).greedy
    assert options(seed=0).seed == 0 and options(seed=2**64 - 1).seed == 2**64 - 1
    assert len(options(stop=["x" * 256] * 16).stop) == 16
    assert options(repetition_penalty=0.0).repetition_penalty == 1.0 == options().repetition_penalty
    assert options(repetition_penalty=1.3).repetition_penalty == 1.3
    assert options(top_logprobs=3).wants_logprobs and options(logprobs=True).wants_logprobs
    assert not options().wants_logprobs and options(top_logprobs=20).top_logprobs == 20
    assert options(max_tokens=0, min_tokens=64).min_tokens == 64  # up to the default max_tokens


@pytest.mark.parametrize(
    "overrides, field",
    [
        pytest.param(dict(temperature=-0.1), "temperature", id="negative-temperature"),
        pytest.param(dict(temperature=math.nan), "temperature", id="nan-temperature"),
        pytest.param(dict(temperature=math.inf), "temperature", id="inf-temperature"),
        pytest.param(dict(top_p=-0.01), r"top_p must be in \[0, 1\]", id="negative-top-p"),
        pytest.param(dict(top_p=1.01), r"top_p must be in \[0, 1\]", id="top-p-above-1"),
        pytest.param(dict(top_p=math.nan), "top_p", id="nan-top-p"),
        pytest.param(dict(top_k=-1), "top_k must be >= 0", id="negative-top-k"),
        pytest.param(dict(max_tokens=-1), r"max_tokens must be in \[0, 4096\]", id="negative-max-tokens"),
        pytest.param(dict(max_tokens=4097), r"max_tokens must be in \[0, 4096\]", id="max-tokens-over-cap"),
        pytest.param(dict(seed=-1), r"seed must be in \[0, 2\*\*64 - 1\]", id="negative-seed"),
        pytest.param(dict(seed=2**64), "seed", id="seed-over-uint64"),
        pytest.param(dict(stop=["s"] * 17), "at most 16", id="too-many-stops"),
        pytest.param(dict(stop=["ok", ""]), r"stop\[1\] must be 1 to 256", id="empty-stop"),
        pytest.param(dict(stop=["x" * 257]), r"stop\[0\] must be 1 to 256", id="long-stop"),
        pytest.param(dict(top_logprobs=21), r"top_logprobs must be in \[0, 20\], got 21", id="top-logprobs-over-20"),
        pytest.param(dict(top_logprobs=-1), r"top_logprobs must be in \[0, 20\]", id="negative-top-logprobs"),
        pytest.param(dict(max_tokens=8, min_tokens=9), r"min_tokens must be in \[0, max_tokens\] \(max_tokens is 8",
                     id="min-tokens-over-max-tokens"),
        pytest.param(dict(min_tokens=65), r"\(max_tokens is 64 here\)", id="min-tokens-over-default-max-tokens"),
        pytest.param(dict(min_tokens=-1), "min_tokens", id="negative-min-tokens"),
        pytest.param(dict(repetition_penalty=-0.5), "repetition_penalty must be a finite number > 0",
                     id="negative-repetition-penalty"),
        pytest.param(dict(repetition_penalty=math.nan), "repetition_penalty", id="nan-repetition-penalty"),
        pytest.param(dict(repetition_penalty=math.inf), "repetition_penalty", id="inf-repetition-penalty"),
    ],
)
def test_bad_values_name_the_field_and_range(overrides, field):
    with pytest.raises(InvalidRequestError, match=field):
        options(**overrides)


# ---------------------------------------------------------------- greedy


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5000, generator=g)
    x[:, ::3] = NEG_INF
    rows = [row(temperature=0.0), row(temperature=2.0), row(temperature=0.0), row(top_k=5),
            row(temperature=0.0, top_p=0.5), row(top_p=0.5)]
    got = sample(x, rows)
    want = x.argmax(dim=1).tolist()
    assert [got[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
    assert sample(x, [row(temperature=0.0)] * 6) == want


@SETTINGS
@given(
    logits=st.lists(
        st.sampled_from([-3.0, 0.0, 1.5, 2.0, NEG_INF]) | st.floats(-50, 50, width=32), min_size=2, max_size=40
    ),
    temperature=st.floats(0.05, 20),
    seed=st.integers(0, 2**64 - 1),
)
def test_top_k_one_equals_greedy(logits, temperature, seed):
    logits[-1] = 0.0  # at least one finite; ties are likely, and both pick the first of them
    x = torch.tensor([logits])
    want = int(x.argmax())
    assert sample(x, [row(top_k=1, temperature=temperature, seed=seed)]) == [want]
    assert sample(x, [row(temperature=0.0)]) == [want]


@pytest.mark.parametrize(
    "temperature", [1e-6, 1e-30, 1e-40, 1e-45, 1e-50, 1e-300],
    ids=["1e-6", "1e-30", "1e-40", "float32-subnormal", "below-float32", "1e-300"],
)
@pytest.mark.parametrize(
    "logits",
    [
        pytest.param([3.0e5, 2.9e5, NEG_INF, -1e30, 3.1e5], id="large"),
        pytest.param([-2.0, -1.0, NEG_INF, -3e38, 0.0], id="peak-zero"),
    ],
)
def test_tiny_temperature_neither_overflows_nor_leaves_the_argmax(temperature, logits):
    x = torch.tensor([logits])
    assert all(sample(x, [row(temperature=temperature, seed=s)]) == [4] for s in range(20))


# ---------------------------------------------------------------- masks and support


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(temperature=1.0), id="plain"),
        pytest.param(dict(temperature=50.0), id="hot"),
        pytest.param(dict(top_k=40), id="top-k-beyond-allowed-count"),
        pytest.param(dict(top_k=3), id="top-k"),
        pytest.param(dict(top_p=0.999), id="top-p-near-1"),
        pytest.param(dict(top_p=0.3, top_k=40, temperature=5.0), id="all"),
    ],
)
def test_masked_tokens_are_never_drawn(overrides):
    g = torch.Generator().manual_seed(7)
    vocab = 64
    x = torch.randn(vocab, generator=g) * 3
    allowed = set(torch.randperm(vocab, generator=g)[:20].tolist())
    for i in range(vocab):
        if i not in allowed:
            x[i] = NEG_INF
    counts = draws(x.tolist(), 5000, **overrides)
    assert set(counts) <= allowed


def test_a_single_allowed_token_is_always_drawn():
    x = torch.full((3, REAL_VOCAB), NEG_INF)
    x[:, 12345] = -1e4  # very unlikely under the model, but the only one allowed
    rows = [row(temperature=5.0, seed=1), row(top_p=0.5, seed=2), row(top_k=50, top_p=0.9, seed=3)]
    for _ in range(20):
        assert sample(x, rows) == [12345] * 3


@SETTINGS
@given(
    data=st.lists(st.tuples(st.floats(-30, 30, width=32), st.booleans()), min_size=1, max_size=60),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 7.0]),
    top_k=st.integers(0, 70),
    top_p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.999999, 1.0]),
    seed=st.integers(0, 2**64 - 1),
)
def test_property_draw_is_allowed_and_within_top_k(data, temperature, top_k, top_p, seed):
    logits = [v if allowed else NEG_INF for v, allowed in data]
    if all(v == NEG_INF for v in logits):
        logits[0] = 0.0
    x = torch.tensor([logits])
    r = row(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    for _ in range(5):
        (token,) = sample(x, [r])
        assert logits[token] != NEG_INF
        if top_k:
            # At most top_k - 1 tokens may be strictly more likely than the one drawn.
            assert sum(v > logits[token] for v in logits) < top_k


# Five tokens, shuffled so that the most likely one is not token 0.
ORDER = [3, 0, 4, 1, 2]  # token ids from most to least likely
PROBS = [0.4, 0.3, 0.2, 0.07, 0.03]
SHUFFLED = [0.0] * 5
for _tok, _p in zip(ORDER, PROBS):
    SHUFFLED[_tok] = _p


@pytest.mark.parametrize(
    "overrides, support",
    [
        pytest.param(dict(top_k=2), ORDER[:2], id="top-k-2"),
        pytest.param(dict(top_k=4), ORDER[:4], id="top-k-4"),
        pytest.param(dict(top_p=0.01), ORDER[:1], id="top-p-keeps-top-token"),
        pytest.param(dict(top_p=0.65), ORDER[:2], id="top-p-0.65"),
        pytest.param(dict(top_p=0.75), ORDER[:3], id="top-p-0.75"),
        # On the whole distribution 0.72 keeps three tokens (0.7 precede the third);
        # after top_k=3 renormalizes (0.44, 0.33, 0.22), 0.78 precede it: two.
        pytest.param(dict(top_k=3, top_p=0.72), ORDER[:2], id="top-p-after-top-k"),
        pytest.param(dict(top_p=0.72), ORDER[:3], id="top-p-0.72"),
        # Temperature acts first: at T=0.25 the top token has 0.4^4 / sum(p^4) = 0.74 of the mass.
        pytest.param(dict(temperature=0.25, top_p=0.7), ORDER[:1], id="top-p-after-temperature"),
        pytest.param(dict(), ORDER, id="no-restriction"),
    ],
)
def test_top_k_and_top_p_restrict_the_support(overrides, support):
    counts = draws(log_probs(*SHUFFLED), 6000, **overrides)
    assert set(counts) == set(support)


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    counts = draws([1.0] * 4 + [NEG_INF] * 4, 2000, top_p=0.3)
    assert set(counts) == {0, 1, 2, 3}


# ---------------------------------------------------------------- distribution


def chi_square(counts: Counter, expected: dict[int, float], n: int) -> float:
    assert set(counts) <= set(expected)
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())


def normalized(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(dict(), dict(zip(ORDER, PROBS)), id="t1"),
        pytest.param(dict(temperature=2.0), normalized({t: p**0.5 for t, p in zip(ORDER, PROBS)}), id="t2"),
        pytest.param(dict(temperature=0.5), normalized({t: p**2 for t, p in zip(ORDER, PROBS)}), id="t0.5"),
        pytest.param(dict(top_k=3), normalized(dict(zip(ORDER[:3], PROBS[:3]))), id="top-k-3"),
        pytest.param(dict(top_p=0.75), normalized(dict(zip(ORDER[:3], PROBS[:3]))), id="top-p-0.75"),
    ],
)
def test_draw_frequencies_match_the_distribution(overrides, expected):
    n = 20_000
    counts = draws(log_probs(*SHUFFLED), n, seed=3, **overrides)
    # With 4 degrees of freedom, P(chi2 > 35) is about 5e-7: a failure means a wrong distribution.
    assert chi_square(counts, expected, n) < 35


# ---------------------------------------------------------------- per-request seeds


def target_logits(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(vocab, generator=g) * 2
    x[torch.rand(vocab, generator=g) < 0.3] = NEG_INF
    return x


def run_target(overrides: dict, position: int, companions: list[dict], vocab: int = 500, steps: int = 40):
    """The target row's tokens over `steps` steps at `position` among `companions`."""
    target = row(**overrides)
    others = [row(**c) for c in companions]
    noise = torch.Generator().manual_seed(position * 31 + len(companions))
    tokens = []
    for step in range(steps):
        rows = others[:position] + [target] + others[position:]
        x = torch.randn(len(rows), vocab, generator=noise) * 2
        x[position] = target_logits(step, vocab)
        tokens.append(sample(x, rows)[position])
    return tokens


COMPANIONS = [dict(temperature=0.0), dict(seed=99), dict(), dict(top_k=10, seed=5), dict(top_p=0.5),
              dict(top_k=1)]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(seed=42), id="plain"),
        pytest.param(dict(seed=42, top_k=20), id="top-k"),
        pytest.param(dict(seed=42, top_p=0.8, temperature=1.5), id="top-p"),
        pytest.param(dict(seed=2**64 - 1, top_k=50, top_p=0.9, temperature=0.7), id="all"),
    ],
)
def test_seeded_row_is_reproducible_whatever_its_batch(overrides):
    alone = run_target(overrides, 0, [])
    assert len(set(alone)) > 5  # the check below would be vacuous for a near-constant sequence
    assert run_target(overrides, 3, COMPANIONS) == alone
    assert run_target(overrides, 0, COMPANIONS[::-1]) == alone
    assert run_target(overrides, 1, [dict(seed=overrides["seed"])] * 2) == alone  # same seed, other logits
    assert run_target(overrides, 6, COMPANIONS) == alone


def test_unseeded_and_differently_seeded_rows_differ():
    flat = dict(temperature=1.0)
    assert run_target({**flat, "seed": 1}, 0, []) != run_target({**flat, "seed": 2}, 0, [])
    assert run_target(flat, 0, []) != run_target(flat, 0, [])


# ---------------------------------------------------------------- the call itself


def test_logits_are_not_modified():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, REAL_VOCAB, generator=g)
    x[:, ::2] = NEG_INF
    before = x.clone()
    rows = [row(temperature=0.0), row(top_p=0.9), row(top_k=40), row(top_k=40, top_p=0.5),
            row(temperature=1e-40)]
    tokens = sample(x, rows)
    assert torch.equal(x, before)
    assert all(x[i, t] != NEG_INF for i, t in enumerate(tokens))


def test_shape_must_match_rows():
    with pytest.raises(ValueError, match="do not have the rows 2 samplers draw from"):
        sample(torch.zeros(1, 10), [row(), row()])
    with pytest.raises(ValueError):
        sample(torch.zeros(3, 10), [row(), row()], [0, 3])
    with pytest.raises(ValueError):
        sample(torch.zeros(3, 10), [row(), row()], [0])
    with pytest.raises(ValueError):
        sample(torch.zeros(10), [row()])


@pytest.mark.parametrize("temperature", [pytest.param(0.0, id="greedy"), pytest.param(1.0, id="sampled")])
def test_row_index_draws_from_the_named_rows_without_copying_the_rest(temperature):
    """The engine skips jump-forwarded rows by index: same tokens as drawing from the gathered rows."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    picked = [4, 1, 3]
    opts = dict(temperature=temperature, seed=11)
    by_index = sample(logits, [row(**opts) for _ in picked], picked)
    gathered = sample(logits[picked], [row(**opts) for _ in picked])
    assert by_index == gathered


def test_torch_paths_agree_with_the_numpy_fast_paths():
    """float64 logits skip the CPU numpy argmax/sort (as CUDA tensors do) and draw the same tokens."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 3000, generator=g) * 2
    x[:, 1::4] = NEG_INF
    specs = [dict(temperature=0.0), dict(top_p=0.9, seed=1), dict(top_p=0.3, top_k=100, seed=2),
             dict(temperature=0.8, seed=3)]
    fast, fallback = [row(**s) for s in specs], [row(**s) for s in specs]
    for _ in range(200):
        assert sample(x, fast) == sample(x.double(), fallback)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="numpy-fast"), pytest.param(torch.float64, id="torch")])
def test_greedy_rows_pick_the_masked_rows_argmax(dtype):
    """Greedy rows without logprobs (an allowed-id list read with one numpy gather; a few rows of many read
    as views): the masked row's argmax, ties to the lowest id, -inf inside a list, rows in any order."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 500, generator=gen).to(dtype)
    rng = np.random.default_rng(1)
    cands = [np.sort(rng.choice(500, size=k, replace=False)).astype(np.int64) for k in (1, 2, 9, 60)]
    logits[5, cands[2][[3, 6]]] = 50.0  # a tie inside the list: the lower id wins
    logits[1, cands[3][:10]] = NEG_INF
    logits[4, [7, 300]] = 60.0  # a tie in a row read whole
    index = [3, 0, 5, 1]
    samplers = [row(temperature=0.0) for _ in index]
    got = sample(logits, samplers, index, cands)
    for token, i, ids in zip(got, index, cands):
        masked = torch.full_like(logits[i], NEG_INF)
        masked[torch.from_numpy(ids)] = logits[i, torch.from_numpy(ids)]
        assert token == int(masked.argmax())
    assert got[2] == int(cands[2][3])
    # Two greedy rows of six, no lists: each row's own argmax.
    assert sample(logits, [row(temperature=0.0) for _ in range(2)], [4, 2]) == [7, int(logits[2].argmax())]


@pytest.mark.parametrize("opts", [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=1.0, seed=3), id="sampled"),
    pytest.param(dict(temperature=0.8, top_k=5, seed=4), id="top-k"),
    pytest.param(dict(temperature=0.8, top_p=0.7, seed=5), id="top-p"),
])
def test_candidates_draw_like_the_masked_row(opts):
    """An allowed-id list instead of a mask: the same distribution (the same tokens, the same logprobs);
    ids outside it never come out."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 500, generator=gen)
    rng = np.random.default_rng(0)
    cands = [np.sort(rng.choice(500, size=k, replace=False)).astype(np.int64) for k in (1, 7, 40, 300)]
    masked = torch.full_like(logits, float("-inf"))
    for i, ids in enumerate(cands):
        masked[i, torch.from_numpy(ids)] = logits[i, torch.from_numpy(ids)]
    samplers_a = [row(top_logprobs=10, **opts) for _ in cands]
    samplers_b = [row(top_logprobs=10, **opts) for _ in cands]
    for _ in range(5):  # several draws from the same generators
        with_candidates, lps_a = sample_with_logprobs(logits, samplers_a, candidates=cands)
        with_mask, lps_b = sample_with_logprobs(masked, samplers_b)
        assert all(t in ids for t, ids in zip(with_candidates, cands))
        assert with_candidates == with_mask
        for lp_a, lp_b, ids in zip(lps_a, lps_b, cands):
            assert lp_a.logprob == pytest.approx(lp_b.logprob, abs=1e-5)
            assert [t for t, _ in lp_a.top] == [t for t, _ in lp_b.top]
            assert [v for _, v in lp_a.top] == pytest.approx([v for _, v in lp_b.top], abs=1e-5)
            assert {t for t, _ in lp_a.top} <= set(ids.tolist())
            if "top_p" not in opts:
                assert len(lp_a.top) == min(10, len(ids), opts.get("top_k") or 10)


# ---------------------------------------------------------------- logprobs


def test_rows_that_do_not_ask_get_no_logprobs():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    _, logprobs = sample_with_logprobs(x, [row(temperature=0.0), row(seed=1), row(top_k=5, seed=2)])
    assert logprobs == [None, None, None]


def test_greedy_logprobs_are_the_log_softmax_at_temperature_one():
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(3)) * 3
    x[:, ::3] = NEG_INF
    rows = [row(temperature=0.0, top_logprobs=5), row(top_k=1, temperature=7.0, logprobs=True)]
    tokens, logprobs = sample_with_logprobs(x, rows)
    want = torch.log_softmax(x, dim=1)
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp.logprob == pytest.approx(float(want[i].max()), abs=1e-6) == float(want[i, token])
    top = torch.topk(want[0], 5)
    assert [t for t, _ in logprobs[0].top] == top.indices.tolist()
    assert [v for _, v in logprobs[0].top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert logprobs[1].top == ()


@pytest.mark.parametrize("opts", [
    pytest.param(dict(temperature=0.6, seed=1), id="temperature"),
    pytest.param(dict(temperature=1.0, top_k=4, seed=2), id="top-k"),
    pytest.param(dict(temperature=2.0, top_p=0.6, seed=3), id="top-p"),
    pytest.param(dict(temperature=0.9, top_k=30, top_p=0.8, seed=4), id="top-k-and-top-p"),
])
def test_sampled_logprobs_are_the_drawn_distribution_renormalised(opts):
    """The draw's own distribution: tempered, cut by top_k/top_p, renormalised over what survives."""
    x = torch.randn(1, 200, generator=torch.Generator().manual_seed(5)) * 2
    r = row(top_logprobs=20, **opts)
    tempered = torch.softmax(x[0].double() / opts["temperature"], 0)
    for _ in range(20):
        (token,), (lp,) = sample_with_logprobs(x, [r])
        support = {t for t, _ in lp.top}
        assert token in support or len(lp.top) == 20
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if "top_k" in opts:
            assert len(lp.top) <= opts["top_k"]
        elif "top_p" not in opts:
            assert lp.logprob == pytest.approx(math.log(tempered[token]), abs=1e-4)  # nothing cut
        if len(lp.top) < 20:
            # The whole support is listed: it holds all the probability.
            assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-5)
            kept = tempered[sorted(support)].sum()
            assert lp.logprob == pytest.approx(math.log(tempered[token] / kept), abs=1e-4)


# ---------------------------------------------------------------- repetition penalty and EOS ban


@pytest.mark.parametrize("penalty", [0.5, 1.3, 4.0])
def test_repetition_penalty_is_hugging_faces_processor(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    x = torch.randn(2, 400, generator=torch.Generator().manual_seed(6)) * 3
    x[1, 10] = NEG_INF
    history = [5, 10, 10, 399, 0, 5, 77]
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), x[1:].clone())[0]
    seen = SeenTokens().update(history)
    apply_repetition_penalty(x, 1, seen, penalty)
    assert torch.equal(x[1], want)


def test_seen_tokens_grow_with_the_history_and_start_over_after_a_rollback():
    seen = SeenTokens()
    history = list(np.random.default_rng(1).integers(0, 1000, size=300))  # a prompt: the vectorised pass
    assert sorted(seen.update(history).tolist()) == sorted(set(history))
    for token in [7, 7, 1001, 3, 1001]:
        history.append(token)
        assert sorted(seen.update(history).tolist()) == sorted(set(history))
    history[-3:] = [5000]
    assert sorted(seen.update(history).tolist()) == sorted(set(history))


EOS = np.array([2, 9], dtype=np.int64)


def test_ban_takes_eos_out_of_candidates_unless_nothing_else_is_left():
    x = torch.zeros(1, 20)
    assert ban_unless_only(x, 0, EOS, np.array([1, 2, 5, 9], dtype=np.int64)).tolist() == [1, 5]
    assert ban_unless_only(x, 0, EOS, np.array([2, 9], dtype=np.int64)).tolist() == [2, 9]
    assert torch.equal(x, torch.zeros(1, 20))


def test_ban_over_many_rows_at_once_is_the_row_by_rows():
    """ban_rows_unless_only (no host wait) writes what ban_unless_only writes row by row: -inf at the banned
    ids, a row left with nothing finite restored, rows not listed untouched."""
    from inference_svc.engine.sampling import ban_rows_unless_only

    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(9))
    x[1] = NEG_INF
    x[1, 2], x[1, 9] = 0.5, -1.0  # allows only EOS
    x[3, 4] = NEG_INF
    bans = {0: EOS, 1: EOS, 3: np.array([0, 4, 7], dtype=np.int64), 4: np.array([19], dtype=np.int64)}
    by_row, at_once = x.clone(), x.clone()
    for i, banned in bans.items():
        ban_unless_only(by_row, i, banned, None)
    ban_rows_unless_only(at_once, list(bans), list(bans.values()))
    assert torch.equal(at_once, by_row) and torch.equal(at_once[2], x[2]) and torch.equal(at_once[1], x[1])


def test_ban_writes_minus_inf_unless_nothing_else_is_left():
    x = torch.randn(2, 20, generator=torch.Generator().manual_seed(8))
    x[1] = NEG_INF
    x[1, 2], x[1, 9] = 0.5, -1.0  # a row that allows only EOS
    before = x.clone()
    assert ban_unless_only(x, 0, EOS, None) is None
    assert x[0, 2] == x[0, 9] == NEG_INF and torch.equal(x[0, :2], before[0, :2])
    ban_unless_only(x, 1, EOS, None)
    assert torch.equal(x[1], before[1])
