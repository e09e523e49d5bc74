"""The OpenAI / vLLM sampling parameters (issue 27 item 1) through the real inference service and, over the
official OpenAI SDK, the gateway: logit_bias under a constraint and alone, stop_token_ids, include_stop_str_in_output,
presence and frequency penalties, min_p, negative seeds, and out-of-range values refused naming the field.

The embedded model repeats one token under greedy decoding ("Once upon a time" gives the same id over and
over): a positive penalty must break that, a negative one keep it. tests/test_sampling_params.py pins the
arithmetic against its references.
"""

from __future__ import annotations

import argparse
import json
import re

import grpc
import openai
import pytest

from shared.inference_client import InferenceError
from structd import generate as generate_cli

PROMPT = "Once upon a time"
CODE = "[a-z]{3}-[0-9]{3}"
# Bounds a broken test only.
TIMEOUT = 60.0


def greedy(client, **kw):
    return client.complete(PROMPT, max_tokens=12, ignore_eos=True, timeout=TIMEOUT, **kw)


def token_id(hf_tokenizer, text: str) -> int:
    (t,) = hf_tokenizer.encode(text, add_special_tokens=False)
    return t


# ---------------------------------------------------------------- logit_bias


def test_a_plus_100_bias_under_a_regex_still_matches(inference_client, hf_tokenizer):
    """+100 on an allowed digit makes it every digit; +100 on tokens the regex never allows changes nothing
    about the match (they stay masked)."""
    seven, space, capital = (token_id(hf_tokenizer, s) for s in ("7", " ", "X"))
    for seed, temperature in ((None, 0.0), (3, 1.0), (4, 1.0)):
        c = inference_client.complete("Code:", regex=CODE, max_tokens=16, timeout=TIMEOUT, seed=seed,
                                      temperature=temperature, logit_bias={seven: 100.0, space: 100.0, capital: 100.0})
        assert re.fullmatch(CODE, c.text), c.text
        assert c.text.endswith("-777"), c.text


def test_a_minus_100_bias_removes_the_greedy_token(inference_client):
    base = greedy(inference_client)
    first = base.token_ids[0]
    biased = greedy(inference_client, logit_bias={first: -100.0})
    assert first not in biased.token_ids and biased.token_ids != base.token_ids


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_move_a_greedy_output_in_their_direction(inference_client, field):
    base = greedy(inference_client)
    assert len(set(base.token_ids)) < len(base.token_ids) / 2, "the embedded model repeats itself here"
    discouraged = greedy(inference_client, **{field: 2.0})
    encouraged = greedy(inference_client, **{field: -2.0})
    assert len(set(discouraged.token_ids)) == len(discouraged.token_ids), discouraged.token_ids
    assert len(set(encouraged.token_ids)) <= len(set(base.token_ids))
    assert discouraged.token_ids[0] == base.token_ids[0], "no output yet: nothing to penalise"


def test_min_p_one_samples_the_greedy_tokens(inference_client):
    """min_p = 1 keeps only the likeliest token: a seeded draw at temperature 1 is the greedy output."""
    base = greedy(inference_client, presence_penalty=2.0)
    for seed in (1, 2):
        drawn = greedy(inference_client, presence_penalty=2.0, temperature=1.0, seed=seed, min_p=1.0)
        assert drawn.token_ids == base.token_ids


# ---------------------------------------------------------------- stop_token_ids, include_stop_str_in_output


@pytest.mark.parametrize("include", [pytest.param(False, id="cut"), pytest.param(True, id="kept")])
def test_a_stop_token_id_ends_the_output_as_eos(inference_client, hf_tokenizer, include):
    base = greedy(inference_client, presence_penalty=2.0)  # distinct tokens
    stop = base.token_ids[1]
    c = greedy(inference_client, presence_penalty=2.0, stop_token_ids=[stop], include_stop_str_in_output=include)
    assert c.finish_reason == "stop"
    assert c.token_ids == base.token_ids[:2]
    assert c.text == hf_tokenizer.decode(base.token_ids[:2 if include else 1])


def test_a_stop_token_id_waits_for_min_tokens(inference_client):
    base = greedy(inference_client, presence_penalty=2.0)
    c = greedy(inference_client, presence_penalty=2.0, stop_token_ids=[base.token_ids[1]], min_tokens=4)
    assert c.finish_reason == "length" and base.token_ids[1] not in c.token_ids[:4]


@pytest.mark.parametrize("include", [pytest.param(False, id="cut"), pytest.param(True, id="kept")])
def test_include_stop_str_in_output_keeps_the_stop_string(inference_client, hf_tokenizer, include):
    base = greedy(inference_client, presence_penalty=2.0)
    stop = hf_tokenizer.decode(base.token_ids[1:3])
    c = greedy(inference_client, presence_penalty=2.0, stop=[stop], include_stop_str_in_output=include)
    assert c.finish_reason == "stop_string"
    assert c.text == hf_tokenizer.decode(base.token_ids[:1]) + (stop if include else "")


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, named", [
    pytest.param(dict(logit_bias={10**6: 1.0}), "logit_bias: 1000000 is not a token id of this model", id="bias-id"),
    pytest.param(dict(logit_bias={5: 150.0}), r"logit_bias\[5\]", id="bias-range"),
    pytest.param(dict(stop_token_ids=[3, 2**31 - 1]), "stop_token_ids: 2147483647 is not a token id", id="stop-id"),
    pytest.param(dict(presence_penalty=3.0), "presence_penalty", id="presence"),
    pytest.param(dict(frequency_penalty=-3.0), "frequency_penalty", id="frequency"),
    pytest.param(dict(min_p=2.0), "min_p", id="min_p"),
])
def test_bad_values_are_invalid_naming_the_field(inference_client, kw, named):
    with pytest.raises(InferenceError) as e:
        greedy(inference_client, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and re.search(named, e.value.message), e.value.message


def test_a_negative_seed_is_its_twos_complement(inference_client):
    drawn = greedy(inference_client, temperature=1.0, seed=-1)
    assert drawn.token_ids == greedy(inference_client, temperature=1.0, seed=2**64 - 1).token_ids


# ---------------------------------------------------------------- through the gateway, with the official SDK


def chat(openai_client, served_model, **kw):
    return openai_client.completions.create(model=served_model, prompt=PROMPT, max_tokens=12,
                                            **{"temperature": 0, **kw})


def test_gateway_takes_penalties_and_logit_bias(openai_client, served_model, inference_client):
    base = greedy(inference_client, presence_penalty=2.0)
    got = chat(openai_client, served_model, presence_penalty=2.0, frequency_penalty=0.5,
               extra_body={"ignore_eos": True})
    want = greedy(inference_client, presence_penalty=2.0, frequency_penalty=0.5)
    assert got.choices[0].text == want.text
    biased = chat(openai_client, served_model, presence_penalty=2.0, logit_bias={str(base.token_ids[0]): -100},
                  extra_body={"ignore_eos": True})
    assert not biased.choices[0].text.startswith(base.text[:2])


def test_gateway_stop_token_ids_and_include_stop_str(openai_client, served_model, inference_client, hf_tokenizer):
    base = greedy(inference_client, presence_penalty=2.0)
    got = chat(openai_client, served_model, presence_penalty=2.0,
               extra_body={"ignore_eos": True, "stop_token_ids": [base.token_ids[1]], "include_stop_str_in_output": True,
                           "min_p": 0.5})
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == hf_tokenizer.decode(base.token_ids[:2])


def test_gateway_regex_with_a_plus_100_bias_still_matches(openai_client, served_model, hf_tokenizer):
    seven, capital = token_id(hf_tokenizer, "7"), token_id(hf_tokenizer, "X")
    got = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Code?"}], max_tokens=16, temperature=0,
        logit_bias={str(seven): 100, str(capital): 100}, extra_body={"structured_outputs": {"regex": CODE}})
    assert re.fullmatch(CODE, got.choices[0].message.content) and got.choices[0].message.content.endswith("777")


@pytest.mark.parametrize("kw, param", [
    pytest.param(dict(logit_bias={"1000000": 5}), None, id="bias-id-past-vocab"),
    pytest.param(dict(presence_penalty=2.5), "presence_penalty", id="presence-range"),
    pytest.param(dict(extra_body={"stop_token_ids": [10**9]}), None, id="stop-id-past-vocab"),
    pytest.param(dict(extra_body={"min_p": -1}), "min_p", id="min_p-range"),
])
def test_gateway_refuses_bad_values_with_a_400(openai_client, served_model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, served_model, **kw)
    error = e.value.response.json()["error"]
    assert error["param"] == param
    if param is None:
        assert "is not a token id of this model" in error["message"]


def test_gateway_takes_a_negative_seed(openai_client, served_model, inference_client):
    got = chat(openai_client, served_model, temperature=1.0, seed=-5, extra_body={"ignore_eos": True})
    assert got.choices[0].text == greedy(inference_client, temperature=1.0, seed=2**64 - 5).text


# ---------------------------------------------------------------- structd generate


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="structd generate")
    generate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_flags_reach_the_sampler(inference_server, inference_client, hf_tokenizer, capsys):
    base = greedy(inference_client, presence_penalty=2.0)
    code = generate_cli.run(cli_args(
        "--target", inference_server.target, "--max-tokens", "12", "--ignore-eos", "--presence-penalty", "2",
        "--frequency-penalty", "0.5", "--logit-bias", f"{base.token_ids[5]}=-100", "--min-p", "0.1",
        "--stop-token-id", str(base.token_ids[1]), "--include-stop-str", "--seed", "-3", "--json",
        "--timeout-seconds", str(TIMEOUT), PROMPT))
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    line = json.loads(out)
    assert line["finish_reason"] == "stop" and line["text"] == hf_tokenizer.decode(base.token_ids[:2])


@pytest.mark.parametrize("flag, value", [
    pytest.param("--logit-bias", "7", id="bias-without-value"),
    pytest.param("--logit-bias", "x=1", id="bias-id-not-int"),
    pytest.param("--stop-token-id", "-1", id="stop-id-negative"),
    pytest.param("--seed", str(-(2**63) - 1), id="seed-below-int64"),
])
def test_generate_refuses_malformed_flags(flag, value):
    with pytest.raises(SystemExit):
        cli_args(flag, value, "hi")
