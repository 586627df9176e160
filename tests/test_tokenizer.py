"""Tokenizer: round trips and chat templates (streaming detokenization: test_detokenizer.py)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from engine.models.tiny import BOS_ID, END_ID, EOS_ID, build_tiny_tokenizer, write_tiny_tokenizer
from engine.tokenizer import Tokenizer

TEXTS = [
    "",
    "hello world",
    "Grüße, naïve café",
    "你好，世界",
    "emoji 🙂👍🏽 and\ttabs\nnewlines",
    "a\u0301 e\u0301",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder, eos_token_ids=[EOS_ID, END_ID])


# --- encode / decode ---------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_special_tokens(tok):
    assert tok.vocab_size == 264
    assert tok.bos_token_id == BOS_ID and tok.bos_token == "<|bos|>"
    assert tok.eos_token_ids == (EOS_ID, END_ID) and tok.eos_token == "<|eos|>"
    ids = tok.encode("<|user|>hi<|end|>", add_special_tokens=False)
    assert ids == [260, ord("h"), ord("i"), END_ID]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|>"


def test_decode_one_is_decode_of_one_token_for_either_skip_setting(tok):
    for token_id in (ord("a"), 0xC3, BOS_ID, END_ID, 260):
        for skip in (True, False):
            assert tok.decode_one(token_id, skip) == tok.decode([token_id], skip)
            assert tok.decode_one(token_id, skip) == tok.decode([token_id], skip)  # remembered
    assert tok.decode_one(END_ID, True) == "" and tok.decode_one(END_ID, False) == "<|end|>"


def test_max_token_chars_bounds_the_text_of_a_token(tok):
    assert tok.max_token_chars == len("<|assistant|>")
    for text in [*TEXTS, "<|assistant|>" * 3]:
        assert len(text) <= len(tok.encode(text, add_special_tokens=False)) * tok.max_token_chars


def test_encode_lets_other_threads_run(tok):
    """The server tokenizes on a worker thread; that keeps it responsive only if ``encode``
    releases the GIL (a long prompt takes a while)."""
    text = "hello world " * 10_000
    encoded = threading.Event()
    thread = threading.Thread(target=lambda: (tok.encode(text), encoded.set()))
    ticks = 0
    thread.start()
    while not encoded.is_set():
        time.sleep(0.001)
        ticks += 1
    thread.join()
    assert ticks >= 5


# --- chat templates ----------------------------------------------------------------------


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Grüße 🙂"},
    ]
    expected = "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nGrüße 🙂<|end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    prompt = tok.apply_chat_template(messages)
    assert prompt == expected + "<|assistant|>\n"
    assert tok.encode(prompt, add_special_tokens=False).count(BOS_ID) == 1


def test_continue_final_message_leaves_the_last_message_open(tok):
    """As Hugging Face's apply_chat_template: the text ends with the last message's content
    (the end-of-turn after it cut); a template that strips the content still matches."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is "}]
    opened = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert opened == "<|bos|><|user|>\nName a colour.<|end|>\n<|assistant|>\nThe colour is "
    stripping = tok.with_chat_template(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    )
    assert stripping.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    ) == "<user>Name a colour.</s><assistant>The colour is"
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="last message with text"):
        tok.apply_chat_template(
            [*messages[:1], {"role": "assistant", "content": " "}], False, continue_final_message=True
        )
    hiding = tok.with_chat_template("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    with pytest.raises(ValueError, match="does not show"):
        hiding.apply_chat_template(messages, False, continue_final_message=True)


def test_chat_template_raise_exception(tok):
    with pytest.raises(ValueError, match="chat template: unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_template_variables_that_do_not_fit_the_template_are_the_requests_fault(tok):
    tools = tok.with_chat_template("{% for t in tools %}{{ t.name }}{% endfor %}{{ messages | length }}")
    assert tools.apply_chat_template([], template_kwargs={"tools": [{"name": "f"}]}) == "f0"
    for bad in (5, None):  # not iterable: a TypeError inside the template
        with pytest.raises(ValueError, match="chat template: .*not iterable"):
            tools.apply_chat_template([], template_kwargs={"tools": bad})


def test_no_chat_template(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.eos_token_ids == (EOS_ID,) and tok.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_file_and_named_templates(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config = {
        "bos_token": {"content": "<|bos|>"},
        "chat_template": [{"name": "default", "template": "A{{ bos_token }}"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(tmp_path).apply_chat_template([]) == "A<|bos|>"
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
    )
    rendered = Tokenizer.from_folder(tmp_path).apply_chat_template(
        [{"role": "user", "content": "ü"}, {"role": "user", "content": "not shown"}]
    )
    assert rendered == '{"role": "user", "content": "ü"}'


def test_template_is_sandboxed():
    tok = Tokenizer(build_tiny_tokenizer(), chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([])
    tok = Tokenizer(build_tiny_tokenizer(), chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([])
