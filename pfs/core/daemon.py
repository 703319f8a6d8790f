"""What every pfs server process does around its service: report readiness on a pipe,
then serve until SIGTERM or SIGINT; and the supervisor's side of that pipe."""
from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)


def report_ready(ready_fd: int | None, port: int) -> None:
    """Write the bound port as one line to ``ready_fd`` (a supervisor's pipe), close it."""
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, f"{port}\n".encode())
    finally:
        os.close(ready_fd)


def wait_ready(rfd: int, timeout: float) -> bytes | None:
    """The supervisor's side of :func:`report_ready`: the line the child writes to the
    pipe ``rfd`` (without its newline), or None when the child closed the pipe (exited)
    first. TimeoutError when no line came in ``timeout`` seconds. Leaves ``rfd`` open."""
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([rfd], [], [], left)[0]:
            raise TimeoutError(f"no line on the ready pipe in {timeout:g} s")
        chunk = os.read(rfd, 4096)
        if not chunk:
            return None
        line += chunk
    return line[:-1]


async def serve_until_signalled(serve: Callable[..., Awaitable[Any]], what: str,
                                ready_fd: int | None = None) -> None:
    """Start ``serve`` (a ``nursery.start``-able server reporting its port), tell the
    supervisor, and stop it cleanly on the first SIGTERM or SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve)
            log.info("%s ready on port %d", what, port)
            report_ready(ready_fd, port)
            async for signum in signals:
                log.info("%s stopping on %s", what, signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
