"""The benchmark scripts run end to end on the CPU, in their smallest settings, and what
they write holds together: a script broken by a change elsewhere fails here, not on the
GPU machine it was meant for. Figures are not judged (they belong to the benchmarks)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, out: Path, timeout: int = 240) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_gpu_tiers_quick_serves_every_hit_from_its_tier(tmp_path):
    got = run("gpu_tiers.py", "--quick", "--codecs", "raw", "--skip", "offload",
              out=tmp_path / "tiers.json")
    assert got["complete"]
    r = got["result"]
    cases = {t["case"]: t for t in r["ttft"]}
    assert {"recompute", "engine hit", "CPU-pool hit", "disk hit"} <= set(cases)
    for t in r["ttft"]:
        assert t["ttft_s"] > 0
        if "hit" in t["case"]:
            assert t["cached_tokens"] == t["prefix"], t
    assert cases["recompute"]["cached_tokens"] == 0
    assert r["on_disk"] and all(d["on_disk"] == d["full_blocks"] and d["dropped"] == 0 for d in r["on_disk"])
    cpu_target = next(v for v in r["targets"] if "CPU restore" in v["name"])
    assert cpu_target["value"] is not None and cpu_target["value"] > 0


def test_disk_restore_loads_every_block_for_every_codec(tmp_path):
    got = run("disk_restore.py", "--device", "cpu", "--shapes", "tiny", "--blocks", "24",
              "--repeats", "1", "--codecs", "raw,zstd,kivi4", "--read-threads", "1,2",
              out=tmp_path / "disk.json")
    assert [(r["codec"], r["read_threads"]) for r in got["rows"]] == [
        ("raw", 1), ("raw", 2), ("zstd", 1), ("zstd", 2), ("kivi4", 1), ("kivi4", 2)
    ]
    for r in got["rows"]:  # the script itself fails on a short load or (raw) different bytes
        assert r["blocks"] == 24 and r["restore_Bps"] > 0 and r["pread_Bps"] > 0
        assert r["cores_busy"] > 0


def test_disk_write_puts_every_block_of_a_paced_prompt_on_disk(tmp_path):
    got = run("disk_write.py", "--shape", "tiny", "--tokens", "1024", "--chunk", "256",
              "--prefill-tok-s", "100000", "--rounds", "2", "--dir", str(tmp_path),
              out=tmp_path / "write.json")
    assert len(got["runs"]) == 2
    for one in got["runs"]:
        assert one["blocks"] == 64 and one["on_disk"] == 64 and one["dropped"] == 0, one
        assert one["write_Bps"] > 0 and one["cpu_s"] > 0
    assert got["median"]["on_disk"] == 64
    assert not list(tmp_path.glob("disk-write-*"))  # each run's store is removed


def test_writer_cost_reports_each_write_behind_thread_per_block(tmp_path):
    got = run("writer_cost.py", "--blocks", "256", "--rounds", "1", "--dir", str(tmp_path),
              out=tmp_path / "cost.json")
    threads = {(r["codec"], r["thread"]) for r in got["rows"]}
    assert {("raw", "engine"), ("raw", "writer"), ("raw", "committer")} <= threads
    assert {("zstd", "writer"), ("zstd", "packers"), ("zstd", "committer")} <= threads
    assert all(r["cpu_us"] > 0 for r in got["rows"] if r["thread"] != "engine")
    assert not list(tmp_path.glob("writer-cost-*"))  # each run's store is removed


def test_writer_cost_splits_a_callgrind_thread_at_the_interpreter_lock(tmp_path):
    """Instructions of lock-free code (and the memcpy it calls) are ``lock_free``; the rest,
    the memcpy called by the interpreter (``bytes.join``) included, is ``interpreter``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import writer_cost
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    profile = tmp_path / "cg.1-02"
    profile.write_text(
        "events: Ir\n"
        "ob=(1) /lib/libpython3.11.so\nfn=(1) _PyEval_EvalFrameDefault\n10 100\n"
        "cob=(2) /lib/libc.so.6\ncfn=(2) __memcpy_avx_unaligned_erms\ncalls=1 0\n11 40\n"
        "ob=(3) /site-packages/lmdb/cpython.so\nfn=(3) mdb_cursor_put\n20 7\n"
        "cob=(2)\ncfn=(2)\ncalls=1 0\n+1 30\n"
        "ob=(4) /site-packages/blake3/blake3.so\nfn=(4) 0x0000000000055480\n1 500\n"
        "ob=(2)\nfn=(2)\n0 70\n"
    )
    role, counts = writer_cost.thread_instructions(profile)
    assert role == "writer"  # it ran BLAKE3, and committed nothing
    assert counts == {"interpreter": 100 + 40, "lock_free": 7 + 30 + 500}


def test_engine_throughput_quick_matches_transformers_and_hits_its_prefix(tmp_path):
    got = run("engine_throughput.py", "--quick", "--shape", "tiny", out=tmp_path / "engine.json")
    assert got["complete"]
    rows = [row for row in got["throughput"] if "workload" in row]
    assert rows
    for row in rows:
        assert row["engine"]["tok_s"] > 0 and row["transformers"]["tok_s"] > 0
        assert row["identical_outputs"] == row["batch"], row  # greedy, fp32: the same tokens
        engine = row["engine"]  # its timed call, split: the prefills, then the decode steps
        assert 0 < engine["prefill_phase_s"] < engine["s"]
        decode_s = engine["decode_step_ms"] / 1e3 * (row["new"] - 1)
        assert 0 < decode_s < engine["s"] - engine["prefill_phase_s"] + 1e-3
    ttft = got["ttft"]
    assert ttft["caching_on"]["num_cached_tokens"][1:] == [ttft["prefix_tokens"]] * (ttft["requests"] - 1)
    assert not any(ttft["caching_off"]["num_cached_tokens"])


def test_engine_host_measures_each_batch_and_prompt(tmp_path):
    got = run("engine_host.py", "--batches", "1,4", "--prompts", "32", "--steps", "20",
              out=tmp_path / "host.json")
    assert [(r["batch"], r["prompt"]) for r in got["rows"]] == [(1, 32), (4, 32)]
    assert all(r["ms_per_step"] > 0 for r in got["rows"])
    got = run("engine_host.py", "--batches", "4", "--prompts", "16", "--steps", "24", "--runner",
              out=tmp_path / "runner.json")
    assert got["runner"] and got["rows"][0]["ms_per_step"] > 0


def test_serve_stream_serves_every_token_streamed_and_not(tmp_path):
    """The script itself fails unless every request got all its tokens (from the usage)."""
    got = run("serve_stream.py", "--batch", "4", "--new", "8", "--rounds", "1",
              out=tmp_path / "serve.json")
    assert list(got["rows"]) == ["engine alone", "not streamed", "streamed"]
    assert all(row["tok_s"] > 0 for row in got["rows"].values())
    assert got["rows"]["not streamed"]["events_per_request"] == 0
    assert got["rows"]["streamed"]["events_per_request"] >= 1


def test_serve_stream_with_a_stub_engine_sends_an_event_per_token(tmp_path):
    """The script itself fails unless every request got all its tokens (from the usage)."""
    got = run("serve_stream.py", "--batch", "4", "--new", "8", "--rounds", "1", "--stub-step-ms", "20",
              out=tmp_path / "serve.json")
    assert list(got["rows"]) == ["not streamed", "streamed"]
    # 8 tokens and the usage; fewer only if the event loop fell behind a step and merged
    assert 2 <= got["rows"]["streamed"]["events_per_request"] <= 9


def test_waiting_host_times_each_kind_of_waiting_request(tmp_path):
    """The script itself fails if the long request got in (it must wait) or the batch was
    preempted (the pool was sized wrong)."""
    got = run("waiting_host.py", "--batch", "2", "--waiting", "512", "--steps", "24",
              out=tmp_path / "waiting.json")
    assert [r["case"] for r in got["rows"]] == ["nothing waits", "cold", "gpu hit", "cpu hit"]
    assert all(r["ms_per_step"] > 0 for r in got["rows"])


def test_repeated_lookup_times_each_chain_first_and_repeated(tmp_path):
    got = run("repeated_lookup.py", "--blocks", "96", "--repeats", "3",
              out=tmp_path / "lookup.json")
    assert [(r["case"], r["matched"]) for r in got["rows"]] == [
        ("cold", 0), ("cpu hit", 96), ("cpu hit, cold tail", 48), ("disk hit", 96)
    ]
    assert all(r["first_us"] > 0 and r["repeated_us"] > 0 for r in got["rows"])


def test_hit_profile_times_a_miss_and_a_hit_of_the_whole_prefix(tmp_path):
    got = run("hit_profile.py", "--quick", "--prefix", "64", out=tmp_path / "hit.json")
    miss, hit = got["rows"]
    assert (miss["caching"], miss["cached_tokens"]) == (False, 0)
    assert (hit["caching"], hit["cached_tokens"]) == (True, 64)
    for row in got["rows"]:
        assert len(row["wall_ms"]) == 5 and len(row["profiled"]) == 2
        assert all(p["wall_ms"] > 0 for p in row["profiled"])


def test_the_gpu_session_script_passes_only_flags_its_benchmarks_take():
    """benchmarks/gpu_session.sh runs on a lent GPU, where a typo costs the session's device
    time: every flag it passes must be one its benchmark's --help lists."""
    script = (REPO / "benchmarks/gpu_session.sh").read_text().replace("\\\n", " ")
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    commands = re.findall(r"python3 (benchmarks/\w+\.py)([^;\n]*)", script)
    assert {name for name, _ in commands} >= {
        "benchmarks/engine_throughput.py", "benchmarks/gpu_tiers.py", "benchmarks/disk_restore.py",
        "benchmarks/multi_round_qa.py", "benchmarks/hit_profile.py", "benchmarks/serve_stream.py",
        "benchmarks/disk_write.py",
    }
    for name, args in commands:
        shown = subprocess.run(
            [sys.executable, REPO / name, "--help"], capture_output=True, text=True, check=True
        ).stdout
        for flag in re.findall(r"(?<!\S)--[a-z][a-z-]*", args):
            assert flag in shown, (name, flag)


def test_overlapped_load_serves_each_hit_whole_or_split(tmp_path):
    got = run("overlapped_load.py", "--quick", "--slowdowns", "3", out=tmp_path / "overlap.json")
    (row,) = got["rows"]
    assert got["prefill_per_token_s"] > 0 or got["prefill_per_token_context_s"] > 0
    assert row["whole_cached_tokens"] == got["prefix_tokens"]  # loaded whole
    assert 0 < row["overlapped_cached_tokens"] < got["prefix_tokens"]  # its head recomputed
    assert row["whole_s"] > 0 and row["overlapped_s"] > 0 and row["recompute_s"] > 0
