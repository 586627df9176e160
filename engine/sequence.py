"""A request as the scheduler sees it: its tokens, its blocks and how far it has been computed.

::

    token_ids:  | prompt ......................... | outputs ...... |
                |<--- num_computed_tokens --->|                     (KV in the cache)
                |<- num_cached_tokens ->|       (prompt tokens found in a cache, not computed)

``num_computed_tokens`` only ever lags ``num_tokens``: the newest sampled token is fed to
the model in the next step. ``block_table[i]`` holds tokens ``i*B .. i*B+B-1``; the list
only grows in place, any other change to it replaces it (:mod:`engine.decode_inputs`).

With speculative decoding a decoding sequence may carry draft tokens
(``spec_token_ids``) past its tokens: the step computes the newest token and the drafts
together and keeps the KV of those verification accepts (:mod:`engine.spec_decode`).
"""
from __future__ import annotations

import enum
import time

import numpy as np
import torch

from engine.hashing import extend_block_hashes
from engine.outputs import PromptLogprob
from engine.penalties import TokenCounts
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    """``WAITING -> [LOADING ->] RUNNING -> FINISHED``; preemption sends RUNNING back to WAITING.

    LOADING: the connector is writing part of the prefix into the sequence's blocks; it runs
    once :meth:`engine.connector.KVConnector.poll` reports the load.
    """

    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request. Owned by the engine thread; nothing here is thread-safe."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        block_size: int,
        root_hash: bytes,
        generator: torch.Generator,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.block_size = block_size
        self.root_hash = root_hash
        self.cache_salt = cache_salt
        self.priority = priority  # under the "priority" policy: lower is served first
        self.generator = generator
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # of the full blocks of token_ids, as far as needed
        # the block manager's last prefix-cache hit for it: (block ids, their versions then)
        self.prefix_hit: tuple[np.ndarray, np.ndarray] | None = None
        self.num_computed_tokens = 0
        # while the rest of a hit loads, the head is recomputed up to this position; then
        # computing resumes at ``tail_end`` (the end of what loaded), once that is reported
        self.compute_limit: int | None = None
        self.tail_end: int | None = None
        self.num_cached_tokens: int | None = None  # set when first scheduled
        self.num_preemptions = 0
        # prompt tokens before this position were computed, cached or loaded once already:
        # a preempted request's recompute does not count them again in the stats
        self.prompt_tokens_counted = 0
        self.finish_reason: str | None = None
        self.logprobs: list[float] | None = [] if params.wants_logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = (
            [] if params.num_top_logprobs else None
        )
        # prompt_logprobs: the entries of prompt tokens 1, 2, ... computed so far
        self.prompt_logprobs: list[PromptLogprob] | None = (
            [] if params.prompt_logprobs is not None else None
        )
        self.grammar: GrammarState | None = None  # set by the engine for structured output
        self.token_counts: TokenCounts | None = None  # set by the engine for penalties
        # the model runner's SamplingRow, kept once min_tokens suppresses nothing (its fields
        # do not change after that); params, generator, grammar and token_counts are fixed
        self.sampling_row: SamplingRow | None = None
        # draft tokens to verify in the next step; a draft model's are a [k] tensor on the
        # device: take len(), never truth-test them (that would sync, and reads a value)
        self.spec_token_ids: list[int] | torch.Tensor = []
        self.spec_draft_probs: torch.Tensor | None = None  # [k, vocab] their q; None: one-hot
        # time.perf_counter() stamps: added, first left the queue, first and last token
        self.arrival_time = time.perf_counter()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are still to compute: its prompt is
        computed, not taken from a cache."""
        return self.prompt_logprobs is not None and (
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_prefilling(self) -> bool:
        """More than one token still lacks KV (a prompt, or a sequence being recomputed)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def keep_drafts(self, num: int) -> None:
        """Keep only the first ``num`` draft tokens (0: none)."""
        if len(self.spec_token_ids) <= num:
            return
        self.spec_token_ids = self.spec_token_ids[:num] if num else []
        if self.spec_draft_probs is not None:
            self.spec_draft_probs = self.spec_draft_probs[:num] if num else None

    def append_token(self, token_id: int) -> None:
        """Append a sampled token (and count it for the penalties)."""
        self.token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def hashes_of_full_blocks(self, num_tokens: int | None = None) -> list[bytes]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens (default: all),
        a list of the caller's own."""
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        return self.block_hash_chain(num_tokens)[: num_tokens // self.block_size]

    def block_hash_chain(self, num_tokens: int) -> list[bytes]:
        """The sequence's own chain of block hashes, grown to cover the full blocks among
        the first ``num_tokens`` tokens (it may hold more): to read, never to change. The
        block manager reads it each time a block completes, where a copy would cost a pass
        over the whole chain (2,048 hashes at 32K tokens) for one new block."""
        num_blocks = num_tokens // self.block_size
        if len(self.block_hashes) < num_blocks:
            extend_block_hashes(
                self.block_hashes, self.root_hash, self.token_ids, self.block_size, num_blocks
            )
        return self.block_hashes
