"""The pfs frame format, sans-IO: bytes in, frames out; frames in, bytes out.

A frame is a fixed 26-byte header, a msgpack map, then an optional raw payload::

    magic  "PF"   2 bytes
    version       u8   the connection's protocol version (pfs/core/versions.py)
    kind          u8   (1 request, 2 reply, 3 error)
    flags         u16  (reserved, 0)
    map_len       u32  length of the msgpack map
    request id    u64  chosen by the requester; a reply carries the request's id
    payload_len   u64  raw bytes after the map (never packed into msgpack)

Every length is checked against :class:`Limits` before anything is allocated. The
decoder hands out the header and map first (:class:`FrameHead`) and leaves the payload
to the caller, so a socket layer can receive it straight into its final buffer.

Versions: the header layout never changes. Until a connection's handshake has picked a
version (pfs/core/auth.py), its frames carry ``HANDSHAKE_VERSION`` and the decoder takes any
version this side supports; once picked (:meth:`FrameDecoder.pin`), every frame carries
that version and the decoder refuses any other. A connection without a handshake (open
mode) keeps ``HANDSHAKE_VERSION``.

Sealing: after a key handshake every frame also carries tags (and in encrypt mode its map
and payload are encrypted); :mod:`pfs.core.wire.seal` has the format. The decoder of a
sealed connection (:meth:`FrameDecoder.seal`) checks a frame's header and map before
handing out its head, and its payload once the caller received all of it
(:meth:`FrameDecoder.finish_payload`, or :meth:`FrameDecoder.take_sealed_payload_into`
when the whole of it is already buffered).
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from pfs.core.errors import LocalProtocolError, RemoteProtocolError
from pfs.core.versions import HANDSHAKE_VERSION, SUPPORTED, Range, fmt_range
from pfs.core.wire.seal import TAG, Opener

MAGIC = b"PF"
VERSION = HANDSHAKE_VERSION  # frames before (or without) a handshake
HEADER = struct.Struct("!2sBBHIQQ")
HEADER_SIZE = HEADER.size


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3


# a header's kind byte -> Kind (a dict lookup costs a tenth of ``Kind(n)``)
_KINDS = {int(k): k for k in Kind}
_tuple_new = tuple.__new__  # a FrameHead without its Python-level __new__ (every frame)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a peer may not exceed; checked before allocation."""

    max_map: int = 1 << 20  # bytes of msgpack per frame
    max_payload: int = 64 << 20  # raw bytes per frame
    max_map_fields: int = 64  # top-level keys
    max_container: int = 1 << 16  # entries in any nested list/map
    max_str: int = 1 << 16  # bytes in any string
    max_bin: int = 1 << 20  # bytes in any binary field


class FrameHead(NamedTuple):
    """A frame's header and map (immutable; a tuple: built on every frame, and a
    tuple costs a third of a frozen dataclass)."""

    kind: Kind
    rid: int
    fields: dict[str, Any]
    payload_len: int


_DEFAULT_LIMITS = Limits()


def packer() -> msgpack.Packer:
    """A map encoder to reuse (one per connection: ``packb`` builds one per call, which
    is half its cost); not to be shared between threads."""
    return msgpack.Packer(use_bin_type=True)


def pack_map(fields: dict[str, Any], pk: msgpack.Packer | None = None) -> bytes:
    try:
        if pk is not None:
            return pk.pack(fields)  # type: ignore[no-any-return]
        return msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode frame fields: {exc}") from exc


def encode_head(kind: Kind, rid: int, fields: dict[str, Any], payload_len: int = 0,
                limits: Limits | None = None, version: int = VERSION,
                pk: msgpack.Packer | None = None) -> bytes:
    """Header + map bytes; the payload (if any) is sent separately after them. ``pk``:
    the caller's reusable :func:`packer`."""
    lim = limits or _DEFAULT_LIMITS
    if pk is None:
        body = pack_map(fields)
    else:  # (pack_map's work inline: every frame)
        try:
            body = pk.pack(fields)
        except (TypeError, ValueError, OverflowError) as exc:
            raise LocalProtocolError(f"cannot encode frame fields: {exc}") from exc
    if len(body) > lim.max_map:
        raise LocalProtocolError(f"frame map of {len(body)} bytes exceeds limit {lim.max_map}")
    if payload_len < 0 or payload_len > lim.max_payload:
        raise LocalProtocolError(f"payload of {payload_len} bytes exceeds limit {lim.max_payload}")
    if not 0 <= rid < 1 << 64:
        raise LocalProtocolError(f"request id {rid} out of range")
    return HEADER.pack(MAGIC, version, kind, 0, len(body), rid, payload_len) + body


def encode_frame(kind: Kind, rid: int, fields: dict[str, Any], payload: bytes = b"",
                 limits: Limits | None = None, version: int = VERSION) -> bytes:
    """A whole frame in one buffer (small frames, tests)."""
    return encode_head(kind, rid, fields, len(payload), limits, version) + bytes(payload)


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, then call ``next_head`` until it returns None.

    After a head with ``payload_len > 0`` the caller must consume exactly that many
    payload bytes: first what is already buffered (``take_payload_into``), then the rest
    from its own source. ``pending_payload`` says how many are still owed.

    ``version`` is the version this connection's frames carry both ways: the handshake's
    until :meth:`pin` sets the negotiated one. Before that the decoder takes any version
    in ``supported`` (and the handshake's); after, only the pinned one.
    """

    def __init__(self, limits: Limits | None = None, supported: Range = SUPPORTED) -> None:
        self.limits = limits or Limits()
        self.supported = supported
        self.version = VERSION
        self.pinned = False
        self._buf = bytearray()
        self.pending_payload = 0
        self.opener: Opener | None = None  # a sealed connection's receiving side
        self.tag_due = False  # the current frame's payload tag is still to come

    def seal(self, opener: Opener) -> None:
        """From the next frame on, frames are sealed (the handshake's key schedule)."""
        self.opener = opener

    def pin(self, version: int) -> None:
        """From now on frames carry ``version``, and a frame with another is refused.
        (The handshake checked it against the range it announced.)"""
        if not 0 < version < 256:
            raise LocalProtocolError(f"protocol version {version} does not fit a frame header")
        self.version = version
        self.pinned = True

    def _check_version(self, version: int) -> None:
        if self.pinned:
            if version != self.version:
                raise RemoteProtocolError(f"frame of protocol version {version} on a connection "
                                          f"that negotiated version {self.version}")
        elif version != VERSION and not self.supported[0] <= version <= self.supported[1]:
            raise RemoteProtocolError(f"unsupported protocol version {version} (this side "
                                      f"speaks {fmt_range(self.supported)})")

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next_head(self) -> FrameHead | None:
        if self.pending_payload or self.tag_due:
            raise LocalProtocolError("previous frame's payload not consumed")
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            return None
        magic, version, kind, _flags, map_len, rid, payload_len = HEADER.unpack_from(buf)
        lim = self.limits
        kind_v = _KINDS.get(kind)
        if (kind_v is None or magic != MAGIC or version != self.version
                or map_len > lim.max_map or payload_len > lim.max_payload):
            try:  # the full check only off the common path (it raises, or takes the version)
                kind_v = self._check_header(magic, version, kind, map_len, payload_len)
            except RemoteProtocolError as exc:
                if self.opener is None:
                    raise
                # a sealed connection's header is authenticated, but checked only with its
                # map: a header that breaks the framing is one tampered with as well
                raise self.opener.fail(f"a frame header ({exc})") from exc
        end = HEADER_SIZE + map_len
        opener = self.opener
        if opener is not None:
            end += TAG
            if len(buf) < end:
                return None
            # (copies, not views: ``cryptography`` and ``msgpack`` take bytes faster)
            fields = self._unpack(opener.head(bytes(buf[:end]), HEADER_SIZE))
            self.tag_due = payload_len > 0
        else:
            if len(buf) < end:
                return None
            fields = self._unpack(bytes(buf[HEADER_SIZE:end]))
        del buf[:end]
        self.pending_payload = payload_len
        return _tuple_new(FrameHead, (kind_v, rid, fields, payload_len))  # type: ignore[no-any-return]

    def _check_header(self, magic: bytes, version: int, kind: int, map_len: int,
                      payload_len: int) -> Kind:
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad magic {bytes(magic)!r}: not a pfs peer")
        if version != self.version:
            self._check_version(version)
        kind_v = _KINDS.get(kind)
        if kind_v is None:
            raise RemoteProtocolError(f"unknown frame kind {kind}")
        lim = self.limits
        if map_len > lim.max_map:
            raise RemoteProtocolError(f"frame map of {map_len} bytes exceeds limit {lim.max_map}")
        if payload_len > lim.max_payload:
            raise RemoteProtocolError(
                f"frame payload of {payload_len} bytes exceeds limit {lim.max_payload}")
        return kind_v

    def _unpack(self, body: bytes) -> dict[str, Any]:
        lim = self.limits
        try:
            fields = msgpack.unpackb(
                body, raw=False, strict_map_key=True, use_list=True,
                max_str_len=lim.max_str, max_bin_len=lim.max_bin,
                max_array_len=lim.max_container, max_map_len=lim.max_container,
                max_ext_len=0)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
                TypeError, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(f"invalid msgpack in frame: {exc}") from exc
        if type(fields) is not dict:
            if not isinstance(fields, dict):
                raise RemoteProtocolError("frame body is not a map")
        if len(fields) > lim.max_map_fields:
            raise RemoteProtocolError(f"frame map has {len(fields)} fields, limit {lim.max_map_fields}")
        for k in fields:
            if type(k) is not str:
                raise RemoteProtocolError("frame map keys must be strings")
        return fields

    def take_payload_into(self, dest: memoryview) -> int:
        """Copy already-buffered payload bytes into ``dest``; returns how many."""
        n = min(len(dest), len(self._buf), self.pending_payload)
        if n:
            with memoryview(self._buf) as buffered:  # (a slice of it would be a copy)
                dest[:n] = buffered[:n]
            del self._buf[:n]
            self.pending_payload -= n
        return n

    def payload_received(self, n: int) -> None:
        """The caller received ``n`` payload bytes itself, bypassing the buffer."""
        if n > self.pending_payload:
            raise LocalProtocolError("more payload consumed than the frame declared")
        self.pending_payload -= n

    # -- sealed payloads ----------------------------------------------------------
    @property
    def tag_missing(self) -> int:
        """Bytes the caller must still feed before :meth:`finish_payload` (the payload's
        tag, once all of the payload was consumed)."""
        if not self.tag_due or self.pending_payload:
            return 0
        return max(0, TAG - len(self._buf))

    def finish_payload(self, views: list[memoryview]) -> None:
        """A sealed frame's payload was received whole into ``views``: check it (encrypt
        mode: decrypt it in place) against the tag that follows it in the buffer.
        ``FrameAuthError`` if it fails: the bytes in ``views`` are not the peer's."""
        assert self.opener is not None
        self.opener.check_payload(views, self.take_tag())

    def take_tag(self) -> bytes:
        """The current frame's payload tag, once the payload was consumed and the tag is
        buffered (a caller that checks the payload itself, piece by piece)."""
        if not self.tag_due or self.pending_payload or len(self._buf) < TAG:
            raise LocalProtocolError("sealed payload finished before it was all received")
        tag = bytes(self._buf[:TAG])
        del self._buf[:TAG]
        self.tag_due = False
        return tag

    def take_sealed_payload_into(self, dest: memoryview) -> bool:
        """When the whole (sealed) payload of the current frame and its tag are
        buffered and ``dest`` is its size: check (decrypt) it into ``dest`` in one step
        and return True (small replies, which arrive with their head); else False."""
        n = self.pending_payload
        if not self.tag_due or n != len(dest) or len(self._buf) < n + TAG:
            return False
        assert self.opener is not None
        self._open_buffered(self.opener, n, dest)
        del self._buf[:n + TAG]
        self.pending_payload = 0
        self.tag_due = False
        return True

    def _open_buffered(self, opener: Opener, n: int, dest: memoryview) -> None:
        # in a function of its own: the views of the buffer are gone when it returns,
        # so the buffer can be resized after
        with memoryview(self._buf) as view:
            opener.open_payload_into(view[:n + TAG], dest)


class Peer:
    """An in-memory protocol endpoint: whole frames in and out (tests, fuzzing); with
    ``opener``, of a sealed connection."""

    def __init__(self, limits: Limits | None = None, opener: Opener | None = None) -> None:
        self.decoder = FrameDecoder(limits)
        if opener is not None:
            self.decoder.seal(opener)
        self._head: FrameHead | None = None

    def receive(self, data: bytes) -> list[tuple[FrameHead, bytes]]:
        dec = self.decoder
        dec.feed(data)
        out: list[tuple[FrameHead, bytes]] = []
        while True:
            if self._head is None:
                self._head = dec.next_head()
                if self._head is None:
                    return out
            head = self._head
            n = head.payload_len
            if dec.buffered < n + (TAG if dec.tag_due else 0):
                return out
            payload = bytearray(n)
            if not dec.take_sealed_payload_into(memoryview(payload)):
                dec.take_payload_into(memoryview(payload))
            out.append((head, bytes(payload)))
            self._head = None
