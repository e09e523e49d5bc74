"""inference_svc/engine/sampling.py's rules pinned on small exact cases: the selection mutation testing runs.

The statistical tests (tests/test_inference_sampling.py, tests/test_batched_sampling.py) take a minute,
too long to run once per mutant; these take about a second. Each draw is checked against a reference
written from the definitions in the module's docstrings: a seeded row takes exactly one uniform u from
its own generator (the test takes the same u from a generator seeded alike) and draws the first token,
in the row's order (by id; likeliest first under top_k), whose cumulative weight exceeds u times the
total, after temperature, top_k, top_p (the longest ascending prefix holding at most 1 - top_p of the
mass is left out, ties with the smallest kept token stay) and min_p (tokens under min_p times the
likeliest token's weight are left out). Logprobs are those of that renormalised distribution. Every path
is reached: greedy rows (numpy and torch), the batch's three groups (temperature only, cut among the
likeliest tokens, allowed-id lists) and the row path the batch falls back to (a non-finite row, a
temperature that overflows float32, a nucleus wider than the candidates). The rewrites before the draw (the
bias, the penalties, the min_tokens bans, row by row and for a step's rows at once) are pinned on exact values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inference_svc.engine import sampling
from inference_svc.engine.sampling import (
    OutputCounts,
    RowLogprobs,
    RowSampler,
    SamplingOptions,
    SeenTokens,
    sample,
    sample_with_logprobs,
)
from shared.errors import InvalidRequestError

NEG_INF = float("-inf")
SEEDS = range(40)


def options(**overrides) -> SamplingOptions:
    fields = dict(max_tokens=0, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(), ignore_eos=False,
                  default_max_tokens=64, max_max_tokens=4096)
    fields.update(overrides)
    return SamplingOptions.validated(**fields)


def uniform(seed: int) -> float:
    """The one uniform a row seeded `seed` draws."""
    return float(torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> tuple[np.ndarray, np.ndarray]:
    """(token ids in the order the row draws in, their probabilities) by the definitions (float64)."""
    x = np.asarray(logits, dtype=np.float32).astype(np.float64)
    ids = np.arange(x.size)
    if 0 < top_k < x.size:
        ids = np.argsort(-x, kind="stable")[:top_k]
    x = x[ids]
    w = np.exp((x - x.max()) / temperature)
    if top_p < 1.0:
        asc = np.sort(w)
        cum = np.cumsum(asc)
        w = np.where(w >= asc[np.searchsorted(cum, (1.0 - top_p) * cum[-1], side="right")], w, 0.0)
    if min_p > 0.0:
        w = np.where(w >= min_p * w.max(), w, 0.0)
    return ids, w / w.sum()


def drawn(ids: np.ndarray, p: np.ndarray, u: float) -> int:
    cdf = np.cumsum(p)
    return int(ids[min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.searchsorted(cdf, cdf[-1]))])


def expected(logits, seed: int, **spec) -> int:
    return drawn(*reference(logits, **spec), uniform(seed))


def draw_specs(logits: torch.Tensor, spec: dict, seeds=SEEDS, candidates=None):
    """The batch's tokens and logprobs for one row of `logits` per seed (every row the same)."""
    rows = [RowSampler(options(seed=s, **spec)) for s in seeds]
    x = logits.expand(len(rows), -1).contiguous()
    return sample_with_logprobs(x, rows, candidates=None if candidates is None else [candidates] * len(rows))


def gentle(width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("overrides, message", [
    pytest.param(dict(max_tokens=-1), "max_tokens must be in [0, 4096] (0 = server default 64), got -1", id="max-neg"),
    pytest.param(dict(max_tokens=4097), "max_tokens must be in [0, 4096] (0 = server default 64), got 4097",
                 id="max-over"),
    pytest.param(dict(temperature=-0.5), "temperature must be a finite number >= 0 (0 = greedy), got -0.5",
                 id="temp-neg"),
    pytest.param(dict(temperature=math.inf), "temperature must be a finite number >= 0 (0 = greedy), got inf",
                 id="temp-inf"),
    pytest.param(dict(top_p=1.5), "top_p must be in [0, 1] (0 or 1 = disabled), got 1.5", id="top-p-over"),
    pytest.param(dict(top_p=-0.1), "top_p must be in [0, 1] (0 or 1 = disabled), got -0.1", id="top-p-neg"),
    pytest.param(dict(top_k=-1), "top_k must be >= 0 (0 = disabled), got -1", id="top-k"),
    pytest.param(dict(seed=-1), "seed must be in [0, 2**64 - 1], got -1", id="seed-neg"),
    pytest.param(dict(seed=2**64), f"seed must be in [0, 2**64 - 1], got {2**64}", id="seed-over"),
    pytest.param(dict(stop=["s"] * 17), "stop allows at most 16 strings, got 17", id="stops"),
    pytest.param(dict(stop=["ok", ""]), "stop[1] must be 1 to 256 characters long, got 0", id="stop-empty"),
    pytest.param(dict(stop=["x" * 257]), "stop[0] must be 1 to 256 characters long, got 257", id="stop-long"),
    pytest.param(dict(top_logprobs=21), "top_logprobs must be in [0, 20], got 21", id="top-logprobs"),
    pytest.param(dict(top_logprobs=-1), "top_logprobs must be in [0, 20], got -1", id="top-logprobs-neg"),
    pytest.param(dict(min_tokens=65), "min_tokens must be in [0, max_tokens] (max_tokens is 64 here), got 65",
                 id="min-tokens"),
    pytest.param(dict(max_tokens=5, min_tokens=6),
                 "min_tokens must be in [0, max_tokens] (max_tokens is 5 here), got 6", id="min-tokens-max"),
    pytest.param(dict(min_tokens=-1), "min_tokens must be in [0, max_tokens] (max_tokens is 64 here), got -1",
                 id="min-tokens-neg"),
    pytest.param(dict(repetition_penalty=-1.0),
                 "repetition_penalty must be a finite number > 0 (0 or 1 = disabled), got -1.0", id="rep-neg"),
    pytest.param(dict(repetition_penalty=math.nan),
                 "repetition_penalty must be a finite number > 0 (0 or 1 = disabled), got nan", id="rep-nan"),
    pytest.param(dict(n=3, max_n=2), "n must be in [0, 2] (0 = 1; the server's --max-n is 2), got 3", id="n"),
    pytest.param(dict(n=-1), "n must be in [0, 1] (0 = 1; the server's --max-n is 1), got -1", id="n-neg"),
    pytest.param(dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (0 = disabled), got 2.5",
                 id="presence"),
    pytest.param(dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2] (0 = disabled), got -2.5",
                 id="frequency"),
    pytest.param(dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias allows at most 300 entries, got 301",
                 id="bias-entries"),
    pytest.param(dict(logit_bias={-3: 1.0}), "logit_bias: -3 is not a token id", id="bias-id"),
    pytest.param(dict(logit_bias={7: 100.5}), "logit_bias[7] must be in [-100, 100], got 100.5", id="bias-over"),
    pytest.param(dict(logit_bias={7: -101.0}), "logit_bias[7] must be in [-100, 100], got -101.0", id="bias-under"),
    pytest.param(dict(min_p=1.5), "min_p must be in [0, 1] (0 = disabled), got 1.5", id="min-p"),
    pytest.param(dict(min_p=-0.5), "min_p must be in [0, 1] (0 = disabled), got -0.5", id="min-p-neg"),
    pytest.param(dict(stop_token_ids=list(range(65))), "stop_token_ids allows at most 64 ids, got 65",
                 id="stop-ids"),
    pytest.param(dict(stop_token_ids=[3, -2]), "stop_token_ids[1]: -2 is not a token id", id="stop-id"),
])
def test_bad_values_are_refused_with_their_message(overrides, message):
    with pytest.raises(InvalidRequestError) as e:
        options(**overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(max_tokens=4096, min_tokens=4096), id="max-tokens"),
    pytest.param(dict(temperature=0.0, top_p=0.0, top_k=0, min_p=0.0), id="zeros"),
    pytest.param(dict(top_p=1.0, min_p=1.0), id="ones"),
    pytest.param(dict(seed=0), id="seed-0"),
    pytest.param(dict(seed=2**64 - 1), id="seed-max"),
    pytest.param(dict(stop=["x" * 256] + ["y"] * 15), id="stops"),
    pytest.param(dict(top_logprobs=20), id="top-logprobs"),
    pytest.param(dict(repetition_penalty=0.0), id="rep-0"),
    pytest.param(dict(n=2, max_n=2), id="n"),
    pytest.param(dict(presence_penalty=2.0, frequency_penalty=-2.0), id="penalties-edges"),
    pytest.param(dict(presence_penalty=-2.0, frequency_penalty=2.0), id="penalties-other-edges"),
    pytest.param(dict(logit_bias={i: 100.0 if i % 2 else -100.0 for i in range(300)}), id="bias-edges"),
    pytest.param(dict(logit_bias={0: 1.0}), id="bias-id-0"),
    pytest.param(dict(stop_token_ids=list(range(64))), id="stop-ids"),
])
def test_values_at_the_edges_are_accepted(overrides):
    options(**overrides)


def test_defaults_and_types():
    o = options(temperature=1, top_p=0.0, repetition_penalty=0.0, n=0, logprobs=1, include_stop_str_in_output=1,
                presence_penalty=1, frequency_penalty=-1, min_p=0, stop=["a", "b"], stop_token_ids=[5, 5, 2])
    assert (o.max_tokens, o.top_p, o.repetition_penalty, o.n) == (64, 1.0, 1.0, 1)
    assert o.logprobs is True and o.include_stop_str_in_output is True
    assert all(type(v) is float for v in (o.temperature, o.top_p, o.repetition_penalty, o.presence_penalty,
                                          o.frequency_penalty, o.min_p))
    assert (o.stop, o.stop_token_ids, o.top_k, o.seed, o.ignore_eos) == (("a", "b"), frozenset({2, 5}), 0, None,
                                                                        False)
    o = options(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=9, ignore_eos=True, top_logprobs=2,
                min_tokens=7, repetition_penalty=1.5, n=2, max_n=4, presence_penalty=0.5, frequency_penalty=0.25,
                min_p=0.125, logit_bias={4: 2.0, 1: -1.0, 9: 0.0})
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed, o.ignore_eos, o.top_logprobs, o.min_tokens,
            o.repetition_penalty, o.n, o.presence_penalty, o.frequency_penalty, o.min_p) == (
        7, 0.5, 0.25, 3, 9, True, 2, 7, 1.5, 2, 0.5, 0.25, 0.125)
    assert o.logit_bias == ((1, -1.0), (4, 2.0))  # by id, the zero left out
    assert options(top_p=1.0).top_p == 1.0 and options().logprobs is False
    assert options().include_stop_str_in_output is False
    assert (options().min_tokens, options().top_logprobs, options().n, options().repetition_penalty) == (0, 0, 1, 1.0)


def test_each_completion_gets_its_own_seed():
    o = options(seed=10, n=3, max_n=3)
    assert o.for_completion(0) is o
    assert o.for_completion(2).seed == 12 and o.for_completion(2).n == 3
    assert options(seed=2**64 - 2).for_completion(3).seed == 1  # wraps at 2**64
    assert options(seed=2**64 - 1).for_completion(1).seed == 0
    unseeded = options()
    assert unseeded.for_completion(4) is unseeded


@pytest.mark.parametrize("overrides, message", [
    pytest.param(dict(logit_bias={5: 1.0}), "logit_bias: 5 is not a token id of this model (0 to 4)", id="bias"),
    pytest.param(dict(logit_bias={9: 1.0, 6: 2.0, 5: 1.0, 1: 3.0}),
                 "logit_bias: 5 is not a token id of this model (0 to 4), and 2 more", id="biases"),
    pytest.param(dict(stop_token_ids=[7, 5]), "stop_token_ids: 5 is not a token id of this model (0 to 4), and 1 more",
                 id="stop-ids"),
])
def test_token_ids_past_the_vocabulary_are_refused(overrides, message):
    with pytest.raises(InvalidRequestError) as e:
        options(**overrides).check_token_ids(5)
    assert str(e.value) == message


def test_token_ids_inside_the_vocabulary_pass():
    options(logit_bias={0: 1.0, 4: -1.0}, stop_token_ids=[0, 4]).check_token_ids(5)


# ---------------------------------------------------------------- the histories penalties read


def test_seen_tokens_grow_and_start_over_after_a_rollback():
    s = SeenTokens()
    history = [3, 1, 3]
    assert sorted(s.update(history)) == [1, 3] and s.update(history).dtype == np.int64
    history += [2, 2, 1]
    assert sorted(s.update(history)) == [1, 2, 3]
    assert sorted(s.update(history)) == [1, 2, 3]  # nothing new
    assert sorted(s.update([7, 1])) == [1, 7]  # shorter: a rollback, counted afresh
    prompt = list(range(100, 300)) * 2  # a prompt past 64 tokens, each id twice
    s = SeenTokens()
    got = s.update(prompt)
    assert sorted(got) == list(range(100, 300)) and got.dtype == np.int64
    grown = prompt + list(range(0, 70))
    assert sorted(s.update(grown)) == list(range(0, 70)) + list(range(100, 300))
    many = SeenTokens()
    for t in range(150):  # distinct ids one at a time: the array grows past its first 64
        assert many.update(list(range(t + 1)))[-1] == t
    assert sorted(many.update(list(range(150)))) == list(range(150))


def test_output_counts_count_the_output_only():
    c = OutputCounts()
    ids, counts = c.update([9, 9, 4], 2)  # prompt [9, 9]
    assert ids.tolist() == [4] and counts.tolist() == [1.0] and counts.dtype == np.float32 and ids.dtype == np.int64
    ids, counts = c.update([9, 9, 4, 5, 4, 4], 2)
    assert ids.tolist() == [4, 5] and counts.tolist() == [3.0, 1.0]
    ids, counts = c.update([9, 9], 2)  # a rollback to the prompt
    assert ids.tolist() == [] and counts.tolist() == []
    ids, counts = c.update([9, 9, 9], 2)
    assert ids.tolist() == [9] and counts.tolist() == [1.0]
    assert OutputCounts().update([1, 2], 5)[0].tolist() == []  # nothing past the prompt yet
    ids, counts = OutputCounts().update([5, 6, 5], 0)  # no prompt: every token is output
    assert ids.tolist() == [5, 6] and counts.tolist() == [2.0, 1.0]
    long = OutputCounts()
    out = [t % 100 for t in range(250)]
    ids, counts = long.update([0] + out, 1)
    assert ids.tolist() == list(range(100))
    assert counts.tolist() == [3.0] * 50 + [2.0] * 50
    ids, counts = long.update([0] + out + [99, 5], 1)
    assert counts[99] == 3.0 and counts[5] == 4.0 and len(ids) == 100


@pytest.mark.parametrize("overrides, seen, counts, bias", [
    pytest.param(dict(), False, False, False, id="none"),
    pytest.param(dict(repetition_penalty=1.0), False, False, False, id="rep-1"),
    pytest.param(dict(repetition_penalty=1.2), True, False, False, id="rep"),
    pytest.param(dict(presence_penalty=0.5), False, True, False, id="presence"),
    pytest.param(dict(frequency_penalty=-0.5), False, True, False, id="frequency"),
    pytest.param(dict(logit_bias={3: 0.0}), False, False, False, id="zero-bias"),
    pytest.param(dict(logit_bias={3: 2.5, 1: -1.0}), False, False, True, id="bias"),
])
def test_a_row_tracks_only_what_its_options_use(overrides, seen, counts, bias):
    r = RowSampler(options(**overrides))
    assert (r.seen is not None, r.counts is not None, r.bias is not None) == (seen, counts, bias)
    assert r.adjusts == (seen or counts or bias)
    if bias:
        ids, values = r.bias
        assert ids.dtype == torch.long and values.dtype == torch.float32
        assert ids.tolist() == [1, 3] and values.tolist() == [-1.0, 2.5]
        assert ids.device.type == "cpu"


def test_a_seeded_row_draws_from_a_generator_seeded_alike():
    assert float(torch.rand((), generator=RowSampler(options(seed=77)).generator, dtype=torch.float64)) == uniform(77)
    a, b = RowSampler(options()), RowSampler(options())  # unseeded: seeded from the OS, each its own
    assert torch.rand(4, generator=a.generator).tolist() != torch.rand(4, generator=b.generator).tolist()


def test_penalties_and_bias_on_exact_values():
    x = torch.tensor([[2.0, -2.0, 0.5, NEG_INF, 4.0]])
    sampling.add_at(x, 0, torch.tensor([0, 3, 4]), torch.tensor([1.0, 5.0, -0.5]))
    assert x.tolist() == [[3.0, -2.0, 0.5, NEG_INF, 3.5]]
    sampling.apply_repetition_penalty(x, 0, np.array([0, 1, 3]), 2.0)
    assert x.tolist() == [[1.5, -4.0, 0.5, NEG_INF, 3.5]]
    sampling.apply_occurrence_penalties(x, 0, np.array([2, 4]), np.array([1.0, 3.0], dtype=np.float32), 0.5, 0.25)
    assert x.tolist() == [[1.5, -4.0, -0.25, NEG_INF, 2.25]]  # -= 0.25 * count + 0.5
    y = torch.tensor([[2.0, -2.0, 0.5, NEG_INF, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    bad = sampling.adjust_rows(y, [(0, torch.tensor([0, 3, 4]), torch.tensor([1.0, 5.0, -0.5])),
                                   (1, torch.tensor([9]), torch.tensor([1.0]))],
                               [(0, np.array([0, 1, 3]), 2.0)],
                               [(0, np.array([2, 4]), np.array([1.0, 3.0], dtype=np.float32), 0.5, 0.25)])
    assert bad == {1} and y.tolist() == [[1.5, -4.0, -0.25, NEG_INF, 2.25], [1.0] * 5]
    # A history id past the row (a penalty's, an occurrence's): that row is left out of what follows, the others
    # are exact.
    y = torch.tensor([[2.0, -2.0, 0.5, NEG_INF, 4.0], [1.0] * 5, [2.0] * 5])
    bad = sampling.adjust_rows(y, [], [(1, np.array([0, 5]), 2.0), (0, np.array([0, 1, 3]), 2.0)],
                               [(2, np.array([-1]), np.array([1.0], dtype=np.float32), 0.5, 0.25),
                                (1, np.array([0]), np.array([1.0], dtype=np.float32), 0.5, 0.25),
                                (0, np.array([2]), np.array([2.0], dtype=np.float32), 1.0, 1.0)])
    assert bad == {1, 2} and y.tolist() == [[1.0, -4.0, -2.5, NEG_INF, 4.0], [1.0] * 5, [2.0] * 5]


def test_penalties_and_bias_on_a_later_row_in_the_logits_dtype():
    """A row other than the first, float64 logits (the bias and the amounts are written in the logits' dtype), a
    positive logit under 1 (divided: only negative ones are multiplied) and a bias at the first id past the row
    (that row left out, the others exact)."""
    x = torch.tensor([[1.0] * 4, [0.5, -0.5, 2.0, 0.0]], dtype=torch.float64)
    sampling.add_at(x, 1, torch.tensor([2]), torch.tensor([0.25]))
    sampling.apply_repetition_penalty(x, 1, np.array([0, 1, 3]), 2.0)
    sampling.apply_occurrence_penalties(x, 1, np.array([3]), np.array([2.0], dtype=np.float32), 0.5, 0.25)
    assert x.tolist() == [[1.0] * 4, [0.25, -1.0, 2.25, -1.0]]  # 0 stays 0 under the penalty
    y = torch.tensor([[1.0] * 4, [0.5, -0.5, 2.0, 0.0], [3.0] * 4], dtype=torch.float64)
    bad = sampling.adjust_rows(y, [(1, torch.tensor([2]), torch.tensor([0.25])), (2, torch.tensor([0, 4]),
                                                                                torch.tensor([1.0, 1.0]))],
                               [(1, np.array([0, 1, 3]), 2.0)],
                               [(1, np.array([3]), np.array([2.0], dtype=np.float32), 0.5, 0.25)])
    assert bad == {2} and y.tolist() == [[1.0] * 4, [0.25, -1.0, 2.25, -1.0], [3.0] * 4]
    assert sampling.adjust_rows(y, [], [], []) == set() and y[1].tolist() == [0.25, -1.0, 2.25, -1.0]


def test_ban_takes_the_banned_ids_out_of_an_allowed_list_unless_they_are_all_it_has():
    x = torch.zeros(2, 6)
    assert sampling.ban_unless_only(x, 1, np.array([2, 5]), np.array([0, 2, 3, 5])).tolist() == [0, 3]
    assert sampling.ban_unless_only(x, 1, np.array([2, 5]), np.array([2, 5])).tolist() == [2, 5]
    assert sampling.ban_unless_only(x, 1, np.array([4]), np.array([1, 3])).tolist() == [1, 3]
    assert torch.equal(x, torch.zeros(2, 6))  # a listed row's logits are not written


def test_ban_writes_minus_inf_at_a_rows_banned_ids_unless_nothing_else_is_finite():
    x = torch.tensor([[0.5, -1.0, 2.0, 0.0], [NEG_INF, 1.5, NEG_INF, -0.5], [1.0, 2.0, NEG_INF, NEG_INF]])
    assert sampling.ban_unless_only(x, 1, np.array([1]), None) is None
    assert x.tolist() == [[0.5, -1.0, 2.0, 0.0], [NEG_INF, NEG_INF, NEG_INF, -0.5], [1.0, 2.0, NEG_INF, NEG_INF]]
    sampling.ban_unless_only(x, 1, np.array([3]), None)  # -0.5 is all the row has left: it stays
    sampling.ban_unless_only(x, 2, np.array([0, 1]), None)  # both come back
    assert x.tolist() == [[0.5, -1.0, 2.0, 0.0], [NEG_INF, NEG_INF, NEG_INF, -0.5], [1.0, 2.0, NEG_INF, NEG_INF]]


def test_ban_over_rows_listed_out_of_order_with_bans_of_different_lengths():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [NEG_INF, 1.0, NEG_INF, 2.0, NEG_INF], [5.0, 4.0, 3.0, 2.0, 1.0],
                      [1.0, NEG_INF, 0.5, NEG_INF, 0.25]])
    sampling.ban_rows_unless_only(x, [3, 1, 0], [np.array([4]), np.array([1, 3]), np.array([0, 2, 4])])
    assert x.tolist() == [[NEG_INF, 1.0, NEG_INF, 3.0, NEG_INF], [NEG_INF, 1.0, NEG_INF, 2.0, NEG_INF],
                          [5.0, 4.0, 3.0, 2.0, 1.0], [1.0, NEG_INF, 0.5, NEG_INF, NEG_INF]]
    sampling.ban_rows_unless_only(x, [], [])  # no row: nothing to do
    assert x[2].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]
    y = torch.tensor([[0.0, 1.0, 2.0], [NEG_INF, 1.0, NEG_INF]])
    sampling.ban_rows_unless_only(y, [1], [np.array([1])])  # whether the listed row, not row 0, is left empty
    assert y.tolist() == [[0.0, 1.0, 2.0], [NEG_INF, 1.0, NEG_INF]]


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="numpy"), pytest.param(torch.float64, id="torch")])
def test_greedy_takes_the_first_of_tied_maxima(dtype):
    x = torch.tensor([[1.0, 3.0, 3.0, NEG_INF], [5.0, 5.0, 0.0, 5.0], [NEG_INF, 0.0, 2.0, 2.0]], dtype=dtype)
    assert sample(x, [RowSampler(options(temperature=0.0))] * 3) == [1, 0, 2]
    assert sample(x, [RowSampler(options(temperature=0.0))], row_index=[2]) == [2]  # one row of three
    assert sample(x, [RowSampler(options(top_k=1, temperature=5.0, seed=1))] * 2, row_index=[1, 0]) == [0, 1]
    cands = [np.array([2, 3]), np.array([0, 1, 3]), None]
    assert sample(x, [RowSampler(options(temperature=0.0))] * 3, candidates=cands) == [2, 0, 2]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="numpy"), pytest.param(torch.float64, id="torch")])
def test_greedy_logprobs_are_the_log_softmax(dtype):
    logits = [math.log(0.5), math.log(0.3), NEG_INF, math.log(0.2)]
    x = torch.tensor([logits, logits[::-1]], dtype=dtype)
    rows = [RowSampler(options(temperature=0.0, top_logprobs=3)), RowSampler(options(temperature=0.0, logprobs=True)),
            RowSampler(options(temperature=0.0))]
    tokens, lps = sample_with_logprobs(torch.cat([x, x[:1]]), rows)
    assert tokens == [0, 3, 0] and lps[2] is None
    assert lps[0].logprob == pytest.approx(math.log(0.5), abs=1e-6) and lps[1].top == ()
    assert lps[1].logprob == pytest.approx(math.log(0.5), abs=1e-6)
    assert [t for t, _ in lps[0].top] == [0, 1, 3]
    assert [v for _, v in lps[0].top] == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.2)], abs=1e-6)
    one = sample_with_logprobs(x, [RowSampler(options(temperature=0.0, top_logprobs=1))])[1][0]
    assert [t for t, _ in one.top] == [0]
    wide = sample_with_logprobs(x, [RowSampler(options(temperature=0.0, top_logprobs=5))] * 2)[1]
    assert [t for t, _ in wide[1].top] == [3, 2, 0]  # -inf is never an alternative, 5 asked of 4 columns
    cand = sample_with_logprobs(x, [RowSampler(options(temperature=0.0, top_logprobs=2))],
                                candidates=[np.array([1, 2, 3])])[1][0]
    assert [t for t, _ in cand.top] == [1, 3]
    assert cand.logprob == pytest.approx(math.log(0.6), abs=1e-6)  # over the allowed ids: 0.3 / 0.5
    assert [v for _, v in cand.top] == pytest.approx([math.log(0.6), math.log(0.4)], abs=1e-6)


def test_greedy_logprobs_of_a_few_rows_of_many():
    x = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    rows = [RowSampler(options(temperature=0.0, top_logprobs=1))]
    tokens, lps = sample_with_logprobs(x, rows, row_index=[1])
    want = torch.log_softmax(x[1], 0).tolist()
    assert tokens == [0] and lps[0].logprob == pytest.approx(want[0]) and lps[0].top == ((0, pytest.approx(want[0])),)
    only = sample_with_logprobs(x, [RowSampler(options(temperature=0.0, logprobs=True))] * 2, row_index=[1, 2])[1]
    assert [lp.top for lp in only] == [(), ()]
    assert [lp.logprob for lp in only] == pytest.approx([want[0], torch.log_softmax(x[2], 0)[2].item()])
    rows = [RowSampler(options(temperature=0.0, logprobs=True)), RowSampler(options(temperature=0.0, top_logprobs=2)),
            RowSampler(options(temperature=0.0, logprobs=True))]
    tokens, lps = sample_with_logprobs(x, rows, row_index=[3, 1, 0])
    assert tokens == [0, 0, 2]
    assert lps[0].top == () and lps[2].top == ()
    assert [t for t, _ in lps[1].top] == [0, 1]
    assert [v for _, v in lps[1].top] == pytest.approx(want[:2])
    assert lps[0].logprob == pytest.approx(torch.log_softmax(x[3], 0)[0].item())
    assert lps[2].logprob == pytest.approx(torch.log_softmax(x[0], 0)[2].item())


# ---------------------------------------------------------------- draws against the reference


def check_logprobs(lp: RowLogprobs, token: int, ids: np.ndarray, p: np.ndarray, top_n: int) -> None:
    prob = dict(zip(ids.tolist(), p.tolist()))
    assert lp.logprob == pytest.approx(math.log(prob[token]), abs=2e-5)
    order = [t for t in sorted(prob, key=lambda t: -prob[t]) if prob[t] > 0][:top_n]
    assert [t for t, _ in lp.top] == order
    assert [v for _, v in lp.top] == pytest.approx([math.log(prob[t]) for t in order], abs=2e-5)


# No weight at a cut's edge (a ratio of exactly min_p, a partial sum of exactly 1 - top_p): float32 and float64
# agree on every cut.
DISTINCT = torch.tensor([math.log(w) for w in (0.05, 0.3, 0.02, 0.16, 0.25, 0.03, 0.2)])

SPECS = [
    pytest.param(dict(temperature=1.0), id="t1"),
    pytest.param(dict(temperature=0.5), id="t0.5"),
    pytest.param(dict(temperature=2.0), id="t2"),
    pytest.param(dict(temperature=1.0, top_k=3), id="top-k"),
    pytest.param(dict(temperature=0.7, top_k=6), id="top-k-6"),
    pytest.param(dict(temperature=1.0, top_p=0.65), id="top-p"),
    pytest.param(dict(temperature=1.0, top_p=0.9), id="top-p-0.9"),
    pytest.param(dict(temperature=1.0, top_p=0.2), id="top-p-one-token"),
    pytest.param(dict(temperature=1.0, min_p=0.5), id="min-p"),
    pytest.param(dict(temperature=2.0, min_p=0.3), id="min-p-t2"),
    pytest.param(dict(temperature=1.0, top_k=4, top_p=0.7), id="top-k-top-p"),
    pytest.param(dict(temperature=1.0, top_p=0.8, min_p=0.6), id="top-p-min-p"),
    pytest.param(dict(temperature=1.0, top_k=5, min_p=0.3), id="top-k-min-p"),
    pytest.param(dict(temperature=1.0, top_k=7), id="top-k-whole-row"),  # as wide as the row: no cut, id order
    pytest.param(dict(temperature=1.0, min_p=1.0), id="min-p-1"),  # the likeliest token alone
    pytest.param(dict(temperature=1.0, top_k=9, top_p=0.9), id="top-k-past-the-row-top-p"),  # still by id
]


@pytest.mark.parametrize("spec", SPECS)
def test_small_rows_draw_the_reference_token_with_its_logprobs(spec):
    tokens, lps = draw_specs(DISTINCT, {**spec, "top_logprobs": 4})
    ids, p = reference(DISTINCT, **spec)
    assert tokens == [drawn(ids, p, uniform(s)) for s in SEEDS]
    for token, lp in zip(tokens, lps):
        check_logprobs(lp, token, ids, p, 4)
    direct = [sampling._sample_row(DISTINCT, RowSampler(options(seed=s, top_logprobs=4, **spec))) for s in SEEDS]
    one = sampling._sample_row(DISTINCT, RowSampler(options(seed=0, top_logprobs=1, **spec)))[1]
    assert len(one.top) == 1 and one.top[0][0] == lps[0].top[0][0]
    assert one.top[0][1] == pytest.approx(lps[0].top[0][1], abs=2e-5)
    assert [t for t, _ in direct] == tokens
    for token, (_, lp) in zip(tokens, direct):
        check_logprobs(lp, token, ids, p, 4)


@pytest.mark.parametrize("spec", [pytest.param(dict(temperature=1.0), id="t1"),
                                  pytest.param(dict(temperature=1.0, top_k=4), id="top-k")])
def test_allowed_lists_of_different_lengths_each_draw_their_own(spec):
    """One matrix for lists of 1, 3 and 6 ids (the shorter padded): each row draws only its ids, at their
    weights."""
    cands = [np.array([5]), np.array([0, 2, 9]), np.array([1, 2, 3, 6, 8, 11])]
    x = torch.stack([gentle(12, s) for s in range(3)])
    for seed in range(12):
        rows = [RowSampler(options(seed=seed * 3 + r, **spec)) for r in range(3)]
        tokens = sample(x, rows, candidates=cands)
        for r, ids in enumerate(cands):
            masked = torch.full((12,), NEG_INF)
            masked[ids] = x[r, ids]
            assert tokens[r] == expected(masked, seed * 3 + r, **spec)


def test_ties_under_top_k_keep_the_lower_ids_of_an_allowed_list_first():
    """Among equal logits an allowed list's likeliest-first order is by id (a stable sort; a whole row's is
    torch.topk's)."""
    x = torch.tensor([0.5, 2.0, 1.0, 2.0, 2.0, 1.0, 2.0, 0.0])
    tokens = draw_specs(x, dict(temperature=1.0, top_k=3), candidates=np.array([0, 1, 2, 3, 4, 6, 7]))[0]
    # Likeliest first: 1, 3, 4 (the first three of the 2.0s), each a third.
    assert tokens == [[1, 3, 4][int(3 * uniform(s))] for s in SEEDS]


def test_the_row_path_under_top_k_one_is_the_argmax():
    assert {sampling._sample_row(DISTINCT, RowSampler(options(seed=s, top_k=1, temperature=2.0)))[0]
            for s in range(5)} == {1}


@pytest.mark.parametrize("spec", SPECS)
def test_allowed_ids_draw_the_reference_token_among_them(spec):
    cands = np.array([0, 1, 3, 4, 6, 7, 9, 10], dtype=np.int64)
    x = torch.full((12,), -3.0)
    x[cands] = torch.tensor([0.1, 1.2, -0.4, 0.9, 0.6, -1.0, 0.3, 1.0])  # what the ids outside weigh: nothing
    tokens, lps = draw_specs(x, {**spec, "top_logprobs": 3}, candidates=cands)
    masked = torch.full((12,), NEG_INF)
    masked[cands] = x[cands]
    ids, p = reference(masked, **spec)  # the masked row's draw (its top_k against the whole row's width)
    assert tokens == [drawn(ids, p, uniform(s)) for s in SEEDS]
    for token, lp in zip(tokens, lps):
        check_logprobs(lp, token, ids, p, 3)


@pytest.mark.parametrize("width", [pytest.param(100, id="one-partial-block"), pytest.param(256, id="two-blocks"),
                                   pytest.param(300, id="blocks-and-a-tail")])
@pytest.mark.parametrize("scale", [pytest.param(0.0, id="flat"), pytest.param(2.0, id="peaked")])
def test_whole_rows_draw_the_reference_token(width, scale):
    x = gentle(width, width, scale)
    x[::9] = NEG_INF
    tokens, lps = draw_specs(x, dict(temperature=0.8, logprobs=True), seeds=range(60))
    ids, p = reference(x, temperature=0.8)
    assert tokens == [drawn(ids, p, uniform(s)) for s in range(60)]
    for token, lp in zip(tokens, lps):
        assert lp.logprob == pytest.approx(math.log(p[token]), abs=2e-5) and lp.top == ()


def test_the_draw_lands_in_the_block_its_uniform_names():
    """Mass in single tokens at block edges (127, 128, 255, 256, the last): u picks among them exactly."""
    x = torch.full((300,), NEG_INF)
    x[[0, 127, 128, 255, 256, 299]] = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.2, 0.7])
    tokens = draw_specs(x, dict(temperature=1.0), seeds=range(80))[0]
    ids, p = reference(x)
    assert tokens == [drawn(ids, p, uniform(s)) for s in range(80)]
    assert set(tokens) == {0, 127, 128, 255, 256, 299}


@pytest.mark.parametrize("spec", [
    pytest.param(dict(temperature=0.9, top_k=7), id="top-k"),
    pytest.param(dict(temperature=0.9, top_k=40, top_p=0.6), id="top-k-top-p"),
    pytest.param(dict(temperature=0.5, min_p=0.2), id="min-p"),
    pytest.param(dict(temperature=1.5, top_p=0.5), id="top-p"),
    pytest.param(dict(temperature=1.5, top_p=0.8, min_p=0.05), id="top-p-min-p"),
])
def test_wide_rows_under_a_cut_draw_the_reference_token(spec):
    """4,000 ids: the block-wise top-k; a nucleus among the 512 likeliest with the rest's mass outside."""
    x = gentle(4000, 5, 3.0)
    x[::11] = NEG_INF
    tokens, lps = draw_specs(x, {**spec, "top_logprobs": 2})
    ids, p = reference(x, **spec)
    assert tokens == [drawn(ids, p, uniform(s)) for s in SEEDS]
    for token, lp in zip(tokens, lps):
        check_logprobs(lp, token, ids, p, 2)


# Weights relative to the likeliest token: 2.0 among the 4 likeliest, 0.45 beyond them.
OUTSIDE = torch.tensor([math.log(w) for w in (0.1, 0.5, 0.05, 0.02, 1.0, 0.1, 0.3, 0.01, 0.2, 0.1, 0.05, 0.02)])


# 2.8 among the 4 likeliest (1, 0.9, 0.8, 0.1), 0.45 beyond them (0.05 each).
FLATTER = torch.tensor([math.log(w) for w in (0.05, 0.9, 0.05, 0.05, 1.0, 0.05, 0.05, 0.1, 0.05, 0.8, 0.05, 0.05,
                                              0.05)])


@pytest.mark.parametrize("row, top_p, kept", [pytest.param(OUTSIDE, 0.6, {4, 1}, id="two-kept"),
                                              pytest.param(OUTSIDE, 0.05, {4}, id="one-kept"),
                                              pytest.param(FLATTER, 0.3, {4}, id="one-of-a-flatter-four")])
def test_a_nucleus_among_the_candidates_weighs_what_lies_beyond_them(row, top_p, kept, monkeypatch):
    """Drawn among its 4 likeliest tokens, a top_p row's nucleus still counts the mass beyond them: at top_p 0.6
    it keeps 1 and 0.5 (the tokens left out, 0.01 to 0.3, hold 0.95 <= 0.4 * 2.45), where the candidates alone
    would keep 0.3 too."""
    monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", 4)
    tokens = draw_specs(row, dict(top_p=top_p))[0]
    assert tokens == [expected(row, s, top_p=top_p) for s in SEEDS]
    assert set(tokens) == kept


@pytest.mark.parametrize("spec", [
    pytest.param(dict(temperature=1.0, top_p=0.9), id="top-p"),
    pytest.param(dict(temperature=1.0, min_p=0.5), id="min-p"),
    pytest.param(dict(temperature=1.0, top_p=0.97, min_p=0.2), id="both"),
])
def test_a_nucleus_wider_than_the_candidates_draws_the_whole_rows_token(spec):
    """A nearly flat row of 2,000 ids: its cut keeps more than the 512 likeliest, so the row path draws it."""
    x = gentle(2000, 8, 0.3)
    tokens = draw_specs(x, spec)[0]
    ids, p = reference(x, **spec)
    assert tokens == [drawn(ids, p, uniform(s)) for s in SEEDS]
    assert max(tokens) > 0 and len(set(tokens)) > 30


def test_a_target_equal_to_a_cumulative_weight_draws_the_next_token():
    """The drawn position is the first whose cumulative weight exceeds u * total: at equality, the next one (so
    a weight 0 is never drawn, even at u = 0)."""
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    j, total = sampling._draw_dense(w, torch.tensor([0.5, 0.0], dtype=torch.float64))
    assert j.tolist() == [2, 2] and total.tolist() == [4.0, 2.0]
    flat = torch.ones((3, 256))  # blocks of 128: targets 128 (a block's edge), 192 (inside one), 0
    flat[2, :130] = 0.0
    j, total = sampling._draw_blocked(flat, torch.tensor([0.5, 0.75, 0.0], dtype=torch.float64))
    assert j.tolist() == [128, 192, 130] and total.tolist() == [256.0, 256.0, 126.0]


def test_min_p_widths_count_what_min_p_keeps():
    x = torch.tensor([[0.0, -1.0, -2.0, -3.0, NEG_INF, -0.5], [NEG_INF] * 6, [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    opts = [options(min_p=math.exp(-2.5), temperature=1.0), options(min_p=0.5), options(min_p=math.exp(-0.5),
                                                                                      temperature=2.0)]
    # Row 0: logits within 2.5 of the peak: 0, -1, -2, -0.5 (4), +1. Row 2: within 1.0: all six, +1.
    assert sampling._min_p_widths(x, opts, [0, 0, 0]) == [5, 1, 7]
    assert sampling._min_p_widths(x, opts, [9, 0, 3]) == [9, 1, 3]
    flat = torch.zeros((1, 600))
    assert sampling._min_p_widths(flat, [options(min_p=0.5)], [0]) == [512]


@pytest.mark.parametrize("width, k", [pytest.param(5000, 7, id="blocks"), pytest.param(4003, 20, id="blocks-tail"),
                                      pytest.param(100, 7, id="narrow")])
def test_top_is_torch_topk(width, k):
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
    x[1, -3:] = torch.tensor([50.0, 52.0, 51.0])  # the largest in the tail past the last whole block
    v, ix = sampling._top(x, k)
    want_v, want_ix = torch.topk(x, k)
    assert torch.equal(v, want_v) and torch.equal(ix, want_ix)
    strided = x.t().contiguous().t()  # not contiguous
    assert torch.equal(sampling._top(strided, k)[1], want_ix)


# ---------------------------------------------------------------- the row path and the batch's fallbacks


def test_a_row_the_batch_leaves_to_the_row_path_draws_its_first_uniform_there():
    """A nearly flat row whose nucleus reaches past the candidates, beside a peaked one the batch draws: each
    row's token is the reference's for the first uniform of its own generator."""
    x = torch.stack([gentle(2000, 8, 0.3), gentle(2000, 9, 4.0)])
    for seed in range(6):
        tokens = sample(x, [RowSampler(options(seed=seed, top_p=0.9)), RowSampler(options(seed=seed + 50, top_p=0.9))])
        assert tokens == [expected(x[0], seed, top_p=0.9), expected(x[1], seed + 50, top_p=0.9)]


def test_rows_named_in_a_wider_batch_draw_from_their_own_logits():
    x = torch.tensor([[0.0, 5.0], [5.0, 0.0], [0.0, 0.0]])  # two columns, three rows: rows [0, 1] are not all
    rows = [RowSampler(options(seed=s, temperature=0.01)) for s in (1, 2)]
    assert sample(x, rows, row_index=[0, 1]) == [1, 0]
    assert sample(x, [RowSampler(options(seed=1, temperature=0.01))] * 2, row_index=[1, 0]) == [0, 1]


def test_a_row_with_nothing_finite_beside_a_nucleus_in_the_batch():
    x = torch.stack([DISTINCT, torch.full((7,), NEG_INF)])
    tokens = sample(x, [RowSampler(options(seed=3, top_p=0.65)), RowSampler(options(seed=4, min_p=0.5))])
    # The row with nothing drawable gives a token whose logit is not finite: the step refuses it (NoAllowedToken).
    assert tokens[0] == expected(DISTINCT, 3, top_p=0.65) and not math.isfinite(float(x[1, tokens[1]]))


@pytest.mark.parametrize("spec", [pytest.param(dict(), id="plain"), pytest.param(dict(min_p=0.5), id="min-p"),
                                  pytest.param(dict(top_k=3), id="top-k"), pytest.param(dict(top_p=0.9), id="top-p")])
def test_a_row_with_nan_or_nothing_finite_draws_no_drawable_token(spec):
    """Such a row takes the row path, whose token is the id of a non-finite logit (under top_k, an id, not its
    position among the likeliest): the step then refuses it (step_sampler's check), where a draw in the batch
    could have picked a finite one."""
    x = torch.tensor([[0.0, 1.0, math.nan, 2.0], [0.5, 1.0, 0.0, 2.0], [NEG_INF] * 4])
    tokens = sample(x, [RowSampler(options(seed=s, **spec)) for s in (1, 2, 3)])
    for i in (0, 2):
        assert 0 <= tokens[i] < 4 and not math.isfinite(x[i, tokens[i]]), tokens
    ids, p = reference(x[1], **spec)
    assert tokens[1] == drawn(ids, p, uniform(2))


@pytest.mark.parametrize("spec", [pytest.param(dict(), id="plain"), pytest.param(dict(top_k=3), id="top-k"),
                                  pytest.param(dict(top_p=0.9), id="top-p"), pytest.param(dict(min_p=0.1), id="min-p")])
def test_a_temperature_that_overflows_float32_still_draws_the_argmax(spec):
    x = torch.tensor([[1.0, 3.0, 2.0, -1.0], [100.0, -5.0, 100.5, 99.0]])
    rows = [RowSampler(options(seed=s, temperature=1e-38, **spec)) for s in (4, 5)]
    assert sample_with_logprobs(x, rows) == ([1, 2], [None, None])
    assert sampling._sample_row(x[1], RowSampler(options(seed=1, temperature=1e-38, **spec)))[0] == 2


def test_each_rows_own_peak_decides_its_overflow():
    """Beside a row whose peak is small, a row of large negative logits at a tiny temperature still takes the
    row path (its own peak overflows logits / temperature) and draws its argmax."""
    x = torch.tensor([[0.0, 0.5, 0.2], [-49.0, -50.0, -51.0]])
    rows = [RowSampler(options(seed=1, temperature=1.0)), RowSampler(options(seed=2, temperature=1e-37))]
    assert sample(x, rows) == [expected(x[0], 1), 0]


def test_the_overflow_guard_is_exact():
    peak = torch.tensor([1.0, 1.0, -2.0, math.inf, math.nan, 1e30])
    temps = torch.tensor([2 / 1e38, 3 / 1e38, 3 / 1e38, 1.0, 1.0, 1e-8], dtype=torch.float64)
    assert sampling._overflows(peak, temps).tolist() == [True, False, True, True, True, True]


def test_softmax_shifts_by_the_peak_where_dividing_would_overflow():
    got = sampling._softmax(torch.tensor([1.0, 1.0, 0.0]), 1e-39)  # 1 / 1e-39 is inf in float32: NaN unshifted
    assert got.tolist() == [0.5, 0.5, 0.0] and got.dtype == torch.float32
    # Logits a denormal apart: (x - peak) / temperature is -0.5 between the first two.
    got = sampling._softmax(torch.tensor([5e-39, 0.0, -3.0]), 1e-38)
    assert got.tolist() == pytest.approx([1 / (1 + math.exp(-0.5)), math.exp(-0.5) / (1 + math.exp(-0.5)), 0.0],
                                         abs=1e-5)
    assert sampling._softmax(torch.tensor([0.0, math.log(3.0)]), 1.0).tolist() == pytest.approx([0.25, 0.75])
    assert sampling._softmax(torch.tensor([0.0, math.log(3.0)]), 2.0).tolist() == pytest.approx(
        [1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))])


def test_nucleus_leaves_out_at_most_one_minus_top_p_and_keeps_ties():
    probs = torch.tensor([0.25, 0.5, 0.25])
    assert sampling._nucleus(probs, 0.5, is_sorted=False).tolist() == [0.0, 0.5, 0.0]  # 0.25 + 0.25 <= 0.5: out
    assert sampling._nucleus(probs, 0.51, is_sorted=False).tolist() == [0.25, 0.5, 0.25]  # ties with the kept
    assert sampling._nucleus(torch.tensor([0.5, 0.25, 0.25]), 0.5, is_sorted=True).tolist() == [0.5, 0.0, 0.0]
    assert sampling._nucleus(torch.tensor([0.5, 0.3, 0.2]), 0.75, is_sorted=True).tolist() == pytest.approx(
        [0.5, 0.3, 0.0])
    p64 = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    assert sampling._nucleus(p64, 0.85, is_sorted=False).tolist() == [0.0, 0.6, 0.3]
    assert sampling._sorted_ascending(p64).tolist() == [0.1, 0.3, 0.6]
    assert sampling._sorted_ascending(p64.float()).tolist() == pytest.approx([0.1, 0.3, 0.6])


def test_largest_leaves_out_the_impossible():
    v = torch.tensor([0.2, 0.0, 0.5, 0.3])
    assert sampling._largest(v, 0, 0.0) == []
    assert sampling._largest(v, 2, 0.0) == [(2, 0.5), (3, pytest.approx(0.3))]
    assert [p for p, _ in sampling._largest(v, 9, 0.0)] == [2, 3, 0]


def test_finite_at_on_both_paths():
    x = torch.tensor([[0.0, NEG_INF], [math.nan, 1.0]])
    assert sampling.finite_at(x, [0, 0, 1, 1], [0, 1, 0, 1]) == [True, False, False, True]
    assert sampling.finite_at(x.double(), [1, 0], [1, 1]) == [True, False]
    assert sampling.numpy_fast(x) and not sampling.numpy_fast(x.double())


def test_the_batch_draws_what_the_row_path_draws_for_mixed_rows():
    x = torch.stack([gentle(700, s, 2.0) for s in range(6)])
    x[:, ::5] = NEG_INF
    specs = [dict(temperature=0.8), dict(temperature=1.0, top_k=9), dict(temperature=0.0),
             dict(temperature=1.2, top_p=0.7), dict(temperature=0.6, min_p=0.1), dict(temperature=1.0, top_k=1)]
    for step in range(3):
        batch = [RowSampler(options(seed=10 * step + i, top_logprobs=3, **s)) for i, s in enumerate(specs)]
        tokens, lps = sample_with_logprobs(x, batch)
        for i, s in enumerate(specs):
            if s["temperature"] == 0.0 or s.get("top_k") == 1:
                assert tokens[i] == int(x[i].argmax())
                continue
            token, lp = sampling._sample_row(x[i], RowSampler(options(seed=10 * step + i, top_logprobs=3, **s)))
            assert tokens[i] == token
            assert lps[i].logprob == pytest.approx(lp.logprob, abs=2e-5)
            assert [t for t, _ in lps[i].top] == [t for t, _ in lp.top]


def test_a_seeded_row_is_reproducible_and_needs_its_own_rows():
    x = gentle(50, 1, 2.0).expand(2, -1).contiguous()
    first = [sample(x, [RowSampler(options(seed=3)), RowSampler(options(seed=4, top_k=5))]) for _ in range(2)]
    assert first[0] == first[1]
    r = RowSampler(options(seed=3))
    assert [sample(x[:1], [r])[0] for _ in range(3)] == [drawn(*reference(x[0]), u) for u in (
        torch.rand(3, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist())]
    with pytest.raises(ValueError, match=r"logits \[2, 50\] do not have the rows 3 samplers draw from"):
        sample(x, [r] * 3)


def test_a_listed_row_with_nothing_drawable_among_its_ids_gives_one_of_them():
    """Allowed ids all -inf, or one NaN among them: the row path over those ids alone, whose token is an allowed
    id at a non-finite logit (the whole row, finite elsewhere, would give a token the constraint forbids)."""
    x = torch.tensor([[0.0, NEG_INF, 1.0, NEG_INF, 2.0], [0.5, 1.0, math.nan, 0.0, 2.0], [0.0, 3.0, 1.0, 2.0, 0.5]])
    for spec in (dict(), dict(top_k=2), dict(top_p=0.9)):
        rows = [RowSampler(options(seed=s, logprobs=True, **spec)) for s in (1, 2, 3)]
        tokens, lps = sample_with_logprobs(x, rows, candidates=[np.array([1, 3]), np.array([0, 2, 3]), None])
        assert tokens[0] in (1, 3) and tokens[1] == 2 and lps[:2] == [None, None]
        assert tokens[2] == expected(x[2], 3, **spec)


def test_rows_without_a_list_before_rows_with_one():
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    rows = [RowSampler(options(temperature=0.0))] * 2
    assert sample(x, rows, candidates=[None, np.array([0, 2])]) == [1, 2]


def test_the_rows_asked_for_must_be_rows_of_a_matrix():
    x = torch.zeros(2, 3)
    r = RowSampler(options(temperature=0.0))
    assert sample(x, []) == [] and sample_with_logprobs(x, []) == ([], [])
    for logits, rows, at in ((x, [r, r], [0]), (torch.zeros(3), [r], None), (x, [r], [-1]), (x, [r], [2])):
        with pytest.raises(ValueError, match=r"do not have the rows \d samplers draw from"):
            sample(logits, rows, row_index=at)
