"""The waiting queue, in the order the scheduling policy serves it (as vLLM's ``fcfs`` and
``priority`` policies do).

- ``fcfs``: arrival order; a preempted sequence goes back to the front.
- ``priority``: by ``(priority, arrival)``, a lower ``priority`` value first; a preempted
  sequence goes back by that same key, so it runs again before the later arrivals of its
  priority.

Both queues are owned by the engine thread, as the scheduler is.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.sequence import Sequence


def priority_key(seq: Sequence) -> tuple[int, float]:
    """What the ``priority`` policy orders by: served smallest first, preempted largest first."""
    return seq.priority, seq.arrival_time


class FcfsQueue(deque[Sequence]):
    """First come, first served: a deque."""

    def add(self, seq: Sequence) -> None:
        self.append(seq)

    def add_front(self, seq: Sequence) -> None:
        self.appendleft(seq)

    def peek(self) -> Sequence:
        return self[0]

    def pop_first(self) -> Sequence:
        return self.popleft()


class PriorityQueue:
    """A heap on ``(priority, arrival)``; ties keep the order of insertion."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (*priority_key(seq), next(self._counter), seq))

    add_front = add  # a priority queue has no front but its key's

    def peek(self) -> Sequence:
        return self._heap[0][-1]

    def pop_first(self) -> Sequence:
        return heapq.heappop(self._heap)[-1]

    def remove(self, seq: Sequence) -> None:
        """O(n): only aborts of waiting sequences call it."""
        for i, entry in enumerate(self._heap):
            if entry[-1] is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{seq.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In the order the queue serves them (sorts a copy)."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


WaitingQueue = FcfsQueue | PriorityQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FcfsQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
