"""What ``serve``'s model settings point to: a folder, a Hugging Face id in the local cache, a
chat template.

A model given as ``org/name`` that is not a folder is looked up in the Hugging Face hub
cache (``--download-dir``; its layout ``models--org--name/refs/REV`` and
``models--org--name/snapshots/COMMIT/``) without any network access: the server never
downloads.
"""
from __future__ import annotations

import re
from pathlib import Path

_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def default_hub_cache() -> Path:
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_model(model: str, *, download_dir: str | None = None, revision: str | None = None) -> str:
    """The folder (or ``tiny``) that ``model`` names; ``FileNotFoundError`` with one line
    saying where it was looked for when a Hugging Face id is not in the cache."""
    if model == "tiny" or Path(model).expanduser().exists() or not _HF_ID.fullmatch(model):
        return model  # the loader reports a folder that is missing or incomplete
    hub = Path(download_dir).expanduser() if download_dir else default_hub_cache()
    repo = hub / ("models--" + model.replace("/", "--"))
    if not repo.is_dir():
        raise FileNotFoundError(
            f"{model}: no such model folder, and not in the Hugging Face cache {hub} (this server "
            f"never downloads: fetch it first, e.g. `huggingface-cli download {model}`, or "
            "set HF_HOME / --download-dir)"
        )
    rev = revision or "main"
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif _COMMIT.fullmatch(rev):
        commit = rev
    else:
        raise FileNotFoundError(f"{model}: the Hugging Face cache has no revision {rev!r} ({ref} is missing)")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise FileNotFoundError(f"{model}: revision {rev!r} is not in the Hugging Face cache ({snapshot} is missing)")
    return str(snapshot)


def load_chat_template(value: str) -> str:
    """``--chat-template``: the text of a file, or the value itself when it is a Jinja template
    (it holds ``{``, ``}`` or a newline, as vLLM decides)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot be read: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(
        f"--chat-template {value}: no such file (a template given inline holds {{{{ }}}} or {{% %}})"
    )
