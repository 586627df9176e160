"""The save side on its own: saved blocks reach the pool, wait for a slot, then drop."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.connector import SavedBlock
from storage.base import BlockKey
from storage.codecs import get_codec
from storage.cpu_pool import CpuBlockPool
from tiered_kv import block_saver
from tiered_kv.block_mover import BlockMover
from tiered_kv.block_saver import BlockSaver
from tiered_kv.config import TierConfig
from tiered_kv.metrics import TierMetrics

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, L, 2, T, H, D]
NAMESPACE = bytes(32)


class Saves:
    """A saver over a pool of ``slots`` slots whose blocks stay pending for ``remote``
    (pinned) until :meth:`written`, and the block ids it reported saved."""

    def __init__(
        self, slots: int, offload: str = "prompt", codec: str = "raw", disk=None,
        pending: tuple[str, ...] = ("remote",), tenant_priorities: dict[str, int] | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.cache = torch.randn(SHAPE, generator=g)
        stage = get_codec(codec).stage
        nbytes = stage.payload_size(self.cache.dtype, SHAPE[1:])
        self.pool = CpuBlockPool(slots * nbytes, block_nbytes=nbytes, pin_memory=False)
        self.mover = BlockMover(self.cache, self.pool.slab, stage)
        self.metrics = TierMetrics(("cpu",), lambda: {}, lambda: None)
        self.reported: list[int] = []
        self.saver = BlockSaver(
            TierConfig(
                cpu_bytes=slots * nbytes, offload=offload, tenant_priorities=tenant_priorities or {}
            ), NAMESPACE, self.pool,
            self.mover, disk, self.metrics, pending_tiers=pending, drop_tier="cpu",
            block_nbytes=nbytes, on_saved=self.reported.extend,
        )

    def written(self) -> None:
        """What a writer does once it has stored every pending block."""
        taken = self.pool.take_pending("remote", self.pool.num_slots, timeout=0)
        self.pool.done_pending("remote", [block.key for block in taken])

    def dropped(self) -> int:
        return self.metrics.counters()["cpu"].dropped

    def close(self) -> None:
        self.saver.close(0.0)
        self.mover.close()
        self.pool.close()


def key(block: SavedBlock) -> BlockKey:
    return BlockKey(NAMESPACE, block.block_hash)


def saved(block_id: int, *, is_prompt: bool = True, cache_salt: str | None = None) -> SavedBlock:
    return SavedBlock(
        bytes([block_id + 1]) * 32, None, tuple(range(4)), block_id, is_prompt, cache_salt
    )


def test_saved_blocks_are_copied_into_the_pool_and_reported():
    s = Saves(slots=4)
    blocks = [saved(0), saved(3), saved(5)]
    s.saver.save(blocks)
    assert s.reported == [0, 3, 5] and not s.saver.busy()
    for b in blocks:
        held = s.pool.acquire(key(b))
        slot = s.pool.slot_view(held.slot, s.cache.dtype, SHAPE[1:])
        assert torch.equal(slot, s.cache[b.block_id])
        s.pool.release(key(b))
    s.saver.save([saved(3)])  # already in the pool: reported, not copied again
    assert s.reported[-1] == 3 and s.pool.stats().puts == 3
    s.close()


@pytest.mark.parametrize("offload", ["prompt", "all"])
def test_offload_prompt_reports_generated_blocks_without_keeping_them(offload):
    s = Saves(slots=4, offload=offload)
    generated = saved(1, is_prompt=False)
    s.saver.save([saved(0), generated])
    assert sorted(s.reported) == [0, 1]
    assert s.pool.contains(key(generated)) == (offload == "all")
    s.close()


def test_a_save_waits_for_a_slot_then_goes_in():
    s = Saves(slots=2)
    first = [saved(0), saved(1)]
    s.saver.save(first)
    s.saver.save([saved(2)])  # every slot holds a block not yet written
    assert s.reported == [0, 1] and s.saver.busy()
    s.saver.retry_deferred()
    assert s.reported == [0, 1]  # still waiting: SAVE_WAIT_S has not passed
    s.written()
    s.saver.retry_deferred()
    assert s.reported == [0, 1, 2] and s.pool.contains(key(saved(2))) and not s.saver.busy()
    assert s.dropped() == 0
    s.close()


def test_a_save_that_waited_save_wait_s_is_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(block_saver, "SAVE_WAIT_S", 0.0)
    s = Saves(slots=1)
    s.saver.save([saved(0), saved(1), saved(2)])
    assert sorted(s.reported) == [0, 1, 2] and not s.saver.busy()  # drops reported first
    assert s.dropped() == 2
    assert not s.pool.contains(key(saved(1)))
    s.close()


def test_a_save_no_slot_can_free_up_for_is_dropped_at_once():
    """A tenant that matters less than every block in the pool, written or not, would wait
    SAVE_WAIT_S for nothing (and a flush or a close with it): its save is dropped at once,
    counted. A block that matters as much waits for a slot as before."""
    s = Saves(slots=2, tenant_priorities={"batch": 3})
    s.saver.save([saved(0), saved(1)])
    s.saver.save([saved(2, cache_salt="batch")])
    assert s.reported == [0, 1, 2] and not s.saver.busy() and s.dropped() == 1
    s.saver.save([saved(3)])  # the slots' blocks, once written, can be evicted for it
    assert s.reported == [0, 1, 2] and s.saver.busy()
    s.written()
    s.saver.retry_deferred()
    assert s.reported == [0, 1, 2, 3] and s.pool.contains(key(saved(3))) and s.dropped() == 1
    s.close()


def test_releasing_deferred_saves_stores_what_fits_and_drops_the_rest():
    """The engine is short of blocks: deferred saves that find a slot now go in, the others
    are dropped at once (counted), and every block is reported, before SAVE_WAIT_S."""
    s = Saves(slots=2)
    s.saver.save([saved(0), saved(1)])  # both slots hold blocks not yet written
    s.saver.save([saved(2), saved(3), saved(4)])
    taken = s.pool.take_pending("remote", 1, timeout=0)  # a writer stores one block
    s.pool.done_pending("remote", [block.key for block in taken])
    s.saver.release_deferred()
    assert s.reported == [0, 1, 2, 3, 4] and not s.saver.busy()
    assert s.pool.contains(key(saved(2))) and s.dropped() == 2
    assert not s.pool.contains(key(saved(3))) and not s.pool.contains(key(saved(4)))
    s.close()


def test_a_save_retried_after_others_keeps_its_own_wait(monkeypatch):
    """A and then, 4 s later, B wait for a slot; at 4.5 s one slot frees and A takes it. B
    has waited 0.5 s: it is dropped only SAVE_WAIT_S after its own save, not A's."""
    now = [100.0]
    monkeypatch.setattr(block_saver.time, "monotonic", lambda: now[0])
    s = Saves(slots=2)
    s.saver.save([saved(0), saved(1)])  # both slots hold blocks not yet written
    s.saver.save([saved(2)])  # A
    now[0] += 4.0
    s.saver.save([saved(3)])  # B
    now[0] += 0.5
    taken = s.pool.take_pending("remote", 1, timeout=0)  # a writer stores one block
    s.pool.done_pending("remote", [block.key for block in taken])
    s.saver.retry_deferred()
    assert s.reported == [0, 1, 2] and s.pool.contains(key(saved(2)))
    now[0] += 1.0  # B has waited 1.5 s
    s.saver.retry_deferred()
    assert s.reported == [0, 1, 2] and s.dropped() == 0 and s.saver.busy()
    now[0] += block_saver.SAVE_WAIT_S - 1.5  # B has waited SAVE_WAIT_S
    s.saver.retry_deferred()
    assert s.reported == [0, 1, 2, 3] and s.dropped() == 1
    s.close()


def test_a_retry_takes_only_as_many_waiting_saves_as_slots_are_free(monkeypatch):
    """The pool drains a slot at a time under a long backlog: each retry looks at the oldest
    waiting saves that could get a slot, not at the whole queue, and the order holds."""
    s = Saves(slots=2)
    s.saver.save([saved(0), saved(1)])  # both slots hold blocks not yet written
    s.saver.save([saved(i) for i in range(2, 12)])  # ten wait
    looked_at = []
    offload = s.saver._offload
    monkeypatch.setattr(s.saver, "_offload", lambda blocks, **kw: (
        looked_at.append([b.block_id for b, _ in blocks]), offload(blocks, **kw))[1])
    s.saver.retry_deferred()  # no slot: nothing is looked at
    for _ in range(3):
        taken = s.pool.take_pending("remote", 1, timeout=0)  # a writer stores one block
        s.pool.done_pending("remote", [block.key for block in taken])
        s.saver.retry_deferred()
    assert looked_at == [[2], [3], [4]]
    assert s.reported == [0, 1, 2, 3, 4] and s.saver.busy()
    s.saver.release_deferred()
    assert s.reported == [0, 1, 2, 3, 4, *range(5, 12)] and s.dropped() == 7
    s.close()


def test_closing_drops_what_waits_and_refuses_new_saves():
    s = Saves(slots=1)
    s.saver.save([saved(0), saved(1)])
    assert s.reported == [0]
    s.saver.close(0.0)  # no time left to wait for a slot
    assert s.reported == [0, 1] and s.dropped() == 1 and not s.saver.busy()
    s.saver.save([saved(4)])
    assert s.reported == [0, 1, 4] and not s.pool.contains(key(saved(4)))
    s.mover.close()
    s.pool.close()


def test_asynchronous_copies_are_committed_by_the_save_watcher():
    """A KIVI offload on the CPU runs on the mover's thread: the watcher commits it."""
    s = Saves(slots=4, codec="kivi4")
    assert s.mover.asynchronous
    assert "tiered-kv-save-watcher" in {t.name for t in threading.enumerate()}
    blocks = [saved(0), saved(2)]
    s.saver.save(blocks)
    deadline = time.monotonic() + 10
    while s.saver.busy() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sorted(s.reported) == [0, 2] and all(s.pool.contains(key(b)) for b in blocks)
    s.close()
    assert "tiered-kv-save-watcher" not in {t.name for t in threading.enumerate()}


def test_an_offload_that_fails_when_queued_drops_its_blocks_instead_of_raising(monkeypatch):
    """On CUDA the copies are queued by ``offload`` itself, so a device error (out of
    memory, a kernel that does not compile) raises there. The save must not raise: the
    engine would let go of every block it offered, including those already reported."""
    s = Saves(slots=3)
    s.saver.save([saved(0)])
    offload = s.mover.offload

    def failing(pairs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(s.mover, "offload", failing)
    s.saver.save([saved(0), saved(1), saved(2)])  # 0 is in the pool already
    assert sorted(s.reported) == [0, 0, 1, 2] and not s.saver.busy()  # each save once
    assert s.dropped() == 2 and not s.pool.contains(key(saved(1)))
    assert s.pool.num_evictable() == 2  # the failed save's slots are free again
    monkeypatch.setattr(s.mover, "offload", offload)
    s.saver.save([saved(1), saved(2)])
    assert all(s.pool.contains(key(saved(b))) for b in (1, 2))
    s.close()


class FailingDisk:
    def contains_many(self, keys):
        raise OSError("I/O error")


def test_a_disk_that_fails_its_lookup_leaves_the_blocks_pending_for_it(caplog):
    s = Saves(slots=4, disk=FailingDisk(), pending=("disk",))
    blocks = [saved(0), saved(1)]
    s.saver.save(blocks)
    assert s.reported == [0, 1] and s.dropped() == 0  # reported once, kept
    taken = s.pool.take_pending("disk", 4, timeout=0)
    assert sorted(b.key for b in taken) == sorted(key(b) for b in blocks)  # written again
    assert "looking up 2 saved blocks on disk failed" in caplog.text
    s.close()


class Disk:
    def __init__(self, keys) -> None:
        self.keys = set(keys)

    def contains_many(self, keys):
        return [k in self.keys for k in keys]


def test_a_block_saved_again_is_pending_again_for_the_tiers_that_may_lack_it():
    """Not copied again, but written again: a tier may have dropped it (the remote server
    was down), and a flush that says True covers every block saved since the last."""
    on_disk, lost = saved(0), saved(1)
    s = Saves(slots=4, disk=Disk([key(on_disk)]), pending=("disk", "remote"))
    s.saver.save([on_disk, lost])
    for tier in ("disk", "remote"):  # the writers are done with them: written or given up
        s.pool.done_pending(tier, [b.key for b in s.pool.take_pending(tier, 4, timeout=0)])
    s.saver.save([on_disk, lost])
    assert s.reported == [0, 1, 0, 1] and s.pool.stats().puts == 2  # not copied again
    remote = s.pool.take_pending("remote", 4, timeout=0)
    assert sorted(b.key for b in remote) == sorted([key(on_disk), key(lost)])
    assert [b.key for b in s.pool.take_pending("disk", 4, timeout=0)] == [key(lost)]
    s.close()


def test_a_commit_that_fails_drops_its_blocks_and_still_reports_them(monkeypatch):
    s = Saves(slots=4)

    def fail(*args, **kwargs):
        raise RuntimeError("pool bookkeeping failed")

    monkeypatch.setattr(s.pool, "commit_many", fail)
    s.saver.save([saved(0), saved(1)])
    assert s.reported == [0, 1] and s.dropped() == 2
    assert s.pool.num_evictable() == 4  # the slots it reserved are free again
    s.close()



def fail(*args, **kwargs):
    raise RuntimeError("injected")


def test_a_save_that_fails_after_reporting_some_blocks_drops_the_rest_instead_of_raising(
    monkeypatch,
):
    """The engine lets go of every block of a save that raises, so once one block is
    reported (here a generated one, skipped) a failing step must not raise: the rest are
    dropped, and every block is reported exactly once."""
    s = Saves(slots=4, offload="prompt")
    monkeypatch.setattr(s.pool, "reserve_many", fail)
    s.saver.save([saved(0), saved(1, is_prompt=False), saved(2)])
    assert sorted(s.reported) == [0, 1, 2] and s.dropped() == 2 and not s.saver.busy()
    s.close()


def test_a_save_whose_counting_fails_still_reports_each_block_once(monkeypatch):
    """One save: a block already in the pool (reported at once), one copied, one waiting
    for a slot. Counting the copy fails: the save must not raise (the engine would let go
    of all three twice); the copied block is reported, the waiting one later."""
    s = Saves(slots=2)
    s.saver.save([saved(0)])  # pending for the remote tier: its slot stays taken
    monkeypatch.setattr(s.metrics, "observe_store", fail)
    s.saver.save([saved(0), saved(2), saved(3)])
    assert s.reported == [0, 0, 2] and s.saver.busy()  # 3 waits for a slot
    s.written()
    s.saver.retry_deferred()
    assert s.reported == [0, 0, 2, 3] and not s.saver.busy() and s.dropped() == 0
    assert s.pool.contains(key(saved(2))) and s.pool.contains(key(saved(3)))  # 3 evicted 0
    s.close()
