"""Fixtures shared across test modules, and the guard that keeps non-``cuda`` tests off the GPU."""
from __future__ import annotations

import functools

import pytest
import torch

from redis_server import RedisServer, server_binary
from storage import cluster_pipeline, remote_calls
from storage.circuit_breaker import CircuitBreaker
from test_circuit_breaker import Clock

# Whether this machine has a GPU, asked once at collection. Every test names its device (a
# non-``cuda`` test: ``device="cpu"``, ``pin_memory=False``, a child process started with
# CUDA_VISIBLE_DEVICES=""), since ``device="auto"``, the default everywhere, picks the GPU
# where there is one.
CUDA = torch.cuda.is_available()
_CUDA_BEFORE = pytest.StashKey[tuple[bool, int]]()


def _cuda_state() -> tuple[bool, int]:
    """Whether this process has initialized CUDA, and how many device allocations torch's
    allocator has made in it so far (a count that only grows: freed memory still counts)."""
    if not torch.cuda.is_initialized():
        return False, 0
    return True, sum(
        torch.cuda.memory_stats(i).get("allocation.all.allocated", 0)
        for i in range(torch.cuda.device_count())
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    if CUDA:  # before any fixture of the test, module-scoped ones included
        item.stash[_CUDA_BEFORE] = _cuda_state()
    return (yield)


@pytest.fixture(autouse=True)
def _non_cuda_tests_stay_off_the_gpu(request):
    """On a GPU machine, fail a test not marked ``cuda`` that initialized CUDA or allocated
    device memory in this process (in its body or in a fixture it set up): it forgot to
    name its device, and would hold the GPU's memory from the tests after it. Only a first
    initialization can be seen: once a ``cuda`` test has initialized CUDA, device
    allocations still are, pinned host memory is not (``pytest -m "not cuda"`` sees both).
    Child processes are not watched; their helpers hide the GPU from them."""
    if not CUDA or request.node.get_closest_marker("cuda") is not None:
        yield
        return
    yield
    before = request.node.stash.get(_CUDA_BEFORE, None)
    if before is None:
        return
    (was_initialized, allocations), (initialized, now) = before, _cuda_state()
    if initialized and not was_initialized:
        pytest.fail("a test not marked cuda initialized CUDA: name its device "
                    "(device=\"cpu\", pin_memory=False), or mark it cuda", pytrace=False)
    if now > allocations:
        pytest.fail(f"a test not marked cuda made {now - allocations} CUDA allocations: name its "
                    "device (device=\"cpu\"), or mark it cuda", pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    """One Valkey/Redis server for the session; tests keep apart by key prefix."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_server(tmp_path) -> RedisServer:
    """A server of this test's own, to stop, pause or restart."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    yield server
    server.resume()
    server.stop()


@pytest.fixture
def breaker_clock(monkeypatch) -> Clock:
    """The clock of the circuit breakers of the remote stores made from now on (the
    store's, and each cluster node's), standing still until the test moves ``now``: a
    cooldown passes when the test says, however long a loaded machine took over the calls
    before it."""
    clock = Clock()
    breaker = functools.partial(CircuitBreaker, clock=clock)
    monkeypatch.setattr(remote_calls, "CircuitBreaker", breaker)
    monkeypatch.setattr(cluster_pipeline, "CircuitBreaker", breaker)
    return clock
