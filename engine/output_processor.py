"""A request's text and outputs: detokenizes its sampled tokens, applies the stop
conditions that look at tokens or text, and builds its :class:`RequestOutput` s.

The engine appends each sampled token to the sequence, then asks :meth:`OutputProcessor.stop`
whether the request ends there. Stop strings are searched in the text as it grows; an
unfinished request's output holds back the last ``len(longest stop) - 1`` characters, which
may be the start of a stop string, so no output ever shows text that a stop later cuts::

    text:  | sent | new, shown | held back (could begin a stop) |
                  ^num_sent_chars

A request whose text nothing reads before its finish (``FINAL_ONLY``, no stop strings) is
detokenized at its finish instead (an abort's too), all its tokens in one decode, with the
text that token by token gives, where the tokenizer's decoder allows it
(:func:`engine.detokenizer.decodes_in_context`). An output read while it runs would
detokenize the tokens so far and go on token by token.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import PromptLogprob, RequestOutput, RequestOutputKind, RequestTimes, frozen
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

DETOKENIZER_CONTEXT = 4  # prompt tokens decoded before the first output token


@dataclasses.dataclass
class _TextState:
    """Detokenization and stop-string state of one request."""

    detokenizer: IncrementalDetokenizer
    prompt_token_ids: list[int]  # every output of the request shares this one list
    stop_ids: tuple[int, ...] = ()  # the request's stop_token_ids, and the eos ids unless ignore_eos
    deferred: bool = False  # its output tokens wait for its text to be read (at its finish)
    # the text in pieces, joined when read (text()): one string grown by each token's piece
    # was copied whole per token, and a request that neither has stop strings nor streams
    # reads its text once
    pieces: list[str] = dataclasses.field(default_factory=list)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0  # DELTA: output tokens (and logprobs) in outputs already built
    stop_reason: str | int | None = None
    # [None, *entries] once the prompt's entries are complete: every output shares it
    prompt_logprobs: list[PromptLogprob | None] | None = None

    def text(self) -> str:
        """The text so far (its pieces joined into one)."""
        if len(self.pieces) != 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0]

    def prompt_logprobs_of(self, seq: Sequence) -> list[PromptLogprob | None] | None:
        """The request's prompt logprobs so far, if it asked for them."""
        if self.prompt_logprobs is not None or seq.prompt_logprobs is None:
            return self.prompt_logprobs
        entries: list[PromptLogprob | None] = [None, *seq.prompt_logprobs]
        if not seq.needs_prompt_logprobs:
            self.prompt_logprobs = entries
        return entries


class OutputProcessor:
    """The text state of every unfinished request, by request id. Used by the engine's
    thread only."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Seq[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self._texts: dict[str, _TextState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start the text of a request (``prompt_token_ids`` is kept, not copied);
        ``ValueError`` if ``request_id`` has one already."""
        if request_id in self._texts:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = self._detokenizer(prompt_token_ids, params)
        stop_ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        deferred = (
            params.output_kind is RequestOutputKind.FINAL_ONLY
            and not params.stop
            and self.tokenizer.decodes_in_context is not None
        )
        self._texts[request_id] = _TextState(detokenizer, prompt_token_ids, stop_ids, deferred)

    def drop(self, request_id: str) -> None:
        """Forget a request that did not start after all."""
        del self._texts[request_id]

    def request_ids(self) -> list[str]:
        return list(self._texts)

    def stop(self, seq: Sequence, token: int, grammar_ended: bool) -> str | None:
        """Detokenize ``token``, just appended to ``seq``; the finish reason if the request
        ends with it (the caller finishes it): ``"stop"`` for a stop token, the end of its
        grammar or a stop string (the text is cut before it; ``stop_reason`` is the string, or
        a token of the request's ``stop_token_ids``), ``"length"`` for
        ``max_tokens`` or ``max_model_len``. A stop token is not detokenized."""
        params, state = seq.params, self._texts[seq.request_id]
        reason = None
        num_tokens = len(seq.token_ids)
        num_out = num_tokens - seq.num_prompt_tokens
        stop_token = num_out >= params.min_tokens and token in state.stop_ids
        # As vLLM: stop_reason names a stop token the request asked for; the model's own
        # eos (or the end of a grammar) leaves it None, the mark of a natural end.
        if stop_token or grammar_ended:
            reason = "stop"
            state.stop_reason = token if token in params.stop_token_ids else None
        elif (params.max_tokens is not None and num_out >= params.max_tokens) or (
            num_tokens >= self.max_model_len
        ):
            reason = "length"
        if state.deferred:
            if reason is not None:
                state.deferred = False
                ids = seq.token_ids[seq.num_prompt_tokens : num_tokens - 1 if stop_token else None]
                state.pieces.append(state.detokenizer.finish_with(ids))
            return reason
        new_text = "" if stop_token else state.detokenizer.add(token)
        if reason is not None:
            new_text += state.detokenizer.finish()
        state.pieces.append(new_text)
        if params.stop and num_out >= params.min_tokens:
            text = state.text()
            cut = _find_stop(text, params.stop, len(text) - len(new_text))
            if cut is not None:
                start, stop = cut
                end = start + len(stop) if params.include_stop_str_in_output else start
                state.pieces = [text[:end]]
                reason, state.stop_reason = "stop", stop
        return reason

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output now: its text so far and the delta since the last output.
        A finished request's text state is dropped."""
        finished = seq.is_finished
        state = self._texts.pop(seq.request_id) if finished else self._texts[seq.request_id]
        if state.deferred:  # read before stop() finished it: aborted, or read while it runs
            state.deferred, ids = False, seq.output_token_ids
            if finished:
                state.pieces.append(state.detokenizer.finish_with(ids, held_back=False))
            else:  # from here on, token by token
                state.pieces.extend(map(state.detokenizer.add, ids))
        params = seq.params
        if params.output_kind is RequestOutputKind.DELTA:
            return self._delta(seq, state)
        text, stops = state.text(), params.stop
        if stops and not finished:
            text = text[: max(len(text) - max(map(len, stops)) + 1, state.num_sent_chars)]
        delta, state.num_sent_chars = text[state.num_sent_chars :], len(text)
        return _output(
            seq, state, seq.output_token_ids, text, delta,
            list(seq.logprobs) if seq.logprobs is not None else None,
            list(seq.top_logprobs) if seq.top_logprobs is not None else None,
        )

    @staticmethod
    def _delta(seq: Sequence, state: _TextState) -> RequestOutput:
        """A ``DELTA`` output: the tokens, logprobs and text since the previous one. Without
        stop strings the text's pieces since then are all it joins (and then forgets)."""
        sent, stops = state.num_sent_tokens, seq.params.stop
        if stops:
            text = state.text()
            if not seq.is_finished:
                text = text[: max(len(text) - max(map(len, stops)) + 1, state.num_sent_chars)]
            delta, state.num_sent_chars = text[state.num_sent_chars :], len(text)
        else:
            delta = "".join(state.pieces)
            state.pieces.clear()
        tokens = seq.token_ids[seq.num_prompt_tokens + sent :]
        state.num_sent_tokens = sent + len(tokens)
        return _output(
            seq, state, tokens, delta, delta,
            seq.logprobs[sent:] if seq.logprobs is not None else None,
            seq.top_logprobs[sent:] if seq.top_logprobs is not None else None,
        )

    def failed(self, seq: Sequence) -> RequestOutput:
        """The final output of a request that failed (``finish_reason="error"``): the text
        already sent, no delta (a ``DELTA`` request's: its tokens since its last output, no
        text). Its text state is dropped."""
        state = self._texts.pop(seq.request_id, None)
        token_ids = seq.output_token_ids
        if seq.params.output_kind is RequestOutputKind.DELTA:  # no new text is sent
            token_ids = token_ids[state.num_sent_tokens :] if state is not None else token_ids
            text = ""
        else:
            text = state.text()[: state.num_sent_chars] if state is not None else ""
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=state.prompt_token_ids if state is not None else seq.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            delta_text="",
            num_cached_tokens=seq.num_cached_tokens or 0,
            finish_reason="error",
            prompt_logprobs=state.prompt_logprobs_of(seq) if state is not None else None,
            times=_times(seq),
        )

    def _detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """A detokenizer primed with the prompt's last tokens, so that the first output token
        decodes in context (SentencePiece decoders drop the leading space of a first token)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        pieces = [detokenizer.add(t) for t in prompt_token_ids[-DETOKENIZER_CONTEXT:]]
        if not pieces[-1]:  # the prompt ends inside a character: start clean instead
            detokenizer.finish()
        return detokenizer


def _output(
    seq: Sequence, state: _TextState, token_ids: list[int], text: str, delta: str,
    logprobs: list[float] | None, top_logprobs: list[dict[int, float]] | None,
) -> RequestOutput:
    return frozen(
        RequestOutput,
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=state.prompt_token_ids,
        token_ids=token_ids,
        text=text,
        delta_text=delta,
        num_cached_tokens=seq.num_cached_tokens or 0,
        finish_reason=seq.finish_reason,
        stop_reason=state.stop_reason,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=state.prompt_logprobs_of(seq),
        times=_times(seq),
    )


def _times(seq: Sequence) -> RequestTimes:
    return frozen(
        RequestTimes,
        arrival=seq.arrival_time,
        scheduled=seq.scheduled_time,
        first_token=seq.first_token_time,
        last_token=seq.last_token_time,
    )


def _find_stop(text: str, stops: Seq[str], searched_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``searched_from``."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, searched_from - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
