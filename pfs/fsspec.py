"""``pfs://`` for fsspec: pandas, pyarrow, Dask and Hugging Face-style loaders read and
write pfs through the native synchronous client (no FUSE mount needed).

    import fsspec
    fs = fsspec.filesystem("pfs", config="/etc/pfs/client.toml")   # or $PFS_CONFIG
    with fsspec.open("pfs:///models/m/config.json") as f: ...

Registered by the ``fsspec.specs`` entry point in pyproject.toml. Paths are absolute
pfs paths; ``pfs://path`` and ``pfs:///path`` both name ``/path``. Files are the native
client's binary files (``pfs.client.sync.File``), so reads and writes go straight to the
data servers; ``"xb"`` is an exclusive create. As on object stores (and as fsspec's
tests and pandas' partitioned writes expect), writing a file makes its missing parent
directories (``auto_mkdir=False``: ENOENT as POSIX says).
"""
from __future__ import annotations

import datetime
import errno
import posixpath
import stat as statmod
from typing import Any

from fsspec.spec import AbstractFileSystem

import pfs
from pfs.client.types import StatResult


def _entry(path: str, st: StatResult) -> dict[str, Any]:
    kind = ("directory" if statmod.S_ISDIR(st.st_mode) else
            "link" if statmod.S_ISLNK(st.st_mode) else
            "file" if statmod.S_ISREG(st.st_mode) else "other")
    return {"name": path, "size": st.st_size if kind != "directory" else 0, "type": kind,
            "mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "nlink": st.st_nlink,
            "ino": st.st_ino, "mtime": st.st_mtime_ns / 1e9, "created": st.st_ctime_ns / 1e9}


class PfsFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec's interface over :func:`pfs.connect` (``config``: a client.toml, default
    ``$PFS_CONFIG``; ``meta``: HOST:PORT)."""

    protocol = ("pfs",)
    root_marker = "/"
    sep = "/"

    def __init__(self, config: Any = None, meta: str | None = None, auto_mkdir: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.auto_mkdir = auto_mkdir
        self.client = pfs.connect(config=config, meta=meta)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]  # type: ignore[return-value]
        path = str(path)
        if path.startswith("pfs://"):
            path = path[len("pfs://"):]
        path = "/" + path.lstrip("/")
        return path.rstrip("/") or "/"

    def unstrip_protocol(self, name: str) -> str:
        return "pfs://" + self._strip_protocol(name)

    # -- reading the namespace ---------------------------------------------------------
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        return _entry(path, self.client.lstat(path))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        st = self.client.stat(path)
        if not statmod.S_ISDIR(st.st_mode):
            out = [_entry(path, st)]
        else:
            out = [_entry(posixpath.join(path, e.name), e.attr) if e.attr is not None
                   else self.info(posixpath.join(path, e.name))
                   for e in sorted(self.client.scandir(path), key=lambda e: e.name)]
        return out if detail else [e["name"] for e in out]

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.client.exists(self._strip_protocol(path)))

    # -- files ---------------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: Any = None,
              autocommit: bool = True, cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "b" not in mode:
            mode += "b"
        if mode.startswith(("w", "a", "x")) and self.auto_mkdir:
            self.makedirs(self._parent(path), exist_ok=True)
        return self.client.open(path, mode)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.isdir(src):
            self.makedirs(dst, exist_ok=True)
            return
        with self.client.open(src, "rb") as f, self._open(dst, "wb") as g:
            while chunk := f.read(8 << 20):
                g.write(chunk)

    # -- changing the namespace ------------------------------------------------------------
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if create_parents:
            self.client.makedirs(path, exist_ok=True)
        else:
            self.client.mkdir(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = self._strip_protocol(path)
        if path != "/" or not exist_ok:
            self.client.makedirs(path, exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        if statmod.S_ISDIR(self.client.lstat(path).st_mode):
            self.client.rmdir(path)
        else:
            self.client.remove(path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in sorted(paths, key=lambda p: p.count("/"), reverse=True):  # children first
            if not recursive and self.isdir(p):
                raise OSError(errno.EISDIR, "Is a directory (use recursive=True)", p)
            self.rm_file(p)

    def mv(self, path1: Any, path2: Any, recursive: bool = False,
           maxdepth: int | None = None, **kwargs: Any) -> None:
        if isinstance(path1, str) and isinstance(path2, str) and not self.isdir(path2):
            self.client.rename(self._strip_protocol(path1), self._strip_protocol(path2))
            return
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def modified(self, path: str) -> Any:
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], datetime.UTC)

    def created(self, path: str) -> Any:
        return datetime.datetime.fromtimestamp(self.info(path)["created"],
                                               datetime.UTC)
