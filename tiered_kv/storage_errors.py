"""How ``tiered-kv storage`` reports an error: one line and an exit code, never a usage box
or a traceback.

Without ``--json`` the line goes to stderr as ``error: MESSAGE``. With ``--json`` it goes
to stdout as ``{"error": "MESSAGE"}``: stdout then always carries one JSON document, and
the exit code says whether it is a result or an error.

Exit codes: 2 for what the user can fix (a usage error, a bad value, no such store, a
damaged file, a disk that refuses a write, a store held by a server); 3 for an exception
the command did not expect (a bug: its type and message are the line); 130 for Ctrl-C
(``interrupted``: what the command committed before stays, the store is consistent).

What the store logs on the way (a corrupt record met, a write given up) goes to stderr as
``warning: MESSAGE`` lines, one per event, before the error line if there is one; stdout
stays the command's output alone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys

import lmdb
import typer
from typer.core import TyperGroup

from storage.base import StoreError

EXIT_ERROR = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
_JSON_FLAG = "--json"


class CommandError(Exception):
    """An error the user can fix, said in one line: ``raise fail("...")``."""


def fail(message: str) -> CommandError:
    return CommandError(message)


def report(message: str, as_json: bool) -> None:
    """Print ``message`` as the one line of an error (see the module docstring)."""
    line = " ".join(message.split())
    if as_json:
        typer.echo(json.dumps({"error": line}))
    else:
        typer.echo(f"error: {line}", err=True)


class StorageGroup(TyperGroup):
    """The ``storage`` command group: every error of its commands, usage errors included,
    becomes one line (see the module docstring)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        # Known before the command's own options are parsed, so usage errors honour it too.
        ctx.meta[_JSON_FLAG] = _JSON_FLAG in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context):
        as_json = ctx.meta.get(_JSON_FLAG, False)
        try:
            with _log_lines():
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:  # the stores were closed on the way out: nothing half-written
            report("interrupted", as_json)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except CommandError as e:
            report(str(e), as_json)
        except (OSError, StoreError, lmdb.Error) as e:  # the disk or the store refused
            report(_describe(e), as_json)
        except Exception as e:  # noqa: BLE001 - one line whatever it is
            if not hasattr(e, "format_message"):  # a bug, not a usage error
                report(f"internal error: {type(e).__name__}: {e}", as_json)
                raise typer.Exit(EXIT_INTERNAL) from None
            report(usage_line(e), as_json)  # a missing argument, an unknown option or command
        raise typer.Exit(EXIT_ERROR)


def usage_line(error: Exception) -> str:
    """A click usage error in one line, with where to find help."""
    message = error.format_message()
    command = getattr(error, "ctx", None)
    if command is not None:
        message += f" (see `{command.command_path} --help`)"
    return message


def _describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror}"
    return str(error) or type(error).__name__


class _LogLine(logging.Handler):
    """A log record as one ``level: message`` line on the stderr of the moment."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = " ".join(record.getMessage().split())
            sys.stderr.write(f"{record.levelname.lower()}: {line}\n")
        except Exception:  # noqa: BLE001 - logging must not fail the command
            self.handleError(record)


@contextlib.contextmanager
def _log_lines():
    """Warnings and errors logged during a command, as lines (instead of Python's bare
    last-resort output), without a traceback."""
    root = logging.getLogger()
    handler = _LogLine(logging.WARNING)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
