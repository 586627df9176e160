"""The sampler that turns a batch of logits into next tokens, one host sync per step."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.host_staging import to_device
from engine.penalties import TokenCounts, apply_penalties
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState, apply_token_masks

_new_tuple = tuple.__new__
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for output token ``position``: a
    request's tokens then depend on its seed and their logits alone, not on how many
    numbers it drew before (drafts verified or proposed, a batch sampled again row by row).
    SplitMix64's finaliser over the seed and the position, so nearby seeds and positions
    give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SamplingRow(NamedTuple):
    """One row of the logits batch and what the sampler needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator
    suppressed_token_ids: Sequence[int] = ()  # stop/eos ids while below min_tokens
    token_counts: TokenCounts | None = None  # the sequence's, when it has penalties
    grammar: GrammarState | None = None  # the sequence's, when it has structured output
    # a seeded request's output index at this step: its draw is keyed by it (position_seed)
    position: int | None = None


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
        their own fail (as a :class:`SampleError`). The others are drawn again then: a
        seeded request's row (``position``) draws the token the batch would have given it,
        another row may draw another.
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
            probs, [rows[i].generator for i in random_rows], [_draw_seed(rows[i]) for i in random_rows]
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


def draw(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator],
    seeds: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """A token per row of ``probs`` (``[R, vocab]``, unnormalised), row ``r`` drawn with
    ``generators[r]``: what ``torch.multinomial(probs[r], 1)`` draws, without the host sync
    in which it checks its input. A row with a seed in ``seeds`` reseeds its generator with
    it first (:func:`position_seed`): the exponential race's noise then depends on that
    seed alone, so verification can draw the very token this draw would."""
    noise = torch.empty_like(probs)  # [R, V]
    for r, generator in enumerate(generators):
        seed = seeds[r] if seeds is not None else None
        if seed is not None:
            generator.manual_seed(seed)
        noise[r].exponential_(generator=generator)
    return (probs / noise).argmax(dim=1)  # [R]


def _draw_seed(row: SamplingRow) -> int | None:
    return None if row.position is None else position_seed(row.params.seed, row.position)


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
