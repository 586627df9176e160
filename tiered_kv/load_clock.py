"""How long loading a block takes from each tier: what the engine weighs against
recomputing it (an overlapped load, see :mod:`engine.scheduler`).

Each tier starts from a rate typical of a GPU host (the CPU pool's DMA, a disk hit from
the page cache, a remote tier over the network) and then follows the loads it serves: a
moving average of seconds per block, each load counted for the tier most of its blocks
came from. Guesses err towards loading, the cheaper choice for the rest of the batch.
"""
from __future__ import annotations

from collections.abc import Sequence

PRIOR_BYTES_PER_S = {"cpu": 20e9, "disk": 2e9, "remote": 1e9}
WEIGHT = 0.5  # of the newest load in the average: loads are large, priors are guesses


class LoadClock:
    """Seconds per block by tier, for blocks of ``block_nbytes``."""

    def __init__(self, block_nbytes: int) -> None:
        self._per_block = {tier: block_nbytes / rate for tier, rate in PRIOR_BYTES_PER_S.items()}

    def estimate(self, tiers: Sequence[str]) -> float:
        """Seconds to load one block from each of ``tiers``."""
        per_block = self._per_block
        return sum(per_block[tier] for tier in tiers)

    def observe(self, tier: str, seconds: float, blocks: int) -> None:
        """A load of ``blocks`` blocks, mostly from ``tier``, took ``seconds``."""
        if blocks > 0 and tier in self._per_block:
            old = self._per_block[tier]
            self._per_block[tier] = old + WEIGHT * (seconds / blocks - old)

    def seconds_per_block(self, tier: str) -> float:
        return self._per_block[tier]
