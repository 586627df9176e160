from __future__ import annotations

import logging
import os
import pickle
import stat

import pytest
from blake3 import blake3

from storage import seal
from storage.seal import MIN_SECRET_BYTES, SealKey, create_key_file, load_key_file

SECRET = b"0123456789abcdef0123456789abcdef"


def test_the_same_secret_gives_the_same_key_and_another_does_not():
    assert SealKey(SECRET) == SealKey(SECRET + b"\n")  # surrounding whitespace is not the secret
    assert SealKey(SECRET).key_id == SealKey(SECRET).key_id
    other = SealKey(SECRET[::-1])
    assert other != SealKey(SECRET) and other.key_id != SealKey(SECRET).key_id
    assert SealKey(SECRET).mac(b"ab", b"c") == SealKey(SECRET).mac(b"abc")
    assert other.mac(b"abc") != SealKey(SECRET).mac(b"abc")


def test_a_short_secret_is_refused_without_showing_it():
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES}") as err:
        SealKey(b"hunter2-hunter2", source="TIERED_KV_SECRET")
    assert "TIERED_KV_SECRET" in str(err.value) and "hunter2" not in str(err.value)


def test_the_key_never_shows_its_secret():
    key = SealKey(SECRET)
    assert repr(key) == f"SealKey(id={key.key_id.hex()})" and SECRET.decode() not in repr(key)
    with pytest.raises(TypeError):
        pickle.dumps(key)


def test_a_key_file_is_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        key = create_key_file(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert load_key_file(tmp_path / "k") == key
    with pytest.raises(FileExistsError):
        create_key_file(tmp_path / "k")


def test_secret_files_are_checked_with_clear_errors(tmp_path, caplog):
    with pytest.raises(ValueError, match="no such file"):
        load_key_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        load_key_file(tmp_path)
    short = tmp_path / "short"
    short.write_bytes(b"pw\n")
    with pytest.raises(ValueError, match=f"{short}.*at least") as err:
        load_key_file(short)
    assert "pw" not in str(err.value).replace(str(tmp_path), "")
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * 5000)
    with pytest.raises(ValueError, match="not a secret"):
        load_key_file(huge)
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_key_file(shared) == SealKey(SECRET)
    assert "readable by other users" in caplog.text and SECRET.decode() not in caplog.text


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_file_is_a_clear_error(tmp_path):
    locked = tmp_path / "locked"
    locked.write_bytes(SECRET)
    locked.chmod(0)
    with pytest.raises(ValueError, match="cannot read it"):
        load_key_file(locked)


def test_a_parallel_mac_on_blake3_threads_is_the_same_mac():
    """A large ``parallel`` MAC runs on BLAKE3's worker threads: it must be the keyed hash of
    the whole input, whichever side of the threshold, however split, parallel or not."""
    key = SealKey(b"s" * 32)
    mac_key = blake3(b"s" * 32, derive_key_context=seal._MAC_CONTEXT).digest()
    data = bytes(range(256)) * ((seal.PARALLEL_MAC_BYTES * 3) // 256 + 7)
    for size in (seal.PARALLEL_MAC_BYTES - 1, seal.PARALLEL_MAC_BYTES, len(data)):
        expected = blake3(data[:size], key=mac_key, max_threads=1).digest()
        for parallel in (False, True):
            assert key.mac(data[:size], parallel=parallel) == expected
            assert key.mac(data[:100], memoryview(data)[100:size], parallel=parallel) == expected
            assert key.check(expected, data[:size], parallel=parallel)


def test_only_a_parallel_mac_of_a_large_input_asks_for_worker_threads(monkeypatch):
    """The engine's readers and writers MAC side by side, one per thread: their MACs must not
    ask BLAKE3 for worker threads; an admin scan's large ones do."""
    asked = []

    def recording(*args, max_threads=1, **kwargs):
        asked.append(max_threads)
        return blake3(*args, max_threads=max_threads, **kwargs)

    recording.AUTO = blake3.AUTO
    key = SealKey(b"s" * 32)
    monkeypatch.setattr(seal, "blake3", recording)
    large, small = bytes(seal.PARALLEL_MAC_BYTES), bytes(seal.PARALLEL_MAC_BYTES - 1)
    key.mac(large)
    key.mac(small, parallel=True)
    key.mac(large, parallel=True)
    assert asked == [1, 1, blake3.AUTO]


def test_a_seal_written_in_place_is_the_key_id_and_the_mac_of_what_precedes_it():
    key = SealKey(SECRET)
    buf = memoryview(bytearray(b"header and payload" + bytes(seal.SEAL_SIZE)))
    end = len(buf) - seal.SEAL_SIZE
    key.seal_into(buf, end)
    assert bytes(buf[end : end + seal.KEY_ID_SIZE]) == key.key_id
    assert bytes(buf[end + seal.KEY_ID_SIZE :]) == key.mac(bytes(buf[:end]), key.key_id)
