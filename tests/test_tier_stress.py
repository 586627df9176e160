"""A seeded, model-based stress test of the tier manager: random interleavings of saves,
lookups, loads, polls, flushes, given-up saves, restarts and records corrupted on disk,
against a real :class:`~tiered_kv.TierManager` (real LMDB, a CPU pool of a few slots so it
evicts, lossless codecs so bytes compare exactly).

The oracle is a plain model: every block's KV is a function of its hash, and the model
knows every key ever saved and which ones a flush or a close said reached the disk
(``durable``). The manager may miss (evicted, dropped, corrupt), but it must never serve
wrong bytes, must report every save and load exactly once, and must find the durable
blocks again after a flush and after a restart. Each seed picks the codec, the write
policy (or a staging buffer without a CPU tier), the dtype, the pool's size and whether
the salted prompts' tenant matters less than the others (``tenant_priorities``).

More seeds for a long local run: ``TIERED_KV_STRESS_SEEDS=500 pytest tests/test_tier_stress.py``
(about half a second a seed). A failure names its seed, its operation's index and the pytest
node to rerun. A seed always draws the same operations; what hits, misses or waits also
depends on the manager's threads, which the checks allow for.
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch

from engine.connector import FinishedTransfers, SavedBlock
from engine.hashing import hash_blocks, root_hash
from engine_testing import NAMESPACE, random_prompts
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.base import BlockKey
from storage.lmdb_store import default_map_size
from storage.record import SEAL_SIZE
from tiered_kv import TierConfig, TierManager

SEEDS = int(os.environ.get("TIERED_KV_STRESS_SEEDS", "16"))
OPERATIONS = 100
BLOCK = 4  # tokens per block
LAYERS, HEADS, HEAD_DIM = 2, 1, 4
GPU_BLOCKS = 32
MAX_CHAIN = 8  # blocks per prompt: a load is one read chunk, and fits the smallest pool
DISK_BYTES = 64 << 20  # never full: the disk does not evict, so what reached it stays
WAIT_S = 20.0  # a flush, or a load's report, that takes longer is a failure


@dataclasses.dataclass(frozen=True)
class Chain:
    """A prompt's full blocks: their tokens and chained hashes."""

    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    salt: str | None

    def saved_block(self, i: int, block_id: int) -> SavedBlock:
        parent = self.hashes[i - 1] if i else None
        tokens = self.tokens[i * BLOCK : (i + 1) * BLOCK]
        return SavedBlock(self.hashes[i], parent, tokens, block_id, True, self.salt)


@dataclasses.dataclass
class Load:
    hashes: tuple[bytes, ...]
    block_ids: list[int]
    at_least: int  # blocks the model says must be served (durable ones, on a quiet manager)


def make_chains(rng: random.Random, seed: int) -> list[Chain]:
    """Prompts that share prefixes: a few stems, each prompt a stem's first blocks and a
    random tail; one stem is also asked under a tenant's salt (other keys, same tokens)."""
    stems = random_prompts([MAX_CHAIN * BLOCK] * 3, seed)
    chains = []
    for _ in range(10):
        stem = rng.randrange(len(stems))
        shared = rng.randint(0, MAX_CHAIN) * BLOCK
        length = rng.randint(max(shared // BLOCK, 1), MAX_CHAIN) * BLOCK
        tokens = stems[stem][:shared] + [rng.randrange(256) for _ in range(length - shared)]
        salt = "tenant" if stem == 0 and rng.random() < 0.5 else None
        hashes = hash_blocks(root_hash(NAMESPACE, salt), tokens, BLOCK)
        chains.append(Chain(tuple(tokens), tuple(hashes), salt))
    return chains


def tier_config(rng: random.Random, path: Path, slot_nbytes: int) -> TierConfig:
    slots = rng.randint(MAX_CHAIN, 14)
    mode = rng.choice(["write-through", "write-back", "staging"])
    pool = dict(cpu_bytes=0, staging_bytes=slots * slot_nbytes) if mode == "staging" else dict(
        cpu_bytes=slots * slot_nbytes, write_policy=mode
    )
    return TierConfig(
        kv_cache_dir=path, disk_bytes=DISK_BYTES, codec=rng.choice(["raw", "zstd"]),
        sync=False, flush_timeout_s=WAIT_S, tenant_priorities={"tenant": rng.choice([0, 3])},
        **pool,
    )


class Harness:
    """The manager under test, the engine's side of the protocol (which GPU blocks are
    free, saving or loading) and the model of what the tiers should hold."""

    def __init__(self, seed: int, path: Path) -> None:
        self.rng = random.Random(seed)
        self.chains = make_chains(self.rng, seed)
        self.dtype = self.rng.choice([torch.float32, torch.bfloat16])
        shape = (GPU_BLOCKS, LAYERS, 2, BLOCK, HEADS, HEAD_DIM)  # [N, L, 2, T, H, D]
        self.kv_cache = torch.zeros(shape, dtype=self.dtype)
        self.config = tier_config(self.rng, path, self.kv_cache[0].nbytes)
        self.stored: dict[bytes, torch.Tensor] = {}  # every block ever offered: its KV
        self.unflushed: set[bytes] = set()  # offered since the last flush or close
        self.durable: set[bytes] = set()  # a flush or a close said these reached the disk
        self.corrupted: set[bytes] = set()  # flipped on disk: may never be served again
        self.free = list(range(GPU_BLOCKS))
        self.saving: set[int] = set()  # block ids offered, until reported saved
        self.loading: dict[str, Load] = {}
        self.looked_up: dict[str, tuple[Chain, int, int]] = {}  # parked: (chain, first, matched)
        self.requests = 0
        self.served = 0  # blocks whose restored bytes were checked
        self.open()

    # ------------------------------------------------------------------ plumbing

    def open(self) -> None:
        self.manager = TierManager(self.config)
        self.manager.register_kv_cache(self.kv_cache, NAMESPACE, BLOCK)
        self.dropped_seen = 0

    def kv(self, block_hash: bytes) -> torch.Tensor:
        """A block's KV, a function of its hash."""
        if block_hash not in self.stored:
            g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little"))
            shape = self.kv_cache.shape[1:]  # [L, 2, T, H, D]
            self.stored[block_hash] = torch.randn(shape, generator=g).to(self.dtype)
        return self.stored[block_hash]

    def take(self, count: int) -> list[int] | None:
        if len(self.free) < count:
            self.collect(self.manager.poll(0.01))
        if len(self.free) < count:
            return None
        return [self.free.pop() for _ in range(count)]

    def collect(self, done: FinishedTransfers) -> None:
        """Check what a poll reported: each save and load once, loads with the right bytes."""
        for block_id in done.saved:
            assert block_id in self.saving, f"block {block_id} reported saved but not saving"
            self.saving.remove(block_id)
            self.free.append(block_id)
        for request_id, count in done.loaded.items():
            load = self.loading.pop(request_id, None)
            assert load is not None, f"{request_id} reported loaded but not loading"
            assert load.at_least <= count <= len(load.block_ids), (
                f"{request_id} loaded {count} of {len(load.block_ids)} blocks, "
                f"{load.at_least} of them durable"
            )
            for i, (block_hash, block_id) in enumerate(zip(load.hashes[:count], load.block_ids)):
                assert torch.equal(self.kv_cache[block_id], self.stored[block_hash]), (
                    f"{request_id}: block {i} ({block_hash.hex()[:12]}) restored wrong bytes"
                )
            self.served += count
            self.free += load.block_ids
            self.manager.request_finished(request_id)

    def settle_loads(self) -> None:
        """Wait for every load's report and for its job to end: a job lets go of the last
        slots it read just after the report."""
        deadline = time.monotonic() + WAIT_S
        while self.loading or self.manager._loads_in_flight:
            assert time.monotonic() < deadline, f"loads never done: {sorted(self.loading)}"
            self.collect(self.manager.poll(0.01))

    def num_dropped(self) -> int:
        return sum(int(tier.get("dropped", 0)) for tier in self.manager.stats().values())

    def reached_disk(self, ok: bool) -> None:
        """A flush or a close ended: with no drops since the last, what was offered is on disk."""
        if ok:
            self.durable |= self.unflushed - self.corrupted
        self.unflushed.clear()

    # ------------------------------------------------------------------ operations

    def save(self) -> None:
        """The engine offers a run of a prompt's blocks (often from its first), or of two
        prompts computed in one step (which may share blocks, each in its own GPU block)."""
        runs = []
        for chain in self.rng.sample(self.chains, 1 if self.rng.random() < 0.8 else 2):
            first = 0 if self.rng.random() < 0.7 else self.rng.randrange(len(chain.hashes))
            end = self.rng.randint(first + 1, len(chain.hashes))
            runs += [(chain, i) for i in range(first, end)]
        block_ids = self.take(len(runs))
        if block_ids is None:
            return
        blocks = []
        for (chain, i), block_id in zip(runs, block_ids):
            self.kv_cache[block_id] = self.kv(chain.hashes[i])
            self.saving.add(block_id)
            self.unflushed.add(chain.hashes[i])
            blocks.append(chain.saved_block(i, block_id))
        self.manager.save_blocks(blocks)

    def lookup_and_load(self) -> None:
        """Look a prompt up, then load part of its match now, or park the lookup for a
        later load (the tiers may have changed by then)."""
        if self.looked_up and self.rng.random() < 0.4:
            request_id = self.rng.choice(sorted(self.looked_up))
            chain, first, matched = self.looked_up.pop(request_id)
            self.load(request_id, chain, first, self.rng.randint(1, matched))
            return
        chain = self.rng.choice(self.chains)
        first = 0 if self.rng.random() < 0.8 else self.rng.randrange(len(chain.hashes))
        request_id, matched = self.lookup(chain, first)
        if matched == 0:
            self.manager.request_finished(request_id)
        elif self.rng.random() < 0.3 and len(self.looked_up) < 3:
            self.looked_up[request_id] = (chain, first, matched)
        else:
            self.load(request_id, chain, first, self.rng.randint(1, matched))

    def lookup(self, chain: Chain, first: int) -> tuple[str, int]:
        self.requests += 1
        request_id = f"r{self.requests}"
        matched = self.manager.get_num_matched_blocks(request_id, chain.hashes, first)
        assert matched is not None and 0 <= matched <= len(chain.hashes) - first
        run = chain.hashes[first : first + matched]
        assert all(h in self.stored for h in run), f"{request_id} matched blocks never saved"
        return request_id, matched

    def load(
        self, request_id: str, chain: Chain, first: int, count: int, at_least: int = 0
    ) -> None:
        block_ids = self.take(count)
        if block_ids is None:
            self.manager.request_finished(request_id)
            return
        self.kv_cache[block_ids] = -1e4  # KV a load that claims a block must overwrite
        hashes = chain.hashes[first : first + count]
        self.loading[request_id] = Load(hashes, block_ids, at_least)
        self.manager.start_load(request_id, hashes, block_ids, chain.salt)

    def poll(self) -> None:
        self.collect(self.manager.poll(self.rng.choice([0.0, 0.01])))  # may wait for a report

    def release_held(self) -> None:
        """The engine runs short of blocks: saves waiting for a slot are given up."""
        self.manager.release_held()
        self.collect(self.manager.poll())

    def flush(self) -> None:
        self.settle_loads()
        ok = self.manager.flush(WAIT_S)
        self.collect(self.manager.poll())
        assert not self.saving, f"saves not reported after a flush: {sorted(self.saving)}"
        dropped = self.num_dropped()
        assert ok == (dropped == self.dropped_seen), (
            f"flush said {ok} with {dropped - self.dropped_seen} blocks dropped since the last"
        )
        self.dropped_seen = dropped
        self.reached_disk(ok)
        self.check_quiet()
        self.check_durable()

    def restart(self) -> None:
        """Close (which finishes the loads in flight and writes what is pending), maybe
        corrupt a record, open a new manager."""
        for request_id in self.looked_up:
            self.manager.request_finished(request_id)
        self.looked_up.clear()
        self.manager.close()
        self.collect(self.manager.poll())
        assert not self.saving, f"saves not reported by close: {sorted(self.saving)}"
        assert not self.loading, f"loads not reported by close: {sorted(self.loading)}"
        self.reached_disk(self.num_dropped() == self.dropped_seen)
        if self.durable and self.rng.random() < 0.5:
            self.corrupt(self.rng.choice(sorted(self.durable)))
        self.open()
        self.check_durable()
        self.check_quiet()

    # ------------------------------------------------------------------ checks

    def corrupt(self, block_hash: bytes) -> None:
        """Flip the last payload byte of a durable record behind the closed store's back."""
        path = str(self.config.cache_path)
        env = lmdb.open(path, max_dbs=4, map_size=default_map_size(DISK_BYTES))
        key = BlockKey(NAMESPACE, block_hash).to_bytes()
        try:
            with env.begin(write=True, db=env.open_db(b"records")) as txn:
                data = bytearray(txn.get(key) or b"")
                assert data, f"durable block {block_hash.hex()[:12]} is not on disk"
                data[len(data) - SEAL_SIZE - 1] ^= 0x55
                txn.put(key, bytes(data))
        finally:
            env.close()
        self.durable.discard(block_hash)
        self.corrupted.add(block_hash)

    def check_durable(self) -> None:
        """On a quiet manager, a few prompts' durable leading blocks are found and loaded."""
        for chain in self.rng.sample(self.chains, 3):
            durable = [h in self.durable for h in chain.hashes]
            run = durable.index(False) if False in durable else len(durable)
            if run == 0:
                continue
            request_id, matched = self.lookup(chain, 0)
            assert matched >= run, f"{request_id} matched {matched} blocks, {run} are durable"
            # a tenant that matters less may find the pool full of blocks it cannot evict
            served = run if self.config.tenant_priority(chain.salt) == 0 else 0
            self.load(request_id, chain, 0, matched, at_least=served)
            assert request_id in self.loading, "a quiet manager's engine has free blocks"
            self.settle_loads()

    def check_quiet(self) -> None:
        """Nothing in flight: every pool slot can be had again, no block waits for disk, and
        the pool's counters add up (a load's promotion counts just after it commits)."""
        stats = self.manager.stats()
        assert stats["disk"]["queued_blocks"] == 0
        pool = self.manager.stores().get("cpu")
        if pool is not None:
            assert pool.num_evictable() == pool.num_slots, (
                f"{pool.num_slots - pool.num_evictable()} pool slots held with nothing in flight"
            )
            cpu = stats["cpu"]
            assert cpu["entries"] == cpu["stored_blocks"] - cpu["evictions"], (
                f"pool holds {cpu['entries']} blocks; {cpu['stored_blocks']} stored, "
                f"{cpu['evictions']} evicted"
            )

    def check_invariants(self) -> None:
        stats = self.manager.stats()
        if "cpu" in stats:
            cpu, slots = stats["cpu"], self.manager.stores()["cpu"].num_slots
            assert cpu["entries"] <= slots, f"{cpu['entries']} pool entries in {slots} slots"
        if not self.corrupted:
            assert stats["disk"]["corrupt"] == 0, "a record nobody touched failed verification"


OPERATION_WEIGHTS: dict[Callable[[Harness], None], int] = {
    Harness.save: 35,
    Harness.lookup_and_load: 30,
    Harness.poll: 12,
    Harness.flush: 8,
    Harness.release_held: 5,
    Harness.restart: 6,
}


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda seed: f"seed{seed}")
def test_random_operations_never_serve_wrong_bytes_or_lose_flushed_blocks(tmp_path, seed, request):
    harness = Harness(seed, tmp_path / "kv")
    operations, weights = zip(*OPERATION_WEIGHTS.items())
    drawn = harness.rng.choices(operations, weights, k=OPERATIONS)
    try:
        for index, operation in enumerate([*drawn, Harness.flush]):
            try:
                operation(harness)
                harness.check_invariants()
            except Exception as e:
                raise AssertionError(
                    f"seed {seed}, operation {index} ({operation.__name__}) with "
                    f"{harness.config.codec}, {harness.dtype}, {harness.config.write_policy}"
                    f"{'' if harness.config.has_cpu else ' (staging only)'}: {e}\n"
                    f"rerun: pytest '{request.node.nodeid}'"
                ) from e
    finally:
        harness.manager.close()
    assert harness.served > 0, "no load was checked: the operations do not exercise the tiers"
