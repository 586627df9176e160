"""OutputProcessor: detokenizing token by token, the stop conditions, and the outputs built."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.models.tiny import END_ID, EOS_ID, write_tiny_tokenizer
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, RequestTimes, frozen
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer

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
