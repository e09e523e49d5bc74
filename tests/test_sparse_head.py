"""The LM head at the allowed ids only (and the partial head): which steps qualify, and the same draws and
logprobs as the full head.

A real (tiny, random-weight) embedded model on the 129k vocabulary: its body
runs once per case, then the step is sampled twice with identically seeded
samplers, from the full head and from the sparse one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from inference_svc.engine.sampling import RowSampler, SamplingOptions
from inference_svc.model.head.sparse_head import MAX_SPARSE_IDS, head_plan
from inference_svc.engine.step_sampler import RowPlan, StepSampler
from shared.codec import SparseMask, words_for_vocab

TINY = EmbeddedModelSpec(name="sparse-head-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
VOCAB = 129_280
EOS = 1
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model, _ = load_model(ensure_embedded_model(tmp_path_factory.mktemp("sparse-head"), TINY, progress=None), "cpu")
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, 4)
    return PagedModelRunner(model, PagedKVCache(spec, 256))


_step_count = [0]


def body(runner: PagedModelRunner, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, full forward logits) of a fresh step of `rows` sequences with random prompts."""
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for r in range(rows):
        _step_count[0] += 1
        seq = f"s{_step_count[0]}"
        n = 1 + r % 5
        runner.block_manager.allocate(seq, n)
        chunks.append(SequenceChunk(seq, tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()), 0))
    batch = StepBatch.of(chunks)
    hidden = runner.forward_body(batch)
    for c in chunks:
        runner.block_manager.free(c.seq_id)
        runner.block_manager.allocate(c.seq_id, len(c.token_ids))
    full = runner.forward(batch)
    for c in chunks:
        runner.block_manager.free(c.seq_id)
    return hidden, full


def allowed(rng: np.random.Generator, n: int) -> SparseMask:
    return SparseMask(True, np.sort(rng.choice(VOCAB, n, replace=False)).astype(np.int64))


def options(**kw) -> SamplingOptions:
    base = dict(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=7, stop=(), ignore_eos=False,
                default_max_tokens=16, max_max_tokens=64)
    base.update(kw)
    return SamplingOptions.validated(**base)


def draw(sampler: StepSampler, logits: torch.Tensor, plan: RowPlan, opts: list[SamplingOptions]):
    plan = RowPlan(list(plan.sample), list(plan.masked), list(plan.ban_eos), dict(plan.forced),
                   list(plan.penalties), list(plan.before_min_tokens))
    return sampler.sample(logits.clone(), plan, [RowSampler(o) for o in (opts[i] for i in plan.sample)])


def test_body_then_head_is_the_forward(runner):
    hidden, full = body(runner, 6, seed=1)
    assert torch.equal(runner.head(hidden), full)


def test_sparse_head_is_the_full_head_at_its_ids_and_minus_inf_elsewhere(runner):
    rng = np.random.default_rng(0)
    hidden, full = body(runner, 5, seed=2)
    for n in (3000, 40):  # the second call reuses the buffer the first wrote
        ids = allowed(rng, n).ids
        logits = runner.sparse_head(hidden, ids)
        assert torch.equal(logits[:, ids], full[:, ids])
        rest = np.setdiff1d(np.arange(VOCAB), ids)
        assert bool(torch.isneginf(logits[:, rest]).all())


CASES = [
    pytest.param(dict(), {}, id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9), {}, id="temperature+top_p"),
    pytest.param(dict(temperature=1.3, top_k=20), {}, id="temperature+top_k"),
    pytest.param(dict(temperature=1.0, repetition_penalty=1.7), {"penalties": True}, id="penalties"),
    pytest.param(dict(temperature=0.7, logprobs=True, top_logprobs=5), {}, id="logprobs-sampled"),
    pytest.param(dict(logprobs=True, top_logprobs=20), {}, id="logprobs-greedy"),
    pytest.param(dict(temperature=1.0, min_tokens=4), {"before_min_tokens": True, "eos": True},
                 id="min_tokens-eos-ban"),
    pytest.param(dict(temperature=1.0), {"forced": True}, id="forced-rows"),
]
# Rows that need every logit (the partial head computes them in full): a disallowed-id list, a dense mask,
# an unconstrained row.
FULL_ROWS = {2: "disallowed", 5: "dense", 6: "unconstrained"}


def step_plan(rng: np.random.Generator, rows: int, shape: dict, bitmask: torch.Tensor, partial: bool) -> RowPlan:
    plan = RowPlan()
    forced = {1, 4} if shape.get("forced") else set()
    for i in range(rows):
        if i in forced:
            plan.forced[i] = [5, 6]
            continue
        plan.sample.append(i)
        kind = FULL_ROWS.get(i) if partial else None
        if kind == "disallowed":
            plan.masked.append((i, SparseMask(False, allowed(rng, 20_000).ids)))
        elif kind == "dense":
            bits = torch.from_numpy(rng.integers(-2**31, 2**31, bitmask.shape[1]).astype(np.int32))
            bitmask[i] = bits
            plan.masked.append((i, None))
        elif kind is None:
            mask = allowed(rng, int(rng.integers(1, 600)))
            if shape.get("eos"):
                mask = SparseMask(True, np.union1d(mask.ids, [EOS]).astype(np.int64))
            plan.masked.append((i, mask))
        if shape.get("penalties"):
            plan.penalties.append((i, rng.choice(VOCAB, 300, replace=False).astype(np.int64), 1.7))
        if shape.get("before_min_tokens"):
            plan.before_min_tokens.append(i)
    return plan


@pytest.mark.parametrize("partial", [pytest.param(False, id="sparse"), pytest.param(True, id="partial")])
@pytest.mark.parametrize("opts, shape", CASES)
def test_same_draws_and_logprobs_as_the_full_head(runner, opts, shape, partial):
    rows = 8
    if partial:
        assert runner.partial_head, "the CPU's oneDNN head should have independent rows"
    rng = np.random.default_rng(abs(hash(str(opts))) % 2**32)
    hidden, full = body(runner, rows, seed=3)
    bitmask = torch.zeros((rows, words_for_vocab(VOCAB)), dtype=torch.int32)
    plan = step_plan(rng, rows, shape, bitmask, partial)
    chosen = head_plan(plan.sample, plan.masked, VOCAB, partial=partial)
    assert chosen is not None and chosen.ids.size <= MAX_SPARSE_IDS
    assert chosen.full_rows.tolist() == (sorted(FULL_ROWS) if partial else [])
    sampler = StepSampler(VOCAB, [EOS], bitmask, bitmask)
    per_row = [options(**opts)] * rows
    want = draw(sampler, full, plan, per_row)
    got = draw(sampler, runner.sparse_head(hidden, chosen.ids, chosen.full_rows), plan, per_row)
    assert got == want
    assert all(not isinstance(t, Exception) for t in got)


def test_the_buffer_forgets_the_last_steps_full_rows_and_columns(runner):
    hidden, full = body(runner, 4, seed=9)
    rng = np.random.default_rng(9)
    first = allowed(rng, 50).ids
    runner.sparse_head(hidden, first, np.array([1, 3]))
    second = allowed(rng, 40).ids
    logits = runner.sparse_head(hidden, second, np.array([0]))
    assert torch.equal(logits[0], full[0])
    assert torch.equal(logits[1:, second], full[1:, second])
    rest = np.setdiff1d(np.arange(VOCAB), second)
    assert bool(torch.isneginf(logits[1:, rest]).all())


def test_a_step_with_no_row_to_sample_needs_no_head():
    chosen = head_plan([], [], VOCAB)
    assert chosen is not None and chosen.ids.size == 0 and chosen.full_rows.size == 0


ALLOW = SparseMask(True, np.arange(10))
DISALLOW = SparseMask(False, np.arange(10))


@pytest.mark.parametrize("masks, partial, full_rows", [
    pytest.param([ALLOW, None], False, None, id="dense-mask"),
    pytest.param([ALLOW, DISALLOW], False, None, id="disallow-list"),
    pytest.param([ALLOW, "unconstrained"], False, None, id="unconstrained"),
    pytest.param([SparseMask(True, np.arange(0, 2 * MAX_SPARSE_IDS, 2)),
                  SparseMask(True, np.arange(1, 2 * MAX_SPARSE_IDS, 2))], False, None, id="union-too-big"),
    pytest.param([ALLOW, DISALLOW], True, [1], id="partial-half"),
    pytest.param([ALLOW, None, "unconstrained", ALLOW, ALLOW], True, [1, 2], id="partial-two-of-five"),
    pytest.param([ALLOW, None, "unconstrained"], True, None, id="partial-most-rows-need-all"),
    pytest.param(["unconstrained"], True, None, id="partial-one-row-needs-all"),
    pytest.param([SparseMask(True, np.arange(0, 2 * MAX_SPARSE_IDS, 2)), DISALLOW,
                  SparseMask(True, np.arange(1, 2 * MAX_SPARSE_IDS, 2))], True, None, id="partial-union-too-big"),
])
def test_which_steps_get_the_full_head(masks, partial, full_rows):
    masked = [(i, m) for i, m in enumerate(masks) if not isinstance(m, str)]
    chosen = head_plan(list(range(len(masks))), masked, VOCAB, partial=partial)
    if full_rows is None:
        assert chosen is None
    else:
        assert chosen.full_rows.tolist() == full_rows and chosen.ids.tolist() == list(range(10))


def test_union_at_the_limit_qualifies():
    masks = [(0, SparseMask(True, np.arange(0, MAX_SPARSE_IDS, 2))), (1, SparseMask(True, np.arange(1, MAX_SPARSE_IDS, 2)))]
    assert head_plan([0, 1], masks, VOCAB).ids.tolist() == list(range(MAX_SPARSE_IDS))
