"""Durable file-system steps the servers share."""
from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync directory ``path``: the entries made or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
