"""The greedy head's bfloat16 screen keeps every id that can be the float32 head's argmax.

The embedded model's head shape (129,280 x 256) with random weights, rows at
scales from 1e-2 to 1e3, ids excluded per row (disallowed lists, a banned EOS,
padding columns), exact ties (duplicated head rows) and near ties; then the
same draws as the full head through the sparse head and the sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference_svc.model.head import greedy_head
from inference_svc.model.head.greedy_head import GreedyScreen, _keys
from inference_svc.model.head.lm_head import LmHead
from inference_svc.engine.sampling import RowSampler, SamplingOptions
from inference_svc.model.head.sparse_head import SparseHead, head_plan
from inference_svc.engine.step_sampler import RowPlan, StepSampler
from shared.codec import SparseMask, words_for_vocab
from tests.conftest import inference_config, untestable_here

VOCAB = 129_280
WIDTH = 256
EOS = 1
# The screen serves greedy rows by default (--greedy-head on): a CI runner that cannot run it fails here.
NO_SCREEN = "this machine has no bfloat16 oneDNN: the default --greedy-head on screen cannot be tested on it"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weight():
    w = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0)) / 16
    w[1000] = w[70_000]  # an exact tie in every row: the first index must win
    w[5] = w[6] * (1 + 2 ** -20)  # a near tie
    return w


@pytest.fixture(scope="module")
def head(weight):
    if not GreedyScreen.available(weight, None):
        untestable_here(NO_SCREEN)
    h = LmHead.create(weight)
    assert h.screen is not None and h.name == "onednn_packed"
    return h


def full_argmax(full: torch.Tensor, banned: np.ndarray | None, limit: int) -> int:
    row = full.clone()
    row[limit:] = float("-inf")
    if banned is not None:
        row[torch.from_numpy(banned)] = float("-inf")
    return int(row.argmax())


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0, 1000.0])
def test_the_screen_keeps_the_float32_argmax(head, weight, scale):
    g = torch.Generator().manual_seed(int(scale * 100))
    rng = np.random.default_rng(int(scale * 100))
    rows = 48
    hidden = torch.randn(rows, WIDTH, generator=g) * scale
    hidden[3] = weight[70_000] * 40  # its argmax is the tied pair 1000 / 70000
    hidden[4] = weight[6] * 40  # ... the near-tied pair 5 / 6
    full = head.full(hidden)
    limit = VOCAB - 280  # a padded head: the last ids are no token
    banned = [None if r % 3 == 0 else np.sort(rng.choice(VOCAB, int(rng.integers(1, 30_000)), replace=False))
              for r in range(rows)]
    banned[3] = banned[4] = None  # the tie rows keep every id
    banned[7] = np.array([int(full[7].argmax())])  # the row's own maximum banned
    cands, fallback = head.screen.candidates(hidden, banned, limit)
    assert not fallback
    for r in range(rows):
        want = full_argmax(full[r], banned[r], limit)
        assert want in set(cands[r].tolist()), f"row {r}"
        kept = cands[r]
        assert (kept < limit).all() and (banned[r] is None or not np.isin(kept, banned[r]).any())
    assert {1000, 70_000} <= set(cands[3].tolist()) and {5, 6} <= set(cands[4].tolist())
    assert np.mean([c.size for c in cands]) < 2000, "the screen should keep few ids"


def test_rows_it_cannot_answer_for_get_the_full_head(head):
    hidden = torch.randn(3, WIDTH)
    hidden[1, 0] = float("nan")
    everything = np.arange(VOCAB, dtype=np.int64)
    cands, fallback = head.screen.candidates(hidden, [None, None, everything])
    assert fallback == {1, 2} and cands[1] is None and cands[2] is None and cands[0] is not None


def test_keys_order_like_the_values():
    bits = np.arange(-32768, 32768, dtype=np.int64).astype(np.int16)
    values = torch.from_numpy(bits.copy()).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(values) | np.isinf(values)
    keys = _keys(bits.copy())[finite].astype(np.int64)
    values = values[finite]
    order = np.argsort(keys, kind="stable")
    assert (np.diff(values[order]) >= 0).all()


def test_a_screen_that_misses_is_refused(weight, monkeypatch):
    if not GreedyScreen.available(weight, None):
        untestable_here(NO_SCREEN)
    monkeypatch.setattr(greedy_head, "SCREEN_MARGIN", -1.0)  # keeps nothing
    assert LmHead.create(weight).screen is None
    assert not GreedyScreen.available(weight, torch.zeros(VOCAB))  # a biased head is not screened


CASES = [
    pytest.param(dict(ignore_eos=False), {}, id="greedy"),
    pytest.param(dict(ignore_eos=True), {"ban_eos": True}, id="greedy-eos-banned"),
]


@pytest.mark.parametrize("opts, shape", CASES)
def test_same_tokens_as_the_full_head_through_the_sampler(head, weight, opts, shape):
    rows = 10
    rng = np.random.default_rng(3)
    hidden = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(3)) * 4
    full = head.full(hidden)
    plan = RowPlan()
    greedy = {}
    for i in range(rows):
        plan.sample.append(i)
        if i % 3 == 1:  # inside a JSON string: a disallowed list
            plan.masked.append((i, SparseMask(False, np.sort(rng.choice(VOCAB, 20_000, replace=False)))))
        elif i % 3 == 2:  # an allowed list
            plan.masked.append((i, SparseMask(True, np.sort(rng.choice(VOCAB, 300, replace=False)))))
        elif shape.get("ban_eos"):
            plan.ban_eos.append(i)
        greedy[i] = np.array([EOS]) if i in plan.ban_eos else None
    chosen = head_plan(plan.sample, plan.masked, VOCAB, partial=True, greedy=greedy)
    assert chosen is not None and chosen.full_rows.size == 0 and len(chosen.screened) == 7
    sparse = SparseHead(head, max_rows=rows)
    logits = sparse.logits(hidden, chosen.ids, chosen.full_rows, chosen.screened, chosen.vocab_limit)
    assert bool(torch.isneginf(logits).any(dim=1).all()), "every row should be sparse"
    bitmask = torch.zeros((rows, words_for_vocab(VOCAB)), dtype=torch.int32)
    options = SamplingOptions.validated(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop=(),
                                        default_max_tokens=16, max_max_tokens=64, **opts)

    def draw(x):
        p = RowPlan(list(plan.sample), list(plan.masked), list(plan.ban_eos))
        return StepSampler(VOCAB, [EOS], bitmask, bitmask).sample(x.clone(), p, [RowSampler(options)] * rows)

    assert draw(logits) == draw(full)


def test_screenable_rows_join_a_full_head_that_runs_anyway():
    allow = SparseMask(True, np.arange(10))
    masked = [(0, allow), (1, None), (2, SparseMask(False, np.arange(5))), (3, allow), (4, allow)]
    # Row 1's dense mask needs the float32 head: rows 2 and 5 (unconstrained) join it instead of a screen.
    plan = head_plan(range(6), masked, VOCAB, partial=True, greedy={2: None, 5: None})
    assert plan.full_rows.tolist() == [1, 2, 5] and plan.screened == ()
    plan = head_plan(range(6), [m for m in masked if m[0] != 1] + [(1, allow)], VOCAB, partial=True,
                     greedy={2: None, 5: np.array([EOS])})
    assert plan.full_rows.size == 0 and [r for r, _ in plan.screened] == [2, 5]
    assert plan.screened[0][1].tolist() == list(range(5)) and plan.screened[1][1].tolist() == [EOS]


def bf16_bits(values) -> np.ndarray:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().copy()


@pytest.mark.parametrize("rows, bound, raw", [
    pytest.param([[0.5, 2.0, -3.0], [1.0, 4.0, 0.0]], [0.1, 0.2], True, id="positive-thresholds-raw-bits"),
    pytest.param([[0.5, 2.0, -3.0], [-1.0, -4.0, -0.5]], [0.1, 0.2], False, id="a-negative-maximum"),
    pytest.param([[0.5, 2.0, -3.0], [1.0, 4.0, 0.0]], [0.1, 3.0], False, id="a-threshold-below-zero"),
])
def test_raw_bits_only_where_every_threshold_is_positive(rows, bound, raw):
    bits = bf16_bits(rows)
    keys, threshold = GreedyScreen._raw_thresholds(bits, np.array(bound))
    assert (keys is not None) == raw
    if raw:
        values = np.array(rows)
        kept = keys >= threshold[:, None]
        want = values >= (values.max(axis=1) - 2 * np.array(bound))[:, None]
        assert (kept >= want).all(), "every id above the threshold must be kept"
        assert (threshold >= 0).all()  # never EXCLUDED_BITS (-1)


def test_a_dense_row_is_screened_with_the_ids_its_bitmask_disallows(head):
    from inference_svc.model.head.sparse_head import disallowed_ids

    rng = np.random.default_rng(11)
    words = words_for_vocab(VOCAB)
    bitmask = rng.integers(-2**31, 2**31, words).astype(np.int32)
    banned = disallowed_ids(bitmask, VOCAB)
    allowed = np.setdiff1d(np.arange(VOCAB), banned)
    # The same ids as the decoder's reading of the row: bit j of word w is id 32w + j.
    assert all(bool((int(bitmask[t // 32]) >> (t % 32)) & 1) for t in allowed[:200])
    assert not any(bool((int(bitmask[t // 32]) >> (t % 32)) & 1) for t in banned[:200])
    plan = head_plan([0, 1], [(0, None), (1, SparseMask(True, np.arange(10)))], VOCAB, partial=True,
                     greedy={0: banned})
    assert plan.full_rows.size == 0 and plan.screened[0][0] == 0
    assert head_plan([0, 1], [(0, None)], VOCAB, partial=True, greedy={0: None}) is None, \
        "a dense row without its disallowed ids cannot be screened"
    hidden = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(11)) * 5
    full = head.full(hidden)
    logits = SparseHead(head, 4).logits(hidden, plan.ids, plan.full_rows, plan.screened, VOCAB)
    row = full[0].clone()
    row[torch.from_numpy(banned)] = float("-inf")
    kept = logits[0].clone()
    kept[torch.from_numpy(banned)] = float("-inf")
    assert int(kept.argmax()) == int(row.argmax())


@pytest.mark.parametrize("argv, env, want", [
    pytest.param([], {}, True, id="default-on"),
    pytest.param(["--greedy-head", "off"], {}, False, id="flag"),
    pytest.param([], {"STRUCTD_INFERENCE_GREEDY_HEAD": "off"}, False, id="env"),
])
def test_greedy_head_flag(argv, env, want):
    assert inference_config(argv, env).engine.greedy_head is want
