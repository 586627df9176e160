"""Helpers shared by the engine tests: a one-thread fixture, sequences, an in-memory connector."""
from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest
import torch

from engine.connector import KVConnector, SavedBlock
from engine.hashing import root_hash
from engine.sampler import SamplingParams
from engine.sequence import Sequence

NAMESPACE = bytes(32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run torch on one thread: on a small shared VM two OpenMP threads stall each other
    on every tiny op, which makes tiny-model steps ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_seq(
    token_ids: Seq[int],
    request_id: str = "r",
    *,
    block_size: int = 4,
    params: SamplingParams | None = None,
    cache_salt: str | None = None,
) -> Sequence:
    return Sequence(
        request_id,
        list(token_ids),
        params or SamplingParams(),
        block_size=block_size,
        root_hash=root_hash(NAMESPACE, cache_salt),
        generator=torch.Generator().manual_seed(0),
        cache_salt=cache_salt,
    )


class MemoryConnector(KVConnector):
    """Keeps saved blocks in a dict (``store``, shareable between instances) keyed by
    (namespace, hash). ``fail_loads`` makes every load write garbage and return False."""

    def __init__(self, store: dict | None = None, *, fail_loads: bool = False) -> None:
        self.store: dict[tuple[bytes, bytes], tuple[SavedBlock, torch.Tensor]] = (
            {} if store is None else store
        )
        self.fail_loads = fail_loads
        self.kv_cache: torch.Tensor | None = None
        self.namespace: bytes | None = None
        self.saved: list[SavedBlock] = []
        self.loads: list[tuple[str, list[bytes], list[int]]] = []
        self.queries: list[tuple[str, int, int]] = []
        self.evicted: list[bytes] = []
        self.finished: list[str] = []
        self.closed = False

    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        self.kv_cache, self.namespace, self.block_size = kv_cache, namespace, block_size

    def get_num_matched_blocks(self, request_id, block_hashes, num_computed_blocks) -> int:
        count = 0
        for h in block_hashes[num_computed_blocks:]:
            if (self.namespace, h) not in self.store:
                break
            count += 1
        self.queries.append((request_id, len(block_hashes), num_computed_blocks))
        return count

    def load_blocks(self, request_id, block_hashes, block_ids) -> bool:
        self.loads.append((request_id, list(block_hashes), list(block_ids)))
        for h, b in zip(block_hashes, block_ids):
            if self.fail_loads:
                self.kv_cache[:, :, b] = 1e4  # a partial, wrong write must never be used
                return False
            self.kv_cache[:, :, b] = self.store[(self.namespace, h)][1]
        return True

    def save_blocks(self, blocks: Seq[SavedBlock]) -> None:
        for block in blocks:
            self.saved.append(block)
            data = self.kv_cache[:, :, block.block_id].clone()  # [L, 2, block_size, H, D]
            self.store[(self.namespace, block.block_hash)] = (block, data)

    def on_blocks_evicted(self, block_hashes) -> None:
        self.evicted += list(block_hashes)

    def request_finished(self, request_id: str) -> None:
        self.finished.append(request_id)

    def close(self) -> None:
        self.closed = True
