"""``tiered-kv``: the command-line entry point."""
from __future__ import annotations

import typer

from tiered_kv.storage_cli import app as storage_app

app = typer.Typer(
    name="tiered-kv",
    help="A paged LLM inference engine with a tiered, persistent KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(storage_app, name="storage")


def main() -> None:
    app()
