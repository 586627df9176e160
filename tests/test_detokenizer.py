"""IncrementalDetokenizer: text token by token, and a stream's ids given all at its finish."""
from __future__ import annotations

import random

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.models.tiny import BOS_ID, END_ID, SPECIAL_TOKENS
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tokenizer_testing import (
    LLAMA2_DECODER,
    crossing_bpe,
    metaspace,
    random_ids,
    sentencepiece,
    tiny,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny()


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


# --- token by token ----------------------------------------------------------------------


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


# --- all at the finish -------------------------------------------------------------------

# A tokenizer of each family of decoder that decodes in context, special tokens and
# multi-byte characters in each vocabulary.
DECODE_IN_CONTEXT = {
    "tiny": tiny,  # byte level, a token per byte
    "byte-level BPE": crossing_bpe,  # merges across characters
    "metaspace": metaspace,
    "llama 2": sentencepiece,  # Replace, ByteFallback, Fuse, Strip
    "gemma": lambda: sentencepiece(LLAMA2_DECODER[:3]),
    "t5": lambda: sentencepiece(decoders.Metaspace(prepend_scheme="first")),  # bytes as text
    "metaspace always": lambda: sentencepiece(decoders.Metaspace(prepend_scheme="always")),
    "byte fallback, metaspace": lambda: sentencepiece(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
    ),
}
# Decoders left token by token: the first three rewrite text across tokens (shown below);
# the others may, and are not looked into.
NOT_IN_CONTEXT = {
    "strip two": [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 2, 0)],
    "replace across tokens": [decoders.Fuse(), decoders.Replace("ab", "X")],
    "bpe suffix": decoders.BPEDecoder(suffix="a"),
    "wordpiece": decoders.WordPiece(prefix="\u2581"),
    "ctc": decoders.CTC(pad_token="<unk>", word_delimiter_token="\u2581"),
    "regex replace": [decoders.Replace(Regex("a+"), "X")],
    "byte level in a sequence": [decoders.ByteLevel(), decoders.Fuse()],
}


def primed(tokenizer: Tokenizer, prompt: list[int], skip: bool) -> IncrementalDetokenizer:
    """A request's detokenizer after its prompt, as the output processor primes it."""
    processor = OutputProcessor(tokenizer, (), 64)
    return processor._detokenizer(prompt, SamplingParams(skip_special_tokens=skip))


def counting_adds(detok: IncrementalDetokenizer) -> list[int]:
    calls, add = [0], detok.add

    def counted(token_id: int) -> str:
        calls[0] += 1
        return add(token_id)

    detok.add = counted
    return calls


@pytest.mark.parametrize("family", DECODE_IN_CONTEXT)
def test_ids_finished_at_once_give_the_text_of_adding_them_one_by_one(family):
    """400 seeded random prompts and outputs (special tokens, broken UTF-8, whole and split
    multi-byte characters, prompts that end inside a character), either skip setting:
    ``finish_with`` gives what ``add`` token by token then ``finish`` give, and without
    ``held_back`` what ``add`` alone gives (an abort), mostly in one decode."""
    tokenizer = DECODE_IN_CONTEXT[family]()
    assert tokenizer.decodes_in_context is not None
    rng, at_once = random.Random(family), {True: 0, False: 0}
    for _ in range(400):
        prompt, skip = random_ids(tokenizer, rng, rng.randint(1, 6)), rng.random() < 0.5
        out = random_ids(tokenizer, rng, rng.randint(0, 30))
        one_by_one = primed(tokenizer, prompt, skip)
        sent = "".join(map(one_by_one.add, out))
        for held_back, expected in ((True, sent + one_by_one.finish()), (False, sent)):
            detok = primed(tokenizer, prompt, skip)
            calls = counting_adds(detok)
            assert detok.finish_with(out, held_back=held_back) == expected, (prompt, out, skip)
            at_once[held_back] += calls[0] == 0
    assert at_once[True] > 100 and at_once[False] > 100


def test_a_byte_fallback_run_that_is_not_whole_utf8_is_added_one_by_one():
    """Token by token the "é" of C3 A9 is sent before the lone C3 comes; decoded at once the
    run C3 A9 C3 is three U+FFFD: the detokenizer sees the broken run and adds the ids."""
    tokenizer = sentencepiece()
    vocab = tokenizer.backend.get_vocab()
    ids = [vocab["a"], vocab["<0xC3>"], vocab["<0xA9>"], vocab["<0xC3>"]]
    assert "".join(stream(tokenizer, ids)) == "aé\ufffd\ufffd"
    assert tokenizer.decode(ids) == "a\ufffd\ufffd\ufffd"
    detok = IncrementalDetokenizer(tokenizer)
    calls = counting_adds(detok)
    assert detok.finish_with(ids) == "aé\ufffd\ufffd" and calls[0] == 4
    detok = IncrementalDetokenizer(tokenizer)
    calls = counting_adds(detok)
    assert detok.finish_with(ids[:3]) == "aé" and calls[0] == 0
    detok = IncrementalDetokenizer(tokenizer)
    calls = counting_adds(detok)
    assert detok.finish_with(ids[:2], held_back=False) == "a" and calls[0] == 2  # C3 held back


def test_byte_fallback_ids_are_known_only_to_decoders_with_byte_fallback():
    assert tiny().decodes_in_context == {} and metaspace().decodes_in_context == {}
    assert sentencepiece(decoders.Metaspace()).decodes_in_context == {}  # "<0xC3>" is text
    byte_ids = sentencepiece().decodes_in_context
    vocab = sentencepiece().backend.get_vocab()
    assert len(byte_ids) == 256 and byte_ids[vocab["<0xC3>"]] == 0xC3


@pytest.mark.parametrize("family", NOT_IN_CONTEXT)
def test_other_decoders_add_the_ids_one_by_one(family):
    tokenizer = sentencepiece(NOT_IN_CONTEXT[family])
    assert tokenizer.decodes_in_context is None
    rng = random.Random(family)
    for _ in range(50):
        out = random_ids(tokenizer, rng, rng.randint(0, 20))
        detok = IncrementalDetokenizer(tokenizer)
        calls = counting_adds(detok)
        assert detok.finish_with(out) == "".join(stream(tokenizer, out)) and calls[0] >= len(out)


def test_no_decoder_or_a_strip_at_the_end_adds_the_ids_one_by_one():
    backend = tokenizers.Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1}, unk_token="a"))
    assert Tokenizer(backend).decodes_in_context is None
    # (decoding a window of skipped tokens alone with this one panics in tokenizers 0.23)
    assert sentencepiece([decoders.Fuse(), decoders.Strip(" ", 0, 1)]).decodes_in_context is None


@pytest.mark.parametrize(
    ("family", "tokens", "one_by_one", "at_once"),
    [
        ("strip two", ["b", "\u2581", "\u2581a"], "b a", "b  a"),
        ("replace across tokens", ["b", "a", "b"], "ba", "bX"),
        ("bpe suffix", ["ab", "a"], "bb", " b"),
    ],
)
def test_why_those_decoders_are_left_token_by_token(family, tokens, one_by_one, at_once):
    tokenizer = sentencepiece(NOT_IN_CONTEXT[family])
    ids = [tokenizer.token_to_id(t) for t in tokens]
    assert "".join(stream(tokenizer, ids)) == one_by_one
    assert tokenizer.decode(ids) == at_once
