"""What the engine hands back for a request."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

T = TypeVar("T")


class RequestOutputKind(enum.Enum):
    """Which outputs :meth:`engine.llm_engine.LLMEngine.step` hands back for a request (as
    vLLM's ``SamplingParams.output_kind``). ``CUMULATIVE``: one after every step that gave
    it tokens, each with everything so far. ``DELTA``: one after every such step, each with
    only what is new since the request's previous output (its ``token_ids``, ``text``,
    ``logprobs`` and ``top_logprobs``), so that building it does not grow with the output
    (the server streams these). ``FINAL_ONLY``: only the finished one, cumulative; the
    steps before build none, which spares the engine thread a copy of the request's token
    ids and text per step (``LLM.generate`` asks for this)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass(frozen=True)
class RequestTimes:
    """``time.perf_counter()`` stamps of a request in the engine (None: not yet)."""

    arrival: float  # added to the engine
    scheduled: float | None  # first left the waiting queue (to run, or to load its KV)
    first_token: float | None
    last_token: float | None


@dataclasses.dataclass(frozen=True)
class PromptLogprob:
    """What the model gave one prompt token, from the tokens before it (vLLM's
    ``prompt_logprobs`` entry): its log-probability (log-softmax of the raw logits), its
    rank (1 = most likely; tokens as likely count ahead of it, as in vLLM) and the ``k``
    most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step; the last one has ``finished`` set.

    ``prompt_token_ids`` is one list shared by every output of the request: read it, do
    not change it. ``token_ids``, ``text`` and ``logprobs`` are cumulative, or with
    :attr:`RequestOutputKind.DELTA` only what is new since the request's previous output;
    ``delta_text`` is the text that is new since then (for streaming). While a request has
    stop strings, the last ``len(longest stop) - 1`` characters are held back until it is
    clear they do not start a stop string.
    """

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (including a final stop/eos token)
    text: str
    delta_text: str
    num_cached_tokens: int  # prompt tokens not computed: GPU prefix hit + connector-loaded
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id, if one ended it
    logprobs: list[float] | None = None  # of each chosen token, when asked for
    top_logprobs: list[dict[int, float]] | None = None  # when asked for logprobs=k > 0
    # when asked for prompt_logprobs: None for the first prompt token (nothing precedes it),
    # then one entry per prompt token; the same list in every output of the request
    prompt_logprobs: list[PromptLogprob | None] | None = None
    times: RequestTimes | None = None  # when it was added, scheduled, got its first and last token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def frozen(cls: type[T], **fields: Any) -> T:
    """``cls(**fields)`` for a frozen dataclass, with every field given: the fields go into
    the instance's dict at once, not through one ``object.__setattr__`` call each as the
    frozen ``__init__`` does (2 µs of the 3 a :class:`RequestOutput` took; one is built
    per request per step when streaming)."""
    if fields.keys() != cls.__dataclass_fields__.keys():
        raise TypeError(f"{cls.__name__} needs all of its fields, got {sorted(fields)}")
    instance = object.__new__(cls)
    instance.__dict__.update(fields)
    return instance
