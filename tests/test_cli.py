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
