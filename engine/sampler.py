"""Sampling parameters and the sampler that turns a batch of logits into next tokens."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.host_staging import to_device
from engine.outputs import RequestOutputKind
from engine.penalties import TokenCounts, apply_penalties
from engine.structured_output import GrammarState, StructuredOutputSpec, apply_token_masks

_MAX_SEED = 2**63 - 1
_new_tuple = tuple.__new__
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
    - ``prompt_logprobs``: ``k`` returns, for each prompt token after the first, its
      log-probability given the tokens before it, its rank and the ``k`` most likely tokens
      there (``0``: none of those; ``-1``: the whole vocabulary). Such a request computes
      its whole prompt: it does not use the prefix cache or the KV tiers.
    - ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) and ``repetition_penalty``
      (> 0) as vLLM defines them (:mod:`engine.penalties`); ``min_p`` (in [0, 1]) drops tokens
      less likely than ``min_p`` times the most likely one (after temperature);
      ``logit_bias`` maps token ids to a bias in [-100, 100] added to their logits. Logits
      go through, in vLLM's order: ``min_tokens`` suppression and ``logit_bias``, penalties,
      then greedy choice, or temperature, ``min_p``, ``top_k``, ``top_p`` and sampling.
    - ``structured_output``: a grammar the output must match (:mod:`engine.structured_output`);
      tokens it forbids are masked before sampling, and the request stops when it ends. It
      cannot be combined with ``min_tokens`` (the grammar decides where the output ends).
    - ``include_stop_str_in_output``: keep the stop string that ended the request at the end
      of its text (vLLM's); by default the text is cut before it.
    - ``output_kind``: every step's cumulative output, or only the final one
      (:class:`engine.outputs.RequestOutputKind`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputSpec | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalize list/str arguments once, at construction, so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.top_k is not None and not _is_int(self.top_k, minimum=1):
            raise ValueError(f"top_k must be None (off) or a positive integer, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id, minimum=0):
                raise ValueError(f"logit_bias keys must be token ids, got {token_id!r}")
            _check_number("logit_bias", bias, -100.0, 100.0)
        if self.seed is not None and not (_is_int(self.seed, minimum=-_MAX_SEED - 1) and self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or a 64-bit integer in [-2**63, 2**63), got {self.seed!r}")
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
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        lp = self.logprobs
        if not (lp is None or isinstance(lp, bool) or _is_int(lp, minimum=0)):
            raise ValueError(f"logprobs must be None, a bool or a non-negative integer, got {lp!r}")
        plp = self.prompt_logprobs
        if not (plp is None or _is_int(plp, minimum=-1)):
            raise ValueError(
                f"prompt_logprobs must be None, -1 (the whole vocabulary) or a non-negative "
                f"integer, got {plp!r}"
            )
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutputSpec):
            raise ValueError(f"structured_output must be a StructuredOutputSpec, got {so!r}")
        if so is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy, without logprobs, logit_bias or penalties: the sampler's argmax alone
        (computed once: the sampler asks for every row of every step)."""
        return self.is_greedy and not (self.wants_logprobs or self.logit_bias or self.has_penalties)

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
    token_counts: TokenCounts | None = None  # the sequence's, when it has penalties
    grammar: GrammarState | None = None  # the sequence's, when it has structured output


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
        return self.launch(logits, rows).samples()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSamples:
        """Queue the batch's draws on the device; :meth:`PendingSamples.samples` brings them
        to the host (the step's one sync). In between, the drawn ids can feed the next
        forward on the device (:mod:`engine.lookahead`)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} requests")
        pending = PendingSamples(logits, rows)
        if rows:
            try:
                pending.drawn = _draw_batch(logits, rows)
                pending.staged = _stage(pending.drawn)
            except Exception:
                pending.fall_back()
        else:
            pending.done = []
        return pending


class _Drawn(NamedTuple):
    """A batch's draws, on the device (or their pinned host copies, :func:`_stage`)."""

    token_ids: torch.Tensor  # [M] int64
    logprob_rows: list[int]  # rows that asked for logprobs
    picked: torch.Tensor | None  # [L] the chosen tokens' logprobs
    top: torch.return_types.topk | None  # [L, k]
    num_top: list[int]  # per logprob row


class PendingSamples:
    """The samples of a launched batch (:meth:`Sampler.launch`)."""

    def __init__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        self._logits, self._rows = logits, rows
        self.drawn: _Drawn | None = None
        self.staged: tuple[_Drawn, torch.cuda.Event | None] | None = None  # on their way to the host
        self.done: list[Sample | SampleError] | None = None

    @property
    def token_ids(self) -> torch.Tensor | None:
        """``[M]`` the drawn ids on the device; None once the batch fell back to row by row."""
        return self.drawn.token_ids if self.drawn is not None else None

    def samples(self) -> list[Sample | SampleError]:
        if self.done is None:
            try:
                host, copied = self.staged
                if copied is not None:
                    copied.synchronize()  # the draws only, not what was queued after them
                self.done = _to_host(host)
            except Exception:
                self.fall_back()
        return self.done

    def fall_back(self) -> None:
        self.drawn = self.staged = None
        self.done = [_sample_alone(self._logits[i : i + 1], row) for i, row in enumerate(self._rows)]


def _sample_alone(logits: torch.Tensor, row: SamplingRow) -> Sample | SampleError:
    try:
        return _to_host(_draw_batch(logits, [row]))[0]  # a sync, but a fallback is rare
    except Exception as e:
        return SampleError(e)


def _draw_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> _Drawn:
    device = logits.device
    # One pass over the rows finds what the batch needs beyond an argmax; a plain greedy
    # row (the params' answer is computed once per params object) needs nothing more.
    logprob_rows: list[int] = []
    random_rows: list[int] = []
    biased = penalized = masked = False
    for i, r in enumerate(rows):
        params = r.params
        if params.is_plain_greedy and r.grammar is None and not r.suppressed_token_ids:
            continue
        if params.wants_logprobs:
            logprob_rows.append(i)
        if not params.is_greedy:
            random_rows.append(i)
        biased = biased or bool(r.suppressed_token_ids or params.logit_bias)
        penalized = penalized or (params.has_penalties and r.token_counts is not None)
        masked = masked or r.grammar is not None
    logprob_index = logprobs = None
    if logprob_rows:
        logprob_index = to_device(logprob_rows, torch.int64, device)
        logprobs = torch.log_softmax(logits.index_select(0, logprob_index), dim=-1)

    if biased:
        logits = _biased(logits, rows)
    if penalized:
        logits = _penalized(logits, rows)
    if masked:
        apply_token_masks(logits, [r.grammar for r in rows])
    token_ids = logits.argmax(dim=-1)  # [M]; kept for greedy rows
    if random_rows:
        random_index = to_device(random_rows, torch.int64, device)
        probs = filtered_probs(logits.index_select(0, random_index), [rows[i].params for i in random_rows])
        token_ids[random_index] = draw(
            probs, [rows[i].generator for i in random_rows]
        )

    picked = top = None
    num_top = [rows[i].params.num_top_logprobs for i in logprob_rows]
    if logprobs is not None:
        picked = logprobs.gather(1, token_ids.index_select(0, logprob_index)[:, None]).squeeze(1)
        if max(num_top):
            top = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)  # [L, k]
    return _Drawn(token_ids, logprob_rows, picked, top, num_top)


def _stage(drawn: _Drawn) -> tuple[_Drawn, torch.cuda.Event | None]:
    """On CUDA, the draws copied into pinned host memory behind an event: the host then waits
    for the draws alone, not for work queued after them (a forward launched ahead; a
    ``.tolist()`` on the device tensor would wait for the whole stream)."""
    if not drawn.token_ids.is_cuda:
        return drawn, None

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    top = drawn.top
    if top is not None:
        top = torch.return_types.topk((pinned(top.values), pinned(top.indices)))
    host = drawn._replace(token_ids=pinned(drawn.token_ids), picked=pinned(drawn.picked), top=top)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(drawn.token_ids.device))
    return host, copied


def _to_host(drawn: _Drawn) -> list[Sample]:
    chosen = drawn.token_ids.tolist()  # on the host: the copy ran (_stage); or a CPU tensor
    # tuples made as Sample's own __new__ (Python code, per row per step) would make them
    samples = [_new_tuple(Sample, (t, None, None)) for t in chosen]
    if drawn.picked is not None:
        picked_list = drawn.picked.tolist()
        top = drawn.top
        top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else ((), ())
        for j, i in enumerate(drawn.logprob_rows):
            k = drawn.num_top[j]
            alternatives = dict(zip(top_ids[j][:k], top_values[j][:k])) if k else None
            samples[i] = Sample(chosen[i], picked_list[j], alternatives)
    return samples


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """A token per row of ``probs`` (``[R, vocab]``, unnormalised), row ``r`` drawn with
    ``generators[r]``: what ``torch.multinomial(probs[r], 1)`` draws, without the host sync
    in which it checks its input."""
    noise = torch.empty_like(probs)  # [R, V]
    for r, generator in enumerate(generators):
        noise[r].exponential_(generator=generator)
    return (probs / noise).argmax(dim=1)  # [R]


def _biased(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias``, its suppressed tokens at -inf: one batched
    scatter (a new tensor, so that a batch sampled again row by row starts from the model's)."""
    row_index, token_index, values = [], [], []
    for i, row in enumerate(rows):
        for token in row.suppressed_token_ids:
            row_index.append(i), token_index.append(token), values.append(float("-inf"))
        for token, bias in row.params.logit_bias:
            row_index.append(i), token_index.append(token), values.append(bias)
    if not row_index:
        return logits
    device = logits.device
    index = (to_device(row_index, torch.int64, device), to_device(token_index, torch.int64, device))
    return logits.index_put(index, to_device(values, logits.dtype, device), accumulate=True)


def _penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` with the penalties of the rows that have them (a new tensor when any)."""
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties and r.token_counts is not None]
    if not penalized:
        return logits
    params = [rows[i].params for i in penalized]
    index = to_device(penalized, torch.int64, logits.device)
    values = apply_penalties(
        logits.index_select(0, index),
        [rows[i].token_counts for i in penalized],
        presence=[p.presence_penalty for p in params],
        frequency=[p.frequency_penalty for p in params],
        repetition=[p.repetition_penalty for p in params],
    )
    return logits.index_copy(0, index, values)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p (in that order). [R, vocab].

    A row without a finite logit (every token suppressed) has no distribution; it gets its
    argmax, as a greedy row does, rather than NaNs.
    """
    device = logits.device
    temperature = to_device([p.temperature for p in params], logits.dtype, device)
    scaled = logits / temperature[:, None]
    if any(p.min_p for p in params):
        probs = torch.softmax(scaled, dim=-1)
        min_p = to_device([p.min_p for p in params], logits.dtype, device)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if all(p.top_k is None and p.top_p == 1.0 for p in params):
        probs = torch.softmax(scaled, dim=-1)
    else:
        vocab = scaled.shape[1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, vocab]
        rank = torch.arange(vocab, device=scaled.device)[None, :]
        top_k = to_device([min(p.top_k or vocab, vocab) for p in params], torch.int64, device)
        sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        top_p = to_device([p.top_p for p in params], scaled.dtype, device)
        # Drop a token when the more likely ones already reach top_p; the first always stays
        # (a top_p below float32's smallest number is 0, which would drop it too).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_((before >= top_p[:, None]) & (rank > 0), float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)
        probs = torch.softmax(filtered, dim=-1)
    empty = probs.isnan().any(dim=-1, keepdim=True)  # [R, 1]
    argmax = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(empty, argmax, probs)


def _check_number(name: str, value: object, low: float, high: float) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
