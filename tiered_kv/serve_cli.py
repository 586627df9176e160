"""The ``serve`` command's parameters, generated from :class:`~tiered_kv.serve_config.ServeConfig`.

Every setting that is a flag becomes a typer option (a switch ``--x/--no-x`` for a boolean, a
text option otherwise, parsed later by the setting itself so that flags, the environment and
YAML spell values alike), plus vLLM's positional ``MODEL``, ``--config``, and the vLLM flags
that are accepted and ignored. A usage error (an unknown flag, a missing value) is one
``error: ...`` line and exit code 2; a vLLM flag that is refused names its reason.
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
import typer.core

try:  # newer typer carries its own copy of click
    from typer._click.exceptions import NoSuchOption, UsageError
except ImportError:
    from click.exceptions import NoSuchOption, UsageError

from tiered_kv.serve_config import SETTINGS
from tiered_kv.serve_option import SERVER, Setting
from tiered_kv.vllm_compat import IGNORED_FLAGS, REFUSED_FLAGS

IGNORED_PANEL = "Accepted from vLLM, ignored"
MODEL_ARGUMENT = "model_tag"  # vLLM's name for the positional MODEL
CONFIG_HELP = (
    "YAML file of settings (keys as the flags, without '--'); flags and TIERED_KV_* environment "
    "variables override it."
)


class ServeCommand(typer.core.TyperCommand):
    """Usage errors as one line, not click's box; ``--help`` as plain text, a section per panel.

    Rich's table gives every option of a panel the width of its longest name, and a switch's
    ``--no-`` form its own column: on an 80-column terminal that left about 18 columns for
    the help. Plain text puts a long name on its own line and the help under it."""

    def format_help(self, ctx: typer.Context, formatter) -> None:
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = "Arguments" if param.param_type_name == "argument" else "Options"
                sections.setdefault(getattr(param, "rich_help_panel", None) or title, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, gather_values(args))
        except UsageError as e:
            typer.echo(f"error: {usage_message(e)}", err=True)
            raise typer.Exit(2) from None


# Flags that take one or more values, as vLLM's nargs="+" (`--api-key k1 k2`).
MULTI_VALUE_FLAGS = frozenset(
    flag for s in SETTINGS if s.option.flag and s.option.parse == "values" for flag in (s.flag, *s.option.aliases)
)


def gather_values(args: list[str]) -> list[str]:
    """``args`` with the values after each multi-value flag, up to the next argument that
    starts with ``-``, joined into one JSON list (what the setting parses). Like vLLM's
    parser, such a flag takes every word after it, a positional MODEL too."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        out.append(arg)
        i += 1
        if arg == "--":
            out += args[i:]
            break
        if arg in MULTI_VALUE_FLAGS:
            values = []
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if values:
                out.append(json.dumps(values))
    return out


def usage_message(e: UsageError) -> str:
    if isinstance(e, NoSuchOption) and e.option_name in REFUSED_FLAGS:
        return f"{e.option_name} is not supported: {REFUSED_FLAGS[e.option_name]}"
    return " ".join(e.format_message().split())


def settings_from_params(params: dict[str, Any]) -> tuple[dict[str, Any], Path | None, list[str]]:
    """The serve callback's parameters as ``ServeConfig.load`` flags, the ``--config`` file,
    and the ignored vLLM flags that were given."""
    params = dict(params)
    config = params.pop("config")
    positional = params.pop(MODEL_ARGUMENT)
    ignored = [flag for flag in IGNORED_FLAGS if params.pop(_ignored_name(flag)) is not None]
    if positional is not None:
        if params["model"] is not None and params["model"] != positional:
            raise ValueError(
                f"the model is given twice, as MODEL ({positional}) and --model ({params['model']}); give it once"
            )
        params["model"] = positional
    return params, config, ignored


def make_serve(body: Callable[[dict[str, Any]], None], doc: str) -> Callable[..., None]:
    """A function whose signature typer reads as the serve command's parameters; it calls
    ``body`` with them all."""

    def serve(**params: Any) -> None:
        body(params)

    parameters = [_model_argument(), *(_option(s) for s in SETTINGS if s.option.flag)]
    parameters.append(inspect.Parameter(
        "config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
        default=typer.Option(
            None, "--config", rich_help_panel=SERVER, show_default=False, help=CONFIG_HELP,
        ),
    ))
    parameters += [_ignored(flag, spec.takes_value) for flag, spec in IGNORED_FLAGS.items()]
    serve.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    serve.__annotations__ = {p.name: p.annotation for p in parameters}
    serve.__doc__ = doc
    return serve


def cli_help(setting: Setting) -> str:
    meta = setting.option
    text = meta.help.replace("`", "")
    if meta.choices:
        text += f" One of: {', '.join(meta.choices)}."
    return f"{text} (default: {default_text(setting)})"


def default_text(setting: Setting) -> str:
    if setting.option.default_text is not None:
        return setting.option.default_text
    value = setting.default
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ", ".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _model_argument() -> inspect.Parameter:
    return inspect.Parameter(
        MODEL_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
        default=typer.Argument(
            None, metavar="MODEL", show_default=False,
            help="The model, as in `vllm serve MODEL`: the same as --model.",
        ),
    )


def _option(setting: Setting) -> inspect.Parameter:
    meta = setting.option
    if setting.kind is bool:
        decls: tuple[str, ...] = (f"{setting.flag}/--no-{setting.flag[2:]}", *meta.aliases)
        annotation: Any = Optional[bool]
        metavar = None
    else:
        decls = (setting.flag, *meta.aliases)
        annotation = Optional[str]
        metavar = meta.metavar or _METAVARS.get(meta.parse) or _METAVARS.get(setting.kind.__name__, "TEXT")
    return inspect.Parameter(
        setting.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
        default=typer.Option(
            None, *decls, help=cli_help(setting), rich_help_panel=meta.panel,
            show_default=False, metavar=metavar,
        ),
    )


_METAVARS = {"human_int": "TOKENS", "human_int_or_auto": "TOKENS", "int": "INTEGER",
             "float": "FLOAT", "tuple": "LIST"}


def _ignored(flag: str, takes_value: bool) -> inspect.Parameter:
    decls = flag if takes_value else f"{flag}/--no-{flag[2:]}"
    return inspect.Parameter(
        _ignored_name(flag), inspect.Parameter.KEYWORD_ONLY,
        annotation=Optional[str] if takes_value else Optional[bool],
        default=typer.Option(
            None, decls, help=f"Ignored: {IGNORED_FLAGS[flag].reason}.",
            rich_help_panel=IGNORED_PANEL, show_default=False,
        ),
    )


def _ignored_name(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")

