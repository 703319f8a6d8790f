"""What every pfs server process does around its service: a private umask and the
highest open-file limit allowed (:func:`harden_process`), report readiness on a pipe,
serve until SIGTERM or SIGINT, and log the real exception when it dies; and the
supervisor's side of that pipe."""
from __future__ import annotations

import logging
import os
import resource
import select
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from pfs.core.config import ConfigError
from pfs.core.versions import FormatError

log = logging.getLogger(__name__)

# refusals at start whose message is the whole story (a key file others can read, a
# store in a newer format): the entry point logs them in one line, without a traceback
EXPECTED = (ConfigError, FormatError)
UMASK = 0o077  # what a server creates (database, keys, objects) is the service's alone
FD_RESERVE = 128  # descriptors kept aside (logs, engine, store, registration, threads)


def harden_process() -> int:
    """Make this process a server's: umask 077, RLIMIT_NOFILE raised to its hard limit
    where allowed. The soft limit it ends with."""
    os.umask(UMASK)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard,
                        exc)
    return nofile_limit()


def nofile_limit() -> int:
    """The soft limit on open descriptors of this process (what sizes connection limits
    and descriptor caches)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups: what actually went wrong."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


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
    cause = "served to the end"
    nofile = harden_process()
    log.info("%s: umask %04o, open-file limit %d", what, UMASK, nofile)
    with logged_death(what):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve)
                log.info("%s ready on port %d", what, port)
                report_ready(ready_fd, port)
                async for signum in signals:
                    cause = signal.Signals(signum).name
                    log.info("%s stopping on %s", what, cause)
                    nursery.cancel_scope.cancel()
                    break
    log.info("%s stopped cleanly (%s)", what, cause)


LOGGED = "(logged by pfs.core.daemon)"  # a note on exceptions logged with their traceback


def log_crash(what: str, exc: BaseException) -> int:
    """At a server's entry point, for what :func:`logged_death` did not take (it failed
    before serving): log each cause with its traceback, once, and give the exit status
    (1), instead of a raw traceback on stderr that a JSON log would not parse."""
    for e in leaves(exc):
        if LOGGED not in getattr(e, "__notes__", ()):
            log.critical("%s died: %s: %s", what, type(e).__name__, e, exc_info=e)
    return 1


@contextmanager
def logged_death(what: str) -> Iterator[None]:
    """Log what ends a server, unwrapped from trio's exception groups (not "Exceptions
    from Trio nursery"), each with its traceback; re-raise it (the one exception itself
    when there is one, so the entry point can name it)."""
    try:
        yield
    except BaseException as exc:  # logged, not handled: re-raised below
        real = [e for e in leaves(exc) if not isinstance(e, (trio.Cancelled, KeyboardInterrupt))]
        for e in real:
            if isinstance(e, EXPECTED):  # its message says what to do; the entry point says it
                continue
            log.critical("%s died: %s: %s", what, type(e).__name__, e, exc_info=e)
            e.add_note(LOGGED)
        if len(real) == 1 and real[0] is not exc:
            raise real[0] from None
        raise
