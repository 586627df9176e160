"""Whole-block copies between the engine's KV cache and the CPU pool's slab.

The cache is block-major (``[num_blocks, L, 2, T, H, D]``), so a block is one contiguous
region, and so is a slot of the slab: a block moves as one copy. Runs of consecutive
block ids that go to (or come from) consecutive slots move as one larger copy.

On CUDA the copies are asynchronous DMA on side streams, ordered by events:

- ``offload_stream`` first waits for an event recorded on the compute stream, so it reads
  a block only after the forward that wrote it; its ``copied`` event tells when the slots
  hold the bytes (and the engine may reuse the blocks).
- ``restore_stream`` writes blocks the engine does not use until the ``copied`` event of
  the restore has completed (the connector reports a load only then).

Nothing here synchronizes the device; :meth:`Copy.done` only queries an event. On the CPU
a copy is a memcpy done in the calling thread, finished when the call returns.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class Copy:
    """One batch of block copies in flight."""

    def __init__(self, copied: torch.cuda.Event | None = None) -> None:
        self._copied = copied

    def done(self) -> bool:
        return self._copied is None or self._copied.query()

    def wait(self) -> None:
        """Block this thread (not the device) until the copies are complete."""
        if self._copied is not None:
            self._copied.synchronize()


class BlockMover:
    """Copies blocks between ``kv_cache`` (``[num_blocks, L, 2, T, H, D]``) and ``slab``
    (``[num_slots, block_nbytes]`` uint8 host memory, pinned for CUDA).

    :meth:`offload` is called by the engine thread; :meth:`restore` by any thread.
    """

    def __init__(self, kv_cache: torch.Tensor, slab: torch.Tensor) -> None:
        block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        if not kv_cache[0].is_contiguous() or kv_cache.stride(0) * kv_cache.element_size() != block_nbytes:
            raise ValueError("the KV cache must be block-major with contiguous blocks")
        if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != block_nbytes:
            raise ValueError(
                f"slab must be [num_slots, {block_nbytes}] uint8, got {slab.dtype}{list(slab.shape)}"
            )
        self.device = kv_cache.device
        self.blocks = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)  # [num_blocks, nbytes]
        self.slab = slab
        self.offload_stream: torch.cuda.Stream | None = None
        self.restore_stream: torch.cuda.Stream | None = None
        if kv_cache.is_cuda:
            self.offload_stream = torch.cuda.Stream(self.device)
            self.restore_stream = torch.cuda.Stream(self.device)

    def offload(self, pairs: Sequence[tuple[int, int]]) -> Copy:
        """Copy block ``b`` into slot ``s`` for each ``(b, s)``, after the work queued so far
        on the current (compute) stream."""
        if self.offload_stream is None:
            for b, s, n in _runs(pairs):
                self.slab[s : s + n].copy_(self.blocks[b : b + n])
            return Copy()
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            self.offload_stream.wait_event(written)
            for b, s, n in _runs(pairs):
                self.slab[s : s + n].copy_(self.blocks[b : b + n], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.offload_stream)
        return Copy(copied)

    def restore(self, pairs: Sequence[tuple[int, int]]) -> Copy:
        """Copy slot ``s`` into block ``b`` for each ``(b, s)``."""
        if self.restore_stream is None:
            for b, s, n in _runs(pairs):
                self.blocks[b : b + n].copy_(self.slab[s : s + n])
            return Copy()
        with torch.cuda.stream(self.restore_stream):
            for b, s, n in _runs(pairs):
                self.blocks[b : b + n].copy_(self.slab[s : s + n], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.restore_stream)
        return Copy(copied)


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(block, slot)`` pairs as ``(first block, first slot, length)`` runs in which both
    indices go up by one."""
    runs: list[tuple[int, int, int]] = []
    for b, s in pairs:
        if runs:
            b0, s0, n = runs[-1]
            if b == b0 + n and s == s0 + n:
                runs[-1] = (b0, s0, n + 1)
                continue
        runs.append((b, s, 1))
    return runs
