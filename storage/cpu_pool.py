"""The host-memory tier: a fixed byte budget of (pinned) CPU memory holding raw KV blocks.

Memory is one slab reserved up front and cut into equal slots, one block per slot, so
that a put or a load is a single contiguous copy and the slab can be pinned once (pinning
is expensive; doing it per block would dominate small copies). The slot size is the
block size of the first block stored, or ``block_nbytes`` if given; blocks of another
size are refused (one pool serves one engine, whose blocks all have the same shape).

Slots are recycled LRU: a put into a full pool evicts the least recently used block,
reporting it to ``on_evict`` (called without the pool's lock held, with a caller-owned
copy, so the callback may write it to a slower tier).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch

from storage.base import BlockKey, BlockStore, StoreStats


@dataclasses.dataclass(frozen=True)
class HostBlock:
    """One KV block in host memory. ``kv`` is ``[L, 2, T, H, D]`` in the engine's KV dtype."""

    kv: torch.Tensor
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclasses.dataclass
class _Entry:
    slot: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    readers: int = 0


def _cuda_available() -> bool:
    return torch.cuda.is_available()


class CpuBlockPool(BlockStore[HostBlock]):
    """LRU pool of raw KV blocks in one (pinned when CUDA is present) host-memory slab.

    Thread-safe. ``get`` returns a copy; :meth:`read_into` copies a block straight into a
    caller's tensor (e.g. a GPU block) and keeps the slot from being reused meanwhile.
    """

    tier = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        block_nbytes: int | None = None,
        pin_memory: bool | None = None,
        on_evict: Callable[[BlockKey, HostBlock], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if block_nbytes is not None and not 0 < block_nbytes <= capacity_bytes:
            raise ValueError(f"block_nbytes must be in (0, {capacity_bytes}], got {block_nbytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = _cuda_available() if pin_memory is None else pin_memory
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._entries: collections.OrderedDict[BlockKey, _Entry] = collections.OrderedDict()
        self._slab: torch.Tensor | None = None  # [num_slots, slot_nbytes] uint8
        self._free: list[int] = []
        self._slot_nbytes = 0
        self._stats = StoreStats(tier=self.tier, capacity_bytes=capacity_bytes)
        self._closed = False
        if block_nbytes is not None:
            self._reserve(block_nbytes)

    @property
    def slot_nbytes(self) -> int:
        return self._slot_nbytes

    @property
    def num_slots(self) -> int:
        return 0 if self._slab is None else self._slab.shape[0]

    def _reserve(self, slot_nbytes: int) -> None:
        num_slots = self.capacity_bytes // slot_nbytes
        self._slab = torch.empty(
            (num_slots, slot_nbytes), dtype=torch.uint8, pin_memory=self.pin_memory
        )
        self._slot_nbytes = slot_nbytes
        self._free = list(range(num_slots - 1, -1, -1))

    def _slot_view(self, entry: _Entry) -> torch.Tensor:
        assert self._slab is not None
        return self._slab[entry.slot].view(entry.dtype).view(entry.shape)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._entries

    def contains_many(self, keys) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def get(self, key: BlockKey) -> HostBlock | None:
        entry = self._acquire(key)
        if entry is None:
            return None
        try:
            kv = self._slot_view(entry).clone()
        finally:
            self._release(entry)
        return HostBlock(kv, entry.parent_hash, entry.token_ids)

    def read_into(self, key: BlockKey, out: torch.Tensor, non_blocking: bool = False) -> bool:
        """Copy the block for ``key`` into ``out`` (same dtype/shape, any device).

        ``False`` on a miss. The slot cannot be reused until the copy has been issued; with
        ``non_blocking=True`` on CUDA the caller must synchronize before the pool can be
        trusted not to overwrite the source, so it is only safe while the caller
        otherwise prevents eviction — prefer the default.
        """
        entry = self._acquire(key)
        if entry is None:
            return False
        try:
            src = self._slot_view(entry)
            if out.dtype != src.dtype or tuple(out.shape) != tuple(src.shape):
                raise ValueError(
                    f"read_into: block is {src.dtype}{list(src.shape)}, "
                    f"out is {out.dtype}{list(out.shape)}"
                )
            out.copy_(src, non_blocking=non_blocking)
        finally:
            self._release(entry)
        return True

    def _acquire(self, key: BlockKey) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            entry.readers += 1
            self._stats.hits += 1
            self._stats.bytes_read += self._slot_nbytes
            return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1
            if entry.readers == 0:
                self._slot_freed.notify_all()

    def put(self, key: BlockKey, value: HostBlock) -> bool:
        key.validate()
        kv = value.kv
        nbytes = kv.numel() * kv.element_size()
        evicted: list[tuple[BlockKey, HostBlock]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("CpuBlockPool is closed")
            if self._slab is None and 0 < nbytes <= self.capacity_bytes:
                self._reserve(nbytes)
            if nbytes != self._slot_nbytes:
                self._stats.dropped += 1
                return False
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            slot = self._take_slot(evicted)
            if slot is None:
                self._stats.dropped += 1
                return False
        # The slot belongs to no entry and is not free, so nobody else touches it while
        # it is filled; the entry becomes visible only once the bytes are in place.
        entry = _Entry(slot, kv.dtype, tuple(kv.shape), value.parent_hash, tuple(value.token_ids))
        self._slot_view(entry).copy_(kv)
        with self._lock:
            if self._closed or key in self._entries:
                if not self._closed:
                    self._free.append(slot)
            else:
                self._entries[key] = entry
                self._stats.puts += 1
                self._stats.bytes_written += nbytes
        for item in evicted:
            self._on_evict(*item)
        return True

    def _take_slot(self, evicted: list[tuple[BlockKey, HostBlock]]) -> int | None:
        """A free slot, evicting the LRU block not being read. Called with the lock held."""
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():
            if entry.readers == 0:
                break
        else:
            return None  # every slot is being copied from or into right now
        del self._entries[key]
        self._stats.evictions += 1
        if self._on_evict is not None:
            kv = self._slot_view(entry).clone()
            evicted.append((key, HostBlock(kv, entry.parent_hash, entry.token_ids)))
        return entry.slot

    def delete(self, key: BlockKey) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            while entry.readers:
                self._slot_freed.wait()
            if self._entries.get(key) is not entry:
                return False
            del self._entries[key]
            self._free.append(entry.slot)
            return True

    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._entries)
        return (k for k in snapshot if namespace is None or k.namespace == namespace)

    def stats(self) -> StoreStats:
        with self._lock:
            self._stats.entries = len(self._entries)
            self._stats.bytes_used = len(self._entries) * self._slot_nbytes
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._free.clear()
            self._slab = None
