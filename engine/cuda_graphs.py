"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels; at small batches the GPU waits on Python
between them. A captured graph launches them all at once. A graph replays fixed addresses
and shapes, so everything it reads lives in the static buffers of :class:`DecodeGraphs`,
allocated once for the largest bucket, and a step of ``n`` sequences runs the smallest
bucket ``b >= n`` with rows ``n..b`` padded::

    rows     0 .. n-1             n .. b-1
             the step's tokens    padding: token 0 at position 0, context length 1, whose
                                  K/V go to the scratch block (never handed to the pool)

The attention kernels plan their work on the host from ``seq_lens_cpu``; a graph is
captured with every context at ``max_model_len`` (the longest a replay may see), while the
kernels read each sequence's real length from the ``seq_lens`` buffer.

Without ``capture`` (on the CPU, where there are no graphs) :meth:`DecodeGraphs.run` runs
the same forward on the same buffers eagerly, which is how the buffer handling is tested
off a GPU.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionMetadata

# Batch sizes with a graph: small ones one by one, then every 16 (as vLLM and nano-vllm do).
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 16

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes that get a graph; the last is ``max_num_seqs``."""
    small = [b for b in _SMALL_BUCKETS if b < max_num_seqs]
    large = list(range(_BUCKET_STEP, max_num_seqs, _BUCKET_STEP))
    return tuple(sorted(set(small + large + [max_num_seqs])))


class DecodeGraphs:
    """Static decode inputs and the graphs that read them.

    ``forward(input_ids, positions, kv_cache, meta)`` is the model's forward returning the
    hidden states ``[N, hidden]``; ``kv_cache`` is the whole cache, scratch block included
    (block ``scratch_block``).
    """

    def __init__(
        self,
        forward: Forward,
        kv_cache: torch.Tensor,  # [num_blocks + 1, L, 2, T, H, D]
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        capture: bool,
    ) -> None:
        self.forward = forward
        self.kv_cache = kv_cache
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.capture_seconds = 0.0
        self.num_replays = 0
        device = kv_cache.device
        b, width = self.buckets[-1], -(-max_model_len // block_size)
        pin = device.type == "cuda"
        # Device buffers every graph reads; rows past a step's batch hold padding. The int64
        # ones are the rows of one [3, B] buffer (ids, positions, slots): one copy a step.
        self._device_rows = torch.zeros(3, b, dtype=torch.int64, device=device)  # [3, B]
        self._device_rows[2] = scratch_block * block_size
        self.input_ids, self.positions, self.slot_mapping = self._device_rows  # [B] each
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.full(  # [B, max_blocks]
            (b, width), scratch_block, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # [B+1]
        # Host staging of one step's rows, in the device buffers' layouts.
        self._host_rows = torch.zeros(3, b, dtype=torch.int64, pin_memory=pin)  # [3, B]
        self._host_seq_lens = torch.ones(b, dtype=torch.int32, pin_memory=pin)  # [B]
        self._host_tables = torch.zeros(b, width, dtype=torch.int32, pin_memory=pin)
        # Recorded after a step's copies out of the staging rows: the next step rewrites them
        # only once those copies ran (a caller need not sync between two runs).
        self._rows_copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds ``num_seqs`` sequences (``None``: none does)."""
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool. Each is run
        once before its capture, so that Triton compiles and the rotary tables grow outside
        it. The padding rows write only to the scratch block."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = None
        for b in reversed(self.buckets):
            meta = self._meta(b)
            self.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
            pool = graph.pool()
            self._graphs[b] = graph
            self._outputs[b] = out
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_seconds = time.perf_counter() - start

    def run(
        self,
        input_ids: np.ndarray,  # [n] one token per sequence
        positions: np.ndarray,  # [n] its position (context length - 1)
        slots: np.ndarray,  # [n] the cache slot its K/V go to
        tables: np.ndarray,  # [n, w] int32 block tables, w blocks cover every context
        device_ids: torch.Tensor | None = None,  # [n] on the device: these, not input_ids
    ) -> torch.Tensor:
        """One decode step of ``n <= max_batch`` sequences; the hidden states ``[n, hidden]``.

        The returned tensor is the graph's output buffer: valid until the next run.
        ``device_ids`` (ids sampled on the device, not yet on the host) are copied in on the
        stream, after the staged rows."""
        n, width = tables.shape
        b = self.bucket_for(n)
        if b is None:
            raise ValueError(f"{n} sequences exceed the largest decode graph ({self.max_batch})")
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed max_model_len")
        if self._rows_copied is not None:
            self._rows_copied.synchronize()  # host sync: the last step's copies have read the rows
        rows, seq_lens = self._host_rows.numpy(), self._host_seq_lens.numpy()
        rows[0, :n], rows[1, :n], rows[2, :n], seq_lens[:n] = input_ids, positions, slots, positions + 1
        rows[0, n:b], rows[1, n:b], seq_lens[n:b] = 0, 0, 1
        rows[2, n:b] = self.scratch_block * self.block_size
        # [b, width] packed at the front of the pinned buffer: a contiguous source, so the
        # copy below is one asynchronous DMA (a strided one goes through pageable memory)
        packed = self._host_tables.view(-1)[: b * width].view(b, width)
        host_tables = packed.numpy()
        host_tables[:n] = tables
        host_tables[n:] = self.scratch_block
        # all B columns of the rows: a contiguous source (the rows past b are read by no graph)
        self._device_rows.copy_(self._host_rows, non_blocking=True)
        self.seq_lens[:b].copy_(self._host_seq_lens[:b], non_blocking=True)
        self.block_tables[:b, :width].copy_(packed, non_blocking=True)
        if device_ids is not None:
            self.input_ids[:n].copy_(device_ids, non_blocking=True)
        if self._rows_copied is not None:
            self._rows_copied.record(torch.cuda.current_stream(self.input_ids.device))
        self.num_replays += 1
        if b in self._graphs:
            self._graphs[b].replay()
            return self._outputs[b][:n]
        # No graph: the same buffers, run eagerly with the real host lengths (the torch
        # attention path plans from them).
        meta = self._meta(b, seq_lens[:b].tolist())
        out = self.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
        return out[:n]

    def _meta(self, b: int, seq_lens: list[int] | None = None) -> AttentionMetadata:
        """Bucket ``b``'s metadata: views of the static buffers. For a capture the host
        lengths are at their bound, ``max_model_len``."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            seq_lens_cpu=seq_lens if seq_lens is not None else [self.max_model_len] * b,
            query_lens_cpu=[1] * b,
        )
