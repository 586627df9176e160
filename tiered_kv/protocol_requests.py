"""The OpenAI API's request bodies and the admin routes', as pydantic models.

Generation requests accept OpenAI's fields and vLLM's sampling extras; a field they do not
know is a 400 naming it (nothing is ignored silently), and values this server cannot honour
(``tools``, ``suffix``...) are refused by :meth:`to_sampling_params` with a
:class:`RequestError` naming the parameter. Sampling values follow vLLM's rules
(``temperature`` at least 0, ``top_p`` in (0, 1], ``top_k`` -1 or 0 for off or at least 1,
``max_tokens`` at least 1, penalties as :class:`engine.sampling_params.SamplingParams` says);
integers must fit int64. Values left out come from the model's generation config
(:class:`~tiered_kv.generation_defaults.GenerationDefaults`), else vLLM's defaults.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.outputs import RequestOutputKind
from engine.sampling_params import SamplingParams
from tiered_kv.generation_defaults import GenerationDefaults
from tiered_kv.protocol_errors import RequestError
from tiered_kv.structured_output_fields import StructuredOutputError, structured_output_spec

MAX_INT = 2**63 - 1  # larger integers are refused, as vLLM refuses seeds beyond int64
# Every generated token is checked against each stop string on the engine thread, which
# every request shares: a request may not make that work unbounded.
MAX_STOP_STRINGS = 128
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
# Fields OpenAI's schema lets a client send as null, which means the default; here they have
# one that is not None.
NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it


class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: each chunk carries its choice's usage so far


class _SamplingFields(StrictRequest):
    """Fields shared by both routes."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # vLLM: no upper bound
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT)  # -1 and 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # any int64, as vLLM
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, clamped to [-100, 100]
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM extras
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    # structured output (tiered_kv/structured_output_fields.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = Field(default=0, ge=-MAX_INT - 1, le=MAX_INT)  # lower is served first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # keep only the prompt's last k tokens (-1: max_model_len), as vLLM
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT)
    # vLLM's: each prompt token's logprob and the k most likely there (-1: all); at most
    # --max-logprobs, not streamed
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_INT)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``"stream": null`` and the like (:data:`NULL_IS_DEFAULT`) as if left out, as OpenAI
        takes them; a field this route does not read stays an unknown one."""
        if not isinstance(data, dict):
            return data
        return {
            k: v for k, v in data.items()
            if not (v is None and k in NULL_IS_DEFAULT and k in cls.model_fields)
        }

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | bool | None, defaults: GenerationDefaults | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        d = defaults or GenerationDefaults()
        top_k = self.top_k if self.top_k is not None else d.top_k
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
        if self.stream and prompt_logprobs is not None:
            raise RequestError(
                "prompt logprobs are not streamed: leave out stream, or prompt_logprobs "
                "(and logprobs with echo)", param="prompt_logprobs",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if not all(stop):
            raise RequestError("stop strings must not be empty", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(
                f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed", param="stop"
            )
        try:
            structured = structured_output_spec(self)
        except StructuredOutputError as e:
            raise RequestError(str(e), param=e.param) from None
        try:
            return SamplingParams(
                temperature=_first(self.temperature, d.temperature, 1.0),
                top_p=_first(self.top_p, d.top_p, 1.0),
                top_k=top_k if top_k is not None and top_k > 0 else None,
                min_p=_first(self.min_p, d.min_p, 0.0),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=_first(self.repetition_penalty, d.repetition_penalty, 1.0),
                logit_bias=_logit_bias(self.logit_bias),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=structured,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                # a stream sends what is new in each output; a whole response needs the last
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split(" ")[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """vLLM's reading: keys are token ids written as integers, values clamped to [-100, 100]."""
    result = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(
                f"logit_bias keys must be token ids (non-negative integers as strings of digits), "
                f"got {key!r}", param="logit_bias"
            )
        token_id = int(key)
        if token_id > MAX_INT:
            raise RequestError(f"logit_bias has a too large token id {key!r}", param="logit_bias")
        if not math.isfinite(value):
            raise RequestError(f"logit_bias for {key!r} is {value}, not a finite number", param="logit_bias")
        result[token_id] = min(100.0, max(-100.0, value))
    return result


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_INT)  # 0: only with echo
    logprobs: int | None = Field(default=None, ge=0, le=MAX_INT)  # at most --max-logprobs
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_INT)
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's own (a BOS), as vLLM

    def to_sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """The parameters of every choice; ``best_of`` choices are generated per prompt (with
        logprobs, to rank them) when it is more than ``n``. ``echo`` with ``logprobs`` also
        asks for the prompt's (``prompt_logprobs``, unless given, is ``logprobs``)."""
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.stream and self.num_generated > self.n:
            raise RequestError("best_of > n cannot be streamed", param="best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        logprobs = self.logprobs if self.logprobs is not None or self.num_generated == self.n else 0
        return self._sampling_params(self.max_tokens, logprobs, defaults, self.num_prompt_logprobs)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt logprobs each choice asks for: ``prompt_logprobs``, else ``logprobs``
        with ``echo`` (the prompt's tokens come back with theirs), as vLLM."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """The prompts (text or token ids), one or a list of them."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if not all(prompts):
            raise RequestError("the prompt is empty", param="prompt")
        return prompts


class ContentPart(_Request):
    type: str
    text: str | None = None


# Fields of an assistant message that clients send back with the history as they got it
# (the `openai` client's `message.model_dump()`, vLLM's own responses): accepted when empty.
_OUTPUT_ONLY_MESSAGE_FIELDS = (
    "refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning_content", "reasoning",
)


class ChatMessage(StrictRequest):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_output_fields(cls, data: Any) -> Any:
        """A response's message sent back in the history: its empty output-only fields are
        dropped; one with content (a tool call, reasoning) is refused, naming it."""
        if not isinstance(data, dict):
            return data
        present = [f for f in _OUTPUT_ONLY_MESSAGE_FIELDS if f in data]
        if not present:
            return data
        data = dict(data)
        for field in present:
            if data[field] not in (None, [], {}, ""):
                raise ValueError(f"a message's {field} is not supported (only its content is read)")
            del data[field]
        return data

    def text(self) -> str:
        """The content as the chat template sees it: text parts joined by newlines, as vLLM
        joins them for a template that takes text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(
                    f"content parts of type {part.type!r} are not supported (only text)",
                    param="messages",
                )
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_INT)  # at most --max-logprobs
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # only "none" (no tools)
    # the chat template's (vLLM's fields)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open, for the model to go on
    chat_template_kwargs: dict[str, Any] | None = None
    # The template holds the special tokens the model expects; True adds the tokenizer's too.
    add_special_tokens: bool = False
    parallel_tool_calls: bool | None = None  # accepted: without tools there are no calls

    def to_sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        if self.tools:
            raise RequestError("tools are not supported", param="tools")
        check_continue_final_message(self.continue_final_message, self.add_generation_prompt)
        if self.tool_choice not in (None, "none"):
            raise RequestError("tool_choice other than \"none\" needs tools, which are not supported", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults, self.prompt_logprobs)

    def messages_as_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def check_continue_final_message(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a last message left open takes no generation prompt after it."""
    if continue_final_message and add_generation_prompt:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(add_generation_prompt is true unless set to false)", param="continue_final_message",
        )


# ---------------------------------------------------------------- admin


class EvictRequest(_Request):
    tier: Literal["cpu", "disk", "all"] = "cpu"
    namespace: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


class ClearRequest(_Request):
    namespace: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


class FlushRequest(_Request):
    timeout: float | None = Field(default=30.0, gt=0)
