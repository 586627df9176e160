"""Servers for the remote-tier tests: a throwaway Valkey/Redis server (its own process on a
free loopback port, no persistence, in a temporary directory), :class:`RedisCluster` (three
such servers in cluster mode, the slots split between them) and :class:`DripServer`, a fake
server that answers slowly."""
from __future__ import annotations

import select
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import valkey
from valkey.crc import key_slot

from ports import LoopbackServer, free_port

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    for name in BINARIES:
        path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if path:
            return path
    return None


class RedisServer:
    """Start, stop and restart one server process on a fixed port; ``extra``: more
    command-line options."""

    def __init__(self, binary: str, workdir: Path, extra: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.workdir = workdir
        self.extra = extra
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = valkey.Valkey(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except valkey.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.binary} did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections and its port but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> valkey.Valkey:
        return valkey.Valkey(port=self.port)


SLOTS = 16384


class RedisCluster:
    """A Valkey/Redis Cluster of ``size`` primaries on loopback, no replicas: each node its
    own process and directory (its ``nodes.conf`` lets a stopped node rejoin with its slots
    when started again), on a free port and a free cluster-bus port. The slots are split in
    equal ranges (``CLUSTER ADDSLOTSRANGE``), each node is given a config epoch of its own
    (``CLUSTER SET-CONFIG-EPOCH``, as ``redis-cli --cluster create`` does) and the nodes
    introduced (``CLUSTER MEET``); ``extra``: more command-line options for every node.

    Without their own epochs the nodes all start at 0 and tell theirs apart by gossip, over
    seconds; a slot moved meanwhile can go back to its old owner at the new one, which then
    deletes the keys moved to it (as keys of a slot it lost) and redirects to the old owner,
    which redirects back."""

    def __init__(self, binary: str, workdir: Path, size: int = 3, node_timeout_ms: int = 5000,
                 extra: tuple[str, ...] = ()) -> None:
        self.nodes: list[RedisServer] = []
        self.bus_ports: list[int] = []
        for i in range(size):
            (workdir / f"node{i}").mkdir(parents=True, exist_ok=True)
            bus = free_port()
            self.bus_ports.append(bus)
            self.nodes.append(RedisServer(binary, workdir / f"node{i}", (
                "--cluster-enabled", "yes", "--cluster-port", str(bus),
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), *extra,
            )))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/?cluster=1"

    def start(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            node.start()
        clients = [node.client() for node in self.nodes]
        try:
            bounds = [SLOTS * i // len(clients) for i in range(len(clients) + 1)]
            for epoch, (client, start, end) in enumerate(zip(clients, bounds, bounds[1:]), 1):
                client.execute_command("CLUSTER ADDSLOTSRANGE", start, end - 1)
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port, bus)
            self.wait_ok(timeout, clients)
        finally:
            for client in clients:
                client.close()

    def wait_ok(self, timeout: float = 20.0, clients: list | None = None) -> None:
        """Until every node sees every other and every slot's owner, and says
        ``cluster_state:ok`` (which a node says with slots unknown to it where the cluster
        does not require full coverage)."""
        own = clients is None
        clients = clients or [node.client() for node in self.nodes]
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    infos = [c.execute_command("CLUSTER INFO") for c in clients]
                    if all(_cluster_ok(info, len(clients)) for info in infos):
                        return
                except valkey.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok after {timeout} s")
                time.sleep(0.05)
        finally:
            if own:
                for client in clients:
                    client.close()

    def owner(self, key: bytes) -> RedisServer:
        """The node whose slots hold ``key``, as :meth:`start` split them."""
        slot = key_slot(key)
        return next(node for i, node in enumerate(self.nodes)
                    if slot < SLOTS * (i + 1) // len(self.nodes))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()  # SIGKILL: a paused node too


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory) -> RedisCluster:
    """A 3-node cluster for a test module (import this fixture into it); tests keep apart by
    key prefix."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    cluster = RedisCluster(binary, tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _cluster_ok(info, size: int) -> bool:
    if isinstance(info, bytes):
        info = info.decode()
    if isinstance(info, str):
        info = dict(line.split(":", 1) for line in info.split() if ":" in line)
    return (info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == size
            and int(info.get("cluster_slots_assigned", 0)) == SLOTS)


class DripServer(LoopbackServer):
    """A fake server on loopback that is alive but slow: it answers the client's connection
    handshake (``CLIENT``, ``SELECT``, ``PING``) at once, and to any other command starts a
    valid-looking reply (a 64 KiB bulk string) that it sends one byte every ``interval_s``,
    for at most ``drip_for_s`` seconds, then hangs up.

    ``accepted`` counts connections; ``hung_up_by_client`` counts those the client closed
    while a reply was still dripping."""

    def __init__(self, interval_s: float = 0.05, drip_for_s: float = 3.0) -> None:
        self.interval_s = interval_s
        self.drip_for_s = drip_for_s
        self.accepted = 0
        self.hung_up_by_client = 0
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accepted(self, conn: socket.socket) -> None:
        self.accepted += 1

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as commands:
            try:
                while not self._stopping.is_set():
                    command = _read_command(commands)
                    if command is None:
                        return
                    name = command[0].upper()
                    if name in (b"CLIENT", b"SELECT"):
                        conn.sendall(b"+OK\r\n")
                    elif name == b"PING":
                        conn.sendall(b"+PONG\r\n")
                    else:
                        self._drip(conn)
                        return
            except OSError:
                return

    def _drip(self, conn: socket.socket) -> None:
        reply = b"$65536\r\n" + b"x" * 65536 + b"\r\n"
        end = time.monotonic() + self.drip_for_s
        for i in range(len(reply)):
            if self._stopping.is_set() or time.monotonic() > end:
                return
            try:
                readable, _, _ = select.select([conn], [], [], self.interval_s)
                if readable and not conn.recv(1 << 16):  # b"": the client hung up
                    raise ConnectionResetError
                conn.sendall(reply[i : i + 1])
            except OSError:
                with self._lock:
                    self.hung_up_by_client += 1
                return


def _read_command(commands) -> list[bytes] | None:
    """One RESP command (an array of bulk strings); ``None`` when the client hung up."""
    header = commands.readline()
    if not header.startswith(b"*"):
        return None
    args = []
    for _ in range(int(header[1:])):
        length = int(commands.readline()[1:])
        args.append(commands.read(length + 2)[:-2])
    return args
