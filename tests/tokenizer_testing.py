"""Small tokenizers built with the ``tokenizers`` library, one per family of decoder, for the
tokenizer, detokenizer and output tests."""
from __future__ import annotations

import random

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from engine.models.tiny import EOS_ID, END_ID, build_tiny_tokenizer, byte_to_unicode
from engine.tokenizer import Tokenizer

BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>"]
SENTENCEPIECE_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
LLAMA2_DECODER = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                  decoders.Strip(" ", 1, 0)]


def tiny() -> Tokenizer:
    """The built-in tiny model's tokenizer: one token per byte, then special tokens."""
    return Tokenizer(build_tiny_tokenizer(), eos_token_ids=[EOS_ID, END_ID])


def crossing_bpe() -> Tokenizer:
    """Byte-level BPE whose merges cross UTF-8 character boundaries: in "ää" the bytes
    C3 A4 C3 A4 become the tokens [C3] [A4 C3] [A4]. Its special tokens come last."""
    b2u = byte_to_unicode()
    vocab = {char: b for b, char in b2u.items()}
    merges = [(b2u[0xA4], b2u[0xC3]), (b2u[0xE4], b2u[0xBD]), ("t", "h"), (b2u[0x20], "th")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(BPE_SPECIAL_TOKENS)
    return Tokenizer(backend, eos_token="<|endoftext|>")


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


def sentencepiece(decoder: list | None = None) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback, as Llama 2's: "▁" for a space, ``<0xAB>``
    for each byte of a character the vocabulary lacks, whole tokens for a few multi-byte
    characters, and ``<unk>``, ``<s>``, ``</s>`` (ids 0-2) as special tokens. ``decoder``:
    its parts (Llama 2's by default), or one decoder."""
    vocab = {token: i for i, token in enumerate(SENTENCEPIECE_SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁", "你")]
    for piece in ["▁", *"abc", "é", "你", "🙂", *(a + b for a, b in merges)]:
        vocab[piece] = len(vocab)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    parts = LLAMA2_DECODER if decoder is None else decoder
    backend.decoder = decoders.Sequence(parts) if isinstance(parts, list) else parts
    backend.add_special_tokens(SENTENCEPIECE_SPECIAL_TOKENS)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


def random_ids(tokenizer: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """``n`` ids: any of the vocabulary's (special tokens and broken UTF-8 among them) and
    those of short texts with multi-byte characters (which the cut at ``n`` may split), mixed."""
    size = tokenizer.backend.get_vocab_size()
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.5:
            ids.append(rng.randrange(size))
        else:
            text = "".join(rng.choice(_TEXT) for _ in range(rng.randint(1, 4)))
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


_TEXT = ["a", "b", "c", "th", " ", "  ", "é", "ü", "ää", "你", "🙂", "\n"]
