"""The mount's quick metaserver calls (``MetaClient.run_now``): read-only calls made at
once over a blocking connection of their own, answered as the usual ones are, and left
to the usual path (which retries) whenever that connection is not there or fails."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import trio

from pfs.client import ops
from pfs.client.aio import AsyncClient
from pfs.client.types import StatResult
from pfs.core.messages.records import At


def test_quick_calls_answer_as_the_usual_ones_and_step_aside_when_broken(client_toml: Path) -> None:
    async def main() -> None:
        async with AsyncClient.connect(client_toml) as c:
            meta = c.meta
            d = f"/quick-{os.getpid()}"
            await c.makedirs(d, exist_ok=True)
            await c.write_file(f"{d}/f", b"abc")
            parent = (await c.stat(d)).st_ino
            usual = await meta.lookup(parent, b"f")

            got: StatResult | None = None
            with trio.fail_after(10):  # the first call opens the connection, in a thread
                while got is None:
                    got = meta.lookup_now(parent, b"f")
                    if got is None:
                        await trio.sleep(0.02)
            assert got == usual
            assert meta.getattr_now(usual.st_ino) == await meta.getattr(usual.st_ino)
            with pytest.raises(FileNotFoundError):  # an answer, raised as itself
                meta.lookup_now(parent, b"missing")

            # a plan that changes something is never run here (nothing is sent)
            plan = ops.meta_mkdir(At(parent, b"made"), 0o755, meta.wire_cred())
            assert meta.run_now(plan) is None
            with pytest.raises(FileNotFoundError):
                await meta.lookup(parent, b"made")

            # the connection breaks: the call steps aside (the usual path answers), and
            # the next ones do too for a while, without trying to reconnect at once
            rpc = meta._now_rpc
            assert rpc is not None
            rpc.conn.sock.shutdown(socket.SHUT_RDWR)
            assert meta.lookup_now(parent, b"f") is None
            assert rpc.conn.closed and meta._now_rpc is None
            assert meta.lookup_now(parent, b"f") is None
            assert (await meta.lookup(parent, b"f")).st_ino == usual.st_ino

    trio.run(main)
