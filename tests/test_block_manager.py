from __future__ import annotations

import random

import pytest

from engine.block_manager import KEPT_HIT_MIN_BLOCKS, BlockManager
from engine_testing import make_seq

BS = 4


def manager(num_blocks: int = 8, **kw) -> tuple[BlockManager, list[list[bytes]]]:
    evictions: list[list[bytes]] = []
    return BlockManager(num_blocks, BS, on_evict=evictions.append, **kw), evictions


def computed(bm: BlockManager, seq, num_tokens: int) -> None:
    """Allocate and mark ``num_tokens`` tokens of ``seq`` computed, as a step would."""
    assert bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.cache_blocks(seq, 0, num_tokens // BS)


def test_allocate_covers_the_tokens_and_free_returns_blocks():
    bm, _ = manager()
    seq = make_seq(range(10), block_size=BS)
    assert bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert bm.allocate(seq, 12)  # still fits in block 2
    assert len(seq.block_table) == 3
    assert bm.allocate(seq, 13)
    assert seq.block_table == [0, 1, 2, 3]
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8


def test_blocks_to_grow_are_each_sequences_blocks_to_allocate_at_its_length():
    bm, _ = manager(num_blocks=16)
    seqs = [make_seq(range(n), f"s{n}", block_size=BS) for n in (1, 4, 5, 9, 13)]
    for seq, have in zip(seqs, (1, 1, 1, 2, 2)):  # blocks held: 0, 0, 1, 1 and 2 short
        assert bm.allocate(seq, have * BS)
    assert bm.num_blocks_to_grow(seqs) == sum(bm.num_blocks_to_allocate(s, s.num_tokens) for s in seqs)
    assert bm.num_blocks_to_grow(seqs) == 0 + 0 + 1 + 1 + 2


def test_allocation_that_does_not_fit_changes_nothing():
    bm, _ = manager(num_blocks=4)
    a, b = make_seq(range(12), "a", block_size=BS), make_seq(range(8), "b", block_size=BS)
    assert bm.allocate(a, 12)
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1


def test_shared_prefix_is_reference_counted():
    bm, _ = manager()
    a = make_seq(range(10), "a", block_size=BS)
    computed(bm, a, 10)
    b = make_seq(list(range(8)) + [99, 98, 97], "b", block_size=BS)
    hit = bm.find_cached_prefix(b, max_blocks=2)
    assert hit == a.block_table[:2]
    assert bm.allocate(b, 11, prefix=hit)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_hit_needs_matching_tokens_not_just_the_hash():
    bm, _ = manager()
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)
    # Simulate a hash collision: the cached block claims other tokens.
    bm.blocks[a.block_table[1]].token_ids = (0, 0, 0, 0)
    b = make_seq(range(9), "b", block_size=BS)
    assert bm.find_cached_prefix(b, max_blocks=2) == a.block_table[:1]


def test_prefix_is_found_only_through_the_chain_and_salt():
    bm, _ = manager()
    computed(bm, make_seq(range(8), "a", block_size=BS), 8)
    same_second_block = make_seq([9, 9, 9, 9, 4, 5, 6, 7, 1], "b", block_size=BS)
    assert bm.find_cached_prefix(same_second_block, 2) == []
    salted = make_seq(range(9), "c", block_size=BS, cache_salt="tenant")
    assert bm.find_cached_prefix(salted, 2) == []
    assert len(bm.find_cached_prefix(make_seq(range(9), "d", block_size=BS), 2)) == 2


def test_freed_blocks_stay_findable_until_reused_in_lru_order():
    bm, evictions = manager(num_blocks=4)
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)  # blocks 0, 1
    bm.free(a)  # free queue: 2, 3, then a's blocks tail first: 1, 0
    assert bm.num_cached_blocks == 2
    b = make_seq(range(100, 109), "b", block_size=BS)
    assert bm.allocate(b, 8)  # takes 2, 3: nothing evicted
    assert evictions == [] and bm.num_cached_blocks == 2
    assert bm.find_cached_prefix(make_seq(range(9), "x", block_size=BS), 2) == [0, 1]
    assert bm.allocate(b, 9)  # takes block 1 (a's tail) first
    assert b.block_table[-1] == 1
    assert evictions == [[a.block_hashes[1]]]
    assert bm.find_cached_prefix(make_seq(range(9), "x", block_size=BS), 2) == [0]


def test_a_waiting_requests_kept_hit_follows_reuse_of_its_blocks():
    """Requests looked up step after step (they wait for blocks) get what a fresh lookup
    would, while others' allocations reuse cached blocks, their hits' among them, and new
    blocks are cached after their hits."""
    rng = random.Random(0)
    bm, _ = manager(num_blocks=72)
    n = 100  # tokens: 25 blocks, past KEPT_HIT_MIN_BLOCKS
    prompts = [list(range(n)), list(range(80)) + [99] * 20, list(range(70)) + [7] * 30]
    waiting = [make_seq(p + [1, 2], f"w{i}", block_size=BS) for i, p in enumerate(prompts)]
    others: list = []
    lengths: list[list[int]] = [[] for _ in waiting]
    for step in range(300):
        if others and rng.random() < 0.4:
            bm.free(others.pop(rng.randrange(len(others))))
        elif len(others) < 4:
            seq = make_seq(rng.choice(prompts)[: rng.randrange(4, n + 1)], block_size=BS)
            if bm.can_allocate(seq, seq.num_tokens):
                computed(bm, seq, seq.num_tokens)
                others.append(seq)
        for w, seen in zip(waiting, lengths):
            hit = bm.find_cached_prefix(w, n // BS)
            assert hit == bm.find_cached_prefix(make_seq(w.token_ids, block_size=BS), n // BS), step
            seen.append(len(hit))
    # hits grew and shrank along the way, long enough to be kept
    assert any(b > a >= KEPT_HIT_MIN_BLOCKS for seen in lengths for a, b in zip(seen, seen[1:]))
    assert any(a > b >= KEPT_HIT_MIN_BLOCKS for seen in lengths for a, b in zip(seen, seen[1:]))


def test_a_kept_hit_is_not_checked_token_by_token_again():
    n = KEPT_HIT_MIN_BLOCKS
    bm, _ = manager(num_blocks=2 * n)
    computed(bm, make_seq(range(n * BS), block_size=BS), n * BS)  # n blocks cached
    waiting = make_seq(list(range(n * BS)) + [5] * 9, "w", block_size=BS)
    assert len(bm.find_cached_prefix(waiting, n + 2)) == n
    checked: list[int] = []
    tokens = waiting.block_tokens
    waiting.block_tokens = lambda i: (checked.append(i), tokens(i))[1]
    assert len(bm.find_cached_prefix(waiting, n + 2)) == n and checked == []


def test_a_hit_takes_the_block_out_of_the_free_queue():
    bm, evictions = manager(num_blocks=3)
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)
    a_blocks = list(a.block_table)
    bm.free(a)
    c = make_seq(range(9), "c", block_size=BS)
    hit = bm.find_cached_prefix(c, 2)
    assert bm.num_blocks_to_allocate(c, 9, hit) == 3  # two reclaimed hits + one new
    assert bm.allocate(c, 9, prefix=hit)
    assert c.block_table[:2] == a_blocks and evictions == []
    assert bm.num_free_blocks == 0


def test_reuse_drops_the_hash_and_reports_each_eviction_once():
    bm, evictions = manager(num_blocks=2)
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)
    bm.free(a)
    b = make_seq(range(50, 58), "b", block_size=BS)
    assert bm.allocate(b, 8)
    assert sorted(evictions[0]) == sorted(a.block_hashes[:2])
    assert bm.num_cached_blocks == 0
    assert all(blk.block_hash is None for blk in bm.blocks)
    bm.free(b)  # b's blocks were never registered: no further notices
    assert bm.allocate(make_seq(range(8), "c", block_size=BS), 8)
    assert len(evictions) == 1


def test_duplicate_content_is_registered_once():
    bm, _ = manager()
    a, b = make_seq(range(8), "a", block_size=BS), make_seq(range(8), "b", block_size=BS)
    assert bm.allocate(a, 8) and bm.allocate(b, 8)
    assert bm.cache_blocks(a, 0, 2) == [0, 1]
    assert bm.cache_blocks(b, 0, 2) == []  # another block already holds these hashes
    assert bm.num_cached_blocks == 2


def test_without_prefix_caching_nothing_is_cached():
    bm, evictions = manager(enable_prefix_caching=False)
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_seq(range(9), "b", block_size=BS), 2) == []
    bm.free(a)
    assert bm.allocate(make_seq(range(32), "c", block_size=BS), 32) and evictions == []


def test_prefix_only_for_an_empty_table():
    bm, _ = manager()
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)
    b = make_seq(range(9), "b", block_size=BS)
    assert bm.allocate(b, 1)
    with pytest.raises(ValueError):
        bm.allocate(b, 9, prefix=a.block_table)


def test_a_held_block_is_not_reused_until_released():
    bm, evictions = manager(num_blocks=3)
    a = make_seq(range(8), "a", block_size=BS)
    computed(bm, a, 8)  # blocks 0, 1
    bm.hold(a.block_table)
    bm.free(a)
    assert (bm.num_free_blocks, bm.num_held_blocks, bm.num_held_only_blocks) == (1, 2, 2)
    assert not bm.allocate(make_seq(range(50, 58), "b", block_size=BS), 8)
    # Held, the blocks are still cached: a hit shares them without touching the free queue.
    c = make_seq(range(9), "c", block_size=BS)
    hit = bm.find_cached_prefix(c, 2)
    assert hit == [0, 1] and bm.num_blocks_to_allocate(c, 9, hit) == 1
    bm.release([0, 1])
    assert (bm.num_free_blocks, bm.num_held_blocks) == (3, 0)
    assert bm.find_cached_prefix(c, 2) == [0, 1]
    # Released blocks join the free queue's tail: block 2 goes first, nothing is evicted.
    d = make_seq(range(50, 54), "d", block_size=BS)
    assert bm.allocate(d, 4) and d.block_table == [2] and evictions == []


def test_a_finished_sequences_saved_blocks_are_reused_tail_first():
    """A request that ends while its blocks are held (saves in flight) gives them back when
    the saves end, as free() does: its last block is reused first, so its cached prefix
    is cut at the tail, not at the head (which would leave no hit at all)."""
    bm, evictions = manager(num_blocks=3)
    a = make_seq(range(12), "a", block_size=BS)
    computed(bm, a, 12)  # blocks 0, 1, 2
    saving = list(a.block_table)
    bm.hold(saving)
    bm.free(a)
    bm.release(saving)
    assert bm.allocate(make_seq(range(50, 54), "b", block_size=BS), 4)
    assert evictions == [[a.block_hashes[2]]]
    assert bm.find_cached_prefix(make_seq(range(12), "c", block_size=BS), 3) == [0, 1]


def test_holds_nest_and_a_bad_release_changes_nothing():
    bm, _ = manager(num_blocks=2)
    bm.hold([0])
    bm.hold([0])
    assert bm.num_free_blocks == 1 and bm.blocks[0].ref_count == 2
    a = make_seq(range(4), "a", block_size=BS)
    assert bm.allocate(a, 4) and a.block_table == [1]
    bm.hold([1])
    assert bm.num_held_only_blocks == 1  # block 1 is also a's
    bm.release([0])
    assert bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="block 1"):
        bm.release([0, 1, 1])
    assert bm.blocks[0].ref_count == 1 and bm.blocks[1].ref_count == 2
    bm.release([0, 1])
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.num_held_blocks == 0


# --- sliding windows --------------------------------------------------------------------


def test_window_gives_back_exactly_the_blocks_before_the_next_tokens_window():
    """kv_window=6, blocks of 4: the token at position p reads p-5..p, so block i is
    needed while i*4+3 >= p-5."""
    from engine.block_manager import NULL_BLOCK

    bm, _ = manager(num_blocks=8, kv_window=6)
    assert bm.num_free_blocks == 7  # block 0 is the placeholder
    seq = make_seq(range(40), block_size=BS)
    computed(bm, seq, 9)  # positions 0..8 in blocks 1, 2, 3
    assert seq.block_table == [1, 2, 3]
    # next token at 9 reads 4..9: block 0 of the sequence (positions 0..3) is not needed
    assert bm.allocate(seq, 10)
    assert seq.block_table == [NULL_BLOCK, 2, 3]
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10  # next token at 10 reads 5..10: block 1 (4..7) still needed
    assert bm.allocate(seq, 11)
    assert seq.block_table == [NULL_BLOCK, 2, 3]
    seq.num_computed_tokens = 14  # reads 9..14: blocks 0 and 1 given back, 2 and 3 kept
    assert bm.allocate(seq, 15)
    assert seq.block_table == [NULL_BLOCK, NULL_BLOCK, 3, 4]
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 7


def test_window_blocks_given_back_stay_in_the_prefix_cache():
    """Their KV is still that of their tokens: another sequence may start on them."""
    bm, _ = manager(num_blocks=8, kv_window=4)
    a = make_seq(range(16), "a", block_size=BS)
    computed(bm, a, 12)
    first_blocks = a.block_table[:2]
    a.num_computed_tokens = 12
    assert bm.allocate(a, 13)  # reads 9..12: blocks 0 and 1 given back
    assert a.block_table[:2] == [0, 0] and bm.num_cached_blocks == 3
    b = make_seq(range(16), "b", block_size=BS)
    hit = bm.find_cached_prefix(b, 3)
    assert hit[:2] == first_blocks and len(hit) == 3
    assert bm.allocate(b, 13, prefix=hit)
    assert b.block_table[:3] == hit


def test_without_a_window_every_block_is_kept():
    bm, _ = manager(num_blocks=8)
    seq = make_seq(range(40), block_size=BS)
    computed(bm, seq, 20)
    assert bm.allocate(seq, 21)
    assert seq.block_table == [0, 1, 2, 3, 4, 5] and bm.num_free_blocks == 2


def test_blocks_taken_together_are_the_least_recently_used_in_the_order_of_their_ids():
    """A freed sequence's blocks return to the queue last block first. A new sequence that
    takes several at once gets the same (least recently used) blocks, evicted tail first
    as before, but in ascending order: consecutive blocks then meet consecutive CPU-pool
    slots, and move as one copy."""
    bm, evictions = manager(num_blocks=8)
    a = make_seq(range(16), "a", block_size=BS)
    computed(bm, a, 16)  # blocks 0..3
    bm.free(a)  # the queue: 4, 5, 6, 7, then 3, 2, 1, 0
    b = make_seq(range(100, 124), "b", block_size=BS)
    assert bm.allocate(b, 24)
    assert b.block_table == [2, 3, 4, 5, 6, 7]
    assert evictions == [[a.block_hashes[3], a.block_hashes[2]]]  # tail first, as before
    assert bm.find_cached_prefix(make_seq(range(16), "c", block_size=BS), 4) == [0, 1]
    c = make_seq(range(200, 204), "c2", block_size=BS)
    assert bm.allocate(c, 4) and c.block_table == [1]  # one block: the queue's head
