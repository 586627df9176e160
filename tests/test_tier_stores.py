"""The stores a tier configuration names: which exist, the pool's reservation, the stats kept
at the close, and the namespace of the keys."""
from __future__ import annotations

import pytest

from tiered_kv.config import TierConfig
from tiered_kv.tier_stores import TierStores, storage_namespace

SLOT = 64 << 10
ENGINE_NAMESPACE = b"model-a/bf16/16"


def test_lossless_codecs_share_the_engines_namespace_and_lossy_ones_get_their_own():
    assert storage_namespace(ENGINE_NAMESPACE, "raw") == ENGINE_NAMESPACE
    assert storage_namespace(ENGINE_NAMESPACE, "zstd") == ENGINE_NAMESPACE
    kivi4 = storage_namespace(ENGINE_NAMESPACE, "kivi4")
    assert kivi4 != ENGINE_NAMESPACE and len(kivi4) == 32
    assert storage_namespace(ENGINE_NAMESPACE, "kivi4+zstd") == kivi4  # same quantizer
    assert storage_namespace(ENGINE_NAMESPACE, "kivi2") not in (kivi4, ENGINE_NAMESPACE)
    assert storage_namespace(b"model-b/bf16/16", "kivi4") != kivi4


def test_only_the_configured_stores_exist_and_the_pool_is_a_tier_only_with_cpu_bytes(tmp_path):
    stores = TierStores(TierConfig(kv_cache_dir=tmp_path / "kv", cpu_bytes=0, disk_bytes=8 << 20))
    try:
        assert stores.pool is None and stores.disk is not None and stores.remote is None
        assert list(stores.stats()) == ["disk"]
        stores.reserve_pool(SLOT, pin_memory=False)  # the staging buffer only
        assert stores.pool is not None and list(stores.by_tier()) == ["disk"]
        assert stores.first_lower_tier() == "disk"
    finally:
        stores.close()


def test_the_cpu_tier_reports_its_budget_before_its_pool_exists_and_its_stats_after_close():
    stores = TierStores(TierConfig(cpu_bytes=4 * SLOT))
    assert stores.stats()["cpu"].capacity_bytes == 4 * SLOT
    assert stores.by_tier() == {} and stores.first_lower_tier() == "cpu"
    pool = stores.reserve_pool(SLOT, pin_memory=False)
    assert stores.by_tier() == {"cpu": pool}
    stores.close()
    after = stores.stats()
    assert after["cpu"].capacity_bytes == 4 * SLOT and stores.stats() is after


@pytest.mark.parametrize("fields, setting", [
    ({"cpu_bytes": SLOT - 1}, "cpu_bytes"),
    ({"cpu_bytes": 0, "staging_bytes": SLOT // 2, "disk_bytes": 8 << 20}, "staging_bytes"),
])
def test_a_pool_that_holds_no_block_is_refused_naming_its_setting(tmp_path, fields, setting):
    stores = TierStores(TierConfig(kv_cache_dir=tmp_path / "kv", **fields))
    try:
        with pytest.raises(ValueError, match=f"{setting}=.*holds no KV block"):
            stores.reserve_pool(SLOT, pin_memory=False)
        assert stores.pool is None
    finally:
        stores.close()
