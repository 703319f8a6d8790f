"""What the ``pfs`` commands print: sizes, user names, errors as one line, JSON or
human tables, progress bars."""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# A progress bar only for transfers at least this long (and only on a terminal).
PROGRESS_MIN = 64 << 20

# Exit statuses: 1 for a failed operation (as cp and ls), 2 for a usage error (argparse),
# 69 (sysexits' EX_UNAVAILABLE) when the cluster could not be reached, 130 for Ctrl-C.
EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 1, 2, 69, 130
_UNREACHABLE = {errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                errno.ECONNRESET, errno.EHOSTDOWN, errno.ENOTCONN}


def parse_size(text: str) -> int:
    """``4096``, ``64K``, ``1M``, ``2G`` (binary units; a trailing B or iB is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _SUFFIX else (t, "")
    try:
        value = float(num) * _SUFFIX[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text}") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a size: {text}")
    return int(value)


def human(n: float) -> str:
    """A byte count as people read it: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tool_version() -> str:
    """``pfs 0.1.0 (protocol 1)``: this installation and the newest protocol it speaks."""
    from pfs.core.versions import PROTOCOL_MAX, package_version

    return f"pfs {package_version()} (protocol {PROTOCOL_MAX})"


def user_name(uid: int) -> str:
    """The local name of ``uid`` where this machine knows it, else the number."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False, default=str))


# -- errors ----------------------------------------------------------------------------
_BYTES_REPR = re.compile(r"""b(['"])(.*?)\1""")


def _plain(text: object) -> str:
    """``b'name'`` (a server's bytes repr) as ``name``, on one line."""
    s = os.fsdecode(text) if isinstance(text, bytes) else str(text)
    return " ".join(_BYTES_REPR.sub(r"\2", s).split())


def error_line(exc: OSError) -> str:
    """One line: the path, what went wrong, the errno's name."""
    msg = _plain(exc.strerror or exc.args[0] if exc.args else exc)
    where = [_plain(f) for f in (exc.filename, exc.filename2) if f is not None]
    if where and not msg.startswith(where[0]):
        msg = f"{' -> '.join(where)}: {msg}"
    name = errno.errorcode.get(exc.errno or 0)
    return f"{msg} [{name}]" if name else msg


def exit_status(exc: OSError) -> int:
    return EXIT_UNAVAILABLE if exc.errno in _UNREACHABLE else EXIT_FAILED


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """An OSError from this block that names no file names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            msg = _plain(exc.strerror or exc).removesuffix(f": {path}")
            raise type(exc)(exc.errno, msg, path) from None
        raise


# -- progress --------------------------------------------------------------------------
class Progress:
    """A tqdm bar on stderr for long work: ``unit`` "B" counts bytes (a bar only from
    :data:`PROGRESS_MIN` bytes), any other unit counts steps (a benchmark's phases).
    Nothing when stderr is no terminal (``force`` decides instead when given). The size
    may come later (:meth:`set_total`: ``pfs load`` knows it once the reads are
    planned); the bar appears then, or at the first :meth:`add`."""

    def __init__(self, total: int | None, label: str, force: bool | None = None,
                 unit: str = "B") -> None:
        self._label, self._force, self._unit = label, force, unit
        self._total = total
        self._bar: Any = None
        self._done = False

    def _on(self) -> bool:
        if self._force is not None:
            return self._force
        return sys.stderr.isatty() and (self._unit != "B" or self._total is None
                                        or self._total >= PROGRESS_MIN)

    def _open(self) -> Any:
        if self._bar is None and not self._done and self._on():
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, desc=self._label, unit=self._unit,
                             unit_scale=self._unit == "B", unit_divisor=1024, leave=False,
                             file=sys.stderr)
        self._done = True  # decided: on (a bar) or off
        return self._bar

    def set_total(self, total: int) -> None:
        self._total = total
        bar = self._bar if self._done else self._open()
        if bar is not None:
            bar.total = total
            bar.refresh()

    def add(self, n: int) -> None:
        bar = self._bar if self._done else self._open()
        if bar is not None:
            bar.update(n)

    def write(self, text: str) -> None:
        """A line on stderr that does not tear the bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._done = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
