"""Structured output on the tiny model: grammars compiled and cached, the batch's logits masked,
requests ending with their grammar; and the server's response_format / structured_outputs /
guided_* fields, streaming and errors."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import tokenizers
import torch
import xgrammar
from tokenizers import decoders, models

from engine import LLM, AsyncLLM, SamplingParams
from engine.models.tiny import EOS_ID, END_ID, build_tiny_tokenizer
from engine.structured_output import (
    GrammarCompiler,
    StructuredOutputSpec,
    apply_token_masks,
    token_bytes,
    unpack_bitmask,
)
from engine.tokenizer import Tokenizer
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import assert_error, run, sse_events

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["id", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-\d{2,4}"
CHOICES = ["yes", "no", 'it "depends"']
VOCAB = 264  # the tiny model's: 256 bytes and 8 special tokens
MAX_TOKENS = 120


def spec(kind, value=None, **kw):
    return StructuredOutputSpec(kind, value, **kw)


def params(structured, temperature=0.0, seed=None, **kw):
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_output=structured, **kw
    )


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu") as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return Tokenizer(build_tiny_tokenizer(), eos_token_ids=[EOS_ID, END_ID])


# ---------------------------------------------------------------- the vocabulary


def test_byte_level_vocabulary_maps_stand_ins_back_to_bytes(tiny_tokenizer):
    table = token_bytes(tiny_tokenizer, VOCAB + 8)  # logits wider than the tokenizer
    assert table[:256] == [bytes([b]) for b in range(256)]
    assert table[256:] == [b""] * 16  # special tokens and padding: never inside a grammar


def _sentencepiece(decoder) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "\u2581hi": 4, "{": 5, "\u2581": 6}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.decoder = decoder
    return Tokenizer(backend, eos_token="</s>")


def test_sentencepiece_vocabularies_read_metaspace_and_byte_fallback():
    llama2 = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    table = token_bytes(_sentencepiece(llama2), 7)
    assert table[1:] == [b"", b"", b"\n", b" hi", b"{", b" "]
    table = token_bytes(_sentencepiece(decoders.Metaspace()), 7)
    assert table[3:] == [b"<0x0A>", b" hi", b"{", b" "]  # no byte fallback: the text as is


def test_other_tokenizers_are_refused_by_name():
    with pytest.raises(ValueError, match="byte-level or SentencePiece.*WordPiece"):
        token_bytes(_sentencepiece(decoders.WordPiece()), 7)


# ---------------------------------------------------------------- specs, compiling, masks


def test_specs_normalize_and_refuse_malformed_values():
    assert spec("json", json.dumps(SCHEMA)) == spec("json", SCHEMA)
    assert spec("choice", ["a", "b"]) == spec("choice", ("a", "b"))
    assert hash(spec("regex", "a+", source="guided_regex")) == hash(spec("regex", "a+"))
    for kind, value, message in [
        ("xml", "<a/>", "kind must be one of"),
        ("json", "{not json", "json is not valid JSON"),
        ("json", [1], "json must be a JSON schema"),
        ("choice", "yes", "choice must be a non-empty list"),
        ("choice", [], "choice must be a non-empty list"),
        ("regex", "", "regex must be a non-empty string"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec(kind, value)
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_output=spec("json_object"))


def test_a_schema_nested_deeper_than_json_recurses_is_refused():
    """Python's json reads and writes by recursion: a schema past its depth is a ValueError
    naming the field (it was a RecursionError, which the server answered with a 500)."""
    deep: dict = {}
    for _ in range(5000):
        deep = {"not": deep}
    for value in ("[" * 5000, '{"a":' * 5000, deep):
        with pytest.raises(ValueError, match="^guided_json is nested too deeply"):
            spec("json", value, source="guided_json")


def test_compiled_grammars_are_cached_per_spec_lru(tiny_tokenizer, monkeypatch):
    compiler = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS_ID], cache_size=2)
    compiled = []
    original = GrammarCompiler._compile
    monkeypatch.setattr(
        GrammarCompiler, "_compile", lambda self, s: compiled.append(s.value) or original(self, s)
    )
    a = compiler.compile(spec("regex", "a+"))
    assert compiler.compile(spec("regex", "a+", source="guided_regex")) is a
    compiler.compile(spec("regex", "b+"))
    compiler.compile(spec("regex", "a+"))  # now the most recent
    compiler.compile(spec("regex", "c+"))  # evicts b+
    compiler.compile(spec("regex", "a+"))
    compiler.compile(spec("regex", "b+"))
    assert compiled == ["a+", "b+", "c+", "b+"]


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("json", {"type": "foo"}, r"^response_format: Unsupported type"),
        ("regex", "a((", r"^response_format: Regex parsing error"),
        ("grammar", "root ::= missing", r"^response_format: .*missing"),
    ],
)
def test_bad_schemas_regexes_and_grammars_raise_naming_the_field(tiny_tokenizer, kind, value, message):
    compiler = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS_ID])
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec(kind, value, source="response_format"))


def test_batch_mask_matches_xgrammar_and_leaves_free_rows_alone(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS_ID])
    digits, word = compiler.state(spec("regex", r"\d+")), compiler.state(spec("choice", ["ab", "cd"]))
    assert not digits.advance(ord("7"))  # a digit read, more may follow
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))  # [M, vocab]
    expected = logits.clone()
    bitmask = xgrammar.allocate_token_bitmask(3, VOCAB)
    digits.fill_bitmask(bitmask, 0)
    word.fill_bitmask(bitmask, 2)
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    apply_token_masks(logits, [digits, None, word])
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {*range(48, 58), EOS_ID}
    assert set(torch.isfinite(logits[2]).nonzero().flatten().tolist()) == {ord("a"), ord("c")}
    assert unpack_bitmask(torch.tensor([[-1, 1]], dtype=torch.int32), 40)[0].tolist() == [True] * 33 + [False] * 7


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 3), (0.7, 2)])
def test_outputs_match_their_grammar_and_end_with_it(llm, temperature, seed):
    cases = [
        # Any whitespace lets a random model wander in it; compact JSON ends within the budget.
        (spec("json", SCHEMA, any_whitespace=False), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (spec("json_object"), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        (spec("regex", REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (spec("choice", CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    ]
    outs = llm.generate(
        ["Hello"] * len(cases), [params(s, temperature, seed) for s, _ in cases]
    )
    for (s, check), out in zip(cases, outs):
        assert out.finish_reason == "stop", (s.kind, out.text)
        assert out.stop_reason is None and out.token_ids[-1] in (EOS_ID, END_ID)
        check(out.text)


def test_a_grammar_still_ends_the_request_when_eos_is_ignored(llm):
    (out,) = llm.generate("Hi", params(spec("choice", CHOICES), ignore_eos=True))
    assert out.finish_reason == "stop" and out.text in CHOICES
    assert out.token_ids[-1] in (EOS_ID, END_ID)


def test_grammar_rows_batched_with_free_rows_sample_as_alone(llm):
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    constrained = params(spec("regex", REGEX), temperature=1.0, seed=6)
    alone = [llm.generate("Once", p)[0].token_ids for p in (free, constrained)]
    together = [o.token_ids for o in llm.generate(["Once", "Once"], [free, constrained])]
    assert together == alone
    assert not re.fullmatch(REGEX, llm.tokenizer.decode(alone[0]))  # the free row is unconstrained


def test_a_bad_schema_is_refused_when_the_request_is_added(llm):
    with pytest.raises(ValueError, match="^json: Unsupported type"):
        llm.generate("Hi", params(spec("json", {"type": "foo"})))


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM("tiny", max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    yield llm
    llm.shutdown()


# Greedy, the random model wanders in the whitespace JSON allows; seeded samples end in time.
BASE = {"temperature": 1.0, "seed": 3, "max_tokens": MAX_TOKENS}
MESSAGES = [{"role": "user", "content": "Give me JSON"}]


def test_server_fields_on_both_routes(async_llm):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}

    async def test(c):
        chat = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": response_format, **BASE})
        cmpl = await c.post("/v1/completions", json={"prompt": "{", "response_format": {"type": "json_object"}, **BASE})
        regex = await c.post("/v1/completions", json={"prompt": "id", "guided_regex": REGEX, **BASE})
        choice = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "guided_choice": CHOICES, **BASE})
        guided_json = await c.post("/v1/completions", json={"prompt": "x", "guided_json": SCHEMA, **BASE})
        structured = await c.post(
            "/v1/completions",
            json={"prompt": "x", "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, **BASE},
        )
        so_choice = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "structured_outputs": {"choice": ["a", "b"]}, **BASE})
        return chat, cmpl, regex, choice, guided_json, structured, so_choice

    chat, cmpl, regex, choice, guided_json, structured, so_choice = run(async_llm, test)
    for r in (chat, cmpl, regex, choice, guided_json, structured, so_choice):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), SCHEMA)
    assert isinstance(json.loads(cmpl.json()["choices"][0]["text"]), dict)
    assert re.fullmatch(REGEX, regex.json()["choices"][0]["text"])
    assert choice.json()["choices"][0]["message"]["content"] in CHOICES
    jsonschema.validate(json.loads(guided_json.json()["choices"][0]["text"]), SCHEMA)
    compact = structured.json()["choices"][0]["text"]
    assert compact == json.dumps(json.loads(compact))  # ", " and ": " only
    assert so_choice.json()["choices"][0]["message"]["content"] in ("a", "b")


def test_server_streams_what_it_returns_whole(async_llm):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    body = {"messages": MESSAGES, "response_format": response_format, **BASE}

    async def test(c):
        streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
        whole = await c.post("/v1/chat/completions", json=body)
        return streamed, whole

    streamed, whole = run(async_llm, test)
    chunks = sse_events(streamed.text)
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    message = whole.json()["choices"][0]
    assert text == message["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == message["finish_reason"] == "stop"


def test_server_refuses_bad_structured_output_with_400(async_llm):
    async def test(c):
        post = lambda body: c.post("/v1/completions", json={"prompt": "x", **body})  # noqa: E731
        return [
            await post({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}),
            await post({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            await post({"response_format": {"type": "yaml"}}),
            await post({"guided_regex": "a(("}),
            await post({"guided_json": "{not json"}),
            await post({"guided_choice": []}),
            await post({"structured_outputs": {"grammar": "root ::= nowhere"}}),
            await post({"structured_outputs": {}}),
            await post({"guided_regex": "a+", "guided_choice": ["a"]}),
            await post({"guided_regex": "a+", "min_tokens": 2}),
            await post({"guided_json": "[" * 5000}),
        ]

    responses = run(async_llm, test)
    params = [
        "response_format.json_schema.schema",
        "response_format.json_schema",
        "response_format",
        "guided_regex",
        "guided_json",
        "guided_choice",
        "structured_outputs.grammar",
        "structured_outputs",
        "guided_choice",
        "min_tokens",
        "guided_json",
    ]
    for response, param in zip(responses, params):
        assert_error(response, 400, param=param)
    assert "Unsupported type" in responses[0].json()["error"]["message"]
    assert "Regex parsing error" in responses[3].json()["error"]["message"]
