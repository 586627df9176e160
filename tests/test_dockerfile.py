"""The server image: the Dockerfile parsed (no Docker engine is needed) and checked against
the torch pin, the docs and .dockerignore.

torch 2.13.0 from PyPI is built for CUDA 13 and needs an NVIDIA driver 580 or later; Triton
compiles a C launcher for each kernel when it first runs, so the image needs a C compiler
and the headers of the Python that runs the server.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# PyPI's default Linux wheel of each torch release we pin: its CUDA major, the least driver.
TORCH_CUDA = {"2.13.0": (13, 580)}


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        result.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions((ROOT / "Dockerfile").read_text())


def one(dockerfile, keyword: str) -> str:
    (arguments,) = [a for k, a in dockerfile if k == keyword]
    return arguments


def run_commands(dockerfile) -> list[list[str]]:
    """The simple commands of every RUN, as words (split at ``&&``, ``||``, ``;`` and ``|``)."""
    commands = []
    for keyword, arguments in dockerfile:
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(arguments, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command = []
        for word in lexer:
            if word in ("&&", "||", ";", "|"):
                commands.append(command)
                command = []
            else:
                command.append(word)
        commands.append(command)
    return commands


def apt_packages(dockerfile) -> set[str]:
    packages = set()
    for words in run_commands(dockerfile):
        if words[:2] == ["apt-get", "install"]:
            packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def torch_pin() -> str:
    (pin,) = re.findall(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    return pin


def test_the_parser_joins_continuations_and_drops_comments():
    parsed = instructions('# a comment\nFROM x:1\n\nRUN a \\\n    # inside\n    && b\nCMD ["c"]\n')
    assert parsed == [("FROM", "x:1"), ("RUN", "a && b"), ("CMD", '["c"]')]


def test_the_base_image_is_cuda_13_runtime_for_the_pinned_torch(dockerfile):
    image = one(dockerfile, "FROM")
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-runtime-ubuntu(\d+\.\d+)", image)
    assert match, image
    cuda_major, _ = TORCH_CUDA[torch_pin()]
    assert int(match.group(1)) == cuda_major
    # the runtime refuses to start the container on a driver older than the image's CUDA
    # needs: a 13.0 base asks for 580, what torch's wheel needs anyway
    assert int(match.group(2)) == 0


def test_triton_can_compile_its_launchers(dockerfile):
    packages = apt_packages(dockerfile)
    assert {"gcc", "libc6-dev"} <= packages
    venvs = [words for words in run_commands(dockerfile) if words[1:3] == ["-m", "venv"]]
    assert venvs, "the server's Python is a virtualenv"
    (interpreter, _, _, venv) = venvs[0]
    assert {interpreter, f"{interpreter}-venv", f"{interpreter}-dev"} <= packages
    assert f"PATH={venv}/bin:$PATH" in one(dockerfile, "ENV")
    # the build itself proves it: Python.h of that interpreter compiles with that gcc
    (check,) = [words for words in run_commands(dockerfile) if words[:1] == ["gcc"]]
    assert "-fsyntax-only" in check and any("sysconfig" in w for w in check)
    assert any("#include <Python.h>" in w for c in run_commands(dockerfile) for w in c)


def test_the_project_is_installed_with_the_constraints(dockerfile):
    assert ["pip", "install", "-c", "constraints.txt", "."] in run_commands(dockerfile)


def test_entrypoint_serves_and_the_state_is_not_root(dockerfile):
    assert json.loads(one(dockerfile, "ENTRYPOINT")) == ["tiered-kv", "serve"]
    command = json.loads(one(dockerfile, "CMD"))
    assert command[command.index("--host") + 1] == "0.0.0.0"
    port = command[command.index("--port") + 1]
    assert one(dockerfile, "EXPOSE") == port
    assert f":{port}/health" in one(dockerfile, "HEALTHCHECK")
    assert command[command.index("--kv-cache-dir") + 1] == "/var/lib/tiered-kv/kv_cache"
    assert one(dockerfile, "USER") == "tiered-kv"
    assert one(dockerfile, "STOPSIGNAL") == "SIGTERM"


def test_dockerignore_keeps_what_the_image_copies(dockerfile):
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and "kv_cache" in ignored
    for _, arguments in (i for i in dockerfile if i[0] == "COPY"):
        *sources, _ = shlex.split(arguments)
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") not in ignored, source


def test_the_docs_name_the_image_cuda_and_driver(dockerfile):
    cuda_major, driver = TORCH_CUDA[torch_pin()]
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    assert f"`{one(dockerfile, 'FROM')}`" in deployment
    assert f"CUDA {cuda_major}" in deployment and f"driver {driver} or later" in deployment
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = path.read_text()
        for stale in re.findall(r"CUDA 12\.\d+|driver 5[0-7]\d\b|nvidia/cuda:12\.", text):
            pytest.fail(f"{path.name} still says {stale!r}")
