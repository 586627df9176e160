"""A paged LLM inference engine (see docs/engine.md)."""
from __future__ import annotations

from engine.async_engine import AsyncLLM
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import PromptLogprob, RequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "LLMEngine", "PromptLogprob", "RequestOutput",
           "RequestOutputKind", "SamplingParams"]
