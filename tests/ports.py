"""Free loopback ports for the servers tests start, taken below the kernel's ephemeral range;
and :class:`LoopbackServer`, the base of the fake servers tests run in a thread.

A port that ``bind(0)`` hands out is an ephemeral one: between the moment a test picks it
and the moment its server binds it (or binds it again after a restart), any outgoing
connection on the machine may take it as its source port, and the server then fails to
start. Ports below the ephemeral range are never used that way.
"""
from __future__ import annotations

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
        for port in random.sample(candidates, 200):
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
