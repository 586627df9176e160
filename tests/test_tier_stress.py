"""A seeded, model-based stress test of the tier manager: random interleavings of saves,
lookups, loads, polls, flushes, given-up saves, restarts (some onto the codec's sibling,
which reads the same records) and records corrupted on disk, against a real
:class:`~tiered_kv.TierManager` (real LMDB, a CPU pool of a few slots so it evicts).
Every fourth seed adds a real Valkey/Redis server as the remote tier
(``tests/tier_stress_remote.py``), and with it outages (the server frozen, or killed and
started again empty), values corrupted on the server, and other managers joining with an
empty disk that must find there what reached it.

The oracle is a plain model (``tests/tier_stress_model.py``): every block's KV is a
function of its hash, and the model knows every block ever saved and which ones a flush or
a close said reached the disk or the remote tier. The manager may miss (evicted, dropped,
corrupt, the server down), but it must never serve wrong bytes (with a lossy codec: other
bytes than the codec's own round trip), must report every save and load exactly once,
must finish every operation within a bounded time, and must find what reached a tier again
after a flush, a restart or a join. Each seed picks the codec (lossless or KIVI), the write
policy (or a staging buffer without a CPU tier), the dtype, the pool's size and whether the
salted prompts' tenant matters less than the others (``tenant_priorities``).

More seeds for a long local run: ``TIERED_KV_STRESS_SEEDS=500 pytest tests/test_tier_stress.py``
(60 seeds take about 50 s; a remote tier's seed up to a few). A failure names its seed, its
operation's index and the pytest node to rerun. A seed always draws the same operations;
what hits, misses or waits also depends on the manager's threads, which the checks allow for.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from tier_stress_model import WAIT_S, Harness
from tier_stress_remote import remote_tier

SEEDS = int(os.environ.get("TIERED_KV_STRESS_SEEDS", "16"))
REMOTE_EVERY = 4  # seeds 1, 5, 9... add a remote tier
OPERATIONS = 100
REMOTE_OPERATIONS = 60  # an outage costs calls their deadline until the breaker opens

OPERATION_WEIGHTS: dict[Callable[[Harness], None], int] = {
    Harness.save: 35,
    Harness.lookup_and_load: 30,
    Harness.poll: 12,
    Harness.flush: 8,
    Harness.release_held: 5,
    Harness.restart: 6,
}
REMOTE_OPERATION_WEIGHTS = {
    **OPERATION_WEIGHTS,
    Harness.outage: 6,
    Harness.corrupt_remote: 3,
    Harness.join: 4,
}


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda seed: f"seed{seed}")
def test_random_operations_never_serve_wrong_bytes_or_lose_flushed_blocks(tmp_path, seed, request):
    remote = remote_tier(request) if seed % REMOTE_EVERY == 1 else None
    harness = Harness(seed, tmp_path, remote)
    if remote is None:
        operations, weights = zip(*OPERATION_WEIGHTS.items())
        drawn = harness.rng.choices(operations, weights, k=OPERATIONS)
        last = [Harness.flush]
    else:
        operations, weights = zip(*REMOTE_OPERATION_WEIGHTS.items())
        drawn = harness.rng.choices(operations, weights, k=REMOTE_OPERATIONS)
        last = [Harness.end_outage, Harness.join]  # a manager joins: what reached the server?
    try:
        for index, operation in enumerate([*drawn, *last]):
            started = time.monotonic()
            try:
                operation(harness)
                harness.check_invariants()
                took = time.monotonic() - started
                assert took < WAIT_S, f"the operation took {took:.1f} s"
            except Exception as e:
                raise AssertionError(
                    f"seed {seed}, operation {index} ({operation.__name__}) with "
                    f"{harness.describe()}: {e}\nrerun: pytest '{request.node.nodeid}'"
                ) from e
    finally:
        harness.manager.close()
    assert harness.served > 0, "no load was checked: the operations do not exercise the tiers"
