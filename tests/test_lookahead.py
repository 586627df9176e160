"""Decode forwards launched a step ahead (``async_scheduling``, engine/lookahead.py): on the
CPU the same code paths run synchronously, so what is checked here is that the engine
generates exactly what it generates without them, gives every block back, and takes the
launched forwards when the next step is what was launched."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.lookahead import Lookahead, held_by_both
from engine.scheduler import ScheduledSequence
from engine_testing import MemoryConnector, make_seq, one_thread  # noqa: F401  (autouse fixture)

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(20 + 9 * i)] for i in range(6)]
# greedy and seeded rows, logprobs, penalties, min_tokens, and lengths that end apart
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=31, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, presence_penalty=0.7),
    SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=40, ignore_eos=True,
                   frequency_penalty=0.3),
    SamplingParams(temperature=0.0, max_tokens=29, min_tokens=12, logprobs=0),
    SamplingParams(temperature=1.0, top_p=0.8, seed=2, max_tokens=35, ignore_eos=True),
]


def make_llm(async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(device="cpu", async_scheduling=async_scheduling, **kw)


def outputs(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[tuple]:
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs, o.top_logprobs)
        for o in llm.generate(prompts, params)
    ]


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Tokens, text and finish reasons equal; logprobs to float rounding (a step launched
    ahead may hold more rows than the step that takes it, which moves the last bits)."""
    assert [o[:4] for o in got] == [o[:4] for o in expected]
    for g, e in zip(got, expected):
        assert (g[4] is None) == (e[4] is None) and (g[5] is None) == (e[5] is None)
        if e[4] is not None:
            assert g[4] == pytest.approx(e[4], abs=1e-5)
        for g_top, e_top in zip(g[5] or (), e[5] or ()):
            assert g_top.keys() == e_top.keys()
            assert list(g_top.values()) == pytest.approx(list(e_top.values()), abs=1e-5)


def assert_all_blocks_back(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_held_blocks == 0 and bm.num_used_blocks == 0
    assert llm.engine.model_runner.lookahead is None


@pytest.fixture(scope="module")
def synchronous() -> list[tuple]:
    with make_llm(False) as llm:
        return outputs(llm)


def test_it_is_off_on_the_cpu_by_default_and_checked():
    assert EngineConfig(device="cpu").resolve(512).async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).resolve(512).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(device="cpu", async_scheduling="yes")
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(device="cpu", speculative_config=spec).resolve(512).async_scheduling is False
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(device="cpu", async_scheduling=True, speculative_config=spec).resolve(512)


def test_a_step_takes_the_launched_rows_only_for_what_was_launched():
    a, b, c = (make_seq(range(1, 9), request_id=r) for r in "abc")
    for seq in (a, b, c):
        seq.num_computed_tokens = 7  # 8 tokens: decoding the 8th
    logits = torch.zeros(2, 10)
    launched = Lookahead([a, b], [8, 8], logits, None, {id(a): 0, id(b): 1})
    for seq in (a, b, c):  # the step in between: its token appended, its KV computed
        seq.append_token(5)
        seq.num_computed_tokens = 8
    assert launched.rows_for([ScheduledSequence(b, 1), ScheduledSequence(a, 1)]) == [1, 0]
    assert launched.rows_for([ScheduledSequence(b, 1)]) == [1]  # a stopped meanwhile
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(c, 1)]) is None
    assert launched.rows_for([ScheduledSequence(a, 2)]) is None
    a.spec_token_ids = [3]
    assert launched.rows_for([ScheduledSequence(a, 1)]) is None
    b.num_computed_tokens = 0  # preempted, recomputed one token at a time
    assert launched.rows_for([ScheduledSequence(b, 1)]) is None
    b.num_computed_tokens = 8
    b.append_token(6)  # a step that did not take the launched forward
    assert launched.rows_for([ScheduledSequence(b, 1)]) is None


def test_a_step_of_every_launched_sequence_in_order_is_checked_as_one_of_some():
    def launched_pair():
        a, b = (make_seq(range(1, 9), request_id=r) for r in "ab")
        for seq in (a, b):
            seq.num_computed_tokens = 7
        launched = Lookahead([a, b], [8, 8], torch.zeros(2, 10), None, {id(a): 0, id(b): 1})
        for seq in (a, b):
            seq.append_token(5)
            seq.num_computed_tokens = 8
        return launched, a, b

    launched, a, b = launched_pair()
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(b, 1)]) == [0, 1]
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(b, 2)]) is None
    b.spec_token_ids = [3]
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(b, 1)]) is None
    launched, a, b = launched_pair()
    b.num_computed_tokens = 0
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(b, 1)]) is None
    launched, a, b = launched_pair()
    b.append_token(6)
    b.num_computed_tokens = 9
    assert launched.rows_for([ScheduledSequence(a, 1), ScheduledSequence(b, 1)]) is None


def test_only_blocks_both_forwards_write_are_held_across_the_handover():
    assert held_by_both([4, 7, 9], [7, 9, 12]) == {7, 9}
    assert held_by_both([4, 7, 7], [7, 9]) == set()  # a block named twice: each list in full
    assert held_by_both([], [3]) == set()


def test_the_engine_generates_what_it_does_without_it(synchronous):
    with make_llm(True) as llm:
        assert_same(outputs(llm), synchronous)
        runner = llm.engine.model_runner
        # every decode step after the first took the forward launched for it
        assert runner.num_lookahead_used >= max(p.max_tokens for p in PARAMS) - 3
        assert runner.num_lookahead_wasted <= 1
        assert_all_blocks_back(llm)


def test_sequences_that_stop_meanwhile_are_left_out_of_the_rows_taken(synchronous):
    """Stop strings and stop tokens end requests at steps the lookahead cannot foresee."""
    stops = [
        SamplingParams(**{**_fields(p), "stop": [out[1][5:8]]}) if i % 2 else
        SamplingParams(**{**_fields(p), "stop_token_ids": [out[0][10]]})
        for i, (p, out) in enumerate(zip(PARAMS, synchronous))
    ]
    with make_llm(False) as llm:
        expected = outputs(llm, params=stops)
    assert all(o[2] == "stop" for o in expected)
    with make_llm(True) as llm:
        assert_same(outputs(llm, params=stops), expected)
        assert llm.engine.model_runner.num_lookahead_used > 0
        assert_all_blocks_back(llm)


def _fields(params: SamplingParams) -> dict:
    names = ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos", "logprobs",
             "presence_penalty", "frequency_penalty", "min_tokens")
    return {name: getattr(params, name) for name in names}


def test_the_block_a_launched_forward_writes_stays_held_until_it_ran():
    """A request aborted while its next forward is in flight gives its blocks back, except
    the one that forward writes: that one waits for the next step."""
    with make_llm(True, enable_prefix_caching=False) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, PARAMS[0]) for p in PROMPTS[:2]]
        while engine.model_runner.lookahead is None:
            engine.step()
        seq = engine.scheduler.get(ids[0])
        written = seq.block_table[seq.num_tokens // engine.config.block_size]
        engine.abort_request(ids[0])
        bm = engine.block_manager
        assert bm.blocks[written].ref_count == 1  # the hold; its other blocks are free
        assert bm.num_held_blocks == 2  # the other request's written block too
        engine.step()
        assert bm.blocks[written].ref_count == 0
        while engine.has_unfinished_requests():
            engine.step()
        assert_all_blocks_back(llm)


def test_requests_that_arrive_or_are_aborted_mid_decode_match_the_synchronous_engine():
    def run(async_scheduling: bool) -> tuple[dict, int]:
        with make_llm(async_scheduling, max_num_seqs=4) as llm:
            engine, done = llm.engine, {}
            queue = list(zip(PROMPTS, PARAMS))
            for i, (prompt, params) in enumerate(queue[:3]):
                engine.add_request(prompt, params, request_id=f"r{i}")
            step, arrivals = 0, iter(queue[3:])
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finish_reason is not None:
                        done[out.request_id] = (out.token_ids, out.finish_reason)
                step += 1
                if step % 7 == 0:  # a request arrives while the others decode
                    nxt = next(arrivals, None)
                    if nxt is not None:
                        engine.add_request(nxt[0], nxt[1], request_id=f"late{step}")
                if step == 12:
                    out = engine.abort_request("r1")
                    done["r1"] = (out.token_ids, out.finish_reason)
            used = engine.model_runner.num_lookahead_used
            assert_all_blocks_back(llm)
            return done, used

    expected, _ = run(False)
    got, used = run(True)
    assert got == expected and used > 0
    assert expected["r1"][1] == "abort" and len(expected) == len(PROMPTS)


def test_preemption_in_a_small_pool_matches_the_synchronous_engine():
    kw = dict(num_gpu_blocks_override=16, max_num_seqs=6)
    with make_llm(False, **kw) as llm:
        expected = outputs(llm)
        assert llm.engine.stats().num_preemptions > 0
    with make_llm(True, **kw) as llm:
        assert_same(outputs(llm), expected)
        assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.model_runner.num_lookahead_used > 0
        assert_all_blocks_back(llm)


def _step_all(llm: LLM) -> tuple[list[tuple], list[bool]]:
    """Run PROMPTS step by step: the final outputs, and per step whether a request waited
    while a forward was launched ahead."""
    engine, finals, launched_while_waiting = llm.engine, {}, []
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        launched_while_waiting.append(
            bool(engine.scheduler.waiting) and engine.model_runner.lookahead is not None
        )
    outs = [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs, o.top_logprobs)
            for o in (finals[i] for i in ids)]
    return outs, launched_while_waiting


def test_requests_waiting_for_blocks_do_not_stop_the_launch():
    """A full pool keeps waiting requests out until blocks come back; meanwhile the decode
    steps are launched ahead (they used to be only when nothing waited)."""
    kw = dict(num_gpu_blocks_override=14, max_num_seqs=6, max_model_len=128)
    with make_llm(False, **kw) as llm:
        expected, _ = _step_all(llm)
    with make_llm(True, **kw) as llm:
        got, launched_while_waiting = _step_all(llm)
        assert_same(got, expected)
        assert sum(launched_while_waiting) >= 5
        assert_all_blocks_back(llm)


def test_decode_graph_buffers_take_the_ids_from_the_device(synchronous):
    """The decode-graph path (run eagerly on the CPU): launched forwards feed the sampled
    ids into the static buffers. Padding the batch to a bucket may move float rounding, so
    the tokens are compared."""
    with make_llm(True) as llm:
        graphs = llm.engine.model_runner.enable_decode_graphs(capture=False)
        got = outputs(llm)
        assert [o[0] for o in got] == [o[0] for o in synchronous]
        assert graphs.num_replays >= llm.engine.model_runner.num_lookahead_used > 0
        assert_all_blocks_back(llm)


def test_saves_and_loads_through_a_connector_are_unchanged():
    """The in-memory connector moves bytes as late as the contract allows: blocks that a
    step read or wrote too early would show as other tokens."""
    store: dict = {}
    with make_llm(False, kv_connector=MemoryConnector(store), num_gpu_blocks_override=64) as llm:
        expected = outputs(llm)
    for hits in (False, True):  # an empty store, then one with every prompt's blocks
        seen = store if hits else {}
        conn = MemoryConnector(dict(seen), load_delay_polls=1, save_delay_polls=2)
        with make_llm(True, kv_connector=conn, num_gpu_blocks_override=64) as llm:
            assert_same(outputs(llm), expected)
            assert (llm.engine.stats().connector_hits > 0) == hits
            assert llm.engine.model_runner.num_lookahead_used > 0
            while llm.engine.has_unfinished_requests():  # saves still held
                llm.engine.step()
            assert_all_blocks_back(llm)


@pytest.mark.cuda
def test_on_a_gpu_graphs_launched_ahead_generate_what_eager_steps_do():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    greedy = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in PARAMS]
    kw = dict(device="cuda", dtype="float32", max_model_len=256, num_gpu_blocks_override=256)
    with LLM(enforce_eager=True, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    with LLM(**kw) as llm:
        assert llm.engine.config.async_scheduling
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected
        assert llm.engine.model_runner.num_lookahead_used > 0
        assert_all_blocks_back(llm)


def test_a_batch_redrawn_row_by_row_drops_the_forward_launched_on_its_first_draw(monkeypatch):
    """The host copy of a batch's draws fails after the next forward was launched on them:
    the rows are drawn again one by one (seeded rows get other tokens), so that forward
    computed ids that were not appended and must not be taken."""
    import engine.sampler as sampler

    real = sampler._to_host

    def run(async_scheduling: bool) -> list[list[int]]:
        calls = 0

        def failing_once(drawn):
            nonlocal calls
            if drawn.token_ids.shape[0] > 1:
                calls += 1
                if calls == 6:
                    raise RuntimeError("the copy of the draws failed")
            return real(drawn)

        monkeypatch.setattr(sampler, "_to_host", failing_once)
        seeded = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=15, ignore_eos=True)
                  for i in range(3)]
        with make_llm(async_scheduling) as llm:
            out = [o.token_ids for o in llm.generate(PROMPTS[:3], seeded)]
            assert_all_blocks_back(llm)
            return out

    assert run(True) == run(False)
