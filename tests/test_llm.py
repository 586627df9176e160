"""End to end on the tiny model: the public API, prefix caching, salts, limits, stats."""
from __future__ import annotations

import dataclasses
import gc
import types

import pytest
import torch

from engine import LLM, EngineConfig, RequestOutput, RequestOutputKind, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheSpec
from engine.models import tiny_model_path
from engine.models.tiny import BOS_ID
from engine.structured_output import StructuredOutputSpec
from engine_testing import one_thread  # noqa: F401  (autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = "A long shared system prompt that many requests start with. " * 2  # 121 tokens


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, num_gpu_blocks_override=128, device="cpu") as llm:
        yield llm


def test_prompt_forms_and_output_fields(llm):
    text = llm.generate("Hello", GREEDY)
    assert len(text) == 1 and isinstance(text[0], RequestOutput)
    out = text[0]
    assert out.prompt == "Hello" and out.prompt_token_ids == llm.tokenizer.encode("Hello")
    assert len(out.token_ids) == 8 and out.finish_reason == "length" and out.finished
    assert out.text == llm.tokenizer.decode(out.token_ids) and out.logprobs is None

    ids = llm.tokenizer.encode("Hello")
    assert llm.generate(ids, GREEDY)[0].token_ids == out.token_ids  # one prompt of ids
    many = llm.generate(["Hello", ids, "Bye"], GREEDY)
    assert [o.token_ids for o in many[:2]] == [out.token_ids] * 2
    assert many[1].prompt is None and many[2].prompt == "Bye"
    assert len({o.request_id for o in many}) == 3
    assert len(llm.generate([ids, ids], GREEDY)) == 2
    assert llm.generate([], GREEDY) == []


def test_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [GREEDY, SamplingParams(temperature=0.0, max_tokens=2)])
    assert [len(o.token_ids) for o in outs] == [8, 2]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [GREEDY])


def test_repeated_prompt_hits_the_prefix_cache(llm):
    first = llm.generate(LONG + "one", GREEDY)[0]
    before = llm.engine.stats()
    again = llm.generate(LONG + "one", GREEDY)[0]
    after = llm.engine.stats()
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.token_ids == first.token_ids
    assert after.prefix_cache_hits - before.prefix_cache_hits == again.num_cached_tokens
    assert after.prefix_cache_queries - before.prefix_cache_queries == n
    # Another suffix shares the full blocks of the prefix.
    other = llm.generate(LONG + "two", GREEDY)[0]
    assert other.num_cached_tokens == len(llm.tokenizer.encode(LONG)) // 16 * 16


def test_a_prompt_of_whole_blocks_is_never_fully_cached(llm):
    prompt = list(range(100, 132))  # 32 tokens = 2 full blocks
    llm.generate(prompt, GREEDY)
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 16


def test_cache_salt_separates_tenants(llm):
    prompt = LONG + "salted"
    llm.generate(prompt, GREEDY)
    a1 = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    a2 = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    b = llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    assert a1.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert a2.num_cached_tokens > 0
    assert a1.token_ids == a2.token_ids == b.token_ids
    mixed = llm.generate([prompt, prompt], GREEDY, cache_salt=["tenant-a", "tenant-c"])
    assert mixed[0].num_cached_tokens > 0 and mixed[1].num_cached_tokens == 0
    with pytest.raises(ValueError, match="must not be empty"):  # it would share the unsalted KV
        llm.generate(prompt, GREEDY, cache_salt="")


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, GREEDY)[0]
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1
    assert len(llm.chat([messages, messages], GREEDY)) == 2


def test_invalid_prompts_are_rejected_and_leave_nothing_queued(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", list(range(1, 257))], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[3, -1, 5]], GREEDY)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate([1.5], GREEDY)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate([[1, True, 2]], GREEDY)  # a bool is no token id
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_blocks == 0


def test_generation_stops_at_max_model_len():
    with LLM(max_model_len=24, num_gpu_blocks_override=8, device="cpu") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        out = llm.generate(list(range(1, 21)), params)[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(list(range(1, 25)), GREEDY)


def test_preemption_gives_the_same_outputs():
    prompts = [list(range(10 * i + 1, 10 * i + 41)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(max_model_len=128, num_gpu_blocks_override=64, device="cpu") as roomy:
        expected = [o.token_ids for o in roomy.generate(prompts, params)]
    with LLM(max_model_len=128, num_gpu_blocks_override=10, device="cpu") as tight:
        got = tight.generate(prompts, params)
        assert [o.token_ids for o in got] == expected
        stats = tight.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_used_blocks == 0


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request_id = engine.add_request("abort me", SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().num_used_blocks > 0
    out = engine.abort_request(request_id)
    assert out.finish_reason == "abort" and len(out.token_ids) == 1
    assert engine.abort_request(request_id) is None
    assert engine.stats().num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_a_final_only_request_gives_one_output_the_cumulative_one_ends_with(llm):
    engine = llm.engine
    stop = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop=["zz"])
    final = dataclasses.replace(stop, output_kind=RequestOutputKind.FINAL_ONLY)
    each = engine.add_request("Hello there", stop)
    last = engine.add_request("Hello there", final)
    seen: dict[str, list[RequestOutput]] = {each: [], last: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[each]) == 9 and len(seen[last]) == 1
    a, b = seen[each][-1], seen[last][0]
    assert b.finished and (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert b.prompt_token_ids == a.prompt_token_ids == llm.tokenizer.encode("Hello there")
    assert b.delta_text == b.text  # nothing was handed out before
    # an abort still answers with the final output
    request_id = engine.add_request("abort me", final)
    assert engine.step() == []
    assert engine.abort_request(request_id).finish_reason == "abort"
    # generate() asks for final outputs only and leaves the caller's params alone
    assert llm.generate("Hello there", stop)[0].token_ids == a.token_ids
    assert stop.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final_only")


def test_a_closed_engine_takes_no_requests():
    llm = LLM(max_model_len=64, num_gpu_blocks_override=8, device="cpu")
    engine = llm.engine
    engine.add_request("left over", GREEDY)
    llm.close()
    assert not engine.has_unfinished_requests() and engine.stats().num_used_blocks == 0
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("more", GREEDY)
    llm.close()


def test_close_drops_the_kv_cache():
    llm = LLM(max_model_len=64, num_gpu_blocks_override=8, device="cpu")
    assert llm.engine.model_runner.kv_cache is not None
    llm.close()
    assert llm.engine.model_runner.kv_cache is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_closed_llm_gives_its_kv_cache_back_to_the_next_one():
    kwargs = dict(max_model_len=64, device="cuda", gpu_memory_utilization=0.5)
    # What outlives every engine is made by a first one before the baseline: a cuBLAS
    # workspace per stream (32 MiB each on Hopper), for the default and the graph-capture one.
    with LLM(**kwargs):
        pass
    gc.collect()
    model_free = torch.cuda.memory_allocated()
    slack = 64 << 20
    blocks = []
    for _ in range(2):
        with LLM(**kwargs) as llm:
            kv_bytes = llm.engine.model_runner.kv_cache.nbytes
            blocks.append(llm.engine.num_blocks)
        weights = sum(p.nbytes for p in llm.engine.model_runner.model.parameters())
        assert torch.cuda.memory_allocated() - model_free <= weights + slack
        assert torch.cuda.memory_reserved() < kv_bytes  # given back to the device, not cached
        del llm
        gc.collect()
        assert torch.cuda.memory_allocated() - model_free <= slack
    assert blocks[0] == blocks[1] > 0


def test_stats(llm):
    before = llm.engine.stats()
    llm.generate(["x", "y"], GREEDY)
    s = llm.engine.stats()
    assert s.num_generated_tokens - before.num_generated_tokens == 16
    assert s.num_finished_requests - before.num_finished_requests == 2
    assert s.num_blocks == 128 and s.num_used_blocks == 0 and s.kv_usage == 0.0
    assert s.num_running == s.num_waiting == 0
    assert len(s.ttft_s) >= 2 and len(s.itl_s) >= 14 and min(s.itl_s) >= 0
    assert s.gpu_memory is None  # a CPU engine


def test_config_defaults_are_resolved_from_the_model(llm):
    cfg = EngineConfig().resolve(max_position_embeddings=4096)
    auto = "cuda" if torch.cuda.is_available() else "cpu"  # device="auto" prefers CUDA
    assert (cfg.max_model_len, cfg.max_num_batched_tokens, cfg.device) == (4096, 2048, auto)
    assert EngineConfig().resolve(1024).max_model_len == 1024
    no_chunk = EngineConfig(enable_chunked_prefill=False).resolve(8192)
    assert no_chunk.max_num_batched_tokens == 4096
    assert llm.engine.config.max_model_len == 256


def test_cpu_cache_is_sized_from_its_byte_budget():
    with LLM(tiny_model_path(), device="cpu", max_model_len=64, cpu_kv_cache_bytes=2**20) as llm:
        engine = llm.engine
        spec = KVCacheSpec(4, 16, 2, 16, engine.model_runner.kv_cache.dtype)
        assert engine.num_blocks == 2**20 // spec.bytes_per_block
        assert engine.model_runner.kv_cache.shape == (engine.num_blocks, 4, 2, 16, 2, 16)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=4096, cpu_kv_cache_bytes=2**16, device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 12}, "power of two"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"cpu_kv_cache_bytes": 0}, "cpu_kv_cache_bytes"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"seed": -1}, "seed"),
        ({"model": ""}, "model"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_config_checks_against_the_model():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineConfig(max_model_len=8192).resolve(4096)
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=512
        ).resolve(4096)


def test_output_text_keeps_the_leading_space_of_sentencepiece_decoders():
    tokenizers = pytest.importorskip("tokenizers")
    from engine.llm_engine import LLMEngine
    from engine.models import load_model
    from engine.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"▁w{i}": i for i in range(264)}, unk_token="▁w0")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()  # drops the space of a first word
    loaded = dataclasses.replace(load_model("tiny"), tokenizer=Tokenizer(backend))
    engine = LLMEngine(
        EngineConfig(max_model_len=64, num_gpu_blocks_override=8, device="cpu"), loaded_model=loaded
    )
    request_id = engine.add_request("w1 w2 w3", GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    final = outs[-1]
    full = backend.decode(final.prompt_token_ids + final.token_ids)
    assert final.text == full[len("w1 w2 w3") :] and final.text.startswith(" w")
    assert "".join(o.delta_text for o in outs) == final.text


STREAMED_PARAMS = [  # the tiny model writes random bytes: broken UTF-8, special tokens
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=4, max_tokens=41, stop_token_ids=[20]),
    SamplingParams(temperature=1.0, seed=2, max_tokens=37, min_tokens=12, stop_token_ids=[6, 7],
                   logprobs=2),
    SamplingParams(temperature=0.8, seed=3, max_tokens=50, skip_special_tokens=False),
    SamplingParams(temperature=1.0, seed=4, max_tokens=60, ignore_eos=True,  # the grammar ends it
                   structured_output=StructuredOutputSpec("regex", "[a-zé你]{2,9}")),
]


@pytest.mark.parametrize("self_draft", [False, True], ids=["plain", "self-draft"])
def test_generate_ends_with_the_outputs_streaming_ends_with(self_draft, monkeypatch):
    """The same requests through ``LLM.generate`` (final-only: detokenized at the finish,
    the tokens not one by one) and streamed from ``step`` (token by token) end with the same
    outputs; among the prompts one that ends inside a character, among the requests one that
    a grammar ends. The tiny model drafting for
    itself has all its drafts accepted: steps of four tokens, stops among them."""
    speculative = {"model": str(tiny_model_path()), "num_speculative_tokens": 3} if self_draft else None
    prompts = ["Hello", "Grüße 你好", "abcabcabcabcabcabc", [BOS_ID, *"x你".encode()[:-1]]]
    requests = [(p, sp) for p in prompts for sp in STREAMED_PARAMS]
    adds, add = [0], IncrementalDetokenizer.add

    def counted(self, token_id):
        adds[0] += 1
        return add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", counted)
    with LLM(max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=False,
             speculative_config=speculative, device="cpu") as llm:
        finals = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
        assert adds[0] <= 4 * len(requests)  # the prompts' last tokens, for context
        engine = llm.engine
        assert engine.stats().spec_num_accepted_tokens > 0 or not self_draft
        ids = [engine.add_request(p, dataclasses.replace(sp, output_kind=RequestOutputKind.CUMULATIVE))
               for p, sp in requests]
        streamed: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            streamed.update((o.request_id, o) for o in engine.step())
    reasons = set()
    for final, request_id in zip(finals, ids):
        last = streamed[request_id]
        assert final.delta_text == final.text
        assert dataclasses.replace(final, request_id="", delta_text="", times=None) == (
            dataclasses.replace(last, request_id="", delta_text="", times=None)
        )
        reasons.add((final.finish_reason, final.stop_reason))
    assert {("length", None), ("stop", 20), ("stop", None)} <= reasons
    assert any("\ufffd" in o.text for o in finals)


def test_nvml_memory_is_queried_at_most_once_per_ttl(monkeypatch):
    """The engine thread takes stats after every step; NVML is asked again only when the
    last answer is older than MEMORY_TTL_S."""
    from engine import stats

    class FakeNvml:
        calls = 0

        def nvmlDeviceGetMemoryInfo(self, handle):
            FakeNvml.calls += 1
            return types.SimpleNamespace(total=100, used=FakeNvml.calls)

    telemetry = stats.NvmlTelemetry(torch.device("cpu"))
    assert telemetry.memory() is None
    telemetry._nvml, telemetry._handle = FakeNvml(), object()
    clock = [1000.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: clock[0])
    assert telemetry.memory() == stats.GpuMemory(100, 1)
    clock[0] += stats.MEMORY_TTL_S / 2
    assert telemetry.memory() == stats.GpuMemory(100, 1) and FakeNvml.calls == 1
    clock[0] += stats.MEMORY_TTL_S
    assert telemetry.memory() == stats.GpuMemory(100, 2)
