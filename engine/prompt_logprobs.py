"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): for each prompt token after
the first, its log-probability given the tokens before it, its rank and the most likely
tokens at its position.

A request that asks for them computes its whole prompt (no prefix-cache or tier hit: a
cached block has no logits). Each prefill chunk asks the model runner for the hidden states
of its positions that predict prompt tokens not yet given (``rows_this_step``); their
logits are computed here a slice of rows at a time, so a long chunk never holds
``[chunk, vocab]`` float32 logits at once (4 GiB for 8K positions of a 128K vocabulary).
A sequence that is preempted and recomputed skips the positions it already has.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.host_staging import to_device
from engine.outputs import PromptLogprob
from engine.sequence import Sequence

SLICE_ROWS = 512  # logits rows computed at once: 256 MiB of float32 for a 128K vocabulary


def rows_this_step(seq: Sequence, num_new: int) -> int:
    """How many positions of ``seq``'s next ``num_new`` tokens predict a prompt token whose
    entry it still lacks (position ``p`` predicts token ``p + 1``). They are the first of the
    chunk's positions that the runner returns, followed by its sampling row, if any."""
    if not seq.needs_prompt_logprobs:
        return 0
    first = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
    end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens - 1)
    return max(end - first, 0)


def first_position(seq: Sequence) -> int:
    """The position of the first row :func:`rows_this_step` counts."""
    return max(seq.num_computed_tokens, len(seq.prompt_logprobs))


def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: Seq[int],
    num_top: int,
) -> list[PromptLogprob]:
    """The entries of ``targets[i]`` from ``hidden[i]`` (the final hidden state of the
    position before it). ``num_top``: the alternatives per position (-1: all)."""
    entries: list[PromptLogprob] = []
    target = to_device(list(targets), torch.int64, hidden.device)
    for start in range(0, len(targets), SLICE_ROWS):
        logprobs = torch.log_softmax(compute_logits(hidden[start : start + SLICE_ROWS]), dim=-1)
        wanted = target[start : start + SLICE_ROWS, None]
        picked = logprobs.gather(1, wanted)  # [n, 1]
        rank = (logprobs >= picked).sum(dim=-1)  # as vLLM: ties count ahead
        vocab = logprobs.shape[1]
        k = vocab if num_top < 0 else min(num_top, vocab)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        # the copies to the host wait for the slice once
        picked_h, rank_h = picked.squeeze(1).tolist(), rank.tolist()
        if k:
            pairs = zip(top_ids.tolist(), top_values.tolist())
            tops = [dict(zip(ids, values)) for ids, values in pairs]
        else:
            tops = [{} for _ in picked_h]
        chunk = targets[start : start + SLICE_ROWS]
        for token_id, lp, r, top in zip(chunk, picked_h, rank_h, tops):
            entries.append(PromptLogprob(int(token_id), lp, r, top))
    return entries
