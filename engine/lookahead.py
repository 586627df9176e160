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
stream, while the forward may still write into it.
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
    held: list[int]  # the blocks their launched forward writes, held by the engine


NOTHING = Reserved([], [])


def reserve(
    plan: SchedulerOutput, scheduler: Scheduler, block_manager: BlockManager, config: EngineConfig
) -> Reserved:
    """The sequences of a decode step to launch a step ahead, each with a block for the
    position it computes then, and those blocks held; :data:`NOTHING` when the step is not
    a plain decode step, or the next step would not be one (a waiting request could join:
    one that waits for blocks does not stop the launch).

    A sequence whose token of this step ends it by length is left out; one that another
    stop ends is launched, and its row is wasted."""
    if plan.preempted or not plan.scheduled:
        return NOTHING
    seqs = []
    max_model_len = config.max_model_len
    for seq, num_new in plan.scheduled:  # one pass: a plain decode step, and who goes on
        num_tokens = len(seq.token_ids)
        if num_new != 1 or len(seq.spec_token_ids) or seq.num_computed_tokens + 1 != num_tokens:
            return NOTHING
        if _continues(seq, num_tokens, max_model_len):
            seqs.append(seq)
    allocate = block_manager.allocate
    for seq in seqs:  # what the next step's schedule would allocate, a step early
        if not allocate(seq, len(seq.token_ids) + 1):
            return NOTHING
    if scheduler.may_admit():
        return NOTHING
    bs = config.block_size
    held = [seq.block_table[len(seq.token_ids) // bs] for seq in seqs]
    block_manager.hold(held)
    return Reserved(seqs, held)


def _continues(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """Whether ``seq`` (``num_tokens`` long) outlives the token it samples now, as far as its
    length tells."""
    max_tokens = seq.params.max_tokens
    if max_tokens is not None and num_tokens - seq.num_prompt_tokens + 1 >= max_tokens:
        return False
    return num_tokens + 1 < max_model_len
