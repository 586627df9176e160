"""The host inputs of a decode-graph step, from its sequences.

A step feeds one token per sequence: its id, its position, the cache slot its K/V go to and
the sequence's block table. The tables are the costly part: a context of ``C`` tokens has
``C / block_size`` block ids, and flattening every table from its list at every step cost
~30 ns an id (0.27 ms a step at batch 128 with 1K-token contexts, 0.64 ms with 4K). So each
sequence's table is mirrored in a row of one int32 array, and a step copies only the ids
appended since the sequence's last step; its tables are then one gather of its rows::

    mirror row r:  | ids copied ........... | ids appended since | (stale past the table)
                                            ^copied              ^len(seq.block_table)

A block table list only grows in place (:meth:`BlockManager.allocate`); every other change
replaces the list (:meth:`BlockManager.free`, :meth:`BlockManager.free_out_of_window`), and
a row whose list is not the sequence's any more is copied again in full.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import numpy as np

from engine.sequence import Sequence


class DecodeRows(NamedTuple):
    """One token per sequence, as :meth:`engine.cuda_graphs.DecodeGraphs.run` takes them."""

    input_ids: np.ndarray  # [n] int64; zeros for a step whose ids are on the device
    positions: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int64
    tables: np.ndarray  # [n, width] int32, width blocks cover every context; 0 past each


class _Row:
    __slots__ = ("index", "table", "copied")

    def __init__(self, index: int, table: list[int]) -> None:
        self.index = index
        self.table = table  # the list mirrored: kept, so that no other list takes its id
        self.copied = 0


class DecodeInputs:
    """Builds the inputs of decode steps of up to ``max_seqs`` sequences whose contexts fit
    ``max_blocks`` blocks. Used by the engine thread only."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._mirror = np.zeros((max_seqs, max_blocks), dtype=np.int32)  # [max_seqs, max_blocks]
        self._rows: dict[int, _Row] = {}  # id(seq) -> its row
        self._free = list(range(max_seqs - 1, -1, -1))

    def build(self, seqs: Seq[Sequence], ahead: bool) -> DecodeRows:
        """The rows of one new token per sequence: its newest token at its last position
        or, ``ahead``, the token being sampled now one position past it (ids left zero)."""
        n, bs, mirror = len(seqs), self.block_size, self._mirror
        if n > len(mirror):
            raise ValueError(f"{n} sequences exceed the {len(mirror)} rows of the decode inputs")
        rows_of = self._rows.get
        indices, lengths, newest = [], [], []
        for seq in seqs:  # per sequence per step: only what changed since its last step
            tokens, table = seq.token_ids, seq.block_table
            row = rows_of(id(seq))
            if row is None or row.table is not table:
                row = self._claim(seq, seqs)
            if row.copied != len(table):
                end = min(len(table), self.max_blocks)
                mirror[row.index, row.copied : end] = table[row.copied : end]
                row.copied = len(table)
            indices.append(row.index)
            lengths.append(len(tokens))
            newest.append(tokens[-1])
        positions = np.array(lengths, dtype=np.int64)  # [n]
        if ahead:
            input_ids = np.zeros(n, dtype=np.int64)  # placeholders: the caller copies the ids in
        else:
            positions -= 1
            input_ids = np.array(newest, dtype=np.int64)
        used = positions // bs + 1  # [n] blocks each context covers
        width = int(used.max())
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed max_model_len")
        tables = mirror[indices, :width]  # [n, width]
        tables[np.arange(width) >= used[:, None]] = 0  # stale ids past each context
        slots = tables[np.arange(n), used - 1].astype(np.int64) * bs + positions % bs
        return DecodeRows(input_ids, positions, slots, tables)

    def _claim(self, seq: Sequence, step: Seq[Sequence]) -> _Row:
        """A row for ``seq``'s table, copied from its start. With every row taken, the rows
        of sequences outside this ``step`` are freed first (they are mirrored again when
        they come back)."""
        old = self._rows.pop(id(seq), None)
        if old is not None:
            self._free.append(old.index)
        if not self._free:
            live = {id(s) for s in step}
            for key in [key for key in self._rows if key not in live]:
                self._free.append(self._rows.pop(key).index)
        row = self._rows[id(seq)] = _Row(self._free.pop(), seq.block_table)
        return row
