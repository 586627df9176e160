"""glibc's ``malloc`` tuned for the tiers' buffers: keep freed memory for reuse.

The disk tier allocates and frees a buffer of a block's size per record, twice: the sealed
record (``storage.record.encode_record_buffer``) and LMDB's dirty overflow pages, which it
``malloc``s per value (``writemap`` is off, docs/disk_tier.md) and frees at each commit.
glibc serves chunks of 128 KiB and more with ``mmap``, or trims them off the heap after a
commit frees a batch, so every record of 0.25–2 MiB faults fresh pages in (and the kernel
zeroes them), twice: the LMDB writer spent more time in page faults than in copying.

:func:`keep_freed_memory` serves chunks up to :data:`MMAP_THRESHOLD` from malloc's heaps
and lets each keep :data:`TRIM_THRESHOLD` free before it gives pages back. The setting is
the process's, so the tiers' entry points apply it (``tiered-kv serve``, ``build_llm``),
never the stores. The process keeps memory it used at its peak instead of returning it;
it never uses more. A glibc setting in the environment (``GLIBC_TUNABLES`` or the
``MALLOC_*_`` variables) is left to stand.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # the largest glibc takes on 64-bit platforms
TRIM_THRESHOLD = 256 << 20  # above the disk writer's batch (64 MiB) and its pending records
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_ENVIRONMENT = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the tuning once per process; whether it is in force (``False`` off glibc, or
    when the environment tunes malloc itself)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if any(name in os.environ for name in _ENVIRONMENT):
        logger.debug("malloc is tuned by the environment; left as it is")
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.warning("mallopt refused the tiers' heap settings; records fault in fresh pages")
        return False
    logger.debug("malloc: chunks up to %d MiB from the heap, %d MiB kept free before trimming",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True


def _mallopt():
    """glibc's ``mallopt``, or None on another C library."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only (musl's mallopt does nothing): else AttributeError
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
