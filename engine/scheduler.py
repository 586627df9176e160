"""Continuous batching with one token budget per step (vLLM v1 style).

Each step the scheduler hands out up to ``max_num_batched_tokens`` tokens:

1. running sequences first, in arrival order: one token for a decode, a chunk for a
   prefill still in progress. When the pool has no block for one of them, the most recently
   arrived running sequence is preempted (its blocks freed, back to the head of the waiting
   queue, recomputed later — its full blocks usually still hit the prefix cache);
2. then waiting sequences, first come first served, while there are budget, blocks and
   room under ``max_num_seqs`` (none in a step that had to preempt). A new sequence first
   takes its longest prefix from the GPU prefix cache, then the blocks the connector can
   supply after it (loaded right away), and computes the rest — at least its last token,
   whose logits it needs. Without chunked prefill its whole remainder must fit the budget.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import KVConnector, SavedBlock
from engine.sequence import Sequence, SequenceStatus
from engine.stats import StatsCollector

logger = logging.getLogger(__name__)


class ScheduledSequence(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self._hashing = config.enable_prefix_caching or connector is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

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
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def complete_step(self, output: SchedulerOutput) -> None:
        """Account the step's computed tokens; register and offer the blocks that became full."""
        saved: list[SavedBlock] = []
        for seq, num_new in output.scheduled:
            start = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            if start < seq.num_prompt_tokens:
                done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                self.stats.num_prompt_tokens += done - start
            first, end = start // self.block_size, seq.num_computed_tokens // self.block_size
            if not self._hashing or end <= first:
                continue
            new = self.block_manager.cache_blocks(seq, first, end)
            if self.connector is not None:
                saved += [self._saved_block(seq, i) for i in new]
        if saved:
            self.connector.save_blocks(saved)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (running or waiting) with ``reason`` and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        del self._requests[seq.request_id]
        self.stats.num_finished_requests += 1
        if self.connector is not None:
            self.connector.request_finished(seq.request_id)

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting ``seq`` its cached prefix and blocks; the tokens to compute, or None."""
        bs = self.block_size
        max_hit_blocks = (seq.num_tokens - 1) // bs  # the last token is always computed
        gpu_hit = self.block_manager.find_cached_prefix(seq, max_hit_blocks)
        num_external = 0
        if self.connector is not None and len(gpu_hit) < max_hit_blocks:
            matched = self.connector.get_num_matched_blocks(
                seq.request_id, seq.hashes_of_full_blocks(), len(gpu_hit)
            )
            num_external = max(0, min(matched, max_hit_blocks - len(gpu_hit)))
        num_hit_tokens = (len(gpu_hit) + num_external) * bs
        remaining = seq.num_tokens - num_hit_tokens
        if not self.config.enable_chunked_prefill and remaining > budget:
            return None
        num_new = min(remaining, budget)
        if not self.block_manager.allocate(seq, num_hit_tokens + num_new, prefix=gpu_hit):
            return None

        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = len(gpu_hit) * bs
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += seq.num_computed_tokens
        if num_external and self._load(seq, len(gpu_hit), num_external):
            seq.num_computed_tokens = num_hit_tokens
        # After a failed load the blocks stay allocated, uncomputed; they still cover the
        # (larger) chunk: len(gpu_hit)*bs + min(rest, budget) <= num_hit_tokens + num_new.
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        return num_new

    def _load(self, seq: Sequence, first: int, count: int) -> bool:
        hashes = seq.hashes_of_full_blocks()[first : first + count]
        block_ids = seq.block_table[first : first + count]
        try:
            ok = self.connector.load_blocks(seq.request_id, hashes, block_ids)
        except Exception:
            logger.exception("KV connector load failed for %s; recomputing", seq.request_id)
            ok = False
        if not ok:
            self.stats.connector_load_failures += 1
            return False
        if self._hashing:
            self.block_manager.cache_blocks(seq, first, first + count)
        self.stats.connector_hits += count * self.block_size
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _saved_block(self, seq: Sequence, index: int) -> SavedBlock:
        hashes = seq.block_hashes
        return SavedBlock(
            block_hash=hashes[index],
            parent_hash=hashes[index - 1] if index else None,
            token_ids=tuple(seq.block_tokens(index)),
            block_id=seq.block_table[index],
            is_prompt=(index + 1) * self.block_size <= seq.num_prompt_tokens,
        )
