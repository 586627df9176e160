"""The disk tier's ``meta`` db values: a record's last access, size, creation, priority and
parent.

Store version 3 writes 64 bytes; version 2 wrote the first 32, without a parent, and
version 1 the first 24, without a priority either. All three are read: a missing priority
as 0 (the default), a missing parent as none known. The first open for writing of an
older store rewrites its values in the version-3 layout, each parent read from its
record's header (:mod:`storage.lmdb_layout`); a read-only open takes them as they are. A
record whose parent is not known is no record's child for the eviction order
(:mod:`storage.lmdb_eviction`)::

    0 u64 last access ns | 8 u64 encoded size | 16 u64 created ns | 24 i64 priority (v2)
    32 parent hash, 32 bytes, zeros for none known (v3)
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from storage.base import DIGEST_SIZE
from storage.priority_lru import DEFAULT_PRIORITY

META = struct.Struct(f"<QQQq{DIGEST_SIZE}s")  # last access ns, size, created ns, priority, parent
META_V2 = struct.Struct("<QQQq")  # store version 2: no parent
META_V1 = struct.Struct("<QQQ")  # store version 1: no priority
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # what the i64 field holds
NO_PARENT = bytes(DIGEST_SIZE)  # the parent field of a root, or of a record whose parent is unknown
_LAYOUT_SIZES = (META.size, META_V2.size, META_V1.size)
_DEFAULTS = META.pack(0, 0, 0, DEFAULT_PRIORITY, NO_PARENT)  # a field an older layout lacks
_META_ROW = np.dtype([  # META as a numpy record
    ("last_access_ns", "<u8"), ("nbytes", "<u8"), ("created_ns", "<u8"), ("priority", "<i8"),
    ("parent_hash", f"V{DIGEST_SIZE}"),
])


class MetaValue(NamedTuple):
    last_access_ns: int  # 0 when unknown (metadata rebuilt after a crash)
    nbytes: int
    created_ns: int
    priority: int
    parent_hash: bytes | None  # None for a root, or when not known (an older store version)


def pack_meta(
    last_access_ns: int, nbytes: int, created_ns: int, priority: int, parent_hash: bytes | None,
) -> bytes:
    return META.pack(last_access_ns, nbytes, created_ns, priority, parent_hash or NO_PARENT)


def unpack_meta(value: bytes | memoryview) -> MetaValue | None:
    """A value of any store version's layout; ``None`` for one of any other size (not ours)."""
    if len(value) == META.size:
        *fields, parent = META.unpack(value)
        return MetaValue(*fields, None if parent == NO_PARENT else parent)
    if len(value) == META_V2.size:
        return MetaValue(*META_V2.unpack(value), None)
    if len(value) == META_V1.size:
        return MetaValue(*META_V1.unpack(value), DEFAULT_PRIORITY, None)
    return None


class MetaColumns(NamedTuple):
    """Many values' fields, in the values' order: numpy arrays ([n] uint64, the priority
    int64) and a list of parent hashes."""

    last_access_ns: np.ndarray
    nbytes: np.ndarray
    created_ns: np.ndarray
    priority: np.ndarray
    parent_hash: list[bytes | None]


def unpack_columns(values: Sequence[bytes]) -> MetaColumns | int:
    """:func:`unpack_meta` of each of ``values``, as columns, read at once (an open reads
    every value of the store); or the size of the first value not ours."""
    sizes = set(map(len, values))
    if not sizes <= set(_LAYOUT_SIZES):
        return next(len(value) for value in values if len(value) not in _LAYOUT_SIZES)
    if sizes != {META.size}:  # older layouts: the fields they lack as unpack_meta reads them
        values = [value + _DEFAULTS[len(value) :] for value in values]
    joined = b"".join(values)
    table = np.frombuffer(joined, dtype=_META_ROW)
    parents = [joined[at : at + DIGEST_SIZE] for at in range(META_V2.size, len(joined), META.size)]
    return MetaColumns(
        table["last_access_ns"], table["nbytes"], table["created_ns"], table["priority"],
        [None if parent == NO_PARENT else parent for parent in parents],
    )


def meta_size(value: bytes | None) -> int:
    """The encoded size a meta value records; 0 for none (or a value not ours)."""
    meta = unpack_meta(value) if value is not None else None
    return meta.nbytes if meta is not None else 0


def check_priority(priority: object) -> int:
    """``priority`` if the ``meta`` db can hold it; ``ValueError`` otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"a priority must be an integer, got {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"a priority must fit in 64 bits (signed), got {priority}")
    return priority


def check_priorities(priorities: list[object]) -> None:
    """:func:`check_priority` of each of ``priorities`` (at once while they are all plain
    integers in range)."""
    if set(map(type, priorities)) <= {int} and (
        not priorities or PRIORITY_MIN <= min(priorities) and max(priorities) <= PRIORITY_MAX
    ):
        return
    for priority in priorities:
        check_priority(priority)
