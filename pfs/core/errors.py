"""Error codes: defined once, carried on the wire as errno, raised as OSError.

A server turns an ``OSError`` raised by its handler into an error frame
``{"errno": e.errno, "msg": str}``; the client turns that frame back into the
same ``OSError``. Anything else that escapes a handler is a bug: the server
logs it and answers EIO so the peer is never left waiting.

:data:`FAILURES` is the one table of what each failure becomes (its errno) and what a
caller does about it (:class:`Action`); docs/architecture.md ("Errors") renders it
(:func:`markdown`, checked by tests/unit/test_errors.py). The client's classes are
derived from it: the data planner's (``pfs.client.plan``: renew, reconnect, the caller's
errno, the next replica) and the metadata client's retries (:func:`transient`).
"""
from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass


class ProtocolError(Exception):
    """Base for framing problems: the byte stream can no longer be trusted."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the framing rules (bad magic, oversized lengths, bad msgpack)."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the framing cannot carry."""


class Final(OSError):
    """An error the client never retries, whatever its errno: an authentication
    refused, no protocol version in common, an outage that outlasted the deadline."""


class Action(enum.Enum):
    """What the client does with a failure (the table's last column)."""

    RECONNECT = "reconnect and retry"  # the connection failed; nothing to blame on the request
    WAIT = "wait and retry"  # the server is up but not ready; it did nothing
    RENEW = "renew the capability and retry"
    REOPEN = "open the inode again and retry"
    REPLICA = "the next replica, else fail"  # this server failed the request
    FAIL = "fail: the caller's answer"  # retrying cannot help

    @property
    def retried(self) -> bool:
        return self is not Action.FAIL


@dataclass(frozen=True, slots=True)
class Failure:
    what: str  # the failure, in words
    errno: int
    action: Action


# Order matters where an errno appears twice: its first row is its class (EACCES from a
# data server is a refused capability before it is a refused key: the key refusal comes
# as a Final error, which is never retried).
FAILURES: tuple[Failure, ...] = (
    Failure("connection refused (server down, restarting)", errno.ECONNREFUSED,
            Action.RECONNECT),
    Failure("connection reset, or cut during the authentication handshake",
            errno.ECONNRESET, Action.RECONNECT),
    Failure("connection broken while sending", errno.EPIPE, Action.RECONNECT),
    Failure("connection aborted", errno.ECONNABORTED, Action.RECONNECT),
    Failure("host unreachable", errno.EHOSTUNREACH, Action.RECONNECT),
    Failure("no connection to the metaserver (it went away)", errno.ENOTCONN,
            Action.RECONNECT),
    Failure("a connect, handshake or reply timed out", errno.ETIMEDOUT, Action.RECONNECT),
    Failure("a frame broke the protocol (the connection is dropped)", errno.EPROTO,
            Action.RECONNECT),
    Failure("a frame failed its authentication tag (changed on the way; the connection "
            "is dropped)", errno.EBADMSG, Action.RECONNECT),
    Failure("metaserver starting: data servers not yet reported again", errno.EAGAIN,
            Action.WAIT),
    Failure("capability refused or expired", errno.EACCES, Action.RENEW),
    Failure("capability stale (truncation, server restart)", errno.ESTALE, Action.RENEW),
    Failure("handle unknown to the metaserver (it restarted)", errno.EBADF, Action.REOPEN),
    Failure("data server I/O error, checksum mismatch, object missing", errno.EIO,
            Action.REPLICA),
    Failure("the client's key or certificate refused", errno.EACCES, Action.FAIL),
    Failure("no protocol version in common", errno.EPROTO, Action.FAIL),
    Failure("no data server can take the data (all full or down)", errno.ENOSPC,
            Action.FAIL),
    Failure("metadata store full (unlink and rmdir still run)", errno.ENOSPC, Action.FAIL),
    Failure("data server's disk full", errno.ENOSPC, Action.FAIL),
    Failure("invalid argument (negative size or offset), refused where it enters",
            errno.EINVAL, Action.FAIL),
    Failure("size or write end past the largest file size (`MAX_FILE_SIZE`)",
            errno.EFBIG, Action.FAIL),
    Failure("an outage outlasted the client's `timeout`", errno.ETIMEDOUT, Action.FAIL),
    Failure("a server's bug (an unexpected exception, logged there)", errno.EIO,
            Action.FAIL),
)


def _first() -> dict[int, Action]:
    out: dict[int, Action] = {}
    for f in FAILURES:
        out.setdefault(f.errno, f.action)
    return out


ACTION_OF: dict[int, Action] = _first()


def errnos(*actions: Action) -> frozenset[int]:
    """The errnos whose class (first row) is one of ``actions``."""
    return frozenset(code for code, act in ACTION_OF.items() if act in actions)


def action(exc: OSError) -> Action:
    """What to do with ``exc``: its errno's class; FAIL for a :class:`Final` error or an
    errno the table does not name (a POSIX answer of the namespace: ENOENT, EEXIST...)."""
    if isinstance(exc, Final) or exc.errno is None:
        return Action.FAIL
    return ACTION_OF.get(exc.errno, Action.FAIL)


def transient(exc: OSError) -> bool:
    """An outage the client retries within its deadline (reconnect, or wait)."""
    return action(exc) in (Action.RECONNECT, Action.WAIT)


# The largest file size or end of a write: the largest off_t (a larger file could not be
# stat'd; every layout's objects hold it, MAX_UNIT * 2**63 / MAX_UNIT per stripe).
MAX_FILE_SIZE = (1 << 63) - 1


def check_size(size: int, what: str) -> None:
    """Refuse a size (or end of a write) where it enters: EINVAL when negative, EFBIG
    past MAX_FILE_SIZE; ``what`` names the file and the operation."""
    if size < 0:
        raise OSError(errno.EINVAL, f"{what}: size {size} is negative")
    if size > MAX_FILE_SIZE:
        raise OSError(errno.EFBIG, f"{what}: size {size} is past the largest file size "
                                   f"({MAX_FILE_SIZE})")


def markdown() -> str:
    """The table as docs/architecture.md shows it."""
    rows = ["| failure | errno | retried | what the client does |", "|---|---|---|---|"]
    for f in FAILURES:
        rows.append(f"| {f.what} | `{errno.errorcode[f.errno]}` | "
                    f"{'yes' if f.action.retried else 'no'} | {f.action.value} |")
    return "\n".join(rows)


def from_wire(code: object, msg: object) -> OSError:
    """Rebuild the OSError a server sent; an unknown code becomes EIO."""
    if not isinstance(code, int) or code <= 0 or code > 4095:
        code = errno.EIO
    text = msg if isinstance(msg, str) else os.strerror(code)
    return OSError(code, text)


def to_wire(exc: OSError) -> dict[str, object]:
    code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO
    return {"errno": code, "msg": exc.strerror or os.strerror(code)}
