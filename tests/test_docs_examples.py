"""Every ``curl`` example in README.md and docs/*.md, run as written against a live server.

A fenced ``bash`` block that holds a ``curl`` command runs as one bash script (so its
variables carry from line to line) against ``tiered-kv serve --model tiny`` started here,
with ``localhost:8000`` replaced by the server's address and ``$ADMIN_KEY`` set to its
admin key. ``curl`` is wrapped so that every response is kept: each must be a 2xx, and a
JSON (or server-sent events) response must parse. The block must exit 0 (``set -e``,
``pipefail``: a ``grep`` that finds nothing fails it) and print no ``null`` (a ``jq`` path
that does not exist).

A block that cannot run here (a GPU, a remote host, a container) is preceded by the line
``<!-- not run by tests/test_docs_examples.py: REASON -->``; the reason is required.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_testing import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ADMIN_KEY = "docs-admin-key"
SKIP_MARK = re.compile(r"<!-- not run by tests/test_docs_examples\.py:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
ADDRESS = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
CURL = re.compile(r"(?<![\w./-])curl\b")

# Keeps each response (headers, body) in $DOCS_RESPONSES and prints the body as curl would.
WRAPPER = r"""
curl() {
    local kept
    kept=$(mktemp -p "$DOCS_RESPONSES" response.XXXXXX) || return
    printf '%q ' "$@" > "$kept.command"
    command curl "$@" --dump-header "$kept" --output "$kept.body" || return
    cat "$kept.body"
}
set -e -o pipefail
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def curl_calls(self) -> int:
        return sum(len(CURL.findall(line.split(" #")[0])) for line in self.code.splitlines()
                   if not line.lstrip().startswith("#"))


def curl_blocks(path: Path) -> list[Block]:
    """The shell blocks of ``path`` that run ``curl``, with their skip marks."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, language = i, fence.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        code = "\n".join(lines[start + 1 : i]) + "\n"
        i += 1
        if language not in ("bash", "sh", "shell") or not CURL.search(code):
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = SKIP_MARK.search(before)
        blocks.append(Block(path, start + 1, code, mark.group(1) if mark else None))
    return blocks


BLOCKS = [block for path in DOCS for block in curl_blocks(path)]
RUN = [block for block in BLOCKS if block.skip_reason is None]


def test_the_docs_have_curl_examples_and_every_skip_says_why():
    assert {b.path.name for b in RUN} >= {"README.md", "server.md"}
    assert sum(b.curl_calls() for b in RUN) >= 8
    for block in BLOCKS:
        assert block.skip_reason != "", f"{block.name}: a skipped example needs its reason"


def test_a_block_marked_not_run_is_skipped_with_its_reason(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- not run by tests/test_docs_examples.py: needs a GPU -->\n```bash\ncurl -s x:1/a\n```\n\n"
        "```bash\nA=1; curl -s localhost:8000/b -H \"$A\"  # curl in a comment\n```\n"
        "```python\ncurl = 1\n```\n```bash\nls\n```\n"
    )
    marked, run = curl_blocks(doc)
    assert (marked.line, marked.skip_reason) == (2, "needs a GPU")
    assert (run.line, run.skip_reason, run.curl_calls()) == (6, None, 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for tool in ("curl", "jq"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (.ci/install-services installs it)")
    work = tmp_path_factory.mktemp("docs")
    process = ServerProcess(
        ["--model", "tiny", "--admin-api-key", ADMIN_KEY, "--kv-cache-dir", str(work / "kv_cache"),
         "--max-model-len", "512", "--num-gpu-blocks-override", "96",
         "--kv-offloading-size", "0.01", "--kv-disk-size", "0.25", "--log-level", "warning"],
        work / "server.log",
    )
    yield process
    process.kill()


def check_response(kept: Path) -> str:
    """What is wrong with one kept response, or ``""``."""
    command = kept.with_name(kept.name + ".command").read_text().strip()
    heads = kept.read_text(errors="replace").split("\r\n\r\n")
    status_line, *headers = [h for h in heads if h.strip()][-1].split("\r\n")
    status = int(status_line.split()[1])
    fields = dict(h.split(":", 1) for h in headers if ":" in h)
    content_type = {k.lower(): v.strip() for k, v in fields.items()}.get("content-type", "")
    body = kept.with_name(kept.name + ".body").read_text(errors="replace")
    if not 200 <= status < 300:
        return f"curl {command}: HTTP {status}: {body[:300]}"
    try:
        if content_type.startswith("application/json"):
            json.loads(body)
        elif content_type.startswith("text/event-stream"):
            events = [e.removeprefix("data: ") for e in body.split("\n\n") if e.strip()]
            assert events and events[-1] == "[DONE]", "no [DONE]"
            for event in events[:-1]:
                json.loads(event)
    except (ValueError, AssertionError) as e:
        return f"curl {command}: {content_type} body does not parse ({e}): {body[:300]}"
    return ""


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_curl_example_runs_as_written(block: Block, server: ServerProcess, tmp_path: Path):
    script = WRAPPER + ADDRESS.sub(f"127.0.0.1:{server.port}", block.code)
    env = {**os.environ, "ADMIN_KEY": ADMIN_KEY, "DOCS_RESPONSES": str(tmp_path)}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                            timeout=120)
    responses = sorted(p for p in tmp_path.glob("response.*") if "." not in p.name[len("response."):])
    problems = [problem for kept in responses if (problem := check_response(kept))]
    assert not problems, f"{block.name}:\n" + "\n".join(problems)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{result.stderr}"
    assert len(responses) == block.curl_calls(), f"{block.name}: not every curl ran"
    nulls = [line for line in result.stdout.splitlines() if line.strip() == "null"]
    assert not nulls, f"{block.name} printed null (a jq path that is not there):\n{result.stdout}"
