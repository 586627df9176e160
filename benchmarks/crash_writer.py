"""Crash rounds for the disk tier: a writer process SIGKILLed at random moments.

    python benchmarks/crash_writer.py serve

runs a small fork server: it reads one JSON job per line on stdin, forks a child per job
(torch is imported once, so a child starts in milliseconds instead of a second), prints
``pid <n>``, and ``exit <n> <status>`` once the child is gone. A child writes the blocks of
its job into the store (:func:`write_blocks`) and appends to the job's report file every
index up to which ``flush()`` has returned.

:func:`run_rounds` drives the server from another process: it kills each child after a
seeded random delay, reopens the store and checks it (:func:`check_store`). It is shared
by ``tests/test_lmdb_store.py`` and ``benchmarks/crash_stress.py``.

Block ``i`` has deterministic content. After ``put(i)``, when ``i % 5 == 4``, the writer
deletes block ``i - 2``, so flushed deletions are checked too.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from storage.base import BlockKey
from storage.lmdb_store import LmdbStore
from storage.record import Record, encode_record

NAMESPACE = hashlib.sha256(b"tiered-kv crash test").digest()
TOKENS_PER_BLOCK = 16
_CREATED_NS = 1_700_000_000_000_000_000
# Nothing is ever evicted: every round's store stays far below this.
CAPACITY_BYTES = 1 << 30


def block_key(index: int) -> BlockKey:
    return BlockKey(NAMESPACE, hashlib.sha256(index.to_bytes(8, "little")).digest())


def payload_size(index: int) -> int:
    """From half a page (stored inline in a leaf) to 24 KiB (a run of overflow pages)."""
    return 2048 if index % 7 == 0 else 1024 * (1 + index % 24)


def block_record(index: int) -> Record:
    size = payload_size(index)
    return Record(
        key=block_key(index),
        parent_hash=block_key(index - 1).block_hash if index else None,
        token_ids=tuple(index * TOKENS_PER_BLOCK + t for t in range(TOKENS_PER_BLOCK)),
        codec="raw",
        dtype=torch.uint8,
        shape=(size,),
        payload=random.Random(index).randbytes(size),
        created_ns=_CREATED_NS + index,
    )


def deleted_by(index: int) -> int | None:
    """The index whose put is followed by the deletion of ``index``, if any."""
    return index + 2 if index % 5 == 2 else None


def write_blocks(
    path: str, start: int, count: int, report: str, *, sync: bool, flush_every: int
) -> None:
    """Store blocks ``[start, start + count)``, report each flushed index, read as we go."""
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with LmdbStore(path, CAPACITY_BYTES, sync=sync, access_flush_interval=0.01) as store:
        for i in range(start, start + count):
            store.put(block_key(i), block_record(i))
            if i % 5 == 4:
                store.delete(block_key(i - 2))
            if i > start:
                store.get(block_key(i - 1))  # access times go to the meta db in batches
            if (i - start + 1) % flush_every == 0 or i == start + count - 1:
                store.flush()
                os.write(fd, b"%d\n" % i)
    os.close(fd)


@dataclasses.dataclass
class RoundResult:
    round: int
    sync: bool
    flush_every: int
    delay_s: float
    killed: bool  # False: the writer finished (or failed) before the kill
    exit_status: int
    written: int  # blocks of this round present after reopening
    flushed: int | None  # blocks of this round covered by a returned flush()
    entries: int
    check_s: float  # reopening and checking the whole store
    problems: list[str]


def check_store(path: str, rounds: list[tuple[int, int, int | None]]) -> tuple[int, int, list[str]]:
    """Reopen the store and check it; returns (entries, blocks of the last round, problems).

    ``rounds`` are the (start, count, last flushed index) of every round in this store.
    Every key must be one of ours and byte-identical to what was written; every block up to
    a round's last flushed index must be present, except that a flushed deletion must have
    happened.
    """
    problems: list[str] = []
    with LmdbStore(path, CAPACITY_BYTES, sync=False) as store:
        for key in store.keys():
            record = store.get(key)
            if record is None:
                problems.append(f"{key.short()} listed but unreadable")
                continue
            index = record.token_ids[0] // TOKENS_PER_BLOCK
            expected = block_record(index)
            if key != expected.key or encode_record(record, store.seal_key) != encode_record(expected, store.seal_key):
                problems.append(f"{key.short()} differs from block {index}")
        for start, count, flushed_upto in rounds:
            present = 0
            for i in range(start, start + count):
                found = store.contains(block_key(i))
                present += found
                if flushed_upto is None or i > flushed_upto:
                    continue
                gone_by = deleted_by(i)
                if gone_by is not None and gone_by <= flushed_upto and found:
                    problems.append(f"block {i} present after its deletion was flushed")
                if gone_by is None and not found:
                    problems.append(f"block {i} missing although flushed")
        stats = store.stats()
        if stats.corrupt:
            problems.append(f"{stats.corrupt} corrupt records")
        quarantined = sum(1 for _ in store.quarantined())
        if quarantined:
            problems.append(f"{quarantined} quarantined records")
        return stats.entries, present, problems


def run_rounds(
    workdir: Path,
    rounds: int,
    *,
    seed: int = 0,
    rounds_per_store: int = 10,
    max_delay_s: float = 0.3,
    count: int = 4000,
    on_round: Callable[[RoundResult], None] | None = None,
) -> list[RoundResult]:
    """Write, kill and check ``rounds`` times; a fresh store every ``rounds_per_store``."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    results = []
    history: list[tuple[int, int, int | None]] = []
    try:
        for r in range(rounds):
            store = workdir / f"store{r // rounds_per_store}"
            if r % rounds_per_store == 0:
                shutil.rmtree(workdir / f"store{r // rounds_per_store - 1}", ignore_errors=True)
                history = []
            report = workdir / f"round{r}.txt"
            start = r * count
            sync = rng.random() < 0.5
            flush_every = rng.choice((1, 4, 16))
            delay = rng.uniform(0.0, max_delay_s)
            job = dict(path=str(store), start=start, count=count, report=str(report),
                       sync=sync, flush_every=flush_every)
            server.stdin.write(json.dumps(job) + "\n")
            pid = int(_expect(server, "pid")[0])
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)  # a zombie until the server reaps it: never reused
            status = int(_expect(server, "exit")[1])
            lines = report.read_text().split() if report.exists() else []
            report.unlink(missing_ok=True)
            flushed = int(lines[-1]) if lines else None
            t0 = time.perf_counter()
            history.append((start, count, flushed))
            entries, written, problems = check_store(str(store), history)
            result = RoundResult(
                round=r, sync=sync, flush_every=flush_every, delay_s=round(delay, 4),
                killed=os.WIFSIGNALED(status), exit_status=status, written=written,
                flushed=None if flushed is None else flushed - start + 1,
                entries=entries, check_s=round(time.perf_counter() - t0, 4), problems=problems,
            )
            results.append(result)
            if on_round is not None:
                on_round(result)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    return results


def _expect(server: subprocess.Popen, word: str) -> list[str]:
    line = server.stdout.readline().split()
    if not line or line[0] != word:
        raise RuntimeError(f"crash writer server said {line!r}, expected {word!r}")
    return line[1:]


def serve() -> None:
    gc.freeze()  # children neither scan nor copy-on-write the objects imported here
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                write_blocks(**job)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


def main() -> None:
    if sys.argv[1:] != ["serve"]:
        sys.exit("usage: crash_writer.py serve")
    serve()


if __name__ == "__main__":
    main()
