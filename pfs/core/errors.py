"""Error codes: defined once, carried on the wire as errno, raised as OSError.

A server turns an ``OSError`` raised by its handler into an error frame
``{"errno": e.errno, "msg": str}``; the client turns that frame back into the
same ``OSError``. Anything else that escapes a handler is a bug: the server
logs it and answers EIO so the peer is never left waiting.
"""
from __future__ import annotations

import errno
import os


class ProtocolError(Exception):
    """Base for framing problems: the byte stream can no longer be trusted."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the framing rules (bad magic, oversized lengths, bad msgpack)."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the framing cannot carry."""


def from_wire(code: object, msg: object) -> OSError:
    """Rebuild the OSError a server sent; an unknown code becomes EIO."""
    if not isinstance(code, int) or code <= 0 or code > 4095:
        code = errno.EIO
    text = msg if isinstance(msg, str) else os.strerror(code)
    return OSError(code, text)


def to_wire(exc: OSError) -> dict[str, object]:
    code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO
    return {"errno": code, "msg": exc.strerror or os.strerror(code)}
