"""A Valkey/Redis server of a benchmark's own, for its remote-tier cases."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class LoopbackServer:
    """A ``redis-server`` (or ``valkey-server``) on a free loopback port, no persistence."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("no valkey-server or redis-server on PATH")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"{binary} did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
