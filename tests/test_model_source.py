"""model_source: a Hugging Face id found in a local hub cache, offline; --chat-template as a file or inline."""
from __future__ import annotations

import shutil

import pytest

from engine.models import load_model
from engine.models.tiny import tiny_model_path
from tiered_kv.model_source import load_chat_template, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(root, repo="acme/tiny-chat", commit=COMMIT, ref="main"):
    """A hub cache as huggingface_hub lays it out, holding the tiny checkpoint."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = shutil.copytree(tiny_model_path(), folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


def test_a_hugging_face_id_resolves_to_its_cached_snapshot_and_loads(tmp_path):
    snapshot = fake_hub(tmp_path)
    path = resolve_model("acme/tiny-chat", download_dir=str(tmp_path))
    assert path == str(snapshot)
    loaded = load_model(path)
    assert loaded.config.num_layers == 4 and loaded.tokenizer.chat_template


def test_revisions_are_refs_or_commits(tmp_path):
    fake_hub(tmp_path, ref="v1")
    with pytest.raises(FileNotFoundError, match="no revision 'main'"):
        resolve_model("acme/tiny-chat", download_dir=str(tmp_path))
    assert resolve_model("acme/tiny-chat", download_dir=str(tmp_path), revision="v1").endswith(COMMIT)
    assert resolve_model("acme/tiny-chat", download_dir=str(tmp_path), revision=COMMIT).endswith(COMMIT)
    with pytest.raises(FileNotFoundError, match="is not in the Hugging Face cache"):
        resolve_model("acme/tiny-chat", download_dir=str(tmp_path), revision="f" * 40)


def test_folders_and_other_names_are_left_to_the_loader(tmp_path):
    assert resolve_model("tiny") == "tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("/no/such/folder") == "/no/such/folder"
    with pytest.raises(FileNotFoundError, match="acme/absent: no such model folder, and not in the Hugging Face cache"):
        resolve_model("acme/absent", download_dir=str(tmp_path))


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="--chat-template missing.jinja: no such file"):
        load_chat_template("missing.jinja")
