"""Redis for ``pfs bench kvcache``: start ``redis-server`` on loopback with a private
directory and port (and stop it), and a small blocking RESP2 client that does what the
benchmark needs (SET, GET into a caller's buffer, DEL, PING) - the ``redis`` package is
not a dependency of pfs."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


class RespError(OSError):
    pass


class Resp:
    """One connection to a Redis server."""

    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = io.BufferedReader(socket.SocketIO(self.sock, "rb"), 1 << 20)

    def _send(self, *parts: bytes | memoryview) -> None:
        head = b"*%d\r\n" % len(parts)
        chunks: list[bytes | memoryview] = [head]
        for p in parts:
            chunks += [b"$%d\r\n" % len(p), p, b"\r\n"]
        total = sum(len(c) for c in chunks)
        sent = self.sock.sendmsg(chunks)
        if sent < total:  # rare: the rest, as one buffer
            rest = b"".join(bytes(c) for c in chunks)[sent:]
            self.sock.sendall(rest)

    def _line(self) -> bytes:
        line = self.rfile.readline()
        if not line.endswith(b"\r\n"):
            raise RespError(0, "redis closed the connection")
        if line[:1] == b"-":
            raise RespError(0, f"redis: {line[1:-2].decode(errors='replace')}")
        return line[:-2]

    def ping(self) -> bool:
        self._send(b"PING")
        return self._line() == b"+PONG"

    def set(self, key: bytes, value: memoryview | bytes) -> None:
        self._send(b"SET", key, value)
        self._line()

    def get_into(self, key: bytes, out: memoryview) -> int | None:
        self._send(b"GET", key)
        line = self._line()
        n = int(line[1:])
        if n < 0:
            return None
        if n > len(out):
            raise RespError(0, f"redis value of {n} bytes, buffer {len(out)}")
        got = self.rfile.readinto(out[:n])
        if got != n or self.rfile.read(2) != b"\r\n":
            raise RespError(0, "redis: short value")
        return n

    def delete(self, keys: list[bytes]) -> int:
        self._send(b"DEL", *keys)
        return int(self._line()[1:])

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[tuple[int, int] | None]:
    """``(port, pid)`` of a redis-server started on loopback in ``workdir`` (no
    persistence), stopped on exit; None when redis-server is not installed."""
    exe = shutil.which("redis-server") or ("/usr/bin/redis-server"
                                           if os.path.exists("/usr/bin/redis-server") else None)
    if exe is None:
        yield None
        return
    d = workdir / "redis"
    d.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                             "--save", "", "--appendonly", "no", "--protected-mode", "yes",
                             "--logfile", str(d / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                c = Resp("127.0.0.1", port, timeout=1)
                ok = c.ping()
                c.close()
                if ok:
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {d / 'redis.log'}"
                                       ) from None
                time.sleep(0.05)
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
