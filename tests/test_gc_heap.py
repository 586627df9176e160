"""The engine's start-up heap is frozen while it runs and given back to the collector when
it closes (engine/gc_heap.py)."""
from __future__ import annotations

import gc
import weakref

from engine import LLM, SamplingParams, gc_heap
from engine.sequence import Sequence
from engine_testing import one_thread  # noqa: F401  (autouse fixture)


def test_an_engine_freezes_its_start_up_heap_and_thaws_it_on_close():
    with LLM(device="cpu", max_model_len=128, num_gpu_blocks_override=16) as llm:
        assert gc.get_freeze_count() > 10_000  # torch, the model and the tokenizer at least
        assert gc.get_threshold()[0] >= gc_heap.YOUNG_THRESHOLD
        out = llm.generate("frozen", SamplingParams(max_tokens=4, temperature=0.0))[0]
        assert len(out.token_ids) == 4
        engine = weakref.ref(llm.engine)
    assert gc.get_freeze_count() == 0
    del llm, out
    gc.collect()
    assert engine() is None  # nothing of a closed engine is kept frozen


def test_a_threshold_set_higher_or_collection_turned_off_is_left_alone():
    before = gc.get_threshold()
    try:
        gc.set_threshold(50_000, 10, 10)
        gc_heap.freeze_startup_heap()
        assert gc.get_threshold() == (50_000, 10, 10)
        gc.set_threshold(0, 10, 10)
        gc_heap.freeze_startup_heap()
        assert gc.get_threshold() == (0, 10, 10)
    finally:
        gc_heap.thaw()
        gc.set_threshold(*before)


def test_finished_requests_are_freed_without_waiting_for_a_collection():
    # with young collections rarer, a request caught in a reference cycle would pile up
    # until one ran (vLLM's requests did, with their multimodal data): ours must not form any
    with LLM(device="cpu", max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=8) as llm:
        outs = llm.generate([f"request {i} " * 3 for i in range(48)],
                            SamplingParams(max_tokens=4, temperature=0.8, seed=1))
        assert len(outs) == 48
        alive = [o for o in gc.get_objects() if isinstance(o, Sequence)]
    assert alive == []
