"""Every version number of pfs in one place: the wire protocol and the two on-disk formats.

A cluster is upgraded one server at a time, so for a while old and new processes talk to
each other and a new binary opens a store an old one wrote. The rules:

- **Wire.** Each side supports a range of protocol versions; the handshake picks the
  highest version both support (:func:`negotiate`) and every later frame of that
  connection carries it in its header. A new release keeps the previous release's
  range (it raises ``PROTOCOL_MAX`` and keeps ``PROTOCOL_MIN``) so that servers can be
  upgraded one at a time; ``PROTOCOL_MIN`` rises only once no older peer is left.
- **Disk.** The metadata store and each data directory record the format they are in.
  A server opens only formats it knows (``*_FORMAT`` is the newest it writes); an older
  format that it knows is upgraded by ``pfs admin migrate``, never silently by a server
  start, unless the upgrade is a pure addition that older servers ignore (see
  :mod:`pfs.metaserver.store` and :mod:`pfs.dataserver.objects`).
"""
from __future__ import annotations

import errno
from collections.abc import Container

# -- the wire (pfs/core/wire/protocol.py, the handshake in pfs/core/auth.py) -----------------
# 1: the frame format of pfs/core/wire/protocol.py (26-byte header, msgpack map, raw payload)
#    and the RPCs of docs/rpc.md. Peers from before version negotiation speak only 1.
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
# The version byte of the handshake's own frames (the key handshake's auth request and
# reply, an error refusing a peer). The header layout and these messages never change,
# so any two pfs processes can read each other's handshake, whatever their ranges.
HANDSHAKE_VERSION = 1
# The range a peer from before version negotiation supports.
LEGACY_RANGE = (1, 1)

# -- the metadata store (metaserver/store.py; key ``C format`` in metaserver/keys.py) --
# 0: no ``C format`` key: stores made before formats were recorded (same layout as 1).
# 1: the key layout of metaserver/keys.py, with ``C format`` = 1.
METADATA_FORMAT = 1

# -- a data server's data directory (dataserver/objects.py; its ``FORMAT`` file) --------
# 0: no FORMAT file: directories made before formats were recorded (same layout as 1).
# 1: objects/<fanout>/<ino>.<stripe>, plain files; server.id; FORMAT holding "1".
# 2: format 1 plus a checksum sidecar <ino>.<stripe>.crc beside each object written since
#    (block CRC32Cs and block map, pfs/core/checksums.py). A server opens a format-1
#    directory and stamps it 2 (objects without a sidecar read unchecked until rewritten);
#    ``pfs admin migrate --data`` also computes a sidecar for every object without one.
OBJECT_FORMAT = 2

MIGRATE_DB = "pfs admin migrate --db"
MIGRATE_DATA = "pfs admin migrate --data"

Range = tuple[int, int]
SUPPORTED: Range = (PROTOCOL_MIN, PROTOCOL_MAX)


def package_version() -> str:
    """This installation's version (``pfs --version``; what a data server reports)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pfs")
    except PackageNotFoundError:
        return "unknown"


class FormatError(OSError):
    """A store in a format this binary cannot open (EPROTO: unknown or newer format)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EPROTO, msg)


def fmt_range(r: Range) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def negotiate(ours: Range, theirs: Range) -> int | None:
    """The highest version in both ranges, or None when they are disjoint."""
    hi = min(ours[1], theirs[1])
    return hi if hi >= max(ours[0], theirs[0]) else None


def alpn_names(r: Range) -> list[str]:
    """TLS ALPN protocol names for range ``r``, highest first (the server's order picks)."""
    return [f"pfs/{v}" for v in range(r[1], r[0] - 1, -1)]


def parse_alpn(name: str | None) -> int | None:
    """The version an ALPN name selects; None for no name (a peer from before
    negotiation, or no version in common) or a foreign one."""
    if name is None or not name.startswith("pfs/") or not name[4:].isdigit():
        return None
    return int(name[4:])


def no_common(ours: Range, theirs: Range | None, me: str, peer: str, note: str = "") -> str:
    """Why two peers cannot talk, naming both ranges (``theirs`` None: not known)."""
    them = "offered none of them" if theirs is None else f"speaks {fmt_range(theirs)}"
    return (f"no protocol version in common: this {me} speaks {fmt_range(ours)}, "
            f"the {peer} {them}{note}")


def parse_versions(value: object) -> Range | None:
    """A peer's announced range off the wire: ``[min, max]`` (or a bare int, as peers
    from before negotiation send ``"v": 1``); None if malformed."""
    if type(value) is int:
        return (value, value) if 0 < value < 256 else None
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(type(v) is int and 0 < v < 256 for v in value) and value[0] <= value[1]):
        return (value[0], value[1])
    return None


def format_refusal(what: str, path: str, found: int, newest: int, command: str) -> str:
    """The one-line refusal of a store format this pfs cannot open or upgrade."""
    if found > newest:
        return (f"{what} {path} is in format {found}, which this pfs (formats up to "
                f"{newest}) does not know: run the pfs that wrote it; `{command} {path}` "
                f"upgrades a store, never downgrades one")
    return (f"{what} {path} is in format {found}, which this pfs cannot upgrade to "
            f"{newest}: run `{command} {path}` of an older pfs release first")


def upgrade_steps(what: str, path: str, found: int, newest: int, steps: Container[int],
                  at_open: Container[int] | None, command: str) -> range:
    """The steps that bring a store from format ``found`` to ``newest`` (step ``f``
    goes from ``f`` to ``f + 1``; ``steps`` are those this pfs has). FormatError naming
    ``command`` when this pfs cannot, or, at a server start (``at_open``: the steps safe
    to take there, those that only add what older servers ignore), when a step is not."""
    todo = range(found, newest)
    if found > newest or any(f not in steps for f in todo):
        raise FormatError(format_refusal(what, path, found, newest, command))
    if at_open is not None and any(f not in at_open for f in todo):
        raise FormatError(f"{what} {path} is in format {found}, older than this pfs's "
                          f"{newest}: stop the server and run `{command} {path}`")
    return todo
