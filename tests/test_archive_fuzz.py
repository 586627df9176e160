"""A property-based fuzz of ``tiered-kv storage import`` (tiered_kv/storage_transfer.py,
tiered_kv/archive.py) on hostile archives: what ``export`` wrote with bytes flipped, cut at every
kind of boundary, random bytes, an empty file, a directory; or forged, framing, count and hash
made anew (all but the seals): sections duplicated, dropped, reordered, under another key,
altered, of another store, of huge lengths, zstd or not, under a header naming either key.
Whatever comes in: exit 0 or 2 and one error line, never a traceback; nothing written when it
is refused; the target passes ``verify`` and gains only records of the store whose key was
given, equal but for the seal; a forgery imports exactly its genuine records. A record's
declared length costs no memory beyond the bytes that are really there."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_testing import traced_peak
from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from storage.seal import KEY_FILE_NAME, load_key_file
from storage_cli_testing import NS_A, NS_B, key, other_store, run
from tiered_kv.archive import FLAG_ZSTD, MAGIC, MAX_RECORD_BYTES, VERSION

pytestmark = pytest.mark.timeout(120)  # a hang; each import is also timed
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None)
CALL_LIMIT_S = 20.0  # far above any import of these few records; pytest-timeout stops a hang
HEAD = 20  # a record's own head (magic, version, flags, lengths), checked before it is read
REPO = Path(__file__).resolve().parents[1]


class Source(NamedTuple):
    path: Path  # the exporting store
    records: dict  # key -> its bytes as stored
    plain: bytes  # its archive, as export wrote it
    compressed: bytes  # the same, --compress
    sections: list[bytes]  # the plain archive's records: length ‖ key ‖ record
    stranger: Path  # another store, with its own key and one record
    stranger_records: dict
    foreign: bytes  # a section holding the stranger's record


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    work = tmp_path_factory.mktemp("archive-fuzz")
    kv = torch.randn(2, 2, 4, 1, 4, generator=torch.Generator().manual_seed(0))
    with LmdbStore(work / "source", 16 << 20) as store:
        for k in [key(NS_A, i) for i in range(4)] + [key(NS_B, 0)]:
            store.put(k, encode_block(k, None, range(4), kv.half(), "zstd" if k.namespace == NS_B else "raw"))
    stranger = other_store(work, "stranger")
    with LmdbStore(stranger) as store:
        store.put(key(NS_B, 9), encode_block(key(NS_B, 9), None, range(4), kv.half(), "raw"))
    archives = {}
    for name, extra in (("plain", []), ("compressed", ["--compress"])):
        assert run("export", work / "source", work / name, *extra).exit_code == 0
        archives[name] = (work / name).read_bytes()
    with LmdbStore(work / "source", readonly=True) as store:
        records = dict(store.raw_records())
    (foreign_key, foreign), = held(stranger).items()
    foreign = struct.pack("<I", len(foreign)) + foreign_key.to_bytes() + foreign
    plain, compressed = archives["plain"], archives["compressed"]
    return Source(work / "source", records, plain, compressed, split(plain), stranger, held(stranger), foreign)


def held(path: Path) -> dict:
    if not path.exists():
        return {}
    with LmdbStore(path, readonly=True) as store:
        return dict(store.raw_records())


def split(archive: bytes) -> list[bytes]:
    """The record sections of a plain archive."""
    pos, sections = 20, []
    while n := struct.unpack_from("<I", archive, pos)[0]:
        sections.append(archive[pos : pos + 68 + n])
        pos += 68 + n
    return sections


def boundaries(archive: bytes) -> list[int]:
    """Where a plain archive's fields begin: header fields, each section's length, key, record
    head and last byte, the end's count and hash."""
    cuts, pos = [0, 8, 10, 12, 20], 20
    for s in split(archive):
        cuts += [pos, pos + 4, pos + 68, pos + 68 + HEAD, pos + len(s) - 1]
        pos += len(s)
    return cuts + [pos, pos + 4, pos + 12, len(archive) - 1]


def forged(sections: list[bytes], key_id: bytes, *, compress: bool, count_delta: int = 0,
           rehash: bool = True) -> bytes:
    """An archive of ``sections`` as a forger writes one: framing, count and hash made anew."""
    header = struct.pack("<8sHH", MAGIC, VERSION, FLAG_ZSTD if compress else 0) + key_id
    body = b"".join(sections) + struct.pack("<IQ", 0, len(sections) + count_delta)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(header + body) ^ (0 if rehash else 1))
    return header + (zstandard.ZstdCompressor().compress(body) if compress else body)


@st.composite
def damaged(draw, source: Source) -> tuple[bytes | None, bool]:
    """An archive export wrote, damaged (``None``: a directory); whether it must be refused."""
    kind = draw(st.sampled_from(["flip", "cut", "cut", "random", "empty", "directory", "append"]))
    base = draw(st.sampled_from([source.plain, source.compressed]))
    if kind == "flip":
        data = bytearray(base)
        for at in draw(st.lists(st.integers(0, len(base) - 1), min_size=1, max_size=4, unique=True)):
            data[at] ^= draw(st.integers(1, 255))
        return bytes(data), base is source.plain  # a zstd stream may hide a change
    if kind == "cut":
        at = draw(st.sampled_from(boundaries(source.plain)) | st.integers(0, len(base) - 1))
        return base[: max(0, min(at + draw(st.integers(-1, 1)), len(base) - 1))], True
    if kind == "random":
        prefix = draw(st.sampled_from([b"", MAGIC, base[:10], base[:20]]))
        return prefix + draw(st.binary(max_size=300)), True
    if kind == "append":
        return base + draw(st.binary(min_size=1, max_size=16)), base is source.plain
    return (b"" if kind == "empty" else None), True


HUGE = [0, 1, HEAD - 1, HEAD, MAX_RECORD_BYTES, MAX_RECORD_BYTES + 1, 2**31, 2**32 - 1]


class Forgery(NamedTuple):
    archive: bytes
    ours: bool  # its header names the exporting store's key (else the stranger's)
    defect: str | None  # in its framing, count or hash: it is refused whatever the key
    genuine: set  # the keys of its sections that are the exporting store's records, untouched
    foreign: bool  # it holds the stranger's record


@st.composite
def forgeries(draw, source: Source) -> Forgery:
    n = len(source.sections)
    parts, genuine = [], set()
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, n - 1))
        s = source.sections[i]
        kind = draw(st.sampled_from(["genuine", "genuine", "rekeyed", "altered", "foreign"]))
        if kind == "genuine":  # duplicates too
            genuine.add(s[4:68])
        elif kind == "rekeyed":  # another record's key: the record's own key disagrees
            s = s[:4] + source.sections[(i + draw(st.integers(1, n - 1))) % n][4:68] + s[68:]
        elif kind == "altered":  # past the record's head: its seal no longer verifies
            at = draw(st.integers(68 + HEAD, len(s) - 1))
            s = s[:at] + bytes([s[at] ^ draw(st.integers(1, 255))]) + s[at + 1 :]
        elif kind == "foreign":
            s = source.foreign
        parts.append(s)
    foreign = source.foreign in parts
    defect = draw(st.sampled_from([None, None, None, "count", "hash", "length", "junk"]))
    if defect in ("length", "junk"):
        s = draw(st.sampled_from(source.sections))
        s = (struct.pack("<I", draw(st.sampled_from(HUGE + [len(s) - 69, len(s) - 67]))) + s[4:]
             if defect == "length" else draw(st.binary(min_size=1, max_size=80)))
        parts.insert(draw(st.integers(0, len(parts))), s)
    ours = draw(st.sampled_from([True, True, True, False]))
    key_id = source.plain[12:20] if ours else load_key_file(source.stranger / KEY_FILE_NAME).key_id
    miscount = draw(st.sampled_from([-1, 1] if parts else [1])) if defect == "count" else 0
    archive = forged(parts, key_id, compress=draw(st.booleans()), count_delta=miscount,
                     rehash=defect != "hash")
    return Forgery(archive, ours, defect, genuine, foreign)


# Where to import, with which key: a new store or a copy of the stranger with the exporting
# store's key file; the stranger itself with its own key; a new store with the stranger's key
# file (the archive's records then verify only where a forged header names that key).
MODES = st.sampled_from(["key file", "key file", "store and key file", "own key", "stranger's key file"])
RIGHT_KEY = ("key file", "store and key file")


def imported(source: Source, archive: bytes | None, mode: str, work: Path, as_json: bool = True):
    """Import ``archive`` as ``mode`` says, check what every import must hold, and return the
    exit code and the records the target gained."""
    path = work / "archive.tkv"
    if archive is None:
        path.mkdir()
    else:
        path.write_bytes(archive)
    target = source.stranger if mode == "own key" else work / "target"
    if mode == "store and key file":
        shutil.copytree(source.stranger, target)
    key_file = {"own key": None, "stranger's key file": source.stranger}.get(mode, source.path)
    existed = target.exists()
    before, mdb = held(target), (target / "data.mdb").read_bytes() if existed else None
    args = ["import", path, target, "--size", "16MiB", *(["--json"] if as_json else [])]
    start = time.monotonic()
    result = run(*args, *(["--key-file", key_file / KEY_FILE_NAME] if key_file else []))
    assert time.monotonic() - start < CALL_LIMIT_S
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    assert result.exit_code in (0, 2), result.output
    if result.exit_code == 2:  # refused: one line, and nothing written
        (line,) = (result.stdout if as_json else result.stderr).splitlines()
        assert line.startswith('{"error": ' if as_json else "error: "), result.output
        assert "Traceback" not in result.output and (as_json or not result.stdout)
        assert target.exists() == existed
        assert mdb == ((target / "data.mdb").read_bytes() if existed else None)
        return 2, {}
    counts = json.loads(result.stdout) if as_json else None
    assert not counts or counts["records"] == sum(counts[n] for n in (
        "imported", "already_present", "skipped_corrupt", "refused_too_large"))
    if target.exists():
        assert run("verify", target).exit_code == 0
    after = held(target)
    assert all(after[k] == v for k, v in before.items())  # never overwritten nor lost
    gained = {k: v for k, v in after.items() if k not in before}
    sealer = source.records if mode in RIGHT_KEY else source.stranger_records  # the key given
    for k, record in gained.items():  # never a wrong record: one the store of that key holds
        assert record[:-SEAL_SIZE] == sealer[k][:-SEAL_SIZE], k
    assert not counts or counts["imported"] == len(gained)
    return 0, gained


def workdir():
    return tempfile.TemporaryDirectory(prefix="import-", ignore_cleanup_errors=True)


@FUZZ
@given(data=st.data())
def test_a_damaged_archive_is_refused_and_writes_nothing(source: Source, data):
    archive, refused = data.draw(damaged(source))
    mode = data.draw(MODES)
    with workdir() as work:
        code, gained = imported(source, archive, mode, Path(work), data.draw(st.booleans()))
        if refused or mode not in RIGHT_KEY:
            assert code == 2
        elif code == 0:  # a zstd stream that decodes to the same archive
            assert set(gained) == set(source.records)


@FUZZ
@given(data=st.data())
def test_a_forged_archive_imports_exactly_its_genuine_records(source: Source, data):
    forgery = data.draw(forgeries(source))
    mode = data.draw(MODES)
    with workdir() as work:
        code, gained = imported(source, forgery.archive, mode, Path(work), data.draw(st.booleans()))
    if forgery.defect or forgery.ours != (mode in RIGHT_KEY):  # damaged, or under another key
        assert code == 2
    elif mode in RIGHT_KEY:
        assert code == 0 and {k.to_bytes() for k in gained} == forgery.genuine
    else:  # a header naming the stranger's key: its record alone verifies (the stranger has it)
        new = forgery.foreign and mode != "own key"
        assert code == 0 and set(gained) == (set(source.stranger_records) if new else set())


def claiming(source: Source, length: int, present: int) -> bytes:
    """A section whose record claims ``length`` bytes, in the section and in its own head
    alike, with ``present`` bytes after the head (fewer if it claims fewer)."""
    s = source.sections[0]
    head = s[68:76] + struct.pack("<IQ", length - SEAL_SIZE - 64, 64)
    return struct.pack("<I", length) + s[4:68] + head + bytes(min(present, length - HEAD))


@st.composite
def forged_lengths(draw, source: Source) -> tuple[bytes, int]:
    """An archive of one record claiming up to the cap; how many bytes follow its head."""
    present = draw(st.sampled_from([0, 100, 1 << 20, 24 << 20]))
    section = claiming(source, draw(st.integers(len(source.sections[0]) - 68, MAX_RECORD_BYTES)), present)
    return forged([section], source.plain[12:20], compress=draw(st.booleans())), present


@settings(FUZZ, max_examples=12)
@given(data=st.data())
def test_a_declared_length_costs_no_memory_beyond_the_bytes_there(source: Source, data):
    archive, present = data.draw(forged_lengths(source))
    with workdir() as work:
        (_, gained), peak = traced_peak(lambda: imported(source, archive, "key file", Path(work)))
    # the bytes there (grown by an eighth at most), and a read of 16 MiB at a time
    assert not gained and peak < 1.25 * present + (40 << 20), f"{peak >> 20} MiB for {present} bytes"


def test_the_command_refuses_a_forged_length_in_one_line_under_a_memory_limit(source: Source, tmp_path: Path):
    """The real entry point, allowed 512 MiB more than its start-up: a record claiming the
    cap over a few bytes of zstd is an error line and exit 2, not a MemoryError (exit 3)."""
    archive = tmp_path / "forged.tkv"
    archive.write_bytes(forged([claiming(source, MAX_RECORD_BYTES, 0)], source.plain[12:20], compress=True))
    child = subprocess.run(
        [sys.executable, "-c", LIMITED, "storage", "import", str(archive), str(tmp_path / "kv"),
         "--key-file", str(source.path / KEY_FILE_NAME)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert child.returncode == 2 and child.stdout == "", child.stderr
    (line,) = child.stderr.splitlines()
    assert line.startswith("error: ") and "truncated" in line, child.stderr
    assert not (tmp_path / "kv").exists()


LIMITED = """
import resource, sys
from tiered_kv.cli import main
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (512 << 20), resource.RLIM_INFINITY))
sys.argv = ["tiered-kv", *sys.argv[1:]]
main()
"""
