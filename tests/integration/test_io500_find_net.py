"""The hand-over of find's work between ``pfs bench io500``'s local ranks
(pfs/bench/io500_find.py LocalNet), between real processes: as pfind's MPI_Send over
Open MPI's shared memory, the giver waits for the asker by polling, on the CPU, never
asleep in the kernel (where, on a loaded node, it would wait to be scheduled again)."""

from __future__ import annotations

import multiprocessing as mp
import resource
from typing import Any

from pfs.bench.io500_find import Item, LocalNet

N_ITEMS = 600  # 2.4 MiB of pfind's work_t: over a mailbox, and over a pipe's 64 KiB


def items() -> list[Item]:
    return [
        ("f", f"/r/mdtest-hard/test-dir.0-0/mdtest_tree.0/file.mdtest.1.{i}01", None)
        for i in range(N_ITEMS)
    ]


def give(net: LocalNet, out: Any) -> None:
    g = net.at(0)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    g.respond(1, items())
    out.put(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before)


def test_the_giver_polls_until_the_asker_took_the_work_and_never_sleeps() -> None:
    ctx = mp.get_context("spawn")
    net = LocalNet.make(ctx, 2)
    thief = net.at(1)
    out = ctx.Queue()
    p = ctx.Process(target=give, args=(net, out))
    p.start()
    try:
        got = None
        while got is None:
            got = thief.answer()
        assert got == items()
        assert out.get(timeout=30) == 0  # voluntary context switches while giving
    finally:
        net.stop()
        p.join(10)
    assert p.exitcode == 0
