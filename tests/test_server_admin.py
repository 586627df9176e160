"""The OpenAI-compatible server in-process: API and admin keys, the admin routes, a degraded tier."""
from __future__ import annotations

import pytest

from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.lmdb_store import LmdbStore
from server_testing import ADMIN, GREEDY, assert_error, run, tiered_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiered_llm(tmp_path_factory)


# ---------------------------------------------------------------- auth


def test_each_key_guards_its_own_routes_and_health_and_metrics_are_open(llm):
    keys = {"api": "Bearer s3cret", "admin": "Bearer adm1n", "wrong": "Bearer nope"}

    async def test(c):
        results = []
        for route in c.app.routes:
            methods = sorted(route.methods - {"HEAD"}) if getattr(route, "methods", None) else ["GET"]
            for method in methods:
                got = {"none": await c.request(method, route.path)}
                for name, value in keys.items():
                    got[name] = await c.request(method, route.path, headers={"Authorization": value})
                results.append((route.path, method, got))
        return results

    results = run(llm, test, api_key="s3cret", admin_api_key="adm1n")
    paths = {path for path, *_ in results}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health",
            "/admin/tiers", "/admin/flush", "/admin/evict", "/admin/clear"} <= paths
    for path, method, got in results:
        if path in ("/health", "/ping", "/version", "/metrics"):  # open, as vLLM's are
            assert {r.status_code for r in got.values()} == {200}, path
            continue
        own = "admin" if path.startswith("/admin/") else "api"
        for name, response in got.items():
            if name == own:
                assert response.status_code != 401, (method, path)
            else:  # no key, a wrong one, or the other route family's key
                assert_error(response, 401, code="invalid_api_key")


def test_admin_routes_are_off_without_an_admin_key(llm):
    async def test(c):
        return [await c.get("/admin/tiers"), await c.post("/admin/flush")]

    for response in run(llm, test, api_key="s3cret", headers={"Authorization": "Bearer s3cret"}):
        assert_error(response, 404, code="not_found")
        assert "--admin-api-key" in response.json()["error"]["message"]


def test_valid_key_reaches_the_model(llm):
    async def test(c):
        headers = {"Authorization": "Bearer s3cret"}
        return await c.post("/v1/completions", json={"prompt": "x", **GREEDY}, headers=headers)

    assert run(llm, test, api_key="s3cret").status_code == 200


# ---------------------------------------------------------------- admin


def test_admin_routes(llm):
    prompt = "An admin test prompt that fills a few blocks of KV. " * 3

    async def test(c):
        await c.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        flushed = await c.post("/admin/flush")
        before = await c.get("/admin/tiers")
        evicted = await c.post("/admin/evict", json={"tier": "cpu"})
        after_evict = await c.get("/admin/tiers")
        bad = await c.post("/admin/clear", json={"namespace": "zz"})
        other = await c.post("/admin/clear", json={"namespace": "ab" * 32})
        cleared = await c.post("/admin/clear")
        after_clear = await c.get("/admin/tiers")
        return flushed, before, evicted, after_evict, bad, other, cleared, after_clear

    flushed, before, evicted, after_evict, bad, other, cleared, after_clear = run(llm, test, **ADMIN)
    assert flushed.json() == {"flushed": True, "degraded": []}
    report = before.json()
    assert set(report["tiers"]) == {"cpu", "disk"}
    assert report["engine"]["num_running"] == 0 and report["engine"]["num_blocks"] == 64
    cpu, disk = report["tiers"]["cpu"]["entries"], report["tiers"]["disk"]["entries"]
    assert cpu > 0 and disk > 0
    assert evicted.json() == {"namespace": report["namespace"], "evicted": {"cpu": cpu}}
    assert after_evict.json()["tiers"]["cpu"]["entries"] == 0
    assert after_evict.json()["tiers"]["disk"]["entries"] == disk
    assert_error(bad, 400, param="namespace")
    assert other.json()["evicted"] == {"cpu": 0, "disk": 0}
    assert cleared.json()["evicted"] == {"cpu": 0, "disk": disk}
    assert after_clear.json()["tiers"]["disk"]["entries"] == 0


def test_a_degraded_disk_shows_on_health_and_flush(llm, monkeypatch):
    """The store's own tests drive a full disk into the degraded state; here, the server
    must say so: /health stays 200 (it still serves) with the tier named, and so does flush."""
    monkeypatch.setattr(LmdbStore, "degraded", property(lambda self: True))

    async def test(c):
        return await c.get("/health"), await c.post("/admin/flush")

    health, flushed = run(llm, test, **ADMIN)
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "degraded": ["disk"]}
    assert flushed.json()["degraded"] == ["disk"]
