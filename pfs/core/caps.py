"""Capabilities: what the metaserver signs so a data server can check a data request.

A capability is ``body || signature``: ``body`` is a msgpack array
``[2, ino, rights, expiry, gen, who, max_off, servers, placement]`` and ``signature`` is
the 64-byte Ed25519 signature of ``body`` by the metaserver's private key.

- ``ino``: the inode; ``0`` (admin and scan capabilities only) means every inode.
- ``rights``: bits READ (1), WRITE (2), ADMIN (4: truncate and delete objects; only the
  metaserver asks for these, and fences the inode while doing so), SCAN (8: list a data
  server's objects; the metaserver issues it to root for ``pfs fsck``, with READ and
  ``ino`` 0, so the checker can read and verify every object and change none).
- ``expiry``: unix seconds (metaserver clock) after which the capability is refused.
- ``gen``: the generation at issue. A data server keeps a *fence* per inode (raised by the
  metaserver's truncate and delete) and a *floor* (the generation at its registration);
  a capability with ``gen`` below either is stale for writing (``ESTALE``), so a holder
  cannot write past a truncation or resurrect a deleted object; it asks for a new one.
- ``who``: the authenticated identity (node key name, certificate common name) of the
  connection it was issued to; a data server refuses it on a connection of any other
  client identity, so a captured capability is useless to another key (a peer with the
  server role, a data server forwarding a write down a chain, may carry it on). ``""``:
  the metaserver's own (admin capabilities), accepted only from a peer with the server
  role.
- ``max_off``: the largest object offset a write (or a truncation) may reach: the
  layout's limit (``max_object_size``), so a capability cannot make a huge sparse object.
- ``servers`` and ``placement``: the objects it covers and who may hold them, taken from
  the file's layout (:func:`placement_of`). ``placement`` is a list of ``[stripe, i, j,
  ...]``: stripe ``stripe`` of ``ino`` may be held by ``servers[i]``, ``servers[j]``...;
  a data server refuses a stripe not listed, or one listed for other servers. ``nil``
  (admin and scan capabilities only): every stripe, on the listed ``servers`` (none
  listed: on any server).

Version 1 capabilities (``[1, ino, stripes, rights, expiry, gen, sid]``: no ``who``, no
placement, no limit) were bearer tokens. A data server refuses them, except while it is
registered with a metaserver older than this (its registration reply names no
``cap_format``), so a cluster is still upgraded one server at a time (data servers
first); once the metaserver is upgraded it signs only version 2, and version 1
capabilities are refused.

The metaserver's private key lives in its db directory (``capability.key``, mode 0600);
data servers only ever hold the public key, so no data server can mint access.
Verification costs one Ed25519 check per distinct capability per connection: the
verified capability is cached by its bytes (:class:`CapCache`); after that a check is
a dict lookup and a few comparisons (:meth:`Capability.check`).
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pfs.core.auth import Identity, read_secret_file

READ = 1
WRITE = 2
ADMIN = 4
SCAN = 8
VERSION = 2  # of the body; 1 (unbound) is refused
SIG_LEN = 64
MAX_CAP = 16 << 10  # bytes; a capability naming many stripes stays well below
KEY_FILE = "capability.key"
CACHE_MAX = 4096  # verified capabilities kept per connection
TAILS_KEPT = 4096  # encoded capability tails a signer keeps (CapSigner.issue_file)
# the default largest object (MetaConfig.max_object_size): a file of ``count`` stripes
# grows to ``count`` times this; a write capability reaches no further
MAX_OBJECT_SIZE = 1 << 40
UNBOUNDED = (1 << 63) - 1  # max_off of the metaserver's own (admin) capabilities


def _eacces(why: str) -> OSError:
    return OSError(errno.EACCES, f"capability refused: {why}")


def stripes_of(layout: Mapping[str, Any] | None) -> tuple[tuple[str, ...], ...]:
    """The servers that may hold each stripe of a file's layout, by stripe
    (``layout["servers"][stripe]``, its replicas). The one place that reads a layout for
    a capability; hashable, so a signer keeps the encoding of each it has seen."""
    return tuple(map(tuple, (layout or {}).get("servers") or ()))


def placement_of(layout: Mapping[str, Any] | None) -> dict[int, tuple[str, ...]]:
    """:func:`stripes_of` as a mapping: stripe -> server ids."""
    return dict(enumerate(stripes_of(layout)))


@dataclass(frozen=True, slots=True)
class Capability:
    ino: int
    rights: int
    expiry: float
    gen: int
    who: str | None  # identity it was issued to; "": the metaserver's own; None: v1
    max_off: int  # a write or truncation may reach this object offset, no further
    servers: frozenset[str]  # with ``placement`` None: the servers it is for (none: any)
    placement: dict[int, frozenset[str]] | None  # stripe -> servers that may hold it

    @property
    def stripes(self) -> frozenset[int] | None:
        return None if self.placement is None else frozenset(self.placement)

    def covers(self, ino: int, stripe: int) -> bool:
        """Whether object ``[ino, stripe]`` is one this capability names."""
        return (self.ino == ino or (self.ino == 0 and self.rights & (ADMIN | SCAN) != 0)) and (
            self.placement is None or stripe in self.placement)

    def check(self, what: str, need: int, obj: tuple[int, int], sid: str | None,
              ident: Identity | None, end: int = 0) -> None:
        """Refuse (EACCES naming what is wrong; EFBIG past ``max_off``) unless this
        capability allows ``what`` (needing one of the ``need`` rights) on ``obj``
        held by server ``sid``, presented by ``ident``, reaching object offset ``end``."""
        if not self.rights & need:
            raise _eacces(f"it does not allow {what}")
        ino, stripe = obj
        if not (self.ino == ino or (self.ino == 0 and self.rights & (ADMIN | SCAN))):
            raise _eacces(f"not for object {list(obj)} (it is for inode {self.ino})")
        if self.placement is None:
            if self.servers and sid not in self.servers:
                raise _eacces(f"meant for another data server, not {sid}")
        else:
            holders = self.placement.get(stripe)
            if holders is None:
                raise _eacces(f"not for object {list(obj)}: stripe {stripe} is outside "
                              f"the file's layout")
            if sid not in holders:
                raise _eacces(f"object {list(obj)} is not placed on data server {sid} by "
                              f"the file's layout")
        if self.who is None:  # version 1, accepted from an older metaserver only
            pass
        elif self.who:
            # a peer with the server role (the cluster key: a data server forwarding a
            # write along a replication chain) may carry it on; it could authenticate as
            # the client anyway (it holds the data-plane keys), and the placement binds it
            if ident is None or (ident.name != self.who and not ident.may_serve):
                raise _eacces(f"issued to {self.who!r}, presented on a connection of "
                              f"{'nobody' if ident is None else repr(ident.name)}")
        elif ident is None or not ident.may_serve:
            raise _eacces("the metaserver's own capability, presented by a client")
        if self.expiry < time.time():
            raise _eacces("expired")
        if end > self.max_off:
            raise OSError(errno.EFBIG, f"capability refused: {what} to object offset {end} "
                                       f"is beyond the file's limit ({self.max_off} bytes "
                                       f"per object)")


class CapSigner:
    """The metaserver's side: issues capabilities; keeps generations increasing."""

    def __init__(self, key: Ed25519PrivateKey, ttl: float = 300.0) -> None:
        self._key = key
        self.ttl = ttl
        self._last_gen = 0
        self._lock = threading.Lock()
        self._tails: dict[tuple[str, int, tuple[tuple[str, ...], ...]], bytes] = {}
        self.public_bytes = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls, ttl: float = 300.0) -> CapSigner:
        return cls(Ed25519PrivateKey.generate(), ttl)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str], ttl: float = 300.0) -> CapSigner:
        """The private key in ``path`` (raw 32 bytes, mode 0600), created if absent."""
        p = Path(path)
        if not p.exists():
            key = Ed25519PrivateKey.generate()
            raw = key.private_bytes(serialization.Encoding.Raw,
                                    serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, raw)
                os.fsync(fd)
            finally:
                os.close(fd)
            return cls(key, ttl)
        return cls(Ed25519PrivateKey.from_private_bytes(read_secret_file(p, 32)), ttl)

    def next_gen(self) -> int:
        """A generation above every one handed out before (nanoseconds of the clock,
        so it also grows across restarts)."""
        with self._lock:
            self._last_gen = max(time.time_ns(), self._last_gen + 1)
            return self._last_gen

    def issue(self, ino: int, rights: int, *, who: str = "",
              placement: Mapping[int, Sequence[str]] | None = None,
              servers: Sequence[str] = (), max_off: int = UNBOUNDED,
              ttl: float | None = None, sid: str = "") -> tuple[bytes, float]:
        """A signed capability and its lifetime in seconds: for ``who``'s connections,
        the objects of ``placement`` (stripe -> the servers that may hold it, from
        :func:`placement_of`) or, without one, every stripe on ``servers`` (or ``sid``;
        none named: any server)."""
        if placement is None:
            names = list(dict.fromkeys([*servers, *([sid] if sid else [])]))
            wire: list[list[int]] | None = None
        else:
            names, wire = _placement_wire(sorted(placement.items()))
        return self._sign(ino, rights, _tail(who, max_off, names, wire), ttl)

    def issue_file(self, ino: int, rights: int, who: str,
                   stripes: tuple[tuple[str, ...], ...], max_off: int) -> tuple[bytes, float]:
        """:meth:`issue` for a file's capability: the objects of ``stripes`` (from
        :func:`stripes_of`). The same bytes; the encoding of everything but the inode,
        rights, expiry and generation is kept per (``who``, ``max_off``, ``stripes``):
        every open and create signs one, and the layouts of a cluster's files repeat."""
        key = (who, max_off, stripes)
        tail = self._tails.get(key)
        if tail is None:
            tail = _tail(who, max_off, *_placement_wire(enumerate(stripes)))
            if len(self._tails) >= TAILS_KEPT:
                self._tails.clear()
            self._tails[key] = tail
        return self._sign(ino, rights, tail, None)

    def _sign(self, ino: int, rights: int, tail: bytes, ttl: float | None
              ) -> tuple[bytes, float]:
        life = self.ttl if ttl is None else ttl
        # the body ``[VERSION, ino, rights, expiry, gen, *tail]``: a 9-element array is
        # its one-byte header and the elements' encodings, one after another
        head = msgpack.packb([VERSION, ino, rights, int(time.time() + life) + 1,
                              self.next_gen()])
        body = b"\x99" + head[1:] + tail
        return body + self._key.sign(body), life


def _placement_wire(placement: Iterable[tuple[int, Sequence[str]]]
                    ) -> tuple[list[str], list[list[int]]]:
    """A capability's ``servers`` and ``placement`` fields: each server named once,
    each stripe as ``[stripe, index of each of its servers...]``."""
    index: dict[str, int] = {}
    wire = []
    for stripe, sids in placement:
        wire.append([stripe, *(index.setdefault(s, len(index)) for s in sids)])
    return list(index), wire


def _tail(who: str, max_off: int, names: list[str], wire: list[list[int]] | None) -> bytes:
    """The encodings of a body's last four elements, one after another."""
    return msgpack.packb([who, max_off, names, wire], use_bin_type=True)[1:]


def _parse_v1(v: list[Any]) -> Capability:
    """A version 1 body (an older metaserver's): bound to nothing but its inode,
    stripes and server."""
    if (len(v) != 7 or not all(type(x) is int for x in (v[1], v[3], v[4], v[5]))
            or not isinstance(v[6], str)
            or not (v[2] is None or (isinstance(v[2], list)
                                     and all(type(s) is int for s in v[2])))):
        raise _eacces("malformed body")
    servers = frozenset([v[6]]) if v[6] else frozenset()
    placement = None if v[2] is None else {s: servers for s in v[2]}
    if placement is not None and not servers:
        raise _eacces("a version 1 capability naming stripes but no server")
    return Capability(v[1], v[3], float(v[4]), v[5], None, UNBOUNDED, servers, placement)


def _parse(v: Any, legacy: bool = False) -> Capability:
    """The fields of a verified body; EACCES if they are not a capability's."""
    if not isinstance(v, list) or not v or v[0] != VERSION:
        if isinstance(v, list) and v and v[0] == 1:
            if legacy:
                return _parse_v1(v)
            raise _eacces("an unbound (version 1) capability from an older metaserver")
        raise _eacces("malformed body")
    if (len(v) != 9 or not all(type(x) is int for x in (v[1], v[2], v[3], v[4], v[6]))
            or not isinstance(v[5], str) or not isinstance(v[7], list)
            or not all(isinstance(s, str) for s in v[7])):
        raise _eacces("malformed body")
    names = v[7]
    placement: dict[int, frozenset[str]] | None = None
    if v[8] is not None:
        if not isinstance(v[8], list):
            raise _eacces("malformed placement")
        placement = {}
        for entry in v[8]:
            if (not isinstance(entry, list) or not entry
                    or not all(type(x) is int for x in entry) or entry[0] < 0
                    or not all(0 <= i < len(names) for i in entry[1:])):
                raise _eacces("malformed placement")
            placement[entry[0]] = frozenset(names[i] for i in entry[1:])
    return Capability(v[1], v[2], float(v[3]), v[4], v[5], v[6],
                      frozenset(names) if placement is None else frozenset(), placement)


class CapVerifier:
    """The data server's side: parses and verifies; raises EACCES on anything wrong."""

    def __init__(self, public_bytes: bytes, legacy: bool = False) -> None:
        self.legacy = legacy  # accept version 1 (registered with an older metaserver)
        try:
            self._pub = Ed25519PublicKey.from_public_bytes(public_bytes)
        except ValueError as exc:
            raise OSError(errno.EINVAL, f"bad capability public key: {exc}") from None
        self.public_bytes = bytes(public_bytes)

    def verify(self, raw: Any) -> Capability:
        if not isinstance(raw, bytes):
            raise _eacces("missing" if raw is None else "not bytes")
        if not SIG_LEN < len(raw) <= MAX_CAP:
            raise _eacces(f"{len(raw)} bytes long")
        body, sig = raw[:-SIG_LEN], raw[-SIG_LEN:]
        try:
            self._pub.verify(sig, body)
        except InvalidSignature:
            raise _eacces("bad signature (forged or tampered)") from None
        try:
            v = msgpack.unpackb(body, raw=False, max_array_len=1 << 12, max_str_len=256,
                                max_bin_len=0, max_map_len=0, max_ext_len=0)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
                TypeError) as exc:  # signed but unreadable: a newer or broken signer
            raise _eacces(f"unreadable body: {exc}") from None
        return _parse(v, self.legacy)


class CapCache:
    """Verified capabilities of one connection, by their bytes."""

    __slots__ = ("verifier", "_seen")

    def __init__(self, verifier: CapVerifier) -> None:
        self.verifier = verifier
        self._seen: dict[bytes, Capability] = {}

    def get(self, raw: Any) -> Capability:
        cap = self._seen.get(raw) if isinstance(raw, bytes) else None
        if cap is None:
            cap = self.verifier.verify(raw)
            if len(self._seen) >= CACHE_MAX:
                self._seen.clear()
            self._seen[raw] = cap
        return cap
