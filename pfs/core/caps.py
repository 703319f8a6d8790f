"""Capabilities: what the metaserver signs so a data server can check a data request.

A capability is ``body || signature``: ``body`` is a msgpack array
``[1, ino, stripes, rights, expiry, gen, sid]`` and ``signature`` is the 64-byte
Ed25519 signature of ``body`` by the metaserver's private key.

- ``ino``: the inode; ``0`` (admin and scan capabilities only) means every inode.
- ``stripes``: list of stripe indexes the holder may touch, or nil for all of the inode's.
- ``rights``: bits READ (1), WRITE (2), ADMIN (4: truncate and delete objects; only the
  metaserver asks for these, and fences the inode while doing so), SCAN (8: list a data
  server's objects; the metaserver issues it to root for ``pfs fsck``, with READ and
  ``ino`` 0, so the checker can read and verify every object and change none).
- ``expiry``: unix seconds (metaserver clock) after which the capability is refused.
- ``gen``: the generation at issue. A data server keeps a *fence* per inode (raised by the
  metaserver's truncate and delete) and a *floor* (the generation at its registration);
  a capability with ``gen`` below either is stale for writing (``ESTALE``), so a holder
  cannot write past a truncation or resurrect a deleted object; it asks for a new one.
- ``sid``: the data server the capability is for, or ``""`` for any.

The metaserver's private key lives in its db directory (``capability.key``, mode 0600);
data servers only ever hold the public key, so no data server can mint access.
Verification costs one Ed25519 check per distinct capability per connection: the
verified capability is cached by its bytes (:class:`CapCache`).
"""
from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

READ = 1
WRITE = 2
ADMIN = 4
SCAN = 8
SIG_LEN = 64
MAX_CAP = 16 << 10  # bytes; a capability naming many stripes stays well below
KEY_FILE = "capability.key"
CACHE_MAX = 4096  # verified capabilities kept per connection


def _eacces(why: str) -> OSError:
    return OSError(errno.EACCES, f"capability refused: {why}")


@dataclass(frozen=True, slots=True)
class Capability:
    ino: int
    stripes: frozenset[int] | None
    rights: int
    expiry: float
    gen: int
    sid: str

    def covers(self, ino: int, stripe: int) -> bool:
        return (self.ino == ino or (self.ino == 0 and self.rights & (ADMIN | SCAN) != 0)) and (
            self.stripes is None or stripe in self.stripes)


class CapSigner:
    """The metaserver's side: issues capabilities; keeps generations increasing."""

    def __init__(self, key: Ed25519PrivateKey, ttl: float = 300.0) -> None:
        self._key = key
        self.ttl = ttl
        self._last_gen = 0
        self._lock = threading.Lock()
        self.public_bytes = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls, ttl: float = 300.0) -> CapSigner:
        return cls(Ed25519PrivateKey.generate(), ttl)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str], ttl: float = 300.0) -> CapSigner:
        """The private key in ``path`` (raw 32 bytes, mode 0600), created if absent."""
        from pfs.core.auth import read_secret_file

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

    def issue(self, ino: int, rights: int, *, stripes: list[int] | None = None,
              ttl: float | None = None, sid: str = "") -> tuple[bytes, float]:
        """A signed capability and its lifetime in seconds."""
        life = self.ttl if ttl is None else ttl
        body = msgpack.packb([1, ino, stripes, rights, int(time.time() + life) + 1,
                              self.next_gen(), sid], use_bin_type=True)
        return body + self._key.sign(body), life


class CapVerifier:
    """The data server's side: parses and verifies; raises EACCES on anything wrong."""

    def __init__(self, public_bytes: bytes) -> None:
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
        if (not isinstance(v, list) or len(v) != 7 or v[0] != 1
                or not all(type(x) is int for x in (v[1], v[3], v[4], v[5]))
                or not isinstance(v[6], str)
                or not (v[2] is None or (isinstance(v[2], list)
                                         and all(type(s) is int for s in v[2])))):
            raise _eacces("malformed body")
        stripes = None if v[2] is None else frozenset(v[2])
        return Capability(v[1], stripes, v[3], float(v[4]), v[5], v[6])


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
