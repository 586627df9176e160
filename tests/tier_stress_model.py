"""The harness and the model of the tier stress test (``tests/test_tier_stress.py``).

:class:`Harness` holds a real :class:`~tiered_kv.TierManager` (real LMDB, a CPU pool of a
few slots so it evicts, and for some seeds a real Valkey/Redis server as the remote tier),
plays the engine's side of the connector protocol (which GPU blocks are free, saving or
loading) and keeps a plain model of what the tiers should hold. Its operations are the
methods a run draws; each checks what it can.

The model: every block's KV is a function of its hash, and a load restores it bit for bit,
or with a lossy codec exactly the codec's own round trip of it (``encode`` is a pure
function of the tensor and ``decode`` is deterministic, docs/codecs.md; the round trip's
error bound is checked in ``tests/test_codecs.py``). The model knows every block ever
offered and which ones a flush or a close said reached the disk (``durable``) or the
remote tier (:attr:`RemoteTier.durable`). A quiet manager must find and load those again:
the run on disk, then, while the server is up, the run the remote tier continues it with
(a lookup asks the remote tier for the rest of the chain after the local run). A block
corrupted in a tier is never required again; it must never be served wrong.
"""
from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import lmdb
import torch

from engine.connector import FinishedTransfers, SavedBlock
from engine.hashing import hash_blocks, root_hash
from engine_testing import NAMESPACE, random_prompts
from remote_testing import SECRET, SILENT_S
from storage.base import BlockKey
from storage.codecs import get_codec
from storage.lmdb_store import default_map_size
from storage.record import SEAL_SIZE
from tier_stress_remote import RemoteTier
from tiered_kv import TierConfig, TierManager

BLOCK = 4  # tokens per block
LAYERS, HEADS, HEAD_DIM = 2, 1, 4
BLOCK_SHAPE = (LAYERS, 2, BLOCK, HEADS, HEAD_DIM)  # [L, 2, T, H, D]
GPU_BLOCKS = 32
MAX_CHAIN = 8  # blocks per prompt: a load is one read chunk, and fits the smallest pool
DISK_BYTES = 64 << 20  # never full: the disk does not evict, so what reached it stays
WAIT_S = 20.0  # a flush, a load's report or an operation that takes longer is a failure
LOSSLESS = ("raw", "zstd")
LOSSY = ("kivi4", "kivi4+zstd", "kivi2", "kivi2+zstd")
# Codecs that share a namespace (docs/tiers.md, Keys): a restart may switch to the other,
# and what was stored before stays usable.
SIBLINGS = {"raw": "zstd", "zstd": "raw", "kivi4": "kivi4+zstd", "kivi4+zstd": "kivi4",
            "kivi2": "kivi2+zstd", "kivi2+zstd": "kivi2"}


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


def tier_config(
    rng: random.Random, path: Path, dtype: torch.dtype, remote_url: str | None
) -> TierConfig:
    codec = rng.choice(LOSSLESS if rng.random() < 0.5 else LOSSY)
    slot_nbytes = get_codec(codec).stage.payload_size(dtype, BLOCK_SHAPE)  # KIVI: smaller
    slots = rng.randint(MAX_CHAIN, 14)
    mode = rng.choice(["write-through", "write-back", "staging"])
    pool = dict(cpu_bytes=0, staging_bytes=slots * slot_nbytes) if mode == "staging" else dict(
        cpu_bytes=slots * slot_nbytes, write_policy=mode
    )
    # calls that wait on a frozen server cost their deadline until the breaker opens
    remote = {} if remote_url is None else dict(
        remote_url=remote_url, remote_timeout_s=SILENT_S, remote_secret=SECRET
    )
    return TierConfig(
        kv_cache_dir=path, disk_bytes=DISK_BYTES, codec=codec, sync=False,
        flush_timeout_s=WAIT_S, tenant_priorities={"tenant": rng.choice([0, 3])},
        **pool, **remote,
    )


class Harness:
    """The manager under test, the engine's side of the protocol (which GPU blocks are
    free, saving or loading) and the model of what the tiers should hold."""

    def __init__(self, seed: int, path: Path, remote: RemoteTier | None = None) -> None:
        self.rng = random.Random(seed)
        self.chains = make_chains(self.rng, seed)
        self.dtype = self.rng.choice([torch.float32, torch.bfloat16])
        # [N, L, 2, T, H, D]
        self.kv_cache = torch.zeros((GPU_BLOCKS, *BLOCK_SHAPE), dtype=self.dtype)
        self.path = path
        self.disks = 1  # disk directories so far: a joining manager gets a new, empty one
        self.remote = remote
        self.config = tier_config(
            self.rng, path / "kv0", self.dtype, None if remote is None else remote.server.url
        )
        self.stored: dict[bytes, torch.Tensor] = {}  # every block ever offered: its KV
        self.quantized: dict[bytes, torch.Tensor] = {}  # lossy codec: its round trip of each
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

    def describe(self) -> str:
        config = self.config
        tiers = "" if config.has_cpu else " (staging only)"
        if self.remote is not None:
            tiers += f", remote tier{' ' + self.remote.down if self.remote.down else ''}"
        return f"{config.codec}, {self.dtype}, {config.write_policy}{tiers}"

    # ------------------------------------------------------------------ plumbing

    def open(self) -> None:
        self.manager = TierManager(self.config)
        self.manager.register_kv_cache(self.kv_cache, NAMESPACE, BLOCK)
        self.dropped_seen: dict[str, int] = {}

    def kv(self, block_hash: bytes) -> torch.Tensor:
        """A block's KV, a function of its hash."""
        if block_hash not in self.stored:
            g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little"))
            self.stored[block_hash] = torch.randn(BLOCK_SHAPE, generator=g).to(self.dtype)
        return self.stored[block_hash]

    def expected(self, block_hash: bytes) -> torch.Tensor:
        """What a load restores: the block's KV, or the lossy codec's round trip of it."""
        codec = get_codec(self.config.codec)
        if codec.lossless:
            return self.stored[block_hash]
        if block_hash not in self.quantized:
            kv = self.stored[block_hash]
            self.quantized[block_hash] = codec.decode(codec.encode(kv), kv.dtype, BLOCK_SHAPE)
        return self.quantized[block_hash]

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
                assert torch.equal(self.kv_cache[block_id], self.expected(block_hash)), (
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

    def settle_writes(self) -> None:
        """Wait until no block waits for the disk: a remote hit is promoted pending for it
        (with write-through), and the next load cannot take a pending block's slot."""
        deadline = time.monotonic() + WAIT_S
        while self.manager.stats()["disk"]["queued_blocks"]:
            assert time.monotonic() < deadline, "promoted blocks never written to disk"
            time.sleep(0.002)

    def dropped(self) -> dict[str, int]:
        return {tier: int(stats.get("dropped", 0)) for tier, stats in self.manager.stats().items()}

    def reached(self) -> None:
        """A flush or a close ended: what was offered since the last one reached each tier
        that dropped nothing since. A save the pool (or the staging buffer) dropped reached
        no tier; a block the remote tier dropped still reached the disk."""
        dropped = self.dropped()
        new = {tier: n - self.dropped_seen.get(tier, 0) for tier, n in dropped.items()}
        self.dropped_seen = dropped
        local = not any(n for tier, n in new.items() if tier != "remote")
        if local:
            self.durable |= self.unflushed - self.corrupted
        self.unflushed.clear()
        if self.remote is not None:
            self.remote.reached(local and not new.get("remote"))

    def close(self) -> None:
        """Close (which finishes the loads in flight and writes what is pending)."""
        for request_id in self.looked_up:
            self.manager.request_finished(request_id)
        self.looked_up.clear()
        self.manager.close()
        self.collect(self.manager.poll())
        assert not self.saving, f"saves not reported by close: {sorted(self.saving)}"
        assert not self.loading, f"loads not reported by close: {sorted(self.loading)}"
        self.reached()

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
            if self.remote is not None:
                self.remote.unflushed.add(chain.hashes[i])
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
        """Ask until the manager answers, polling meanwhile, as the engine asks at each step
        (a remote lookup answers from a lookup thread)."""
        self.requests += 1
        request_id = f"r{self.requests}"
        deadline = time.monotonic() + WAIT_S
        ask = self.manager.get_num_matched_blocks
        while (matched := ask(request_id, chain.hashes, first)) is None:
            assert time.monotonic() < deadline, f"{request_id}: the lookup never answered"
            self.collect(self.manager.poll(0.01))
        assert 0 <= matched <= len(chain.hashes) - first
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
        dropped = sum(self.dropped().values()) - sum(self.dropped_seen.values())
        assert ok == (dropped == 0), f"flush said {ok} with {dropped} blocks dropped since the last"
        self.reached()
        self.check_quiet()
        self.check_durable()

    def restart(self) -> None:
        """Close, maybe corrupt a record on disk, open a new manager on the same disk, maybe
        with the codec's sibling."""
        self.close()
        if self.durable and self.rng.random() < 0.5:
            self.corrupt(self.rng.choice(sorted(self.durable)))
        if self.rng.random() < 0.3:
            self.config = dataclasses.replace(self.config, codec=SIBLINGS[self.config.codec])
            self.quantized.clear()
        self.open()
        self.check_durable()
        self.check_quiet()

    def outage(self) -> None:
        """The remote server goes down (frozen or killed), or comes back."""
        if self.remote.down is None:
            self.remote.take_down(self.rng)
        else:
            self.remote.bring_back()

    def end_outage(self) -> None:
        if self.remote.down is not None:
            self.remote.bring_back()

    def corrupt_remote(self, blocks: set[bytes] | None = None) -> None:
        """Flip a byte of a block the remote server holds (one of ``blocks``), while the
        manager runs (a save of the block may write it again) or before one joins."""
        blocks = self.remote.durable if blocks is None else blocks
        if self.remote.down is None and blocks:
            block_hash = self.rng.choice(sorted(blocks))
            # the key is <prefix><namespace hex>:<block hash hex> (docs/tiers.md)
            key = f"{self.config.remote_prefix}{self.manager.namespace.hex()}:{block_hash.hex()}"
            self.remote.corrupt(key.encode(), block_hash, self.rng)

    def join(self) -> None:
        """Another server joins: a manager with an empty pool and disk, on the same remote
        tier, finds every prompt's blocks that reached it; the run goes on with it. Maybe
        one of them was corrupted there first, where the joining manager reads it."""
        self.close()
        if self.rng.random() < 0.5:
            led = {h for c in self.chains for h in c.hashes[: self.run(c, self.remote.durable)]}
            self.corrupt_remote(led)  # the joining manager's lookups get to it
        path = self.path / f"kv{self.disks}"
        self.disks += 1
        self.config = dataclasses.replace(self.config, kv_cache_dir=path)
        self.durable.clear()
        self.open()
        self.check_durable(self.chains)
        self.check_quiet()

    # ------------------------------------------------------------------ checks

    def corrupt(self, block_hash: bytes) -> None:
        """Flip the last payload byte of a durable record behind the closed store's back."""
        path = str(self.config.cache_path)
        env = lmdb.open(path, max_dbs=4, map_size=default_map_size(DISK_BYTES))
        key = BlockKey(self.manager.namespace, block_hash).to_bytes()  # the closed one's
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

    @staticmethod
    def run(chain: Chain, *tiers: set[bytes]) -> int:
        """How many of ``chain``'s leading blocks ``tiers`` hold: the run in the first,
        continued in the next (as a lookup continues the local run on the remote tier)."""
        run = 0
        for tier in tiers:
            while run < len(chain.hashes) and chain.hashes[run] in tier:
                run += 1
        return run

    def check_durable(self, chains: list[Chain] | None = None) -> None:
        """On a quiet manager, the durable leading blocks of a few prompts (or of ``chains``)
        are found and loaded: those on disk, then those the remote server holds while it is
        up, but for the blocks corrupted on disk (the lookup finds them there first)."""
        remote: set[bytes] = set()
        if self.remote is not None and self.remote.down is None:
            remote = self.remote.durable - self.corrupted
            self.remote.let_breakers_probe()  # open since a busy moment, or an outage
        for chain in chains or self.rng.sample(self.chains, 3):
            run = self.run(chain, self.durable, remote)
            if run == 0:
                continue
            self.settle_writes()
            request_id, matched = self.lookup(chain, 0)
            assert matched >= run, f"{request_id} matched {matched} blocks, {run} are durable"
            # a tenant that matters less may find the pool full of blocks it cannot evict
            served = run if self.config.tenant_priority(chain.salt) == 0 else 0
            self.load(request_id, chain, 0, matched, at_least=served)
            assert request_id in self.loading, "a quiet manager's engine has free blocks"
            self.settle_loads()
        self.settle_writes()

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
        if self.remote is not None and not self.remote.corrupted:
            assert stats["remote"]["corrupt"] == 0, "a value nobody touched failed verification"
