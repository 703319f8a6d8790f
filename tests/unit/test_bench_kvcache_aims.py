"""`pfs bench kvcache`'s aim lines: which backends are held to which reference."""

from __future__ import annotations

from typing import Any

from pfs.bench.kvcache import _aims


def _cell(backend: str, size: int, gbps: float, p50: float) -> dict[str, Any]:
    return {"backend": backend, "size": size, "procs": 4,
            "get": {"GBps": gbps, "p50_us": p50}}


def test_every_pfs_path_is_held_to_redis_and_the_node_tier_to_a_file_read() -> None:
    size = 256 << 10
    lines = _aims([_cell("node", size, 6.0, 30), _cell("local", size, 2.4, 60),
                   _cell("server", size, 0.9, 900), _cell("redis", size, 1.5, 700),
                   _cell("file", size, 8.0, 45)])
    assert "get GB/s pfs node / redis at 256 KiB, 4 proc: 4.00x (aim >= 2): met" in lines
    assert "get GB/s pfs local / redis at 256 KiB, 4 proc: 1.60x (aim >= 2): NOT met" in lines
    assert "get GB/s pfs server / redis at 256 KiB, 4 proc: 0.60x (aim >= 2): NOT met" in lines
    assert "get p50 node tier / local file at 256 KiB, 4 proc: 0.67x (aim <= 1.5): met" in lines


def test_small_blocks_carry_no_throughput_aim() -> None:
    lines = _aims([_cell("node", 16 << 10, 1.0, 8), _cell("redis", 16 << 10, 2.0, 300)])
    assert not any("redis" in line for line in lines)
