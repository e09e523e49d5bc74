"""The OpenAI / vLLM sampling parameters at the sampler level: presence and frequency penalties, logit_bias,
min_p, stop_token_ids and include_stop_str_in_output (issue 27 item 1).

Each is pinned against a reference: OpenAI's penalty formula computed with
numpy (as vLLM computes it), transformers' MinPLogitsWarper (after its
TopPLogitsWarper, transformers' order), a plain addition for the bias. The
bias composes with every form a grammar mask arrives in: a disallowed token
is never drawn whatever its bias. tests/test_sampling_params_server.py runs
them through the real services.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inference_svc.engine.sampling import (OutputCounts, RowSampler, SamplingOptions, add_at,
                                           apply_occurrence_penalties, apply_repetition_penalty, SeenTokens,
                                           sample_with_logprobs)
from inference_svc.engine.step_sampler import RowPlan, StepSampler
from inference_svc.engine.text_stream import TextStream
from shared.codec import SparseMask, words_for_vocab
from shared.errors import InvalidRequestError

VOCAB = 1000
EOS = 999
NEG_INF = float("-inf")
DISALLOWED = np.array([3, 10, 11, 500], dtype=np.int64)


def options(**kw) -> SamplingOptions:
    base = dict(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=7, stop=(), ignore_eos=False,
                default_max_tokens=16, max_max_tokens=64)
    base.update(kw)
    return SamplingOptions.validated(**base)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kw, field", [
    pytest.param(dict(presence_penalty=2.5), "presence_penalty", id="presence-above"),
    pytest.param(dict(presence_penalty=float("nan")), "presence_penalty", id="presence-nan"),
    pytest.param(dict(frequency_penalty=-2.01), "frequency_penalty", id="frequency-below"),
    pytest.param(dict(logit_bias={5: 100.5}), "logit_bias[5]", id="bias-above"),
    pytest.param(dict(logit_bias={5: float("nan")}), "logit_bias[5]", id="bias-nan"),
    pytest.param(dict(logit_bias={-1: 1.0}), "logit_bias: -1", id="bias-negative-id"),
    pytest.param(dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300", id="bias-too-many"),
    pytest.param(dict(min_p=1.5), "min_p", id="min_p-above"),
    pytest.param(dict(min_p=-0.1), "min_p", id="min_p-below"),
    pytest.param(dict(stop_token_ids=list(range(65))), "stop_token_ids allows at most 64", id="stop-ids-too-many"),
    pytest.param(dict(stop_token_ids=[4, -2]), "stop_token_ids[1]", id="stop-id-negative"),
])
def test_out_of_range_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        options(**kw)


def test_ids_past_the_vocabulary_are_refused_naming_the_field_and_the_id():
    options(logit_bias={999: 1.0}, stop_token_ids=[0, 999]).check_token_ids(VOCAB)
    with pytest.raises(InvalidRequestError, match=r"logit_bias: 1000 is not a token id of this model \(0 to 999\)"):
        options(logit_bias={1000: 1.0, 5: 1.0}).check_token_ids(VOCAB)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids: 1200 is not .*, and 1 more"):
        options(stop_token_ids=[1300, 1200, 3]).check_token_ids(VOCAB)


def test_unused_parameters_leave_the_row_unadjusted():
    """The step's one check per row: a request with none of them (zero biases included) adjusts nothing."""
    s = RowSampler(options(presence_penalty=0.0, frequency_penalty=0.0, logit_bias={5: 0.0}, min_p=0.0))
    assert not s.adjusts and s.bias is None and s.counts is None and s.seen is None
    for kw in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(logit_bias={5: 1.0}),
               dict(repetition_penalty=1.2)):
        assert RowSampler(options(**kw)).adjusts, kw


# ---------------------------------------------------------------- presence and frequency penalties


@pytest.mark.parametrize("presence, frequency", [
    pytest.param(0.5, 0.0, id="presence"),
    pytest.param(0.0, 0.7, id="frequency"),
    pytest.param(-1.5, 2.0, id="both-negative-presence"),
])
def test_occurrence_penalties_are_openais_formula_over_the_output_only(presence, frequency):
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((2, VOCAB)).astype(np.float32) * 3)
    x[1, 42] = NEG_INF
    prompt = [1, 2, 3, 42, 7]
    output = [7, 7, 9, 42, 7, 100, 9]
    ref = x[1].numpy().astype(np.float64).copy()
    counts = np.bincount(output, minlength=VOCAB)  # OpenAI's reference: over the generated tokens only
    ref -= counts * frequency + (counts > 0) * presence
    apply_occurrence_penalties(x, 1, *OutputCounts().update(prompt + output, len(prompt)), presence, frequency)
    np.testing.assert_allclose(x[1].numpy(), ref.astype(np.float32), rtol=1e-6, atol=1e-5)
    assert math.isinf(x[1, 42]) and x[1, 42] < 0, "-inf stays -inf"
    assert x[1, 1] == ref[1], "a prompt token is not penalised"


def test_output_counts_grow_with_the_output_and_start_over_after_a_rollback():
    counts = OutputCounts()
    history = [5, 5, 6]  # the prompt
    assert [a.tolist() for a in counts.update(history, 3)] == [[], []]
    rng = np.random.default_rng(0)
    for token in rng.integers(0, 70, size=200).tolist():  # past the first buffer of 64 distinct ids
        history.append(token)
        ids, got = counts.update(history, 3)
        want = np.bincount(history[3:], minlength=70)
        assert dict(zip(ids.tolist(), got.tolist())) == {t: float(c) for t, c in enumerate(want) if c}
    del history[-5:]
    ids, got = counts.update(history, 3)
    want = np.bincount(history[3:], minlength=70)
    assert dict(zip(ids.tolist(), got.tolist())) == {t: float(c) for t, c in enumerate(want) if c}


# ---------------------------------------------------------------- min_p


@pytest.mark.parametrize("min_p, top_p, temperature", [
    pytest.param(0.05, 1.0, 1.0, id="min_p"),
    pytest.param(0.3, 1.0, 0.7, id="min_p-tempered"),
    pytest.param(0.02, 0.9, 1.3, id="min_p-after-top_p"),
    pytest.param(1.0, 1.0, 1.0, id="min_p-one-keeps-the-top"),
])
def test_min_p_is_transformers_warper(min_p, top_p, temperature):
    """The distribution drawn from (its logprobs over the whole support) is transformers' temperature, top_p
    and min_p warpers' softmax."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.from_numpy(np.random.default_rng(5).standard_normal((1, 20)).astype(np.float32) * 2)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.log_softmax(MinPLogitsWarper(min_p)(None, scores), -1)[0]
    s = RowSampler(options(temperature=temperature, top_p=top_p, min_p=min_p, top_logprobs=20))
    for _ in range(20):
        (token,), (lp,) = sample_with_logprobs(logits, [s])
        assert math.isfinite(want[token])
        got = dict(lp.top)
        assert set(got) == {t for t in range(20) if math.isfinite(want[t])}
        for t, v in got.items():
            assert v == pytest.approx(float(want[t]), abs=1e-5)


def test_min_p_never_changes_greedy():
    logits = torch.from_numpy(np.random.default_rng(2).standard_normal((1, VOCAB)).astype(np.float32))
    (token,), _ = sample_with_logprobs(logits, [RowSampler(options(min_p=0.9))])
    assert token == int(logits.argmax())


# ---------------------------------------------------------------- logit_bias, alone and under grammar masks


def step_sampler() -> StepSampler:
    """Its bitmask rows hold, densely, the mask that allows everything but DISALLOWED."""
    bits = np.ones(words_for_vocab(VOCAB) * 32, dtype=np.uint8)
    bits[DISALLOWED] = 0
    bitmask = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy()).repeat(8, 1)
    return StepSampler(VOCAB, [EOS], bitmask, bitmask)


def plan_for(samplers: list[RowSampler], masked) -> RowPlan:
    """The plan the engine makes (_plan_adjustments): each row's bias as its sampler holds it."""
    plan = RowPlan(sample=list(range(len(samplers))), masked=list(masked))
    plan.bias = [(i, *s.bias) for i, s in enumerate(samplers) if s.bias is not None]
    return plan


def test_logit_bias_adds_to_the_logits():
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((2, VOCAB)).astype(np.float32))
    x[1, 9] = NEG_INF
    want = x[1].clone()
    bias = {5: 3.5, 9: 100.0, 700: -100.0}
    for t, v in bias.items():
        want[t] += v
    add_at(x, 1, *RowSampler(options(logit_bias=bias)).bias)
    assert torch.equal(x[1], want) and math.isinf(x[1, 9])


MASKS = [
    pytest.param(lambda: SparseMask(True, np.array([1, 2, 400, 998], dtype=np.int64)), id="allowed-list"),
    pytest.param(lambda: SparseMask(False, DISALLOWED), id="disallowed-list"),
    pytest.param(lambda: None, id="dense"),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("opts", [
    pytest.param(dict(), id="greedy"),
    pytest.param(dict(logprobs=True), id="greedy-logprobs"),
    pytest.param(dict(temperature=1.0), id="sampled"),
    pytest.param(dict(temperature=1.0, top_k=3, min_p=0.01), id="sampled-top_k-min_p"),
])
def test_a_bias_never_makes_a_disallowed_token_drawable(mask, opts):
    """+100 on a disallowed id (and the unmasked winner) leaves it undrawable; +100 on an allowed id wins."""
    rng = np.random.default_rng(11)
    for seed in range(30):
        logits = torch.from_numpy(rng.standard_normal((2, VOCAB)).astype(np.float32))
        logits[:, 500] = 9.0  # the winner, disallowed
        samplers = [RowSampler(options(logit_bias={3: 100.0, 500: 100.0}, seed=seed, **opts)),
                    RowSampler(options(logit_bias={3: 100.0, 400: 100.0}, seed=seed, **opts))]
        got = step_sampler().sample(logits, plan_for(samplers, [(0, mask()), (1, mask())]), samplers)
        assert got[0][0] not in (3, 500, 10, 11), got[0]
        form = mask()
        if form is not None and form.allow:
            assert got[0][0] in form.ids.tolist()
        assert got[1][0] == 400


def test_a_minus_100_bias_removes_the_greedy_winner():
    logits = torch.from_numpy(np.random.default_rng(8).standard_normal((1, VOCAB)).astype(np.float32))
    winner = int(logits.argmax())
    s = RowSampler(options(logit_bias={winner: -100.0}))
    ((token, _),) = step_sampler().sample(logits.clone(), plan_for([s], []), [s])
    ranked = logits[0].argsort(descending=True).tolist()
    assert token == ranked[1] != winner


def test_bias_comes_before_the_repetition_penalty_and_the_occurrence_penalties():
    """vLLM's order: bias, repetition penalty (divides positive logits), then presence / frequency."""
    x = torch.zeros(1, 10)
    x[0, 4] = 1.0
    s = RowSampler(options(logit_bias={4: 3.0}, repetition_penalty=2.0, presence_penalty=0.5,
                           frequency_penalty=0.25))
    plan = plan_for([s], [])
    history = [4, 4, 4]  # prompt [4], output [4, 4]
    plan.penalties.append((0, s.seen.update(history), 2.0))
    plan.occurrences.append((0, *s.counts.update(history, 1), 0.5, 0.25))
    step_sampler_small = StepSampler(10, [9], torch.zeros(1, 1, dtype=torch.int32),
                                     torch.zeros(1, 1, dtype=torch.int32))
    step_sampler_small._adjust(x, plan, {})
    assert x[0, 4].item() == pytest.approx((1.0 + 3.0) / 2.0 - 0.5 - 0.25 * 2)
    y = torch.tensor([[4.0]])
    apply_repetition_penalty(y, 0, SeenTokens().update([0]), 2.0)
    assert y.item() == 2.0


def test_min_tokens_bans_stop_token_ids_with_eos():
    """Before min_tokens the engine hands the row its EOS and stop ids to ban (plan.min_tokens_bans)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 9.0
    logits[0, EOS] = 8.0
    logits[0, 5] = 1.0
    s = RowSampler(options(min_tokens=3, stop_token_ids=[7]))
    plan = RowPlan(sample=[0], before_min_tokens=[0], min_tokens_bans={0: np.array([7, EOS], dtype=np.int64)})
    ((token, _),) = step_sampler().sample(logits, plan, [s])
    assert token == 5


# ---------------------------------------------------------------- include_stop_str_in_output


TOKENS = [b"Hel", b"lo", b" wor", b"ld", b"!", b"\n"]


@pytest.mark.parametrize("include, want", [
    pytest.param(False, "Hell", id="cut"),
    pytest.param(True, "Hello w", id="kept"),
])
def test_include_stop_keeps_the_matched_stop_string(include, want):
    stream = TextStream(TOKENS, (), ["o w", "ld"], include_stop=include)
    text = "".join(stream.push([t]).text for t in range(3))
    assert stream.stopped and text == want
