"""One host allocation of exactly the size asked for, page-locked when CUDA is present.

Not torch's caching host allocator (``pin_memory=True``): it rounds an allocation up to a
power of two, so a 20 GiB pool would pin 32 GiB. Instead an ordinary allocation is
registered with ``cudaHostRegister``, which pins exactly its pages, and unregistered on
:meth:`PinnedSlab.close`, or when the slab is collected (a range left registered after its
memory is freed would make CUDA refuse to register that address again). Copies between a registered buffer and the GPU run as DMA
(``non_blocking=True`` copies are truly asynchronous), at the bus's full speed.

Pinned pages stay resident, so a slab larger than the host memory available is refused
(``ValueError``) before anything is allocated: pinning it would fail, or wake the OOM killer.
"""
from __future__ import annotations

import weakref
from pathlib import Path

import torch

_GiB = 1 << 30


class PinnedSlab:
    """``num_rows`` rows of ``row_nbytes`` bytes in one allocation: :attr:`tensor` is
    ``[num_rows, row_nbytes]`` uint8. ``pin``: register it with CUDA (default: when CUDA
    is available)."""

    def __init__(self, num_rows: int, row_nbytes: int, *, pin: bool | None = None) -> None:
        if num_rows <= 0 or row_nbytes <= 0:
            raise ValueError(f"need positive num_rows and row_nbytes, got {num_rows}, {row_nbytes}")
        self.pinned = torch.cuda.is_available() if pin is None else pin
        available = available_host_bytes() if self.pinned else None
        if available is not None and num_rows * row_nbytes > available:
            raise ValueError(
                f"cannot pin {num_rows * row_nbytes / _GiB:.2f} GiB of host memory: "
                f"{available / _GiB:.2f} GiB is available"
            )
        self.tensor = torch.empty((num_rows, row_nbytes), dtype=torch.uint8)  # [rows, bytes]
        self._unpin = None
        if self.pinned:
            _check(
                torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0),
                "cudaHostRegister",
            )
            # holds the tensor, so the memory outlives its registration
            self._unpin = weakref.finalize(self, _unregister, self.tensor)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """Unpin and drop the memory. Only once no copy can still read or write it."""
        if self.tensor is None:
            return
        if self._unpin is not None:
            self._unpin()
        self.tensor = None


def available_host_bytes() -> int | None:
    """Host memory that can be made resident now: ``MemAvailable``, and within a cgroup (v2)
    with a limit, no more than the limit less its working set (usage less inactive page
    cache, which the kernel reclaims). ``None`` where ``/proc/meminfo`` cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # "123 kB"
    except (OSError, KeyError, ValueError):
        return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            working_set = used - int(stat.get("inactive_file", 0))
            available = min(available, int(limit) - working_set)
    except (OSError, ValueError):
        pass  # no cgroup v2 limit here
    return max(available, 0)


def _unregister(tensor: torch.Tensor) -> None:
    _check(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()), "cudaHostUnregister")


def _check(status: object, call: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA error {code}")
