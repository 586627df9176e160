"""Speculative decoding (engine/spec_decode): the config, the proposers, verification, and
the engine end to end on the tiny model: greedy output identical with and without
speculation, rejection sampling that keeps the target's distribution, rolled-back drafts
that never reach the prefix cache or the connector, and the counters."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.tiny import TINY_CONFIG, tiny_model_path, tiny_weights, write_tiny_checkpoint
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram
from engine.sampler import Sampler, SamplingRow
from engine.spec_decode.rejection import VerifyRow, verify, verify_rows
from engine_testing import MemoryConnector, one_thread  # noqa: F401  (autouse fixture)
from tiered_kv.engine_metrics import EngineCollector
from tiered_kv.serve_config import ServeConfig
from tiered_kv.vllm_compat import REFUSED_FLAGS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
REPEAT = "def add(a, b):\n    return a + b\n" * 5
PROMPTS = [REPEAT, list(range(5, 45)), "hello world, hello world, hello " * 3]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A 2-layer draft with the tiny model's tokenizer and unrelated random weights."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("draft"))
    config = dict(TINY_CONFIG, num_hidden_layers=2)
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(7)
    weights = {}
    for name, w in tiny_weights().items():
        if ".layers." in name and int(name.split(".")[2]) >= 2:
            continue
        signs = torch.randint(0, 2, w.shape, generator=gen) * 2 - 1
        weights[name] = w if name.endswith("norm.weight") else w * signs
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def make_llm(speculative_config=None, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(max_model_len=256, device="cpu", speculative_config=speculative_config, **kw)


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with make_llm() as llm:
        return generate(llm)


# ---------------------------------------------------------------- config


def test_config_parses_vllms_json():
    ngram = SpeculativeConfig.from_json(json.dumps(NGRAM))
    assert (ngram.resolved_method, ngram.num_speculative_tokens) == ("ngram", 4)
    assert (ngram.lookup_min, ngram.lookup_max) == (2, 4)
    one_bound = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one_bound.lookup_min, one_bound.lookup_max) == (3, 3)
    draft = SpeculativeConfig.from_dict({"model": "/models/draft", "num_speculative_tokens": 3})
    assert draft.resolved_method == "draft_model"
    assert EngineConfig(speculative_config=NGRAM).speculative_config == ngram


@pytest.mark.parametrize(
    "data, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_len": 3}, "unknown speculative_config keys"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "'eagle' is not supported"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown speculative method"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
         "must not exceed"),
        ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "for the ngram method"),
    ],
)
def test_config_refuses_what_it_does_not_know(data, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=data)


def test_config_refuses_bad_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")


def test_serve_flag_reaches_the_engine_config():
    config = ServeConfig(speculative_config=json.dumps(NGRAM))
    assert config.engine_config().speculative_config == SpeculativeConfig.from_dict(NGRAM)
    assert "--speculative-config" not in REFUSED_FLAGS
    with pytest.raises(ValueError, match="^--speculative-config: unknown speculative method"):
        ServeConfig(speculative_config='{"method": "medusa2", "num_speculative_tokens": 2}')


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path)
    (path / "config.json").write_text(json.dumps(dict(TINY_CONFIG, vocab_size=300)))
    weights = tiny_weights()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.cat([weights[name], torch.zeros(300 - weights[name].shape[0], 64)])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm({"model": str(path), "num_speculative_tokens": 2})


# ---------------------------------------------------------------- proposers and verification


def test_ngram_proposes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 1, 2, 3]
    assert propose_ngram(tokens, 2, 3, 2) == [9, 8]  # "1 2 3" beats the later "2 3"
    assert propose_ngram(tokens, 2, 2, 3) == [7, 6, 1]  # only "2 3": its latest occurrence
    assert propose_ngram(tokens, 4, 4, 3) == []
    assert propose_ngram([4, 5, 4, 5], 1, 2, 8) == [4, 5]  # capped by what follows


def test_greedy_verification_accepts_while_the_argmax_matches():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 1, 8]):
        logits[row, best] = 1.0
    params, gen = SamplingParams(temperature=0.0), torch.Generator()
    assert verify(logits, [3, 5, 1], params, gen) == [3, 5, 1, 8]
    assert verify(logits, [3, 4, 1], params, gen) == [3, 5]
    assert verify(logits, [0, 5, 1], params, gen) == [3]


def _total_variation(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "one-hot-q"])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    vocab, num = 6, 8000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=gen) * 1.5  # target rows p0, p1, p2
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    params = SamplingParams(temperature=1.0)
    firsts, seconds = [], []
    guesses = torch.multinomial(q, num, replacement=True, generator=gen).T.tolist()  # [num, 2]
    for n in range(num):
        drafts = guesses[n] if with_q else [2, 4]  # without q: a fixed guess, as ngram's
        tokens = verify(logits.clone(), drafts, params, gen, q.clone() if with_q else None)
        assert 1 <= len(tokens) <= 3 and tokens[:-1] == drafts[: len(tokens) - 1]
        firsts.append(tokens[0])
        if len(tokens) >= 2:  # the first draft was accepted: the second follows p1
            seconds.append(tokens[1])
    assert _total_variation(firsts, p[0]) < 0.03
    assert len(seconds) > 1000 and _total_variation(seconds, p[1]) < 0.06
    # without correction (emitting the drafts as they are) the first token would follow q
    if with_q:
        assert 0.5 * (q[0] - p[0]).abs().sum() > 0.1


def test_batched_verification_is_row_by_row_verification():
    gen = torch.Generator().manual_seed(2)
    rows, chunks, first = [], [], 0
    for r in range(9):  # greedy and sampled rows, draft q and one-hot q, 0..3 drafts
        k = r % 4
        chunks.append(torch.randn(k + 1, 12, generator=gen) * 2)
        q = torch.softmax(torch.randn(k, 12, generator=gen), dim=-1) if r % 3 == 0 else None
        drafts = torch.randint(0, 12, (k,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0 if r % 2 else 1.0, top_k=None if r % 4 else 8)
        rows.append(VerifyRow(first, drafts, params, torch.Generator().manual_seed(r), q))
        first += k + 1
    logits = torch.cat(chunks)  # [sum(k + 1), vocab]
    batched = verify_rows(logits, rows)
    alone = [
        verify(logits[row.first_logit : row.first_logit + len(row.draft_ids) + 1], row.draft_ids,
               row.params, torch.Generator().manual_seed(r), row.draft_probs)
        for r, row in enumerate(rows)
    ]
    assert batched == alone
    assert any(len(tokens) > 1 for tokens in batched)


def test_a_row_without_drafts_is_sampled_as_the_sampler_samples_it():
    """Plain rows of a speculative step are picked by verification; a seeded request gets
    the token the sampler would have given it."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    settings = [(0.0, 1.0, None, 0.0), (1.0, 1.0, None, 0.0), (0.7, 0.8, None, 0.0),
                (1.3, 1.0, 5, 0.0), (1.0, 0.9, 10, 0.1), (0.5, 1.0, 1, 0.0)]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in settings]

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    sampled = Sampler()(logits.clone(), [SamplingRow(p, gen(i)) for i, p in enumerate(params)])
    verified = verify_rows(logits, [VerifyRow(i, [], p, gen(i)) for i, p in enumerate(params)])
    assert verified == [[s.token_id] for s in sampled]
    assert len({tokens[0] for tokens in verified}) > 1


# ---------------------------------------------------------------- the engine


_HOST_SYNCS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _syncs_per_step(engine, monkeypatch) -> list[tuple[int, int]]:
    """(host syncs, verified sequences) of each step until the engine is done."""
    calls = []

    def counted(method):
        def call(self, *args, **kwargs):
            calls.append(method.__name__)
            return method(self, *args, **kwargs)
        return call

    for name in _HOST_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    steps = []
    while engine.has_unfinished_requests():
        calls.clear()
        before = engine.stats().spec_num_drafts
        engine.step()
        steps.append((len(calls), engine.stats().spec_num_drafts - before))
    monkeypatch.undo()
    return steps


@pytest.mark.parametrize("config", [None, "ngram", "draft"], ids=["plain", "ngram", "draft"])
def test_a_step_has_one_host_sync(config, monkeypatch):
    """A step brings its tokens back in one host sync: the sampler's ``tolist`` without
    drafts (what the non-speculative path does, measured here), verification's with them,
    for greedy rows, seeded sampled rows and the plain rows of the same step together. A
    draft model's drafts stay on the device from one draft position to the next and on to
    verification."""
    if config == "ngram":  # a one-token lookup in a prompt of every byte: drafts most steps
        config = {"method": "ngram", "num_speculative_tokens": 3,
                  "prompt_lookup_max": 1, "prompt_lookup_min": 1}
    elif config == "draft":
        config = {"model": str(tiny_model_path()), "num_speculative_tokens": 3}
    every_byte = list(range(256))
    requests = [  # ending at different lengths: rows get fewer drafts than others near the end
        (every_byte, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        (every_byte[::-1], SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)),
        ([7, 9], SamplingParams(temperature=0.8, seed=6, max_tokens=11, ignore_eos=True)),
    ]
    with LLM(max_model_len=512, device="cpu", num_gpu_blocks_override=64,
             speculative_config=config) as llm:
        for prompt, params in requests:
            llm.engine.add_request(prompt, params)
        steps = _syncs_per_step(llm.engine, monkeypatch)
    assert [syncs for syncs, _ in steps] == [1] * len(steps)
    if config is not None:
        assert max(verified for _, verified in steps) >= 2


def speculative_config(method: str, random_draft: str) -> dict:
    return {
        "ngram": NGRAM,
        "self-draft": {"model": str(tiny_model_path()), "num_speculative_tokens": 3},
        "random-draft": {"model": random_draft, "num_speculative_tokens": 3},
    }[method]


@pytest.mark.parametrize("method", ["ngram", "self-draft", "random-draft"])
def test_greedy_output_is_identical_with_speculation(method, reference, random_draft):
    config = speculative_config(method, random_draft)
    with make_llm(config) as llm:
        assert generate(llm) == reference
        stats = llm.engine.stats()
        again = llm.generate(PROMPTS, GREEDY)  # every prompt hits the prefix cache now
        assert [o.token_ids for o in again] == reference
        assert all(o.num_cached_tokens > 0 for o in again)
    assert stats.spec_num_drafts > 0
    rate = stats.spec_acceptance_rate
    if method == "self-draft":
        assert rate == 1.0
    if method == "random-draft":
        assert rate < 0.5


@pytest.mark.parametrize("config", [NGRAM, "self-draft"], ids=["ngram", "draft"])
def test_greedy_output_is_identical_across_preemptions(config):
    if config == "self-draft":
        config = {"model": str(tiny_model_path()), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with make_llm(num_gpu_blocks_override=16) as llm:
        expected = generate(llm, params=params)
        assert llm.engine.stats().num_preemptions > 0
    with make_llm(config, num_gpu_blocks_override=16) as llm:
        assert generate(llm, params=params) == expected
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_steps_without_drafts_stay_on_the_decode_graphs(reference):
    with make_llm(NGRAM) as llm:
        graphs = llm.engine.model_runner.enable_decode_graphs(capture=False)
        assert generate(llm) == reference
        stats = llm.engine.stats()
    assert graphs.num_replays > 0 and stats.spec_num_drafts > 0


def test_nothing_past_a_stop_is_emitted(reference):
    full = reference[0]
    stop = full[10]
    cut = full[: full.index(stop) + 1]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    with make_llm({"model": str(tiny_model_path()), "num_speculative_tokens": 4}) as llm:
        assert generate(llm, [REPEAT], params) == [cut]
        assert generate(llm, [REPEAT], short) == [full[:7]]
        out = llm.generate([REPEAT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                     stop=[llm.tokenizer.decode(full[12:14])]))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= 14


def test_requests_that_do_not_compose_decode_one_token_at_a_time(reference):
    logprobs = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    penalty = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    with make_llm() as llm:
        expected = generate(llm, params=penalty)
    with make_llm(NGRAM) as llm:
        outs = llm.generate(PROMPTS, logprobs)
        assert generate(llm, params=penalty) == expected
        assert llm.engine.stats().spec_num_drafts == 0
    assert [o.token_ids for o in outs] == reference
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)


# low enough a temperature for the tiny model to repeat itself (ngram drafts), still sampled
SEEDED = SamplingParams(temperature=0.1, top_p=0.9, max_tokens=40, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_reference() -> list[list[int]]:
    with make_llm() as llm:
        return generate(llm, params=SEEDED)


@pytest.mark.parametrize("method", ["ngram", "self-draft", "random-draft"])
def test_seeded_output_is_identical_with_speculation(method, seeded_reference, reference, random_draft):
    """A seeded request draws each output token with the noise of its own position, and
    verification accepts a draft while it is that token: speculation changes how many
    tokens a step emits, never which (in float32, as greedy)."""
    config = speculative_config(method, random_draft)
    with make_llm(config) as llm:
        assert generate(llm, params=SEEDED) == seeded_reference
        stats = llm.engine.stats()
        # alone in the batch, and with the prefix cache moving where its chunks fall
        assert generate(llm, PROMPTS[1:2], params=SEEDED) == seeded_reference[1:2]
    assert seeded_reference != reference  # sampled, not greedy
    assert stats.spec_num_drafts > 0
    if method == "self-draft":  # the same model and the same noise: the target's own tokens
        assert stats.spec_acceptance_rate > 0.9
    if method == "ngram":
        assert stats.spec_num_accepted_tokens > 0


def test_seeded_output_is_identical_across_preemptions():
    params = SamplingParams(temperature=0.1, max_tokens=48, seed=11, ignore_eos=True)
    with make_llm(num_gpu_blocks_override=16) as llm:
        expected = generate(llm, params=params)
        assert llm.engine.stats().num_preemptions > 0
    with make_llm(NGRAM, num_gpu_blocks_override=16) as llm:
        assert generate(llm, params=params) == expected
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0


def test_seeded_verification_draws_the_samplers_token_at_each_position():
    """Whatever the drafts, a seeded row emits at position ``n + j`` the token the sampler
    draws for output ``n + j``: drafts equal to those tokens all pass, the first other one
    is replaced by it."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=1.0, seed=9)

    def sampled(position: int) -> int:
        row = SamplingRow(params, torch.Generator(), position=position)
        return Sampler()(logits[position - 7 : position - 6].clone(), [row])[0].token_id

    tokens = [sampled(7 + j) for j in range(5)]
    assert len(set(tokens)) > 1 or len(set(sampled(7) for _ in range(3))) == 1
    gen = torch.Generator().manual_seed(123)  # its state does not matter: each draw reseeds it
    row = VerifyRow(0, tokens[:4], params, gen, None, 7)
    assert verify_rows(logits, [row]) == [tokens]
    wrong = (tokens[2] + 1) % 40
    row = VerifyRow(0, [*tokens[:2], wrong, tokens[3]], params, gen, None, 7)
    assert verify_rows(logits, [row]) == [tokens[:3]]
    # and a batch sampled again row by row draws the same seeded token
    assert Sampler()(logits[:1].clone(), [SamplingRow(params, gen, position=7)])[0].token_id == tokens[0]


# ---------------------------------------------------------------- KV: pools, cache, connector


def test_draft_kv_never_reaches_the_connector_and_rejected_blocks_are_never_cached(random_draft):
    plain, speculative = MemoryConnector(), MemoryConnector()
    with make_llm(kv_connector=plain) as llm:
        expected = generate(llm)
        plain.close()
    config = {"model": random_draft, "num_speculative_tokens": 4}
    with make_llm(config, kv_connector=speculative) as llm:
        assert generate(llm) == expected
        engine = llm.engine
        draft_cache = engine.speculator.proposer.kv_cache
        assert speculative.kv_cache is engine.model_runner.kv_cache
        assert draft_cache.shape[1] == 2 and engine.model_runner.kv_cache.shape[1] == 4
        assert draft_cache.data_ptr() != speculative.kv_cache.data_ptr()
        assert engine.stats().spec_num_draft_tokens > engine.stats().spec_num_accepted_tokens
        # every block in the prefix cache holds tokens of a finished sequence
        outputs = [list(p if isinstance(p, list) else llm.tokenizer.encode(p)) + o
                   for p, o in zip(PROMPTS, expected)]
        for block in engine.block_manager.blocks:
            if block.block_hash is not None:
                assert any(_holds(seq, block.token_ids) for seq in outputs)
        speculative.close()
    # the same blocks were offered, with the same KV: none carries a rejected draft
    assert set(speculative.store) == set(plain.store)
    for key, (block, kv) in speculative.store.items():
        assert block.token_ids == plain.store[key][0].token_ids
        torch.testing.assert_close(kv, plain.store[key][1], atol=1e-4, rtol=1e-4)


def _holds(tokens: list[int], block: tuple[int, ...]) -> bool:
    n = len(block)
    return any(tuple(tokens[i : i + n]) == block for i in range(0, len(tokens) - n + 1, n))


# ---------------------------------------------------------------- counters and metrics


def test_accepted_drafts_share_their_steps_inter_token_latency():
    with make_llm({"model": str(tiny_model_path()), "num_speculative_tokens": 3}) as llm:
        (out,) = llm.generate(PROMPTS[:1], GREEDY)
        stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    itl = stats.itl_s
    assert len(itl) == len(out.token_ids) - 1 and min(itl) > 0  # none is a 0.0 sample
    assert sum(itl) == pytest.approx(out.times.last_token - out.times.first_token, rel=1e-6)


def test_counters_and_their_metrics():
    with make_llm({"model": str(tiny_model_path()), "num_speculative_tokens": 3}) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    # a draft step emits its accepted tokens plus one; the first token of each comes from prefill
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # self-draft
    assert generated == len(PROMPTS) + stats.spec_num_drafts + stats.spec_num_accepted_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts

    families = {f.name: f for f in EngineCollector(lambda: stats, lambda: 0, None).collect()}
    values = {name: f.samples[0].value for name, f in families.items() if name.startswith("vllm:spec")
              and name != "vllm:spec_decode_num_accepted_tokens_per_pos"}
    assert values == {
        "vllm:spec_decode_num_drafts": stats.spec_num_drafts,
        "vllm:spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
        "vllm:spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
    }
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert {s.labels["position"]: s.value for s in per_pos.samples if s.name.endswith("_total")} == {
        str(i): v for i, v in enumerate(stats.spec_accepted_per_pos)
    }
