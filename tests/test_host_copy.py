"""host_copy: a step's index tensors cross to the device as views of one copy, each its own shape and values
(packed_copy to CPU here; tests/test_cuda_paths.py's paged-runner cases run the pinned, non-blocking copy on a
GPU), and stay as they are on CPU."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.host_copy import packed_copy, to_device


@pytest.mark.parametrize("shapes", [
    pytest.param([(5,), (2, 3), (0,), (1, 1), (4,)], id="vectors-table-and-empty"),
    pytest.param([(7,)], id="one"),
])
def test_each_tensor_comes_back_whole_as_a_view_of_one_copy(shapes):
    tensors = [torch.randint(-1, 1000, shape, dtype=torch.long) for shape in shapes]
    moved = packed_copy(torch.device("cpu"), *tensors)
    assert len(moved) == len(tensors)
    for got, want in zip(moved, tensors):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        assert got.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1
    # A copy: the caller's tensors may change afterwards without reaching what was shipped.
    tensors[0].fill_(-7)
    assert not torch.equal(moved[0], tensors[0]) or tensors[0].numel() == 0


def test_mixed_dtypes_are_refused():
    with pytest.raises(TypeError, match="one dtype"):
        packed_copy(torch.device("cpu"), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32))


def test_on_cpu_the_tensors_are_used_where_they_are():
    tensors = (torch.arange(3), torch.zeros(2, 2, dtype=torch.long))
    assert all(a is b for a, b in zip(to_device("cpu", *tensors), tensors))
