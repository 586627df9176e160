"""``tiered-kv``: the command-line entry point.

- ``tiered-kv serve``: the OpenAI-compatible server (docs/server.md, docs/configuration.md)
- ``tiered-kv storage ...``: admin of a KV cache directory
"""
from __future__ import annotations

import sys

import typer

try:  # recent typer releases carry their own copy of click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on click itself
    from click.exceptions import NoArgsIsHelpError, UsageError

from tiered_kv.serve_cli import ServeCommand, make_serve, settings_from_params
from tiered_kv.storage_cli import app as storage_app
from tiered_kv.storage_errors import usage_line

app = typer.Typer(
    name="tiered-kv",
    help="A paged LLM inference engine with a tiered, persistent KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's lines are joined, as in a paragraph
)
app.add_typer(storage_app, name="storage")


def _serve(params: dict) -> None:
    from storage.base import StoreError
    from tiered_kv import server
    from tiered_kv.serve_config import ServeConfig

    try:
        flags, config_file, ignored = settings_from_params(params)
        settings = ServeConfig.load(flags, config_file=config_file)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        server.run(settings, ignored_flags=ignored)
    except StoreError as e:
        typer.echo(f"error: the KV cache directory cannot be used: {e}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, OSError) as e:  # no such model, or the engine refused its settings
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


serve = app.command("serve", cls=ServeCommand)(make_serve(_serve, """Serve a model over the OpenAI API with a persistent, tiered KV cache.

    The routes are vLLM's: /v1/completions, /v1/chat/completions, /v1/models and more. Each
    flag can also be set as an environment variable, TIERED_KV_ and the flag in capitals
    (TIERED_KV_MAX_MODEL_LEN), or as a key of the --config file; flags win over the
    environment, which wins over the file. Token counts take vLLM's suffixes: 8k = 8000,
    8K = 8192."""))


def main() -> None:
    """Run the CLI. A usage error of the top-level command or a group (an unknown command or
    option) is one ``error:`` line and exit code 2, as the commands' own errors are."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:  # bare `tiered-kv`: the help, exit 2
        e.show()
        sys.exit(2)
    except UsageError as e:
        typer.echo(f"error: {usage_line(e)}", err=True)
        sys.exit(2)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
