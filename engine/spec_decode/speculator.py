"""The engine's side of speculative decoding: which sequences get draft tokens, how many,
from which proposer, and the counters of what verification accepted.

Each step, before scheduling, every running sequence that decodes and whose sampling
composes with speculation gets up to ``num_speculative_tokens`` drafts (fewer near
``max_tokens`` or ``max_model_len``: no draft is proposed that could not be emitted). The
scheduler fits them into the step, the model runner verifies them
(:mod:`engine.spec_decode.rejection`), and :meth:`Speculator.verified` counts the outcome.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch

from engine.host_staging import to_device
from engine.sampler import SampleError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram
from engine.stats import StatsCollector


class Proposal(NamedTuple):
    token_ids: list[int] | torch.Tensor  # k; a draft model's stay on the device, [k] int64
    probs: torch.Tensor | None  # [len(token_ids), vocab] the distribution each was drawn from


def place_drafts(out: torch.Tensor, starts: Seq[int], drafts: Seq[torch.Tensor]) -> None:
    """Copy device drafts into ``out`` (flat, ``[N]``), ``drafts[i]`` from ``starts[i]`` on,
    in one copy on the device."""
    index = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    out.index_copy_(0, to_device(index, torch.int64, out.device), torch.cat(list(drafts)))


class Proposer(Protocol):
    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        """Up to ``num_tokens[i]`` drafts continuing ``seqs[i]`` (all running, decoding)."""

    def keep_only(self, running: Seq[Sequence]) -> None:
        """Forget the state of sequences no longer running (finished, preempted)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup_min, self.lookup_max = config.lookup_min, config.lookup_max

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        return [
            Proposal(propose_ngram(seq.token_ids, self.lookup_min, self.lookup_max, k), None)
            for seq, k in zip(seqs, num_tokens)
        ]

    def keep_only(self, running: Seq[Sequence]) -> None:
        pass


def composes_with_speculation(params: SamplingParams) -> bool:
    """Sampling whose per-token state a draft cannot follow decodes one token at a time:
    logprobs, penalties, logit_bias and structured output (and ``min_tokens`` until it is
    reached, see :meth:`Speculator.num_drafts`)."""
    return not (
        params.wants_logprobs
        or params.has_penalties
        or params.logit_bias
        or params.structured_output is not None
    )


class Speculator:
    """Proposes drafts for the running sequences and counts what verification accepted
    (``stats.spec_*``, vLLM's ``spec_decode`` counters). Engine thread only."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        stats: StatsCollector,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = stats
        self.max_model_len = max_model_len
        stats.spec_accepted_per_pos = [0] * config.num_speculative_tokens

    def num_drafts(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may verify next step: 0 unless it is running and decodes,
        and no more than it may still emit, less the target's own token."""
        params = seq.params
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.num_tokens - seq.num_computed_tokens != 1
            or seq.num_output_tokens < params.min_tokens
            or not composes_with_speculation(params)
        ):
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, running: Seq[Sequence]) -> None:
        """Set the drafts of each running sequence (``seq.spec_token_ids``)."""
        self.proposer.keep_only(running)
        seqs, counts = [], []
        for seq in running:
            seq.keep_drafts(0)
            k = self.num_drafts(seq)
            if k:
                seqs.append(seq)
                counts.append(k)
        if not seqs:
            return
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, counts)):
            seq.spec_token_ids = proposal.token_ids
            seq.spec_draft_probs = proposal.probs

    def verified(self, seq: Sequence, result: list | SampleError | None) -> int:
        """Count the verification of ``seq``'s drafts (``result``: the tokens it emits) and
        drop them; the number rejected (all of them when verification failed)."""
        num_drafts = len(seq.spec_token_ids)
        seq.keep_drafts(0)
        if not isinstance(result, list):
            return num_drafts
        accepted = len(result) - 1
        stats = self.stats
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_drafts
        stats.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            stats.spec_accepted_per_pos[pos] += 1
        return num_drafts - accepted
