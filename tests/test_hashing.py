from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.hashing import (
    KV_LAYOUT_VERSION, KVNamespace, block_hash, extend_block_hashes, hash_blocks, root_hash,
)

ROOT = Path(__file__).resolve().parent.parent
NS = KVNamespace(
    model_fingerprint=hashlib.sha256(b"model").digest(),
    kv_dtype="bfloat16",
    kv_scales=(),
    block_size=16,
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
)
TOKENS = list(range(1000, 1040))

_SCRIPT = """
from engine.hashing import KVNamespace, hash_blocks, root_hash
import hashlib
ns = KVNamespace(hashlib.sha256(b"model").digest(), "bfloat16", (), 16, 4, 2, 64).digest()
print(ns.hex())
for h in hash_blocks(root_hash(ns, "tenant"), list(range(1000, 1040)), 16):
    print(h.hex())
"""


def test_digests_are_the_same_in_another_process():
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    ns = NS.digest()
    assert out == [ns.hex()] + [h.hex() for h in hash_blocks(root_hash(ns, "tenant"), TOKENS, 16)]


def test_chain_matches_the_documented_formula():
    ns = NS.digest()
    root = hashlib.sha256(ns + struct.pack("<I", 0)).digest()
    assert root_hash(ns) == root_hash(ns, "") == root
    h0 = hashlib.sha256(root + struct.pack("<16I", *TOKENS[:16])).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<16I", *TOKENS[16:32])).digest()
    assert hash_blocks(root, TOKENS, 16) == [h0, h1]  # 40 tokens: only the 2 full blocks
    assert block_hash(h0, TOKENS[16:32]) == h1
    assert all(len(h) == 32 for h in (root, h0, h1))


def test_known_hashes_are_reused_and_extended():
    root = root_hash(NS.digest())
    full = hash_blocks(root, TOKENS, 8)
    assert len(full) == 5
    assert hash_blocks(root, TOKENS, 8, known=full[:2]) == full
    assert hash_blocks(root, TOKENS[:7], 8) == []


def test_a_chain_is_extended_in_place_up_to_the_blocks_asked_for():
    root = root_hash(NS.digest())
    full = hash_blocks(root, TOKENS, 8)
    chain = full[:1]
    extend_block_hashes(chain, root, TOKENS, 8, 3)  # reads only the ids of blocks 1 and 2
    assert chain == full[:3]
    extend_block_hashes(chain, root, TOKENS, 8, 2)  # fewer than known: nothing changes
    assert chain == full[:3]
    extend_block_hashes(chain, root, TOKENS, 8, 99)  # no further than the full blocks
    assert chain == full
    # a sequence's hashes follow its tokens as they grow a block at a time
    grown: list[bytes] = []
    for end in range(0, len(TOKENS) + 1):
        extend_block_hashes(grown, root, TOKENS[:end], 8, end // 8)
        assert grown == full[: end // 8]


def test_salts_separate_roots_unambiguously():
    ns = NS.digest()
    roots = {root_hash(ns, salt) for salt in ("a", "b", "ab", "tenant-a", "\x00", " ")}
    assert len(roots) == 6
    assert root_hash(ns) not in roots
    assert root_hash(ns, None) == root_hash(ns, "")
    # Without the length prefix, namespace ‖ salt could be forged by another namespace.
    assert root_hash(ns, "x") != hashlib.sha256(ns + b"x").digest()


def test_same_tokens_under_different_salts_or_parents_differ():
    ns = NS.digest()
    a = hash_blocks(root_hash(ns, "a"), TOKENS, 16)
    b = hash_blocks(root_hash(ns, "b"), TOKENS, 16)
    assert not set(a) & set(b)
    assert block_hash(a[0], TOKENS[:16]) != block_hash(b[0], TOKENS[:16])


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": hashlib.sha256(b"other").digest()},
        {"kv_dtype": "float8_e4m3fn"},
        {"kv_dtype": "float8_e4m3fn", "kv_scales": ((0.5, 0.5),) * 4},
        {"block_size": 32},
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"layout_version": KV_LAYOUT_VERSION + 1},
    ],
)
def test_namespace_changes_with_every_field(change):
    assert dataclasses.replace(NS, **change).digest() != NS.digest()


def test_namespace_changes_with_each_fp8_scale():
    base = dataclasses.replace(NS, kv_dtype="float8_e4m3fn", kv_scales=((0.5, 0.25),) * 4)
    for layer in range(4):
        for which in range(2):
            scales = [list(s) for s in base.kv_scales]
            scales[layer][which] *= 2
            other = dataclasses.replace(base, kv_scales=tuple(tuple(s) for s in scales))
            assert other.digest() != base.digest()


def test_namespace_fields_cannot_run_into_each_other():
    # Tagged, length-prefixed fields: moving bytes between fields changes the encoding.
    a = dataclasses.replace(NS, model_fingerprint=b"ab", kv_dtype="c")
    b = dataclasses.replace(NS, model_fingerprint=b"a", kv_dtype="bc")
    assert a.digest() != b.digest()


def test_invalid_inputs_raise_value_error():
    with pytest.raises(ValueError, match="token ids"):
        block_hash(bytes(32), [2**32])
    with pytest.raises(ValueError, match="token ids"):
        block_hash(bytes(32), [-1])
    with pytest.raises(ValueError, match="token ids"):  # packed in one call per chain
        hash_blocks(bytes(32), TOKENS[:16] + [2**32] + TOKENS[:15], 16)
    with pytest.raises(ValueError, match="namespace"):
        root_hash(b"short")
    with pytest.raises(ValueError, match="kv_scales"):
        dataclasses.replace(NS, kv_scales=((1.0, 1.0),))
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(NS, kv_scales=((0.0, 1.0),) * 4)
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(NS, block_size=0)
