"""Verifying draft tokens against the target model's logits, for a whole step at once.

The target scored the last accepted token and the ``k`` drafts in one forward: row ``i`` of
its logits predicts the token after draft ``i`` (row 0: after the last accepted token)::

    input:   t   d1  d2 ... dk
    logits:  p0  p1  p2 ... pk      accept d1 against p0, d2 against p1, ...

Greedy: drafts are accepted while each equals the target's argmax; the first mismatch is
replaced by the argmax, and when all match ``argmax(pk)`` is a bonus token. A seeded
request, likewise, against the token its seed draws at each position (the sampler's
exponential race with that position's noise: :func:`engine.sampler.position_seed`), so it
emits what it would without speculation. Other sampled requests: the
standard rejection rule (Leviathan et al., Chen et al.): draft ``x`` drawn from ``q`` is
accepted with probability ``min(1, p(x) / q(x))``; the first rejected one is replaced by a
sample of ``max(0, p - q)`` normalised; all accepted, a bonus is drawn from ``pk``. Each
emitted token is then distributed exactly as the target's sampler would draw it. A
proposer without a distribution (ngram) counts as one-hot ``q``: accept with ``p(x)``.

:func:`verify_rows` does this for every row of a step on the device, padded to the
longest row's ``K`` drafts, and brings back all the emitted tokens in one host sync. A row
with no drafts is sampled as :class:`~engine.sampler.Sampler` samples it (same tokens, same
draws from its generator), so that a step's plain rows share that sync::

    drafts   [R, K]     d (pad -1)          accept  [R, K]  while matching / u·q(x) < p(x)
    out      [R, K+1]   d1 .. d(a) t        accepted [R]    cumprod(accept).sum()
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import numpy as np
import torch

from engine.host_staging import to_device
from engine.sampler import Sample, SampleError, draw, filtered_probs, position_seed
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.speculator import composes_with_speculation, place_drafts


class VerifyRow(NamedTuple):
    """One sequence of the step: where its ``k + 1`` logits start, its drafts and their ``q``."""

    first_logit: int
    draft_ids: Seq[int] | torch.Tensor  # k >= 0; a tensor: [k] int64 on the logits' device
    params: SamplingParams
    generator: torch.Generator
    draft_probs: torch.Tensor | None = None  # [k, vocab]; None: one-hot
    position: int = 0  # the output index of the token logits[first_logit] predicts


def verifiable(seq: Sequence) -> bool:
    """Whether verification may pick ``seq``'s tokens: its sampling has no per-token state
    (logprobs, penalties, bias, grammar, ``min_tokens`` still suppressing stops)."""
    return seq.num_output_tokens >= seq.params.min_tokens and composes_with_speculation(seq.params)


def verify_step(logits: torch.Tensor, rows: Seq[VerifyRow]) -> list[list[Sample] | SampleError]:
    """:func:`verify_rows`, the samples to append; if the batch raises, each row is verified
    again alone, so that only the rows that raise on their own fail (their generators have
    drawn once more then, as in :class:`~engine.sampler.Sampler`)."""
    try:
        return [[Sample(t, None, None) for t in tokens] for tokens in verify_rows(logits, rows)]
    except Exception:
        return [_verify_alone(logits, row) for row in rows]


def _verify_alone(logits: torch.Tensor, row: VerifyRow) -> list[Sample] | SampleError:
    try:
        return [Sample(t, None, None) for t in verify_rows(logits, [row])[0]]
    except Exception as e:
        return SampleError(e)


def verify(
    logits: torch.Tensor,  # [k+1, vocab] float32, the target's
    draft_ids: list[int] | torch.Tensor,  # k
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k, vocab] the drafts' q; None: one-hot
) -> list[int]:
    """The tokens to emit for one sequence: the accepted drafts, then one target token."""
    if logits.shape[0] != len(draft_ids) + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(draft_ids)} draft tokens")
    return verify_rows(logits, [VerifyRow(0, draft_ids, params, generator, draft_probs)])[0]


def verify_rows(logits: torch.Tensor, rows: Seq[VerifyRow]) -> list[list[int]]:
    """The tokens each row emits (1..k+1): row ``r`` reads ``logits[first_logit : first_logit
    + k + 1]`` (``logits``: ``[M, vocab]`` float32). One host sync for the whole step: drafts
    already on the device are not read on the host."""
    device = logits.device
    num = len(rows)
    ks = np.fromiter((len(r.draft_ids) for r in rows), np.int64, num)  # [R]
    width = int(ks.max()) if num else 0  # K
    firsts = np.fromiter((r.first_logit for r in rows), np.int64, num)
    positions = np.minimum(np.arange(width + 1)[None, :], ks[:, None])  # [R, K+1]
    drafts_np = np.full((num, width + 1), -1, dtype=np.int64)  # [R, K+1]; column K stays -1
    on_device = []  # rows whose drafts a draft model left on the device
    for r, row in enumerate(rows):
        if isinstance(row.draft_ids, torch.Tensor):
            on_device.append(r)
        else:
            drafts_np[r, : ks[r]] = row.draft_ids
    index = to_device((firsts[:, None] + positions).ravel().tolist(), torch.int64, device)
    drafts = to_device(drafts_np.ravel().tolist(), torch.int64, device).view(num, width + 1)
    if on_device:
        place_drafts(drafts.view(-1), [r * (width + 1) for r in on_device],
                     [rows[r].draft_ids for r in on_device])

    out = logits.argmax(dim=-1).index_select(0, index).view(num, width + 1)  # [R, K+1]
    # greedy: the argmax where each draft matches it, then the argmax at the first mismatch
    accept = drafts[:, :width] == out[:, :width]  # [R, K]; padding (-1) never matches
    random = [r for r, row in enumerate(rows) if not row.params.is_greedy]
    seeded = [r for r in random if rows[r].params.seed is not None]
    if seeded:
        random = [r for r in random if rows[r].params.seed is None]
        picked = to_device(seeded, torch.int64, device)
        seeded_logits = logits.index_select(0, index.view(num, width + 1)[picked].ravel())
        tokens = _seeded_draws(seeded_logits, [rows[r] for r in seeded], width)
        out.index_copy_(0, picked, tokens)
        accept.index_copy_(0, picked, drafts.index_select(0, picked)[:, :width] == tokens[:, :width])
    if random:
        picked = to_device(random, torch.int64, device)
        random_logits = logits.index_select(0, index.view(num, width + 1)[picked].ravel())
        tokens, accepted = _rejection_sample(
            random_logits, [rows[r] for r in random], drafts.index_select(0, picked)
        )
        out.index_copy_(0, picked, tokens)
        accept.index_copy_(0, picked, accepted)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)  # [R, 1]
    host = torch.cat([num_accepted, out], dim=1).tolist()  # the step's host sync
    return [values[1 : values[0] + 2] for values in host]


def _seeded_draws(logits: torch.Tensor, rows: Seq[VerifyRow], width: int) -> torch.Tensor:
    """The tokens seeded rows draw at each of their positions (``logits``: ``[S*(K+1),
    vocab]``; returns ``[S, K+1]``): at output index ``position + j`` the token the sampler
    draws there, ``argmax(p / E)`` with the noise ``E`` of that index's seed. A draft is
    accepted while it is that token, so the request emits the tokens it would without
    speculation, each distributed as ``p``; a draft ``x`` then passes with probability
    ``p(x)``, as an ngram draft does under the rejection rule (a draft model proposes with
    the same noise, :meth:`~engine.spec_decode.draft.DraftProposer.propose`, which makes its
    draft the target's token whenever the two distributions agree enough)."""
    num = len(rows)
    p = filtered_probs(logits, [row.params for row in rows for _ in range(width + 1)])
    noise = torch.ones_like(p).view(num, width + 1, -1)  # [S, K+1, V]; padding never read
    for s, row in enumerate(rows):
        for j in range(len(row.draft_ids) + 1):
            generator = row.generator.manual_seed(position_seed(row.params.seed, row.position + j))
            noise[s, j].exponential_(generator=generator)
    return (p.view(num, width + 1, -1) / noise).argmax(dim=2)  # [S, K+1]


def _rejection_sample(
    logits: torch.Tensor, rows: Seq[VerifyRow], drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule for sampled rows (``logits``: ``[S*(K+1), vocab]``, ``drafts``:
    ``[S, K+1]``). Returns the tokens ``[S, K+1]`` (the drafts, with the correction or bonus
    written at every position: only the first past the accepted ones is read) and which
    drafts pass ``[S, K]``. Each row's generator draws ``k`` uniforms, then a token, as
    ``torch.rand`` and ``torch.multinomial`` would."""
    num, width = drafts.shape[0], drafts.shape[1] - 1
    device = logits.device
    p = filtered_probs(logits, [row.params for row in rows for _ in range(width + 1)])
    p = p.view(num, width + 1, -1)  # [S, K+1, V]
    vocab = p.shape[2]
    valid = drafts[:, :width] >= 0  # [S, K]
    safe = drafts.clamp(min=0)
    p_x = p[:, :width].gather(2, safe[:, :width, None]).squeeze(2)  # [S, K]
    q = None
    if any(row.draft_probs is not None for row in rows):
        q = torch.zeros(num, width + 1, vocab, dtype=p.dtype, device=device)  # [S, K+1, V]
        for s, row in enumerate(rows):
            k = len(row.draft_ids)
            if row.draft_probs is not None:
                q[s, :k].copy_(row.draft_probs)
            elif k:  # one-hot among rows with a distribution
                q[s, :k].scatter_(1, safe[s, :k, None], 1.0)
        q_x = q[:, :width].gather(2, safe[:, :width, None]).squeeze(2)
    else:
        q_x = torch.ones_like(p_x)
    u = torch.zeros(num, width, dtype=p.dtype, device=device)  # [S, K]
    for s, row in enumerate(rows):
        if len(row.draft_ids):
            u[s, : len(row.draft_ids)].uniform_(generator=row.generator)
    accepted = (u * q_x < p_x) & valid  # u < p/q
    first_rejected = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [S]
    at = torch.arange(num, device=device)
    p_at = p[at, first_rejected]  # [S, V]
    if q is not None:
        residual = (p_at - q[at, first_rejected]).clamp_(min=0)
    else:  # one-hot q: p without the rejected draft (column K is -1: the bonus keeps p)
        rejected = drafts[at, first_rejected]
        residual = p_at.masked_fill(torch.arange(vocab, device=device) == rejected[:, None], 0.0)
    # p == q (a rejection then has probability 0): sample p
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_at)
    token = draw(residual, [row.generator for row in rows])  # [S]
    tokens = torch.where(torch.arange(width + 1, device=device) < first_rejected[:, None],
                         safe, token[:, None])
    return tokens, accepted
