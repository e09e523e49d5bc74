"""One host-to-device copy for a step's small index tensors.

A step's plan is about ten int64 tensors of a few hundred entries each (positions, slots, block tables, the
paged kernel's indices, the input ids). Copied one by one, each was a blocking copy the host waited for before
it could launch the next kernel; packed into one pinned buffer and copied without blocking, the host goes on to
the forward's launches while they land, as vLLM's input batch does with its pinned CPU mirrors. On CPU the
tensors are used where they are.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device | str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU tensors (one dtype) on `device`: on CPU themselves, elsewhere views of one tensor copied at once."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensors  # already there: packing would only add a copy to the host's step
    return packed_copy(device, *tensors)


def packed_copy(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor, of its own shape, as a view of one tensor copied to `device` at once.

    On CUDA the staging buffer is pinned and the copy does not block: the caching host allocator keeps the
    buffer from reuse until the copy has run, and the forward that reads the views is queued behind it on the
    same stream.
    """
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        raise TypeError(f"packed_copy packs one dtype: got {sorted({str(t.dtype) for t in tensors})}")
    pinned = device.type == "cuda"
    sizes = [t.numel() for t in tensors]
    packed = torch.empty(sum(sizes), dtype=dtype, pin_memory=pinned)
    torch.cat([t.reshape(-1) for t in tensors], out=packed)
    moved = packed.to(device, non_blocking=pinned)
    return tuple(part.view(t.shape) for part, t in zip(moved.split(sizes), tensors))
