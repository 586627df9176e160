"""The disk tier across processes: restarts hit, crashes leave only verified records,
corruption is recomputed. Each process is ``tests/tier_child.py`` on the tiny model."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from engine import LLM, SamplingParams
from engine.hashing import hash_blocks, root_hash
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.base import BlockKey
from storage.lmdb_store import LmdbStore, default_map_size
from tiered_kv import TierConfig, build_llm

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "tier_child.py"
BLOCK = 16
MAX_TOKENS = 8


def random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


PROMPTS = random_prompts(4, 60, 300, seed=11)
TRAFFIC = random_prompts(60, 100, 400, seed=12)  # ~25 ms each: the kill lands mid-traffic


def recompute(prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(max_model_len=512, enable_prefix_caching=False, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return recompute(PROMPTS)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_child(**args) -> dict:
    proc = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(args)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_restarted_process_hits_from_disk(tmp_path, reference, codec):
    cache = str(tmp_path / "kv")
    first = run_child(cache_dir=cache, prompts=PROMPTS, codec=codec)
    assert [o["token_ids"] for o in first["outputs"]] == reference
    assert all(o["cached"] == 0 for o in first["outputs"])

    second = run_child(cache_dir=cache, prompts=PROMPTS, codec=codec)
    assert [o["token_ids"] for o in second["outputs"]] == reference
    assert [o["cached"] for o in second["outputs"]] == [full_hit(p) for p in PROMPTS]
    disk = second["stats"]["disk"]
    assert disk["hit_blocks"] == sum(full_hit(p) for p in PROMPTS) // BLOCK
    assert disk["corrupt"] == disk["load_failures"] == 0
    assert second["engine"]["connector_hits"] == sum(full_hit(p) for p in PROMPTS)


def committed_run(store: LmdbStore, namespace: bytes, prompt: list[int]) -> int:
    """How many of ``prompt``'s leading full blocks are committed in ``store``, as a hit
    would use them (the last token is always computed)."""
    chain = hash_blocks(root_hash(namespace), prompt[: len(prompt) - 1], BLOCK)
    present = store.contains_many([BlockKey(namespace, h) for h in chain])
    return present.index(False) if False in present else len(present)


@pytest.mark.parametrize("seed", [1, 2])
def test_killed_while_serving_then_restarted(tmp_path, seed):
    cache = str(tmp_path / "kv")
    args = dict(cache_dir=cache, prompts=TRAFFIC, traffic=True, cpu_bytes=4 << 20)
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(args)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        first_line = proc.stdout.readline()
        time.sleep(random.Random(seed).uniform(0.05, 0.8))
    finally:
        proc.send_signal(signal.SIGKILL)
        rest, errors = proc.communicate(timeout=30)
    assert first_line, errors
    ready = json.loads(first_line)
    assert proc.returncode == -signal.SIGKILL and ready["ready"]
    served = rest.count('"done"')
    namespace = bytes.fromhex(ready["namespace"])

    with LmdbStore(cache, readonly=True) as store:  # what the crash left, as any reader sees it
        assert store.verify().corrupt == 0
        runs = [committed_run(store, namespace, p) for p in TRAFFIC]

    restarted = run_child(cache_dir=cache, prompts=TRAFFIC)
    assert [o["token_ids"] for o in restarted["outputs"]] == recompute(TRAFFIC)
    assert [o["cached"] for o in restarted["outputs"]] == [BLOCK * r for r in runs]
    disk = restarted["stats"]["disk"]
    assert disk["hit_blocks"] == sum(runs)
    assert disk["corrupt"] == disk["load_failures"] == 0
    print(f"\nkilled after {served} finished requests; {sum(runs)} blocks hit after the restart")


def flip_a_payload_byte(path: Path, key: BlockKey) -> None:
    """Flip one payload byte of a stored record behind the store's back."""
    env = lmdb.open(str(path), max_dbs=4, map_size=default_map_size(64 << 20))
    records = env.open_db(b"records")
    with env.begin(write=True, db=records) as txn:
        data = bytearray(txn.get(key.to_bytes()))
        data[len(data) // 2] ^= 0x01
        txn.put(key.to_bytes(), bytes(data))
    env.close()


def disk_llm(path):
    """A tiny CPU engine whose only tier is the disk store at ``path``."""
    tiers = TierConfig(kv_cache_dir=path, cpu_bytes=0, disk_bytes=64 << 20)
    return build_llm("tiny", tiers, max_model_len=512, device="cpu")


def test_a_corrupt_record_is_recomputed_and_counted(tmp_path, reference):
    path = tmp_path / "kv"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = max(PROMPTS, key=len)
    want = reference[PROMPTS.index(prompt)]
    with disk_llm(path) as llm:
        llm.generate(prompt, params)
        namespace = llm.engine.connector.namespace
    victim = BlockKey(namespace, hash_blocks(root_hash(namespace), prompt, BLOCK)[3])
    flip_a_payload_byte(path, victim)  # no process has the store open

    with disk_llm(path) as llm:
        out = llm.generate(prompt, params)[0]
        stats = llm.engine.connector.stats()["disk"]
        engine = llm.engine.stats()
    # The three blocks before the corrupt one load; the engine recomputes from it on.
    assert out.token_ids == want and out.num_cached_tokens == 3 * BLOCK
    assert stats["corrupt"] == 1 and stats["load_failures"] == 1 and stats["hit_blocks"] == 3
    assert engine.connector_load_failures == 1

    # The recompute stored the block again: the next engine hits the whole prefix.
    with disk_llm(path) as llm:
        again = llm.generate(prompt, params)[0]
        stats = llm.engine.connector.stats()["disk"]
    assert again.token_ids == want and again.num_cached_tokens == full_hit(prompt)
    assert stats["hit_blocks"] == full_hit(prompt) // BLOCK and stats["corrupt"] == 0


def test_a_truncated_store_is_moved_aside_and_the_engine_serves_on(tmp_path, reference, caplog):
    path = tmp_path / "kv"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = max(PROMPTS, key=len)
    want = reference[PROMPTS.index(prompt)]
    with disk_llm(path) as llm:
        llm.generate(prompt, params)
    data = path / "data.mdb"
    with open(data, "r+b") as f:  # a crash of the file system, a copy cut short
        f.truncate(data.stat().st_size // 3)

    with caplog.at_level("WARNING"), disk_llm(path) as llm:
        out = llm.generate(prompt, params)[0]
        moved = llm.engine.connector.stores()["disk"].moved_aside
    assert out.token_ids == want and out.num_cached_tokens == 0  # served, recomputed
    assert moved is not None and moved.name.startswith("kv.damaged-") and moved.is_dir()
    assert any("moved it to" in r.getMessage() for r in caplog.records)
    with disk_llm(path) as llm:  # the new store works
        assert llm.generate(prompt, params)[0].num_cached_tokens == full_hit(prompt)
