"""glibc's malloc tuned for the tiers' buffers (tiered_kv.heap_tuning): each case runs in a
fresh interpreter, since the setting is the process's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Frees and reallocates a disk writer's batch of 2 MiB record buffers, as the writer does per
# commit; prints the minor page faults of the rounds after the first, and the pages touched.
CHURN = """
import importlib.util, json, resource, sys
import numpy as np
spec = importlib.util.spec_from_file_location("heap_tuning", "tiered_kv/heap_tuning.py")
heap_tuning = importlib.util.module_from_spec(spec)  # alone: the package would import torch
spec.loader.exec_module(heap_tuning)
applied = heap_tuning.keep_freed_memory() if sys.argv[1] == "tuned" else None
again = heap_tuning.keep_freed_memory() if applied is not None else None
def batch():
    bufs = [np.empty(2 << 20, dtype=np.uint8) for _ in range(32)]
    for b in bufs:
        b[::4096] = 1
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    batch()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "again": again, "faults": faults, "pages": 4 * 32 * 512}))
"""


def churn(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    done = subprocess.run(
        [sys.executable, "-c", CHURN, mode], cwd=REPO, capture_output=True, text=True, check=True,
        env={**clean, **env},
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_tuned_malloc_reuses_freed_record_buffers_instead_of_faulting_fresh_pages():
    tuned = churn("tuned")
    assert tuned["applied"] is True and tuned["again"] is True
    assert tuned["faults"] < tuned["pages"] // 20, tuned
    plain = churn("default")  # what the tuning saves (glibc gives a freed batch back)
    assert plain["faults"] > tuned["faults"], (plain, tuned)


@pytest.mark.parametrize("variable", ["GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_"])
def test_a_malloc_setting_in_the_environment_is_left_to_stand(variable):
    value = "glibc.malloc.trim_threshold=1048576" if variable == "GLIBC_TUNABLES" else "1048576"
    assert churn("tuned", **{variable: value})["applied"] is False


class _Built(Exception):
    """Stands in for the tier manager: the entry point got that far."""


def _manager(_config):
    raise _Built


def test_the_tiers_entry_points_tune_malloc_before_building_the_tiers(monkeypatch, tmp_path):
    from tiered_kv import heap_tuning, server, tiered_llm
    from tiered_kv.config import TierConfig
    from tiered_kv.serve_config import ServeConfig

    calls = []
    monkeypatch.setattr(heap_tuning, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(tiered_llm, "TierManager", _manager)
    monkeypatch.setattr(server, "TierManager", _manager)
    with pytest.raises(_Built):
        tiered_llm.build_llm("tiny", TierConfig(kv_cache_dir=tmp_path / "a"))
    assert calls == [1]
    with pytest.raises(_Built):
        server.build_async_llm(ServeConfig(kv_cache_dir=str(tmp_path / "b")))
    assert calls == [1, 1]
