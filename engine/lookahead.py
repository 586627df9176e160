"""Decode forwards launched a step ahead (``async_scheduling``): the GPU computes step N+1
while the host finishes step N.

Without it, a decode step's host work (appending and detokenizing the sampled tokens,
building outputs, scheduling, preparing the next inputs) leaves the GPU idle: the next
forward can start only once all of it is done. With it, the model runner queues the next
decode forward right after a step's sampling, before that step's tokens reach the host;
the forward's input ids are the sampled ids, copied on the device::

    host    sample N | launch N+1 | sync N | outputs N, schedule N+1 | sample N+1 | launch N+2
    device  forward N | sample N | forward N+1 ............................ | sample N+1 | ...

The next step takes the launched logits when the scheduler plans what was launched: each
of its sequences decodes one token at the position launched ahead. A sequence that
stopped meanwhile (an EOS, a stop string, an abort, a preemption) is left out of the rows
taken. When the plan holds anything that was not launched (a new request, a prefill, a
sequence being recomputed), the launched forward is wasted and the step runs its own.

Nothing is sampled ahead: sampling waits for the step that takes the logits, so penalties,
``min_tokens``, logit bias and grammars see every earlier token, and seeded draws come in
the same order as without lookahead. A launched batch may hold rows of sequences that
stopped meanwhile, so it can be larger (on CUDA, fall in a larger graph bucket) than the
step that takes it: float rounding may move, as with any other change of batch.

The host waits for a step's draws alone: the sampler copies them into pinned memory
behind an event before the forward is launched (a ``.tolist()`` on the device would wait
for that forward too, and the host would again finish the step while the GPU idles).

A launched forward writes the KV of one position per sequence in a block the engine
reserved for it (:func:`reserve`). The engine holds those blocks until that forward is
known to have run: a sequence that stops meanwhile gives its blocks back, and a block
given back could otherwise be handed to a connector load, whose copies run on another
stream, while the forward may still write into it. A sequence writes the same block for
``block_size`` steps: a block that the forward in flight and the next one both write is
held once for both (:func:`held_by_both`), not released and held again at every step.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler, ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence


class Lookahead(NamedTuple):
    """A decode forward launched a step ahead."""

    seqs: list[Sequence]  # kept alive, so that the ids in ``rows`` stay theirs
    positions: list[int]  # the position each sequence computes (its num_tokens at launch)
    logits: torch.Tensor  # [len(seqs), vocab] float32, still being computed on CUDA
    done: torch.cuda.Event | None  # recorded after the forward on CUDA
    rows: dict[int, int]  # id(seq) -> its row

    def rows_for(self, items: Seq[ScheduledSequence]) -> list[int] | None:
        """The rows of the step's sequences, or None when the step is not what was launched."""
        seqs = [seq for seq, _ in items]
        if seqs == self.seqs:  # the usual step: every launched sequence in its order
            # (a Sequence compares by identity), checked a list at a time
            positions = self.positions
            if (
                [n for _, n in items].count(1) == len(items)
                and [seq.num_computed_tokens for seq in seqs] == positions
                and [len(seq.token_ids) - 1 for seq in seqs] == positions
                and not any([len(seq.spec_token_ids) for seq in seqs])
            ):
                return list(range(len(seqs)))
            return None
        rows = []
        row_of, positions = self.rows.get, self.positions
        for seq, num_new in items:
            row = row_of(id(seq))
            if row is None or num_new != 1 or len(seq.spec_token_ids):
                return None
            position = positions[row]
            if seq.num_computed_tokens != position or len(seq.token_ids) != position + 1:
                return None
            rows.append(row)
        return rows

    def wait(self) -> None:
        """Block the host until the forward ran."""
        if self.done is not None:
            self.done.synchronize()


class Reserved(NamedTuple):
    seqs: list[Sequence]  # to launch ahead, in the step's order
    held: list[int]  # the blocks their launched forward writes, for the engine to hold


NOTHING = Reserved([], [])


def reserve(
    plan: SchedulerOutput, scheduler: Scheduler, block_manager: BlockManager, config: EngineConfig
) -> Reserved:
    """The sequences of a decode step to launch a step ahead, each with a block for the
    position it computes then (for the engine to hold); :data:`NOTHING` when the step is not
    a plain decode step, or the next step would not be one (a waiting request could join:
    one that waits for blocks does not stop the launch).

    A sequence whose token of this step ends it by length is left out; one that another
    stop ends is launched, and its row is wasted."""
    if plan.preempted or not plan.scheduled:
        return NOTHING
    seqs, positions = [], []
    max_model_len = config.max_model_len
    for seq, num_new in plan.scheduled:  # one pass: a plain decode step, and who goes on
        num_tokens = len(seq.token_ids)
        if num_new != 1 or len(seq.spec_token_ids) or seq.num_computed_tokens + 1 != num_tokens:
            return NOTHING
        # left out: one that the token it samples now ends by length
        max_tokens = seq.params.max_tokens
        if num_tokens + 1 < max_model_len and (
            max_tokens is None or num_tokens - seq.num_prompt_tokens + 1 < max_tokens
        ):
            seqs.append(seq)
            positions.append(num_tokens)
    # what the next step's schedule would allocate, a step early; no call while the last
    # block has room (without a window, which allocate applies at every call)
    allocate, bs = block_manager.allocate, config.block_size
    windowed = block_manager.kv_window is not None
    held = []
    for seq, position in zip(seqs, positions):
        if (windowed or position >= len(seq.block_table) * bs) and not allocate(seq, position + 1):
            return NOTHING
        held.append(seq.block_table[position // bs])
    if scheduler.may_admit():
        return NOTHING
    return Reserved(seqs, held)


def held_by_both(in_flight: Seq[int], to_launch: Seq[int]) -> set[int]:
    """The blocks that both the forward in flight and the one to launch write, to hold once
    for both; none when either list names a block twice (each is then held in full)."""
    flight, launch = set(in_flight), set(to_launch)
    if len(flight) != len(in_flight) or len(launch) != len(to_launch):
        return set()
    return flight & launch
