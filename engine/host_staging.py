"""Host values on their way to the device.

On CUDA a copy from pageable host memory is synchronous: it waits for everything queued on
the stream before it (a forward launched a step ahead included), so a step whose inputs
crossed that way could not be prepared while the GPU ran the step before. Here values cross
through pinned memory in asynchronous copies instead; the caching host allocator keeps a
pinned buffer from being reused until the copy that reads it has run. On the CPU nothing is
copied at all.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# bytes: each array starts where any dtype may be viewed, and where Triton takes a pointer
# as 16-byte aligned (it compiles a kernel per alignment of its pointer arguments)
_ALIGN = 16


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on ``device``."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` as tensors on ``device``, with their dtypes and shapes. On CUDA they are
    packed into one pinned buffer and cross in one asynchronous copy, each a view of the
    device buffer, 16-byte aligned; on the CPU each tensor shares its array's memory."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]  # no copy on the CPU
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    packed = host.numpy()
    for a, offset in zip(arrays, offsets):
        packed[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    moved = host.to(device, non_blocking=True)
    return [
        moved[offset : offset + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
        for a, offset in zip(arrays, offsets)
    ]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
