"""OutputProcessor: detokenizing token by token or at the finish, the stop conditions, and
the outputs built."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tokenizers import decoders

from engine.models.tiny import END_ID, EOS_ID, write_tiny_tokenizer
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, RequestOutputKind, RequestTimes, frozen
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer
from tokenizer_testing import crossing_bpe, random_ids, sentencepiece, tiny

FINAL_ONLY, CUMULATIVE = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder, eos_token_ids=[EOS_ID, END_ID])


@pytest.fixture
def proc(tok) -> OutputProcessor:
    return OutputProcessor(tok, tok.eos_token_ids, MAX_MODEL_LEN)


def start(proc: OutputProcessor, params: SamplingParams, rid: str = "r") -> Sequence:
    prompt = proc.tokenizer.encode("Say:", add_special_tokens=False)
    seq = Sequence(rid, prompt, params, block_size=16, root_hash=bytes(32), generator=torch.Generator())
    proc.add(rid, prompt, params)
    return seq


def feed(proc: OutputProcessor, seq: Sequence, ids: list[int]):
    """Append ``ids`` one by one as the engine does; the outputs after each and the finish
    reason (the request is finished as the scheduler would)."""
    outputs, reason = [], None
    for token in ids:
        seq.append_token(token)
        reason = proc.stop(seq, token, grammar_ended=False)
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        outputs.append(proc.output(seq))
        if reason is not None:
            break
    return outputs, reason


def encode(proc: OutputProcessor, text: str) -> list[int]:
    return proc.tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_across_tokens_cuts_the_text_and_no_output_showed_it(proc):
    seq = start(proc, SamplingParams(stop=["lo w"]))
    outputs, reason = feed(proc, seq, encode(proc, "hello world"))
    assert reason == "stop" and outputs[-1].stop_reason == "lo w"
    assert outputs[-1].text == "hel"
    assert "".join(o.delta_text for o in outputs) == "hel"
    assert all("l" * 2 not in o.text for o in outputs)  # "hell" was held back, then cut
    assert proc.request_ids() == []  # a finished request's state is dropped


def test_unfinished_outputs_hold_back_what_could_begin_a_stop_string(proc):
    seq = start(proc, SamplingParams(stop=["xyz"], max_tokens=100))
    outputs, reason = feed(proc, seq, encode(proc, "abcdef"))
    assert reason is None
    assert [o.text for o in outputs] == ["", "", "a", "ab", "abc", "abcd"]
    assert outputs[-1].token_ids == encode(proc, "abcdef")


def test_eos_stops_unless_ignored_or_before_min_tokens(proc):
    seq = start(proc, SamplingParams(max_tokens=10))
    outputs, reason = feed(proc, seq, [*encode(proc, "ok"), EOS_ID])
    assert reason == "stop" and outputs[-1].stop_reason is None and outputs[-1].text == "ok"  # vLLM's

    seq = start(proc, SamplingParams(max_tokens=10, min_tokens=3), rid="early")
    outputs, reason = feed(proc, seq, [*encode(proc, "o"), EOS_ID, *encode(proc, "k"), EOS_ID])
    assert reason == "stop" and seq.num_output_tokens == 4
    assert outputs[-1].text == "ok"  # the early eos is kept in the ids, not in the text

    seq = start(proc, SamplingParams(max_tokens=3, ignore_eos=True), rid="ignored")
    outputs, reason = feed(proc, seq, [EOS_ID, EOS_ID, EOS_ID])
    assert reason == "length" and outputs[-1].stop_reason is None


def test_a_stop_string_before_min_tokens_does_not_stop(proc):
    seq = start(proc, SamplingParams(stop=["a"], min_tokens=3, max_tokens=10))
    outputs, reason = feed(proc, seq, encode(proc, "aaaa"))
    assert reason == "stop" and seq.num_output_tokens == 3
    assert outputs[-1].text == "aa"  # the third "a" (at min_tokens) is the stop


def test_max_tokens_and_max_model_len_end_with_length(proc):
    seq = start(proc, SamplingParams(max_tokens=2))
    outputs, reason = feed(proc, seq, encode(proc, "abc"))
    assert reason == "length" and outputs[-1].text == "ab" and len(outputs) == 2

    seq = start(proc, SamplingParams(max_tokens=None), rid="long")
    room = MAX_MODEL_LEN - seq.num_tokens
    outputs, reason = feed(proc, seq, encode(proc, "z" * (room + 5)))
    assert reason == "length" and seq.num_tokens == MAX_MODEL_LEN


def test_a_character_split_across_tokens_waits_for_its_last_byte(proc):
    seq = start(proc, SamplingParams(max_tokens=2))
    outputs, reason = feed(proc, seq, encode(proc, "é"))  # two byte tokens
    assert reason == "length"
    assert [o.delta_text for o in outputs] == ["", "é"]


def test_a_failed_request_keeps_only_the_text_already_sent(proc):
    seq = start(proc, SamplingParams(stop=["zz"], max_tokens=10))
    outputs, _ = feed(proc, seq, encode(proc, "abc"))
    sent = outputs[-1].text
    failed = proc.failed(seq)
    assert failed.finish_reason == "error" and failed.text == sent == "ab" and failed.delta_text == ""
    assert proc.request_ids() == []


def test_a_duplicate_id_is_refused_and_the_first_request_keeps_its_text(proc):
    seq = start(proc, SamplingParams(max_tokens=10))
    feed(proc, seq, encode(proc, "ab"))
    with pytest.raises(ValueError, match="already in use"):
        proc.add("r", [1, 2], SamplingParams())
    outputs, _ = feed(proc, seq, encode(proc, "c"))
    assert outputs[-1].text == "abc"
    proc.drop("r")
    assert proc.request_ids() == []


def test_outputs_built_without_their_init_are_the_same_frozen_outputs():
    fields = dict(request_id="r", prompt=None, prompt_token_ids=[1], token_ids=[2, 3], text="ab",
                  delta_text="b", num_cached_tokens=0, finish_reason=None, stop_reason=None,
                  logprobs=None, top_logprobs=None, prompt_logprobs=None,
                  times=frozen(RequestTimes, arrival=1.0, scheduled=2.0, first_token=None,
                               last_token=None))
    out = frozen(RequestOutput, **fields)
    assert out == RequestOutput(**fields) and out.times == RequestTimes(1.0, 2.0, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.text = "c"
    with pytest.raises(TypeError, match="needs all of its fields"):
        frozen(RequestTimes, arrival=1.0)


# --- final-only requests: detokenized at their finish ---------------------------------------

TOKENIZERS = {
    "tiny": tiny,
    "byte-level BPE": crossing_bpe,
    "llama 2": sentencepiece,  # metaspace, byte fallback
    "t5": lambda: sentencepiece(decoders.Metaspace(prepend_scheme="first")),
}


def random_params(rng: random.Random, tokenizer: Tokenizer) -> SamplingParams:
    size = tokenizer.backend.get_vocab_size()
    max_tokens = rng.choice([None, rng.randint(1, 30)])
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens or 5)]),
        ignore_eos=rng.random() < 0.2,
        stop_token_ids=rng.sample(range(size), rng.choice([0, 0, 1, 3])),
        skip_special_tokens=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 2]),
    )


def run_side_by_side(proc: OutputProcessor, rng: random.Random, case: int):
    """One random request fed to a streamed request (an output after every step) and to a
    final-only one: steps of 1-3 tokens (accepted drafts), eos ids among them, a grammar
    that may end, an abort that may come, the final-only one's output that may be read
    while it runs. Their final outputs, and the text that read gave."""
    tokenizer = proc.tokenizer
    params = random_params(rng, tokenizer)
    prompt = random_ids(tokenizer, rng, rng.randint(1, 8))
    seqs = []
    for kind in (CUMULATIVE, FINAL_ONLY):
        rid = f"{case}-{kind.value}"
        kind_params = dataclasses.replace(params, output_kind=kind)
        seqs.append(Sequence(rid, prompt, kind_params, block_size=16, root_hash=bytes(32),
                             generator=torch.Generator()))
        proc.add(rid, prompt, kind_params)
    assert proc._texts[seqs[1].request_id].deferred
    eos = list(proc.eos_token_ids)
    grammar_end, abort_at = rng.randint(1, 60), rng.choice([None, rng.randint(0, 20)])
    read_at, read = rng.randint(0, 20) if rng.random() < 0.1 else None, ""
    for step in range(1000):
        if step == abort_at:
            return *finish(proc, seqs, "abort"), read
        if step == read_at:  # read while it runs: detokenized token by token from here on
            read = proc.output(seqs[1]).text
        ids = [rng.choice(eos) if rng.random() < 0.05 else random_ids(tokenizer, rng, 1)[0]
               for _ in range(rng.randint(1, 3))]
        for token in ids:
            logprob, top = rng.random(), {token: rng.random()}
            reasons = [sample(proc, seq, token, logprob, top, seq.num_output_tokens + 1 == grammar_end)
                       for seq in seqs]
            assert reasons[0] == reasons[1]
            if reasons[0] is not None:
                return *finish(proc, seqs, reasons[0]), read
        proc.output(seqs[0])
    raise AssertionError("the request did not end")


def sample(proc: OutputProcessor, seq: Sequence, token: int, logprob: float, top: dict,
           grammar_ended: bool = False) -> str | None:
    """Append ``token`` (with its logprobs, if the request keeps them) as the engine does;
    the finish reason :meth:`OutputProcessor.stop` gives."""
    seq.append_token(token)
    if seq.logprobs is not None:
        seq.logprobs.append(logprob)
    if seq.top_logprobs is not None:
        seq.top_logprobs.append(top)
    return proc.stop(seq, token, grammar_ended=grammar_ended)


def finish(proc: OutputProcessor, seqs: list[Sequence], reason: str) -> list[RequestOutput]:
    for seq in seqs:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    return [proc.output(seq) for seq in seqs]


@pytest.mark.parametrize("family", TOKENIZERS)
def test_final_only_outputs_detokenized_at_the_finish_are_the_streamed_ones(family):
    """300 seeded random requests per tokenizer (stop ids and eos, min_tokens, max_tokens,
    max_model_len, a grammar's end, aborts, either skip setting, logprobs, several tokens a
    step, prompts and outputs that end inside a character): the final-only request's output
    is the streamed one's, field for field, its delta the whole text (less what a read while
    it ran gave)."""
    tokenizer = TOKENIZERS[family]()
    proc = OutputProcessor(tokenizer, tokenizer.eos_token_ids, max_model_len=32)
    ends = set()
    for case in range(300):
        streamed, final, read = run_side_by_side(proc, random.Random(f"{family}-{case}"), case)
        assert final.delta_text == final.text[len(read) :]
        assert dataclasses.replace(final, request_id="", delta_text="", times=None) == (
            dataclasses.replace(streamed, request_id="", delta_text="", times=None)
        ), case
        at_max_model_len = len(final.prompt_token_ids) + len(final.token_ids) == 32
        ends.add((final.finish_reason, final.stop_reason is not None, at_max_model_len))
    assert proc.request_ids() == []
    assert {("stop", False, False), ("stop", True, False), ("length", False, False),
            ("length", False, True), ("abort", False, False)} <= ends


def test_only_final_only_requests_without_stop_strings_wait_for_their_finish(proc):
    start(proc, SamplingParams(output_kind=FINAL_ONLY), rid="final")
    start(proc, SamplingParams(output_kind=FINAL_ONLY, stop=["x"]), rid="stop strings")
    start(proc, SamplingParams(output_kind=CUMULATIVE), rid="streamed")
    assert [s.deferred for s in proc._texts.values()] == [True, False, False]
    other = OutputProcessor(sentencepiece(decoders.WordPiece()), (), MAX_MODEL_LEN)
    other.add("r", [3, 4], SamplingParams(output_kind=FINAL_ONLY))
    assert not other._texts["r"].deferred


# --- delta outputs: what is new since the previous output ---------------------------------


@pytest.mark.parametrize("family", TOKENIZERS)
def test_delta_outputs_are_the_cumulative_outputs_differences(family):
    """200 seeded random requests per tokenizer, with and without stop strings, fed token by
    token (1-3 a step) to a cumulative and a delta request side by side, their outputs read
    after every step, some aborted or failed: each delta output is what the cumulative one
    added (tokens, text, logprobs), with the same finish."""
    tokenizer = TOKENIZERS[family]()
    proc = OutputProcessor(tokenizer, tokenizer.eos_token_ids, max_model_len=48)
    stops_seen = 0
    for case in range(200):
        rng = random.Random(f"delta-{family}-{case}")
        params = random_params(rng, tokenizer)
        if rng.random() < 0.4:  # stop strings: pieces of what the tokenizer decodes
            text = tokenizer.decode(random_ids(tokenizer, rng, 6), skip_special_tokens=True)
            stops = [text[i : i + rng.randint(1, 3)] for i in rng.sample(range(max(1, len(text))), 2)]
            params = dataclasses.replace(params, stop=tuple(s for s in stops if s) or ("zz",))
            stops_seen += 1
        prompt = random_ids(tokenizer, rng, rng.randint(1, 8))
        seqs = []
        for kind in (CUMULATIVE, RequestOutputKind.DELTA):
            rid = f"{case}-{kind.value}"
            kind_params = dataclasses.replace(params, output_kind=kind)
            seqs.append(Sequence(rid, prompt, kind_params, block_size=16, root_hash=bytes(32),
                                 generator=torch.Generator()))
            proc.add(rid, prompt, kind_params)
        end = rng.choice(["run", "run", "abort", "fail"])
        end_at = rng.randint(0, 15)
        previous = None
        for step in range(1000):
            if end != "run" and step == end_at:
                if end == "fail":
                    cumulative, delta = (proc.failed(seq) for seq in seqs)
                    assert delta.text == delta.delta_text == ""
                    assert delta.token_ids == cumulative.token_ids[len(previous.token_ids) if previous else 0 :]
                    break
                for seq in seqs:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            else:
                reasons = []
                for token in [rng.choice(list(proc.eos_token_ids)) if rng.random() < 0.05
                              else random_ids(tokenizer, rng, 1)[0] for _ in range(rng.randint(1, 3))]:
                    logprob, top = rng.random(), {token: rng.random()}
                    reasons = [sample(proc, seq, token, logprob, top) for seq in seqs]
                    assert reasons[0] == reasons[1]
                    if reasons[0] is not None:
                        for seq in seqs:
                            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reasons[0]
                        break
            cumulative, delta = (proc.output(seq) for seq in seqs)
            before = previous.token_ids if previous is not None else []
            assert delta.token_ids == cumulative.token_ids[len(before) :], case
            assert delta.text == delta.delta_text == cumulative.delta_text, case
            if cumulative.logprobs is not None:
                assert delta.logprobs == cumulative.logprobs[len(before) :]
            if cumulative.top_logprobs is not None:
                assert delta.top_logprobs == cumulative.top_logprobs[len(before) :]
            assert (delta.finish_reason, delta.stop_reason) == (cumulative.finish_reason, cumulative.stop_reason)
            assert delta.prompt_token_ids == cumulative.prompt_token_ids
            previous = cumulative
            if cumulative.finished:
                break
        else:
            raise AssertionError("the request did not end")
    assert proc.request_ids() == [] and stops_seen > 40
