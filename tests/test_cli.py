"""The ``tiered-kv`` entry point: usage errors of the top-level command and its groups are one
line and exit code 2, as the commands' own errors are (tests/test_storage_cli.py,
tests/test_serve_config.py cover those)."""
from __future__ import annotations

import subprocess
import sys

import pytest

MAIN = "import sys; from tiered_kv.cli import main; sys.argv[0] = 'tiered-kv'; main()"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", MAIN, *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--bogus",), "No such option: --bogus"),
        (("bogus",), "No such command 'bogus'"),
        (("storage", "--bogus"), "No such option: --bogus"),
        (("storage", "bogus"), "No such command 'bogus'"),
    ],
)
def test_a_usage_error_is_one_line(args, message):
    done = _run(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_help_still_works():
    done = _run("--help")
    assert done.returncode == 0 and "serve" in done.stdout and "storage" in done.stdout


def _help(*args: str, columns: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", MAIN, *args, "--help"], capture_output=True, text=True,
        timeout=60, env={"COLUMNS": str(columns), "PATH": ""},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_serve_help_reads_on_an_80_column_terminal():
    text = _help("serve", columns=80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert "…" not in text  # no help cut short
    for section in ("Engine:", "Server:", "KV tiers:", "Accepted from vLLM, ignored:"):
        assert section in lines
    # a switch's two forms on one line, its help under them at a readable width
    i = lines.index("  --enable-prefix-caching / --no-enable-prefix-caching")
    assert len(lines[i + 1].strip()) > 30


def test_command_summaries_are_whole_sentences():
    """A docstring's line breaks do not show in the lists of commands."""
    assert "(and resize it to --size if given" in _help("storage", columns=200)
    top = _help(columns=200)
    assert "Serve a model over the OpenAI API with a persistent, tiered KV cache." in top
    assert "TIERED_KV_" not in top  # the summary is the first paragraph alone
