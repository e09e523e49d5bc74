"""Model runners: packed paged steps equal plain per-sequence forwards; the simulated runner's contract."""

from __future__ import annotations

import time

import pytest
import torch

from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.paged_kv import KVCacheSpec, OutOfBlocksError, PagedKVCache
from inference_svc.model.simulated_runner import SimulatedRunner

# head_dim 16, 4 query heads over 2 KV heads: the GQA paths are exercised.
TINY = EmbeddedModelSpec(name="runner-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
VOCAB = 129_280
ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("runner-model"), TINY, progress=None)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same weights with transformers' own attention, called one sequence at a time."""
    model, _ = load_model(model_dir, "cpu")
    return model


@pytest.fixture(scope="module")
def paged_model(model_dir):
    model, _ = load_model(model_dir, "cpu")
    return model


def make_runner(model, num_blocks: int = 64, block_size: int = 4) -> PagedModelRunner:
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, block_size)
    return PagedModelRunner(model, PagedKVCache(spec, num_blocks))


def last_logits(reference, tokens: list[int]) -> torch.Tensor:
    # logits_to_keep=1 only spares the LM head the other positions' rows; the forward is the plain one.
    with torch.inference_mode():
        return reference(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]


class Driver:
    """Feeds sequences to a runner step by step and checks every logits row against the reference."""

    def __init__(self, runner: PagedModelRunner, reference, tokens: dict[str, list[int]]):
        self.runner, self.reference, self.tokens = runner, reference, tokens
        self.fed = dict.fromkeys(tokens, 0)

    def step(self, plan: dict[str, int], no_logits: frozenset[str] = frozenset()) -> None:
        blocks = self.runner.block_manager
        chunks = []
        for seq_id, n in plan.items():
            start = self.fed[seq_id]
            if seq_id in blocks:
                blocks.extend(seq_id, n)
            else:
                blocks.allocate(seq_id, n)
            chunks.append(SequenceChunk(seq_id, tuple(self.tokens[seq_id][start : start + n]), start,
                                        needs_logits=seq_id not in no_logits))
            self.fed[seq_id] = start + n
        batch = StepBatch.of(chunks)
        logits = self.runner.forward(batch)
        assert logits.shape == (len(batch.logit_seq_ids), VOCAB) and logits.dtype == torch.float32
        for row, seq_id in enumerate(batch.logit_seq_ids):
            want = last_logits(self.reference, self.tokens[seq_id][: self.fed[seq_id]])
            diff = (logits[row] - want).abs().max().item()
            assert diff < ATOL, f"{seq_id} after {self.fed[seq_id]} tokens: max |diff| {diff}"


def random_tokens(lengths: dict[str, int], seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in lengths.items()}


def test_mixed_packed_steps_equal_per_sequence_forwards(paged_model, reference):
    runner = make_runner(paged_model, block_size=4)
    tokens = random_tokens({"a": 30, "b": 30, "c": 40, "d": 30, "e": 30})
    drive = Driver(runner, reference, tokens)
    # prefills of several lengths, a one-token prompt, and a first prompt chunk without logits
    drive.step({"a": 9, "b": 1, "c": 10, "d": 6}, no_logits=frozenset({"c"}))
    # decode, jump-forward extend, the prompt's last chunk, and a sequence joining mid-flight
    drive.step({"a": 1, "b": 5, "c": 13, "e": 14})
    # extends that cross block boundaries next to single-token decodes
    drive.step({"a": 3, "b": 1, "c": 1, "d": 7, "e": 1})
    for _ in range(3):
        drive.step({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    assert runner.block_manager.num_tokens("c") == 27


def test_freed_blocks_are_reused_without_stale_keys(paged_model, reference):
    runner = make_runner(paged_model, num_blocks=6, block_size=4)
    blocks = runner.block_manager
    tokens = random_tokens({"old": 20, "new": 20}, seed=1)
    drive = Driver(runner, reference, tokens)
    drive.step({"old": 18})
    old_blocks = blocks.block_table("old")
    assert not blocks.can_allocate("new", 8)
    with pytest.raises(OutOfBlocksError):
        blocks.allocate("new", 8)
    blocks.free("old")
    drive.step({"new": 7})
    drive.step({"new": 1})
    drive.step({"new": 4})  # 12 tokens, all in blocks the old sequence wrote
    assert set(blocks.block_table("new")) <= set(old_blocks)


def test_rollback_then_refeed(paged_model, reference):
    """A jump-forward run the grammar rejects is truncated away and other tokens take its slots."""
    runner = make_runner(paged_model, block_size=4)
    blocks = runner.block_manager
    tokens = random_tokens({"s": 12}, seed=2)
    drive = Driver(runner, reference, tokens)
    drive.step({"s": 6})
    blocks.extend("s", 4)
    runner.forward(StepBatch.of([SequenceChunk("s", (11, 12, 13, 14), 6)]))
    blocks.truncate("s", 6)
    drive.step({"s": 3})
    drive.step({"s": 1})


def test_runner_rejects_bad_steps(paged_model):
    runner = make_runner(paged_model)
    runner.block_manager.allocate("s", 2)
    with pytest.raises(ValueError, match="only 2 are reserved"):
        runner.forward(StepBatch.of([SequenceChunk("s", (1, 2, 3), 0)]))
    with pytest.raises(ValueError, match="twice"):
        runner.forward(StepBatch.of([SequenceChunk("s", (1,), 0), SequenceChunk("s", (2,), 1)]))
    with pytest.raises(ValueError, match="empty"):
        runner.forward(StepBatch.of([]))
    with pytest.raises(KeyError):
        runner.forward(StepBatch.of([SequenceChunk("unknown", (1,), 0)]))


def test_model_attached_to_a_runner_needs_its_context(paged_model):
    make_runner(paged_model)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="PagedModelRunner"):
        paged_model(torch.tensor([[1, 2, 3]]))


def test_simulated_runner_shapes_and_step_time():
    runner = SimulatedRunner(step_time_s=0.02, vocab_size=1000, num_blocks=8, block_size=4, pool_rows=4)
    assert runner.vocab_size == 1000 and runner.device == torch.device("cpu")
    blocks = runner.block_manager
    blocks.allocate("a", 5)
    blocks.allocate("b", 1)
    blocks.allocate("c", 2)
    batch = StepBatch.of([SequenceChunk("a", (1, 2, 3, 4, 5), 0), SequenceChunk("b", (7,), 0),
                          SequenceChunk("c", (8, 9), 0, needs_logits=False)])
    started = time.perf_counter()
    logits = runner.forward(batch)
    assert time.perf_counter() - started >= 0.02
    assert logits.shape == (2, 1000) and logits.dtype == torch.float32
    kept = logits.clone()
    following = runner.forward(batch)
    assert torch.equal(logits, kept), "a step's logits must stay valid through the next step's forward"
    logits.fill_(float("-inf"))  # a caller masking in place must not poison later steps
    following.fill_(float("-inf"))
    assert torch.isfinite(runner.forward(batch)).all() and torch.isfinite(runner.forward(batch)).all()
    with pytest.raises(ValueError, match="reserved"):
        runner.forward(StepBatch.of([SequenceChunk("b", (7, 8), 0)]))
