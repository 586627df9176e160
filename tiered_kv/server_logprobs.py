"""Logprobs in the response bodies: the chosen tokens' (OpenAI's completions and chat
shapes) and the prompt's (vLLM's ``prompt_logprobs``, and completions' ``echo`` with
``logprobs``, which lists the prompt's tokens before the generated ones).

A token's text is its own decoding, special tokens included; a completion's
``text_offset`` counts the characters of the tokens before it in the choice.
"""
from __future__ import annotations

from engine.async_engine import AsyncLLM
from engine.outputs import PromptLogprob, RequestOutput
from tiered_kv.protocol_responses import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
)


def token_text(llm: AsyncLLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(llm: AsyncLLM, out: RequestOutput, start: int, offset: int) -> CompletionLogprobs:
    """Logprobs of tokens ``start:`` of ``out``; ``offset``: text offset of token ``start``."""
    result = CompletionLogprobs()
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        top = out.top_logprobs[i] if out.top_logprobs is not None else None
        offset = _append(llm, result, out.token_ids[i], logprobs[i], top, offset)
    return result


def echo_logprobs(llm: AsyncLLM, out: RequestOutput, with_generated: bool) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: the prompt's tokens (the first has no logprob), then the
    generated ones when ``with_generated``, as vLLM lists them."""
    entries = out.prompt_logprobs or []
    result = CompletionLogprobs()
    offset = _append(llm, result, out.prompt_token_ids[0], None, None, 0)
    for entry in entries[1:]:
        offset = _append(llm, result, entry.token_id, entry.logprob, entry.top, offset)
    if with_generated:
        generated = completion_logprobs(llm, out, 0, offset)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(result, name).extend(getattr(generated, name))
    return result


def _append(
    llm: AsyncLLM, result: CompletionLogprobs, token_id: int, logprob: float | None,
    top: dict[int, float] | None, offset: int,
) -> int:
    """Append one token to ``result``; the offset of the next. A token with a logprob is in
    its top list whatever its rank (``k + 1`` entries at most; the token alone for
    ``logprobs: 0``, as vLLM's)."""
    text = token_text(llm, token_id)
    result.tokens.append(text)
    result.token_logprobs.append(logprob)
    result.text_offset.append(offset)
    if logprob is None:
        result.top_logprobs.append(None)
    else:
        texts = {token_text(llm, t): lp for t, lp in (top or {}).items()}
        texts.setdefault(text, logprob)
        result.top_logprobs.append(texts)
    return offset + len(text)


def chat_logprobs(llm: AsyncLLM, out: RequestOutput, start: int) -> ChatLogprobs:
    content = []
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        text = token_text(llm, out.token_ids[i])
        top = out.top_logprobs[i] if out.top_logprobs is not None else {}
        content.append(
            TokenLogprob(
                token=text,
                logprob=logprobs[i],
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(t := token_text(llm, tid)), logprob=lp, bytes=list(t.encode()))
                    for tid, lp in top.items()
                ],
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(llm: AsyncLLM, out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of ``out``, if it asked for them: per prompt token, by
    token id, the token itself (its rank in the vocabulary) and the ``k`` most likely there
    (ranks 1 to ``k``)."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else _prompt_entry(llm, e) for e in out.prompt_logprobs]


def _prompt_entry(llm: AsyncLLM, entry: PromptLogprob) -> dict[str, PromptTokenLogprob]:
    tokens = {
        str(token_id): PromptTokenLogprob(logprob=lp, rank=rank, decoded_token=token_text(llm, token_id))
        for rank, (token_id, lp) in enumerate(entry.top.items(), start=1)
    }
    tokens.setdefault(str(entry.token_id), PromptTokenLogprob(
        logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(llm, entry.token_id)
    ))
    return tokens
