"""Run Triton kernels' checks under the interpreter (``TRITON_INTERPRET=1``) in a child
process: the interpreter is chosen when ``triton`` is imported, so it needs a fresh one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, *args: str) -> dict:
    """Run ``code`` (``python -c``) with ``args`` under the interpreter; the JSON object it
    prints last."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreter_main_of(module: str) -> str:
    """Code that runs ``tests/<module>.py``'s ``interpreter_main()``."""
    return f"import sys; sys.path.insert(0, 'tests'); import {module}; {module}.interpreter_main()"


def value_errors(calls: Mapping[str, Callable[[], object]]) -> dict[str, str | None]:
    """Each call's ``ValueError`` message, or ``None`` where it raised none (a wrapper
    that should have refused its arguments)."""
    errors: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors
