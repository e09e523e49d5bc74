"""The LM head's kernels: the column form bitwise the full head, the packed kernel the model's own head.

At the embedded model's head shape (129,280 x 256): the CPU's kernels are
picked by shape, so narrow column counts and one row are where a column form
could round differently from the full head (lm_head.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference_svc.lm_head import LmHead, PackedKernel, PlainKernel
from inference_svc.sparse_head import SparseHead

VOCAB = 129_280
WIDTH = 256
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
        pytest.skip("this torch has no oneDNN")
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
        pytest.skip("this torch has no oneDNN")
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
    assert LmHead.create(weight, packed=False).name == "plain"


class _RoundsColumnsDifferently(PlainKernel):
    name = "broken"

    def columns(self, hidden, cols):
        return super().columns(hidden, cols) + 1e-3


def test_a_kernel_whose_columns_differ_is_refused(weight, monkeypatch):
    # The start-up check, not a promise about the CPU: a kernel failing it is never used for columns.
    import inference_svc.lm_head as lm_head

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
