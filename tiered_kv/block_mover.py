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

A slot holds a block in the form of the codec's tensor stage (:attr:`Codec.stage`): the
block's own bytes for ``raw`` (and ``zstd``, whose byte stage runs on the host later), or
its KIVI payload for ``kivi2``/``kivi4``. KIVI blocks are quantized on the engine's device
before the copy and dequantized there after it, so the lossy codecs also cut the bytes
that cross PCIe and the pool holds 2.9x (kivi4) to 4.6x (kivi2) more blocks. That takes a
device staging area per direction (:data:`STAGING_BYTES` of blocks, and their payloads): a
batch moves in chunks that fit it. On CUDA the stage's kernels run once on a zeroed block
when the mover is built, so they compile at start-up rather than in the first offload::

    offload:  cache ─ index_select ─▶ staged blocks ─ encode ─▶ payloads ─ DMA ─▶ slots
    restore:  slots ─ DMA ─▶ payloads ─ decode ─▶ staged blocks ─ index_copy ─▶ cache

Nothing here synchronizes the device; :meth:`Copy.done` only queries an event (a batch
that fails part-way waits for its own stream before it raises). On the CPU
a raw copy is a memcpy in the calling thread, finished when the call returns; an offload
that transcodes runs on the mover's own thread (the CPU stands in for the offload stream),
so the engine thread never runs a codec, and its :class:`Copy` is done when that work is.
A restore runs in the calling thread (a load worker), transcoding or not.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

from storage.codecs.base import TensorCodec
from storage.codecs.raw import RawCodec

STAGING_BYTES = 32 << 20  # device staging per direction for a transcoding stage
# Raw blocks on CUDA through the staging area too: a gather (or scatter) on the device and
# one DMA per run of slots, instead of one DMA per run of (block, slot) pairs. Scattered
# block ids make many short runs, each a DMA call; with consecutive slots the staged path
# makes one. ``benchmarks/gpu_tiers.py`` measures both on a GPU.
STAGE_RAW_COPIES = False


class Copy:
    """One batch of block copies in flight: behind a CUDA event, or a host thread's work."""

    def __init__(
        self,
        copied: torch.cuda.Event | None = None,
        running: concurrent.futures.Future[None] | None = None,
    ) -> None:
        self._copied = copied
        self._running = running

    def done(self) -> bool:
        if self._running is not None:
            return self._running.done()
        return self._copied is None or self._copied.query()

    def wait(self) -> None:
        """Block this thread (not the device) until the copies are complete; re-raises what
        made a host copy fail."""
        if self._running is not None:
            self._running.result()
        elif self._copied is not None:
            self._copied.synchronize()


class BlockMover:
    """Copies blocks between ``kv_cache`` (``[num_blocks, L, 2, T, H, D]``) and ``slab``
    (``[num_slots, slot_nbytes]`` uint8 host memory, pinned for CUDA), each slot holding a
    block in ``stage``'s form (default: raw bytes). ``staged``: raw copies go through the
    device staging area too (default: :data:`STAGE_RAW_COPIES` on CUDA).

    :meth:`offload` is called by the engine thread; :meth:`restore` by any thread.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        slab: torch.Tensor,
        stage: TensorCodec | None = None,
        *,
        staged: bool | None = None,
    ) -> None:
        block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        if not kv_cache[0].is_contiguous() or kv_cache.stride(0) * kv_cache.element_size() != block_nbytes:
            raise ValueError("the KV cache must be block-major with contiguous blocks")
        self.stage = stage = stage or RawCodec()
        self.block_shape = tuple(kv_cache.shape[1:])
        self.slot_nbytes = stage.payload_size(kv_cache.dtype, self.block_shape)
        if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != self.slot_nbytes:
            raise ValueError(
                f"slab must be [num_slots, {self.slot_nbytes}] uint8, got {slab.dtype}{list(slab.shape)}"
            )
        self.transcodes = stage.name != "raw"
        # copies through the device staging area (a transcoding stage needs it)
        if staged is None:
            staged = STAGE_RAW_COPIES and kv_cache.is_cuda
        self.staged = self.transcodes or staged
        self.device = kv_cache.device
        self.cache = kv_cache
        self.cache_dtype = kv_cache.dtype
        self.blocks = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)  # [num_blocks, nbytes]
        self.slab = slab
        self.offload_stream: torch.cuda.Stream | None = None
        self.restore_stream: torch.cuda.Stream | None = None
        if kv_cache.is_cuda:
            self.offload_stream = torch.cuda.Stream(self.device)
            self.restore_stream = torch.cuda.Stream(self.device)
        if self.staged:
            self._chunk = max(1, STAGING_BYTES // block_nbytes)
            self._out = _Staging(self._chunk, kv_cache, self.slot_nbytes, self.transcodes)
            self._in = _Staging(self._chunk, kv_cache, self.slot_nbytes, self.transcodes)
            self._out_lock, self._in_lock = threading.Lock(), threading.Lock()
        if self.transcodes and self.offload_stream is not None:
            self._warm_up()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        if self.transcodes and self.offload_stream is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tiered-kv-offload"
            )

    def _warm_up(self) -> None:
        """Run the stage's device kernels once on one (zeroed) staged block, so that they are
        compiled at start-up rather than by the first offload on the engine thread (and the
        first restore on a load worker)."""
        with torch.cuda.stream(self.offload_stream):
            block, payload = self._out.blocks[:1].zero_(), self._out.payloads[:1]
            self.stage.encode_blocks(block, payload)
            self.stage.decode_blocks(payload, block)
        self.offload_stream.synchronize()

    @property
    def asynchronous(self) -> bool:
        """Whether an offload's :class:`Copy` may still be running when it is returned."""
        return self.offload_stream is not None or self._thread is not None

    def close(self) -> None:
        """Finish the offloads in flight, stop the mover's thread (if it has one) and let go
        of the KV cache, the slab and the staging areas, so that closing the engine gives
        their memory back whoever still holds the mover."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self.offload_stream is not None:
            self.offload_stream.synchronize()
            self.restore_stream.synchronize()
        self.cache = self.blocks = self.slab = None
        if self.staged:
            self._out = self._in = None

    @property
    def slot_dtype(self) -> torch.dtype:
        """The dtype a slot is viewed as (with :attr:`slot_shape`)."""
        return torch.uint8 if self.transcodes else self.cache_dtype

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (self.slot_nbytes,) if self.transcodes else self.block_shape

    def offload(self, pairs: Sequence[tuple[int, int]]) -> Copy:
        """Copy block ``b`` into slot ``s`` for each ``(b, s)``, after the work queued so far
        on the current (compute) stream."""
        if self._thread is not None:
            return Copy(running=self._thread.submit(self._offload, list(pairs)))
        if self.offload_stream is None:
            self._offload(pairs)
            return Copy()
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            self.offload_stream.wait_event(written)
            return _issued(self._offload, pairs, self.offload_stream)

    def fence(self) -> torch.cuda.Event | None:
        """An event past the work queued so far on the current (compute) stream, for a
        :meth:`restore` into blocks that work may still write: blocks freed while a forward
        was in flight (a request aborted mid-prefill) and handed to a load. None without a
        restore stream (copies and forwards are then ordered by the host)."""
        if self.restore_stream is None:
            return None
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        return queued

    def restore(self, pairs: Sequence[tuple[int, int]], after: torch.cuda.Event | None = None) -> Copy:
        """Copy slot ``s`` into block ``b`` for each ``(b, s)``; with ``after`` (a
        :meth:`fence`), once the work before it has run."""
        if self.restore_stream is None:
            self._restore(pairs)
            return Copy()
        with torch.cuda.stream(self.restore_stream):
            if after is not None:
                self.restore_stream.wait_event(after)
            return _issued(self._restore, pairs, self.restore_stream)

    def _offload(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The copies of :meth:`offload`, queued on the current stream."""
        cuda = self.offload_stream is not None
        if not self.staged:
            _move(self.slab, self.blocks, [(s, b, n) for b, s, n in _runs(pairs)], cuda)
            return
        with self._out_lock:  # one user of the staging area at a time; the stream orders the rest
            for chunk in _chunks(pairs, self._chunk):
                n = len(chunk)
                staged, payloads = self._out.blocks[:n], self._out.payloads[:n]
                # gathered as bytes: index_select need not know the KV dtype (fp8)
                ids = self._ids([b for b, _ in chunk])
                torch.index_select(self.blocks, 0, ids, out=self._out.bytes[:n])
                if self.transcodes:  # raw: the gathered bytes are the payloads
                    self.stage.encode_blocks(staged, payloads)
                runs = _runs([(s, i) for i, (_, s) in enumerate(chunk)])
                _move(self.slab, payloads, runs, cuda)

    def _restore(self, pairs: Sequence[tuple[int, int]]) -> None:
        cuda = self.restore_stream is not None
        if not self.staged:
            _move(self.blocks, self.slab, _runs(pairs), cuda)
            return
        with self._in_lock:
            for chunk in _chunks(pairs, self._chunk):
                n = len(chunk)
                staged, payloads = self._in.blocks[:n], self._in.payloads[:n]
                _move(payloads, self.slab, _runs([(i, s) for i, (_, s) in enumerate(chunk)]), cuda)
                if self.transcodes:  # raw: the payloads are the blocks' bytes already
                    self.stage.decode_blocks(payloads, staged)
                if cuda:
                    self.blocks.index_copy_(0, self._ids([b for b, _ in chunk]), self._in.bytes[:n])
                else:  # the CPU's index_copy_ goes element by element: copy rows instead
                    runs = _runs([(b, i) for i, (b, _) in enumerate(chunk)])
                    _move(self.blocks, self._in.bytes, runs, False)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        """``block_ids`` as an index tensor on the device, copied without stalling the host."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)


def _issued(
    issue: Callable[[Sequence[tuple[int, int]]], None],
    pairs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream,
) -> Copy:
    """``issue(pairs)`` queued on ``stream`` (the current stream), behind a ``copied`` event.
    If it raises part-way (out of device memory, a kernel that does not compile), the copies
    queued so far still read or write slots and blocks that the caller gives back on the
    error: wait for them (this stream only) before the error goes on."""
    try:
        issue(pairs)
    except BaseException:
        with contextlib.suppress(Exception):  # a broken stream: the first error is the one
            stream.synchronize()
        raise
    copied = torch.cuda.Event()
    copied.record(stream)
    return Copy(copied)


class _Staging:
    """A device staging area for up to ``count`` blocks (``blocks``, typed, and ``bytes``, the
    same memory as ``[count, block_nbytes]`` uint8) and their stage payloads (for a raw
    stage, the same memory again)."""

    def __init__(self, count: int, kv_cache: torch.Tensor, slot_nbytes: int, transcodes: bool) -> None:
        block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self.bytes = torch.empty((count, block_nbytes), dtype=torch.uint8, device=kv_cache.device)
        self.blocks = self.bytes.view(kv_cache.dtype).view(count, *kv_cache.shape[1:])
        self.payloads = self.bytes
        if transcodes:
            self.payloads = torch.empty((count, slot_nbytes), dtype=torch.uint8, device=kv_cache.device)


def _move(
    dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], cuda: bool
) -> None:
    """``dst[d : d + n] = src[s : s + n]`` for each run ``(d, s, n)`` of rows: DMA queued on
    the current stream on CUDA; on the host a numpy copy, which costs a fraction of a
    torch ``copy_`` per call (it matters for many small blocks) and releases the GIL."""
    if cuda:
        for d, s, n in runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return
    dst_rows, src_rows = dst.numpy(), src.numpy()
    for d, s, n in runs:
        dst_rows[d : d + n] = src_rows[s : s + n]


def _chunks(pairs: Sequence[tuple[int, int]], size: int) -> list[Sequence[tuple[int, int]]]:
    return [pairs[i : i + size] for i in range(0, len(pairs), size)]


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
