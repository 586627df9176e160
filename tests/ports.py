"""Free loopback ports for the servers tests start, taken below the kernel's ephemeral range;
and :class:`LoopbackServer`, the base of the fake servers tests run in a thread.

A port that ``bind(0)`` hands out is an ephemeral one: between the moment a test picks it
and the moment its server binds it (or binds it again after a restart), any outgoing
connection on the machine may take it as its source port, and the server then fails to
start. Ports below the ephemeral range are never used that way. Each process remembers the
ports it handed out; pytest-xdist workers pick from shares of the range of their own, so two
workers never hand out the same port (a server started on a port another worker's server
took would answer that worker's checks).
"""
from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
_given: set[int] = set()  # not handed out twice by one process


def _below_ephemeral() -> range | None:
    try:
        first = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST, first) if first - _LOWEST >= 1000 else None


def _own_share(ports: range) -> range:
    """This process's share of ``ports``: every n-th one from its own offset for worker k
    of n pytest-xdist workers, all of them otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        count = 1
    if count > 1 and worker.startswith("gw") and worker[2:].isdigit():
        return ports[int(worker[2:]) % count :: count]
    return ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range where the system
    says where that is (else whatever ``bind(0)`` gives)."""
    candidates = _below_ephemeral()
    if candidates is not None:
        candidates = _own_share(candidates)
        for port in random.sample(candidates, min(200, len(candidates))):
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port


class LoopbackServer:
    """A test's own server on a loopback port ``bind(0)`` picks (never restarted on it): a
    thread accepts connections and serves each on a thread of its own (``_serve``, the
    subclass's). ``_accepted(conn)`` is told of each connection first, under ``_lock``;
    ``_stopping`` is set once :meth:`stop` is called, which waits for the threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.05)  # the accept loop sees soon that it is to stop
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _accepted(self, conn: socket.socket) -> None:
        """A connection came in (called under ``_lock``)."""

    def _stop_serving(self) -> None:
        """:meth:`stop` has set ``_stopping``: end what would keep a serving thread waiting."""

    def stop(self) -> None:
        self._stopping.set()
        self._stop_serving()
        for t in list(self._threads):
            t.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self._accepted(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()
