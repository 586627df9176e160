"""The KV connector: the engine's one hook for KV that lives outside its block pool.

The engine runs without a connector (plain prefix caching in GPU memory). With one, it
also asks the connector for prompt blocks it does not hold, lets it fill them, hands it
every block that becomes full, and tells it which cached blocks it evicts. Blocks are
named by their chained hashes (:mod:`engine.hashing`) under the namespace given to
:meth:`KVConnector.register_kv_cache`.

Both directions are asynchronous, so the engine thread never waits on a lower tier:

- **Loads.** :meth:`KVConnector.start_load` only starts a load. The request waits in a
  loading state, holding the blocks it was given, while other requests keep stepping.
  The engine learns from :meth:`KVConnector.poll` how many of the blocks are in place; it
  marks those computed and schedules the request.
- **Saves.** :meth:`KVConnector.save_blocks` only starts the copies. The engine holds each
  offered block (it is not freed for reuse) until :meth:`KVConnector.poll` reports it in
  ``saved``, so a copy never reads a block that a later step overwrites.

Threading: the engine calls every method from its one engine thread, never concurrently.
A connector may run its own threads. It may write a block only between ``start_load`` and
the ``poll`` that reports that load, and read a block only between ``save_blocks`` and the
``poll`` that reports it saved. On CUDA, what ``poll`` reports must be complete on the
device (an event that has completed), so the engine needs no synchronize.

Order of calls for one request::

    get_num_matched_blocks -> (blocks allocated) -> start_load -> poll ... poll (loaded)
        -> steps, with save_blocks for blocks that became full -> request_finished

A connector that cannot start a save at once (its buffer is full of data not yet written
below) may keep the offered block held while it waits; when the engine runs short of blocks
it calls :meth:`KVConnector.release_held`, and the connector gives such saves up.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class SavedBlock:
    """A block that became full (and was written) in the step that just ran."""

    block_hash: bytes
    parent_hash: bytes | None  # None for a sequence's first block
    token_ids: tuple[int, ...]
    block_id: int  # index into the KV cache's block dimension
    is_prompt: bool  # all of its tokens are prompt tokens (not generated ones)
    cache_salt: str | None = None  # the request's tenant, for the tiers' eviction order


@dataclasses.dataclass(frozen=True)
class FinishedTransfers:
    """What the connector finished since the previous :meth:`KVConnector.poll`.

    ``loaded``: request id -> how many leading blocks of its :meth:`~KVConnector.start_load`
    are now in the KV cache (fewer than asked when a block could not be served: the engine
    recomputes the rest). Every ``start_load`` is reported exactly once.
    ``saved``: block ids whose save no longer reads them (copied, or given up). Every block
    id offered to :meth:`~KVConnector.save_blocks` is reported exactly once.
    """

    loaded: Mapping[str, int] = dataclasses.field(default_factory=dict)
    saved: Sequence[int] = ()

    @property
    def is_empty(self) -> bool:
        return not self.loaded and not self.saved


class KVConnector(abc.ABC):
    """What a KV connector must do. Subclass it and pass an instance as ``kv_connector``."""

    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        """Called once, before any request, with the engine's whole KV cache.

        ``kv_cache`` is block-major, ``[num_blocks, L, 2, block_size, kv_heads, head_dim]``:
        block ``b`` is ``kv_cache[b]``, one contiguous region. It stays valid until
        :meth:`close`. ``namespace`` is the 32-byte digest of everything that makes these
        KV bytes compatible (model, KV dtype and fp8 scales, block size, layout): keys from
        another namespace must never be used.
        """

    @abc.abstractmethod
    def get_num_matched_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int | None:
        """How many blocks, following the ``num_computed_blocks`` the engine already holds,
        the connector can supply consecutively; ``None`` if it does not know yet.

        ``block_hashes`` is the chain of all the request's full blocks. The answer counts from
        ``block_hashes[num_computed_blocks]`` on and stops at the first missing block. The
        engine may use fewer (it always computes at least the last prompt token itself).
        Must be quick (index lookups, no reads of block data): it runs while the engine
        schedules a step. A lookup that needs the network runs elsewhere: answer ``None``
        meanwhile, and the engine leaves the request waiting, schedules the ones behind
        it, and asks again at a later step (after a :meth:`poll` with a timeout, which a
        connector may end early when the lookup completes).
        """

    @abc.abstractmethod
    def start_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        cache_salt: str | None = None,
    ) -> None:
        """Start writing the KV of ``block_hashes[i]`` into block ``block_ids[i]``, for every i.
        ``cache_salt`` is the request's tenant (its hashes already cover it), for the tiers'
        eviction order of what the load brings up.

        Returns at once; the blocks belong to the connector until :meth:`poll` reports
        ``request_id`` in ``loaded``. Blocks past the reported count may hold anything:
        the engine recomputes them. Only the reported blocks are marked computed and
        entered in the prefix cache.

        A forward queued before this call may still write these blocks (they may have been
        freed under it: a request aborted mid-prefill). On a GPU, order the writes after the
        work queued on the current stream when this is called (an event recorded here).
        """

    def estimate_load_seconds(self, request_id: str, num_blocks: int) -> float | None:
        """Expected seconds to load the first ``num_blocks`` of the blocks the last
        :meth:`get_num_matched_blocks` matched for ``request_id``; ``None`` (the default)
        if unknown. With an estimate, an engine that has nothing else to run recomputes
        the head of a long hit while the rest loads (the ``start_load`` then names the
        tail only), so that a slow tier and the GPU share the work."""
        return None

    @abc.abstractmethod
    def save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        """Offered after each step: the blocks that became full and were written in it.

        Returns at once. The engine does not reuse these blocks until :meth:`poll`
        reports them in ``saved``. Blocks are given in chain order per request;
        ``is_prompt`` lets a connector keep prompt blocks only. A block whose hash is
        already in the engine's prefix cache (for example, it was loaded from this
        connector) is not offered again.

        It takes every block, or raises having taken none. A block taken is reported by
        :meth:`poll` exactly once, copied or given up; so once one block is taken
        (reported, waiting or copying), a step that fails must give the rest up (report
        them) rather than raise. If it raises, the engine logs it and lets go of every
        block of the call at once, so a connector that raises must neither read those
        blocks nor report any of them later: by then a block may be reused and held for a
        newer save, whose hold such a report would drop while that save still reads it.
        """

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> FinishedTransfers:
        """The loads and saves finished since the last call. Waits up to ``timeout``
        seconds for at least one when there is none yet (the engine waits only when it
        has nothing else to run)."""

    def release_held(self) -> None:
        """The engine is short of blocks while some are held for saves: let go of the saves
        that have not started copying (report them in ``saved`` at the next :meth:`poll`)
        rather than keep them waiting. Called only then, from the engine thread; saves
        already copying finish as usual. The default does nothing."""

    @abc.abstractmethod
    def on_blocks_evicted(self, block_hashes: Sequence[bytes]) -> None:
        """These blocks left the engine's prefix cache (their GPU blocks are being reused)."""

    @abc.abstractmethod
    def request_finished(self, request_id: str) -> None:
        """The request finished or was aborted; per-request state may be dropped. A load
        still running for it is still reported by :meth:`poll`."""

    @abc.abstractmethod
    def close(self) -> None:
        """The engine shuts down; the KV cache tensor is no longer valid after this returns.
        Transfers still running are finished or abandoned before it returns."""
