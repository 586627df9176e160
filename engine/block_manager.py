"""The pool of KV blocks: reference counts, the prefix cache and the LRU free queue.

A block is *free* when no sequence references it. Free blocks wait in an LRU queue (oldest
first) and, when they hold a full block whose hash is registered, stay findable by that
hash until the queue hands them out again (lazy eviction, as in vLLM): only then is the
hash dropped and the eviction reported. A hit on a free block takes it back out of the
queue, so the queue is the LRU order of unreferenced blocks.

A hit needs both the chained hash and the block's token ids to match: the hash finds the
block, the token check guarantees it holds what the sequence needs.

A *hold* is a reference that belongs to no sequence: the engine holds a block while the
connector's save still reads it. A held block stays out of the free queue (and, if cached,
findable by its hash) until it is released.

Sliding windows. When *every* layer of the model sees only the last ``kv_window`` tokens
(``ModelConfig.kv_window``), a sequence's blocks that lie wholly before the window of its
next token are never read again: :meth:`BlockManager.allocate` gives them back and puts
:data:`NULL_BLOCK` in their place in the block table, so a long chat holds at most
``(kv_window - 1) // block_size + 2`` blocks while it decodes. Block 0 is then reserved
as that placeholder (never handed out, never read: the attention starts at the window).
A given-back block keeps its hash and stays findable: its KV is still exactly that of its
tokens, and a prefix hit is a run of leading blocks that ends in the hitting sequence's
window, so everything a hit is used for is there. Models with any full-attention layer
keep all blocks (see docs/engine.md).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence as Seq

import numpy as np

from engine.kv_events import KVEventLog
from engine.sequence import Sequence

NULL_BLOCK = 0  # with a kv_window: stands in for a sequence's given-back blocks
KEPT_HIT_MIN_BLOCKS = 16  # a shorter prefix-cache hit is not kept on its request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set only while registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out the blocks of one KV cache. Single-threaded: the engine thread owns it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[list[bytes]], None] | None = None,
        events: KVEventLog | None = None,
        kv_window: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block id
        # [num_blocks] bumped when a block's cached content goes (the block is reused): a
        # hit kept on a request holds as far as its blocks' versions are unchanged
        self._versions = np.zeros(num_blocks, dtype=np.int64)
        self._holds: Counter[int] = Counter()  # block id -> holds on it (part of its ref_count)
        self._on_evict = on_evict
        self._events = events  # KV events for routers: blocks cached and evicted
        if kv_window is not None and (kv_window < 1 or num_blocks < 2):
            raise ValueError(f"need kv_window >= 1 and 2 or more blocks, got {kv_window}, {num_blocks}")
        self.kv_window = kv_window
        if kv_window is not None:
            del self._free[NULL_BLOCK]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence or hold references (not the reserved :data:`NULL_BLOCK`)."""
        return len(self.blocks) - len(self._free) - (self.kv_window is not None)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_held_blocks(self) -> int:
        return len(self._holds)

    @property
    def num_held_only_blocks(self) -> int:
        """Held blocks that no sequence uses: they become free when released."""
        return sum(1 for b, n in self._holds.items() if self.blocks[b].ref_count == n)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def find_cached_prefix(self, seq: Sequence, max_blocks: int) -> list[int]:
        """Block ids of the longest run of ``seq``'s leading full blocks in the prefix cache.

        A request that waits for blocks is looked up again at every step, and checking a
        block's token ids costs ~1 µs (2 ms a step for a 32K-token hit). So the run found
        last time is kept on the request (``seq.prefix_hit``) with its blocks' versions: the
        part of it whose blocks have not been reused since still holds, and only the blocks
        after that part are looked at."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        hit: list[int] = []
        kept = seq.prefix_hit
        if kept is not None:
            ids, versions = kept
            n = min(len(ids), max_blocks)
            changed = np.flatnonzero(self._versions[ids[:n]] != versions[:n])
            hit = ids[: int(changed[0]) if len(changed) else n].tolist()
        found = len(hit)
        hashes = seq.block_hash_chain(max_blocks * self.block_size)
        for i in range(found, min(len(hashes), max_blocks)):
            block_id = self._cached.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hit.append(block_id)
        if len(hit) < KEPT_HIT_MIN_BLOCKS:  # checked again faster than kept
            seq.prefix_hit = None
        elif kept is None or len(hit) != found or found != len(kept[0]):
            ids = np.array(hit, dtype=np.int64)
            seq.prefix_hit = (ids, self._versions[ids])
        return hit

    def num_blocks_to_allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> int:
        """Free-queue entries that :meth:`allocate` would take (new blocks + reclaimed hits)."""
        new = -(-num_tokens // self.block_size) - len(seq.block_table) - len(prefix)
        reclaimed = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        return max(new, 0) + reclaimed

    def num_blocks_to_grow(self, seqs: Seq[Sequence]) -> int:
        """New blocks ``seqs`` need for all their tokens: :meth:`num_blocks_to_allocate` of
        each at its length, without a prefix (one pass: it runs over every running sequence
        at each step that a request waits)."""
        bs = self.block_size
        return sum(max(-(-len(s.token_ids) // bs) - len(s.block_table), 0) for s in seqs)

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> bool:
        return self.num_blocks_to_allocate(seq, num_tokens, prefix) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens; False (and no change but
        :meth:`free_out_of_window`, which runs first) if short.

        ``prefix``: cached block ids (from :meth:`find_cached_prefix`) to share first; only
        for a sequence that holds no blocks yet.
        """
        if prefix and seq.block_table:
            raise ValueError("a cached prefix can only start an empty block table")
        if self.kv_window is not None:
            self.free_out_of_window(seq)
        elif not prefix and num_tokens <= len(seq.block_table) * self.block_size:
            return True  # most decode steps: the last block has room
        if not self.can_allocate(seq, num_tokens, prefix):
            return False
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table.extend(prefix)
        evicted: list[bytes] = []
        take = self._take_free
        num_new = -(-num_tokens // self.block_size) - len(seq.block_table)
        if num_new == 1:
            seq.block_table.append(take(evicted))
        elif num_new > 1:
            # The least recently used blocks, as always, but in the order of their ids: a
            # freed sequence's blocks return to the queue last block first, and taken as they
            # come they would run backwards. In order, consecutive blocks go to consecutive
            # slots of the CPU pool as one copy each way (offload and restore), not one each.
            seq.block_table.extend(sorted([take(evicted) for _ in range(num_new)]))
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        if evicted and self._events is not None:
            self._events.removed(evicted)
        return True

    def free_out_of_window(self, seq: Sequence) -> int:
        """Give back ``seq``'s blocks that lie wholly before the window of its next token
        (position ``num_computed_tokens``); how many. Called by :meth:`allocate`, so
        whatever else happens in that call, these blocks are never read again::

            positions: | block 0 | block 1 | block 2 | block 3 |
                                      |<---- kv_window ---->|
                                      first = p - kv_window + 1   p = num_computed_tokens
            given back: blocks 0 .. first // block_size - 1
        """
        if self.kv_window is None:
            return 0
        first = max(0, seq.num_computed_tokens - self.kv_window + 1)
        table = seq.block_table
        i = min(first // self.block_size, len(table)) - 1
        if i < 0 or table[i] == NULL_BLOCK:  # earlier ones went in earlier calls
            return 0
        # a new list: a table list only ever grows in place (engine.decode_inputs mirrors it)
        seq.block_table = table = list(table)
        freed = 0
        while i >= 0 and table[i] != NULL_BLOCK:
            self._unref(table[i])
            table[i] = NULL_BLOCK
            freed += 1
            i -= 1
        return freed

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its last blocks become the first to be reused."""
        for block_id in reversed(seq.block_table):
            if self._is_null(block_id):
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []

    def hold(self, block_ids: Seq[int]) -> None:
        """Take a reference on each block that keeps it from reuse until :meth:`release`."""
        holds, blocks = self._holds, self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            holds[block_id] = holds.get(block_id, 0) + 1  # not +=: Counter's __missing__ is Python

    def release(self, block_ids: Seq[int]) -> None:
        """Drop holds taken by :meth:`hold`. A block left unreferenced joins the free queue's
        tail, still findable by its hash; ``block_ids`` in a chain's order (a sequence's
        saves) join it last to first, as :meth:`free` gives them back, so that the chain's
        tail is reused first and its cached prefix is not cut at its head. Raises
        ``ValueError`` (changing nothing) for a block not held that many times."""
        holds, blocks = self._holds, self.blocks
        for block_id, count in Counter(block_ids).items():
            if holds.get(block_id, 0) < count:
                raise ValueError(f"block {block_id} is released more often than it is held")
        for block_id in reversed(block_ids):
            left = holds[block_id] - 1
            if left:
                holds[block_id] = left
            else:
                del holds[block_id]
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Register ``seq``'s full blocks ``start..end-1`` (computed, hashed) in the prefix cache.

        Returns the indices of the blocks whose hash was new to the cache (a block whose
        hash another block already holds stays unregistered and is simply reused when freed).
        With prefix caching off nothing is registered and every index is returned.
        """
        hashes = seq.block_hash_chain(end * self.block_size)
        if not self.enable_prefix_caching:
            return list(range(start, end))
        new: list[int] = []
        for i in range(start, end):
            block_hash = hashes[i]
            if block_hash in self._cached or self._is_null(seq.block_table[i]):
                continue
            block = self.blocks[seq.block_table[i]]
            block.block_hash = block_hash
            block.token_ids = tuple(seq.block_tokens(i))
            self._cached[block_hash] = block.block_id
            new.append(i)
        if self._events is not None:
            self._log_stored(seq, hashes, new)
        return new

    def _log_stored(self, seq: Sequence, hashes: Seq[bytes], new: list[int]) -> None:
        """One event per run of consecutive newly cached blocks of ``seq``."""
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            tokens = [t for i in run for t in seq.block_tokens(i)]
            parent = hashes[run[0] - 1] if run[0] else None
            self._events.stored([hashes[i] for i in run], parent, tokens)

    def _is_null(self, block_id: int) -> bool:
        return self.kv_window is not None and block_id == NULL_BLOCK

    def _take_free(self, evicted: list[bytes]) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._versions[block_id] += 1
            evicted.append(block.block_hash)
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id
