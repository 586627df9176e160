"""The scheduler's side of connector loads: what to load, and what a reported load changes.

A new sequence whose prefix the connector can supply after the GPU hit gets blocks for the
hit and those, starts the load and waits, LOADING, taking no budget. A load ends when the
connector's ``poll`` reports it (:meth:`Loads.apply_transfers`): the blocks it filled
count as computed and enter the prefix cache, and the sequence joins the running ones;
blocks that did not load are recomputed (in chunks if the budget says so, even without
chunked prefill). Loading sequences count toward ``max_num_seqs``, so a finished load
always finds a running slot.

Overlapped loads. When nothing else runs and both a prefill and the load can be timed
(``prefill_cost``, measured by the engine; the connector's
:meth:`~engine.connector.KVConnector.estimate_load_seconds`), a long hit is split where
recomputing the head takes about as long as loading the rest: the sequence runs at once,
recomputing its head up to ``compute_limit`` while the tail loads into the blocks after it
(a *tail load*), and goes on past what loaded once both are done. The GPU and a slow tier
share the work, where a disk hit alone would take longer than recomputing::

    blocks   | GPU hit | head: recomputed | tail: loaded meanwhile | rest, computed after |
                       ^ num_computed     ^ compute_limit          ^ tail_end

A sequence with a tail load in flight is never preempted, and if it finishes meanwhile
its blocks are freed only once the load is reported. Under load the engine loads whole
hits: its GPU has other work, and loading costs it none.

:class:`Loads` is a part of :class:`engine.scheduler.Scheduler`: it uses the scheduler's
``config``, ``block_size``, ``block_manager``, ``connector``, ``stats``, its ``running``
list, load tables and ``prefill_cost``, and ``_count_queries``.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from engine.connector import FinishedTransfers
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger("engine.scheduler")

# An overlapped load recomputes at least this many blocks, or none: below it the head's
# step costs more than the time it saves.
MIN_OVERLAP_BLOCKS = 4


class Load(NamedTuple):
    """A load in flight: ``seq``'s blocks ``first .. first + num_blocks - 1``."""

    seq: Sequence
    first: int
    num_blocks: int


class Loads:
    """Starting connector loads and taking in their reports (a part of
    :class:`~engine.scheduler.Scheduler`; see the module docstring)."""

    def apply_transfers(self, finished: FinishedTransfers) -> None:
        """Take in what :meth:`KVConnector.poll` reported: release the saved blocks; a loaded
        sequence has its loaded blocks computed and cached, and joins the running ones.
        Raises ``ValueError`` for a report that breaks the connector's contract: the holds
        can no longer be trusted (a stale report may already have dropped a newer save's
        hold), so the engine stops rather than go on with a connector that may have stored
        a block overwritten while it was copied."""
        if finished.saved:
            try:
                self.block_manager.release(finished.saved)
            except ValueError as e:
                raise ValueError(
                    f"the KV connector reported a save it was not given: {e}"
                ) from None
        for request_id, num_loaded in finished.loaded.items():
            if request_id in self.loading:
                self._end_load(self.loading.pop(request_id), num_loaded, aborted=False)
            elif request_id in self.tail_loads:
                self._end_tail_load(self.tail_loads.pop(request_id), num_loaded)
            elif request_id in self._aborted_loads:
                self._end_load(self._aborted_loads.pop(request_id), num_loaded, aborted=True)
            else:
                raise ValueError(f"the KV connector reported a load {request_id!r} never started")

    def _num_external(self, seq: Sequence, num_hit_blocks: int, max_hit_blocks: int) -> int | None:
        """How many blocks after the GPU hit to load through the connector; None while the
        connector is still looking."""
        if (
            self.connector is None
            or num_hit_blocks >= max_hit_blocks
            or seq.request_id in self._aborted_loads  # its id would name two loads at once
        ):
            return 0
        matched = self.connector.get_num_matched_blocks(
            seq.request_id, seq.hashes_of_full_blocks(), num_hit_blocks
        )
        if matched is None:
            return None
        return max(0, min(matched, max_hit_blocks - num_hit_blocks))

    def _head_to_recompute(self, seq: Sequence, first: int, num_external: int) -> int:
        """How many of the ``num_external`` blocks after the GPU hit (``first`` blocks) to
        recompute while the rest loads: 0 (load them all) unless nothing else runs and both
        the load and a prefill can be timed. The most blocks ``k`` whose recompute takes no
        longer than loading the other ``num_external - k``; the recompute runs in steps of
        ``max_num_batched_tokens`` from the hit's end, each with its fixed cost and
        attention over the context before each token
        (:meth:`~engine.prefill_cost.PrefillCost.seconds`)."""
        cost = self.prefill_cost
        busy = self.running or self.loading or self.tail_loads
        if cost is None or busy or seq.num_preemptions:
            return 0
        seconds = self.connector.estimate_load_seconds(seq.request_id, num_external)
        if not seconds or seconds <= 0:
            return 0
        start, budget = first * self.block_size, self.config.max_num_batched_tokens

        def fits(k: int) -> bool:
            head_s = cost.seconds(start, k * self.block_size, budget)
            return head_s <= seconds * (num_external - k) / num_external

        low, high = 0, num_external  # fits(low); the answer is below high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low if low >= MIN_OVERLAP_BLOCKS else 0

    def _start_load(
        self, seq: Sequence, gpu_hit: list[int], num_external: int, head: int = 0
    ) -> bool:
        """Give ``seq`` blocks for its GPU hit and the ``num_external`` blocks after it and
        start loading those but the first ``head``: ``seq`` is LOADING, or with a ``head``,
        RUNNING up to its ``compute_limit`` (the caller runs it). False (and no change) if
        the pool is short. If the connector fails to start the load, ``seq`` is left
        WAITING without blocks."""
        first = len(gpu_hit)
        if not self.block_manager.allocate(
            seq, (first + num_external) * self.block_size, prefix=gpu_hit
        ):
            return False
        try:
            self.connector.start_load(
                seq.request_id,
                seq.hashes_of_full_blocks()[first + head : first + num_external],
                seq.block_table[first + head : first + num_external],
                seq.cache_salt,
            )
        except Exception:
            logger.exception("KV connector failed to start a load for %s", seq.request_id)
            self.stats.connector_load_failures += 1
            self.block_manager.free(seq)
            return True
        left_queue(seq)
        seq.num_computed_tokens = first * self.block_size
        self._count_queries(seq, seq.num_computed_tokens)
        if head:
            seq.status = SequenceStatus.RUNNING
            seq.compute_limit = (first + head) * self.block_size
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.tail_loads[seq.request_id] = Load(seq, first + head, num_external - head)
            self.stats.connector_overlapped_loads += 1
            self.stats.connector_overlap_tokens += head * self.block_size
        else:
            seq.status = SequenceStatus.LOADING
            self.loading[seq.request_id] = Load(seq, first, num_external)
        return True

    def _end_load(self, load: Load, num_loaded: int, aborted: bool) -> None:
        """The first ``num_loaded`` blocks of ``load`` are in place: cache them, and run the
        sequence (or, for an aborted one, free its blocks)."""
        seq, first, _ = load
        self._cache_loaded(load, num_loaded, count=not aborted)
        if aborted:
            self.block_manager.free(seq)
            return
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = (first + num_loaded) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.running.append(seq)

    def _end_tail_load(self, load: Load, num_loaded: int) -> None:
        """A running sequence's tail load is reported: cache what it filled, and resume
        past it once the head is recomputed (now, or in :meth:`complete_step`)."""
        seq, first, _ = load
        self._cache_loaded(load, num_loaded, count=True)
        seq.tail_end = (first + num_loaded) * self.block_size
        seq.num_cached_tokens = min(
            (seq.num_cached_tokens or 0) + num_loaded * self.block_size, seq.num_prompt_tokens
        )
        if seq.num_computed_tokens == seq.compute_limit:
            self._join_tail(seq)

    def _cache_loaded(self, load: Load, num_loaded: int, *, count: bool) -> None:
        """Check a reported count against ``load`` and enter the blocks it filled in the
        prefix cache; ``count``: in the stats too (a preempted request's return, which
        finds its own blocks, counts no hits)."""
        seq, first, num_blocks = load
        if not 0 <= num_loaded <= num_blocks:
            raise ValueError(
                f"the KV connector reported {num_loaded} blocks loaded for {seq.request_id!r}, "
                f"which asked for {num_blocks}"
            )
        self.block_manager.cache_blocks(seq, first, first + num_loaded)
        if not count:
            return
        if not seq.num_preemptions:
            self.stats.connector_hits += num_loaded * self.block_size
        if num_loaded < num_blocks:
            self.stats.connector_load_failures += 1

    @staticmethod
    def _join_tail(seq: Sequence) -> None:
        """``seq`` recomputed its head: once its tail load is reported, go on past what
        loaded (right after the head if nothing did)."""
        if seq.tail_end is None:
            return  # still loading: it sits out until the load is reported
        seq.num_computed_tokens = seq.tail_end
        seq.compute_limit = seq.tail_end = None


def left_queue(seq: Sequence) -> None:
    """Stamp the first time ``seq`` leaves the waiting queue (a preempted one keeps it)."""
    if seq.scheduled_time is None:
        seq.scheduled_time = time.perf_counter()
