"""pfs/loader/arrivals.py: a tensor is handed out once, exactly when its last byte lands."""
from __future__ import annotations

import random
import threading

from pfs.loader.arrivals import Arrivals


def test_each_tensor_once_when_its_last_byte_lands() -> None:
    # two files; tensors with gaps between them (merged regions read the gaps too)
    tensors = [("a", 8, 100, "a0"), ("a", 100, 1000, "a1"), ("a", 1200, 1300, "a2"),
               ("b", 0, 4096, "b0"), ("b", 5000, 5001, "b1"), ("b", 7, 7, "empty")]
    handed: list[str] = []
    arr = Arrivals(tensors, handed.append)
    arr.landed("a", 0, 50)  # a piece from before a0 into it
    assert handed == []
    arr.landed("a", 50, 60)  # a0 ends inside this piece, a1 starts
    assert handed == ["a0"]
    arr.landed("a", 110, 890)
    assert handed == ["a0", "a1"]
    arr.landed("c", 0, 10)  # a file with no tensors
    arr.landed("b", 0, 4096)
    assert handed == ["a0", "a1", "b0"]
    arr.rest()  # the rest once the reads are done, each once
    arr.rest()
    assert sorted(handed) == ["a0", "a1", "a2", "b0", "b1"]
    assert arr.handed == set(handed)


def test_pieces_in_any_order_from_many_threads() -> None:
    size, piece = 1 << 20, 4096
    tensors = [("f", o, o + 3 * piece + 17, o) for o in range(0, size - 4 * piece, 4 * piece)]
    pieces = [(o, min(piece, size - o)) for o in range(0, size, piece)]
    random.Random(3).shuffle(pieces)
    handed: list[int] = []
    arr = Arrivals(tensors, handed.append)

    def feed(part: list[tuple[int, int]]) -> None:
        for o, n in part:
            arr.landed("f", o, n)

    threads = [threading.Thread(target=feed, args=(pieces[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(handed) == [t[3] for t in tensors]  # every byte landed: all, once
