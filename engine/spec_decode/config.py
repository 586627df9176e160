"""``speculative_config``: vLLM's JSON shape, two methods.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
proposes tokens by prompt lookup; ``{"model": "/path/to/draft", "num_speculative_tokens": 4}``
(``method`` ``"draft_model"``, implied by ``model``) by a smaller checkpoint that shares
the target's vocabulary. Keys and defaults are vLLM's ``SpeculativeConfig``'s.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.json_config import from_json, from_mapping

METHODS = ("ngram", "draft_model")
# vLLM's other methods need weights or heads this engine does not load.
_UNSUPPORTED_METHODS = (
    "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix",
)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose draft tokens. ``method=None`` means ``draft_model`` when ``model`` is
    given. ``prompt_lookup_*`` (ngram only) bound the length of the suffix looked up; one
    given alone sets both, as in vLLM."""

    num_speculative_tokens: int | None = None
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if self.method in _UNSUPPORTED_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; use one of {', '.join(METHODS)}"
            )
        if self.method is not None and self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}"
            )
        if self.method is None and self.model is None:
            raise ValueError("speculative_config needs a method ('ngram') or a draft model")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative model must be a checkpoint folder, got {self.model!r}")
        if self.resolved_method == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method takes no model")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                value = getattr(self, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if self.lookup_min > self.lookup_max:
                raise ValueError(
                    f"prompt_lookup_min ({self.lookup_min}) must not exceed "
                    f"prompt_lookup_max ({self.lookup_max})"
                )
        else:
            if self.model is None:
                raise ValueError("the draft_model method needs a model (a checkpoint folder)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_max and prompt_lookup_min are for the ngram method")

    @property
    def resolved_method(self) -> str:
        return self.method or "draft_model"

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP

    @property
    def lookup_min(self) -> int:
        return self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's keys; ``ValueError`` for an unknown key."""
        return from_mapping(cls, data, "speculative_config")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config``; ``ValueError`` names what is wrong."""
        return from_json(cls, text, "speculative_config")
