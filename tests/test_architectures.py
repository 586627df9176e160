"""Every supported architecture against the transformers reference, in fp32, on checkpoints
transformers wrote: Llama (with biases and RoPE scalings), Qwen2, Qwen3, Mistral (with and
without a sliding window), Phi-3, Gemma 2 and Gemma 3."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.attention import AttentionMetadata
from engine.models import load_model
from engine.models.tiny import write_tiny_tokenizer

ATOL = 1e-4
SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=256,
    eos_token_id=257,
    attn_implementation="eager",
)
CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    ),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "linear-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(head_dim=32, sliding_window=None, num_key_value_heads=1),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, attention_bias=True, rope_theta=1000000.0),
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(sliding_window=None, pad_token_id=0),
    ),
    # windows shorter than the test sequences, across block edges (block_size 4)
    "mistral-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(head_dim=32, sliding_window=6, num_key_value_heads=1),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=6, pad_token_id=0,
            attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=32, query_pre_attn_scalar=20, sliding_window=7, pad_token_id=0,
            layer_types=["full_attention", "sliding_attention"],
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
}


def write_hf_checkpoint(path: Path, case: str, **save_kwargs) -> torch.nn.Module:
    """A random model saved by transformers, with every parameter (norms and biases too) random."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name else 0.08)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    write_tiny_tokenizer(path)
    return model


class PagedRunner:
    """Drives a CausalLM the way an engine does: blocks scattered over a shared cache."""

    def __init__(self, loaded, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        c = loaded.config
        self.model = loaded.model
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim
        )  # [B, L, 2, T, H, D]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def share_prefix(self, seq: int, source: int, num_blocks: int) -> None:
        """Start ``seq`` on ``source``'s first full blocks, as a prefix-cache hit does."""
        self.blocks[seq] = self.blocks[source][:num_blocks]
        self.lens[seq] = num_blocks * self.block_size

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append new tokens to each sequence in one flattened step; logits for every new token."""
        ids, positions, slots, seq_lens, q_lens = [], [], [], [], []
        for seq, tokens in batch:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.blocks.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            q_lens.append(len(tokens))
            self.lens[seq] = end
        width = max(len(self.blocks[s]) for s, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for b, (seq, _) in enumerate(batch):
            tables[b, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=q_lens,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                self.kv_cache,
                meta,
            )
            return self.model.compute_logits(hidden)


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=gen).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_hf_checkpoint(path, request.param)
    return reference, load_model(str(path))


def test_prefill_matches_reference(checkpoint):
    reference, loaded = checkpoint
    tokens = random_tokens(23, seed=1)
    logits = PagedRunner(loaded).step([(0, tokens)])
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=ATOL, rtol=0)


def test_batch_of_different_lengths(checkpoint):
    reference, loaded = checkpoint
    seqs = [random_tokens(n, seed=n) for n in (5, 17, 1, 9)]
    logits = PagedRunner(loaded).step(list(enumerate(seqs)))
    expected = torch.cat([reference_logits(reference, s) for s in seqs])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_steps_match_full_sequence(checkpoint):
    reference, loaded = checkpoint
    seqs = [random_tokens(14, seed=3), random_tokens(11, seed=4)]
    prompt_lens = [6, 3]
    runner = PagedRunner(loaded)
    runner.step([(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompt_lens))])
    got: list[list[torch.Tensor]] = [[], []]
    for t in range(8):
        logits = runner.step([(i, [s[n + t]]) for i, (s, n) in enumerate(zip(seqs, prompt_lens))])
        for i in range(2):
            got[i].append(logits[i])
    for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
        expected = reference_logits(reference, s[: n + 8])[n:]
        torch.testing.assert_close(torch.stack(got[i]), expected, atol=ATOL, rtol=0)


def test_chunked_prefill_attends_to_cached_chunk(checkpoint):
    reference, loaded = checkpoint
    tokens = random_tokens(21, seed=5)
    runner = PagedRunner(loaded)
    first = runner.step([(0, tokens[:10])])
    second = runner.step([(0, tokens[10:]), (1, tokens[:4])])  # mixed with another sequence
    expected = reference_logits(reference, tokens)
    torch.testing.assert_close(first, expected[:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[:11], expected[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[11:], expected[:4], atol=ATOL, rtol=0)


def test_prefix_cache_hit_continues_like_the_full_sequence(checkpoint):
    """A second sequence starts on the first one's cached blocks (past every window here)
    and computes only its own suffix, then decodes."""
    reference, loaded = checkpoint
    shared = random_tokens(16, seed=9)
    suffix = random_tokens(6, seed=10)
    runner = PagedRunner(loaded)
    runner.step([(0, shared + random_tokens(3, seed=11))])
    runner.share_prefix(1, source=0, num_blocks=4)
    got = [runner.step([(1, suffix[:5])])]
    got.append(runner.step([(1, suffix[5:])]))
    expected = reference_logits(reference, shared + suffix)[16:]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint(tmp_path):
    reference = write_hf_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    loaded = load_model(str(tmp_path))
    tokens = random_tokens(12, seed=6)
    logits = PagedRunner(loaded).step([(0, tokens)])
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=ATOL, rtol=0)


def test_classic_rope_keys(tmp_path):
    """Checkpoints written before ``rope_parameters`` keep ``rope_theta`` and ``rope_scaling``."""
    reference = write_hf_checkpoint(tmp_path, "llama3-rope")
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    config["torch_dtype"] = config.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path))
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    tokens = random_tokens(30, seed=7)
    logits = PagedRunner(loaded).step([(0, tokens)])
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=ATOL, rtol=0)


def test_bfloat16_weights_stay_close(tmp_path):
    reference = write_hf_checkpoint(tmp_path, "llama")
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    tokens = random_tokens(12, seed=8)
    logits = PagedRunner(loaded).step([(0, tokens)])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=0.1, rtol=0.05)


def test_tiny_model_greedy_generation_varies(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_KV_HOME", str(tmp_path))
    loaded = load_model("tiny")
    assert loaded.dtype == torch.float32 and not loaded.model.training
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    runner = PagedRunner(loaded)
    logits = runner.step([(0, ids)])[-1]
    out = []
    for _ in range(32):
        out.append(int(logits.argmax()))
        logits = runner.step([(0, out[-1:])])[0]
    assert len(set(out)) >= 8, out
    assert len(set(out[-8:])) >= 3, out


def test_partial_rotary_phi_is_refused_naming_the_setting():
    from engine.models import ModelConfig
    from engine.models.tiny import TINY_CONFIG

    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf(
            {**TINY_CONFIG, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}
        )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tie_word_embeddings": True},
        {"attention_bias": True, "mlp_bias": True},
        {"architectures": ["Qwen2ForCausalLM"]},
        {"architectures": ["MistralForCausalLM"], "head_dim": 32},
        {"architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
        {"architectures": ["Phi3ForCausalLM"]},
        {"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh"},
        {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh"},
    ],
)
def test_checkpoint_layout_covers_every_parameter_once(extra):
    """The loader fills parameters only through the layout, so it must tile each exactly."""
    from engine.models import CausalLM, ModelConfig
    from engine.models.tiny import TINY_CONFIG

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf({**TINY_CONFIG, **extra}))
    rows: dict[str, list[tuple[int, int]]] = {}
    params = dict(model.named_parameters())
    for slot in model.checkpoint_layout().values():
        assert params[slot.param].shape[1:] == slot.shape[1:]
        rows.setdefault(slot.param, []).append((slot.offset, slot.offset + slot.shape[0]))
    assert set(rows) == set(params)
    for name, spans in rows.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == params[name].shape[0], name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name


@pytest.mark.parametrize(
    "case, expected",
    [
        ("mistral-window", ("sliding_attention",) * 2),
        ("gemma2", ("sliding_attention", "full_attention")),
        ("gemma3", ("full_attention", "sliding_attention")),
    ],
)
def test_layer_types_are_read_as_transformers_writes_them(case, expected):
    from engine.models import ModelConfig

    config_cls, _, extra = CASES[case]
    hf = config_cls(**{**SMALL, **extra}).to_dict()
    hf["architectures"] = [_ARCHITECTURES[case]]
    config = ModelConfig.from_hf(hf)
    assert config.layer_types == expected
    windows = tuple(config.layer_window(i) for i in range(2))
    assert windows == tuple(extra["sliding_window"] if t == "sliding_attention" else None for t in expected)
    assert config.kv_window == (extra["sliding_window"] if case == "mistral-window" else None)


_ARCHITECTURES = {
    "mistral-window": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def test_default_layer_patterns_follow_the_architecture():
    """Configs without layer_types (as on the Hub): vLLM's and transformers' rules."""
    from engine.models import ModelConfig
    from engine.models.tiny import TINY_CONFIG

    base = {**TINY_CONFIG, "num_hidden_layers": 6, "hidden_activation": "gelu_pytorch_tanh"}
    gemma2 = ModelConfig.from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 8})
    assert [gemma2.layer_window(i) for i in range(6)] == [8, None] * 3
    gemma3 = ModelConfig.from_hf(
        {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
         "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )
    assert [gemma3.layer_window(i) for i in range(6)] == [8, 8, None] * 2
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert gemma3.local_rope_scaling is None and gemma3.query_pre_attn_scalar == 256
    qwen = ModelConfig.from_hf(
        {**TINY_CONFIG, "num_hidden_layers": 6, "architectures": ["Qwen2ForCausalLM"],
         "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}
    )
    assert [qwen.layer_window(i) for i in range(6)] == [None] * 4 + [8] * 2


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "'Gemma3ForConditionalGeneration' is not supported"),
        ({"architectures": ["MistralForCausalLM"], "layer_types": ["chunked_attention"] * 4, "sliding_window": 8},
         "layer type 'chunked_attention'"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_unsupported_models_are_refused_naming_what(extra, message):
    from engine.models import ModelConfig
    from engine.models.tiny import TINY_CONFIG

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**TINY_CONFIG, **extra})
