"""Decode-graph inputs from sequences (engine/decode_inputs.py): the block tables mirrored row
by row give what flattening every table at every step gives."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.decode_inputs import DecodeInputs
from engine_testing import make_seq

BS = 4


def flattened(seqs, ahead: bool) -> tuple[np.ndarray, ...]:
    """Each table copied from its list, as a step did before the mirror."""
    positions = np.array([len(s.token_ids) - (0 if ahead else 1) for s in seqs], dtype=np.int64)
    used = positions // BS + 1
    tables = np.zeros((len(seqs), int(used.max())), dtype=np.int32)
    for b, (seq, u) in enumerate(zip(seqs, used)):
        tables[b, :u] = seq.block_table[:u]
    ids = np.zeros(len(seqs), dtype=np.int64)
    if not ahead:
        ids = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)
    slots = tables[np.arange(len(seqs)), used - 1].astype(np.int64) * BS + positions % BS
    return ids, positions, slots, tables


def assert_same(inputs: DecodeInputs, seqs, ahead: bool) -> None:
    for got, want in zip(inputs.build(seqs, ahead), flattened(seqs, ahead)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kv_window", [None, 6])
def test_the_mirrored_tables_are_the_tables_as_sequences_grow_stop_and_return(kv_window):
    """More sequences than rows come and go (finished, preempted and recomputed, windowed
    blocks given back): each step's rows are those of its sequences' lists."""
    rng = random.Random(0)
    bm = BlockManager(256, BS, enable_prefix_caching=False, kv_window=kv_window)
    inputs = DecodeInputs(max_seqs=4, max_blocks=16, block_size=BS)
    seqs = [make_seq(range(rng.randint(1, 9)), request_id=str(i), block_size=BS) for i in range(7)]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
    for step in range(60):
        batch = rng.sample(seqs, rng.randint(1, 4))
        ahead = step % 2 == 0
        for seq in batch:  # the next position's block, as the scheduler or reserve() gives it
            seq.num_computed_tokens = seq.num_tokens - 1
            assert bm.allocate(seq, seq.num_tokens + ahead)
        assert_same(inputs, batch, ahead)
        for seq in batch:
            seq.append_token(rng.randint(0, 255))
            if seq.num_tokens >= 60:  # finished: a new request takes its place
                bm.free(seq)
                seq.token_ids = seq.token_ids[:3]
                assert bm.allocate(seq, seq.num_tokens)
        victim = rng.choice(seqs)
        if step % 7 == 3:  # preempted: a new table for the same sequence
            bm.free(victim)
            assert bm.allocate(victim, victim.num_tokens)


def test_a_batch_past_its_rows_is_refused():
    inputs = DecodeInputs(max_seqs=2, max_blocks=4, block_size=BS)
    seqs = [make_seq([1, 2], request_id=str(i), block_size=BS) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    with pytest.raises(ValueError, match="3 sequences exceed the 2 rows"):
        inputs.build(seqs, ahead=False)
