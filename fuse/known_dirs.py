"""Directories whose every name this mount knows, to answer "no such name" itself.

A create through the mount is a LOOKUP (the name is missing) and then a CREATE: two
metaserver calls. With negative entries on (``negative_timeout`` > 0), the kernel already
answers a missing name from its own cache for that long; this extends the same bound to
LOOKUPs the kernel sends anyway (an ``O_EXCL`` create always asks again) for names in a
directory this mount knows completely: one it made (``mkdir`` here: empty) or listed from
start to end here, as of the moment it asked. Within ``negative_timeout`` of that moment
a name not in the directory is answered missing without a call, and the kernel is told
to cache that answer only for what is left of the bound, so nothing stays missing here
longer than a negative entry the kernel cached at that moment would.

This mount's own changes keep the set right (a name it creates is there at once, one it
removes is gone); a change that says the set was wrong (``EEXIST`` for a name it held
missing, an unlink of a name that was not there) drops the directory. A wrong "missing"
can only delay a plain lookup: a create asks the metaserver, which refuses a name that
exists (``O_EXCL``) or opens it (docs/architecture.md, "Consistency").
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

MAX_DIRS = 1024  # directories known at once (then the oldest knowledge is dropped)
MAX_NAMES = 65536  # names in one known directory (a larger one is not kept)
_DOTS = (b".", b"..")


@dataclass
class _Dir:
    until: float  # monotonic deadline: the moment it was known complete + the bound
    names: set[bytes]


class KnownDirs:
    """Complete name sets of directories, each good for ``ttl`` seconds from when it was
    known complete; ``ttl`` 0 keeps nothing."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._dirs: dict[int, _Dir] = {}
        # bumped by every change this mount makes: a listing that saw one is not complete
        self.epoch = 0

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    def learn(self, ino: int, names: Iterable[bytes], since: float) -> None:
        """Directory ``ino`` held exactly ``names`` at monotonic time ``since``."""
        if not self.enabled:
            return
        until = since + self.ttl
        held = set(names)
        if until <= time.monotonic() or len(held) > MAX_NAMES:
            self._dirs.pop(ino, None)
            return
        if ino not in self._dirs and len(self._dirs) >= MAX_DIRS:
            del self._dirs[next(iter(self._dirs))]  # the first learned
        self._dirs[ino] = _Dir(until, held)

    def absent(self, ino: int, name: bytes) -> float | None:
        """Seconds for which ``name`` is known missing from ``ino``, or None."""
        d = self._dirs.get(ino)
        if d is None or name in _DOTS:
            return None
        left = d.until - time.monotonic()
        if left <= 0:
            del self._dirs[ino]
            return None
        return None if name in d.names else left

    def added(self, ino: int, name: bytes) -> None:
        """This mount made ``name`` in ``ino``."""
        self.epoch += 1
        d = self._dirs.get(ino)
        if d is not None:
            d.names.add(name)
            if len(d.names) > MAX_NAMES:
                del self._dirs[ino]

    def removed(self, ino: int, name: bytes) -> None:
        """This mount removed ``name`` from ``ino``."""
        self.epoch += 1
        d = self._dirs.get(ino)
        if d is not None:
            d.names.discard(name)

    def found(self, ino: int, name: bytes) -> None:
        """The metaserver found ``name`` in ``ino``: if it was held missing, the set is
        wrong (made elsewhere): drop it."""
        d = self._dirs.get(ino)
        if d is not None and name not in d.names and name not in _DOTS:
            del self._dirs[ino]

    def drop(self, *inodes: int) -> None:
        """A change of these directories here failed or may have happened: what is
        known of them may be wrong, forget it."""
        self.epoch += 1
        for ino in inodes:
            self._dirs.pop(ino, None)

    def forget(self, ino: int) -> None:
        """The kernel forgot the directory: it sends no LOOKUP in it before a new one."""
        self._dirs.pop(ino, None)
