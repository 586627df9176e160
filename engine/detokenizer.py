"""Token ids to text as they are sampled: each request's :class:`IncrementalDetokenizer`.

A request that streams reads its text after every step, so its ids are decoded one by one
(:meth:`IncrementalDetokenizer.add`). One whose text is read only when it ends may give all
of its ids at its finish (:meth:`IncrementalDetokenizer.finish_with`): one decode of the
window instead of one per token, where the tokenizer's decoder gives the same text both ways
(:func:`decodes_in_context`); elsewhere they are still added one by one, at the finish.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    ``add`` returns only text that is complete: while the bytes seen so far end in the
    middle of a UTF-8 character (a byte-level tokenizer splits characters across tokens),
    it returns ``""`` and waits. ``finish`` returns whatever is still held back. The
    pieces joined equal ``tokenizer.decode(all_ids)``.

    Decoding runs over a short window of ids, not the whole output::

        ids:  ... | emitted, context |  held back  |
                  ^prefix            ^read         ^len(ids)

    Text for ``ids[read:]`` is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``;
    the context token keeps decoders that strip a leading space from changing the text.

    ``tokenizers``' own ``DecodeStream`` runs that window in one call per token (a third of
    the Python version's cost, which is per running request per decode step); the window's
    bounds are kept here too, for ``finish`` and for a decoder whose text of a window does
    not begin with its context's text, which ``DecodeStream`` refuses and the slice below
    takes as it comes. ``finish_with`` grows the window by all the ids left at once and
    decodes it once, where the decoder gives the same text that way.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        if self._stream is None:
            context, text = self._window()
            piece = text[len(context) :]
            if not piece or piece[-1] == REPLACEMENT_CHAR:
                return ""
        else:
            try:
                piece = self._stream.step(self._tokenizer._backend, token_id)
            except Exception:  # the window's text does not begin with its context's
                self._stream = None
                return self.add(ids.pop())
            if piece is None:  # held back: the same rule as the window's (empty, or ends in U+FFFD)
                return ""
        self._prefix, self._read = self._read, len(ids)
        return piece

    def finish(self) -> str:
        """The held-back rest (text the ids end with that is not valid UTF-8, decoded with
        replacement characters, as ``decode`` would)."""
        context, text = self._window()
        self._restart()
        return text[len(context) :]

    def finish_with(self, token_ids: list[int], *, held_back: bool = True) -> str:
        """``"".join(map(self.add, token_ids))``, then (``held_back``) ``self.finish()``;
        without it the held-back rest is dropped, as an aborted request's. In one decode of
        the window where that gives the same text: the decoder decodes in context
        (:func:`decodes_in_context`), ``DecodeStream`` has not been refused, the window's
        byte-fallback runs are whole characters, its text begins with its context's, and
        without ``held_back`` it holds nothing back (ends in no U+FFFD). With ``held_back``
        the next id starts a new text, as after ``finish``; without it none may follow."""
        byte_ids = self._tokenizer.decodes_in_context
        if byte_ids is not None and self._stream is not None:
            ids = self._ids
            ids.extend(token_ids)
            if _whole_characters(ids[self._prefix :], byte_ids):
                context, text = self._window()
                if text.startswith(context) and (held_back or text[-1:] != REPLACEMENT_CHAR):
                    self._restart()
                    return text[len(context) :]
            del ids[len(ids) - len(token_ids) :]
        text = "".join(map(self.add, token_ids))
        return text + self.finish() if held_back else text

    def _restart(self) -> None:
        """Begin the next text after all the ids, without context."""
        self._prefix = self._read = len(self._ids)
        if self._stream is not None:  # the stream still holds the rest: start it clean
            self._stream = DecodeStream(skip_special_tokens=self._skip)

    def _window(self) -> tuple[str, str]:
        """The text of the context, and of the whole window."""
        tokenizer, ids, prefix, skip = self._tokenizer, self._ids, self._prefix, self._skip
        if self._read - prefix == 1:  # the usual context: the one token emitted last
            context = tokenizer.decode_one(ids[prefix], skip)
        else:
            context = tokenizer.decode(ids[prefix : self._read], skip)
        # the slice is a new list already: straight to the backend (decode() copies it)
        return context, tokenizer._backend.decode(ids[prefix:], skip_special_tokens=skip)


def decodes_in_context(backend: Any) -> dict[int, int] | None:
    """Whether ``backend``'s decoder gives the text of a window in one decode as
    :meth:`IncrementalDetokenizer.add` gives it piece by piece: the ids of its byte-fallback
    tokens (id -> byte; empty without ``ByteFallback``) if so, else None.

    It does when the text a token adds after at least one token of context is the same
    whatever that context is: each window ``add`` decodes then adds the same text as the one
    window. So it is for ``ByteLevel`` alone (its bytes decode left to right, and a window
    is only cut where its text ends in a whole character), and for a SentencePiece decoder
    (Llama 2, Mistral, Gemma, T5): a ``Metaspace`` (it treats only a window's first token
    apart), or a ``Sequence`` of ``Replace`` of one character, ``ByteFallback``, ``Fuse`` and
    ``Strip`` of at most one leading character. ``ByteFallback`` decodes a run of byte tokens
    that is not whole UTF-8 to one U+FFFD per byte, whichever tokens of the run a window
    holds, so a window with such a run is added one by one (:func:`_whole_characters`).

    Left out, as they may rewrite text across tokens: ``WordPiece`` (its cleanup joins
    words), ``BPEDecoder`` (a window's last token loses its suffix's space), ``CTC`` (it
    drops repeated tokens), a ``Replace`` of a longer or regex pattern (a match may span
    tokens), and anything else (no decoder, ``ByteLevel`` in a ``Sequence``).
    """
    decoder = backend.decoder
    config = json.loads(decoder.__getstate__()) if decoder is not None else {}
    parts = config.get("decoders", []) if config.get("type") == "Sequence" else [config]
    if config.get("type") != "ByteLevel" and not (parts and all(map(_sentencepiece_part, parts))):
        return None
    if not any(part.get("type") == "ByteFallback" for part in parts):
        return {}
    vocab = backend.get_vocab(with_added_tokens=True)
    return {i: int(t[3:5], 16) for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t)}


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # ByteFallback's spelling of a byte


def _sentencepiece_part(part: dict[str, Any]) -> bool:
    kind = part.get("type")
    if kind == "Replace":
        return len(part.get("pattern", {}).get("String") or "") == 1
    if kind == "Strip":
        return part.get("start", 0) <= 1 and part.get("stop", 0) == 0
    return kind in ("ByteFallback", "Fuse", "Metaspace")


def _whole_characters(ids: list[int], byte_ids: dict[int, int]) -> bool:
    """Every run of byte tokens in ``ids`` is whole UTF-8 (then so is each longer run that
    skipped special tokens between them make)."""
    if not byte_ids or byte_ids.keys().isdisjoint(ids):
        return True
    run = bytearray()
    for token in [*ids, None]:
        byte = byte_ids.get(token)
        if byte is not None:
            run.append(byte)
            continue
        try:
            run.decode()
        except UnicodeDecodeError:
            return False
        run.clear()
    return True
