"""``pfs put`` and ``pfs get``: copies between local disk and pfs, as ``cp`` does them.

Each file is written under a temporary name in its destination directory and renamed
over the final name only once it is complete, so an interrupted copy (Ctrl-C, a lost
server) leaves the old file or none, never a partial one; the temporary file is removed
on the way out. ``-`` is stdin (put) or stdout (get). A directory destination receives
the source under its own name; ``-r`` copies trees.
"""
from __future__ import annotations

import argparse
import errno
import os
import posixpath
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from pfs.tools.output import Progress, human, naming

COPY_CHUNK = 32 << 20


def _tmp_name(final: str, join: Callable[[str, str], str], split: Callable[[str], tuple[str, str]]) -> str:
    head, tail = split(final)
    return join(head, f".{tail}.pfs-tmp-{os.getpid()}")


class Totals:
    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self.t0 = time.perf_counter()

    def report(self, what: str, verbose: bool) -> None:
        secs = time.perf_counter() - self.t0
        if verbose or (sys.stderr.isatty() and self.bytes >= (64 << 20)):
            print(f"{what}: {self.files} file(s), {human(self.bytes)} in {secs:.2f} s "
                  f"({human(self.bytes / max(secs, 1e-9))}/s)", file=sys.stderr)


def _copy(src: Any, dst: Any, total: int | None, label: str, tot: Totals) -> None:
    buf = bytearray(COPY_CHUNK if total is None else min(COPY_CHUNK, max(total, 1)))
    view = memoryview(buf)
    with Progress(total, label) as bar:
        while n := src.readinto(buf):
            dst.write(view[:n])
            bar.add(n)
            tot.bytes += n
    tot.files += 1


# -- put -------------------------------------------------------------------------------
def _remote_isdir(c: Any, path: str) -> bool:
    try:
        return bool(c.stat(path).is_dir())
    except FileNotFoundError:
        return False


def put_file(c: Any, src: BinaryIO, total: int | None, remote: str, label: str,
             tot: Totals) -> None:
    tmp = _tmp_name(remote, posixpath.join, posixpath.split)
    try:
        with naming(remote), c.open(tmp, "wb") as dst:
            _copy(src, dst, total, label, tot)
        with naming(remote):
            c.rename(tmp, remote)
    except BaseException:
        try:
            c.remove(tmp)
        except OSError:
            pass  # never created, or the cluster is gone: nothing more to do here
        raise


def _put_tree(c: Any, local: str, remote: str, tot: Totals) -> None:
    with naming(remote):
        c.makedirs(remote, exist_ok=True)
    for entry in sorted(os.scandir(local), key=lambda e: e.name):
        dest = posixpath.join(remote, entry.name)
        if entry.is_dir(follow_symlinks=False):
            _put_tree(c, entry.path, dest, tot)
        elif entry.is_file():
            with open(entry.path, "rb", buffering=0) as src:
                put_file(c, src, os.fstat(src.fileno()).st_size, dest, entry.path, tot)


def cmd_put(args: argparse.Namespace, c: Any) -> None:
    """Copy local files (or ``-``, stdin) into pfs."""
    sources: list[str] = args.sources
    remote: str = args.dest
    into_dir = remote.endswith("/") or _remote_isdir(c, remote)
    if len(sources) > 1 and not into_dir:
        raise OSError(errno.ENOTDIR, "Not a directory (several sources)", remote)
    tot = Totals()
    for local in sources:
        if local == "-":
            if into_dir:
                raise OSError(errno.EISDIR, "Is a directory (stdin needs a file name)", remote)
            put_file(c, sys.stdin.buffer, None, remote, "stdin", tot)
            continue
        dest = posixpath.join(remote, os.path.basename(local.rstrip("/"))) if into_dir else remote
        if os.path.isdir(local):
            if not args.recursive:
                raise OSError(errno.EISDIR, "Is a directory (use -r)", local)
            _put_tree(c, local, dest, tot)
            continue
        with open(local, "rb", buffering=0) as src:
            put_file(c, src, os.fstat(src.fileno()).st_size, dest.rstrip("/") or "/", local, tot)
    tot.report("put", args.verbose)


# -- get -------------------------------------------------------------------------------
def get_file(c: Any, remote: str, local: str, tot: Totals) -> None:
    with naming(remote), c.open(remote, "rb") as src:
        if local == "-":
            _copy(src, sys.stdout.buffer, src.size, remote, tot)
            sys.stdout.buffer.flush()
            return
        tmp = _tmp_name(local, os.path.join, os.path.split)
        try:
            with open(tmp, "wb", buffering=0) as dst:
                _copy(src, dst, src.size, remote, tot)
            os.replace(tmp, local)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(exc, OSError) and exc.filename == tmp:  # name the file asked for
                raise type(exc)(exc.errno, exc.strerror, local) from None
            raise


def _get_tree(c: Any, remote: str, local: str, tot: Totals) -> None:
    os.makedirs(local, exist_ok=True)
    with naming(remote):
        entries = sorted(c.scandir(remote), key=lambda e: e.name)
    for e in entries:
        dest = os.path.join(local, e.name)
        if e.is_dir():
            _get_tree(c, posixpath.join(remote, e.name), dest, tot)
        elif e.is_file():
            get_file(c, posixpath.join(remote, e.name), dest, tot)


def cmd_get(args: argparse.Namespace, c: Any) -> None:
    """Copy pfs files (trees with ``-r``) to local disk, or to stdout (``-``)."""
    sources: list[str] = args.sources
    local: str = args.dest
    into_dir = local != "-" and (local.endswith("/") or os.path.isdir(local))
    if len(sources) > 1 and local != "-" and not into_dir:
        raise OSError(errno.ENOTDIR, "Not a directory (several sources)", local)
    tot = Totals()
    for remote in sources:
        with naming(remote):
            isdir = c.stat(remote).is_dir()
        name = posixpath.basename(remote.rstrip("/")) or "root"
        dest = os.path.join(local, name) if into_dir else local
        if isdir:
            if not args.recursive or local == "-":
                raise OSError(errno.EISDIR, "Is a directory" + (
                    "" if local == "-" else " (use -r)"), remote)
            _get_tree(c, remote, dest, tot)
        else:
            get_file(c, remote, dest, tot)
    tot.report("get", args.verbose)
