from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch
import zstandard

from memory_testing import traced_peak
from storage.base import BlockKey
from storage.record import SEAL_SIZE, Record, encode_record
from storage.seal import SealKey
from tiered_kv.archive import (
    FLAG_ZSTD, MAGIC, MAX_RECORD_BYTES, VERSION, ArchiveError, ArchiveWriter, check_archive, read_archive,
    read_key_id,
)

KEY = SealKey(b"the exporting store's secret, 32 bytes+")


def item(i: int) -> tuple[BlockKey, bytes]:
    key = BlockKey(hashlib.sha256(b"ns").digest(), hashlib.sha256(bytes([i])).digest())
    payload = bytes([i]) * (100 + i)
    return key, encode_record(
        Record(key, None, tuple(range(16)), "raw", torch.uint8, (len(payload),), payload, 1), KEY
    )


ITEMS = [item(i) for i in range(20)]


def write(path: Path, items=ITEMS, compress: bool = False) -> Path:
    with open(path, "wb") as f:
        writer = ArchiveWriter(f, KEY.key_id, compress=compress)
        for key, data in items:
            writer.add(key, data)
        writer.finish()
    return path


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(tmp_path: Path, compress: bool):
    path = write(tmp_path / "a", compress=compress)
    assert list(read_archive(path)) == ITEMS
    assert check_archive(path) == (20, sum(len(d) for _, d in ITEMS), KEY.key_id)
    assert read_key_id(path) == KEY.key_id


def test_empty_archive(tmp_path: Path):
    assert check_archive(write(tmp_path / "a", [])) == (0, 0, KEY.key_id)


def test_progress_counts_file_bytes(tmp_path: Path):
    path = write(tmp_path / "a", compress=True)
    seen = []
    check_archive(path, seen.append)
    assert sum(seen) == path.stat().st_size


@pytest.mark.parametrize("compress", [False, True])
def test_every_truncation_is_detected(tmp_path: Path, compress: bool):
    data = write(tmp_path / "a", ITEMS[:3], compress).read_bytes()
    cut = tmp_path / "cut"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(ArchiveError):
            check_archive(cut)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: b"NOTARCHV" + d[8:], "bad magic"),
        (lambda d: d[:8] + b"\x03\x00" + d[10:], "archive version 3"),
        (lambda d: d[:8] + b"\x01\x00" + d[10:], "no key sealed"),  # the unsealed format
        (lambda d: d[:12] + bytes(8) + d[20:], "checksum mismatch"),  # the key id
        (lambda d: d[:10] + b"\x04\x00" + d[12:], "unknown archive flags"),
        (lambda d: d[:-21] + bytes([d[-21] ^ 1]) + d[-20:], "checksum mismatch"),  # a record's
        (lambda d: d + b"\x00", "bytes after the end"),
    ],
)
def test_damage_is_detected(tmp_path: Path, damage, message):
    path = write(tmp_path / "a")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ArchiveError, match=message):
        check_archive(path)


def test_refuses_an_empty_record(tmp_path: Path):
    with open(tmp_path / "a", "wb") as f, pytest.raises(ValueError):
        ArchiveWriter(f, KEY.key_id).add(ITEMS[0][0], b"")


@pytest.mark.parametrize("declared", ["zeros", "another length"])
def test_a_forged_record_length_is_refused_before_it_is_read(tmp_path: Path, declared: str):
    length = 256 << 20  # 256 MiB of zeros: about 8 KiB of zstd
    key, record = ITEMS[0]
    with open(tmp_path / "bomb", "wb") as f:
        f.write(struct.pack("<8sHH", MAGIC, VERSION, FLAG_ZSTD) + KEY.key_id)
        body = zstandard.ZstdCompressor().stream_writer(f, closefd=False)
        body.write(struct.pack("<I", length) + key.to_bytes())
        body.write(record if declared == "another length" else b"")
        for _ in range(length // (16 << 20)):
            body.write(bytes(16 << 20))
        body.close()
    def check() -> None:
        with pytest.raises(ArchiveError, match="not a record of 268435456 bytes"):
            check_archive(tmp_path / "bomb")

    _, peak = traced_peak(check)
    assert peak < 8 << 20


@pytest.mark.parametrize("compress", [False, True])
def test_a_forged_length_its_record_agrees_with_costs_only_the_bytes_there(tmp_path: Path, compress: bool):
    """A record whose own head claims the cap too, then the end of the archive: refused as
    truncated, without first allocating the gigabyte it claims (a MemoryError, exit 3, for
    `storage import` of a file of 200 bytes where memory is short)."""
    key, record = ITEMS[0]
    head = record[:8] + struct.pack("<IQ", MAX_RECORD_BYTES - SEAL_SIZE - 64, 64)
    body = struct.pack("<I", MAX_RECORD_BYTES) + key.to_bytes() + head
    path = tmp_path / "forged"
    path.write_bytes(struct.pack("<8sHH", MAGIC, VERSION, FLAG_ZSTD if compress else 0) + KEY.key_id
                     + (zstandard.ZstdCompressor().compress(body) if compress else body))
    def check() -> None:
        with pytest.raises(ArchiveError, match="truncated"):
            check_archive(path)

    _, peak = traced_peak(check)
    assert peak < 32 << 20  # a read of 16 MiB at most


def test_the_largest_block_of_a_supported_model_fits_an_archive_record():
    """126 layers of 8 KV heads of 128 in 16-bit floats, at the largest block size (1,024
    tokens): a store holds such a record, so an archive must take it."""
    from engine.config import EngineConfig

    with pytest.raises(ValueError):
        EngineConfig(block_size=2048)
    largest = 126 * 2 * 8 * 128 * 2 * 1024
    assert largest + (64 << 10) <= MAX_RECORD_BYTES  # a generous header
