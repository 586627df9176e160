"""The KV connector: the engine's one hook for KV that lives outside its block pool.

The engine runs without a connector (plain prefix caching in GPU memory). With one, it
also asks the connector for prompt blocks it does not hold, lets it fill them, hands it
every block that becomes full, and tells it which cached blocks it evicts. Blocks are
named by their chained hashes (:mod:`engine.hashing`) under the namespace given to
:meth:`KVConnector.register_kv_cache`.

Threading: the engine calls every method from its one engine thread, never concurrently.
A connector may run its own threads; it must not touch the KV cache outside the calls
below (writes only inside :meth:`KVConnector.load_blocks`, reads only inside
:meth:`KVConnector.save_blocks`), because the engine reuses blocks as soon as a call returns.

Order of calls for one request::

    get_num_matched_blocks -> (blocks allocated) -> load_blocks -> ... steps ...
        -> save_blocks (per step, for blocks that became full) -> request_finished
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class SavedBlock:
    """A block that became full (and was written) in the step that just ran."""

    block_hash: bytes
    parent_hash: bytes | None  # None for a sequence's first block
    token_ids: tuple[int, ...]
    block_id: int  # index into the KV cache's block dimension
    is_prompt: bool  # all of its tokens are prompt tokens (not generated ones)


class KVConnector(abc.ABC):
    """What a KV connector must do. Subclass it and pass an instance as ``kv_connector``."""

    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        """Called once, before any request, with the engine's whole KV cache.

        ``kv_cache`` is ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``; block ``b`` is
        ``kv_cache[:, :, b]``. It stays valid until :meth:`close`. ``namespace`` is the
        32-byte digest of everything that makes these KV bytes compatible (model, KV dtype
        and fp8 scales, block size, layout): keys from another namespace must never be used.
        """

    @abc.abstractmethod
    def get_num_matched_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int:
        """How many blocks, following the ``num_computed_blocks`` the engine already holds,
        the connector can supply consecutively.

        ``block_hashes`` is the chain of all the request's full blocks. The answer counts from
        ``block_hashes[num_computed_blocks]`` on and stops at the first missing block. The
        engine may use fewer (it always computes at least the last prompt token itself).
        Should be quick: it runs while the engine schedules a step.
        """

    @abc.abstractmethod
    def load_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> bool:
        """Write the KV of ``block_hashes[i]`` into GPU block ``block_ids[i]``, for every i.

        Synchronous: the data must be in place (copies complete or ordered on the current
        stream) when this returns. Return False on any failure; the engine then treats all
        these blocks as not computed and recomputes them, so a partial write is harmless.
        Only after True are the blocks marked computed and entered in the prefix cache.
        The engine calls this while scheduling the step that admits the request, so the
        load time adds to that one step; other requests are not held up beyond it.
        """

    @abc.abstractmethod
    def save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        """Offered after each step: the blocks that became full and were written in it.

        The connector must copy what it wants during this call (or enqueue a copy ordered on
        the current stream): the engine may overwrite the block in any later step. Blocks
        are given in chain order per request; ``is_prompt`` lets a connector keep prompt
        blocks only. A block whose hash is already in the engine's prefix cache (for
        example, it was loaded from this connector) is not offered again.
        """

    @abc.abstractmethod
    def on_blocks_evicted(self, block_hashes: Sequence[bytes]) -> None:
        """These blocks left the engine's prefix cache (their GPU blocks are being reused)."""

    @abc.abstractmethod
    def request_finished(self, request_id: str) -> None:
        """The request finished or was aborted; per-request state may be dropped."""

    @abc.abstractmethod
    def close(self) -> None:
        """The engine shuts down; the KV cache tensor is no longer valid after this returns."""
