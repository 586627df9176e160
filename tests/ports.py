"""Free loopback ports for the servers tests start, taken below the kernel's ephemeral range.

A port that ``bind(0)`` hands out is an ephemeral one: between the moment a test picks it
and the moment its server binds it (or binds it again after a restart), any outgoing
connection on the machine may take it as its source port, and the server then fails to
start. Ports below the ephemeral range are never used that way.
"""
from __future__ import annotations

import random
import socket
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
