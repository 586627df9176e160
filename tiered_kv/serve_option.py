"""What each ``tiered-kv serve`` setting is: the metadata its field carries, and how its text parses.

A field of :class:`~tiered_kv.serve_config.ServeConfig` declared with :func:`option` carries an
:class:`Option`: help text, help panel, vLLM's short aliases, choices, and other environment
variables that may set it. The CLI (``serve_cli``), the environment and YAML loader
(``serve_config``) and the docs tables (``serve_docs``) are all generated from it, and every
text value (a flag, an environment variable, a YAML string) is parsed by :meth:`Setting.parse`.

Token counts take vLLM's suffixes (``human_readable_int``): lower case is decimal, upper
case binary, so ``8k`` is 8000, ``8K`` is 8192, ``1g`` 10⁹, ``1G`` 2³⁰; a decimal number only
with a decimal suffix (``25.6k``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

SERVER = "Server"
ENGINE = "Engine"
TIERS = "KV tiers"
PANELS = (SERVER, ENGINE, TIERS)

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null")


@dataclasses.dataclass(frozen=True)
class EnvAlias:
    """Another environment variable that sets a field (after ``TIERED_KV_<FIELD>``), with
    how its text becomes the field's value."""

    name: str
    convert: Callable[[str], Any]
    meaning: str  # for the docs: "GiB", "+ /hub"


@dataclasses.dataclass(frozen=True)
class Option:
    help: str  # one paragraph; `backticks` are dropped in the CLI's help
    panel: str
    default_text: str | None = None  # the default in words, when the value alone says too little
    choices: tuple[str, ...] = ()
    value_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # vLLM's spelling -> ours
    refused_values: Mapping[str, str] = dataclasses.field(default_factory=dict)  # vLLM's value -> why not
    aliases: tuple[str, ...] = ()  # further flags: vLLM's short forms (-tp)
    env: tuple[EnvAlias, ...] = ()
    parse: str = ""  # "human_int", "human_int_or_auto", "values"; "": by the field's type
    metavar: str = ""  # the value's name in the CLI's help; "": from the type
    flag: bool = True  # False: environment only (secrets)
    vllm: bool = True  # vLLM has this flag with this meaning
    vllm_note: str = ""  # how ours differs, for docs/compatibility.md


def option(default: Any, help: str, panel: str, **kwargs: Any) -> Any:
    """A dataclass field carrying its :class:`Option`. A field that is not a flag is a secret:
    it is left out of the ``repr`` too."""
    meta = Option(help=help, panel=panel, **kwargs)
    return dataclasses.field(default=default, repr=meta.flag, metadata={"option": meta})


def option_of(field: dataclasses.Field) -> Option:
    """A field's option; a field declared without :func:`option` gets a bare one."""
    return field.metadata.get("option") or Option(help="", panel=SERVER, vllm=False)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "TIERED_KV_" + name.upper()


def human_readable_int(text: str) -> int:
    """vLLM's token counts: ``8k`` = 8000, ``8K`` = 8192, ``25.6k`` = 25600, ``4096``."""
    text = text.strip()
    m = _HUMAN_INT.fullmatch(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError("not an integer (examples: 4096, 8k = 8000, 8K = 8192)") from None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        value = float(number) * _DECIMAL[suffix]
        if math.isinf(value):
            raise ValueError(f"too large: {text}")
        return int(value)
    if "." in number:
        raise ValueError(f"a decimal number takes a decimal suffix: {number}{suffix.lower()}, not {text}")
    return int(number) * _BINARY[suffix]


def human_readable_int_or_auto(text: str) -> int | None:
    """As :func:`human_readable_int`; ``auto`` or ``-1``: ``None`` (the default)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")


def parse_values(text: str) -> tuple[str, ...]:
    """One value, or a JSON list of them: a setting that takes one or more values on the
    command line (vLLM's ``nargs="+"``: ``--api-key k1 k2``). Commas are part of a value."""
    if text.strip().startswith("["):
        return parse_list(text)
    return (text,)


def parse_list(text: str) -> tuple[str, ...]:
    """A JSON list (as vLLM takes ``--allowed-origins``) or comma-separated words."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for json
            raise ValueError("not a JSON list of strings") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError("not a JSON list of strings")
        return tuple(items)
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of the settings model, with its resolved type."""

    name: str
    hint: Any
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.hint)

    @property
    def kind(self) -> type:
        """``int`` for ``int | None``, ``tuple`` for ``tuple[str, ...]``."""
        hint = self.hint
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]
        return typing.get_origin(hint) or hint

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for; ``ValueError`` with the reason (not the flag's name)."""
        meta = self.option
        if self.optional and text.strip().lower() in _NONE:
            return None
        if meta.parse == "human_int":
            return human_readable_int(text)
        if meta.parse == "human_int_or_auto":
            return human_readable_int_or_auto(text)
        if meta.parse == "values":
            return parse_values(text)
        kind = self.kind
        if kind is bool:
            return parse_bool(text)
        if kind is int:
            try:
                return int(text.strip())
            except ValueError:
                raise ValueError("not an integer") from None
        if kind is float:
            try:
                return float(text.strip())
            except ValueError:
                raise ValueError("not a number") from None
        if kind is tuple:
            return parse_list(text)
        return meta.value_aliases.get(text, text)

    def check_choice(self, value: Any) -> None:
        """``ValueError`` naming the flag when ``value`` is not one of the choices."""
        meta = self.option
        if value in meta.refused_values:
            raise ValueError(f"{self.flag} {value} is not supported: {meta.refused_values[value]}")
        if not meta.choices or (value is None and self.optional) or value in meta.choices:
            return
        spellings = [*meta.choices, *meta.value_aliases]
        raise ValueError(f"{self.flag} must be one of {', '.join(spellings)}, got {value!r}")


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The fields of the dataclass ``cls``, in order, as :class:`Setting` s."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Setting(f.name, hints[f.name], f.default, option_of(f)) for f in dataclasses.fields(cls)
    )
