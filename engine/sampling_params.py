"""A request's sampling options, :class:`SamplingParams` (names and defaults as in vLLM).

Every option is checked when the params are made: a bad one raises ``ValueError`` whose
message begins with the option's name, which the server's 400 reports as its ``param``
(:mod:`tiered_kv.protocol_requests`). List and dict arguments (``stop``, ``stop_token_ids``,
``logit_bias``) become tuples there, so params are frozen and hashable. What the options do
to the logits is :class:`~engine.sampler.Sampler`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from engine.outputs import RequestOutputKind
from engine.structured_output import StructuredOutputSpec

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
    - ``seed`` draws each output token with noise seeded by the seed and the token's
      position, so its samples do not depend on what else is in the batch, on preemptions
      or on speculative decoding. Without a seed the request gets a generator seeded from
      the engine's seed and the order in which requests arrive.
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


def _check_number(name: str, value: object, low: float, high: float) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
