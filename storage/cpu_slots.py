"""What a slot of the host-memory pool (:class:`storage.cpu_pool.CpuBlockPool`) holds and
hands out: the block copied out (:class:`HostBlock`), the block held in its slot
(:class:`SlotBlock`), blocks committed into reserved slots (:class:`Commit`, or as columns
:class:`Commits`), and the
pool's own record of a visible block (:class:`SlotEntry`), and a writer's pending blocks
(:class:`TakenBlocks`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

import torch

from storage.base import BlockKey
from storage.priority_lru import DEFAULT_PRIORITY


@dataclasses.dataclass(frozen=True)
class HostBlock:
    """One KV block in host memory. ``kv`` is ``[L, 2, T, H, D]`` in the engine's KV dtype."""

    kv: torch.Tensor
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclasses.dataclass(slots=True)
class SlotEntry:
    """A visible block, as the pool files it; only the pool touches it, under its lock."""

    slot: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    pending: set[str]
    readers: int = 0
    taken: set[str] = dataclasses.field(default_factory=set)  # tiers writing it right now
    priority: int = DEFAULT_PRIORITY


class Commit(NamedTuple):
    """A block filled into a reserved slot, for :meth:`CpuBlockPool.commit_many`."""

    key: BlockKey
    slot: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    pending: Collection[str] = ()  # the lower tiers it still has to reach
    priority: int = DEFAULT_PRIORITY


class Commits(NamedTuple):
    """Blocks filled into reserved slots, as columns (one entry a block in each), for
    :meth:`CpuBlockPool.commit_many`: what :class:`Commit` holds, without an object a
    block."""

    keys: Sequence[BlockKey]
    slots: Sequence[int]
    parent_hashes: Sequence[bytes | None]
    token_ids: Sequence[tuple[int, ...]]
    pending: Sequence[Collection[str]]
    priorities: Sequence[int]

    @classmethod
    def of(cls, commits: Iterable[Commit]) -> Commits:
        columns = [list(column) for column in zip(*commits)]
        return cls(*columns) if columns else cls([], [], [], [], [], [])


class SlotBlock(NamedTuple):
    """A block held in its slot: ``kv`` is a view of slot ``slot``, valid until the holder
    lets go (:meth:`CpuBlockPool.release`, or :meth:`CpuBlockPool.done_pending` for a
    writer); ``None`` from ``take_pending(views=False)``, whose caller reads the slot's row
    of :attr:`CpuBlockPool.slab` itself. (A tuple: a writer takes one a block it writes.)"""

    key: BlockKey
    slot: int
    kv: torch.Tensor | None
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    priority: int = DEFAULT_PRIORITY  # the block's, for the tiers it is written to


class TakenBlocks(NamedTuple):
    """Blocks a writer took (:meth:`CpuBlockPool.take_pending_columns`), as columns: one
    entry a block in each list. Each block is held until the writer lets go of it
    (:meth:`CpuBlockPool.done_pending`); its stage payload is its slot's row of
    :attr:`CpuBlockPool.slab`."""

    keys: list[BlockKey]
    slots: list[int]
    parent_hashes: list[bytes | None]
    token_ids: list[tuple[int, ...]]
    priorities: list[int]
