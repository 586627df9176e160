"""The request fields that ask for structured output, read into one
:class:`engine.structured_output.StructuredOutputSpec`.

Accepted, as vLLM's OpenAI server accepts them, on both ``/v1/completions`` and
``/v1/chat/completions``:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar`` or
  ``json_object: true``, and optionally ``disable_any_whitespace``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``.

A request may use one of them; errors name the field.
"""
from __future__ import annotations

from typing import Any

from engine.structured_output import StructuredOutputSpec

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    """A structured output field the server cannot use; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_output_spec(request: Any) -> StructuredOutputSpec | None:
    """The spec ``request``'s fields ask for (``None``: free text). Raises
    :class:`StructuredOutputError` for a malformed field or for more than one constraint."""
    found: list[tuple[str, Any, bool]] = []  # (source, (kind, value), any_whitespace)
    rf = _response_format(request.response_format)
    if rf is not None:
        found.append(rf)
    so = request.structured_outputs
    if so is not None:
        found.extend(_structured_outputs(so))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, (kind, value), True))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(source for source, _, _ in found)
        raise StructuredOutputError(
            f"use one structured output constraint per request (got {names})", found[1][0]
        )
    source, (kind, value), any_whitespace = found[0]
    try:
        return StructuredOutputSpec(kind, value, any_whitespace=any_whitespace, source=source)
    except ValueError as e:
        raise StructuredOutputError(str(e), source) from None


def _response_format(rf: dict[str, Any] | None) -> tuple[str, Any, bool] | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("response_format", ("json_object", None), True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredOutputError(
                "response_format of type 'json_schema' needs json_schema.schema",
                "response_format.json_schema",
            )
        return ("response_format.json_schema.schema", ("json", spec["schema"]), True)
    raise StructuredOutputError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


def _structured_outputs(so: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    whitespace = so.get("disable_any_whitespace", False)
    if not isinstance(whitespace, bool):
        raise StructuredOutputError(
            "structured_outputs.disable_any_whitespace must be true or false",
            "structured_outputs.disable_any_whitespace",
        )
    found = []
    for key in _STRUCTURED:
        value = so.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        if key == "json_object" and value is not True:
            raise StructuredOutputError(
                "structured_outputs.json_object must be true or false", "structured_outputs.json_object"
            )
        found.append((f"structured_outputs.{key}", (key, None if key == "json_object" else value), not whitespace))
    if not found:
        raise StructuredOutputError(
            f"structured_outputs needs one of {', '.join(_STRUCTURED)}", "structured_outputs"
        )
    return found
