"""Continuous batching with one token budget per step (vLLM v1 style).

Each step the scheduler hands out up to ``max_num_batched_tokens`` tokens:

1. running sequences first, oldest first: one token for a decode, a chunk for a prefill
   still in progress. When the pool has no block for one of them, a running sequence is
   preempted (its blocks freed, back to the waiting queue, recomputed later — its full
   blocks usually still hit the prefix cache): the newest under ``fcfs``, the last by
   ``(priority, arrival)`` under ``priority``, as vLLM does. If blocks held for the
   connector's saves would free up instead, the sequence sits this step out: they come
   back as soon as the saves are reported;
2. then waiting sequences, in the policy's order (:mod:`engine.request_queue`: first come
   first served, or by ``(priority, arrival)``), while there are budget, blocks and room
   under ``max_num_seqs`` (none in a step that ran short of blocks). A new sequence
   first takes its longest prefix from the GPU prefix cache. If the connector can supply
   blocks after it, the sequence gets blocks for the hit and those, starts the load and
   waits, LOADING, taking no budget; the next sequence is admitted. Otherwise it computes
   the rest — at least its last token, whose logits it needs. Without chunked prefill its
   whole remainder must fit the budget.

Loads (:mod:`engine.scheduler_loads`) end when the connector's ``poll`` reports them; a
long hit on an idle engine may be split, its head recomputed while its tail loads. A
sequence whose tail loads is never preempted. ::

    waiting --admit---------------------------> running --finish / abort--> finished
      |  ^                                       |   ^
      |  '---------------preempt-----------------'   |
      '--admit, start_load--> loading --poll: n loaded'
                                 '--abort--> finished (blocks freed once the load is reported)

Speculative decoding: a decoding sequence that carries draft tokens (``spec_token_ids``)
computes its newest token and the drafts in one chunk; the drafts that do not fit the
budget are dropped, and all of them when the pool has no blocks for them (the sequence
then decodes one token, as without speculation). Rejected drafts' slots are rolled back in
:meth:`Scheduler.complete_step`.

Blocks offered to ``save_blocks`` are held (:meth:`BlockManager.hold`) until ``poll``
reports them saved.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as Seq
from itertools import repeat
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import KVConnector, SavedBlock
from engine.request_queue import make_waiting_queue, priority_key
from engine.prefill_cost import PrefillCost
from engine.scheduler_loads import Load, Loads, left_queue
from engine.sequence import Sequence, SequenceStatus
from engine.stats import StatsCollector

logger = logging.getLogger(__name__)
_new_tuple = tuple.__new__


class ScheduledSequence(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # computed this step, from seq.num_computed_tokens; drafts included


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    # a sequence found too few free blocks while some were held only (by connector saves,
    # or a forward launched ahead): it waits for them instead of preempting
    waits_for_held: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(Loads):
    """Decides what runs in each step. Single-threaded: the engine thread owns it."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        stats: StatsCollector,
        connector: KVConnector | None = None,
    ) -> None:
        if not config.is_resolved:
            raise ValueError("the scheduler needs a resolved EngineConfig (EngineConfig.resolve)")
        self.config = config
        self.block_manager = block_manager
        self.block_size = config.block_size
        self.stats = stats
        self.connector = connector
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Sequence] = []
        self.loading: dict[str, Load] = {}  # request id -> its load in flight
        self.tail_loads: dict[str, Load] = {}  # of running sequences recomputing their head
        # measured by the engine (on CUDA, with a connector); with the connector's estimate
        # it sizes the head an overlapped load recomputes (engine.scheduler_loads)
        self.prefill_cost: PrefillCost | None = None
        self._aborted_loads: dict[str, Load] = {}  # of finished requests, still in flight
        self._lookups_pending = False  # the last schedule left requests the connector looks up
        self._requests: dict[str, Sequence] = {}
        self._hashing = config.enable_prefix_caching or connector is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_pending_transfers(self) -> bool:
        """Loads not yet reported (also of aborted requests) or blocks held for saves."""
        return bool(
            self.loading
            or self.tail_loads
            or self._aborted_loads
            or self.block_manager.num_held_blocks
            or self._lookups_pending
        )

    def may_admit(self) -> bool:
        """Whether the next :meth:`schedule` could start the first waiting request, as far as
        the pool tells now: room under ``max_num_seqs`` and in the token budget, and blocks
        for the least it needs (its first chunk after its GPU hit; a connector hit takes
        more). When False a decode step may be launched a step ahead
        (:mod:`engine.lookahead`); an answer that proves wrong only wastes that launch."""
        if not self.waiting or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
            return False
        budget = self.config.max_num_batched_tokens - len(self.running)  # decodes go first
        if budget <= 0:
            return False
        if self._lookups_pending:  # one of those behind the first may be admitted
            return True
        seq, bm = self.waiting.peek(), self.block_manager
        # the running sequences' next tokens are given blocks first
        decoding = bm.num_blocks_to_grow(self.running)
        free = bm.num_free_blocks - decoding
        if -(-min(seq.num_tokens, budget) // self.block_size) <= free:
            return True  # it fits without a hit: no need to look its prefix up
        gpu_hit = bm.find_cached_prefix(seq, _max_hit_blocks(seq, self.block_size))
        num_hit_tokens = len(gpu_hit) * self.block_size
        first_chunk = min(seq.num_tokens - num_hit_tokens, budget)
        return bm.num_blocks_to_allocate(seq, num_hit_tokens + first_chunk, gpu_hit) <= free

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens, but max_model_len is "
                f"{self.config.max_model_len} (the prompt must leave room for at least one "
                "generated token)"
            )
        if seq.priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {seq.priority} but Priority scheduling is not enabled "
                f"(scheduling_policy is {self.config.scheduling_policy!r})"
            )
        self._requests[seq.request_id] = seq
        self.waiting.add(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        waits_for_held = False

        # the body runs for every running sequence each step (host time per decode step):
        # names bound once, no keep_drafts call for a sequence without drafts, no allocate
        # call while the last block has room (one that, without a window, changes nothing),
        # no min() (its keyword parsing costs more than the rest of a line)
        running, allocate = self.running, self.block_manager.allocate
        bs, windowed = self.block_size, self.block_manager.kv_window is not None
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed, num_drafts = seq.num_computed_tokens, len(seq.spec_token_ids)
            if num_drafts:
                seq.keep_drafts(budget - 1)
                num_drafts = len(seq.spec_token_ids)
            num_new = len(seq.token_ids) - computed
            num_new = (num_new if num_new <= budget else budget) + num_drafts
            if seq.compute_limit is not None:  # the rest of its hit is loading
                num_new = min(num_new, seq.compute_limit - computed)
                if num_new <= 0:  # its head is done: it waits for the load
                    i += 1
                    continue
            allocated = (
                not windowed and computed + num_new <= len(seq.block_table) * bs
            ) or allocate(seq, computed + num_new)
            if not allocated and num_drafts:  # no blocks for the drafts: one token
                seq.keep_drafts(0)
                num_new = 1
                allocated = allocate(seq, computed + 1)
            if allocated:  # the tuple ScheduledSequence's own __new__ (Python code) makes
                scheduled.append(_new_tuple(ScheduledSequence, (seq, num_new)))
                budget -= num_new
                i += 1
            elif self.block_manager.num_held_only_blocks:
                # Saves in flight give blocks back soon: cheaper to wait than to recompute.
                waits_for_held = True
                i += 1
            else:
                victim = self._pick_victim()
                if victim is None:  # only sequences whose tail loads: it waits for blocks
                    i += 1
                    continue
                index = running.index(victim)
                del running[index]
                if index < i:  # scheduled earlier in this step: take it back
                    i -= 1
                    budget += self._unschedule(scheduled, victim)
                self._preempt(victim)
                preempted.append(victim)
                # It was its own victim (the last by policy): the ones after it, now from
                # index i on, are still to schedule.
                if victim is seq:
                    continue

        looking: list[Sequence] = []  # the connector is still looking up their blocks
        while (
            self.waiting
            and budget > 0
            and not preempted
            and not waits_for_held
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            seq = self.waiting.peek()
            max_hit_blocks = _max_hit_blocks(seq, self.block_size)
            gpu_hit = self.block_manager.find_cached_prefix(seq, max_hit_blocks)
            num_external = self._num_external(seq, len(gpu_hit), max_hit_blocks)
            if num_external is None:  # asked again next step; the ones behind it go first
                looking.append(self.waiting.pop_first())
                continue
            if num_external:
                head = self._head_to_recompute(seq, len(gpu_hit), num_external)
                if not self._start_load(seq, gpu_hit, num_external, head):
                    waits_for_held = self.block_manager.num_held_only_blocks > 0
                    break
                if seq.status is SequenceStatus.LOADING:
                    self.waiting.pop_first()
                    continue
                if seq.compute_limit is not None:  # recomputes its head while the rest loads
                    self.waiting.pop_first()
                    self.running.append(seq)
                    num_new = min(seq.compute_limit - seq.num_computed_tokens, budget)
                    scheduled.append(ScheduledSequence(seq, num_new))
                    budget -= num_new
                    continue
            remaining = seq.num_tokens - len(gpu_hit) * self.block_size
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._admit(seq, gpu_hit, min(remaining, budget))
            if num_new is None:
                waits_for_held = self.block_manager.num_held_only_blocks > 0
                break
            self.waiting.pop_first()
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        for seq in reversed(looking):  # back in front, in their order
            self.waiting.add_front(seq)
        self._lookups_pending = bool(looking)
        return SchedulerOutput(scheduled, preempted, waits_for_held)

    def complete_step(self, output: SchedulerOutput, num_rejected: Seq[int] = ()) -> None:
        """Account the step's computed tokens, once its sampled tokens are appended; register
        and offer the blocks that became full.

        ``num_rejected[i]``: draft tokens of ``output.scheduled[i]`` that verification
        rejected. Their KV stays in the sequence's blocks past ``num_computed_tokens``, to be
        overwritten by the next step, so no block holding one is ever full of computed
        tokens: none is registered or offered. A sequence that stopped before the end of its
        accepted tokens counts only the tokens it kept."""
        saved: list[SavedBlock] = []
        heads_done: list[Sequence] = []  # recomputed their head while the rest loads
        bs, hashing = self.block_size, self._hashing
        rejected_counts = num_rejected or repeat(0, len(output.scheduled))
        for (seq, num_new), rejected in zip(output.scheduled, rejected_counts, strict=True):
            start, num_tokens = seq.num_computed_tokens, len(seq.token_ids)
            computed = start + num_new - rejected  # no min(), per sequence per step
            seq.num_computed_tokens = computed = computed if computed <= num_tokens else num_tokens
            if computed == seq.compute_limit:
                heads_done.append(seq)
            if seq.prompt_tokens_counted < seq.num_prompt_tokens:  # each prompt token once a request
                done = min(computed, seq.num_prompt_tokens)
                if done > seq.prompt_tokens_counted:
                    self.stats.num_prompt_tokens += done - max(start, seq.prompt_tokens_counted)
                    seq.prompt_tokens_counted = done
            first, end = start // bs, computed // bs
            if not hashing or end <= first:
                continue
            new = self.block_manager.cache_blocks(seq, first, end)
            if self.connector is not None:
                saved += [self._saved_block(seq, i) for i in new]
        if saved:
            block_ids = [block.block_id for block in saved]
            self.block_manager.hold(block_ids)
            try:
                self.connector.save_blocks(saved)
            except Exception:
                logger.exception("KV connector could not start saving %d blocks", len(saved))
                self.block_manager.release(block_ids)
        for seq in heads_done:
            self._join_tail(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (running, waiting or loading) with ``reason`` and release its blocks
        (a loading one's once its load is reported: the connector may still write them)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if seq.request_id in self.tail_loads:  # freed once the load is reported
                self._aborted_loads[seq.request_id] = self.tail_loads.pop(seq.request_id)
            else:
                self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.LOADING:
            self._aborted_loads[seq.request_id] = self.loading.pop(seq.request_id)
        else:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._requests[seq.request_id]
        self.stats.num_finished_requests += 1
        if self.connector is not None:
            self.connector.request_finished(seq.request_id)

    def _admit(self, seq: Sequence, gpu_hit: list[int], num_new: int) -> int | None:
        """Give a waiting ``seq`` its cached prefix and the blocks for ``num_new`` tokens
        after it; ``num_new``, or None if the pool is short."""
        num_hit_tokens = len(gpu_hit) * self.block_size
        if not self.block_manager.allocate(seq, num_hit_tokens + num_new, prefix=gpu_hit):
            return None
        seq.status = SequenceStatus.RUNNING
        left_queue(seq)
        seq.num_computed_tokens = num_hit_tokens
        self._count_queries(seq, num_hit_tokens)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
        return num_new

    def _count_queries(self, seq: Sequence, num_hit_tokens: int) -> None:
        """``seq`` left the queue with ``num_hit_tokens`` found in the GPU prefix cache. As in
        vLLM, a preempted request's return is not counted again: it would find its own blocks."""
        if seq.num_preemptions:
            return
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += num_hit_tokens
        if self.connector is not None:
            self.stats.connector_queries += seq.num_tokens

    def _pick_victim(self) -> Sequence | None:
        """The running sequence to preempt; never one whose tail loads into its blocks."""
        running = self.running
        if self.tail_loads:
            running = [s for s in running if s.request_id not in self.tail_loads]
            if not running:
                return None
        if self.config.scheduling_policy == "priority":
            return max(reversed(running), key=priority_key)  # ties: the newest
        return running[-1]

    @staticmethod
    def _unschedule(scheduled: list[ScheduledSequence], seq: Sequence) -> int:
        """Drop ``seq`` from this step's plan; the budget it had."""
        for k, entry in enumerate(scheduled):
            if entry.seq is seq:
                del scheduled[k]
                return entry.num_new_tokens
        return 0  # it sat this step out, waiting for saves

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.keep_drafts(0)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add_front(seq)

    def _saved_block(self, seq: Sequence, index: int) -> SavedBlock:
        hashes = seq.block_hashes
        return SavedBlock(
            block_hash=hashes[index],
            parent_hash=hashes[index - 1] if index else None,
            token_ids=tuple(seq.block_tokens(index)),
            block_id=seq.block_table[index],
            is_prompt=(index + 1) * self.block_size <= seq.num_prompt_tokens,
            cache_salt=seq.cache_salt,
        )


def _max_hit_blocks(seq: Sequence, block_size: int) -> int:
    """How many leading blocks ``seq`` may take from a cache: those before its last token
    (computed, to sample from), none while it needs prompt logprobs (a cached block has no
    logits)."""
    return 0 if seq.needs_prompt_logprobs else (seq.num_tokens - 1) // block_size
