"""The block-store contract every KV tier implements.

A *block store* maps a :class:`BlockKey` (namespace digest + chained block hash) to the
bytes of one KV block. Tiers differ in what they hold: the pinned CPU pool holds raw
tensors (:class:`storage.cpu_slots.HostBlock`), the disk and remote tiers hold checksummed
:class:`storage.record.Record` s. The contract is the same for all of them.

Thread safety
    Every method may be called from any thread at any time, concurrently, except that no
    method may be called after :meth:`BlockStore.close` has returned.

Visibility
    A value passed to :meth:`BlockStore.put` is visible to :meth:`BlockStore.get` on every
    thread as soon as ``put`` returns (read-your-writes), even when the store persists it
    later on a background thread. :meth:`BlockStore.flush` returns once everything put
    before the call is durable in the tier (committed to disk, acknowledged by the server).
    A value may disappear at any time afterwards through eviction by the store's policy.

Returned buffers
    A value returned by ``get`` is owned by the caller: it never aliases memory that the
    store will reuse, so it stays valid (and unchanged) for as long as the caller keeps it.
    Stores that can do better than a copy offer tier-specific zero-copy methods with their
    own, documented lifetimes (e.g. :meth:`storage.cpu_pool.CpuBlockPool.acquire`).

Misses
    ``get`` returns ``None`` for a key that is absent *or* whose stored bytes fail
    verification; a store never raises because of what it read back.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

DIGEST_SIZE = 32  # SHA-256
KEY_SIZE = 2 * DIGEST_SIZE

V = TypeVar("V")


class BlockKey(NamedTuple):
    """Where a KV block lives: the namespace digest and the block's chained hash."""

    namespace: bytes
    block_hash: bytes

    def to_bytes(self) -> bytes:
        return self.namespace + self.block_hash

    @classmethod
    def from_bytes(cls, raw: bytes) -> BlockKey:
        if len(raw) != KEY_SIZE:
            raise ValueError(f"a block key is {KEY_SIZE} bytes, got {len(raw)}")
        raw = bytes(raw)
        return cls(raw[:DIGEST_SIZE], raw[DIGEST_SIZE:])

    def validate(self) -> BlockKey:
        if len(self.namespace) != DIGEST_SIZE or len(self.block_hash) != DIGEST_SIZE:
            raise ValueError(
                f"a block key is two {DIGEST_SIZE}-byte digests, got "
                f"{len(self.namespace)} + {len(self.block_hash)} bytes"
            )
        return self

    def short(self) -> str:
        return f"{self.namespace.hex()[:8]}/{self.block_hash.hex()[:12]}"


_new_key = functools.partial(tuple.__new__, BlockKey)  # a BlockKey of a (namespace, hash) pair


def block_keys(namespace: bytes, block_hashes: Iterable[bytes]) -> list[BlockKey]:
    """The key of each of ``block_hashes`` under ``namespace`` (unchecked), built without a
    Python call each (a save makes one a block on the engine's thread)."""
    return list(map(_new_key, zip(itertools.repeat(namespace), block_hashes)))


def check_keys(keys: Sequence[BlockKey]) -> None:
    """:meth:`BlockKey.validate` of each of ``keys`` (at once while all are valid)."""
    if set(map(len, itertools.chain.from_iterable(keys))) - {DIGEST_SIZE}:
        for key in keys:
            key.validate()


@dataclasses.dataclass
class StoreStats:
    """Counters and occupancy of one store. Counters only ever grow."""

    tier: str
    entries: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    corrupt: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


class StoreError(Exception):
    """A store cannot be opened or used as asked (not a store, newer format, read-only...)."""


class BlockStore(abc.ABC, Generic[V]):
    """A tier of KV blocks. See the module docstring for the thread-safety contract."""

    tier: str = "store"

    @abc.abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is present (without verifying its bytes or touching LRU order)."""

    @abc.abstractmethod
    def get(self, key: BlockKey) -> V | None:
        """The value for ``key`` (caller-owned), or ``None`` on a miss or a corrupt record."""

    @abc.abstractmethod
    def put(self, key: BlockKey, value: V) -> bool:
        """Store ``value`` under ``key``; ``False`` if the store refused it (too large)."""

    @abc.abstractmethod
    def delete(self, key: BlockKey) -> bool:
        """Remove ``key``; ``True`` if it was present."""

    @abc.abstractmethod
    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        """Iterate over present keys, optionally of one namespace. Order is unspecified.

        Keys added or removed while iterating may or may not be seen; no key is seen twice.
        """

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the store's counters and occupancy."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is durable; ``False`` if ``timeout`` passed first,
        or if something put since the previous flush could not be made durable."""
        return True

    def close(self) -> None:
        """Flush and release resources. Idempotent."""

    # Batch forms. Stores with a cheaper batched path override these.

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[BlockKey]) -> list[V | None]:
        return [self.get(k) for k in keys]

    @contextlib.contextmanager
    def reading(self, keys: Sequence[BlockKey]) -> Iterator[list[V | None]]:
        """Like :meth:`get_many`, but the values are valid only inside the ``with`` block: a
        store may hand out views of its own memory (no copy) that go away when it ends."""
        yield self.get_many(keys)

    def put_many(self, items: Iterable[tuple[BlockKey, V]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.delete(k) for k in keys)

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are present: the first absent one ends the run."""
        for i, present in enumerate(self.contains_many(keys)):
            if not present:
                return i
        return len(keys)

    def __contains__(self, key: BlockKey) -> bool:
        return self.contains(key)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
