"""The engine with the LM head at the allowed ids only gives the same outputs as with the full head.

Two real inference servers on the embedded model behind the session's
grammar server, one with --sparse-head on (the session's, the default) and
one with it off; the same seeded constrained requests, one at a time (so
every step has the same rows on both), must give the same tokens and the
same logprobs, and the sparse one must have taken the sparse path.
"""

from __future__ import annotations

import pytest

from shared.inference_client import InferenceClient
from tests.conftest import InferenceServerThread

POINT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "kind": {"enum": ["cat", "dog", "bird"]},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 30}},
         "required": ["name", "kind", "age"]}


@pytest.fixture(scope="module")
def full_head_client(grammar_server, inference_server):
    from dataclasses import replace

    base = inference_server.server.config
    cfg = replace(base, engine=replace(base.engine, sparse_head=False))
    srv = InferenceServerThread(cfg)
    client = InferenceClient(srv.target)
    yield client
    client.close()
    srv.stop()


ATTEMPTS = 5


def sparse_steps(server) -> float:
    return server.server.metrics.lm_head_steps.labels("sparse")._value.get()


CASES = [
    pytest.param(dict(json_schema=POINT, temperature=1.0, seed=3, top_logprobs=5), id="json-sampled-logprobs"),
    pytest.param(dict(json_schema=POINT, temperature=0.7, top_p=0.9, seed=11, disable_jump_forward=True),
                 id="json-top_p-no-jump-forward"),
    pytest.param(dict(regex=r"(yes|no|maybe)( because [a-z]{1,6})?", temperature=1.2, seed=5, logprobs=True),
                 id="regex"),
    pytest.param(dict(choice=["alpha", "beta", "gamma delta"], seed=2, temperature=1.0, top_logprobs=3),
                 id="choice"),
    pytest.param(dict(json_schema=POINT, repetition_penalty=1.3, min_tokens=3, top_logprobs=2), id="json-greedy"),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_sparse_and_full_head_give_the_same_output(inference_server, inference_client, full_head_client, kwargs):
    # A step takes the sparse head only where the grammar has answered by the end of the body's forward (else
    # "full_late"): on a loaded machine a short request's few constrained steps can all be late, so it is sent
    # again (the same seeded output every time) until one of its steps took it.
    for _ in range(ATTEMPTS):
        before = sparse_steps(inference_server)
        want = full_head_client.complete("Describe a pet as JSON:", max_tokens=24, timeout=120, **kwargs)
        got = inference_client.complete("Describe a pet as JSON:", max_tokens=24, timeout=120, **kwargs)
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs
        assert got.finish_reason == want.finish_reason
        if sparse_steps(inference_server) > before:
            return
    pytest.fail(f"no step of the request took the sparse head in {ATTEMPTS} tries (every mask came late)")


def head_steps(server, path: str) -> float:
    return server.server.metrics.lm_head_steps.labels(path)._value.get()


def test_a_step_whose_few_rows_need_every_logit_takes_the_partial_head(inference_server, inference_client):
    # Three constrained requests whose masks are short allowed lists (digits) beside one unconstrained
    # request, all at once: their steps have one row of four that needs the whole vocabulary. The rows'
    # draws equal the full head's (tests/test_sparse_head.py); here the server must take that path and
    # every output must still match its constraint.
    import re
    from concurrent.futures import ThreadPoolExecutor

    digits = r"[0-9]{40}"
    inference_client.complete("warm the grammar up:", max_tokens=2, regex=digits, timeout=120)
    before = head_steps(inference_server, "partial")

    def constrained(seed: int):
        return inference_client.complete("Digits:", max_tokens=40, regex=digits, temperature=1.0, seed=seed,
                                         timeout=120)

    def unconstrained():
        # Sampled at temperature 1: a greedy row would be screened instead (next test).
        return inference_client.complete("Go on:", max_tokens=60, ignore_eos=True, temperature=1.0, seed=4,
                                         timeout=120)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(constrained, s) for s in (1, 2, 3)] + [pool.submit(unconstrained)]
        outputs = [f.result() for f in futures]
    for out in outputs[:3]:
        assert re.fullmatch(digits, out.text), out.text
    assert len(outputs[3].token_ids) == 60
    assert head_steps(inference_server, "partial") > before, "no step took the partial head"


# A free string: inside it the mask is a list of disallowed ids. In LONG's bounded one some masks come
# dense (their disallowed ids are read from the bitmask row) and some as disallowed lists: ~7 screenable
# steps a request, so a step or two whose grammar answer is late (full head) cannot hide the path.
LONG = {"type": "object", "properties": {"code": {"type": "string", "minLength": 100, "maxLength": 120}},
        "required": ["code"]}
NOTE = {"type": "object", "properties": {"note": {"type": "string"}, "kind": {"enum": ["cat", "dog"]}},
        "required": ["note", "kind"]}
GREEDY = [
    pytest.param(dict(), id="unconstrained"),
    pytest.param(dict(ignore_eos=True), id="unconstrained-eos-banned"),
    pytest.param(dict(json_schema=NOTE), id="json-string-disallowed-list"),
    pytest.param(dict(json_schema=NOTE, disable_jump_forward=True), id="json-no-jump-forward"),
    pytest.param(dict(json_schema=LONG), id="json-long-bounded-string"),
]


@pytest.mark.parametrize("kwargs", GREEDY)
def test_greedy_rows_screened_give_the_full_heads_tokens(inference_server, inference_client, full_head_client,
                                                          kwargs):
    # Greedy rows without logprobs take the bfloat16 screen (greedy_head.py) on the session's server and
    # the float32 head on the other: the same tokens, one request at a time (the same steps on both).
    before = head_steps(inference_server, "screened") + head_steps(inference_server, "partial")
    want = full_head_client.complete("Describe a pet as JSON:", max_tokens=40, timeout=120, **kwargs)
    got = inference_client.complete("Describe a pet as JSON:", max_tokens=40, timeout=120, **kwargs)
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    after = head_steps(inference_server, "screened") + head_steps(inference_server, "partial")
    assert after > before, "no step screened its greedy row"
