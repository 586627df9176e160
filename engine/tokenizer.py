"""Text ↔ token ids and chat templates (streaming detokenization: :mod:`engine.detokenizer`).

A :class:`Tokenizer` is read from a model folder: ``tokenizer.json`` (the ``tokenizers``
format, required), ``tokenizer_config.json`` (special tokens and ``chat_template``,
optional) and ``chat_template.jinja`` (newer checkpoints keep the template there).
"""
from __future__ import annotations

import copy
import datetime
import functools
import json
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from engine.detokenizer import decodes_in_context
from engine.json_config import read_object


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of a model.

    ``eos_token_ids`` is every id that ends a generation (the loader merges the ids of
    ``config.json``, ``generation_config.json`` and ``tokenizer_config.json``).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = list(dict.fromkeys(eos_token_ids))
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        if eos_token is None and ids:
            eos_token = backend.id_to_token(ids[0])
        self.eos_token = eos_token
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.chat_template = chat_template
        self._special_tokens = {
            **(special_tokens or {}),
            "bos_token": bos_token or "",
            "eos_token": eos_token or "",
        }
        self._compiled: jinja2.Template | None = None
        self._single: dict[tuple[int, bool], str] = {}  # decode_one's answers

    @classmethod
    def from_folder(cls, folder: str | Path, *, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model folder")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = read_object(config_path)
        special = {
            key: token
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := _token_text(config.get(key))) is not None
        }
        template_path = folder / "chat_template.jinja"
        if template_path.is_file():
            template = template_path.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"), config_path)
        return cls(
            backend,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            eos_token_ids=eos_token_ids,
            chat_template=template,
            special_tokens=special,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object, for reading its vocabulary and decoder (do not change it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the length of the vocabulary's longest
        entry (byte-level entries have a character per byte, so this bounds the text too)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def decodes_in_context(self) -> dict[int, int] | None:
        """The ids of the byte-fallback tokens if the decoder decodes a window in one call as
        token by token, else None (:func:`engine.detokenizer.decodes_in_context`)."""
        return decodes_in_context(self._backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor
        adds (a BOS for Llama). Encode a rendered chat prompt with ``add_special_tokens=False``:
        chat templates write their own BOS.

        Releases the GIL while it runs (``encode_batch`` does, ``encode`` does not), so a long
        prompt tokenized on a worker thread does not stall the other threads."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered (at most one entry per vocabulary entry): the
        incremental detokenizer decodes the same one-token contexts over and over."""
        key = (token_id, skip_special_tokens)
        text = self._single.get(key)
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=skip_special_tokens)
            self._single[key] = text
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy that renders chats with ``template`` instead of the model's; ``ValueError``
        when the template does not compile."""
        try:
            compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template, line {e.lineno}: {e.message}") from None
        other = copy.copy(self)
        other.chat_template = template
        other._compiled = compiled
        return other

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the model's template.
        ``template_kwargs``: further variables the template reads (``enable_thinking``...);
        as in vLLM they may set ``add_generation_prompt`` and the special tokens too, not
        ``messages``. ``continue_final_message``: the text ends with the last message's
        content, left open for the model to go on (what the template puts after it, an
        end-of-turn token, is cut), as in Hugging Face's ``apply_chat_template``."""
        if template_kwargs and "messages" in template_kwargs:
            raise ValueError("the chat template's variables may not set messages")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message:
            return _open_final_message(self._render(messages, False, template_kwargs), messages)
        return self._render(messages, add_generation_prompt, template_kwargs)

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict | None) -> str:
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json has no 'chat_template' "
                "and there is no chat_template.jinja); use a completion prompt instead"
            )
        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template)
        try:
            variables = {"add_generation_prompt": add_generation_prompt, **self._special_tokens}
            return self._compiled.render(messages=messages, **{**variables, **(template_kwargs or {})})
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            # the request's messages or template variables do not fit the template (a
            # variable of the wrong type): the request's fault, as vLLM answers it
            raise ValueError(f"chat template: {e}") from None


def _open_final_message(rendered: str, messages: list[dict]) -> str:
    """``rendered`` cut just after the last message's content (stripped of surrounding
    space if the template strips it)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    for text in (final, final.strip()):
        end = rendered.rfind(text)
        if end >= 0:
            return rendered[: end + len(text)]
    raise ValueError(
        "continue_final_message: the chat template does not show the last message's text as sent"
    )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    # Templates expect unescaped unicode, unlike jinja's built-in filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _pick_template(value: Any, source: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
    raise ValueError(f"{source}: 'chat_template' must be a string or a list with a 'default' entry")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # the serialized AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None

