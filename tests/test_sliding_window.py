"""Sliding-window models through the whole engine, against transformers.

A pure-window model (Mistral with a short window) gives back the blocks behind its window,
so a long generation holds a bounded number of them; a hybrid model (Gemma 2: window and
global layers) keeps them all. Greedy tokens match transformers either way, and a prefix
restored from the GPU prefix cache or from a tier gives the same tokens as recompute.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.tiny import write_tiny_tokenizer
from engine_testing import MemoryConnector, one_thread  # noqa: F401  (autouse fixture)

transformers = pytest.importorskip("transformers")

WINDOW, BLOCK = 8, 4
SIZES = dict(
    vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=256, eos_token_id=257, initializer_range=0.1, attn_implementation="eager",
)
MODELS = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(head_dim=16, query_pre_attn_scalar=16, pad_token_id=0),
    ),
}


def write_checkpoint(path, name: str) -> torch.nn.Module:
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, sliding_window=WINDOW, **extra)).eval()
    if name == "gemma2":  # zero-initialized (1 + w) norms: give them some spread
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_checkpoint(path, request.param)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def reference_tokens(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def make_llm(path, connector=None, **kw) -> LLM:
    return LLM(
        path, device="cpu", block_size=BLOCK, max_model_len=256, num_gpu_blocks_override=64,
        kv_connector=connector, **kw,
    )


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_long_generation_matches_transformers_and_holds_bounded_blocks(checkpoint):
    name, path, model = checkpoint
    prompt, n = prompt_of(6, seed=1), 90
    with make_llm(path) as llm:
        engine = llm.engine
        engine.add_request(prompt, greedy(n))
        held = []
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            held.append(engine.block_manager.num_used_blocks)
    assert outputs[-1].token_ids == reference_tokens(model, prompt, n)
    if name == "mistral":  # every layer windowed: the blocks behind the window go back
        assert engine.block_manager.kv_window == WINDOW
        assert max(held) == (WINDOW - 1) // BLOCK + 2, held
    else:  # global layers read everything: all blocks stay
        assert engine.block_manager.kv_window is None
        assert max(held) == -(-(len(prompt) + n - 1) // BLOCK), held


def test_a_restored_prefix_gives_the_tokens_of_recompute(checkpoint):
    """The second run hits blocks the first one gave back (from the GPU prefix cache), a
    fresh engine loads them from a tier; both continue exactly as recompute does."""
    _, path, _ = checkpoint
    prompt, n = prompt_of(41, seed=2), 30
    with make_llm(path, enable_prefix_caching=False) as llm:
        recomputed = llm.generate(prompt, greedy(n))[0].token_ids
    store: dict = {}
    with make_llm(path, MemoryConnector(store)) as llm:
        first = llm.generate(prompt, greedy(n))[0]
        again = llm.generate(prompt, greedy(n))[0]
    assert first.token_ids == again.token_ids == recomputed
    assert again.num_cached_tokens == 40
    with make_llm(path, MemoryConnector(store)) as llm:
        loaded = llm.generate(prompt, greedy(n))[0]
        assert llm.engine.stats().connector_hits == 40
    assert loaded.token_ids == recomputed


def test_decode_from_the_graph_buffers_matches_transformers(checkpoint):
    """The blocks given back behind the window change a decoding sequence's block table;
    the decode inputs mirrored from it follow (engine/decode_inputs.py), with decode
    forwards launched a step ahead."""
    _, path, model = checkpoint
    prompts, n = [prompt_of(6, seed=3), prompt_of(11, seed=4)], 40
    with make_llm(path, async_scheduling=True) as llm:
        llm.engine.model_runner.enable_decode_graphs(capture=False)
        outputs = llm.generate(prompts, greedy(n))
        assert llm.engine.model_runner.decode_graphs.num_replays >= n - 2
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_tokens(model, prompt, n)
