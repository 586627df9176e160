"""What a prefill step costs, as the scheduler sizes an overlapped load's head with it.

A step that computes ``n`` tokens after ``p`` already in its sequence's cache takes

    fixed_s + n * per_token_s + per_token_context_s * (n * p + n * (n - 1) / 2)

seconds: a fixed part (launches, sampling, the host), the weights' work per token, and
attention, where each token reads every token before it. The last term is what makes the
head of a long hit dearer than its first blocks suggest: on a 1B model at 32K tokens,
attention is most of a step (recomputing 32K took 7× as long as 8K on an H200, not 4×).

:func:`fit` solves the three coefficients from three timed steps: ``small`` tokens and
``big`` tokens from an empty cache, and ``small`` tokens after ``big`` (the engine's
:func:`~engine.startup_probes.time_prefill` on CUDA, and
``benchmarks/overlapped_load.py`` on the CPU).
"""
from __future__ import annotations

from typing import NamedTuple


class PrefillCost(NamedTuple):
    """A prefill step's seconds (see the module docstring)."""

    fixed_s: float
    per_token_s: float
    per_token_context_s: float = 0.0  # a token's seconds per token before it (attention)

    def step_seconds(self, start: int, tokens: int) -> float:
        """One step computing ``tokens`` tokens after ``start`` in the cache."""
        pairs = tokens * start + tokens * (tokens - 1) / 2  # (token, earlier token) pairs
        return self.fixed_s + tokens * self.per_token_s + pairs * self.per_token_context_s

    def seconds(self, start: int, tokens: int, budget: int) -> float:
        """Computing ``tokens`` tokens after ``start`` in steps of at most ``budget``."""
        total = 0.0
        for first in range(start, start + tokens, budget):
            total += self.step_seconds(first, min(budget, start + tokens - first))
        return total


def fit(small: int, big: int, small_s: float, big_s: float, after_big_s: float) -> PrefillCost:
    """The cost that gives ``small_s`` and ``big_s`` for ``small`` and ``big`` tokens from an
    empty cache, and ``after_big_s`` for ``small`` tokens after ``big``; every coefficient
    at least 0 (a noisy timing can make one come out negative)."""
    if not 0 < small < big:
        raise ValueError(f"need 0 < small < big, got small={small}, big={big}")
    context = max(after_big_s - small_s, 0.0) / (small * big)
    pairs = big * (big - 1) / 2 - small * (small - 1) / 2
    per_token = max(big_s - small_s - context * pairs, 0.0) / (big - small)
    fixed = small_s - small * per_token - context * small * (small - 1) / 2
    return PrefillCost(max(fixed, 0.0), per_token, context)
