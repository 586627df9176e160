"""Sampling parameters and the sampler that turns a batch of logits into next tokens."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

_MAX_SEED = 2**63 - 1
# Below this temperature sampling is greedy, as in vLLM: the distribution is one-hot in all
# but name, and a temperature past float32's range (1e-40 is 0 there) would divide by zero.
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (names and defaults as in vLLM).

    - ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_TEMPERATURE``
      (1e-5). ``top_k=None`` and ``top_p=1.0`` disable those filters; a ``top_k`` of the
      vocabulary's size or more keeps every token, and the most likely token always survives
      ``top_p``.
    - ``seed`` gives the request its own random generator, so its samples do not depend on
      what else is in the batch. Without a seed the engine derives one from its own seed
      and the order in which requests arrive.
    - ``max_tokens=None`` generates until a stop condition or ``max_model_len``.
    - ``stop`` strings end generation; the output text is cut before the stop string (the
      token ids keep the token that completed it). ``stop_token_ids`` and, unless
      ``ignore_eos``, the model's eos tokens end generation and are kept in the token ids
      but not in the text. ``min_tokens`` suppresses all of these until that many tokens exist.
    - ``logprobs``: ``True`` or ``0`` returns the log-probability of each chosen token; an
      integer ``k > 0`` also returns the ``k`` most likely tokens at each step. They are
      log-softmax of the model's raw logits (before temperature and filters).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalize list/str arguments once, at construction, so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.top_k is not None and not _is_int(self.top_k, minimum=1):
            raise ValueError(f"top_k must be None (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed, minimum=0) and self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and not _is_int(self.max_tokens, minimum=1):
            raise ValueError(f"max_tokens must be None or positive, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens, minimum=0):
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        if not all(_is_int(i, minimum=0) for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}"
            )
        lp = self.logprobs
        if not (lp is None or isinstance(lp, bool) or _is_int(lp, minimum=0)):
            raise ValueError(f"logprobs must be None, a bool or a non-negative integer, got {lp!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    @property
    def num_top_logprobs(self) -> int:
        """How many alternatives to return per step besides the chosen token."""
        if isinstance(self.logprobs, bool) or self.logprobs is None:
            return 0
        return self.logprobs


class SamplingRow(NamedTuple):
    """One row of the logits batch and what the sampler needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator
    suppressed_token_ids: Sequence[int] = ()  # stop/eos ids while below min_tokens


class Sample(NamedTuple):
    token_id: int
    logprob: float | None  # of the chosen token; None unless asked for
    top_logprobs: dict[int, float] | None  # None unless logprobs=k with k > 0


class SampleError(NamedTuple):
    """Sampling this row raised: only its request fails."""

    error: Exception


class Sampler:
    """Greedy, temperature, top-k and top-p sampling of a batch with per-request generators."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sample | SampleError]:
        """``logits``: ``[M, vocab]`` float32, one row per entry of ``rows``; may be modified.

        A batch that raises is sampled again row by row, so that only the rows that raise on
        their own fail (as a :class:`SampleError`). The others are drawn again then, so a
        seeded row's token may differ from the one the batch would have given it.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} requests")
        if not rows:
            return []
        try:
            return _sample(logits, rows)
        except Exception:
            return [_sample_alone(logits[i : i + 1], row) for i, row in enumerate(rows)]


def _sample_alone(logits: torch.Tensor, row: SamplingRow) -> Sample | SampleError:
    try:
        return _sample(logits, [row])[0]
    except Exception as e:
        return SampleError(e)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sample]:
    logprob_rows = [i for i, r in enumerate(rows) if r.params.wants_logprobs]
    logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

    for i, row in enumerate(rows):
        if row.suppressed_token_ids:
            logits[i, list(row.suppressed_token_ids)] = float("-inf")

    token_ids = logits.argmax(dim=-1)  # [M]; kept for greedy rows
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [rows[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]

    chosen = token_ids.tolist()
    samples = [Sample(t, None, None) for t in chosen]
    if logprobs is not None:
        picked = logprobs.gather(1, token_ids[logprob_rows, None]).squeeze(1).tolist()
        for j, i in enumerate(logprob_rows):
            k = rows[i].params.num_top_logprobs
            top = None
            if k:
                values, ids = logprobs[j].topk(min(k, logprobs.shape[1]))
                top = dict(zip(ids.tolist(), values.tolist()))
            samples[i] = Sample(chosen[i], picked[j], top)
    return samples


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (applied in that order). [R, vocab].

    A row without a finite logit (every token suppressed) has no distribution; it gets its
    argmax, as a greedy row does, rather than NaNs that ``multinomial`` rejects.
    """
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    scaled = logits / temperature.to(logits.device)[:, None]
    if all(p.top_k is None and p.top_p == 1.0 for p in params):
        probs = torch.softmax(scaled, dim=-1)
    else:
        vocab = scaled.shape[1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, vocab]
        rank = torch.arange(vocab, device=scaled.device)[None, :]
        top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=scaled.device)
        sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype, device=scaled.device)
        # Drop a token when the more likely ones already reach top_p; the first always stays
        # (a top_p below float32's smallest number is 0, which would drop it too).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_((before >= top_p[:, None]) & (rank > 0), float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)
        probs = torch.softmax(filtered, dim=-1)
    empty = probs.isnan().any(dim=-1, keepdim=True)  # [R, 1]
    argmax = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(empty, argmax, probs)


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
