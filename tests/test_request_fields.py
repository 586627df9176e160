"""OpenAI/vLLM request fields over HTTP: n and best_of, prompt lists, echo, penalties, min_p,
logit_bias, generation_config.json defaults, max_tokens past the context, unknown fields."""
from __future__ import annotations

import json

import pytest

import engine.sampler
from engine import AsyncLLM
from engine.models.tiny import write_tiny_checkpoint
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import MAX_MODEL_LEN, assert_error, config, run, sse_events
from tiered_kv.server import create_app

GEN_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5}
NEUTRAL = {"generation_config": "vllm", "kv_offloading_size": 0, "kv_disk_size": 0}
SAMPLED = {"prompt": "Once upon", "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, whose generation_config.json also holds sampling defaults."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")
    gen = path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **GEN_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = AsyncLLM(model_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, device="cpu")
    yield llm
    llm.shutdown()


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["text"] for c in response.json()["choices"]]


# ---------------------------------------------------------------- n, best_of, echo


def test_n_gives_distinct_choices_reproducible_with_a_seed(llm):
    async def test(c):
        three = [await c.post("/v1/completions", json={**SAMPLED, "n": 3, "seed": 5}) for _ in range(2)]
        singles = [await c.post("/v1/completions", json={**SAMPLED, "seed": 5 + k}) for k in range(3)]
        unseeded = await c.post("/v1/completions", json={**SAMPLED, "n": 3})
        return three, singles, unseeded

    (first, again), singles, unseeded = run(llm, test, **NEUTRAL)
    choices = texts(first)
    assert len(set(choices)) == 3
    assert texts(again) == choices
    assert [texts(s)[0] for s in singles] == choices  # choice k is the request with seed + k
    assert len(set(texts(unseeded))) == 3
    assert first.json()["usage"]["completion_tokens"] == 3 * 8


def test_chat_n_streams_the_same_choices(llm):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "seed": 9, "temperature": 1.0,
            "max_tokens": 6, "ignore_eos": True}

    async def test(c):
        whole = await c.post("/v1/chat/completions", json=body)
        stream = await c.post("/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        return whole, stream

    whole, stream = run(llm, test, **NEUTRAL)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"]["content"] != choices[1]["message"]["content"]
    events = sse_events(stream.text)
    streamed = ["", ""]
    for event in events[:-1]:
        (choice,) = event["choices"]
        streamed[choice["index"]] += choice["delta"].get("content", "")
    assert streamed == [c["message"]["content"] for c in choices]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_best_of_returns_the_choice_of_highest_cumulative_logprob(llm):
    async def test(c):
        best = await c.post("/v1/completions", json={**SAMPLED, "best_of": 3, "n": 1, "seed": 21})
        candidates = [
            await c.post("/v1/completions", json={**SAMPLED, "seed": 21 + k, "logprobs": 0}) for k in range(3)
        ]
        too_few = await c.post("/v1/completions", json={**SAMPLED, "best_of": 1, "n": 2})
        streamed = await c.post("/v1/completions", json={**SAMPLED, "best_of": 2, "stream": True})
        return best, candidates, too_few, streamed

    best, candidates, too_few, streamed = run(llm, test, **NEUTRAL)
    scored = [(sum(r.json()["choices"][0]["logprobs"]["token_logprobs"]), texts(r)[0]) for r in candidates]
    assert len({text for _, text in scored}) == 3
    (choice,) = best.json()["choices"]
    assert choice["text"] == max(scored)[1] and choice["logprobs"] is None
    assert_error(too_few, 400, param="best_of")
    assert_error(streamed, 400, param="best_of")


def test_echo_puts_the_prompt_before_the_text(llm):
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    ids = [256, 72, 105]

    async def test(c):
        plain = [await c.post("/v1/completions", json={"prompt": p, **greedy}) for p in ("Once upon", ids)]
        echoed = [
            await c.post("/v1/completions", json={"prompt": p, "echo": True, **greedy}) for p in ("Once upon", ids)
        ]
        stream = await c.post("/v1/completions", json={"prompt": "Once upon", "echo": True, "stream": True, **greedy})
        return plain, echoed, stream

    plain, echoed, stream = run(llm, test, **NEUTRAL)
    prompt_texts = ["Once upon", llm.tokenizer.decode(ids)]
    assert [texts(e)[0] for e in echoed] == [p + texts(t)[0] for p, t in zip(prompt_texts, plain)]
    streamed = "".join(e["choices"][0]["text"] for e in sse_events(stream.text))
    assert streamed == "Once upon" + texts(plain[0])[0]


# ---------------------------------------------------------------- penalties, min_p, logit_bias


def reference_penalties(row: list[float], prompt: list[int], generated: list[int], name: str, value: float):
    """vLLM's definitions, one logit at a time."""
    out = []
    for token, logit in enumerate(row):
        if name == "repetition_penalty" and (token in prompt or token in generated):
            logit = logit / value if logit > 0 else logit * value
        if name == "frequency_penalty":
            logit -= value * generated.count(token)
        if name == "presence_penalty" and token in generated:
            logit -= value
        out.append(logit)
    return out


@pytest.mark.parametrize(
    "name, value", [("presence_penalty", 1.5), ("frequency_penalty", 0.7), ("repetition_penalty", 1.8)]
)
def test_each_penalty_changes_the_logits_as_vllm_defines_it(llm, monkeypatch, name, value):
    steps = []
    real = engine.sampler.apply_penalties

    def spy(logits, counts, **kwargs):
        out = real(logits, counts, **kwargs)
        steps.append((logits[0].tolist(), out[0]))
        return out

    monkeypatch.setattr(engine.sampler, "apply_penalties", spy)
    prompt = [256, 72, 105, 72, 33]
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0, name: value}
    (response,) = run(llm, lambda c: _gather(c.post("/v1/completions", json=body)), **NEUTRAL)
    assert response.status_code == 200, response.text
    assert len(steps) == 6
    generated = []
    for raw, penalized in steps:
        assert penalized.tolist() == pytest.approx(reference_penalties(raw, prompt, generated, name, value), abs=1e-5)
        generated.append(int(penalized.argmax()))  # greedy picks from the penalized logits
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in generated]


async def _gather(*awaitables):
    return [await a for a in awaitables]


def test_min_p_of_one_is_greedy_and_logit_bias_steers(llm):
    greedy = {"prompt": "Once upon", "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    forced = llm.tokenizer.encode("A", add_special_tokens=False)[0]

    async def test(c):
        return [
            await c.post("/v1/completions", json=greedy),
            await c.post("/v1/completions", json={**greedy, "temperature": 1.5, "min_p": 1.0, "seed": 3}),
            await c.post("/v1/completions", json={**greedy, "temperature": 1.5, "seed": 3}),
            await c.post("/v1/completions", json={**greedy, "logit_bias": {str(forced): 100}}),
            await c.post("/v1/completions", json={**greedy, "logit_bias": {"99999": 5}}),
            await c.post("/v1/completions", json={**greedy, "logit_bias": {"a": 5}}),
            await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "logit_bias": {str(forced): 100}, "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True}),
        ]

    plain, min_p, sampled, biased, outside, not_an_id, chat = run(llm, test, **NEUTRAL)
    assert texts(min_p) == texts(plain) != texts(sampled)
    assert texts(biased) == ["A" * 8]
    assert_error(outside, 400, param="logit_bias")
    assert_error(not_an_id, 400, param="logit_bias")
    assert chat.json()["choices"][0]["message"]["content"] == "AAA"


@pytest.mark.parametrize("bias", [{"5": float("nan")}, {"5": float("inf")}, {" 5 ": 1}, {"1_0": 1},
                                  {"\u0663": 1}, {"-3": 1}, {"5.0": 1}])
def test_logit_bias_takes_plain_token_ids_and_finite_values(llm, bias):
    async def test(c):  # json.dumps writes NaN and Infinity, which the server's parser accepts
        return await c.post("/v1/completions", content=json.dumps({"prompt": "x", "logit_bias": bias}),
                            headers={"content-type": "application/json"})

    assert_error(run(llm, test), 400, param="logit_bias")


# ---------------------------------------------------------------- generation_config.json


def test_generation_config_gives_the_defaults_and_a_request_overrides_them(llm, tmp_path):
    bare = {"prompt": "Once upon", "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "top_k": 1}))

    async def test(c):
        return [
            await c.post("/v1/completions", json=bare),
            await c.post("/v1/completions", json={**bare, "temperature": 1.0, "seed": 4, "max_tokens": 5}),
            await c.post("/v1/chat/completions", json=chat),
        ]

    auto = run(llm, test, kv_offloading_size=0, kv_disk_size=0)  # generation_config="auto"
    neutral = run(llm, test, **NEUTRAL)
    own = run(llm, test, generation_config=str(folder), kv_offloading_size=0, kv_disk_size=0)

    async def explicit(c):
        return [
            await c.post("/v1/completions", json={**bare, "temperature": 0, "max_tokens": 5}),
            await c.post("/v1/completions", json={**bare, "temperature": 1.0, "seed": 4, "max_tokens": 5}),
        ]

    greedy5, sampled5 = run(llm, explicit, **NEUTRAL)
    # auto: temperature 0 and max_new_tokens 5 from the model's file; a request's own values win
    assert texts(auto[0]) == texts(greedy5)
    assert texts(auto[1]) == texts(sampled5) != texts(greedy5)
    assert auto[2].json()["usage"]["completion_tokens"] == 5
    # vllm: neutral defaults (max_tokens 16 for completions, until max_model_len for chat)
    assert neutral[0].json()["usage"]["completion_tokens"] == 16
    assert neutral[2].json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - neutral[2].json()["usage"]["prompt_tokens"]
    # a folder: its file instead (max_new_tokens caps even a request's max_tokens, as in vLLM)
    assert [r.json()["usage"]["completion_tokens"] for r in own] == [3, 3, 3]
    # --override-generation-config: keys on top of the file's (auto), or of nothing (vllm)
    merged = run(llm, test, override_generation_config='{"max_new_tokens": 2}', kv_offloading_size=0, kv_disk_size=0)
    assert texts(merged[0]) == [texts(greedy5)[0][: len(texts(merged[0])[0])]]  # still greedy, from the file
    assert [r.json()["usage"]["completion_tokens"] for r in merged] == [2, 2, 2]
    alone = run(llm, test, override_generation_config='{"max_new_tokens": 4}', **NEUTRAL)
    assert [r.json()["usage"]["completion_tokens"] for r in alone] == [4, 4, 4]


@pytest.mark.parametrize("text", ["[1]", "{nope", '{"temperature": -1}', '{"max_new_tokens": "x"}'])
def test_a_bad_generation_config_override_is_refused_naming_the_flag(text):
    from tiered_kv.serve_config import ServeConfig

    with pytest.raises(ValueError, match="--override-generation-config"):
        ServeConfig(override_generation_config=text)


def test_a_generation_config_folder_without_the_file_is_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="--generation-config"):
        create_app(config(generation_config=str(tmp_path), kv_offloading_size=0, kv_disk_size=0), llm)


# ---------------------------------------------------------------- refused


def test_max_tokens_past_the_context_and_unknown_fields_are_400(llm):
    long_prompt = [72] * (MAX_MODEL_LEN - 10)

    async def test(c):
        post = c.post
        messages = [{"role": "user", "content": "Hi"}]
        return [
            await post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 11}),
            await post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 10}),
            await post("/v1/completions", json={"prompt": long_prompt}),  # the default 16 is too many
            await post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": MAX_MODEL_LEN}),
            await post("/v1/completions", json={"prompt": "x", "frobnicate": 1}),
            await post("/v1/chat/completions", json={"messages": messages, "tool_choice": "auto"}),
            await post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "extra": 1}]}),
        ]

    over, fits, default, chat, unknown, tool_choice, message_field = run(llm, test, **NEUTRAL)
    assert_error(over, 400, param="max_tokens", code="context_length_exceeded")
    assert "maximum context length is 256 tokens" in over.json()["error"]["message"]
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] >= 1
    assert_error(default, 400, param="max_tokens", code="context_length_exceeded")
    assert_error(chat, 400, param="max_completion_tokens", code="context_length_exceeded")
    assert_error(unknown, 400, param="frobnicate")
    assert_error(tool_choice, 400, param="tool_choice")
    assert_error(message_field, 400, param="messages")


def test_null_is_the_default_for_openais_nullable_fields(llm):
    """OpenAI's schema takes `"stream": null`, `"n": null`, `"echo": null` and chat's
    `"logprobs": null` (clients serialize unset options so); a field the route does not
    read is still refused, null or not."""
    messages = [{"role": "user", "content": "Hi"}]
    nulls = {"n": None, "stream": None, "stream_options": None}

    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", json={**SAMPLED, **nulls, "echo": None, "logprobs": None}),
            await post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **nulls, "logprobs": None}),
            await post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "echo": None}),
        ]

    completion, chat, unknown = run(llm, test, **NEUTRAL)
    assert len(texts(completion)) == 1 and completion.json()["choices"][0]["logprobs"] is None
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    assert_error(unknown, 400, param="echo")



@pytest.mark.parametrize("stream", [False, True])
def test_only_a_streamed_request_asks_the_engine_for_every_output(stream):
    from engine.outputs import RequestOutputKind
    from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest

    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    completion = CompletionRequest(model="m", prompt="Hi", stream=stream)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], stream=stream)
    assert completion.to_sampling_params().output_kind is kind
    assert chat.to_sampling_params().output_kind is kind


def test_vllms_ranges_of_seed_and_temperature(llm):
    """vLLM takes any int64 seed and a temperature above 2; n choices from a seed near the
    bound wrap within int64."""

    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", json={**SAMPLED, "seed": -1}),
            await post("/v1/completions", json={**SAMPLED, "seed": -1}),
            await post("/v1/completions", json={**SAMPLED, "seed": 2**63 - 1, "n": 2}),
            await post("/v1/completions", json={**SAMPLED, "seed": -(2**63)}),
            await post("/v1/completions", json={**SAMPLED, "temperature": 2.5}),
            await post("/v1/completions", json={**SAMPLED, "seed": 2**63}),
        ]

    negative, again, wrapped, lowest, hot, beyond = run(llm, test, **NEUTRAL)
    assert texts(negative) == texts(again)
    assert len(texts(wrapped)) == 2 and texts(wrapped)[1] == texts(lowest)[0]  # 2**63 - 1 + 1 wraps
    assert hot.status_code == 200
    assert_error(beyond, 400, param="seed")


def test_an_assistant_message_sent_back_as_received_is_read(llm):
    """The `openai` client's `message.model_dump()` (and vLLM's responses) carry output-only
    fields, null or empty; they are dropped. One with content is refused, naming it."""
    returned = {
        "role": "assistant", "content": "Hello.", "refusal": None, "annotations": None, "audio": None,
        "function_call": None, "tool_calls": [], "reasoning_content": None,
    }

    async def test(c):
        history = [{"role": "user", "content": "Hi"}, returned, {"role": "user", "content": "Again"}]
        called = {**returned, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}
        plain = [m if m is not returned else {"role": "assistant", "content": "Hello."} for m in history]
        return [
            await c.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4, "temperature": 0}),
            await c.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 4, "temperature": 0}),
            await c.post("/v1/chat/completions", json={"messages": [called], "max_tokens": 4}),
        ]

    sent_back, plain, called = run(llm, test, **NEUTRAL)
    assert sent_back.status_code == 200, sent_back.text
    assert sent_back.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert_error(called, 400, param="messages")
    assert "tool_calls" in called.json()["error"]["message"]


def test_echo_with_max_tokens_0_returns_the_prompt_and_generates_nothing(llm):
    """vLLM's echo without generation, what scoring harnesses send: each choice is its prompt."""

    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", json={"prompt": ["Once upon", "a time"], "max_tokens": 0, "echo": True, "n": 2}),
            await post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 0}),
            await post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 0, "echo": True, "stream": True}),
            await post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 0, "echo": True, "top_p": 0}),
            await post("/v1/completions", json={"prompt": [-5], "max_tokens": 0, "echo": True}),
            await post("/v1/completions", json={"prompt": [10**6], "max_tokens": 0, "echo": True}),
            await post("/v1/completions", json={"prompt": "x", "max_tokens": 0, "echo": True, "n": 10**6}),
        ]

    echoed, no_echo, streamed, bad, negative_id, unknown_id, too_many = run(llm, test, **NEUTRAL)
    assert_error(negative_id, 400, param="prompt")
    assert_error(unknown_id, 400, param="prompt")
    assert_error(too_many, 400, param="n")  # each choice is built: bounded as generations are
    assert texts(echoed) == ["Once upon", "Once upon", "a time", "a time"]
    assert {c["finish_reason"] for c in echoed.json()["choices"]} == {"length"}
    usage = echoed.json()["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == usage["total_tokens"] > 0
    assert_error(no_echo, 400, param="max_tokens")
    assert_error(streamed, 400, param="stream")
    assert_error(bad, 400, param="top_p")


def test_include_stop_str_in_output_and_skip_special_tokens(llm):
    """vLLM's fields: the stop string kept at the end of the text; special tokens (the tiny
    model's eos) shown in the text when skip_special_tokens is false."""
    greedy = {"prompt": "Once upon", "temperature": 0, "max_tokens": 24, "ignore_eos": True}

    async def test(c):
        full = await c.post("/v1/completions", json=greedy)
        stop = full.json()["choices"][0]["text"][6:9]
        cut = await c.post("/v1/completions", json={**greedy, "stop": [stop]})
        kept = await c.post("/v1/completions", json={**greedy, "stop": [stop], "include_stop_str_in_output": True})
        forced = {**greedy, "max_tokens": 2, "logit_bias": {str(EOS): 100}}  # eos twice, ignored
        hidden = await c.post("/v1/completions", json=forced)
        shown = await c.post("/v1/completions", json={**forced, "skip_special_tokens": False})
        return stop, full, cut, kept, hidden, shown

    EOS = llm.tokenizer.eos_token_ids[0]
    stop, full, cut, kept, hidden, shown = run(llm, test, **NEUTRAL)
    text = texts(full)[0]
    start = text.index(stop)
    assert texts(cut) == [text[:start]] and texts(kept) == [text[: start + len(stop)]]
    eos_text = llm.tokenizer.decode([EOS], skip_special_tokens=False)
    assert eos_text and texts(hidden) == [""] and texts(shown) == [eos_text * 2]


def test_chat_template_variables_and_the_generation_prompt(llm):
    """vLLM's chat fields: add_generation_prompt and chat_template_kwargs reach the template
    (as Qwen3's enable_thinking does); they may not set the messages."""
    template = (
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}(no think){% endif %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}]

    async def test(c):
        async def tokens(**extra):
            response = await c.post("/tokenize", json={"messages": messages, **extra})
            return response.json()["tokens"]

        chat = await c.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": False, "tool_choice": "none",
        })
        bad = await c.post("/v1/chat/completions", json={
            "messages": messages, "chat_template_kwargs": {"messages": []},
        })
        return (await tokens(), await tokens(add_generation_prompt=False),
                await tokens(chat_template_kwargs={"enable_thinking": False}), chat, bad)

    plain, no_prompt, no_think, chat, bad = run(llm, test, chat_template=template, **NEUTRAL)
    encode = llm.tokenizer.encode
    assert plain == encode("[Hi]>", add_special_tokens=False)
    assert no_prompt == encode("[Hi]", add_special_tokens=False)
    assert no_think == encode("[Hi](no think)>", add_special_tokens=False)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(encode("[Hi](no think)", add_special_tokens=False))
    assert_error(bad, 400, param="messages")


def test_truncate_prompt_tokens_and_add_special_tokens(llm):
    """vLLM's fields: a prompt cut to its last k tokens generates what those tokens alone
    do; the tokenizer's special tokens (the tiny model's bos) added or not, per route."""
    prompt = "Once upon a time there"
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    ids = llm.tokenizer.encode(prompt)

    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 5, **greedy}),
            await post("/v1/completions", json={"prompt": ids[-5:], **greedy}),
            await post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 5, "max_tokens": 0, "echo": True}),
            await post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": -1, **greedy}),
            await post("/v1/completions", json={"prompt": prompt, "add_special_tokens": False, **greedy}),
            await post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 7}),
            await post("/v1/chat/completions", json=chat),
            await post("/v1/chat/completions", json={**chat, "add_special_tokens": True, "parallel_tool_calls": False}),
            await post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 0}),
            await post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}),
        ]

    cut, alone, echoed, whole, plain, chat_cut, chat_plain, chat_special, zero, too_long = run(llm, test, **NEUTRAL)
    assert texts(cut) == texts(alone) and cut.json()["usage"]["prompt_tokens"] == 5
    assert texts(echoed) == [llm.tokenizer.decode(ids[-5:])] == ["there"]
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)  # -1: max_model_len, more than it has
    assert plain.json()["usage"]["prompt_tokens"] == len(ids) - 1  # no bos
    assert chat_cut.json()["usage"]["prompt_tokens"] == 7
    assert chat_special.json()["usage"]["prompt_tokens"] == chat_plain.json()["usage"]["prompt_tokens"] + 1
    assert_error(zero, 400, param="truncate_prompt_tokens")
    assert_error(too_long, 400, param="truncate_prompt_tokens")


def test_continue_final_message_goes_on_from_the_assistants_text(llm):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message, as
    the same text sent as a completion prompt; it needs add_generation_prompt false."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    opened = llm.tokenizer.apply_chat_template(messages, False, continue_final_message=True)

    async def test(c):
        post = c.post
        chat = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        return [
            await post("/v1/chat/completions", json={**chat, **greedy}),
            await post("/v1/completions", json={"prompt": opened, "add_special_tokens": False, **greedy}),
            await post("/tokenize", json=chat),
            await post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True}),
            await post("/tokenize", json={"messages": messages, "continue_final_message": True}),
        ]

    chat, completion, tokens, both, both_tokens = run(llm, test, **NEUTRAL)
    assert opened.endswith("<|assistant|>\nOnce upon")
    assert chat.json()["choices"][0]["message"]["content"] == texts(completion)[0]
    assert tokens.json()["tokens"] == llm.tokenizer.encode(opened, add_special_tokens=False)
    assert_error(both, 400, param="continue_final_message")
    assert_error(both_tokens, 400, param="continue_final_message")


def test_max_logprobs_bounds_what_a_request_may_ask(llm):
    async def test(c):
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
        return [
            await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 3}),
            await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 4}),
            await c.post("/v1/chat/completions", json={**chat, "top_logprobs": 4}),
        ]

    three, four, chat_four = run(llm, test, max_logprobs=3, **NEUTRAL)
    assert three.status_code == 200 and all(len(t) <= 4 for t in three.json()["choices"][0]["logprobs"]["top_logprobs"])
    assert_error(four, 400, param="logprobs")
    assert_error(chat_four, 400, param="top_logprobs")
    (thirty,) = run(llm, lambda c: _gather(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 30})),
                    max_logprobs=-1, **NEUTRAL)
    assert thirty.status_code == 200  # past the default 20: -1 allows the whole vocabulary
