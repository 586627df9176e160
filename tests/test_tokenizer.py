"""Tokenizer: round trips, chat templates, and streaming detokenization."""
from __future__ import annotations

import json
import threading
import time

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from engine.models.tiny import (
    BOS_ID,
    END_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    byte_to_unicode,
    write_tiny_tokenizer,
)
from engine.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

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


def crossing_bpe() -> Tokenizer:
    """Byte-level BPE whose merges cross UTF-8 character boundaries: in "ää" the bytes
    C3 A4 C3 A4 become the tokens [C3] [A4 C3] [A4]."""
    b2u = byte_to_unicode()
    vocab = {char: b for b, char in b2u.items()}
    merges = [(b2u[0xA4], b2u[0xC3]), (b2u[0xE4], b2u[0xBD]), ("t", "h"), (b2u[0x20], "th")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def metaspace() -> Tokenizer:
    """SentencePiece-style: spaces become "▁" and decoding drops the text's leading space."""
    chars = ["▁", *"abcdefghij"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}, "▁a": 12, "▁b": 13, "ab": 14}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b"), ("a", "b")], unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    return Tokenizer(backend)


def stream(
    tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True, *, window_only: bool = False
) -> list[str]:
    """The pieces of ``ids``; ``window_only``: without ``tokenizers``' DecodeStream, the
    detokenizer's own window (what it falls back to)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    if window_only:
        detok._stream = None
    pieces = [detok.add(i) for i in ids]
    return pieces + [detok.finish()]


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


# --- incremental detokenization ----------------------------------------------------------


def test_multibyte_character_waits_for_its_last_byte(tok):
    ids = tok.encode("a你🙂", add_special_tokens=False)  # 1 + 3 + 4 byte tokens
    assert stream(tok, ids) == ["a", "", "", "你", "", "", "", "🙂", ""]


def test_invalid_tail_comes_out_at_finish(tok):
    ids = [ord("A"), 0xE4, 0xBD]  # "A" and the first two bytes of a three-byte character
    pieces = stream(tok, ids)
    assert pieces[:3] == ["A", "", ""]
    assert "".join(pieces) == tok.decode(ids) and pieces[3].startswith(REPLACEMENT_CHAR)


def test_special_tokens_in_the_stream(tok):
    ids = [BOS_ID, *"hé".encode(), END_ID, *"x".encode()]
    assert "".join(stream(tok, ids)) == "héx"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "<|bos|>hé<|end|>x"


valid_text = st.text(st.characters(codec="utf-8", exclude_characters=REPLACEMENT_CHAR), max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=valid_text)
def test_stream_equals_decode_byte_level(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    if not any(special in text for special in SPECIAL_TOKENS):  # those encode to their id
        assert tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.sampled_from("ää你th 🙂x"), max_size=30))
def test_stream_equals_decode_with_merges_across_characters(text):
    tok = crossing_bpe()
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.sampled_from("abcj  "), max_size=30))
def test_stream_equals_decode_metaspace(text):
    tok = metaspace()
    ids = tok.encode(text)
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_decode_stream_gives_the_windows_pieces(tok, data):
    """DecodeStream and the detokenizer's own window cut the text at the same tokens, for
    every kind of tokenizer above, whatever ids come (special ones and broken UTF-8 too)."""
    kind = data.draw(st.sampled_from(["byte-level", "crossing", "metaspace"]))
    t = {"byte-level": tok, "crossing": crossing_bpe(), "metaspace": metaspace()}[kind]
    ids = data.draw(st.lists(st.integers(0, t._backend.get_vocab_size() - 1), max_size=30))
    skip = data.draw(st.booleans())
    assert stream(t, ids, skip) == stream(t, ids, skip, window_only=True)


def test_a_decoder_that_rewrites_its_context_falls_back_to_the_window():
    """Fusing "ab" into "XYZ" makes the text of [a, b] not begin with that of [a]: DecodeStream
    refuses it, and the window's slice takes over for the rest of the request."""
    backend = tokenizers.Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2}, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    assert stream(Tokenizer(backend), [0, 1, 2, 0]) == ["a", "YZ", "c", "a", ""]
