"""The LM head's kernels: the column form bitwise the full head, the packed kernel the model's own head; the flag.

At the embedded model's head shape (129,280 x 256): the CPU's kernels are
picked by shape, so narrow column counts and one row are where a column form
could round differently from the full head (lm_head.py).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.head.lm_head import LmHead, PackedKernel, PlainKernel
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.head.sparse_head import SparseHead
from tests.conftest import inference_config, untestable_here

VOCAB = 129_280
WIDTH = 256
# The packed kernel is the default head (--lm-head-kernel auto) where oneDNN is: a CI runner without it fails here.
NO_PACKED = "this torch has no oneDNN: the default --lm-head-kernel auto (packed) head cannot be tested on it"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weight():
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0)) / 16


KERNELS = [pytest.param(PlainKernel, id="plain"), pytest.param(PackedKernel, id="onednn_packed")]


def ids_of(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.sort(rng.choice(VOCAB, n, replace=False)).astype(np.int64)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 32])
def test_every_column_count_is_bitwise_the_full_head(weight, kernel, rows):
    if kernel is PackedKernel and not PackedKernel.available(weight):
        untestable_here(NO_PACKED)
    head = LmHead(kernel(weight, None), exact_columns=True)
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, WIDTH, generator=g)
    full = head.full(hidden)
    rng = np.random.default_rng(rows)
    sparse = SparseHead(head, max_rows=rows)
    for width in (1, 2, 3, 7, 9, 15, 17, 31, 33, 63, 65, 129, 1000, 4097):
        ids = ids_of(rng, width)
        assert torch.equal(head.columns(hidden, torch.from_numpy(ids)), full[:, ids]), f"{width} columns"
        assert torch.equal(sparse.logits(hidden, ids)[:, ids], full[:, ids]), f"{width} columns, sparse head"


def test_packed_kernel_is_the_plain_head_to_rounding_and_does_not_depend_on_the_batch(weight):
    if not PackedKernel.available(weight):
        untestable_here(NO_PACKED)
    packed, plain = PackedKernel(weight, None), PlainKernel(weight, None)
    hidden = torch.randn(24, WIDTH, generator=torch.Generator().manual_seed(3))
    full = packed.full(hidden)
    torch.testing.assert_close(full, plain.full(hidden), rtol=1e-5, atol=1e-5)
    # A row's logits are the same whichever batch it is in: the draw does not depend on the load.
    for rows in (1, 5, 24):
        assert torch.equal(packed.full(hidden[:rows].contiguous()), full[:rows])


def test_bias_is_added_in_both_forms(weight):
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    head = LmHead.create(weight, bias)
    hidden = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(5))
    full = head.full(hidden)
    torch.testing.assert_close(full, torch.nn.functional.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)
    ids = torch.from_numpy(ids_of(np.random.default_rng(6), 300))
    assert torch.equal(head.columns(hidden, ids), full[:, ids])


def test_create_picks_the_packed_kernel_on_a_cpu_with_onednn(weight):
    head = LmHead.create(weight)
    assert head.exact_columns
    assert head.name == ("onednn_packed" if PackedKernel.available(weight) else "plain")
    # The partial head needs it; the start-up check found it on the CPUs measured (MKL's rows depend on
    # the row count, so the plain head's answer is the machine's).
    assert head.rows_independent or head.name == "plain"
    assert LmHead.create(weight, packed=False).name == "plain"


def test_a_head_whose_rows_depend_on_each_other_computes_no_partial_head(weight):
    head = LmHead(PlainKernel(weight, None), exact_columns=True, rows_independent=False)
    sparse = SparseHead(head, max_rows=4)
    hidden = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(8))
    ids = ids_of(np.random.default_rng(8), 10)
    sparse.logits(hidden, ids)  # columns alone are fine
    with pytest.raises(ValueError, match="depend on each other"):
        sparse.logits(hidden, ids, np.array([1]))


class _RoundsColumnsDifferently(PlainKernel):
    name = "broken"

    def columns(self, hidden, cols):
        return super().columns(hidden, cols) + 1e-3


def test_a_kernel_whose_columns_differ_is_refused(weight, monkeypatch):
    # The start-up check, not a promise about the CPU: a kernel failing it is never used for columns.
    import inference_svc.model.head.lm_head as lm_head

    monkeypatch.setattr(lm_head, "PackedKernel", _RoundsColumnsDifferently)
    monkeypatch.setattr(_RoundsColumnsDifferently, "available", staticmethod(lambda w: True), raising=False)
    head = LmHead.create(weight)
    assert head.name == "plain" and head.exact_columns
    monkeypatch.setattr(lm_head, "PlainKernel", _RoundsColumnsDifferently)
    head = LmHead.create(weight)
    assert not head.exact_columns
    with pytest.raises(RuntimeError, match="no exact column form"):
        head.columns(torch.zeros(1, WIDTH), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="no exact column form"):
        SparseHead(head, max_rows=4)


TINY = EmbeddedModelSpec(name="lm-head-tiny", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("lm-head-model"), TINY, progress=None)


@pytest.mark.parametrize("packed, want", [
    pytest.param(True, "onednn_packed", id="auto"),
    pytest.param(False, "plain", id="plain"),
])
def test_runner_computes_the_models_head_with_the_chosen_kernel(tiny_model_dir, packed, want):
    model, _ = load_model(tiny_model_dir, "cpu")
    if packed and not PackedKernel.available(model.get_output_embeddings().weight):
        untestable_here(NO_PACKED)
    # The model's own forward (its lm_head module, F.linear), before the runner takes the model over.
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1:].float()
    runner = PagedModelRunner.create(model, block_size=4, num_blocks=64, packed_head=packed)
    assert runner.lm_head.name == want and runner.splits_head
    runner.block_manager.allocate("a", 3)
    logits = runner.forward(StepBatch.of([SequenceChunk("a", (5, 6, 7), 0)]))
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_a_tensor_parallel_runner_leaves_the_head_to_the_model(tiny_model_dir):
    # A sharded head gathers its output in its own hooks: the runner must not compute it from the local shard.
    model, _ = load_model(tiny_model_dir, "cpu")
    runner = PagedModelRunner.create(model, block_size=4, num_blocks=64, tp_size=2)
    assert runner.lm_head is None and not runner.splits_head


@pytest.mark.parametrize("argv, env, want", [
    pytest.param([], {}, "auto", id="default"),
    pytest.param(["--lm-head-kernel", "plain"], {}, "plain", id="flag"),
    pytest.param([], {"STRUCTD_INFERENCE_LM_HEAD_KERNEL": "plain"}, "plain", id="env"),
])
def test_lm_head_kernel_flag(argv, env, want):
    assert inference_config(argv, env).lm_head_kernel == want


def test_unknown_lm_head_kernel_is_refused():
    with pytest.raises(SystemExit, match="--lm-head-kernel onednn: use auto, plain"):
        inference_config(["--lm-head-kernel", "onednn"])
