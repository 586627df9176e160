"""A model-based fuzz of the disk tier: hypothesis draws sequences of calls on a real
:class:`~storage.lmdb_store.LmdbStore` (puts of overlapping keys of chained blocks, with
sizes, priorities and parents, reads, lookups, deletes, flushes, reopenings with another
budget, records damaged in ``data.mdb``, verify, bursts of writes under concurrent
readers) and checks each answer against :class:`lmdb_store_model.StoreModel`; after every
reopening the files themselves.

Two budgets: one that evicts on nearly every put, in a map that never fills (every answer
is known exactly), and one in a 1 MiB map that fills on nearly every commit (the writer
evicts at moments of its own: what is served must still be exactly what was last put, and
nothing may vanish unreported).
"""
from __future__ import annotations

import collections
import dataclasses
import random
import shutil
import tempfile
import threading
from pathlib import Path

import lmdb
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test,
)

from lmdb_store_model import NAMESPACES, Blocks, StoreModel, block_key, damage_record
from storage.base import BlockKey
from storage.lmdb_layout import (
    DB_INFO, DB_META, DB_NAMES, DB_QUARANTINE, DB_RECORDS, INFO_BYTES_USED, U64,
)
from storage.lmdb_meta import unpack_meta
from storage.lmdb_store import LmdbStore
from storage.record import RecordError, decode_record, encode_record
from storage.record_batch import RecordBatch

BLOCKS = 12
INDEX = {block_key(k): k for k in range(BLOCKS)}
MiB = 1 << 20
COUNTERS = ("hits", "misses", "puts", "evictions", "corrupt", "dropped", "bytes_read")


@dataclasses.dataclass(frozen=True)
class Budget:
    capacities: tuple[int, ...]  # the first opens the store; a reopening picks any
    sizes: tuple[int, ...]  # payload sizes a put draws from
    map_sizes: tuple[int | None, ...] = (None,)
    exact: bool = True


# Records from inline (a part of a page) to runs of overflow pages; the largest is refused.
EVICTING = Budget(
    capacities=(24_000, 16_000, 40_000), sizes=(200, 1_500, 3_000, 6_000, 12_000, 30_000),
)
MAP_FULL = Budget(
    capacities=(4 * MiB,), sizes=(2_000, 30_000, 120_000, 250_000, 400_000, 600_000),
    map_sizes=(MiB, 2 * MiB), exact=False,
)

blocks_ = st.integers(0, BLOCKS - 1)
sizes_ = st.integers(0, 5)  # an index into Budget.sizes
priorities_ = st.sampled_from([-1, 0, 0, 3])


def read_files(
    path: Path,
) -> tuple[dict[int, tuple[bytes, tuple[int, int, int, bytes | None]]], set[int]]:
    """A closed store's records (block -> its bytes and its meta: last access, size,
    priority, parent hash) and the blocks in its quarantine, read straight from the file.
    The records, the meta db and the byte count in the info db must agree."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    try:
        dbs = {name: env.open_db(name, create=False) for name in DB_NAMES}
        with env.begin() as txn:
            records = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs[DB_RECORDS])}
            meta = {bytes(k): unpack_meta(v) for k, v in txn.cursor(db=dbs[DB_META])}
            bad = txn.cursor(db=dbs[DB_QUARANTINE]).iternext(values=False)
            quarantine = {INDEX[BlockKey.from_bytes(k)] for k in bad}
            used = U64.unpack(txn.get(INFO_BYTES_USED, db=dbs[DB_INFO]) or bytes(8))[0]
    finally:
        env.close()
    assert records.keys() == meta.keys(), "records and meta hold other keys"
    assert used == sum(map(len, records.values())), "info's bytes_used drifted"
    stored = {}
    for kb, data in records.items():
        m = meta[kb]
        assert m.nbytes == len(data), "meta's size is not the record's"
        stored[INDEX[BlockKey.from_bytes(kb)]] = (
            data, (m.last_access_ns, m.nbytes, m.priority, m.parent_hash)
        )
    return stored, quarantine


class StoreMachine(RuleBasedStateMachine):
    budget = EVICTING

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="lmdb-model-"))
        self.path = self.tmp / "store"
        self.blocks = Blocks()
        self.events: collections.deque[tuple[int, int]] = collections.deque()  # (thread, block)
        self.me = threading.get_ident()
        self.quarantined: set[int] = set()  # every key the store found bad
        self.reported: set[int] = set()  # keys gone with an on_evict since their last put
        self.store = self.open(self.budget.capacities[0], self.budget.map_sizes[0])
        self.model = StoreModel(
            self.budget.capacities[0], self.store.max_record_bytes, exact=self.budget.exact
        )

    def open(self, capacity: int, map_size: int | None) -> LmdbStore:
        self.dropped = 0  # as of the last flush
        return LmdbStore(
            self.path, capacity, map_size=map_size, sync=False, max_batch_items=3,
            max_pending_bytes=64_000, access_flush_interval=3600,
            on_evict=lambda key: self.events.append((threading.get_ident(), INDEX[key])),
        )

    def drain(self) -> tuple[list[int], list[int]]:
        """on_evict calls since the last drain: on this thread, and on others."""
        events = [self.events.popleft() for _ in range(len(self.events))]
        self.reported.update(k for _, k in events)
        return [k for t, k in events if t == self.me], [k for t, k in events if t != self.me]

    def expect_no_other_events(self) -> None:
        mine, others = self.drain()
        assert not mine, f"blocks {mine} left the store unasked"
        if self.model.exact:
            assert not others, f"blocks {others} left the store on another thread"

    # ------------------------------------------------------------------ puts

    @rule(k=blocks_, size=sizes_, priority=priorities_)
    def put(self, k: int, size: int, priority: int) -> None:
        gen = self.blocks.new(k, self.budget.sizes[size])
        ok = self.store.put(block_key(k), self.blocks.record(gen), priority=priority)
        self.check_puts([(k, size, priority)], [gen], [ok])

    @rule(items=st.lists(st.tuples(blocks_, sizes_, priorities_), min_size=2, max_size=5))
    def put_many(self, items) -> None:
        gens = [self.blocks.new(k, self.budget.sizes[s]) for k, s, _ in items]
        records = [self.blocks.record(g) for g in gens]
        priorities = [p for _, _, p in items]
        results = self.store.put_many([(r.key, r) for r in records], priorities=priorities)
        self.check_puts(items, gens, results)

    @rule(ks=st.lists(blocks_, min_size=1, max_size=5), size=sizes_, priority=priorities_)
    def put_batch(self, ks: list[int], size: int, priority: int) -> None:
        """A RecordBatch, as the CPU pool's writer hands the disk tier its blocks."""
        gens = [self.blocks.new(k, self.budget.sizes[size]) for k in ks]
        records = [self.blocks.record(g) for g in gens]
        batch = RecordBatch(
            "raw", records[0].dtype, records[0].shape, [r.key for r in records],
            [r.parent_hash for r in records], [r.token_ids for r in records],
            [r.payload for r in records],
        )
        batch.created_ns = [r.created_ns for r in records]
        results = self.store.put_many(batch, priorities=[priority] * len(ks))
        self.check_puts([(k, size, priority) for k in ks], gens, results)

    def check_puts(self, items, gens, results) -> None:
        """The answers of puts of ``items`` (block, size, priority) as versions ``gens``,
        and what they evicted, against the model."""
        evicted, others = self.drain()
        assert not others or not self.model.exact, f"blocks {others} left on another thread"
        model, chosen, seen = self.model, [], list(evicted)
        for (k, _, priority), gen, ok in zip(items, gens, results):
            nbytes = self.blocks.nbytes(gen)
            if nbytes > model.max_record_bytes:
                assert not ok, f"{nbytes} bytes taken, max {model.max_record_bytes}"
            if not model.exact:
                if ok:
                    model.put(k, gen, nbytes, priority, self.blocks.parent(gen))
                    self.reported.discard(k)
                continue
            expected = model.admits(k, nbytes, priority)
            assert ok == expected, f"block {k}, {nbytes} B at {priority}: {ok}"
            if ok:
                chosen += model.accept(k, gen, nbytes, priority, self.blocks.parent(gen), seen)
                self.reported.discard(k)
            else:
                model.refuse()
        if model.exact and model.order_known:
            assert evicted == chosen, f"evicted {evicted}, the model evicts {chosen}"
        elif model.exact:
            assert not seen, f"blocks {seen} evicted beyond the budget"
        else:  # a victim put again in the same call may be back
            batch = {k for k, _, _ in items}
            self.reported.update(evicted + others)  # perhaps of a version this call put
            for k in evicted:
                if k not in batch:
                    model.remove(k)

    # ------------------------------------------------------------------ reads

    @rule(ks=st.lists(blocks_, min_size=1, max_size=4), zero_copy=st.booleans())
    def get_many(self, ks: list[int], zero_copy: bool) -> None:
        keys = [block_key(k) for k in ks]
        if zero_copy:
            with self.store.reading(keys) as records:
                got = [None if r is None else self.blocks.gen_of(k, r) for k, r in zip(ks, records)]
        elif len(ks) == 1:
            record = self.store.get(keys[0])
            got = [None if record is None else self.blocks.gen_of(ks[0], record)]
        else:
            records = self.store.get_many(keys)
            got = [None if r is None else self.blocks.gen_of(k, r) for k, r in zip(ks, records)]
        quarantined, others = self.drain()
        self.quarantined.update(quarantined)
        if self.model.exact:
            entries = self.model.entries
            poisoned = list(dict.fromkeys(k for k in ks if k in entries and entries[k].poisoned))
            assert got == self.model.read(ks), f"get_many({ks}) = {got}"
            assert quarantined == poisoned and not others
            return
        for k, gen in zip(ks, got):
            self.seen(k, gen is not None)
            last = self.model.entries[k].gen if gen is not None else None
            assert gen == last, f"block {k}: v{gen} served, v{last} last put"

    def seen(self, k: int, present: bool) -> None:
        """What a lookup found, where the writer may evict at any moment: a key present
        must be one the model has, and one seen gone stays gone until put again."""
        if present:
            assert k in self.model.entries, f"block {k} came back"
        else:
            self.model.remove(k)

    @rule(ks=st.lists(blocks_, min_size=1, max_size=6))
    def lookups(self, ks: list[int]) -> None:
        keys = [block_key(k) for k in ks]
        present = self.store.contains_many(keys)
        prefix = self.store.longest_prefix(keys)
        one = self.store.contains(keys[0])
        if self.model.exact:
            assert present == [k in self.model.entries for k in ks]
            assert prefix == (present + [False]).index(False) and one == present[0]
        else:
            for k, p in zip(ks, present):
                self.seen(k, p)
        self.expect_no_other_events()

    @rule(namespace=st.sampled_from([None, *NAMESPACES]))
    def keys(self, namespace: bytes | None) -> None:
        listed = [INDEX[k] for k in self.store.keys(namespace)]
        assert len(listed) == len(set(listed)), "keys() listed a key twice"
        mine = {k for k in self.model.entries if namespace in (None, block_key(k).namespace)}
        if self.model.exact:
            assert set(listed) == mine
        else:
            for k in mine | set(listed):
                self.seen(k, k in listed)
        self.expect_no_other_events()

    @precondition(lambda self: self.model.exact)  # small records: no wait for the writer
    @rule(ks=st.lists(blocks_, min_size=1, max_size=3), size=st.integers(0, 2),
          priority=priorities_, reads=st.lists(blocks_, max_size=3))
    def reads_before_the_commit(self, ks: list[int], size: int, priority: int, reads) -> None:
        """Puts the writer is held from committing, and reads of them and of others."""
        assert self.store.flush(timeout=30)
        release = threading.Event()
        write_txn = self.store._write_txn

        def held(*args, **kwargs):
            release.wait(10)
            return write_txn(*args, **kwargs)

        self.store._write_txn = held
        try:
            self.put_batch(ks, size, priority)
            self.get_many([*reads, ks[0]], zero_copy=False)
        finally:
            release.set()
            del self.store._write_txn

    # ------------------------------------------------------------------ deletes

    @rule(ks=st.lists(blocks_, min_size=1, max_size=4))
    def delete_many(self, ks: list[int]) -> None:
        keys = [block_key(k) for k in ks]
        removed = self.store.delete(keys[0]) if len(ks) == 1 else self.store.delete_many(keys)
        if self.model.exact:
            assert removed == self.model.delete(ks)
        else:
            assert removed <= len(set(ks) & self.model.entries.keys())
            self.model.delete(ks)
        self.expect_no_other_events()

    # ------------------------------------------------------------------ durability

    @rule()
    def flush(self) -> None:
        ok = self.store.flush(timeout=30)
        dropped = self.store.stats().dropped  # what the writer gave up on counts here too
        assert ok or (not self.model.exact and dropped > self.dropped), "flush failed"
        self.dropped = dropped

    @rule(capacity=st.integers(0, 2), map_size=st.integers(0, 1))
    def reopen(self, capacity: int, map_size: int) -> None:
        """Close, check the files, open again, perhaps with another budget or map."""
        self.store.close()
        capacity = self.budget.capacities[capacity % len(self.budget.capacities)]
        map_size = self.budget.map_sizes[map_size % len(self.budget.map_sizes)]
        metadata = self.check_files()
        self.store = self.open(capacity, map_size)
        evicted, others = self.drain()
        assert not others
        if self.model.exact:
            expected = self.model.reopen(capacity, self.store.max_record_bytes, metadata)
            assert evicted == expected, f"the open evicted {evicted}, the model {expected}"
        else:
            self.model.capacity, self.model.max_record_bytes = capacity, self.store.max_record_bytes
            for k in evicted:
                self.model.remove(k)

    def check_files(self) -> dict[int, tuple[int, int, int, bytes | None]]:
        """A closed store's files against the model; its metadata (block -> last access,
        size, priority, parent hash)."""
        self.expect_no_other_events()  # what the writer evicted while closing
        stored, quarantine = read_files(self.path)
        model = self.model
        if model.exact:
            assert stored.keys() == model.entries.keys(), "the files hold other keys"
            # a read's quarantine is given up if the key is put again before it commits
            assert quarantine <= self.quarantined, "the quarantine holds keys never found bad"
        for k in model.entries.keys() - stored.keys():  # the writer evicted it
            assert k in self.reported, f"block {k} was lost without an on_evict"
            model.remove(k)
        for k, (data, _) in stored.items():
            entry = model.entries.get(k)
            assert entry is not None, f"block {k} is on disk, but it was deleted or evicted"
            try:
                decode_record(data, self.store.seal_key, block_key(k))
                want = encode_record(self.blocks.record(entry.gen), self.store.seal_key)
                assert data == want, f"block {k} is stale"
            except RecordError:
                assert entry.poisoned, f"block {k} was stored damaged"
        return {k: meta for k, (_, meta) in stored.items()}

    # ------------------------------------------------------------------ damage

    @rule(i=blocks_)
    def damage(self, i: int) -> None:
        """Flip a byte of a committed record in data.mdb behind the store's back: of the
        ``i``-th one the model has, in block order."""
        sound = sorted(k for k, e in self.model.entries.items() if not e.poisoned)
        if not sound:
            return
        k = sound[i % len(sound)]
        entry = self.model.entries[k]
        assert self.store.flush(timeout=30) or not self.model.exact
        stored = encode_record(self.blocks.record(entry.gen), self.store.seal_key)
        copies = damage_record(self.path, stored)
        if self.model.exact:
            assert copies, f"block {k} is not in data.mdb after a flush"
        entry.poisoned = True

    @precondition(lambda self: self.model.exact)
    @rule()
    def verify(self) -> None:
        assert self.store.flush(timeout=30)
        damaged = [k for k, e in self.model.entries.items() if e.poisoned]
        poisoned = sorted(damaged, key=lambda k: block_key(k).to_bytes())  # verify's order
        result = self.store.verify()
        quarantined, others = self.drain()
        assert not others and quarantined == poisoned, f"{quarantined} quarantined, {poisoned} bad"
        checked = (len(self.model.entries), len(poisoned), len(poisoned))
        assert (result.checked, result.corrupt, result.quarantined) == checked
        for k in poisoned:
            self.model.remove(k)
        self.model.counts["corrupt"] += len(poisoned)
        self.quarantined.update(poisoned)

    # ------------------------------------------------------------------ concurrent readers

    @precondition(lambda self: self.model.exact)
    @rule(ops=st.lists(st.tuples(blocks_, sizes_, priorities_, st.booleans()), max_size=12))
    def writes_under_readers(self, ops) -> None:
        """Puts and deletes while two threads read. A read returns the version of the last
        write to its key that completed before the read began, or a later one, or a miss
        (the key may have been evicted since); never an older version. The readers' hits
        move keys in the access order: the model learns it again from a reopening."""
        floors: dict[int, int] = {}  # block -> the oldest version a read may return
        problems: list[str] = []
        stop = threading.Event()
        damaged = {k for k, e in self.model.entries.items() if e.poisoned}  # reads quarantine

        def read(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    ks = [k for k in rng.sample(range(BLOCKS), 3) if k not in damaged]
                    oldest = [floors.get(k, 0) for k in ks]
                    records = self.store.get_many([block_key(k) for k in ks])
                    for k, floor, r in zip(ks, oldest, records):
                        if r is not None and self.blocks.gen_of(k, r) < floor:
                            problems.append(f"block {k}: v{r.token_ids[0]} read after v{floor}")
                    listed = list(self.store.keys())
                    if len(listed) != len(set(listed)):
                        problems.append(f"keys() listed a key twice: {listed}")
                    if self.store.stats().bytes_used > self.model.capacity:
                        problems.append("the budget was exceeded")
            except Exception as e:  # noqa: BLE001 (reported below, with the others)
                problems.append(f"a reader failed: {e!r}")

        self.model.order_known = False
        readers = [threading.Thread(target=read, args=(seed,)) for seed in range(2)]
        for t in readers:
            t.start()
        try:
            for k, s, priority, is_put in ops:
                if not is_put:
                    self.store.delete(block_key(k))
                    self.model.delete([k])
                    floors[k] = self.blocks.next_gen
                    continue
                before = set(self.model.entries)
                self.put(k, s, priority)
                floors.update({v: self.blocks.next_gen for v in before - self.model.entries.keys()})
                if k in self.model.entries:
                    floors[k] = self.model.entries[k].gen
        finally:
            stop.set()
            for t in readers:
                t.join()
        assert not problems, problems[:5]
        self.reopen(0, 0)  # the order and counters the readers changed, from the store

    # ------------------------------------------------------------------ invariants

    @invariant()
    def stats_agree(self) -> None:
        stats = self.store.stats()
        assert stats.bytes_used <= stats.capacity_bytes == self.model.capacity
        if not self.model.exact:
            assert stats.entries <= len(self.model.entries)
            return
        assert (stats.entries, stats.bytes_used) == (len(self.model.entries), self.model.used)
        counted = {name: getattr(stats, name) for name in COUNTERS}
        expected = {name: self.model.counts[name] for name in COUNTERS}
        assert counted == expected, f"stats {counted}, the model's {expected}"

    @invariant()
    def children_agree(self) -> None:
        """The store knows which records have a child here, as its eviction order needs:
        whatever removed a record (an eviction, a delete, a quarantine) counted it gone."""
        if not self.model.exact:
            return
        with self.store._lock:
            index = self.store._index
            found = {k for k in self.model.entries if index.has_child(block_key(k).to_bytes())}
        assert found == {k for k in self.model.entries if self.model.has_child(k)}, "children"

    def teardown(self) -> None:
        try:
            if self.store._closing:
                return  # a reopening failed: its error is the one to see
            if self.model.exact:
                self.verify()
                again = self.store.verify()
                assert again.corrupt == 0 and again.ok == again.checked == len(self.model.entries)
            self.store.close()
            self.check_files()
        finally:
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


class MapFullMachine(StoreMachine):
    budget = MAP_FULL


RUN = settings(
    max_examples=100, stateful_step_count=50, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_against_the_model_with_constant_eviction() -> None:
    run_state_machine_as_test(StoreMachine, settings=RUN)


def test_against_the_model_in_a_map_that_fills_up() -> None:
    run_state_machine_as_test(MapFullMachine, settings=RUN)
