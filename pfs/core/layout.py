"""Striping math: RAID-0 over data servers, as Lustre lays files out.

Byte ``o`` of a file lives in stripe ``(o // unit) % count`` at object offset
``(o // (unit * count)) * unit + o % unit``. ``pieces`` splits a file range into
per-stripe pieces; ``stripe_extents`` merges one stripe's pieces of a range into a
single contiguous object range (the pieces of one stripe are contiguous in the object).
"""
from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MIN_UNIT = 4096
MAX_UNIT = 1 << 30
MAX_COUNT = 256
MAX_REPLICAS = 8


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of bytes of one stripe: file offset ``file_off`` maps to ``obj_off``."""

    stripe: int
    obj_off: int
    file_off: int
    length: int


@dataclass(frozen=True, slots=True)
class Layout:
    unit: int
    count: int
    replicas: int = 1
    # each stripe's replicas, head first: the chain's members serving now (placed
    # before chains: the servers chosen at placement, an implicit chain of version 0)
    servers: tuple[tuple[str, ...], ...] = field(default=())
    # close() syncs the data written to stable storage before the size is committed;
    # False (scratch data, ``pfs setstripe --no-sync``): only fsync() does
    durable: bool = True
    # each stripe's chain id and that chain's version when this layout was read (empty:
    # a layout from before chains; docs/architecture.md "Replication")
    chains: tuple[int, ...] = field(default=())
    versions: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check_geometry(self.unit, self.count, self.replicas)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Layout:
        # a record without "durable" (older metaservers) is durable
        return cls(int(d["unit"]), int(d["count"]), int(d.get("replicas", 1)),
                   tuple(tuple(s) for s in d.get("servers", ())),
                   d.get("durable", True) is not False,
                   tuple(int(c) for c in d.get("chains", ())),
                   tuple(int(v) for v in d.get("versions", ())))

    def to_wire(self) -> dict[str, Any]:
        out = {"unit": self.unit, "count": self.count, "replicas": self.replicas,
               "servers": [list(s) for s in self.servers]}
        if self.chains:
            out["chains"] = list(self.chains)
            out["versions"] = list(self.versions)
        if not self.durable:
            out["durable"] = False
        return out

    def chain_of(self, stripe: int) -> tuple[int, int]:
        """(chain id, version) of ``stripe``; (0, 0): an implicit chain (a layout from
        before chains, its servers in the order placed)."""
        if stripe < len(self.chains):
            return self.chains[stripe], (self.versions[stripe]
                                         if stripe < len(self.versions) else 0)
        return 0, 0

    def locate(self, off: int) -> tuple[int, int]:
        """(stripe index, object offset) of file byte ``off``."""
        return locate(self.unit, self.count, off)

    def pieces(self, off: int, length: int) -> Iterator[Piece]:
        return pieces(self.unit, self.count, off, length)

    def object_size(self, stripe: int, file_size: int) -> int:
        return object_size(self.unit, self.count, stripe, file_size)


def check_geometry(unit: int, count: int, replicas: int = 1) -> None:
    if unit < MIN_UNIT or unit > MAX_UNIT or unit % MIN_UNIT:
        raise OSError(errno.EINVAL,
                      f"stripe unit {unit} must be a multiple of {MIN_UNIT} up to {MAX_UNIT}")
    if not 1 <= count <= MAX_COUNT:
        raise OSError(errno.EINVAL, f"stripe count {count} must be between 1 and {MAX_COUNT}")
    if not 1 <= replicas <= MAX_REPLICAS:
        raise OSError(errno.EINVAL, f"replicas {replicas} must be between 1 and {MAX_REPLICAS}")


def locate(unit: int, count: int, off: int) -> tuple[int, int]:
    block, within = divmod(off, unit)
    row, stripe = divmod(block, count)
    return stripe, row * unit + within


def pieces(unit: int, count: int, off: int, length: int) -> Iterator[Piece]:
    """Split ``[off, off+length)`` into pieces, each inside one stripe unit."""
    end = off + length
    while off < end:
        stripe, obj_off = locate(unit, count, off)
        n = min(unit - off % unit, end - off)
        yield Piece(stripe, obj_off, off, n)
        off += n


def object_size(unit: int, count: int, stripe: int, file_size: int) -> int:
    """How many bytes stripe ``stripe``'s object holds for a file of ``file_size``."""
    full_rows, rest = divmod(file_size, unit * count)
    size = full_rows * unit
    start = stripe * unit
    if rest > start:
        size += min(unit, rest - start)
    return size


@dataclass(frozen=True, slots=True)
class Extent:
    """One stripe's share of a file range: a contiguous object range and the file
    pieces it scatters to, in object order."""

    stripe: int
    obj_off: int
    length: int
    pieces: tuple[Piece, ...]


def stripe_extents(unit: int, count: int, off: int, length: int) -> list[Extent]:
    """Group a range's pieces by stripe; each group is contiguous in its object."""
    by_stripe: dict[int, list[Piece]] = {}
    for p in pieces(unit, count, off, length):
        by_stripe.setdefault(p.stripe, []).append(p)
    out = []
    for stripe, ps in sorted(by_stripe.items()):
        start = ps[0].obj_off
        out.append(Extent(stripe, start, ps[-1].obj_off + ps[-1].length - start, tuple(ps)))
    return out
