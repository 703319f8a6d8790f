"""Which tensors of a load are complete, as the reads land (``on_tensor``).

The loader reads whole regions, and a pfs shard's bulk reads land chunk by chunk in
worker threads (``File.pread_many``'s ``done``), in no fixed order. :class:`Arrivals`
counts, per tensor, the bytes still missing; the call that brings a tensor's count to
zero hands it out. Nothing is handed out before every byte of it is in its buffer and
verified (a chunk is reported only then), and each tensor exactly once.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any


class Arrivals:
    """``ready(key)`` for each ``(file, begin, end, key)`` once the bytes
    ``[begin, end)`` of ``file`` have all been :meth:`landed`. The ranges of one file
    must not overlap; each landed byte must be new (the loader reads each once)."""

    def __init__(self, tensors: Sequence[tuple[Hashable, int, int, Any]],
                 ready: Callable[[Any], None]) -> None:
        self._ready = ready
        self._lock = threading.Lock()  # landed() comes from several worker threads
        self._calls = threading.Lock()  # ready() one at a time
        by_file: dict[Hashable, list[list[Any]]] = {}
        for f, begin, end, key in tensors:
            if end > begin:
                by_file.setdefault(f, []).append([begin, end, end - begin, key])
        self._files: dict[Hashable, tuple[list[int], list[list[Any]]]] = {}
        for f, ents in by_file.items():
            ents.sort(key=lambda e: e[0])
            self._files[f] = ([e[0] for e in ents], ents)
        self.handed: set[Any] = set()  # keys handed out so far

    def landed(self, f: Hashable, off: int, n: int) -> None:
        """Bytes ``[off, off+n)`` of ``f`` are in their buffer."""
        got = self._files.get(f)
        if got is None or n <= 0:
            return
        begins, ents = got
        end = off + n
        done: list[Any] = []
        with self._lock:
            i = max(0, bisect.bisect_right(begins, off) - 1)
            while i < len(ents) and ents[i][0] < end:
                e = ents[i]
                over = min(e[1], end) - max(e[0], off)
                if over > 0 and e[2] > 0:
                    e[2] -= over
                    if e[2] <= 0:
                        done.append(e[3])
                i += 1
        for key in done:
            self._hand(key)

    def rest(self) -> None:
        """Hand out every tensor not handed out yet (the reads are all done)."""
        for _begins, ents in self._files.values():
            for e in ents:
                with self._lock:
                    due = e[2] > 0
                    e[2] = 0
                if due:
                    self._hand(e[3])

    def _hand(self, key: Any) -> None:
        with self._calls:
            self.handed.add(key)
            self._ready(key)
