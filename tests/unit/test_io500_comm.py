"""The local ranks' barrier of ``pfs bench io500`` (pfs/bench/io500_comm.py)."""

from __future__ import annotations

import multiprocessing as mp
import threading

from pfs.bench.io500_comm import SpinBarrier


def test_spin_barrier_orders_rounds_and_aborts() -> None:
    """pfs bench io500's barrier between local ranks (polling, as MPI's): no rank starts
    a round before every rank ended the one before; abort() frees a waiting rank with
    BrokenBarrierError."""
    ctx = mp.get_context("spawn")
    b = SpinBarrier(ctx, 3)
    seen: list[int] = []

    def rank() -> None:
        for k in range(20):
            seen.append(k)
            b.wait()

    ts = [threading.Thread(target=rank) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert seen == sorted(seen) and len(seen) == 60
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            b.wait()
        except threading.BrokenBarrierError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    b.abort()
    t.join(timeout=10)
    assert not t.is_alive() and len(errors) == 1 and b.broken
