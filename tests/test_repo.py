"""The repository's promises about itself: README commands, CI entry point, pins."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_starts_with_a_run_and_a_test_command():
    run, test = _readme_commands()
    assert "python3 -m venv .venv" in run and "tiered-kv " in run
    assert "python3 -m venv .venv" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    _, test = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci


def test_torch_is_pinned_everywhere():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_reqs = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_reqs == ["torch==2.13.0"]
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_every_test_security_md_names_exists():
    """docs/security.md maps each threat to tests: a renamed or deleted test must show up."""
    text = (ROOT / "docs/security.md").read_text()
    refs, current = [], None
    for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", text):
        current = path or current  # `::name` continues the file named before it
        refs.append((current, name))
    assert len(refs) > 20
    missing = [f"{p}::{n}" for p, n in refs if f"def {n}(" not in (ROOT / p).read_text()]
    assert not missing, missing
