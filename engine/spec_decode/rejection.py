"""Verifying draft tokens against the target model's logits.

The target scored the last accepted token and the ``k`` drafts in one forward: row ``i`` of
its logits predicts the token after draft ``i`` (row 0: after the last accepted token)::

    input:   t   d1  d2 ... dk
    logits:  p0  p1  p2 ... pk      accept d1 against p0, d2 against p1, ...

Greedy: drafts are accepted while each equals the target's argmax; the first mismatch is
replaced by the argmax, and when all match ``argmax(pk)`` is a bonus token. Sampling: the
standard rejection rule (Leviathan et al., Chen et al.): draft ``x`` drawn from ``q`` is
accepted with probability ``min(1, p(x) / q(x))``; the first rejected one is replaced by a
sample of ``max(0, p - q)`` normalised; all accepted, a bonus is drawn from ``pk``. Each
emitted token is then distributed exactly as the target's sampler would draw it. A
proposer without a distribution (ngram) counts as one-hot ``q``: accept with ``p(x)``.
"""
from __future__ import annotations

import torch

from engine.sampler import Sample, SampleError, SamplingParams, filtered_probs
from engine.sequence import Sequence


def verify_drafts(seq: Sequence, logits: torch.Tensor) -> list[Sample] | SampleError:
    """:func:`verify` ``seq``'s pending draft tokens; an error fails only this sequence."""
    try:
        tokens = verify(logits, seq.spec_token_ids, seq.params, seq.generator, seq.spec_draft_probs)
    except Exception as e:
        return SampleError(e)
    return [Sample(t, None, None) for t in tokens]


def verify(
    logits: torch.Tensor,  # [k+1, vocab] float32, the target's
    draft_ids: list[int],  # k
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k, vocab] the drafts' q; None: one-hot
) -> list[int]:
    """The tokens to emit: the accepted drafts, then one target token (1..k+1 tokens)."""
    k = len(draft_ids)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {k} draft tokens")
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()  # the step's host sync for this row
        accepted = 0
        while accepted < k and draft_ids[accepted] == target[accepted]:
            accepted += 1
        return draft_ids[:accepted] + [target[accepted]]

    device = logits.device
    p = filtered_probs(logits, [params] * (k + 1))  # [k+1, vocab]
    drafts = torch.tensor(draft_ids, dtype=torch.int64, device=device)  # [k]
    rows = torch.arange(k, device=device)
    p_x = p[rows, drafts]
    q_x = draft_probs[rows, drafts] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
    rejected = (u * q_x >= p_x).tolist()  # u < p/q accepts; the row's host sync
    accepted = rejected.index(True) if True in rejected else k
    if accepted == k:
        bonus = torch.multinomial(p[k], 1, generator=generator)
        return draft_ids + [int(bonus)]
    if draft_probs is not None:
        residual = (p[accepted] - draft_probs[accepted]).clamp_(min=0)
    else:
        residual = p[accepted].clone()
        residual[draft_ids[accepted]] = 0
    if not residual.sum() > 0:  # p == q (a rejection then has probability 0): sample p
        residual = p[accepted]
    fix = torch.multinomial(residual, 1, generator=generator)  # multinomial normalises
    return draft_ids[:accepted] + [int(fix)]
