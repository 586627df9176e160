"""Structured output: a grammar (JSON schema, any JSON object, regex, choice or EBNF) decides
which tokens a request may sample, with xgrammar doing the matching.

- :class:`StructuredOutputSpec` is what a request asks for; it is hashable and rides in
  ``SamplingParams.structured_output``.
- :class:`GrammarCompiler` holds the model's vocabulary as xgrammar sees it (built at first
  use) and a small LRU of compiled grammars, one per distinct spec. It is thread-safe: the
  server compiles on a worker thread before it admits a request, and the engine thread then
  finds the grammar in the cache.
- :class:`GrammarState` is one request's matcher: it fills the request's row of the step's
  bitmask and advances with each accepted token. It is owned by the engine thread.
- :func:`apply_token_masks` masks a batch's logits with one bitmask and one tensor op.

A request ends when its grammar does: the grammar then allows only the model's eos tokens,
and accepting one terminates it (``finish_reason="stop"``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept; a JSON schema compiles in milliseconds to seconds
_MAX_COMPILE_THREADS = 4
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclasses.dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match.

    ``kind`` and ``value``: ``"json"`` and a JSON schema (a dict or its JSON text, kept as
    text); ``"json_object"`` and nothing (any JSON object); ``"regex"`` and a regular
    expression; ``"choice"`` and the strings to choose from; ``"grammar"`` and an EBNF grammar
    in xgrammar's dialect (GBNF). ``any_whitespace=False`` makes JSON compact (``", "`` and
    ``": "`` between items) instead of allowing any whitespace between tokens, as vLLM's
    ``disable_any_whitespace`` does. ``source`` names the request field it came from, for error
    messages; it is not part of the spec's identity.
    """

    kind: str
    value: Any = None
    any_whitespace: bool = True
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.source:
            object.__setattr__(self, "source", self.kind)
        value = self.value
        if self.kind == "json":
            value = _schema_text(value, self.source)
        elif self.kind == "json_object":
            value = None
        elif self.kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{self.source} must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in value):
                raise ValueError(f"{self.source} must be a non-empty list of strings")
            value = tuple(value)
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{self.source} must be a non-empty string")
        object.__setattr__(self, "value", value)
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"any_whitespace must be True or False, got {self.any_whitespace!r}")


def _schema_text(schema: Any, source: str) -> str:
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"{source} is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{source} must be a JSON schema (an object)")
        return json.dumps(schema, ensure_ascii=False)
    except RecursionError:  # json nests by recursion: a schema too deep for it is the user's
        raise ValueError(f"{source} is nested too deeply to read as JSON") from None


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``[M, ceil(vocab / 32)]`` int32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, token_id: int) -> bool:
        """Accept the sampled token; True once the grammar has ended (an eos token closed it).
        Raises ``ValueError`` for a token the grammar does not allow (the mask forbade it)."""
        if not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not match the request's grammar")
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles specs for one model's vocabulary and keeps the last ``cache_size`` of them.

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's);
    ``stop_token_ids`` are the ids that close a grammar (the model's eos tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # guards _cache and the creation of _compiler
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache when it is there. Raises
        ``ValueError`` naming ``spec.source`` for a schema, regex or grammar xgrammar refuses,
        and for a tokenizer whose vocabulary it cannot read."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiled = self._compile(spec)  # outside the lock: others' cache hits need not wait
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutputSpec) -> GrammarState:
        """A fresh matcher at the start of ``spec``'s grammar."""
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(self.compile(spec)))

    def _compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.value, any_whitespace=spec.any_whitespace)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=spec.any_whitespace
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                # Each choice as a JSON string literal: xgrammar's EBNF strings take JSON's escapes.
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.value)
                )
            return compiler.compile_grammar(spec.value)
        except RuntimeError as e:  # xgrammar reports a bad schema, regex or grammar so
            raise ValueError(f"{spec.source}: {_cpp_message(e)}") from None

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo(
                    token_bytes(self._tokenizer, self._vocab_size),
                    xgrammar.VocabType.RAW,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                threads = max(1, min(_MAX_COMPILE_THREADS, os.cpu_count() or 1))
                # Its own cache is off: ours is the one cache, bounded by entries.
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=threads, cache_enabled=False
                )
            return self._compiler


def _cpp_message(error: RuntimeError) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    first, *rest = str(error).strip().splitlines() or [""]
    return " ".join([_CPP_PREFIX.sub("", first), *(line.strip() for line in rest)]).strip()


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes each token id stands for in generated text, ``vocab_size`` entries.

    Byte-level tokenizers (GPT-2, Llama 3, Qwen, the tiny model) spell bytes with printable
    stand-ins; SentencePiece-style ones (Llama 2, Mistral: a metaspace ``▁`` for a space,
    ``<0xAB>`` for byte fallback) are read as such. Special tokens and ids past the tokenizer
    get ``b""``, which xgrammar never allows inside a grammar. Other kinds of tokenizer (a
    WordPiece decoder, for one) raise ``ValueError``.
    """
    backend = tokenizer.backend
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = _decoder_types(decoder)
    if "ByteLevel" in kinds:
        chars = _byte_level_chars()

        def to_bytes(token: str) -> bytes:
            if all(c in chars for c in token):
                return bytes(chars[c] for c in token)
            return token.encode("utf-8")  # an added, non-special token: its text as is

    elif "Metaspace" in kinds or _replaces_metaspace(decoder):
        byte_fallback = "ByteFallback" in kinds

        def to_bytes(token: str) -> bytes:
            if byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode("utf-8")

    else:
        described = ", ".join(sorted(kinds)) or "none"
        raise ValueError(
            "structured output needs a byte-level or SentencePiece (metaspace) tokenizer; this "
            f"model's tokenizer.json has decoder {described}"
        )
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = [b""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            table[i] = to_bytes(token)
    return table


def _decoder_types(decoder: dict) -> set[str]:
    if decoder.get("type") == "Sequence":
        return {t for d in decoder.get("decoders", ()) for t in _decoder_types(d)}
    return {decoder["type"]} if "type" in decoder else set()


def _replaces_metaspace(decoder: dict) -> bool:
    """Llama 2's decoder: a Sequence with ``Replace("▁", " ")`` instead of a Metaspace."""
    parts = decoder.get("decoders", ()) if decoder.get("type") == "Sequence" else (decoder,)
    return any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581" for d in parts
    )


def _byte_level_chars() -> dict[str, int]:
    """The printable stand-in of each byte in byte-level vocabularies, mapped back to the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def apply_token_masks(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's grammar forbids next.

    ``logits``: ``[M, vocab]``, one row per entry of ``grammars``; a row without a grammar is
    left alone. The matchers fill one bitmask for the batch on the host; it crosses to the
    logits' device in one copy and is applied with one ``masked_fill_``.
    """
    if all(g is None for g in grammars):
        return
    num_rows, vocab_size = logits.shape
    bitmask = torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)  # [M, W]: all allowed
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_bitmask(bitmask, row)
    if logits.is_cuda:  # pinned: a pageable copy would wait for the forward queued before it
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, vocab_size)  # [M, vocab] bool
    logits.masked_fill_(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[M, W]`` int32 words (bit ``j`` of word ``w`` is token ``32w + j``) to ``[M, vocab]`` bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
