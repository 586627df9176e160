"""Decode from static buffers (engine/cuda_graphs.py): padding, buckets, and the same tokens
as eager decode. On the CPU the buffers run eagerly; the ``cuda`` tests capture graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_buckets
from engine_testing import one_thread  # noqa: F401  (autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(7 * i + 1, 7 * i + 1 + n)) for i, n in enumerate((5, 17, 33))]


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert batch_buckets(64)[-2:] == (48, 64)


def _generate(llm: LLM, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_static_buffer_decode_gives_the_eager_tokens():
    with LLM(max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=8, device="cpu") as eager:
        expected = _generate(eager, PROMPTS)
    with LLM(max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=8, device="cpu") as llm:
        graphs = llm.engine.model_runner.enable_decode_graphs(capture=False)
        # 3 sequences run in bucket 4: one padding row, whose K/V go to the scratch block.
        assert graphs.bucket_for(3) == 4
        scratch_before = llm.engine.model_runner._full_cache[-1].clone()
        pool_before = llm.engine.model_runner.kv_cache.clone()
        assert _generate(llm, PROMPTS) == expected
        assert graphs.num_replays >= GREEDY.max_tokens - 1
        assert not torch.equal(llm.engine.model_runner._full_cache[-1], scratch_before)
        # A second round hits the prefix cache and still matches.
        assert _generate(llm, PROMPTS) == expected
        assert llm.engine.model_runner.kv_cache.shape == pool_before.shape


def test_padding_rows_never_touch_the_pool():
    with LLM(max_model_len=64, num_gpu_blocks_override=32, max_num_seqs=4, device="cpu") as llm:
        runner = llm.engine.model_runner
        graphs = runner.enable_decode_graphs(capture=False)
        pool = runner.kv_cache.clone()
        # 3 sequences in bucket 4: each writes slot 5 of its own block; one padding row.
        tables = np.array([[2], [9], [4]], dtype=np.int32)
        out = graphs.run(np.array([3, 4, 5]), np.array([5, 5, 5]), tables[:, 0] * 16 + 5, tables)
        assert out.shape[0] == 3
        changed = (runner.kv_cache != pool).flatten(1).any(dim=1)  # [num_blocks]
        assert changed.nonzero().flatten().tolist() == [2, 4, 9]


def test_a_batch_past_the_largest_bucket_is_refused():
    with LLM(max_model_len=64, num_gpu_blocks_override=32, max_num_seqs=2, device="cpu") as llm:
        graphs = llm.engine.model_runner.enable_decode_graphs(capture=False)
        with pytest.raises(ValueError, match="largest decode graph"):
            graphs.run(np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64),
                       np.zeros((3, 1), np.int32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_gives_the_eager_tokens():
    kwargs = dict(max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=16,
                  device="cuda", dtype="float32")
    with LLM(enforce_eager=True, **kwargs) as eager:
        expected = _generate(eager, PROMPTS)
    with LLM(**kwargs) as llm:
        graphs = llm.engine.model_runner.decode_graphs
        assert graphs is not None and graphs.capture_seconds > 0
        assert _generate(llm, PROMPTS) == expected
        assert graphs.num_replays >= GREEDY.max_tokens - 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_staged_behind_a_busy_gpu_reads_its_own_rows():
    # Two runs without a host sync between them: the first one's copies out of the pinned
    # staging rows wait behind a busy stream while the second one stages other rows.
    with LLM(max_model_len=64, num_gpu_blocks_override=32, max_num_seqs=4, device="cuda",
             dtype="float32") as llm:
        graphs = llm.engine.model_runner.decode_graphs
        tables = np.array([[2, 0, 0, 0], [9, 0, 0, 0]], dtype=np.int32)  # every column: contiguous

        def step(ids):
            return graphs.run(np.array(ids), np.array([5, 5]), tables[:, 0] * 16 + 5, tables)

        with torch.inference_mode():  # as the model runner runs it
            expected = step([3, 4]).clone()
            torch.cuda.synchronize()
            torch.cuda._sleep(1 << 30)  # about half a second of GPU time
            first = step([3, 4]).clone()
            step([7, 8])
            torch.cuda.synchronize()
        assert torch.equal(first, expected)
