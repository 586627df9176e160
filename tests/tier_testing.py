"""What the tier manager's tests share: a tiny engine whose block pool holds about one
request (so hits must come from below), its prompts, and their reference outputs."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.tiny import TINY_CONFIG
from storage.lmdb_store import LmdbStore
from tiered_kv import TierConfig, build_llm

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(count)]


PROMPTS = random_prompts(3, 130, seed=7)  # 8 full blocks each; 9 blocks with the outputs
FLUSH = random_prompts(1, 240, seed=8)[0]  # with its outputs, fills all 16 blocks of the engine


def make_llm(tiers: TierConfig, blocks: int = 16, **engine) -> LLM:
    """A tiny engine whose block pool holds about one request, so hits must come from below."""
    return build_llm(
        "tiny", tiers, device="cpu", max_model_len=256, num_gpu_blocks_override=blocks, **engine
    )


def hit_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def tiny_block_nbytes() -> int:
    """The bytes of one full block of the tiny model in float32."""
    c = TINY_CONFIG
    return c["num_hidden_layers"] * 2 * BLOCK * c["num_key_value_heads"] * c["head_dim"] * 4


def assert_all_dropped(manager, blocks: int) -> None:
    """After a flush: ``blocks`` saves dropped, nothing in the pool, every slot free."""
    assert not manager.flush(30)  # it says blocks were lost since the last flush
    assert manager.flush(30)  # and none since
    stats = manager.stats()["cpu"]
    assert stats["dropped"] == blocks and stats["entries"] == 0
    assert manager.stores()["cpu"].num_evictable() == manager.stores()["cpu"].num_slots


class StalledDisk(NamedTuple):
    writing: threading.Event  # set once a commit is held
    release: threading.Event  # set by the test: the held commits go on


def stall_disk(monkeypatch) -> StalledDisk:
    """Hold every disk commit (``LmdbStore.put_many``) until ``release`` is set: a disk that
    does not keep up."""
    stalled = StalledDisk(threading.Event(), threading.Event())
    put_many = LmdbStore.put_many

    def stalled_put_many(self, items, **kwargs):
        stalled.writing.set()
        stalled.release.wait(30)
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", stalled_put_many)
    return stalled
