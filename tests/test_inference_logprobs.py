"""Generate's logprobs and top_logprobs, through the real server on the embedded model.

The numbers are checked against the model itself (a log_softmax of its own
logits, recomputed with transformers), against the grammar's masks (recomputed
with a local xgrammar matcher) and against the sampling options that cut the
distribution (top_k, top_p).
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
import xgrammar as xgr

from shared.inference_client import InferenceError
from tests.embedded_reference import reference_model

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"]}
# Logits tolerance between the paged runner and transformers' plain forward (test_inference_model_runner
# holds them to 1e-4); log_softmax adds the logsumexp's rounding.
TOL = 1e-3


@pytest.fixture(scope="module")
def reference():
    return reference_model()


@pytest.fixture(scope="module")
def token_bytes(hf_tokenizer):
    from inference_svc.engine.text_stream import token_bytes_for

    return token_bytes_for(hf_tokenizer)


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's next-token logits before each output token: [len(output_ids), V]."""
    ids = prompt_ids + output_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1: len(ids) - 1].double(), dim=-1)


def allowed_sets(xgr_tokenizer_info, ebnf: str, output_ids: list[int]) -> list[set[int]]:
    """The ids the grammar allows before each output token (a local matcher, fed the output as it goes)."""
    compiled = xgr.GrammarCompiler(xgr_tokenizer_info).compile_grammar(ebnf)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, xgr_tokenizer_info.vocab_size)
    sets = []
    for token in output_ids:
        matcher.fill_next_token_bitmask(bitmask)
        row = torch.zeros(xgr_tokenizer_info.vocab_size)
        xgr.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask)  # disallowed -> -inf
        sets.append(set(torch.isfinite(row).nonzero().flatten().tolist()))
        assert matcher.accept_token(token), "the server sampled a token the grammar does not allow"
    return sets


# ---------------------------------------------------------------- shape of the answer


def test_one_logprob_per_token_in_every_chunk(inference_client, token_bytes):
    chunks = list(inference_client.generate("Count:", max_tokens=12, logprobs=True, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 12
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == chunk.token_ids
        for lp in chunk.logprobs:
            assert lp.token_bytes == token_bytes[lp.token_id]
            assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
            assert not lp.forced and lp.top_logprobs == []


def test_no_logprobs_unless_asked(inference_client):
    out = inference_client.complete("Count:", max_tokens=6, ignore_eos=True)
    assert out.logprobs == [] and len(out.token_ids) == 6


def test_top_logprobs_implies_logprobs(inference_client):
    out = inference_client.complete("Count:", max_tokens=4, ignore_eos=True, top_logprobs=2)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top_logprobs) == 2 for lp in out.logprobs)


@pytest.mark.parametrize("top", [1, 7, 20])
def test_greedy_logprobs_are_the_models_log_softmax(inference_client, reference, hf_tokenizer, top):
    prompt = "The quick brown fox"
    out = inference_client.complete(prompt, max_tokens=6, ignore_eos=True, top_logprobs=top)
    want = reference_logprobs(reference, hf_tokenizer.encode(prompt), out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for k, lp in enumerate(out.logprobs):
        row = want[k]
        assert lp.logprob == pytest.approx(float(row.max()), abs=TOL), "greedy: the chosen token is the row's max"
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=TOL)
        assert len(lp.top_logprobs) == top
        assert lp.top_logprobs[0].token_id == lp.token_id
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(top).values.tolist(), abs=TOL)
        for t in lp.top_logprobs:
            assert t.logprob == pytest.approx(float(row[t.token_id]), abs=TOL)


def test_top_logprobs_above_20_is_invalid_argument(inference_client):
    with pytest.raises(InferenceError) as err:
        inference_client.complete("hi", top_logprobs=21)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs must be in [0, 20], got 21" in err.value.message


# ---------------------------------------------------------------- the distribution actually sampled from


@pytest.mark.parametrize("opts", [
    pytest.param(dict(temperature=0.7, seed=1), id="temperature"),
    pytest.param(dict(temperature=1.3, top_p=0.5, seed=2), id="top-p"),
])
def test_sampled_tokens_carry_their_own_probability(inference_client, reference, hf_tokenizer, opts):
    """Temperature reshapes the distribution: the logprobs are those of the tempered one, renormalised."""
    prompt = "Once upon"
    out = inference_client.complete(prompt, max_tokens=8, ignore_eos=True, top_logprobs=5, **opts)
    want = reference_logprobs(reference, hf_tokenizer.encode(prompt), out.token_ids)
    for k, lp in enumerate(out.logprobs):
        tempered = torch.log_softmax(want[k] / opts["temperature"], dim=-1)
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True) and 1 <= len(values) <= 5
        assert lp.logprob <= values[0] + 1e-6
        if "top_p" not in opts:
            assert lp.logprob == pytest.approx(float(tempered[lp.token_id]), abs=TOL)
        else:
            # Renormalised over the nucleus: at least the tempered probability, and the nucleus is all there is.
            assert lp.logprob >= float(tempered[lp.token_id]) - TOL
            assert sum(math.exp(v) for v in values) <= 1 + 1e-4


def test_top_k_cuts_the_alternatives_and_renormalises(inference_client):
    out = inference_client.complete("Once upon", max_tokens=6, ignore_eos=True, temperature=1.0, seed=5, top_k=3,
                                    top_logprobs=10)
    for lp in out.logprobs:
        assert len(lp.top_logprobs) == 3  # tokens outside top_k have probability 0: never alternatives
        assert lp.token_id in {t.token_id for t in lp.top_logprobs}
        assert sum(math.exp(t.logprob) for t in lp.top_logprobs) == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------- under a constraint


@pytest.mark.parametrize("kwargs, ebnf", [
    pytest.param(dict(choice=["yes", "no", "maybe"]), 'root ::= "yes" | "no" | "maybe"', id="choice"),
    pytest.param(dict(regex="[ab]{3}"), 'root ::= [ab] [ab] [ab]', id="regex-small"),
    pytest.param(dict(regex="[a-z]{2,6}", temperature=0.9, seed=4), 'root ::= [a-z] [a-z] [a-z]? [a-z]? [a-z]? [a-z]?',
                 id="regex-sampled"),
    # Almost every token is allowed: the mask arrives as a disallowed list or dense, applied as -inf.
    pytest.param(dict(regex=r"[^\n]{1,12}", max_tokens=6), 'root ::= [^\\n]+', id="regex-wide"),
])
def test_alternatives_are_only_allowed_tokens(inference_client, xgr_tokenizer_info, kwargs, ebnf):
    kwargs = {"max_tokens": 12, **kwargs}
    out = inference_client.complete("Pick:", top_logprobs=20, disable_jump_forward=True, **kwargs)
    # EOS is sampled at the end; the local matcher checks the answer's own tokens.
    answer = [lp for lp in out.logprobs if lp.token_id not in xgr_tokenizer_info.stop_token_ids]
    allowed = allowed_sets(xgr_tokenizer_info, ebnf, [lp.token_id for lp in answer])
    for lp, ok in zip(answer, allowed):
        tops = {t.token_id for t in lp.top_logprobs}
        assert tops <= ok, f"alternatives the mask forbids: {sorted(tops - ok)[:5]}"
        assert len(lp.top_logprobs) == min(20, len(ok))
        mass = sum(math.exp(t.logprob) for t in lp.top_logprobs)
        if len(ok) <= 20:
            # Every allowed token is listed: the distribution over the allowed set sums to 1.
            assert mass == pytest.approx(1.0, abs=1e-4)
        else:
            assert mass <= 1 + 1e-4


def test_a_token_the_grammar_forces_by_mask_has_logprob_zero(inference_client):
    """After a choice completes only EOS is allowed: sampled from a one-token distribution, logprob 0."""
    out = inference_client.complete("Well?", choice=["yes", "no"], top_logprobs=3, disable_jump_forward=True)
    assert out.finish_reason == "stop"
    last = out.logprobs[-1]
    assert last.logprob == pytest.approx(0.0, abs=1e-6) and not last.forced
    assert [t.token_id for t in last.top_logprobs] == [last.token_id]


def test_forced_tokens_are_marked_forced(inference_client):
    out = inference_client.complete("P:", json_schema=POINT, max_tokens=64, top_logprobs=3)
    assert out.finish_reason == "stop" and out.usage.forced_tokens > 0
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    forced = [lp for lp in out.logprobs if lp.forced]
    assert len(forced) == out.usage.forced_tokens
    assert all(lp.logprob == 0.0 and lp.top_logprobs == [] for lp in forced)
    assert all(lp.top_logprobs for lp in out.logprobs if not lp.forced)
