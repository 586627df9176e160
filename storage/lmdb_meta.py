"""The disk tier's ``meta`` db values: a record's last access, size, creation and priority.

Store version 2 writes 32 bytes; version 1 wrote the first 24, without a priority. Both are
read, a version-1 value as priority 0 (the default), so a store of either version opens
as it is; a version-1 value becomes a version-2 one when its record is put or accessed
again::

    0 u64 last access ns | 8 u64 encoded size | 16 u64 created ns | 24 i64 priority (v2)
"""
from __future__ import annotations

import struct
from typing import NamedTuple

from storage.priority_lru import DEFAULT_PRIORITY

META = struct.Struct("<QQQq")  # last access ns, encoded size, created ns, priority
META_V1 = struct.Struct("<QQQ")  # store version 1: no priority
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # what the i64 field holds


class MetaValue(NamedTuple):
    last_access_ns: int  # 0 when unknown (metadata rebuilt after a crash)
    nbytes: int
    created_ns: int
    priority: int


def pack_meta(last_access_ns: int, nbytes: int, created_ns: int, priority: int) -> bytes:
    return META.pack(last_access_ns, nbytes, created_ns, priority)


def unpack_meta(value: bytes | memoryview) -> MetaValue | None:
    """A value of either layout; ``None`` for one of any other size (not ours)."""
    if len(value) == META.size:
        return MetaValue(*META.unpack(value))
    if len(value) == META_V1.size:
        return MetaValue(*META_V1.unpack(value), DEFAULT_PRIORITY)
    return None


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
