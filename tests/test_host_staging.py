"""Host arrays moved to the device (engine/host_staging.py): one packed asynchronous copy on
CUDA, each array back with its dtype, shape and values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM
from engine.host_staging import to_device, upload


def arrays() -> list[np.ndarray]:
    """Mixed dtypes and sizes, so that packing needs padding between them."""
    return [
        np.array([0, 3, 7], dtype=np.int32),  # 12 bytes: the next starts 4 bytes later
        np.arange(15, dtype=np.int32).reshape(3, 5),
        np.array([2**40, -1, 5], dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        np.array([1.5, -2.25], dtype=np.float32),
        np.arange(6, dtype=np.int64)[::2],  # not contiguous
    ]


def check(moved: list[torch.Tensor], device: torch.device) -> None:
    expected = arrays()
    assert len(moved) == len(expected)
    for tensor, array in zip(moved, expected):
        assert tensor.device.type == device.type
        assert tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
        assert tuple(tensor.shape) == array.shape and tensor.is_contiguous()
        assert tensor.cpu().numpy().tolist() == array.tolist()


def test_on_the_cpu_each_array_comes_back_as_it_was():
    check(upload(arrays(), torch.device("cpu")), torch.device("cpu"))


def test_to_device_on_the_cpu():
    t = to_device([3, 1, 2], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [3, 1, 2]


@pytest.mark.cuda
def test_on_a_gpu_the_arrays_cross_in_one_copy_that_does_not_wait_for_queued_work():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a long kernel queued before the copy (~1 s)
    moved = upload(arrays(), device)
    assert not torch.cuda.current_stream().query()  # upload returned while it still runs
    torch.cuda.synchronize()
    check(moved, device)
    # Triton compiles a kernel per alignment of its pointers: every array starts 16-aligned
    assert all(t.data_ptr() % 16 == 0 for t in moved)
    # the pinned buffer is not reused before its copy ran: with both copies still queued
    # behind a kernel, the second upload's values do not reach the first's
    torch.cuda._sleep(1_000_000_000)
    first = upload([np.full(1000, 7, dtype=np.int64)], device)[0]
    upload([np.full(1000, 9, dtype=np.int64)], device)
    torch.cuda.synchronize()
    assert first.eq(7).all()


def test_a_prepared_batch_keeps_the_dtypes_the_kernels_take():
    with LLM(max_model_len=64, num_gpu_blocks_override=16, device="cpu") as llm:
        batch = llm.engine.model_runner.prepare(
            [[5, 6, 7, 8, 9], [1, 2]], [2, 0], [3, 2], [[4], [9]], [1, 2]
        )
    meta = batch.meta
    assert batch.input_ids.tolist() == [7, 8, 9, 1, 2] and batch.input_ids.dtype == torch.int64
    assert batch.positions.tolist() == [2, 3, 4, 0, 1] and batch.positions.dtype == torch.int64
    assert batch.logits_indices.tolist() == [2, 3, 4] and batch.logits_indices.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 3, 5] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 2] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[4], [9]] and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [66, 67, 68, 144, 145]
    assert meta.slot_mapping.dtype == torch.int64
