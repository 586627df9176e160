"""``LLM``: offline batch generation, the way vLLM's ``LLM`` class is used."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence as Seq
from typing import Any

from engine.config import EngineConfig
from engine.connector import KVConnector
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """``LLM(model="tiny" | folder, **EngineConfig fields, kv_connector=None)``.

    >>> llm = LLM(max_model_len=256)
    >>> out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8))
    >>> out[0].token_ids
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        kv_connector: KVConnector | None = None,
        **engine_config: Any,
    ) -> None:
        config = EngineConfig(model=os.fspath(model), **engine_config)
        self.engine = LLMEngine(config, kv_connector=kv_connector)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | Seq[str | None] | None = None,
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one finished output per prompt, in order.

        ``prompts``: a string, a list of token ids (one prompt), or a list of either.
        ``sampling_params``, ``cache_salt`` and ``priority``: one for all prompts or one per
        prompt. ``priority`` needs ``scheduling_policy="priority"`` (lower is served first).
        """
        prompts = _normalize_prompts(prompts)
        n = len(prompts)
        params = _per_prompt("sampling_params", sampling_params, n, SamplingParams())
        salts = _per_prompt("cache_salt", cache_salt, n, None)
        priorities = _per_prompt("priority", priority, n, 0)
        return self._run([(*r, True) for r in zip(prompts, params, salts, priorities)])

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages)
        or to a list of conversations, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        params = _per_prompt("sampling_params", sampling_params, len(texts), SamplingParams())
        salts = _per_prompt("cache_salt", cache_salt, len(texts), None)
        # Chat templates write their own BOS.
        return self._run([(t, sp, salt, 0, False) for t, sp, salt in zip(texts, params, salts)])

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self, requests: list[tuple[Prompt, SamplingParams, str | None, int, bool]]
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        final_only: dict[int, SamplingParams] = {}  # only finished outputs are kept here
        try:
            for prompt, params, salt, priority, special in requests:
                if isinstance(params, SamplingParams):  # add_request refuses anything else
                    if id(params) not in final_only:
                        final_only[id(params)] = dataclasses.replace(
                            params, output_kind=RequestOutputKind.FINAL_ONLY
                        )
                    params = final_only[id(params)]
                ids.append(
                    engine.add_request(
                        prompt, params, cache_salt=salt,
                        add_special_tokens=special, priority=priority,
                    )
                )
            pending = set(ids)
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for request_id in ids:
                if request_id not in done:
                    engine.abort_request(request_id)
        return [done[i] for i in ids]


def _normalize_prompts(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and _all_ints(prompts):
        return [prompts]
    normalized: list[Prompt] = []
    for p in prompts:
        if isinstance(p, str):
            normalized.append(p)
        elif isinstance(p, Seq) and _all_ints(p):
            normalized.append(list(p))
        else:
            raise ValueError(
                "prompts must be a string, a list of token ids, or a list of strings / token-id "
                f"lists; got an element of type {type(p).__name__}"
            )
    return normalized


def _per_prompt(name: str, value: Any, count: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    if isinstance(value, (SamplingParams, str, int)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name}: {len(values)} values for {count} prompts")
    return values


def _all_ints(values: Seq[Any]) -> bool:
    """Every value an int and none a bool; a C loop when every value is a plain int."""
    if set(map(type, values)) <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)
